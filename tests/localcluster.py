"""Launch a real multi-controller JAX job on this machine: N processes over gloo on localhost."""

import os
import re
import socket
import subprocess
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


def launch_local_cluster(
    command: list[str],
    n_processes: int = 2,
    devices_per_process: int = 2,
    merge_stderr: bool = False,
    launcher: str = "jax",
    environments: Optional[list[dict]] = None,
) -> list[subprocess.Popen]:
    """Start `command` once per process with the launcher environment `jax.distributed` reads
    (`olmo_eqx.sharding.maybe_initialize_distributed`); each process fakes its CPU devices.

    launcher "jax": JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    launcher "slurm": only the variables SLURM sets for its tasks (`slurm_environment`).
    environments: more variables for each process (one dict per process: e.g. a staging dir
    of its own, as hosts without a shared file system have).
    """
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    slurm = [slurm_environment(n_processes, 0)] if launcher == "slurm" else []
    # The caller's other XLA flags (the suite's compile flags in tests) with this device count.
    others = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).split()
    flags = " ".join([f"--xla_force_host_platform_device_count={devices_per_process}", *others])
    processes = []
    for rank in range(n_processes):
        env = {**base, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
        if launcher == "slurm":
            env.update(slurm[0], SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))
        elif launcher == "jax":
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n_processes),
                       JAX_PROCESS_ID=str(rank))
        else:
            raise ValueError(f"launcher={launcher!r}: 'jax' or 'slurm'")
        env.update((environments or [{}] * n_processes)[rank])
        stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return processes
