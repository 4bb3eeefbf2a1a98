"""The local checkpoint tier beside the persistent one (`olmo_eqx.checkpoint.local_tier`):
a kill -9 resumes bitwise from the newest step that was safe, a newer local step wins over an
older persistent one, a damaged one or one saved on another layout is passed over, every save
says when it is safe, and in a two-process run no process resumes a step another lacks.

Real `python -m olmo_eqx` runs of the nano model (one CPU device unless a test says), a real
kill -9, real jax.distributed processes over 127.0.0.1 (tests/localcluster.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_eqx.checkpoint.format import step_arrays
from olmo_eqx.checkpoint.local_tier import RAM_DISK, resolve_local_dir

from clihelp import TINY, olmo_eqx, xla_flags
from localcluster import launch_local_cluster

# 12 steps, a persistent save every 6, a local one every 2.
TIERS = ["checkpoint.every=6", "checkpoint.local_every=2", "trainer.eval_every=0"]


def run(run_dir: Path, *overrides: str, devices: int = 1, local: Path | None = None):
    local = local or run_dir / "local"
    return olmo_eqx(*TINY, *TIERS, f"checkpoint.local_dir={local}", *overrides, f"hydra.run.dir={run_dir}",
                    env={"XLA_FLAGS": xla_flags(devices)})


def arrays(step_dir: Path) -> list[np.ndarray]:
    """Every array of a persistent step (model and train state) as numpy, whatever it was saved on."""
    return step_arrays(step_dir)


def local_steps(local: Path, process: int = 0) -> list[int]:
    where = local / f"process_{process}"
    return sorted(int(p.name) for p in where.iterdir() if p.name.isdigit()) if where.exists() else []


def persistent_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def said(result) -> str:
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[np.ndarray]:
    """The final state of 12 uninterrupted steps, without a local tier."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = olmo_eqx(*TINY, "trainer.eval_every=0", f"hydra.run.dir={run_dir}", env={"XLA_FLAGS": xla_flags(1)})
    assert result.returncode == 0, said(result)[-3000:]
    return arrays(run_dir / "checkpoints" / "12")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run stopped at step 10 whose persistent step 10 is then lost (a kill before the final
    save): persistent step 6, local steps 4 and 8 (local_keep=2; step 6 was the persistent tier's)."""
    run_dir = tmp_path_factory.mktemp("stopped")
    result = run(run_dir, "trainer.stop_at=10")
    assert result.returncode == 0, said(result)[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "10")
    assert persistent_steps(run_dir) == [6] and local_steps(run_dir / "local") == [4, 8]
    return run_dir


def copy_of(stopped: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir)
    return run_dir


def test_kill_9_resumes_bitwise_from_the_newest_safe_step(tmp_path, reference):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "olmo_eqx", *TINY, *TIERS, f"checkpoint.local_dir={run_dir / 'local'}",
               f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "checkpoint step 8 is safe: local tier" in line:
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    process.stdout.close()
    assert process.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    safe = [int(line.split()[2]) for line in lines if " is safe: " in line]
    assert safe[-1] == 8 and 6 in safe
    kept = local_steps(run_dir / "local")  # its own retention (local_keep=2): 2 went when 8 was safe
    assert 8 in kept and 2 not in kept and len(kept) <= 3  # 3: step 10's commit may have beaten the kill

    # Every safe record comes at or after the step it saved, and took a positive time.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    marks = [r for r in records if "checkpoint_safe" in r]
    assert {(r["checkpoint_safe"], r["tier"]) for r in marks} >= {(2, "local"), (6, "persistent"), (8, "local")}
    for mark in marks:
        assert mark["step"] >= mark["checkpoint_safe"] and mark["save_s"] > 0
        trained = next(i for i, r in enumerate(records) if r.get("step") == mark["checkpoint_safe"] and "loss" in r)
        assert records.index(mark) > trained

    again = run(run_dir)
    assert again.returncode == 0, said(again)[-3000:]
    resumed = next(line for line in said(again).splitlines() if line.startswith("Resuming from"))
    step = int(resumed.split("(step ")[1].split(";")[0].split(")")[0])
    assert step >= 8, resumed  # never older than the newest step said to be safe
    if step % 6:
        assert resumed.startswith(f"Resuming from the local tier {run_dir / 'local'} (step {step}; the persistent "
                                  "tier's newest is step 6"), resumed
    assert all(np.array_equal(a, b) for a, b in zip(arrays(run_dir / "checkpoints" / "12"), reference, strict=True))
    # The local tier's retention touched nothing persistent; the run completed, and its local
    # steps were removed (the RAM disk is the host's).
    assert local_steps(run_dir / "local") == [] and persistent_steps(run_dir) == [6, 12]


def test_a_newer_local_step_wins_and_a_damaged_one_falls_back(tmp_path, stopped):
    run_dir = copy_of(stopped, tmp_path)
    local = tmp_path / "moved_local"  # another local_dir on the rerun is no change of settings
    shutil.move(run_dir / "local", local)
    result = run(run_dir, "trainer.stop_at=9", local=local)
    assert result.returncode == 0, said(result)[-3000:]
    assert f"Resuming from the local tier {local} (step 8; the persistent tier's newest is step 6" in said(result)

    damaged = tmp_path / "damaged"
    shutil.copytree(stopped, damaged)
    shard = max((damaged / "local" / "process_0" / "8" / "shards").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run(damaged, "trainer.stop_at=9")
    assert result.returncode == 0, said(result)[-3000:]
    text = said(result)
    assert "(step 8) is unusable: shards/" in text and "contents changed since the save" in text, text[-3000:]
    assert "removed from every process's local tier (a cache); falling back to step 6" in text
    assert f"Resuming from {damaged / 'checkpoints' / '6'} (step 6" in text
    assert persistent_steps(damaged) == [6, 9]


def test_a_local_step_of_another_layout_is_passed_over(tmp_path, stopped):
    """Saved on one device, resumed on two: the persistent tier's step restores on any mesh,
    the local tier's shards only on the one they were saved from."""
    run_dir = copy_of(stopped, tmp_path)
    result = run(run_dir, "trainer.stop_at=7", devices=2)
    assert result.returncode == 0, said(result)[-3000:]
    text = said(result)
    assert "local step 8 in" in text and "was saved on another layout (devices [0] there, [0, 1] now)" in text, text[-3000:]
    assert f"Resuming from {run_dir / 'checkpoints' / '6'} (step 6" in text
    assert local_steps(run_dir / "local") == [4]  # 8 was past the step resumed: gone, never mixed in


def test_a_save_that_never_completed_is_named(tmp_path, stopped):
    run_dir = copy_of(stopped, tmp_path)
    (run_dir / "checkpoints" / "12.orbax-checkpoint-tmp-1234").mkdir()
    (run_dir / "local" / "process_0" / "10").mkdir()  # no commit marker, no manifest
    result = run(run_dir, "trainer.stop_at=9")
    assert result.returncode == 0, said(result)[-3000:]
    text = said(result)
    assert f"checkpoint step 12 in {run_dir / 'checkpoints'} never completed" in text and "resuming from step 8" in text
    assert f"local checkpoint step 10 in {run_dir / 'local' / 'process_0'} never completed" in text
    assert not (run_dir / "checkpoints" / "12.orbax-checkpoint-tmp-1234").exists()


def test_two_processes_resume_from_the_newest_step_both_hold(tmp_path):
    """Process 1's local tier loses its newest step (a host replaced, its RAM disk cleared):
    both resume from the step both still have, and the log says so."""
    run_dir, local = tmp_path / "run", tmp_path / "local"
    command = [sys.executable, "-m", "olmo_eqx", *TINY, "checkpoint.every=0", "checkpoint.local_every=2",
               "trainer.eval_every=0", f"checkpoint.local_dir={local}", f"hydra.run.dir={run_dir}"]

    def cluster(*overrides):
        procs = launch_local_cluster([*command, *overrides], devices_per_process=1, merge_stderr=True)
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
        return outputs[0]

    first = cluster("trainer.stop_at=10")
    assert "checkpoint step 8 is safe: local tier" in first and "checkpoint step 10 is safe: persistent tier" in first
    shutil.rmtree(run_dir / "checkpoints" / "10")  # a kill before the final save
    assert local_steps(local, 0) == local_steps(local, 1) == [6, 8]
    shutil.rmtree(local / "process_1" / "8")
    again = cluster("trainer.stop_at=11")
    assert (f"process 1's local tier ({local / 'process_1'}) has no step 8 (it holds [6]: host replaced, or its RAM "
            "disk cleared?): every process resumes from step 6 (the local tier)") in again, again[-3000:]
    assert f"Resuming from the local tier {local} (step 6; the persistent tier's newest is none" in again
    assert local_steps(local, 0) == local_steps(local, 1) == [8, 10]  # saved anew from step 6


def test_local_dir_auto_and_refusals(tmp_path, monkeypatch):
    root, why = resolve_local_dir("auto", tmp_path / "run", need=1 << 20, keep=2)
    if RAM_DISK.is_dir() and os.access(RAM_DISK, os.W_OK):
        assert why is None and root.parent == RAM_DISK / f"olmo_eqx-{__import__('getpass').getuser()}"
    assert resolve_local_dir("off", tmp_path, 1, 2) == (None, None) and resolve_local_dir(None, tmp_path, 1, 2) == (None, None)
    monkeypatch.setattr("olmo_eqx.checkpoint.local_tier.RAM_DISK", tmp_path / "no_such_dir")
    root, why = resolve_local_dir("auto", tmp_path / "run", need=1, keep=2)
    assert root is None and why.startswith("no local checkpoint tier: ") and "checkpoint.local_dir" in why
    monkeypatch.setattr("olmo_eqx.checkpoint.local_tier.RAM_DISK", tmp_path)
    root, why = resolve_local_dir("auto", tmp_path / "run", need=1 << 60, keep=2)
    assert root is None and "GiB free, the tier needs" in why
    for bad in ("checkpoint.local_dir=relative/dir", "checkpoint.local_every=-1", "checkpoint.local_keep=0"):
        result = olmo_eqx(*TINY, "checkpoint.local_every=2", bad, f"hydra.run.dir={tmp_path / 'refused'}")
        assert result.returncode == 2 and result.stderr.count("error: ") == 1, result.stderr[-2000:]
        assert f"{bad.split('.', 1)[1]} must be" in result.stderr  # the bad key and value, named alone


def test_in_process_resume_from_the_local_tier_on_eight_devices(tmp_path, capsys):
    """The same path in this process, under the suite's type checks, on 8 devices (FSDP: each
    device's shard saved and restored): stopped at 4, its persistent step 4 lost, resumed
    from local step 2, and bitwise equal to a run that never stopped."""
    from olmo_eqx.config import compose_config
    from olmo_eqx.train.loop import train

    common = [*TINY, *TIERS, "trainer.steps=6", f"checkpoint.local_dir={tmp_path / 'local'}"]
    run_dir = tmp_path / "run"
    train(compose_config([*common, "trainer.stop_at=4"]), run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "4")
    assert local_steps(tmp_path / "local") == [2]
    capsys.readouterr()
    summary = train(compose_config(common), run_dir)
    out = capsys.readouterr().out
    assert summary["start_step"] == 2 and f"Resuming from the local tier {tmp_path / 'local'} (step 2;" in out, out
    assert "checkpoint step 6 is safe: persistent tier" in out
    whole = tmp_path / "whole"
    train(compose_config([*TINY, "trainer.eval_every=0", "trainer.steps=6"]), whole)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(run_dir / "checkpoints" / "6"),
                                                     arrays(whole / "checkpoints" / "6"), strict=True))
