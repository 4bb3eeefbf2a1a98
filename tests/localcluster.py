"""Launch a real multi-controller JAX job on this machine: N processes over gloo on localhost."""

import contextlib
import http.server
import os
import re
import socket
import subprocess
import threading
from typing import Optional


def free_port(low: int = 0) -> int:
    """A port nobody listens on (any, or one in [low, 65535])."""
    import random

    if not low:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for port in random.sample(range(low, 65536), 64):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{low}, 65535]")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def slurm_environment(n_processes: int, rank: int) -> dict:
    """What SLURM sets for task `rank` of an `srun --ntasks=N` step on one node, as far as
    jax's SLURM detection (jax/_src/clusters/slurm_cluster.py) reads it: the coordinator is the
    first node of SLURM_STEP_NODELIST on a port derived from SLURM_JOB_ID."""
    port = free_port(low=65535 - 2**12 + 1)  # jax's SLURM port range: [61440, 65535]
    return {
        "SLURM_JOB_ID": str(port - (65535 - 2**12 + 1) + 4096 * 1000),  # job id % 4096 picks the port
        "SLURM_JOB_NAME": "olmo_eqx",
        "SLURM_NTASKS": str(n_processes),
        "SLURM_NTASKS_PER_NODE": str(n_processes),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_NODELIST": "localhost",
    }


def gke_environment(n_processes: int, rank: int, port: int, slices: int = 1) -> dict:
    """What GKE's TPU webhook gives the pod of host `rank` in a JobSet of `n_processes` TPU
    hosts (XPK's `--num-slices` splits them into slices of equal size, adding the MEGASCALE_*
    variables), as far as JAX's GkeTpuCluster reads it, with every host on 127.0.0.1. The
    coordinator port (8482 in JAX's TPU detector) is chosen by JAX_COORDINATOR_PORT, which
    JAX reads too, so a test never collides with another on a fixed port."""
    per_slice = n_processes // slices
    env = {"TPU_WORKER_HOSTNAMES": ",".join(["127.0.0.1"] * per_slice), "TPU_WORKER_ID": str(rank % per_slice),
           "TPU_SKIP_MDS_QUERY": "true", "JAX_COORDINATOR_PORT": str(port)}
    if slices > 1:
        env.update(MEGASCALE_COORDINATOR_ADDRESS="127.0.0.1", MEGASCALE_NUM_SLICES=str(slices),
                   MEGASCALE_SLICE_ID=str(rank // per_slice))
    return env


# Variables of launchers and clusters a test's own environment must not pass on to its processes.
LAUNCHER_VARIABLES = ("SLURM_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS", "TPU_WORKER", "TPU_PROCESS",
                      "MEGASCALE_", "GCE_METADATA", "OMPI_", "OLMO_EQX_DISTRIBUTED", "OLMO_EQX_LAUNCHER")


def launch_local_cluster(
    command: list[str],
    n_processes: int = 2,
    devices_per_process: int = 2,
    merge_stderr: bool = False,
    launcher: str = "jax",
    ranks: Optional[list[int]] = None,
    metadata: Optional[list[str]] = None,
    env: Optional[dict] = None,
    rank_env: Optional[dict] = None,
) -> list[subprocess.Popen]:
    """Start `command` once per process with the launcher environment `jax.distributed` reads
    (`olmo_eqx.infra.cluster.start_cluster`); each process fakes its CPU devices.

    launcher "jax": JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    launcher "slurm": only the variables SLURM sets for its tasks (`slurm_environment`).
    launcher "gke" / "gke-slices": what GKE gives each TPU pod (`gke_environment`), one slice of
    n hosts, or n slices of one host.
    launcher "tpu-vm": a TPU VM pod host: nothing but GCE_METADATA_IP, process i's pointing at
    `metadata[i]` (host:port of a metadata server: `tpu_vm_metadata`), and JAX_COORDINATOR_PORT.
    ranks: start only these processes (the others never arrive); env: added to every process,
    rank_env[i] to process i's (e.g. a staging dir of its own, as hosts without a shared file
    system have).
    """
    port = free_port()
    while not _free(port + 1):  # the roll call's port (olmo_eqx.infra.cluster.RollCall)
        port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    slurm = [slurm_environment(n_processes, 0)] if launcher == "slurm" else []
    # The caller's other XLA flags (the suite's compile flags in tests) with this device count.
    others = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).split()
    flags = " ".join([f"--xla_force_host_platform_device_count={devices_per_process}", *others])
    processes = []
    extra = env or {}
    for rank in range(n_processes) if ranks is None else ranks:
        env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
        if launcher == "slurm":
            env.update(slurm[0], SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
        elif launcher == "jax":
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n_processes),
                       JAX_PROCESS_ID=str(rank))
        elif launcher in ("gke", "gke-slices"):
            env.update(gke_environment(n_processes, rank, port, slices=n_processes if launcher == "gke-slices" else 1))
        elif launcher == "tpu-vm":
            env.update(GCE_METADATA_IP=metadata[rank], JAX_COORDINATOR_PORT=str(port))
        else:
            raise ValueError(f"launcher={launcher!r}: 'jax', 'slurm', 'gke', 'gke-slices' or 'tpu-vm'")
        env.update(extra, **(rank_env or {}).get(rank, {}))
        stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return processes


class _MetadataHandler(http.server.BaseHTTPRequestHandler):
    """GCE's metadata server as far as JAX's GceTpuCluster (and olmo_eqx) read it: instance
    attributes under /computeMetadata/v1/instance/attributes/, only with `Metadata-Flavor: Google`."""

    attributes: dict = {}

    def do_GET(self):
        prefix = "/computeMetadata/v1/instance/attributes/"
        value = self.attributes.get(self.path[len(prefix):]) if self.path.startswith(prefix) else None
        if self.headers.get("Metadata-Flavor") != "Google":
            self.send_response(403)
            value = None
        else:
            self.send_response(200 if value is not None else 404)
        body = (value if value is not None else "").encode()
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def tpu_vm_metadata(n_hosts: int, hosts: str = "127.0.0.1", tpu_env: str = ""):
    """One real HTTP metadata server per TPU VM host on 127.0.0.1 (each host of a pod asks its
    own, and each answers with its own agent-worker-number); yields their host:port addresses.
    worker-network-endpoints in the `name:id:ip` form a pod's metadata gives."""
    endpoints = ",".join(f"t1v-n-test-w-{i}:{i}:{hosts}" for i in range(n_hosts))
    servers = []
    try:
        for worker in range(n_hosts):
            handler = type("Handler", (_MetadataHandler,), {"attributes": {
                "agent-worker-number": str(worker), "worker-network-endpoints": endpoints, "tpu-env": tpu_env}})
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
        yield [f"127.0.0.1:{server.server_address[1]}" for server in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
