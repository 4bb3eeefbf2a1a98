"""The pretrain stage end to end on the nano model: learning, artifacts (metrics in JSON lines,
TensorBoard and W&B, loss.png, a profile), exact resume, interruption by SIGTERM, a refused
mismatched checkpoint, and a two-job sweep (with sweep.png)."""

import glob
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from olmo_eqx.run import huge_pages
from olmo_eqx.config import compose_config
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.train.loop import TrainError, train

from clihelp import PLOT, TINY, olmo_eqx, xla_flags
from evalhelp import TOY_TASKS, write_toy_tasks
from localcluster import launch_local_cluster


@pytest.fixture(scope="module")
def one_device() -> dict:
    """Environment of subprocess runs that test the CLI, not sharding: one CPU device compiles
    faster than eight (the suite's compilation cache, conftest.py, lets a rerun skip compiling)."""
    return {"XLA_FLAGS": xla_flags(1)}


def read_metrics(run_dir) -> dict[int, dict]:
    """Train-step records by step (the last record of a step wins, as after a replay)."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            records[record["step"]] = record
    return records


def checkpoint_steps(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


# The reference run also feeds every metric sink and profiles three steps (none of which
# changes a training number: the resume test compares against it bit for bit).
SINKS = ["trainer.loggers=[jsonl,tensorboard,wandb]", "trainer.profile_steps=[4,6]", PLOT]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One complete 12-step run (shared by the tests that compare against it)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")  # never the network, even where an API key is set
        env.setenv("WANDB_SILENT", "true")
        summary = train(compose_config(TINY + SINKS), run_dir)
    return run_dir, summary


def wandb_history(path) -> list[dict]:
    """The logged rows of a W&B run file (`run-*.wandb`): LevelDB-log-framed protobuf `Record`s
    (32 KiB blocks, 7-byte chunk headers: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    rows, chunks, pos, block = [], [], 7, 32 * 1024
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):  # block trailer padding
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_pretrain_learns_and_writes_its_artifacts(uninterrupted):
    run_dir, summary = uninterrupted
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == list(range(1, 13))
    assert metrics[12]["loss"] < metrics[1]["loss"] - 0.5  # from ~ln(4096) = 8.3 downwards
    heldout = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "heldout_loss" in line]
    assert [r["step"] for r in heldout] == [6, 12]
    assert heldout[1]["heldout_loss"] < heldout[0]["heldout_loss"]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["stage_completed"] and on_disk["end_step"] == 12
    assert on_disk["final_heldout_loss"] == heldout[1]["heldout_loss"]
    assert on_disk["tokens_per_s"] > 0 and on_disk["mfu"] > 0
    # The training rate leaves compilation, evaluation and saves out, and says so; the wall rate
    # is every token of the session over its whole wall time. (Which is larger is not fixed: a
    # warm compilation cache can make the whole session's rate beat the steps' median.)
    assert "compilation" in on_disk["tokens_per_s_excludes"]
    config = json.loads((run_dir / "config.json").read_text())
    session_tokens = 12 * config["data"]["global_batch_size"] * config["data"]["sequence_length"]
    assert on_disk["tokens_per_s_wall"] == pytest.approx(session_tokens / on_disk["wall_time_s"], rel=1e-6)
    assert checkpoint_steps(run_dir) == [6, 12]
    assert json.loads((run_dir / "config.json").read_text())["model"]["name"] == "olmo3_nano"
    # One host, nothing set: no jax.distributed, and the log's first line says so.
    assert re.match(r"^cluster: local( \(TPU_WORKER_HOSTNAMES lists one host\))?, 1 process x 8 cpu devices, mesh slice=1 data=1 fsdp=8 ", (run_dir / "train.log").read_text())


