"""Every process of a multi-process run checkpoints to the bucket (`checkpoint.dir=s3://...`,
`gs://...`): real `jax.distributed` processes over 127.0.0.1, each with a staging dir of its
own (hosts without a shared file system), on moto's S3 server and on `rangeserver.py`'s
emulation of GCS's JSON API. Each process uploads the files it wrote, process 0 commits the
step once all landed; a resume on another process count reads it; a process killed mid-upload
leaves no committed step lacking a file."""

import contextlib
import json
import os
import signal
import sys
import time
from typing import Optional

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


# `python -m olmo_eqx` whose uploads of step $STALL_AT's files stall from the third one on
# (after printing STALLED), so that the test can kill the process mid-upload.
STALLING = """
import os, runpy, sys, threading, time
from olmo_eqx.checkpoint import remote
stall_at, calls, lock = os.environ.get("STALL_AT"), [], threading.Lock()
def stalling(put):
    def put_file(self, name, path):
        if stall_at and name.startswith(stall_at + "/"):
            with lock:
                calls.append(name)
                if len(calls) == 3:
                    print("STALLED", flush=True)
            if len(calls) >= 3:
                time.sleep(600)
        return put(self, name, path)
    return put_file
remote.S3Objects.put_file = stalling(remote.S3Objects.put_file)
remote.GcsObjects.put_file = stalling(remote.GcsObjects.put_file)
sys.argv[0] = "olmo_eqx"
runpy.run_module("olmo_eqx", run_name="__main__", alter_sys=True)
"""


def two_processes(url: str, run_dir, staging, *extra: str, stall_at: Optional[int] = None) -> list:
    """Start the command on 2 processes x 2 devices, each with its own staging dir (process 1's
    uploads of step `stall_at` stall: `STALLING`)."""
    command = [sys.executable, "-m", "olmo_eqx"] if stall_at is None else [sys.executable, "-c", STALLING]
    args = [*command, *ARGS, f"checkpoint.dir={url}", f"hydra.run.dir={run_dir}", *extra]
    environments = {i: {"OLMO_EQX_CHECKPOINT_STAGING": str(staging / f"host{i}")} for i in range(2)}
    if stall_at is not None:
        environments[1]["STALL_AT"] = str(stall_at)
    return launch_local_cluster(args, merge_stderr=True, rank_env=environments)


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


def test_two_processes_save_to_s3_resume_on_one_then_two_and_a_kill_mid_upload_commits_nothing(s3, reference, tmp_path):
    """2 processes save step 4 (each uploads its own shards, one commit); 1 process resumes
    from it and saves step 8; 2 processes resume from that one-process step (2 -> 1 -> 2), and
    process 1 is killed mid-upload of step 12: not committed; one rerun of the same processes
    uploads it from their staging dirs. The losses are the uninterrupted run's."""
    client, url, run_dir = s3, f"s3://{BUCKET}/spread", tmp_path / "run"
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

    # 1 -> 2: two processes resume from the one-process step; process 1 is killed (SIGKILL)
    # mid-upload of step 12, once process 0's part has landed: no commit of step 12.
    from olmo_eqx.checkpoint.remote import STAGED_RECORD

    processes = two_processes(url, run_dir, tmp_path / "c", stall_at=12)
    for line in processes[1].stdout:
        if line.startswith("STALLED"):
            break
    else:
        pytest.fail(f"process 1 never reached step 12's upload: {finish(processes)}")
    os.kill(processes[1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while "12/digests.json" not in keys(client, "spread/") and time.monotonic() < deadline:
        time.sleep(0.5)  # process 0 uploads its part (its digests.json among them), then waits
    time.sleep(2)
    assert "12/digests.json" in keys(client, "spread/") and "12/committed.json" not in keys(client, "spread/")
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)  # the job is lost
        process.communicate()
    assert committed_steps(url) == [4, 8]
    every_committed_step_is_whole(url)
    record = json.loads((run_dir / STAGED_RECORD).read_text())
    assert list(record) == ["12"] and record["12"]["processes"] == 2
    # A rerun elsewhere (another staging dir) would resume from step 8, and says where step 12 is.
    from olmo_eqx.checkpoint import Checkpointer
    from olmo_eqx.train.setup import _never_uploaded

    with Checkpointer(url, staging=tmp_path / "elsewhere", staged_record=run_dir / STAGED_RECORD) as elsewhere:
        assert elsewhere.all_steps() == [4, 8]
        (note,) = _never_uploaded(elsewhere, 8)
    host0 = tmp_path / "c" / "host0"
    assert note.startswith(f"checkpoint step 12 was saved by 2 processes in their staging dirs (process 0's: "
                           f"{record['12']['path']} on host "), note
    assert note.endswith(f"each with its OLMO_EQX_CHECKPOINT_STAGING (process 0's: {host0}), which uploads it first"), note

    # One rerun of the same processes with their staging dirs uploads step 12 first, and
    # resumes from it (nothing is left to train); the losses are those of the uninterrupted run.
    out = finish(two_processes(url, run_dir, tmp_path / "c"))
    assert f"Resuming from {url}/12 (step 12)" in out[0], out[0][-3000:]
    assert committed_steps(url) == [8, 12]  # keep_last=2
    every_committed_step_is_whole(url)
    assert_losses_continue(run_dir, reference, range(1, 13))
    assert not (run_dir / STAGED_RECORD).exists()


def test_on_gcs_two_processes_resume_a_one_process_run_each_verifying_what_it_reads(gcs, reference, tmp_path):
    """1 -> 2 processes on GCS's JSON API: a one-process run saves steps 4 and 8; step 8's
    largest object is damaged in the bucket. Both processes download and verify it, agree it is
    unusable, step 8 is marked set aside once and both resume from step 4; their step 8 and 12
    are committed (the marked objects copied aside first), with the uninterrupted run's losses."""
    url, run_dir, bucket_dir = "gs://ckpts/spread", tmp_path / "run", tmp_path / "served" / "ckpts" / "spread"
    one_process(url, run_dir, tmp_path / "a", "trainer.stop_at=8")
    assert committed_steps(url) == [4, 8]
    weights = max((p for p in (bucket_dir / "8" / "model").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[40:48] = bytes(8)
    weights.write_bytes(bytes(data))

    out = finish(two_processes(url, run_dir, tmp_path / "b"))
    damaged = weights.relative_to(bucket_dir / "8").as_posix()
    assert (f"checkpoint {url}/8 (step 8) is unusable: {damaged}: contents changed since the save (sha256 differs, "
            f"same size); set aside: {url}/8/set_aside.json; falling back to step 4") in out[0], out[0][-3000:]
    assert f"Resuming from {url}/4 (step 4)" in out[0]
    assert committed_steps(url) == [8, 12]
    every_committed_step_is_whole(url)
    assert [p.name.split("-")[0] for p in (bucket_dir / "set_aside").iterdir()] == ["8"]
    assert_losses_continue(run_dir, reference, range(1, 13))
