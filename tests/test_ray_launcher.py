"""The Ray launcher (`python -m olmo_eqx.infra.ray_launcher`) on a real Ray cluster of two nodes
on this machine (`ray start --head` and a second `ray start --address`), one `python -m olmo_eqx`
process per node with 4 fake CPU devices each: the job trains like one process on 8 devices, and
`kill -9` of one process mid-run makes the launcher restart the whole job, which resumes (from
moto's S3) and ends with the final state of an uninterrupted job, bit for bit; a lost node is
replaced; a refusal is not retried.

The tests on the cluster are marked `ray` (about 3.5 minutes: a cluster and five multi-process
runs on 2 shared cores); the suite's default run leaves them out (`-m "not ray"` in pyproject's addopts)
and CI runs them as a step of their own: `python -m pytest -m ray -n 0`.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import jax
import numpy as np
import pytest

from clihelp import TINY, olmo_eqx, xla_flags
from localcluster import free_port
from test_checkpoint_remote import BUCKET, s3  # noqa: F401 (the fixture: moto's S3 server on 127.0.0.1)

# Four checkpoints in twelve steps, so the kill lands after a committed one with steps to go.
JOB = [a for a in TINY if not a.startswith("checkpoint.every")] + ["checkpoint.every=4"]
LAUNCHER = [sys.executable, "-m", "olmo_eqx.infra.ray_launcher"]
RAY_CLI = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def _bare_environment() -> dict:
    """The suite's environment for a Ray node (its compile cache, its CPU-peak cache), minus
    the test process's own device count and pytest's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "JAX_COORDINATOR", "JAX_NUM_PROC",
                                                                     "JAX_PROCESS", "RAY_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), RAY_USAGE_STATS_ENABLED="0")
    return env


