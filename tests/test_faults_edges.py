"""Issue 42's faults at the edges, with real processes, files and servers: settings checked up
front, a manifest listing a file twice, config changes at resume, a finite loss that runs away,
misbehaving range servers. Each test asserts the line the user sees, the exit status and what
is left on disk; the CLI runs are the nano model on one CPU device (tests/clihelp.py).
"""

import contextlib
import dataclasses
import json
import math
import resource
import signal

import pytest

from olmo_eqx.checkpoint.storage import CheckpointSaveError
from olmo_eqx.config import ConfigError, compose_config
from olmo_eqx.data.mixes import read_mix
from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.errors import RunError
from olmo_eqx.run.sinks import SinkError
from olmo_eqx.train.divergence import DivergenceGuard, SaveHealth, runaway_loss_limit
from olmo_eqx.train.loop import TrainError, TrainingDiverged, train

from clihelp import TINY, olmo_eqx
from test_faults import steps_in, tree_hashes

# ---------------------------------------------------------------------------------------------
# Settings checked before any work


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr=-1.0 must be > 0"),
        ("optim.lr=0", "optim.lr=0.0 must be > 0"),
        ("optim.lr=nan", "optim.lr=nan must be > 0"),
        ("optim.b2=1.5", "optim.b2=1.5 must be in [0, 1)"),
        ("schedule.final_lr_ratio=2", "schedule.final_lr_ratio=2.0 must be in [0, 1]"),
        ("data.remote_timeout_s=0", "data.remote_timeout_s=0.0 must be > 0"),
        ("trainer.runaway_loss_steps=0", "trainer.runaway_loss_steps=0 must be >= 1"),
        ("schedule.warmup_steps=12", "schedule.warmup_steps=12 must be below the schedule's length 12"),
    ],
)
def test_numeric_settings_are_checked_before_any_work(override, message):
    with pytest.raises(ConfigError) as refused:
        compose_config([*TINY, override])
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_manifest_listing_a_file_twice_is_refused_naming_both_lines(tmp_path):
    manifest = tmp_path / "mix.txt"
    manifest.write_text("web,a/{TOKENIZER}/p0.npy\nweb,a/{TOKENIZER}/p1.npy\n# note\ncode,a/{TOKENIZER}/p0.npy\n")
    with pytest.raises(DataFileError) as refused:
        read_mix(manifest, tmp_path, "tok")
    assert str(refused.value) == (
        f"{manifest}:4: a/tok/p0.npy is already listed on line 1 (the same file: {tmp_path / 'a/tok/p0.npy'}); "
        "a file listed twice would get double weight: remove one of the two lines"
    )
    # The same file name in two directories is two files; at a URL root too.
    manifest.write_text("web,a/{TOKENIZER}/p0.npy\nweb,b/{TOKENIZER}/p0.npy\n")
    assert [len(s.paths) for s in read_mix(manifest, "http://127.0.0.1:1/root", "tok")] == [2]
    manifest.write_text("web,a/p0.npy\nweb,./a/p0.npy\n")
    with pytest.raises(DataFileError, match="already listed on line 1"):
        read_mix(manifest, tmp_path, "tok")


# ---------------------------------------------------------------------------------------------
# Runaway losses


def test_the_guard_stops_a_finite_runaway_and_save_health_never_trusts_it():
    limit = runaway_loss_limit(4096, 1.0)
    assert limit == pytest.approx(math.log(4096) + 1.0) and runaway_loss_limit(4096, None) == math.inf
    guard = DivergenceGuard(history=0, min_history=20, max_consecutive_skips=5, loss_limit=limit, runaway_steps=3)
    assert guard.observe(1, 8.3, 1.0, skipped=False) is None
    assert guard.observe(2, 50.0, 9.0, skipped=False) is None
    assert guard.observe(3, 9.0, 1.0, skipped=False) is None  # one healthy step restarts the count
    assert guard.observe(4, 1120.0, 1e3, skipped=False) is None
    assert guard.observe(5, 1e6, 1e5, skipped=False) is None
    reason = guard.observe(6, 7e9, 1e7, skipped=False)
    assert reason.startswith(f"the loss ran away: above {limit:.2f}") and "3 steps in a row up to step 6" in reason
    health = SaveHealth(last_good=None, unconfirmed=[4], loss_limit=limit)
    health.observe(5, 1e6, 1e5, skipped=False)  # finite, but not healthy: step 4 stays unconfirmed
    assert (health.last_good, health.unconfirmed) == (None, [4])
    health.observe(6, 3.0, 1.0, skipped=False)
    assert (health.last_good, health.unconfirmed) == (4, [])


