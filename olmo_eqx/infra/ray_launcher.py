"""Run one training job on a Ray cluster: one JAX process per Ray node, restarted from the
latest checkpoint when any of them fails.

    python -m olmo_eqx.infra.ray_launcher [--address ADDR] [--hosts N] [--resources JSON]
        [--max-restarts R] [--env NAME[=VALUE]]... [--placement-timeout S] [--grace S]
        -- +stage=pretrain hydra.run.dir=/shared/runs/my_run [overrides of `python -m olmo_eqx`]

What it does, in order:

1. The run directory. Every process of a multi-process run computes its own `${now:}` run
   directory, and a restart must find the first attempt's checkpoints, so the launcher pins
   one: the command's `hydra.run.dir` (made absolute against the launcher's working directory),
   or, when the command names none, `<working directory>/outputs/ray/<UTC date>/<UTC time>`,
   added to the command. The first line printed says which, and a derived one is named with
   the override that resumes it from a later launch. Every node must see that path (a shared
   file system), or the checkpoints must live on a bucket (`checkpoint.dir=gs://...`).
2. Connects to a running cluster (`ray.init(address=ADDR)`; `auto`, the default, is Ray's own
   choice: `RAY_ADDRESS`, else the cluster started on this machine). It never starts one.
3. Places the hosts: one placement group of N bundles of `--resources` each (default
   `{"CPU": 1}`), strategy `STRICT_SPREAD`, so every bundle is on a different node; N is
   `--hosts`, by default every alive node that has those resources. On a TPU pod give each
   bundle the host's chips, e.g. `--resources '{"TPU": 4}'` (a v5p or v4 host; a v5e host of a
   multi-host slice also has 4): Ray then hands the process those chips (`TPU_VISIBLE_CHIPS`).
   One small actor per bundle starts and watches the host's process.
4. Starts `python -m olmo_eqx <command>` on every host, with the Python the node's Ray runs,
   in the launcher's working directory (the same path on every node), in a session of its
   own, with
       JAX_COORDINATOR_ADDRESS = <process 0's node IP>:<a free port there>
       JAX_NUM_PROCESSES, JAX_PROCESS_ID = N, the host's rank
       OLMO_EQX_LAUNCHER = ray
   plus every `--env NAME=VALUE` (`--env NAME` passes the launcher's own value). The command
   starts `jax.distributed` from the first three (`olmo_eqx.sharding`). Ranks follow the nodes:
   a node keeps its rank from one attempt to the next while it is there, so process 0 (which
   holds the run directory's `run.lock`) stays on its host.
5. Streams every process's output, each line prefixed `[pK]`, and says each process's pid and
   node. When a process fails (a non-zero exit status, a signal, or its node lost), the others
   are killed by their process groups (SIGKILL: a checkpoint needs every process, so a
   survivor could only wait in a collective for its lost peer) and the whole job starts again, up to `--max-restarts` times (default 3): the same command on the
   same run directory, so it resumes from the newest committed checkpoint. A job whose
   processes all exit 0 ends the launcher with status 0.

   A refusal is not retried: exit status 2 is how `python -m olmo_eqx` says bad input (a
   config it refuses, a checkpoint it will not resume, a bucket that refuses writes), and
   the same command would be refused again. An attempt counts as refused when every process
   that failed on its own exited with 2 and none was killed by a signal or lost with its node
   (a process that saw its peer die also exits 2, naming the peer: that attempt is retried).
   The launcher then exits 2. After the last allowed attempt it exits with the failure's own
   status (128 + the signal for a killed process, 1 for a lost node).

Ctrl-C (SIGINT) or SIGTERM to the launcher reaches every process once as SIGTERM, so they save
a checkpoint together and stop (SIGKILL after `--grace` seconds, default 120); the launcher
then exits 128 + the signal, without restarting. A second one kills them at once. Bad launcher input (no cluster at the address, fewer nodes than
`--hosts`, a sweep's `-m`, no command) is one `error:` line and exit status 2.

What was run where: `tests/test_ray_launcher.py` starts a real two-node Ray cluster on one
machine, 4 fake CPU devices per process: the job's losses equal one process's on 8 devices;
`kill -9` of one process mid-run (checkpoints on moto's S3) restarts the job, which ends with a
final state bitwise equal to an uninterrupted job's; a node lost mid-run is said and the job
resumes on a node that joined since; a refused config is not retried. No TPU pod was used; the TPU resource and the
`TPU_VISIBLE_CHIPS` hand-over are Ray's (docs.ray.io, "Accelerator Support"), as Levanter's
launcher uses them (marin-community/levanter, `src/levanter/infra/ray_tpu.py`).
"""

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Optional

