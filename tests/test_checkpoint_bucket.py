"""Every process of a multi-process run checkpoints to the bucket (`checkpoint.dir=s3://...`,
`gs://...`): real `jax.distributed` processes over 127.0.0.1, each with a staging dir of its
own (hosts without a shared file system), on moto's S3 server and on `rangeserver.py`'s
emulation of GCS's JSON API. Each process uploads the files it wrote, process 0 commits the
step once all landed; a resume on another process count reads it; a process killed mid-upload
leaves no committed step lacking a file."""

import json
import os
import signal
import sys
import time

import pytest

from clihelp import TINY, olmo_eqx, xla_flags
from localcluster import launch_local_cluster
from test_checkpoint_remote import BUCKET, keys, s3  # noqa: F401 (the fixture)
from test_pretrain import read_metrics

# 12 steps, a checkpoint every 4: runs stop at 4 or 8 and the next resumes there.
ARGS = [*TINY, "checkpoint.every=4", "trainer.eval_every=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: one process, 4 devices (the 2 x 2 of the runs compared with it)."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = olmo_eqx(*ARGS, f"hydra.run.dir={run_dir}", env={"XLA_FLAGS": xla_flags(4)})
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    from rangeserver import RangeServer

    (tmp_path / "served" / "ckpts").mkdir(parents=True)
    server = RangeServer(tmp_path / "served")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    yield server
    server.stop()


def committed_steps(url: str) -> list[int]:
    from olmo_eqx.checkpoint.remote import RemoteSteps

    return RemoteSteps(url).committed_steps()


def every_committed_step_is_whole(url: str) -> None:
    """Each committed step's objects hold every file of its manifest at its size."""
    from olmo_eqx.checkpoint.remote import RemoteSteps

    steps = RemoteSteps(url)
    for step in steps.committed_steps():
        listed, manifest = steps.occupied(step), steps.committed(step)
        for name, entry in manifest["files"].items():
            assert listed.get(name) == entry["size"], (step, name)


def two_processes(url: str, run_dir, staging, *extra: str, wrap: str = "") -> list:
    """Start the command on 2 processes x 2 devices, each with its own staging dir."""
    command = [sys.executable, "-m", "olmo_eqx"] if not wrap else [sys.executable, "-c", wrap]
    args = [*command, *ARGS, f"checkpoint.dir={url}", f"hydra.run.dir={run_dir}", *extra]
    environments = [{"OLMO_EQX_CHECKPOINT_STAGING": str(staging / f"host{i}")} for i in range(2)]
    return launch_local_cluster(args, merge_stderr=True, environments=environments)


def finish(processes, timeout: float = 300) -> list[str]:
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return outputs


def one_process(url: str, run_dir, staging, *extra: str):
    result = olmo_eqx(*ARGS, f"checkpoint.dir={url}", f"hydra.run.dir={run_dir}", *extra,
                      env={"XLA_FLAGS": xla_flags(4), "OLMO_EQX_CHECKPOINT_STAGING": str(staging)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_losses_continue(run_dir, reference, steps) -> None:
    got = read_metrics(run_dir)
    for step in steps:  # 2 x 2 devices against 4 in one process: float32 reduction order
        assert got[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5, abs=1e-5), step


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_two_processes_save_to_the_bucket_and_another_process_count_resumes(store, reference, tmp_path, request):
    """2 processes save step 4 (each uploads its own shards, one commit); 1 process resumes
    from it and saves step 8; on S3, 2 processes resume from that one-process step (2 -> 1 -> 2).
    The losses are the uninterrupted run's."""
    request.getfixturevalue(store)
    url = f"s3://{BUCKET}/spread" if store == "s3" else "gs://ckpts/spread"
    run_dir = tmp_path / "run"
    first = finish(two_processes(url, run_dir, tmp_path / "a", "trainer.stop_at=4"))
    assert committed_steps(url) == [4]
    every_committed_step_is_whole(url)
    from olmo_eqx.checkpoint.remote import RemoteSteps

    files = RemoteSteps(url).committed(4)["files"]
    # The shards of both processes are in the step: process 1's never touched process 0's disk.
    staged = sorted(p.relative_to(tmp_path / "a").as_posix() for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert not [p for p in staged if "/4" in p], staged  # both parts leave the staging dirs once committed
    # One zarr chunk file per shard, no OCDBT (whose merge reads every process's files on one disk).
    assert "model/embed/.zarray" in files and not [name for name in files if "ocdbt" in name], sorted(files)
    assert "4 cpu device(s)" in first[0]

    one_process(url, run_dir, tmp_path / "b", "trainer.stop_at=8")
    assert committed_steps(url) == [4, 8]
    assert_losses_continue(run_dir, reference, range(1, 9))
    if store == "s3":
        out = finish(two_processes(url, run_dir, tmp_path / "c"))
        assert f"Resuming from {url}/8 (step 8)" in out[0]
        assert committed_steps(url) == [8, 12]  # keep_last=2
        every_committed_step_is_whole(url)
        assert_losses_continue(run_dir, reference, range(1, 13))