def test_every_sink_holds_the_metrics_of_metrics_jsonl(uninterrupted):
    from tensorboard.backend.event_processing import event_accumulator

    run_dir, _ = uninterrupted
    metrics = read_metrics(run_dir)
    heldout = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "heldout_loss" in r}
    # TensorBoard's own reader; event files store float32, so compare the float32 of each value.
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    for tag in ("loss", "grad_norm", "lr"):
        assert {e.step: e.value for e in events.Scalars(tag)} == {s: float(np.float32(m[tag])) for s, m in metrics.items()}
    assert {e.step: e.value for e in events.Scalars("heldout/python-stdlib-heldout")} == {
        s: float(np.float32(r["heldout"]["python-stdlib-heldout"])) for s, r in heldout.items()}
    # W&B (offline) keeps doubles: the same numbers exactly.
    (wandb_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = wandb_history(wandb_file)
    assert {r["_step"]: r["loss"] for r in rows if "loss" in r} == {s: m["loss"] for s, m in metrics.items()}
    assert {r["_step"]: r["heldout_loss"] for r in rows if "heldout_loss" in r} == {
        s: r["heldout_loss"] for s, r in heldout.items()}


def test_loss_plot_and_a_profile_of_three_steps(uninterrupted):
    from jax.profiler import ProfileData

    run_dir, _ = uninterrupted
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (xplane,) = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    events = [e.name for plane in ProfileData.from_file(xplane).planes for line in plane.lines for e in line.events]
    # The Python tracer's frames of olmo_eqx/train/step.py's train_step: one per step 4, 5, 6.
    assert sum(bool(re.fullmatch(r"\$step\.py:\d+ train_step", name)) for name in events) == 3
    (perfetto,) = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    import gzip

    assert json.load(gzip.open(perfetto))["traceEvents"]


def test_stop_and_resume_is_bitwise_identical(uninterrupted, tmp_path):
    reference = read_metrics(uninterrupted[0])
    first = train(compose_config(TINY + ["trainer.stop_at=5"]), tmp_path)
    assert not first["stage_completed"] and checkpoint_steps(tmp_path) == [5]
    # Held-out sets are evaluation only: naming two of them changes no training number.
    corpus = embedded_corpus()
    named_sets = [f"+data.heldout.stdlib={corpus.heldout_files[0]}", f"+data.heldout.train_sample={corpus.train_files[0]}",
                  "data.allow_heldout_in_training=true"]
    second = train(compose_config(TINY + named_sets), tmp_path)
    assert second["start_step"] == 5 and second["stage_completed"]
    resumed = read_metrics(tmp_path)
    for step in range(1, 13):
        for key in ("loss", "grad_norm", "lr"):
            assert resumed[step][key] == reference[step][key], (step, key)
    assert set(second["final_heldout_losses"]) == {"stdlib", "train_sample"}
    # The reference evaluated the same held-out split (under its default name) at step 12.
    assert second["final_heldout_losses"]["stdlib"] == uninterrupted[1]["final_heldout_loss"]


def test_mismatched_checkpoint_is_refused_clearly(uninterrupted):
    run_dir, _ = uninterrupted
    with pytest.raises(TrainError, match="different model.*d_model"):
        train(compose_config(TINY + ["model.d_model=96"]), run_dir)


def test_sigterm_saves_and_the_next_run_resumes(tmp_path, one_device):
    args = TINY + ["trainer.steps=100000", "trainer.log_every=1", "checkpoint.every=0", f"hydra.run.dir={tmp_path}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "olmo_eqx", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **one_device},
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert re.search(r"^cluster: local( \(TPU_WORKER_HOSTNAMES lists one host\))?, 1 process x 1 cpu device, mesh slice=1 data=1 fsdp=1 ", output, re.M), output
    # The first step's wait is announced as compilation, not left silent: trainer.micro_batches=auto
    # compiles it before the banner, saying so, and the banner says the first step comes next.
    assert "  trainer.micro_batches=auto: the train step, 1 micro-batch(es) of " in output
    assert "compiled above (trainer.micro_batches=auto): step 1's line comes once it has run" in output
    if huge_pages.environment_with_huge_pages({"JAX_PLATFORMS": "cpu"}) is not None:
        # The command re-executed itself with the tunable (same pid: the signal reached the run).
        assert "host memory: GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in output, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = summary["end_step"]
    assert summary["interrupted"] == "SIGTERM" and 3 <= stopped < 100000
    assert checkpoint_steps(tmp_path) == [stopped]

    result = olmo_eqx(*args, f"trainer.stop_at={stopped + 2}", env=one_device)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] == stopped and summary["end_step"] == stopped + 2
    assert f"Resuming from {tmp_path / 'checkpoints' / str(stopped)}" in result.stdout
    # How long it ran, then what to do: not "rerun to resume in <seconds>", which reads as a countdown.
    assert re.search(rf"stopped at step {stopped + 2} \(trainer.stop_at\) after [\d.]+s; rerun to resume \|", result.stdout)
    # trainer.plot=false (TINY's): no loss.png, and the closing line names none.
    assert "| plot:" not in result.stdout and not (tmp_path / "loss.png").exists()


def test_sweep_runs_each_job_in_its_own_dir_and_prints_a_table(tmp_path, one_device):
    args = [a for a in TINY if not a.startswith("trainer.steps")] + ["trainer.steps=4", "trainer.eval_every=4", PLOT]
    result = olmo_eqx("-m", *args, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}", env=one_device)
    assert result.returncode == 0, result.stdout + result.stderr
    for job in ("0", "1"):
        summary = json.loads((tmp_path / job / "summary.json").read_text())
        assert summary["stage_completed"] and summary["final_heldout_loss"] is not None
        assert (tmp_path / job / "loss.png").exists()
    assert (tmp_path / "sweep.png").stat().st_size > 0
    table = result.stdout[result.stdout.index("Sweep summary"):]
    assert "optim.lr=0.001" in table and "optim.lr=0.003" in table
    assert "held-out loss" in table
    rows = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok"]


def test_sweep_through_the_submitit_launcher(tmp_path, one_device):
    """`hydra/launcher=submitit_local`: the submitit launcher (the one submitit_slurm is) runs a
    2-job sweep for real, each job in its own submitit process and directory; one table."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = [a for a in TINY if not a.startswith("trainer.steps")] + ["trainer.steps=4", "trainer.eval_every=4"]
    result = olmo_eqx("-m", "hydra/launcher=submitit_local", *args, "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}",
                      "hydra.launcher.timeout_min=10", env=one_device)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Submitit 'local' sweep output dir" in result.stdout + result.stderr
    assert list(tmp_path.glob(".submitit/*/*_0_log.out"))  # submitit ran the jobs
    rows = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok"]
    for job in ("0", "1"):
        summary = json.loads((tmp_path / job / "summary.json").read_text())
        assert summary["stage_completed"] and summary["final_heldout_loss"] is not None


def test_the_slurm_launcher_off_a_cluster_is_one_line(tmp_path, one_device):
    """README's SLURM command on a machine without SLURM: one line naming the launcher and the
    way out (exit status 2), not submitit's traceback; no sweep dir is left behind."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import shutil

    if shutil.which("srun"):
        pytest.skip("srun is on PATH here")
    result = olmo_eqx("-m", "hydra/launcher=submitit_slurm", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}", env=one_device)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: hydra/launcher=submitit_slurm: SLURM's srun is not on PATH here; submit from a node of the cluster "
        "(its login node), or try the same jobs on this machine with hydra/launcher=submitit_local"]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("launcher", ["jax", "slurm"])
