"""Launch a real multi-controller JAX job on this machine: N processes over gloo on localhost."""

import os
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local_cluster(
    command: list[str], n_processes: int = 2, devices_per_process: int = 2, merge_stderr: bool = False
) -> list[subprocess.Popen]:
    """Start `command` once per process with the launcher environment `jax.distributed` reads
    (`olmo_eqx.sharding.maybe_initialize_distributed`); each process fakes its CPU devices."""
    port = free_port()
    processes = []
    for rank in range(n_processes):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(n_processes),
            "JAX_PROCESS_ID": str(rank),
        }
        stderr = subprocess.STDOUT if merge_stderr else subprocess.PIPE
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True))
    return processes
