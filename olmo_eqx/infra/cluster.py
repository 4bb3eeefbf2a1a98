"""Which cluster this process runs in, and starting JAX's multi-controller runtime there.

Every host of a job runs the same `python -m olmo_eqx ...`; what tells the hosts apart is the
environment their launcher gave them. `detect_cluster` reads it, in JAX's own order
(`jax/_src/clusters/`: Open MPI, SLURM, GKE TPU pods, GCE TPU VMs), after the explicit
`JAX_COORDINATOR_ADDRESS` that any launcher (ours for Ray included) may set:

  kind        read from                                              processes
  jax / ray   JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,            as given
              JAX_PROCESS_ID (OLMO_EQX_LAUNCHER names the launcher)
  ompi        OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE/RANK       mpirun's -n
  slurm       SLURM_NTASKS > 1, SLURM_PROCID (+ JAX's SLURM reads)   srun's tasks
  gke-tpu     TPU_WORKER_HOSTNAMES (or TPU_PROCESS_ADDRESSES),       hosts x slices
              TPU_WORKER_ID; MEGASCALE_COORDINATOR_ADDRESS,
              MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID for slices
  tpu-vm-pod  the GCE metadata server: agent-worker-number,          hosts x slices
              worker-network-endpoints (and tpu-env for slices)
  auto        OLMO_EQX_DISTRIBUTED=1: JAX's bare detection           whatever JAX finds
  local       nothing of the above, or a pod of one host             1: no jax.distributed

Process ids across slices are JAX's: `worker id + slice id * hosts per slice`; the coordinator
is process 0's host (the megascale coordinator where slices are joined) on JAX's TPU port,
or `JAX_COORDINATOR_PORT` where that is set (JAX reads the same variable).

On a real TPU VM JAX's TPU detectors fire, so the runtime starts bare
(`jax.distributed.initialize()`), exactly as MaxText starts it. JAX's TPU detectors also
insist on TPU chips, so elsewhere (a CPU host mimicking a pod) the same figures are passed
explicitly; either way they are the figures JAX's detectors compute.

A host whose peers never arrive stops after `OLMO_EQX_PEER_TIMEOUT_S` seconds (default 300,
JAX's own) with one line naming who is missing (`RollCall` finds out which): JAX's runtime
itself aborts the process with a C++ stack trace instead, a little later (its timeout is set
past ours).
"""

import dataclasses
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import jax
from jax.sharding import Mesh

from olmo_eqx.errors import RunError

PEER_TIMEOUT_ENV = "OLMO_EQX_PEER_TIMEOUT_S"
DEFAULT_PEER_TIMEOUT_S = 300.0
# JAX's own timeout runs this much past ours: ours says who is missing, JAX's aborts.
_JAX_GRACE_S = 60
# JAX's TPU detectors put the coordinator on this port (jax/_src/clusters/cloud_tpu_cluster.py);
# read from JAX where it can be, so a JAX that moves it moves ours too (8476 in older releases, 8482 in JAX 0.10).
_FALLBACK_TPU_PORT = "8482"
_METADATA_PATH = "/computeMetadata/v1/instance/attributes/"


class ClusterError(RunError):
    """The launcher's environment is inconsistent, or the runtime could not start: one line
    naming the variable or the missing peers, and what to check."""


@dataclass(frozen=True)
class Cluster:
    """What this process learnt about its job from the environment.

    kind: "local", "jax", a launcher's name ("ray"), "ompi", "slurm", "gke-tpu", "tpu-vm-pod"
        or "auto". source: the variables (or the server) it was read from.
    num_processes / process_id: None where only JAX's detection can tell (filled in once the
        runtime has started).
    coordinator: "host:port" of process 0's coordinator, None where JAX's detection picks it.
    hosts: the host of each process id where known, "" where not (another slice's hosts).
    jax_detects: start the runtime bare and let JAX's detector read the same environment.
    """

    kind: str
    source: str = ""
    num_processes: Optional[int] = 1
    process_id: Optional[int] = 0
    coordinator: Optional[str] = None
    hosts: tuple[str, ...] = ()
    jax_detects: bool = False

    @property
    def distributed(self) -> bool:
        return self.kind != "local"


LOCAL = Cluster("local")