def test_resume_changes_are_refused_unless_named_and_a_runaway_names_a_healthy_checkpoint(tmp_path, capsys):
    """One run, resumed twice: with lr x10 and 100 steps (refused, nothing in the run dir
    changes), then with lr x10 accepted by name and a runaway limit every step exceeds: the stop
    names step 1, the last save a healthy step followed, not the newer saves."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    common = [*TINY, "trainer.eval_every=0", "checkpoint.every=1"]
    train(compose_config([*common, "trainer.stop_at=2"]), run_dir)
    assert steps_in(checkpoints) == [1, 2]
    before = tree_hashes(run_dir)
    with pytest.raises(TrainError) as changed:
        train(compose_config([*common, "optim.lr=3e-2", "trainer.steps=100"]), run_dir)
    assert str(changed.value) == (
        f"cannot resume from {checkpoints / '2'} with changed settings: optim.lr 0.003 -> 0.03, trainer.steps 12 -> 100. "
        "Give the checkpoint's values to continue that run, or add checkpoint.accept_changes=[optim.lr,trainer.steps] "
        "to resume with the new ones")
    assert tree_hashes(run_dir) == before
    # Accepted by name; every loss is above ln(4096) - 6 = 2.32, so the loss "runs away" at once.
    capsys.readouterr()
    with pytest.raises(TrainingDiverged) as bad:
        train(compose_config([*common, "optim.lr=3e-2", "checkpoint.accept_changes=[optim.lr]",
                              "trainer.runaway_loss_margin=-6"]), run_dir)
    assert "Resuming with changed settings (checkpoint.accept_changes): optim.lr 0.003 -> 0.03" in capsys.readouterr().out
    message = str(bad.value)
    assert message.startswith("training diverged: the loss ran away: above 2.32 (ln(vocab size) + "
                              "trainer.runaway_loss_margin) for 3 steps in a row up to step 5") and "\n" not in message
    assert f"the last good checkpoint is {checkpoints / '1'} (step 1); a rerun resumes from it" in message
    assert steps_in(checkpoints) == [1]
    assert json.loads((run_dir / "summary.json").read_text())["diverged"]["last_good_step"] == 1


# ---------------------------------------------------------------------------------------------
# Full and unwritable run dirs: one line naming the file, exit 2, the checkpoints intact

# A full disk is RLIMIT_FSIZE (writes then fail with EFBIG, as with ENOSPC), SIGXFSZ ignored so
# the write returns the error instead of killing the process. Set in this process, as a soft
# limit lifted after: a cold limited subprocess cost 3-4 s more per run (imports, a compile).


@contextlib.contextmanager
def file_size_limit(limit: int):
    """No file this process writes may grow past `limit` bytes, until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)