class Cluster:
    """A head node and a worker node, each `ray start --block` in a session of its own, staging
    checkpoints for a bucket in a directory of its own (as hosts without a shared disk): stopping
    one is signalling its process group (Ray's daemons and workers are in it), never `ray stop`,
    which stops every Ray process of the user on the machine."""

    def __init__(self):
        # Short: Ray's unix sockets live under it (a socket path holds at most 107 bytes).
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str]) -> None:
        log = open(Path(self.temp_dir) / f"{name}.log", "w")
        ports = ["--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                 "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
                 "--metrics-export-port", str(free_port())]
        self.nodes.append(subprocess.Popen(
            [*RAY_CLI, "start", "--block", "--num-cpus", "1", "--object-store-memory", str(80 * 2**20),
             "--disable-usage-stats", *ports, *args],
            env={**_bare_environment(), "OLMO_EQX_CHECKPOINT_STAGING": str(Path(self.temp_dir) / f"staging-{name}")},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 120
        while "block forever" not in (Path(self.temp_dir) / f"{name}.log").read_text():
            if self.nodes[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start ({name}) failed:\n" + (Path(self.temp_dir) / f"{name}.log").read_text())
            time.sleep(0.2)

    def start(self) -> "Cluster":
        self._start("head", ["--head", "--port", str(self.port), "--include-dashboard", "false",
                             "--dashboard-port", str(free_port()), "--temp-dir", self.temp_dir])
        return self.add_worker()

    def add_worker(self) -> "Cluster":
        self._start(f"worker{len(self.nodes)}", ["--address", self.address])
        return self

    def stop(self) -> None:
        # SIGKILL to the whole group at once: `ray start --block` given SIGTERM took over 30 s to
        # take its daemons down here, and nothing of a test cluster needs to outlive it.
        for node in reversed(self.nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


class Launch:
    """`python -m olmo_eqx.infra.ray_launcher` running, its output collected as it comes."""

    started: list["Launch"] = []

    def __init__(self, cluster: Cluster, job: list[str], env: Optional[dict] = None, options: Sequence[str] = ()):
        Launch.started.append(self)
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [*LAUNCHER, "--address", cluster.address, "--hosts", "2", "--placement-timeout", "120",
             "--env", f"XLA_FLAGS={xla_flags(4)}", *options, "--", *job],
            env={**_bare_environment(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def wait(self, timeout: float = 600) -> tuple[int, str]:
        try:
            self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)  # the launcher stops its processes
                self.process.wait(timeout=60)
        self._reader.join(timeout=10)
        return self.process.returncode, "".join(self.lines)

    def pid_of(self, rank: int, attempt: int = 1) -> int:
        pattern = re.compile(rf"\[ray\] attempt {attempt}: .*process {rank}: pid (\d+)")
        for line in list(self.lines):
            if match := pattern.search(line):
                return int(match.group(1))
        raise LookupError(f"attempt {attempt} has not started process {rank}:\n{''.join(self.lines)}")


@pytest.fixture(autouse=True)
def no_launcher_outlives_its_test():
    """A test that fails before waiting for its launcher: Ctrl-C to it (it stops its processes)."""
    yield
    while Launch.started:
        launch = Launch.started.pop()
        if launch.process.poll() is None:
            launch.process.send_signal(signal.SIGINT)
            try:
                launch.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launch.process.kill()
                launch.process.wait()


def read_losses(run_dir: Path) -> dict[int, float]:
    """Train losses by step (the last record of a step wins, as after a resume's replay)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """The job through the launcher, never interrupted: its run dir and output."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    returncode, output = Launch(cluster, [*JOB, f"hydra.run.dir={run_dir}"]).wait()
    assert returncode == 0, output
    return run_dir, output


@pytest.mark.ray
def test_the_job_trains_like_one_process_on_8_devices(uninterrupted, tmp_path):
    run_dir, output = uninterrupted
    assert output.startswith(f"[ray] run dir {run_dir} (hydra.run.dir of the command)")
    assert re.search(r"\[ray\] attempt 1: 2 processes, coordinator \S+:\d+; process 0: pid \d+ .*process 1: pid \d+",
                     output)
    assert "[p0] olmo3_nano: " in output and "8 cpu device(s)" in output  # one runtime over both processes
    # The run names the launcher that started it (OLMO_EQX_LAUNCHER=ray), with both processes.
    assert re.search(r"^\[p0\] cluster: ray \(.*\), 2 processes x 4 cpu devices, mesh slice=1 ", output, re.M), output
    assert "[ray] attempt 1: done, every process exited 0" in output and "attempt 2" not in output
    single = olmo_eqx(*JOB, f"hydra.run.dir={tmp_path}", env={"XLA_FLAGS": xla_flags(8)})
    assert single.returncode == 0, single.stderr
    reference, job = read_losses(tmp_path), read_losses(run_dir)
    assert sorted(job) == sorted(reference) == list(range(1, 13))
    for step, loss in reference.items():  # 2 x 4 devices against 1 x 8: float32 reduction order
        assert job[step] == pytest.approx(loss, rel=1e-5, abs=1e-5), step


def s3_checkpoints(tmp_path: Path):
    """`checkpoint.dir` on moto's S3 (each node stages its shards on its own disk): the
    override, the committed steps so far, the location to read them from, and the launcher
    options that hand every process the store's endpoint and credentials."""
    from olmo_eqx.checkpoint.remote import RemoteSteps

    url = f"s3://{BUCKET}/{tmp_path.name}"
    aws = [option for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
           for option in ("--env", name)]
    return f"checkpoint.dir={url}", lambda: RemoteSteps(url).committed_steps(), url, aws


@pytest.mark.ray
@pytest.mark.parametrize("where", ["s3"])
def test_kill_9_of_one_process_restarts_the_job_which_resumes_bitwise(cluster, uninterrupted, s3, tmp_path, where):
    from olmo_eqx.checkpoint import Checkpointer
    from olmo_eqx.config import compose_config
    from olmo_eqx.sharding import MeshConfig, make_mesh
    from olmo_eqx.train.state import sharded_abstract_train_state

    setting, committed, location, options = {"s3": s3_checkpoints}[where](tmp_path)
    run_dir = tmp_path / "run"
    launch = Launch(cluster, [*JOB, setting, f"hydra.run.dir={run_dir}"], options=["--max-restarts", "1", *options])
    deadline = time.monotonic() + 400
    while not committed() and launch.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert committed(), "".join(launch.lines)
    victim = launch.pid_of(1)
    os.kill(victim, signal.SIGKILL)
    killed_after = committed()[-1]
    returncode, output = launch.wait()
    assert returncode == 0, output
    assert f"[ray] attempt 1 ended: process 1 (pid {victim} " in output and "was killed by SIGKILL; restarting" in output
    assert "[ray] attempt 2: done" in output
    first, second = output.split("[ray] attempt 2:", 1)
    assert "steps 0 -> 12" in first and "step     12/12" not in first  # the kill landed mid-run
    resumed = re.search(r"\[p0\] Resuming from \S+ \(step (\d+)\)", second)
    assert resumed and killed_after <= int(resumed.group(1)) < 12, output

    # The final checkpoints, read with the project's own reader onto this process's 8 devices.
    config = compose_config(JOB)
    mesh = make_mesh(MeshConfig())
    target = sharded_abstract_train_state(config.model, config.optim, mesh)
    finals = []
    for directory in (location, str(uninterrupted[0] / "checkpoints")):
        with Checkpointer(directory, read_only=True, staging=tmp_path / "reader") as checkpointer:
            assert checkpointer.latest_step() == 12
            finals.append(checkpointer.restore(12, target=target))
    leaves = [jax.tree.leaves(jax.tree.map(np.asarray, r.state)) for r in finals]
    assert len(leaves[0]) == len(leaves[1]) > 0
    for a, b in zip(*leaves):
        np.testing.assert_array_equal(a, b)
    assert finals[0].loader_state == finals[1].loader_state


@pytest.mark.ray
def test_a_lost_node_is_replaced_and_the_job_resumes_on_the_new_one(cluster, uninterrupted, tmp_path):
    """Every Ray process of one node killed at once (a host gone) after a checkpoint: the
    launcher says the node was lost, waits for the nodes of the next attempt, and the job
    resumes on a node that joined since, ending with the uninterrupted job's losses exactly."""
    run_dir = tmp_path / "run"
    launch = Launch(cluster, [*JOB, f"hydra.run.dir={run_dir}"], options=["--max-restarts", "1"])
    deadline = time.monotonic() + 400
    while not list(run_dir.glob("checkpoints/*/commit_success.txt")) and launch.process.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launch.process.poll() is None, "".join(launch.lines)
    lost = cluster.nodes[1]
    os.killpg(lost.pid, signal.SIGKILL)
    lost.wait(timeout=30)
    cluster.add_worker()
    returncode, output = launch.wait()
    assert returncode == 0, output
    assert re.search(r"\[ray\] attempt 1 ended: process \d \(pid \d+ on \S+, \S+\): its node or actor was lost", output)
    first, second = output.split("[ray] attempt 2:", 1)
    assert "step     12/12" not in first and re.search(r"\[p0\] Resuming from \S+ \(step \d+\)", second), output
    assert read_losses(run_dir) == read_losses(uninterrupted[0])


@pytest.mark.ray
def test_a_refused_config_is_not_retried(cluster, tmp_path):
    returncode, output = Launch(cluster, [*JOB, "optim.lr=-1", f"hydra.run.dir={tmp_path / 'run'}"]).wait()
    assert returncode == 2, output
    # Each process refuses it on its own; whichever ended first is named, with its error line.
    assert re.search(r"\[ray\] attempt 1 ended: process \d \(pid \d+ on \S+, \S+\) exited with status 2 "
                     r"\(error: .*optim\.lr", output), output
    assert "not retried: exit status 2 is a refusal" in output and "attempt 2" not in output


@pytest.mark.parametrize("args, message", [
    ([], "give the run's command after --"),
    (["--", "-m", "+stage=pretrain", "optim.lr=1e-3,3e-3"], "-m (a sweep) in the command"),
    (["--resources", "[1]", "--", "+stage=pretrain"], "--resources '[1]': give a JSON object"),
    (["--env", "OLMO_EQX_SURELY_UNSET", "--", "+stage=pretrain"], "--env OLMO_EQX_SURELY_UNSET: it is not set here"),
    (["--hosts", "two", "--", "+stage=pretrain"], "argument --hosts: invalid int value: 'two' (--help lists"),
])
def test_bad_launcher_input_is_one_line_before_any_cluster_is_reached(args, message, capsys):
    from olmo_eqx.infra.ray_launcher import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
def test_a_derived_run_dir_is_absolute_and_named_with_the_override_that_resumes_it():
    from olmo_eqx.infra.ray_launcher import pin_run_dir

    now = time.strptime("2026-12-07 06:10:56", "%Y-%m-%d %H:%M:%S")
    command, run_dir, given = pin_run_dir(["+stage=pretrain"], "/work", now)
    assert (command, run_dir, given) == (["+stage=pretrain", "hydra.run.dir=/work/outputs/ray/2026-12-07/06-10-56"],
                                         "/work/outputs/ray/2026-12-07/06-10-56", False)
    command, run_dir, given = pin_run_dir(["hydra.run.dir=runs/a", "x=1"], "/work")
    assert (command, run_dir, given) == (["hydra.run.dir=/work/runs/a", "x=1"], "/work/runs/a", True)


@pytest.mark.parametrize("ends, status, retry", [
    ([(-9, False, ""), (2, False, "")], 137, True),  # a peer that saw process 0 killed exits 2: retried
    ([(2, False, ""), (-9, True, "")], 2, False),  # killed by the launcher after the refusal: refused
    ([(2, False, ""), (2, False, "")], 2, False),  # both refused the config
    ([(2, False, ""), (None, True, "its node or actor was lost (ActorDiedError)")], 1, True),
    ([(1, False, ""), (-9, True, "")], 1, True),  # a crash (a traceback) is retried
])
def test_what_ends_an_attempt_and_whether_it_is_retried(ends, status, retry):
    """An attempt is a refusal (exit status 2, not retried) only when every process that failed
    on its own exited 2, none killed by a signal or lost with its node; the processes the
    launcher itself killed after the first failure do not count."""
    from olmo_eqx.infra.ray_launcher import Attempt, Options, Process

    options = Options("auto", 2, {"CPU": 1}, 3, {}, 300.0, 120.0, ["+stage=pretrain"], "/work")
    attempt = Attempt(None, options, len(ends), 1, {})
    attempt.processes = [Process(rank, None, f"node{rank}", "10.0.0.1", f"host{rank}", pid=100 + rank,
                                 returncode=code, stopped=stopped, lost=lost)
                         for rank, (code, stopped, lost) in enumerate(ends)]
    outcome = attempt.judge()
    assert (outcome.status, outcome.retry) == (status, retry), outcome.reason


def test_an_address_nobody_listens_on_is_named_at_once():
    """Ray's client retries an unreachable head for ever; the launcher asks the port first."""
    from olmo_eqx.infra.ray_launcher import _reachable

    assert _reachable(f"127.0.0.1:{free_port()}") == "Connection refused"
    assert _reachable("auto") is None