def test_two_processes_train_like_one(uninterrupted, tmp_path, launcher):
    """jax.distributed on CPU (2 processes x 2 devices): each process reads its own rows once,
    so the losses match the single-process run; only process 0 writes the run files. Started
    by JAX's own variables, or by the ones SLURM sets for 2 tasks (what a submitit_slurm job's
    tasks see), which jax's SLURM detection turns into the same runtime."""
    args = [sys.executable, "-m", "olmo_eqx", *TINY, "trainer.stop_at=4", "trainer.eval_every=0", f"hydra.run.dir={tmp_path}"]
    if launcher == "jax":  # and downstream tasks in the loop: every process scores its rows, one record
        tasks = write_toy_tasks(tmp_path / "toy_tasks")
        args += ["trainer.downstream_every=4", f"trainer.downstream.tasks={TOY_TASKS}",
                 f"trainer.downstream.tasks_dir={tasks}", "trainer.downstream.batch_size=8"]
    processes = launch_local_cluster(args, merge_stderr=True, launcher=launcher)
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert "4 cpu device(s)" in outputs[0] and "parameters" not in outputs[1]
    kind = "jax (JAX_COORDINATOR_ADDRESS)" if launcher == "jax" else "slurm (SLURM_NTASKS=2)"
    assert (tmp_path / "train.log").read_text().startswith(f"cluster: {kind}, 2 processes x 2 cpu devices, mesh ")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"loss"' in line] == [1, 2, 3, 4]  # written once
    reference, distributed = read_metrics(uninterrupted[0]), read_metrics(tmp_path)
    for step in range(1, 5):  # 8 devices vs 2 x 2: equal up to float32 reduction order
        assert distributed[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-5)
    assert checkpoint_steps(tmp_path) == [4]
    # Process 0 alone keeps the session's goodput record (olmo_eqx.run.goodput), its parts adding up.
    (record_file,) = (tmp_path / "goodput").glob("session-*.json")
    session = json.loads(record_file.read_text())
    assert session["ended"] == "stopped" and session["last_step"] == 4 and session["buckets"]["steps"] > 0
    assert sum(session["buckets"].values()) == pytest.approx(session["wall_s"], rel=1e-9)
    assert json.loads((tmp_path / "summary.json").read_text())["goodput"]["sessions"] == 1
    if launcher == "jax":
        assert session["buckets"]["eval"] > 0  # the downstream tasks
        (record,) = [json.loads(line) for line in lines if '"downstream"' in line]
        assert record["step"] == 4 and "downstream, 3 tasks" in outputs[0] and "downstream" not in outputs[1]
        # The same scores as one process (8 devices) gives the saved step-4 weights.
        from olmo_eqx.evaluation import Scorer, TextTokenizer, evaluate_task, load_model, locate, read_task
        from olmo_eqx.sharding import MeshConfig, make_mesh

        mesh = make_mesh(MeshConfig())
        model = load_model(locate(str(tmp_path)), mesh)
        tokenizer = TextTokenizer(embedded_corpus().tokenizer_path)
        for name, scores in record["downstream"].items():
            row, _ = evaluate_task(Scorer(mesh), model, tokenizer, read_task(tasks, name), 8,
                                   model.config.max_sequence_length)
            assert scores["bpb"] == pytest.approx(row["bpb"], rel=1e-5)
            assert all(row[metric] == pytest.approx(value, abs=1e-6) for metric, value in scores.items())