# After the failed save, TensorStore's own threads still complete writes of it and call back
# into the asyncio loop Orbax ran the save on, closed by then: "Exception ignored ... Event loop
# is closed", said by Python and harmless (the run has stopped; a command line's process exits).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_full_disk_stops_the_run_when_it_fails_and_the_rerun_resumes(tmp_path, capsys):
    """From checkpoint 6: a save failing at step 12 of 18 is reported at once (not at the next
    save, step 18); metrics.jsonl reaching the file size limit at step 7 is one line naming it;
    checkpoint 6 stays intact throughout, and with room again the rerun resumes from it. Both
    errors are RunErrors, which the command line prints as its one `error:` line with exit
    status 2 (that path for a failed save: test_faults' test_a_failed_save_stops_at_once_...)."""
    run_dir = tmp_path / "run"
    config = compose_config([*TINY, "trainer.eval_every=0"])
    train(dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, stop_at=6)), run_dir)
    metrics = run_dir / "metrics.jsonl"
    longer = compose_config([*TINY, "trainer.eval_every=0", "trainer.steps=18", "checkpoint.accept_changes=[trainer.steps]"])
    # 1 MiB: checkpoint 12's largest files pass it; nothing else the run writes comes near (the
    # compilation cache's entries are under 0.5 MiB).
    with file_size_limit(1 << 20), pytest.raises(CheckpointSaveError) as failed_save:
        train(longer, run_dir)
    message = str(failed_save.value)
    assert isinstance(failed_save.value, RunError) and "\n" not in message, message
    assert message.startswith(f"saving checkpoint step 12 to {run_dir / 'checkpoints' / '12'} failed: File too large"), message
    trained = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert 12 <= max(trained) <= 14 and steps_in(run_dir / "checkpoints") == [6]
    kept = metrics.read_bytes()
    # metrics.jsonl 200 bytes short of the limit: step 7's record does not fit. No other file
    # the run writes comes near 64 MiB.
    limit = 64 << 20
    metrics.write_bytes(kept + b'{"pad": "' + b"x" * (limit - len(kept) - 200) + b'"}\n')
    with file_size_limit(limit), pytest.raises(SinkError) as full:
        train(config, run_dir)
    assert str(full.value) == (f"cannot write {metrics}: File too large: free space on its disk (or make the run dir "
                               "writable), then rerun to resume; the checkpoints are intact")
    assert steps_in(run_dir / "checkpoints") == [6]
    metrics.write_bytes(kept)
    capsys.readouterr()
    assert train(config, run_dir)["start_step"] == 6
    # The steps the failed save's session trained past checkpoint 6 are said to be trained again.
    assert (f"{metrics} records steps up to {max(trained)}, past the checkpoint resumed (step 6): steps "
            f"7-{max(trained)} are trained again") in capsys.readouterr().out


def test_a_tensorboard_sink_on_a_full_disk_raises_in_one_line_instead_of_hanging(tmp_path):
    """tensorboardX's writer thread used to die on ENOSPC and block the loop for good; the
    events are now written in the caller's thread, so the failure is the run's one line. The
    event file may not grow past 4 KiB (this process, soft limit: lifted after)."""
    from olmo_eqx.run.run_dir import RunDir

    out = RunDir(tmp_path / "run", loggers=("tensorboard",))
    out.metrics({"step": 0, "loss": 3.0})  # the writer opens before the limit: only the growth fails
    with file_size_limit(4096):
        with pytest.raises(SinkError) as full:
            # The file's buffer reaches it within a few hundred records; the old sink's queue
            # blocked for good a few records after its thread died.
            for step in range(1, 100000):
                out.metrics({"step": step, "loss": 3.0, "grad_norm": 1.0, "lr": 1e-3})
        out.close()  # quiet: the error is said once
    events = next((tmp_path / "run" / "tensorboard").iterdir())
    assert str(full.value) == (f"cannot write {events}: File too large: free space on its disk (or make the run dir "
                               "writable), then rerun to resume; the checkpoints are intact")


def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path):
    # Root writes through chmod, so an unwritable place is a path under a regular file.
    (tmp_path / "a_file").write_text("x")
    result = olmo_eqx(*TINY, f"hydra.run.dir={tmp_path / 'a_file' / 'run'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"error: cannot write {tmp_path / 'a_file' / 'run'}: Not a directory: make it writable, or choose another " \
           "directory (hydra.run.dir=...), then rerun" in result.stderr