from olmo_eqx.errors import RunError

REFUSED = 2  # `python -m olmo_eqx`'s exit status for bad input
# Variables of an outer launcher that would make a process join the wrong job.
_INHERITED_CLUSTER_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "OLMO_EQX_LAUNCHER",
                                "OLMO_EQX_DISTRIBUTED")
# How often the launcher asks the hosts for output and status (seconds): the delay before it
# notices a failure and before a line appears.
POLL_S = 0.5
# How long a host may take to answer one poll before its node counts as lost (seconds).
HOST_TIMEOUT_S = 60.0


class LauncherError(RunError):
    """Bad launcher input or a cluster that cannot run the job: one line, exit status 2."""


def _say(text: str) -> None:
    print(f"[ray] {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# On each host: the actor that starts the process, hands its output over and stops it


def _kill_me_with_my_parent():
    """A function for the child to call between fork and exec that has the kernel SIGKILL it
    when the thread that started it (the actor's) dies (Linux's PR_SET_PDEATHSIG), so a killed
    actor, node or launcher never leaves a training process holding the host's devices; None
    elsewhere. libc is loaded here, in the parent: the child of a threaded process must not
    take the dynamic loader's lock."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)


class Host:
    """One host's process, held by a Ray actor on that host (`ray.remote(Host)`). Every method
    returns at once: Ray cannot cancel a running actor call, so none may wait on training."""

    def __init__(self):
        self._process: Optional[subprocess.Popen] = None
        self._lines: deque[str] = deque()
        self._reader: Optional[threading.Thread] = None

    def describe(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, command: list[str], env: dict, cwd: str) -> dict:
        """Start the process: {"pid": ...}, or {"error": ...} naming what this host lacks."""
        if not Path(cwd).is_dir():
            return {"error": f"the launcher's working directory {cwd} does not exist on host {socket.gethostname()}: "
                             "run the launcher from a directory every node has"}
        full_env = {k: v for k, v in os.environ.items() if k not in _INHERITED_CLUSTER_VARIABLES}
        full_env.update(env)
        full_env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
        self._process = subprocess.Popen(
            [sys.executable, "-m", "olmo_eqx", *command], env=full_env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True, preexec_fn=_kill_me_with_my_parent(),  # a group of its own, to signal whole
        )
        self._reader = threading.Thread(target=self._read, args=(self._process.stdout,), daemon=True)
        self._reader.start()
        return {"pid": self._process.pid}

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.append(line.rstrip("\n"))

    def poll(self) -> tuple[list[str], Optional[int]]:
        """The lines printed since the last poll, and the exit status once the process ended
        and its output is all read (negative: killed by that signal)."""
        returncode = self._process.poll()
        if returncode is not None:
            self._reader.join(timeout=5)
        lines = [self._lines.popleft() for _ in range(len(self._lines))]
        return lines, returncode

    def signal(self, signum: int) -> bool:
        """Signal the process's group; whether the process was still running (a process that
        had already ended failed on its own, not by this signal)."""
        if self._process is None or self._process.poll() is not None:
            return False
        try:
            os.killpg(self._process.pid, signum)
        except ProcessLookupError:
            return False
        return True


# ---------------------------------------------------------------------------------------------
# On the launcher's machine


@dataclass
class Options:
    address: str
    hosts: Optional[int]
    resources: dict
    max_restarts: int
    env: dict
    placement_timeout: float
    grace: float
    command: list[str]
    cwd: str


@dataclass
class Process:
    rank: int
    actor: Any
    node_id: str
    ip: str
    host: str
    pid: int = 0
    returncode: Optional[int] = None
    lost: str = ""  # why its node counts as lost
    stopped: bool = False  # the launcher signalled it
    last_lines: deque = field(default_factory=lambda: deque(maxlen=20))

    @property
    def running(self) -> bool:
        return self.returncode is None and not self.lost

    def where(self) -> str:
        return f"process {self.rank} (pid {self.pid} on {self.host}, {self.ip})"


@dataclass
class Outcome:
    status: int  # the launcher's exit status if this attempt is the last
    reason: str
    retry: bool


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every other refusal
        raise LauncherError(f"{message} (--help lists the options)")


def parse_args(argv: list[str]) -> Options:
    at = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:at], argv[at + 1:]
    parser = _Parser(
        prog="python -m olmo_eqx.infra.ray_launcher",
        description="Run `python -m olmo_eqx <command>` once per Ray node as one jax.distributed job; restart it "
                    "from the latest checkpoint when a process fails.",
        epilog="Everything after -- is the command of a single run, e.g. "
               "-- +stage=pretrain hydra.run.dir=/shared/runs/my_run",
    )
    parser.add_argument("--address", default="auto",
                        help="the Ray cluster (host:port of its head); 'auto' (default): RAY_ADDRESS, else the one "
                             "started on this machine")
    parser.add_argument("--hosts", type=int, default=None,
                        help="number of processes, one per node (default: every alive node with --resources)")
    parser.add_argument("--resources", default='{"CPU": 1}',
                        help='what each process holds on its node, as JSON (default {"CPU": 1}; a TPU host: '
                             '\'{"TPU": 4}\')')
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="how many times a failed job starts again from its latest checkpoint (default 3)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="a variable for every process (NAME alone: the launcher's own value); repeatable")
    parser.add_argument("--placement-timeout", type=float, default=300.0,
                        help="seconds to wait for the nodes of one attempt (default 300)")
    parser.add_argument("--grace", type=float, default=120.0,
                        help="when the launcher is interrupted: seconds the processes have after SIGTERM to save a "
                             "checkpoint and exit, before SIGKILL (default 120)")
    args = parser.parse_args(own)
    if not command:
        raise LauncherError("give the run's command after --, e.g. -- +stage=pretrain hydra.run.dir=/shared/runs/my_run")
    if any(a in ("-m", "--multirun") for a in command):
        raise LauncherError("-m (a sweep) in the command: the launcher runs one job; launch each of a sweep's runs "
                            "on its own, with its own hydra.run.dir")
    if args.hosts is not None and args.hosts < 1:
        raise LauncherError(f"--hosts {args.hosts}: give at least 1")
    if args.max_restarts < 0:
        raise LauncherError(f"--max-restarts {args.max_restarts}: give 0 or more")
    try:
        resources = json.loads(args.resources)
        if not isinstance(resources, dict) or not resources or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in resources.items()):
            raise ValueError
    except ValueError:
        raise LauncherError(f"--resources {args.resources!r}: give a JSON object of positive amounts, "
                            'e.g. \'{"CPU": 1}\' or \'{"TPU": 4}\'') from None
    env = {}
    for item in args.env:
        name, eq, value = item.partition("=")
        if not name:
            raise LauncherError(f"--env {item!r}: give NAME=VALUE or NAME")
        if not eq:
            if name not in os.environ:
                raise LauncherError(f"--env {name}: it is not set here; give --env {name}=VALUE")
            value = os.environ[name]
        env[name] = value
    return Options(args.address, args.hosts, resources, args.max_restarts, env, args.placement_timeout, args.grace,
                   command, os.getcwd())


def pin_run_dir(command: list[str], cwd: str, now: Optional[time.struct_time] = None) -> tuple[list[str], str, bool]:
    """The command with an absolute `hydra.run.dir`, that dir, and whether the command named it."""
    for i, arg in enumerate(command):
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra.run.dir":
            if not value:
                raise LauncherError("hydra.run.dir= is empty: name the run directory every host shares")
            run_dir = str(Path(cwd, value)) if not Path(value).is_absolute() else value
            return [*command[:i], f"hydra.run.dir={run_dir}", *command[i + 1:]], run_dir, True
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S", now or time.gmtime())
    run_dir = str(Path(cwd, "outputs", "ray", stamp))
    return [*command, f"hydra.run.dir={run_dir}"], run_dir, False


def _import_ray():
    try:
        import ray
    except ImportError:
        raise LauncherError("the Ray launcher needs Ray: pip install 'olmo_eqx[ray]' (on every node too)") from None
    return ray


def _reachable(address: str, timeout: float = 10.0) -> Optional[str]:
    """None when HOST:PORT accepts a connection (or is not HOST:PORT), else why not: Ray's own
    client retries an unreachable head for ever."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def connect(ray, address: str) -> None:
    if address != "auto" and (why := _reachable(address)):
        raise LauncherError(f"no Ray cluster at {address} ({why}): start one there (ray start --head --port PORT) or "
                            "name its head with --address HOST:PORT")
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "RAY_ADDRESS or this machine" if address == "auto" else address
        raise LauncherError(f"no Ray cluster at {where} ({str(e).splitlines()[0]}): start one (ray start --head) "
                            "or name its head with --address HOST:PORT") from None


