"""Faults on purpose, with real processes and real files: each test asserts what the user sees
(the message, the exit status) and what is on disk afterwards (nothing good lost).

The runs are the nano model on one CPU device sharing a compilation cache, a few seconds each.
A read-only directory cannot be made here when the tests run as root (root writes through
chmod), so an unwritable checkpoint dir is a path under a regular file, and a full disk is
RLIMIT_FSIZE in the child (SIGXFSZ ignored, so writes fail with EFBIG like ENOSPC would).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_eqx.checkpoint.digests import DIGEST_FILE
from olmo_eqx.data.token_files import write_token_file
from olmo_eqx.run.lock import LOCK_FILE, RunLock
from olmo_eqx.train.divergence import DivergenceGuard

from clihelp import PLOT, TINY, olmo_eqx, xla_flags

NANO_VOCAB = 4096


@pytest.fixture(scope="module")
def env() -> dict:
    return {"XLA_FLAGS": xla_flags(1)}  # the suite's compilation cache (conftest.py) is inherited


def run(run_dir: Path, *overrides: str, env: dict, limit_file_bytes: int = 0):
    """`python -m olmo_eqx` on TINY in `run_dir`; with `limit_file_bytes`, no file may grow past
    it (in the command's process only: forked from the warm server, 3-4 s less than a cold start)."""
    return olmo_eqx(*TINY, *overrides, f"hydra.run.dir={run_dir}", env=env, file_size_limit=limit_file_bytes)


def steps_in(checkpoints: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.exists() else []


def train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file's digest, .hydra/ included (a refused run puts back what Hydra rewrote there)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "olmo_eqx.log"
    }


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# ---------------------------------------------------------------------------------------------
# 1. Divergence


def test_divergence_stops_with_a_message_and_saves_nothing(tmp_path, env):
    # Step 1 is applied with lr ~1e29 (its loss is still finite); step 2's loss is NaN.
    result = run(tmp_path / "nan", "optim.lr=1e30", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "training diverged: loss nan and grad norm nan at step 2" in result.stderr
    assert "learning rate" in result.stderr and "bad data" in result.stderr
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["stage_completed"] is False and summary["diverged"]["step"] == 2
    assert steps_in(tmp_path / "nan" / "checkpoints") == []
    # A learning rate past float32's range makes step 1's update itself non-finite; with a save
    # due right after it, the state is checked before saving: never saved.
    result = run(tmp_path / "save", "optim.lr=1e40", "checkpoint.every=1", env=env)
    assert result.returncode == 2 and "non-finite values after step 1" in result.stderr, result.stderr
    assert steps_in(tmp_path / "save" / "checkpoints") == []


def test_divergence_guard_counts_consecutive_skips_and_early_nan():
    guard = DivergenceGuard(history=20, min_history=20, max_consecutive_skips=2)
    assert guard.observe(21, 3.0, 1.0, skipped=True) is None
    assert guard.observe(22, float("nan"), 1.0, skipped=True) is None  # skip-step handles it
    assert guard.observe(23, 3.0, 1.0, skipped=False) is None  # the count restarts
    for step in (24, 25):
        assert guard.observe(step, 9.0, 1.0, skipped=True) is None
    assert "3 consecutive steps skipped up to step 26" in guard.observe(26, 9.0, 1.0, skipped=True)
    early = DivergenceGuard(history=0, min_history=20, max_consecutive_skips=5)
    assert "before the skip-step rule" in early.observe(1, float("inf"), 1.0, skipped=True)
    disabled = DivergenceGuard(history=50, min_history=None, max_consecutive_skips=5)
    assert "skip-step rule disabled" in disabled.observe(51, 3.0, float("nan"), skipped=False)


def test_a_diverging_run_never_costs_the_last_good_checkpoint(tmp_path, env):
    """lr 1e30 from a healthy step 6: step 7's update leaves finite but ruined weights, every
    later step is skipped and saved (checkpoint.every=1); retention (keep_last=2) must still
    keep step 6, the stop names it, and a rerun at the normal rate resumes there."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    common = ["trainer.steps=20", "trainer.eval_every=0", "optim.skip_step_min_history=2"]
    assert run(run_dir, *common, "trainer.stop_at=6", env=env).returncode == 0
    bad = run(run_dir, *common, "optim.lr=1e30", "checkpoint.every=1", "checkpoint.accept_changes=[optim.lr]", env=env)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "training diverged: 6 consecutive steps skipped up to step 13" in bad.stderr
    assert f"the last good checkpoint is {checkpoints / '6'} (step 6); a rerun resumes from it" in bad.stderr
    assert steps_in(checkpoints) == [6]
    aside = sorted(int(p.name.split("-")[0]) for p in (checkpoints / "set_aside").iterdir())
    assert aside == [11, 12]  # the newest two saved during the streak: kept aside, not deleted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["diverged"]["last_good_step"] == 6
    again = run(run_dir, *common, "trainer.stop_at=8", env=env)
    assert again.returncode == 0 and f"Resuming from {checkpoints / '6'}" in again.stdout, again.stderr


def test_save_health_confirms_a_save_by_the_healthy_step_after_it():
    from olmo_eqx.checkpoint.retention import steps_to_delete
    from olmo_eqx.train.divergence import SaveHealth

    health = SaveHealth.resumed(30, {"last_good": 20})
    assert (health.last_good, health.unconfirmed) == (20, [30])
    health.observe(31, 3.0, 1.0, skipped=False)  # measured on step 30's weights: 30 is good
    health.saved(31)
    for step in (32, 33):
        health.observe(step, float("nan"), 1.0, skipped=True)
        health.saved(step)
    assert (health.last_good, health.unconfirmed) == (30, [31, 32, 33])
    assert health.saved_record() == {"last_good": 30}
    # Retention keeps the newest two and the protected good step.
    assert steps_to_delete([20, 30, 31, 32, 33], {20, 30, 31, 32, 33}, 2, protected={30}) == [20, 31]
    # A skipped spike leaves the weights as saved: the next healthy step confirms them all.
    health.observe(34, 3.1, 1.0, skipped=False)
    assert (health.last_good, health.unconfirmed) == (33, [])
    assert SaveHealth.resumed(7, None).last_good == 7  # saved before health was recorded


# ---------------------------------------------------------------------------------------------
# 2. Token ids out of range


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, env):
    rng = np.random.default_rng(0)
    files = [write_token_file(tmp_path / f"part{i}.npy", rng.integers(0, NANO_VOCAB, 64 * 24), NANO_VOCAB) for i in range(2)]
    # Same size, so the file still looks fine to every cheap check: one id past the vocabulary.
    tokens = np.fromfile(files[1], dtype=np.uint16)
    tokens[64 * 5 + 7] = NANO_VOCAB + 9
    tokens.tofile(files[1])
    result = run(tmp_path / "run", f"data.source={tmp_path}/part*.npy", "trainer.eval_every=0", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"token file {files[1]} holds token id {NANO_VOCAB + 9} at position {64 * 5 + 7}" in result.stderr
    assert "loss nan" not in (tmp_path / "run" / "train.log").read_text()  # stopped before training on it


# ---------------------------------------------------------------------------------------------
# 3 + 5. Damaged checkpoints fall back; a stale lock is taken over; retention keeps the good


def test_damaged_checkpoints_are_set_aside_and_the_run_falls_back(tmp_path, env):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    keep = ["checkpoint.every=2", "checkpoint.keep_last=5"]
    first = run(run_dir, *keep, "trainer.stop_at=10", env=env)
    assert first.returncode == 0, first.stderr
    assert steps_in(checkpoints) == [2, 4, 6, 8, 10]
    (checkpoints / "10" / "commit_success.txt").unlink()  # a save that never committed
    with open(largest_file(checkpoints / "8" / "model"), "r+b") as f:  # 4 KiB overwritten in place
        f.seek(1000)
        f.write(os.urandom(4096))
    weights = largest_file(checkpoints / "6" / "model")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # half the weights
    loader = checkpoints / "4" / "loader" / "metadata"
    loader.write_text(loader.read_text()[:20])  # truncated loader JSON
    # A lock left by a process that has died on this host.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid}))

    second = run(run_dir, *keep, env=env)
    assert second.returncode == 0, second.stderr
    out = second.stdout
    assert f"taking over the stale lock {run_dir / LOCK_FILE} of pid {dead.pid}" in second.stderr
    assert f"checkpoint {checkpoints / '8'} (step 8) is unusable: model/" in out and "contents changed" in out
    assert f"checkpoint {checkpoints / '6'} (step 6) is unusable: model/" in out and "truncated" in out
    assert "(step 4) is unusable: loader/metadata: truncated" in out
    assert out.count("falling back to step 2") == 3 and f"Resuming from {checkpoints / '2'}" in out
    # Nothing was deleted: the damaged steps, and the uncommitted 10 (moved before step 10 was
    # saved again, instead of Orbax's StepAlreadyExistsError), are kept aside.
    aside = sorted(p.name.split("-")[0] for p in (checkpoints / "set_aside").iterdir())
    assert aside == ["10", "4", "6", "8"]
    assert steps_in(checkpoints) == [4, 6, 8, 10, 12] and not (run_dir / LOCK_FILE).exists()
    assert all((checkpoints / str(s) / DIGEST_FILE).exists() for s in steps_in(checkpoints))
    # Resuming from step 2 recomputes steps 3..10 bit for bit.
    records = train_records(run_dir)
    before, after = records[:10], records[10:]
    assert [r["step"] for r in after] == list(range(3, 13))
    assert [r["loss"] for r in before[2:]] == [r["loss"] for r in after[:8]]


# ---------------------------------------------------------------------------------------------
# 4. A refused resume changes nothing in the run dir


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, env) -> Path:
    run_dir = tmp_path_factory.mktemp("finished")
    result = run(run_dir, "trainer.steps=6", "trainer.eval_every=0", env=env)
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_model=96", "different model"),
        ("data.seed=7", "seed"),
        ("data.global_batch_size=16", "batch"),
        ("data.sequence_length=32", "fingerprint"),
    ],
)
def test_refused_resume_leaves_the_run_dir_byte_for_byte(finished_run, env, override, message):
    before = tree_hashes(finished_run)
    assert {"config.json", "metrics.jsonl", "train.log", "summary.json", ".hydra/overrides.yaml"} <= set(before)
    result = run(finished_run, "trainer.steps=6", "trainer.eval_every=0", override, env=env)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert tree_hashes(finished_run) == before


# ---------------------------------------------------------------------------------------------
# 5. One writer per run dir


def test_a_second_process_on_a_run_dir_stops_at_once(tmp_path, env):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunLock(run_dir):  # this test process is the live holder
        result = run(run_dir, env=env)
    assert result.returncode == 2, result.stderr
    assert f"run dir {run_dir} is in use by pid {os.getpid()}" in result.stderr
    assert sorted(p.name for p in run_dir.iterdir() if p.name != ".hydra") == []  # no empty olmo_eqx.log


# ---------------------------------------------------------------------------------------------
# 6. Storage faults


def test_unwritable_checkpoint_dir_stops_before_compiling(tmp_path, env):
    (tmp_path / "a_file").write_text("not a directory")
    result = run(tmp_path / "run", f"checkpoint.dir={tmp_path}/a_file/ckpt", env=env)
    assert result.returncode == 2
    assert f"checkpoint dir {tmp_path}/a_file/ckpt is not writable: Not a directory" in result.stderr
    assert "parameters" not in result.stdout  # stopped before the loop started


def test_a_failed_save_stops_at_once_keeps_nothing_partial_and_a_rerun_resumes(tmp_path, env):
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert run(run_dir, "trainer.stop_at=6", env=env).returncode == 0
    # The disk "fills": no file may grow past 1 MiB, less than the optimiser state's.
    full = run(run_dir, env=env, limit_file_bytes=1 << 20)
    assert full.returncode == 2, full.stderr[-2000:]
    # Our one error line; Orbax's background threads may still log after it, so it need not be last.
    errors = [line for line in full.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, full.stderr[-3000:]
    assert errors[0].startswith(f"error: saving checkpoint step 12 to {checkpoints / '12'} failed: File too large (errno 27)")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["6"]  # no tmp dir, no partial step
    again = run(run_dir, env=env)
    assert again.returncode == 0 and f"Resuming from {checkpoints / '6'}" in again.stdout, again.stderr
    assert steps_in(checkpoints) == [6, 12]


# ---------------------------------------------------------------------------------------------
# A junk step directory named as checkpoint.load


def test_junk_step_dir_as_checkpoint_load_is_reported_clearly(tmp_path, env):
    step = tmp_path / "ckpt" / "7"
    (step / "model").mkdir(parents=True)
    (step / "commit_success.txt").write_text("done")
    result = olmo_eqx("+stage=anneal", "model=olmo3_nano", f"checkpoint.load={step}", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {step} (step 7) is unusable: model_config: not a readable olmo_eqx checkpoint")
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------
# 7. Append-only files survive a kill


def test_a_partial_metrics_line_is_set_aside_and_the_resume_appends_cleanly(tmp_path, env):
    run_dir = tmp_path / "run"
    assert run(run_dir, "trainer.stop_at=6", env=env).returncode == 0
    fragment = '{"step": 7, "loss": 8.1, "l'  # what a SIGKILL mid-write leaves: no newline
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(fragment)
    result = run(run_dir, PLOT, env=env)  # loss.png reads metrics.jsonl too
    assert result.returncode == 0, result.stderr
    assert "its last line was cut off" in result.stderr and (run_dir / "loss.png").exists()
    [aside] = run_dir.glob("metrics.jsonl.partial-*")
    assert aside.read_text() == fragment  # kept, not deleted
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line)["step"] for line in lines)  # every line parses
    assert [r["step"] for r in train_records(run_dir)] == list(range(1, 13))


def test_readers_skip_a_malformed_line_and_a_sweep_without_its_table_fails(tmp_path):
    from omegaconf import OmegaConf

    from olmo_eqx.run.plots import read_metrics
    from olmo_eqx.run.sweep import SweepSummary

    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- optim.lr=0.001\n")
    (job / "summary.json").write_text(json.dumps({"train_loss_mean_last_n": 3.0, "final_heldout_loss": 3.5}))
    (job / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "lo\n{"step": 2, "loss": 3.0}\n')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: skipped a malformed line"):
        assert [r["step"] for r in read_metrics(job / "metrics.jsonl")] == [1, 2]
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.warns(UserWarning, match="malformed"):
        SweepSummary().on_multirun_end(config)  # the table is built despite the bad line
    assert json.loads((tmp_path / "sweep_summary.json").read_text())[0]["status"] == "ok"
    assert (tmp_path / "sweep.png").exists()
    # A sweep dir where the table cannot be written: the sweep exits non-zero.
    (tmp_path / "sweep_summary.json").unlink()
    (tmp_path / "sweep_summary.json").mkdir()
    with pytest.raises(SystemExit) as exit_info, pytest.warns(UserWarning):
        SweepSummary().on_multirun_end(config)
    assert exit_info.value.code == 1


# ---------------------------------------------------------------------------------------------
# 8. Foreign or damaged HF weights: one line in every stage that loads weights, no run dir left


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict:
    import struct

    from safetensors.numpy import save_file

    from olmo_eqx.interop.hf import hf_config_dict
    from olmo_eqx.models.zoo import get_model_config

    root = tmp_path_factory.mktemp("hf")
    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 16}))
    save_file({"model.embed_tokens.weight": np.zeros((128, 16), np.float32)}, str(llama / "model.safetensors"))
    header = root / "header"
    header.mkdir()
    config = hf_config_dict(get_model_config("olmo3_tiny"), dtype="float32")
    (header / "config.json").write_text(json.dumps(config))
    # A header length of 2^60 bytes: what a corrupted or hostile file claims.
    (header / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    return {"llama": llama, "header": header}


@pytest.mark.parametrize(
    "stage, fault, message",
    [
        ("eval", "llama", "model_type='llama'"),
        ("compare", "header", "model.safetensors is not a readable safetensors file"),
        ("generate", "header", "model.safetensors is not a readable safetensors file"),
        ("anneal", "llama", "model_type='llama'"),
    ],
)
def test_foreign_or_damaged_hf_weights_are_one_line_and_leave_no_run_dir(tmp_path, env, hf_dirs, stage, fault, message):
    run_dir = tmp_path / "out" / "run"
    extra = [f"stage.against={hf_dirs[fault]}"] if stage == "compare" else []
    result = olmo_eqx(f"+stage={stage}", "model=olmo3_nano", f"checkpoint.load={hf_dirs[fault]}", *extra,
                      f"hydra.run.dir={run_dir}", env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1] and result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "out").exists()  # the run dir Hydra made for it is gone


# ---------------------------------------------------------------------------------------------
# 9. Small ones: where checkpoints live, what the summary names, the exit status after "done"


def test_a_checkpoint_dir_is_recorded_absolute_and_belongs_to_one_run_dir(tmp_path, env):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    run_a, run_b, checkpoints = tmp_path / "a", tmp_path / "b", here / "ckpt"
    first = olmo_eqx(*TINY, "trainer.stop_at=6", "checkpoint.dir=ckpt", f"hydra.run.dir={run_a}", env=env, cwd=here)
    assert first.returncode == 0, first.stderr
    assert json.loads((run_a / "config.json").read_text())["checkpoint"]["dir"] == str(checkpoints)
    assert steps_in(checkpoints) == [6]
    moved = olmo_eqx(*TINY, "checkpoint.dir=ckpt", f"hydra.run.dir={run_a}", env=env, cwd=elsewhere)
    assert moved.returncode == 2, moved.stderr
    assert f"checkpoint.dir=ckpt is relative: from {elsewhere} it names {elsewhere / 'ckpt'}" in moved.stderr
    assert f"Give checkpoint.dir={checkpoints} (absolute)" in moved.stderr
    other = olmo_eqx(*TINY, f"checkpoint.dir={checkpoints}", f"hydra.run.dir={run_b}", env=env)
    assert other.returncode == 2, other.stderr
    assert f"checkpoint.dir={checkpoints} belongs to the run dir {run_a}" in other.stderr
    assert steps_in(checkpoints) == [6] and not (run_b / "metrics.jsonl").exists()


def test_a_resume_past_stop_at_names_the_checkpoint_that_exists(tmp_path, env):
    run_dir = tmp_path / "run"
    assert run(run_dir, "trainer.eval_every=0", env=env).returncode == 0
    trained = json.loads((run_dir / "summary.json").read_text())
    again = run(run_dir, "trainer.eval_every=0", "trainer.stop_at=6", env=env)
    assert again.returncode == 0, again.stderr
    assert "Nothing to train: the checkpoint is at step 12, the run ends at 6" in again.stdout
    assert "compiling the train step" not in again.stdout  # no step 13 is coming
    summary = json.loads((run_dir / "summary.json").read_text())
    # A session that trains nothing keeps the training figures of the one that did (a sweep
    # resumed over its finished jobs reads them), and says so.
    for key in ("train_loss_mean_last_n", "train_loss_mean_steps", "last_step_loss", "tokens_per_s", "mfu"):
        assert summary[key] == trained[key] and trained[key] is not None, key
    assert "trained no step" in summary["training_figures_from"]
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "12") and Path(summary["checkpoint"]).is_dir()
    assert steps_in(run_dir / "checkpoints") == [6, 12]


def test_a_signal_after_done_leaves_exit_status_zero(tmp_path, env):
    import signal

    command = [sys.executable, "-m", "olmo_eqx", *TINY, "trainer.stop_at=2", "trainer.eval_every=0",
               f"hydra.run.dir={tmp_path / 'run'}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **env})
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("stopped at step 2"):
            process.send_signal(signal.SIGTERM)  # the run has said it is done; teardown is left
            break
    seen.extend(process.stdout)
    assert process.wait(timeout=120) == 0, "".join(seen)
    assert any("SIGTERM after the run completed: ignored" in line for line in seen), "".join(seen)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["end_step"] == 2


def test_a_line_printed_while_the_run_log_closes_is_kept(tmp_path):
    """The race behind the test above, made certain: a signal handler's line lands just as the
    run's log file finishes closing (it once raised "I/O operation on closed file", exit 1)."""
    from olmo_eqx.run.run_dir import RunDir

    run = RunDir(tmp_path, log_name="train.log")
    run.print("stopped at step 2")
    log = run._log

    class SignalOnClose:  # the log file, with a SIGTERM handler's line right after its close
        def close(self):
            log.close()
            run.print("SIGTERM after the run completed: ignored")

    run._log = SignalOnClose()
    run.close()
    run.close()
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert lines == ["stopped at step 2", "SIGTERM after the run completed: ignored"]


def test_a_line_printed_while_the_run_log_flushes_follows_the_line_in_progress(tmp_path, capsys):
    """The same handler's line landing inside the closing line's own flush: a second write to
    that buffered file raised "reentrant call" (exit 1 after "done"; seen in CI's suite)."""
    from olmo_eqx.run.run_dir import RunDir

    run = RunDir(tmp_path, log_name="train.log")
    run.print("step 2/12")
    log = run._log

    class SignalInFlush:  # the log file, with a SIGTERM handler's line arriving inside a flush
        flushing, signalled = False, False

        def write(self, text):
            if self.flushing:
                raise RuntimeError("reentrant call inside <_io.BufferedWriter name='train.log'>")
            log.write(text)

        def flush(self):
            self.flushing = True
            try:
                if not self.signalled:
                    self.signalled = True
                    run.print("SIGTERM after the run completed: ignored")
                log.flush()
            finally:
                self.flushing = False

        def close(self):
            log.close()

    run._log = SignalInFlush()
    run.print("stopped at step 2 (trainer.stop_at)")
    run.close()
    expected = ["step 2/12", "stopped at step 2 (trainer.stop_at)", "SIGTERM after the run completed: ignored"]
    assert (tmp_path / "train.log").read_text().splitlines() == expected
    assert capsys.readouterr().out.splitlines() == expected


# ---------------------------------------------------------------------------------------------
# 10. Data identity by content: a resume on changed data is refused naming the file


def test_changed_data_is_refused_naming_the_file_and_what_changed(tmp_path):
    from olmo_eqx.data.instances import InstanceDataset
    from olmo_eqx.data.loader import DataLoader
    from olmo_eqx.data.mixes import source_from_paths
    from olmo_eqx.data.sampler import LoaderState
    from olmo_eqx.data.token_files import DataFileError

    rng = np.random.default_rng(0)
    files = [write_token_file(tmp_path / f"part{i}.npy", rng.integers(0, NANO_VOCAB, 64 * 300), NANO_VOCAB)
             for i in range(3)]

    def resume(state):
        dataset = InstanceDataset([source_from_paths("web", tmp_path / "part*.npy")], 64, NANO_VOCAB)
        return DataLoader(dataset, 8, seed=0, state=LoaderState.from_dict(state.to_dict()))

    saved = DataLoader(InstanceDataset([source_from_paths("web", tmp_path / "part*.npy")], 64, NANO_VOCAB), 8, 0).state
    assert resume(saved).step == 0  # unchanged data resumes
    original = [f.read_bytes() for f in files]
    # One token in the middle rewritten in place: same size, same path.
    tokens = np.fromfile(files[1], dtype=np.uint16)
    tokens[len(tokens) // 2 - 1000 : len(tokens) // 2 + 1000] = 7
    tokens.tofile(files[1])
    with pytest.raises(DataFileError, match=r"token file .*part1\.npy \(source 'web'\): its contents changed at the same size"):
        resume(saved)
    # Two same-size files swapped.
    files[1].write_bytes(original[2]), files[2].write_bytes(original[1])
    with pytest.raises(DataFileError, match=r"part1\.npy .* it now holds what .*part2\.npy held \(files swapped\?\)"):
        resume(saved)
    # Truncated, and gone.
    files[1].write_bytes(original[1][: len(original[1]) // 2]), files[2].write_bytes(original[2])
    with pytest.raises(DataFileError, match=r"part1\.npy \(source 'web'\) was truncated: 9600 tokens, the checkpoint's had 19200"):
        resume(saved)
    files[1].unlink()
    with pytest.raises(DataFileError, match=r"part1\.npy \(source 'web'\) is gone from the dataset"):
        resume(saved)


def test_a_same_size_rewrite_between_stop_and_resume_is_refused(tmp_path, env):
    rng = np.random.default_rng(1)
    files = [write_token_file(tmp_path / f"part{i}.npy", rng.integers(0, NANO_VOCAB, 64 * 64), NANO_VOCAB) for i in range(2)]
    data = [f"data.source={tmp_path}/part*.npy", "trainer.eval_every=0"]
    assert run(tmp_path / "run", *data, "trainer.stop_at=6", env=env).returncode == 0
    swapped = [f.read_bytes() for f in files][::-1]
    for f, content in zip(files, swapped):
        f.write_bytes(content)
    result = run(tmp_path / "run", *data, env=env)
    assert result.returncode == 2, result.stderr
    named = "/".join((tmp_path / "part0.npy").parts[-3:])  # the tail a checkpoint records, not the root
    assert f"token file {named} (source" in result.stderr and "contents changed at the same size" in result.stderr


# ---------------------------------------------------------------------------------------------
# 11. Several processes: one listing, and one failure stops them all


def test_two_processes_saving_every_step_with_keep_last_1_never_race(tmp_path):
    """Process 0's retention deleted a step while process 1 listed the directory (crash, then
    a 5-minute barrier hang); the listing is now process 0's, agreed by both."""
    from localcluster import launch_local_cluster

    args = [sys.executable, "-m", "olmo_eqx", *TINY, "trainer.stop_at=6", "trainer.eval_every=0",
            "checkpoint.every=1", "checkpoint.keep_last=1", f"hydra.run.dir={tmp_path}"]
    processes = launch_local_cluster(args, merge_stderr=True)
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert steps_in(tmp_path / "checkpoints") == [5, 6]  # keep_last=1, and 5 until 6 is confirmed


def test_a_failure_in_one_process_stops_both_within_seconds(tmp_path):
    """A token id out of range in rows only process 1 reads: process 1 stops with its message,
    and process 0, waiting in the step's collective, stops within seconds saying why."""
    import time

    from localcluster import launch_local_cluster
    from olmo_eqx.data.instances import InstanceDataset
    from olmo_eqx.data.mixes import source_from_paths
    from olmo_eqx.config import DataConfig
    from olmo_eqx.data.sampler import StepSampler

    rng = np.random.default_rng(0)
    files = [write_token_file(tmp_path / f"part{i}.npy", rng.integers(0, NANO_VOCAB, 64 * 24), NANO_VOCAB) for i in range(2)]
    dataset = InstanceDataset([source_from_paths("data", tmp_path / "part*.npy")], 64, NANO_VOCAB)
    sampler = StepSampler(len(dataset), 8, seed=DataConfig().seed)
    process_0 = set(np.concatenate([sampler.global_batch(k)[:4] for k in range(3)]).tolist())
    bad = next(i for i in sampler.global_batch(2)[4:].tolist() if i not in process_0)
    file_index, offset = (int(x[0]) for x in dataset.locate(np.array([bad])))
    tokens = np.fromfile(files[file_index], dtype=np.uint16)
    tokens[offset + 5] = NANO_VOCAB + 3
    tokens.tofile(files[file_index])

    args = [sys.executable, "-m", "olmo_eqx", *TINY, f"data.source={tmp_path}/part*.npy", "trainer.eval_every=0",
            f"hydra.run.dir={tmp_path / 'run'}"]
    processes = launch_local_cluster(args, merge_stderr=True)
    ended = [None, None]
    while any(e is None for e in ended):
        for i, p in enumerate(processes):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.1)
    outputs = [p.communicate()[0] for p in processes]
    assert [p.returncode for p in processes] == [2, 2], outputs
    assert f"process 1 of 2 failed: token file {files[file_index]} holds token id {NANO_VOCAB + 3}" in outputs[0]
    assert abs(ended[0] - ended[1]) < 15, (ended, outputs)  # seconds, not the runtime's 5-minute timeouts