def running_on_tpu_vm() -> bool:
    """True where JAX found TPU chips on this host at import (then its TPU detectors can fire)."""
    try:
        from jax._src import cloud_tpu_init
    except ImportError:  # a JAX without the module has no TPU detectors of this shape either
        return False
    return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _tpu_port(env: Mapping[str, str]) -> str:
    if env.get("JAX_COORDINATOR_PORT"):
        return env["JAX_COORDINATOR_PORT"]
    try:
        from jax._src.clusters import cloud_tpu_cluster

        return str(cloud_tpu_cluster.coordinator_port)
    except (ImportError, AttributeError):
        return _FALLBACK_TPU_PORT


def _whole(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"{name}={value!r} is not a whole number; set it as the launcher would "
                           f"(or unset it on a single host)") from None


def _host(address: str) -> str:
    """The host of "host", "host:port" or a worker endpoint "name:id:ip" (JAX's old format)."""
    parts = address.strip().split(":")
    return parts[2] if len(parts) == 3 else parts[0]


def _pod(kind: str, source: str, workers: list[str], worker_id: Optional[int], slices: int, slice_id: int,
         megascale: Optional[str], env: Mapping[str, str], worker_name: str) -> Cluster:
    """A TPU pod's figures as JAX's BaseTpuCluster forms them: processes are hosts x slices,
    process ids worker + slice * hosts per slice, the coordinator process 0's host."""
    per_slice = len(workers)
    num = per_slice * slices
    if num == 1:
        return dataclasses.replace(LOCAL, source=f"{source} lists one host")
    if worker_id is None:
        raise ClusterError(f"{source} names {per_slice} hosts but {worker_name} (this host's place among them) "
                           f"is not set: set it as the launcher does (0 to {per_slice - 1}), or unset {source}")
    if not 0 <= worker_id < per_slice or not 0 <= slice_id < slices:
        raise ClusterError(f"{worker_name}={worker_id} (of {per_slice} hosts), slice {slice_id} (of {slices}): "
                           f"out of range; each host needs its own place in {source}")
    coordinator_host = _host(megascale) if megascale else _host(workers[0])
    hosts = tuple(_host(workers[p % per_slice]) if p // per_slice == slice_id else "" for p in range(num))
    if megascale:
        hosts = (coordinator_host, *hosts[1:])
    return Cluster(kind, source, num, worker_id + slice_id * per_slice, f"{coordinator_host}:{_tpu_port(env)}",
                   hosts, jax_detects=running_on_tpu_vm())


def _gke(env: Mapping[str, str]) -> Optional[Cluster]:
    # JAX reads TPU_PROCESS_ADDRESSES first, then TPU_WORKER_HOSTNAMES (GkeTpuCluster).
    name = next((n for n in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES") if env.get(n)), None)
    if name is None:
        return None
    slices = _whole(env, "MEGASCALE_NUM_SLICES", 1) or 1
    source = name + (f", MEGASCALE_NUM_SLICES={slices}" if slices > 1 else "")
    return _pod("gke-tpu", source, env[name].split(","), _whole(env, "TPU_WORKER_ID"), slices,
                _whole(env, "MEGASCALE_SLICE_ID", 0) or 0, env.get("MEGASCALE_COORDINATOR_ADDRESS"), env,
                "TPU_WORKER_ID")


def metadata_endpoint(env: Mapping[str, str]) -> Optional[str]:
    """The GCE metadata server to ask, or None where asking makes no sense: JAX asks it on a TPU
    VM (unless TPU_SKIP_MDS_QUERY is set), at GCE_METADATA_IP when set, as do we; a host without
    TPU chips is asked only where GCE_METADATA_IP points somewhere explicitly, so a CPU run
    never waits on a name that does not resolve."""
    if running_on_tpu_vm():
        if env.get("TPU_SKIP_MDS_QUERY") is not None:
            return None
        return "http://" + env.get("GCE_METADATA_IP", "metadata.google.internal")
    if env.get("GCE_METADATA_IP"):
        return "http://" + env["GCE_METADATA_IP"]
    return None


def read_metadata(endpoint: str, key: str, tries: int = 3) -> Optional[str]:
    """One instance attribute from the metadata server, or None where it has none (404) or
    cannot be reached."""
    request = urllib.request.Request(endpoint + _METADATA_PATH + key, headers={"Metadata-Flavor": "Google"})
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.read().decode()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
        except (urllib.error.URLError, OSError):
            pass
        if attempt + 1 < tries:
            time.sleep(0.5)
    return None


def _tpu_env_value(env: Mapping[str, str], tpu_env: str, key: str) -> Optional[str]:
    """A MEGASCALE_* value: the environment first, then the metadata's tpu-env lines
    (`KEY: 'value'`), as JAX's get_tpu_env_value."""
    if key in env:
        return env[key]
    for line in tpu_env.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip().strip("'")
    return None


def _tpu_vm(env: Mapping[str, str]) -> Optional[Cluster]:
    endpoint = metadata_endpoint(env)
    if endpoint is None:
        return None
    worker = read_metadata(endpoint, "agent-worker-number")
    endpoints = read_metadata(endpoint, "worker-network-endpoints") if worker is not None else None
    if worker is None or not endpoints:
        return None
    tpu_env = read_metadata(endpoint, "tpu-env") or ""
    merged = {key: value for key in ("MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID", "MEGASCALE_COORDINATOR_ADDRESS")
              if (value := _tpu_env_value(env, tpu_env, key)) is not None}
    slices = _whole(merged, "MEGASCALE_NUM_SLICES", 1) or 1
    source = f"GCE metadata at {endpoint}" + (f", MEGASCALE_NUM_SLICES={slices}" if slices > 1 else "")
    try:
        worker_id = int(worker)
    except ValueError:
        raise ClusterError(f"the metadata server at {endpoint} gives agent-worker-number={worker!r}, not a whole "
                           f"number: is GCE_METADATA_IP pointing at a GCE metadata server?") from None
    return _pod("tpu-vm-pod", source, endpoints.split(","), worker_id, slices, _whole(merged, "MEGASCALE_SLICE_ID", 0) or 0,
                merged.get("MEGASCALE_COORDINATOR_ADDRESS"), env, "agent-worker-number")


def detect_cluster(environ: Optional[Mapping[str, str]] = None) -> Cluster:
    """The cluster this process runs in, read from `environ` (the process's environment by
    default) and, on a TPU VM or where GCE_METADATA_IP says so, the GCE metadata server."""
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        launcher = env.get("OLMO_EQX_LAUNCHER")
        source = "JAX_COORDINATOR_ADDRESS" + (f", OLMO_EQX_LAUNCHER={launcher}" if launcher else "")
        coordinator = env["JAX_COORDINATOR_ADDRESS"]
        num = _whole(env, "JAX_NUM_PROCESSES")
        return Cluster(launcher or "jax", source, num, _whole(env, "JAX_PROCESS_ID"), coordinator,
                       (_host(coordinator),) + ("",) * ((num or 1) - 1))
    if "OMPI_MCA_orte_hnp_uri" in env and (_whole(env, "OMPI_COMM_WORLD_SIZE", 1) or 1) > 1:
        return Cluster("ompi", "OMPI_COMM_WORLD_SIZE", _whole(env, "OMPI_COMM_WORLD_SIZE"),
                       _whole(env, "OMPI_COMM_WORLD_RANK"), jax_detects=True)
    if (_whole(env, "SLURM_NTASKS", 1) or 1) > 1:
        return Cluster("slurm", f"SLURM_NTASKS={env['SLURM_NTASKS']}", _whole(env, "SLURM_NTASKS"),
                       _whole(env, "SLURM_PROCID"), jax_detects=True)
    found = _gke(env) or _tpu_vm(env)
    if found is not None and found.distributed:
        return found
    if env.get("OLMO_EQX_DISTRIBUTED") == "1":
        return Cluster("auto", "OLMO_EQX_DISTRIBUTED=1", None, None, jax_detects=True)
    return found or LOCAL


def peer_timeout_s(environ: Optional[Mapping[str, str]] = None) -> float:
    env = os.environ if environ is None else environ
    value = env.get(PEER_TIMEOUT_ENV)
    if not value:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ClusterError(f"{PEER_TIMEOUT_ENV}={value!r}: give the seconds a host waits for its peers, e.g. "
                           f"{PEER_TIMEOUT_ENV}={DEFAULT_PEER_TIMEOUT_S:g}")
    return seconds


def _reachable(address: Optional[str]) -> Optional[bool]:
    """Whether a TCP connection to "host:port" opens (None where no address is known)."""
    split = _split(address)
    if split is None:
        return None
    try:
        with socket.create_connection(split, timeout=3):
            return True
    except OSError:
        return False


def _split(address: Optional[str]) -> Optional[tuple[str, int]]:
    host, _, port = (address or "").rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


class RollCall:
    """Who has arrived, for the line a process stops with when some have not: JAX's runtime
    cannot say which processes have registered, so process 0 listens on the coordinator's
    port + 1 and every other process tells it its id there; asked again at the deadline, it
    answers with the ids it has heard from. Best effort and nothing else depends on it: a port
    that is taken or blocked only makes the line less precise."""

    def __init__(self, cluster: Cluster):
        self.me = cluster.process_id
        split = _split(cluster.coordinator)
        self.address = None if split is None else (split[0], split[1] + 1)
        self.present: set[int] = {self.me} if self.me is not None else set()
        # A worker's last answer from process 0: where process 0 has given up and left first,
        # still the best account of who had arrived.
        self.last: Optional[set[int]] = None
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.server: Optional[socket.socket] = None
        if self.address is None or self.me is None:
            return
        if self.me == 0:
            try:
                self.server = socket.create_server(("", self.address[1]))
            except OSError:
                return
            self.server.settimeout(0.5)
            threading.Thread(target=self._serve, daemon=True).start()
        else:
            threading.Thread(target=self._announce, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.server.accept()
            except OSError:  # the accept timeout (to see `closed`), or the socket closed
                continue
            with connection:
                try:
                    connection.settimeout(2)
                    line = connection.makefile().readline()
                    with self.lock:
                        self.present.add(int(line.split()[1]))
                        answer = " ".join(map(str, sorted(self.present)))
                    connection.sendall(f"olmo_eqx-roll-call {answer}\n".encode())
                except (OSError, ValueError, IndexError):
                    continue

    def ask(self) -> Optional[set[int]]:
        """The ids process 0 has heard from (this one's included): asked now, else its last
        answer; None where it never answered."""
        if self.me == 0:
            if self.server is None:
                return None
            with self.lock:
                return set(self.present)
        return self._ask() or self.last

    def _ask(self) -> Optional[set[int]]:
        if self.address is None:
            return None
        try:
            with socket.create_connection(self.address, timeout=2) as connection:
                connection.settimeout(2)
                connection.sendall(f"olmo_eqx-roll-call {self.me}\n".encode())
                words = connection.makefile().readline().split()
            if not words or words[0] != "olmo_eqx-roll-call":
                return None
            self.last = {int(word) for word in words[1:]}
            return self.last
        except (OSError, ValueError, TypeError):
            return None

    def _announce(self) -> None:
        # Until the runtime starts: soon after a miss, now and then after an answer.
        while not self.closed.is_set():
            self.closed.wait(1.0 if self._ask() is None else 5.0)

    def close(self) -> None:
        self.closed.set()
        if self.server is not None:
            self.server.close()


# How each kind runs the same command on every host, for the line that says one is missing.
_EVERY_HOST = {
    "slurm": "every task runs the same command (srun, one task per process, not the batch script alone)",
    "gke-tpu": "every pod of the JobSet runs the same command",
    "tpu-vm-pod": "every host runs the same command (gcloud compute tpus tpu-vm ssh ... --worker=all)",
    "ompi": "mpirun starts the same command for every rank",
}


def _processes(ids: list[int], hosts: tuple[str, ...]) -> str:
    named = [f"{i} ({hosts[i]})" if i < len(hosts) and hosts[i] else str(i) for i in ids]
    return ("process " if len(named) == 1 else "processes ") + ", ".join(named)


def missing_peers_line(cluster: Cluster, timeout: float, coordinator_up: Optional[bool],
                       present: Optional[set[int]] = None) -> str:
    """The one line a process whose peers did not all arrive stops with. present: the ids the
    roll call heard from, where it could tell."""
    num, me = cluster.num_processes, cluster.process_id
    coordinator = cluster.coordinator or "the coordinator"
    where = f"cluster {cluster.kind} ({cluster.source})"
    if me not in (None, 0) and coordinator_up is False:
        who = f"{_processes([0], cluster.hosts)}, the coordinator at {coordinator}, did not come up"
    elif num is not None and me is not None and present is not None and len(present - {me}) < num - 1:
        arrived = len(present)
        who = f"{_processes(sorted(set(range(num)) - present), cluster.hosts)} did not join ({arrived} of {num} did)"
    elif num is not None and me is not None:
        others = [i for i in range(num) if i != me and not (i == 0 and coordinator_up)]
        some = "" if len(others) == 1 else "some of "
        who = f"{some}{_processes(others, cluster.hosts)} did not join"
    else:
        who = "not every process joined"
    this = f"process {me} of {num}" if num is not None and me is not None else "this process"
    every = _EVERY_HOST.get(cluster.kind, "every host runs the same command")
    return (f"{where}: {this}: {who} within {timeout:g} s. Check that {every} with its launcher's environment "
            f"({cluster.source}) and can reach {coordinator}; if hosts start slowly, raise {PEER_TIMEOUT_ENV} "
            f"(now {timeout:g})")


def _give_up(cluster: Cluster, timeout: float, roll_call: Optional[RollCall]) -> None:
    """Runs in a timer thread while the main thread is blocked inside JAX's connect, which
    cannot be interrupted: say who is missing and leave with the command line's status 2."""
    try:
        from jax._src import distributed

        state = distributed.global_state  # JAX's own figures where its detection chose them
        cluster = dataclasses.replace(
            cluster,
            coordinator=cluster.coordinator or state.coordinator_address,
            num_processes=cluster.num_processes if cluster.num_processes is not None else state.num_processes,
            process_id=cluster.process_id if cluster.process_id is not None else state.process_id,
        )
    except (ImportError, AttributeError):
        pass
    present = roll_call.ask() if roll_call is not None else None
    # A coordinator that answered the roll call came up (it may have given up and left since).
    up = None if cluster.process_id in (None, 0) or present else _reachable(cluster.coordinator)
    print(f"error: {missing_peers_line(cluster, timeout, up, present)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


def _started_cluster(cluster: Cluster) -> Cluster:
    """`cluster` with the figures the runtime settled on."""
    return dataclasses.replace(cluster, num_processes=jax.process_count(), process_id=jax.process_index())


_current: Optional[Cluster] = None


def start_cluster() -> Cluster:
    """Detect the cluster and start `jax.distributed` there, once per process; a single host
    starts nothing. Must run before anything touches JAX's devices. Returns what was detected
    (the same object on every later call)."""
    global _current
    if _current is not None:
        return _current
    if jax.distributed.is_initialized():  # started by the caller (a test, a notebook) before us
        _current = _started_cluster(Cluster("external", "jax.distributed already initialised"))
        return _current
    cluster = detect_cluster()
    if not cluster.distributed:
        _current = cluster
        return cluster
    timeout = peer_timeout_s()
    kwargs = {}
    if not cluster.jax_detects:
        kwargs = {"coordinator_address": cluster.coordinator}
        if cluster.num_processes is not None:
            kwargs["num_processes"] = cluster.num_processes
        if cluster.process_id is not None:
            kwargs["process_id"] = cluster.process_id
    roll_call = RollCall(cluster) if cluster.coordinator else None
    watchdog = threading.Timer(timeout, _give_up, args=(cluster, timeout, roll_call))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout) + _JAX_GRACE_S)
    except (ValueError, TypeError, RuntimeError) as e:
        hint = "; JAX found no cluster here: on one host, unset OLMO_EQX_DISTRIBUTED" if cluster.kind == "auto" else ""
        raise ClusterError(f"cluster {cluster.kind} ({cluster.source}): jax.distributed did not start: "
                           f"{str(e).splitlines()[0].rstrip('.') if str(e) else type(e).__name__}{hint}") from e
    finally:
        watchdog.cancel()
        if roll_call is not None:
            roll_call.close()
    _current = _started_cluster(cluster)
    return _current


def cluster_line(cluster: Cluster, mesh: Mesh) -> str:
    """The first line of a run: the cluster kind and where it was read, processes, devices per
    process, and the mesh axes with their sizes (whatever axes the mesh has)."""
    processes = jax.process_count()
    local = jax.local_device_count()
    platform = jax.local_devices()[0].platform
    source = f" ({cluster.source})" if cluster.source else ""
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return (f"cluster: {cluster.kind}{source}, {processes} process{'es' if processes != 1 else ''} x {local} "
            f"{platform} device{'s' if local != 1 else ''}, mesh {axes}")