def eligible_nodes(ray, resources: dict) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive") and all(n["Resources"].get(k, 0) >= v for k, v in resources.items())]


class Attempt:
    """One start of the whole job: placement, processes, monitoring, stop."""

    def __init__(self, ray, options: Options, hosts: int, number: int, previous_ranks: dict[str, int]):
        self.ray, self.options, self.hosts, self.number = ray, options, hosts, number
        self.previous_ranks = previous_ranks
        self.group = None
        self.processes: list[Process] = []
        self.interrupted: Optional[int] = None

    def place(self) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, resources = self.ray, self.options.resources
        self.group = placement_group([dict(resources)] * self.hosts, strategy="STRICT_SPREAD")
        ready, deadline = self.group.ready(), time.monotonic() + self.options.placement_timeout
        # In slices, so that Ctrl-C while nodes are awaited stops the launcher at once.
        while not ray.wait([ready], timeout=1.0)[0] and time.monotonic() < deadline:
            if self.interrupted is not None:
                return
        if not ray.wait([ready], timeout=0)[0]:
            have = len(eligible_nodes(ray, resources))
            fix = f"add nodes, or give --hosts {have}" if have else "give --resources that the nodes have (ray status)"
            raise LauncherError(
                f"could not place {self.hosts} processes with {json.dumps(resources)} each on distinct nodes within "
                f"{self.options.placement_timeout:g} s: {have} alive node(s) have those resources; {fix}")
        remote_host = ray.remote(Host)
        cpus = resources.get("CPU", 0)
        others = {k: v for k, v in resources.items() if k != "CPU"}
        actors = [
            remote_host.options(
                num_cpus=cpus, resources=others, max_restarts=0, max_concurrency=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            ).remote()
            for i in range(self.hosts)
        ]
        described = ray.get([a.describe.remote() for a in actors], timeout=HOST_TIMEOUT_S)
        order = sorted(range(self.hosts), key=lambda i: (self.previous_ranks.get(described[i]["node_id"], self.hosts), i))
        self.processes = [Process(rank, actors[i], **described[i]) for rank, i in enumerate(order)]

    def start(self) -> None:
        ray, first = self.ray, self.processes[0]
        port = ray.get(first.actor.free_port.remote(), timeout=HOST_TIMEOUT_S)
        coordinator = f"{first.ip}:{port}"
        started = ray.get([
            p.actor.start.remote(self.options.command, {
                **self.options.env, "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(self.hosts),
                "JAX_PROCESS_ID": str(p.rank), "OLMO_EQX_LAUNCHER": "ray"}, self.options.cwd)
            for p in self.processes
        ], timeout=HOST_TIMEOUT_S)
        errors = [s["error"] for s in started if "error" in s]
        for p, answer in zip(self.processes, started):
            p.pid = answer.get("pid", 0)
        if errors:
            raise LauncherError(errors[0])
        _say(f"attempt {self.number}: {self.hosts} processes, coordinator {coordinator}; "
             + ", ".join(f"process {p.rank}: pid {p.pid} on {p.host} ({p.ip}, node {p.node_id[:8]})"
                         for p in self.processes))

    def _poll_all(self) -> None:
        running = [p for p in self.processes if p.running]
        if not running:
            return
        refs = [p.actor.poll.remote() for p in running]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=HOST_TIMEOUT_S)
        ready = set(ready)
        for p, ref in zip(running, refs):
            if ref not in ready:
                p.lost = f"its host did not answer for {HOST_TIMEOUT_S:g} s"
                continue
            try:
                lines, returncode = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                p.lost = f"its node or actor was lost ({type(e).__name__})"
                continue
            for line in lines:
                print(f"[p{p.rank}] {line}", flush=True)
                p.last_lines.append(line)
            p.returncode = returncode

    def _failed(self) -> list[Process]:
        return [p for p in self.processes if p.lost or (p.returncode not in (None, 0) and not p.stopped)]

    def _signal_running(self, signum: int) -> None:
        for p in self.processes:
            if p.running:
                with contextlib.suppress(self.ray.exceptions.RayError, ValueError):
                    p.stopped = self.ray.get(p.actor.signal.remote(signum), timeout=HOST_TIMEOUT_S) or p.stopped

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(p.running for p in self.processes) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            self._poll_all()

    def stop(self, grace: float = 0.0) -> None:
        """Stop every running process's group: SIGTERM and `grace` seconds to save a checkpoint
        and exit, then SIGKILL. After a failure there is no grace: a checkpoint needs every
        process, and a survivor would only wait in a collective for its lost peer."""
        if grace > 0:
            self._signal_running(signal.SIGTERM)
            self._wait(grace)
        self._signal_running(signal.SIGKILL)
        self._wait(HOST_TIMEOUT_S)
        for p in self.processes:
            if p.running:
                p.lost = "it did not end after SIGKILL"

    def run(self) -> Outcome:
        """Start and watch the job until it ends; what ended it."""
        try:
            self.start()
        except LauncherError:
            self.stop()
            raise
        except self.ray.exceptions.RayError as e:
            self.stop()
            return Outcome(1, f"a host was lost while the processes started ({type(e).__name__})", True)
        forwarded = False
        while True:
            time.sleep(POLL_S)
            self._poll_all()
            if self.interrupted is not None and not forwarded:
                forwarded = True
                _say(f"{signal.Signals(self.interrupted).name}: SIGTERM to every process (they save a checkpoint "
                     f"together and stop; SIGKILL after {self.options.grace:g} s)")
                self.stop(self.options.grace)
            if self._failed():
                self.stop()
                return self.judge()
            if all(not p.running for p in self.processes):
                if self.interrupted is not None:
                    return Outcome(128 + self.interrupted, f"stopped by {signal.Signals(self.interrupted).name}", False)
                return Outcome(0, "every process exited 0", False)

    def judge(self) -> Outcome:
        # Every failure that happened on its own, whether seen first or while stopping the rest.
        failed = self._failed()
        killed = [p for p in failed if not p.lost and p.returncode < 0]
        lost = [p for p in failed if p.lost]
        described = []
        for p in failed:
            if p.lost:
                described.append(f"{p.where()}: {p.lost}")
            elif p.returncode < 0:
                described.append(f"{p.where()} was killed by {signal.Signals(-p.returncode).name}")
            else:
                error = next((line for line in reversed(p.last_lines) if line.startswith("error:")), "")
                described.append(f"{p.where()} exited with status {p.returncode}" + (f" ({error})" if error else ""))
        reason = "; ".join(described)
        if self.interrupted is not None:
            return Outcome(128 + self.interrupted, f"stopped by {signal.Signals(self.interrupted).name}; {reason}", False)
        if not killed and not lost and all(p.returncode == REFUSED for p in failed):
            return Outcome(REFUSED, reason, False)
        status = 128 - killed[0].returncode if killed else 1 if lost else failed[0].returncode
        return Outcome(status, reason, True)

    def release(self) -> None:
        for p in self.processes:
            with contextlib.suppress(self.ray.exceptions.RayError, ValueError):
                self.ray.kill(p.actor, no_restart=True)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(self.ray.exceptions.RayError, ValueError):
                remove_placement_group(self.group)


def launch(options: Options) -> int:
    options.command, run_dir, given = pin_run_dir(options.command, options.cwd)
    _say(f"run dir {run_dir} (" + ("hydra.run.dir of the command" if given else
         f"derived; a later launch resumes it with hydra.run.dir={run_dir}") + "), shared by every process and attempt")
    ray = _import_ray()
    connect(ray, options.address)
    try:
        hosts = options.hosts or len(eligible_nodes(ray, options.resources))
        if not hosts:
            raise LauncherError(f"no alive node of the cluster has {json.dumps(options.resources)}: give --resources "
                                "that the nodes have (ray status lists them)")
        _say(f"cluster {ray.get_runtime_context().gcs_address}: {hosts} processes, one per node, each with "
             f"{json.dumps(options.resources)}; up to {options.max_restarts} restart(s)")
        received: list[int] = []
        current: list[Attempt] = []

        def on_signal(signum, _frame):
            received.append(signum)
            if current:
                if len(received) == 1:
                    current[0].interrupted = signum
                else:
                    for p in current[0].processes:
                        if p.running:
                            p.actor.signal.remote(signal.SIGKILL)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        ranks: dict[str, int] = {}
        try:
            for number in range(1, options.max_restarts + 2):
                if received:  # between attempts
                    _say(f"{signal.Signals(received[0]).name}: no further attempt; exit status {128 + received[0]}")
                    return 128 + received[0]
                attempt = Attempt(ray, options, hosts, number, ranks)
                current[:] = [attempt]
                try:
                    try:
                        attempt.place()
                    except LauncherError as e:
                        if number == 1:
                            raise
                        outcome = Outcome(1, str(e), True)
                    except ray.exceptions.RayError as e:  # a node lost while its actor started
                        outcome = Outcome(1, f"placing the processes failed ({type(e).__name__})", True)
                    else:
                        ranks = {p.node_id: p.rank for p in attempt.processes} or ranks
                        outcome = attempt.run() if attempt.processes else Outcome(
                            128 + received[0], f"stopped by {signal.Signals(received[0]).name} while placing", False)
                finally:
                    attempt.release()
                if outcome.status == 0:
                    _say(f"attempt {number}: done, {outcome.reason}")
                    return 0
                if not outcome.retry:
                    why = ("not retried: exit status 2 is a refusal of the command's input, which another attempt "
                           "would meet again" if outcome.status == REFUSED and attempt.interrupted is None else
                           "not retried")
                    _say(f"attempt {number} ended: {outcome.reason}; {why}; exit status {outcome.status}")
                    return outcome.status
                if number <= options.max_restarts:
                    _say(f"attempt {number} ended: {outcome.reason}; restarting the job (attempt {number + 1} of "
                         f"at most {options.max_restarts + 1}): the same command on the same run dir resumes from its latest "
                         "checkpoint")
                else:
                    _say(f"attempt {number} ended: {outcome.reason}; no restarts left (--max-restarts "
                         f"{options.max_restarts}); exit status {outcome.status}")
                    return outcome.status
            raise AssertionError("unreachable")
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        ray.shutdown()


def main(argv: Optional[list[str]] = None) -> NoReturn:
    try:
        options = parse_args(sys.argv[1:] if argv is None else argv)
        status = launch(options)
    except LauncherError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        status = REFUSED
    sys.exit(status)


if __name__ == "__main__":
    main()
