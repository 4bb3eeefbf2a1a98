"""Test-wide setup: 8 fake CPU devices (must be set before jax is imported) and float32 matmuls."""

import os
import sys
from pathlib import Path

# Bytecode for the project's own modules. Where PYTHONDONTWRITEBYTECODE is set (this machine image sets
# it), every `python -m olmo_eqx` a test starts compiles olmo_eqx's modules from source again:
# 0.3 s of each of the suite's ~100 runs (site-packages were byte-compiled when installed).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the suite, its xdist workers and every `python -m
# olmo_eqx` it starts: the CLI tests compile the same tiny steps again and again, and a hit
# halves such a run (29 s -> 14 s for the 12-step pretrain). XLA's cache is keyed by the HLO,
# the compile options and the versions, so a hit is the same executable a compile would give.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The CPU peak behind every run's MFU figure, measured once for the suite (`pytest_configure`,
# before any worker starts) and read by the workers and their subprocesses, in the suite's own
# cache (a figure of the suite's busy cores must not stand for the user's idle machine).
os.environ.setdefault("OLMO_EQX_CACHE", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "olmo_eqx"))
# Tests never reach a model hub, and HF progress bars only clutter the log.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Torch's and BLAS's thread pools at one thread: the two xdist workers (and their subprocesses)
# already keep both cores busy, and parity tests' PyTorch side otherwise oversubscribes them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
from clihelp import SUITE_XLA_FLAGS  # noqa: E402

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} --xla_force_host_platform_device_count=8"
if SUITE_XLA_FLAGS not in flags:
    flags = f"{flags} {SUITE_XLA_FLAGS}"
os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402

# Parity tests compare against float32 PyTorch; keep XLA's CPU matmuls at full precision.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller measured it before starting the workers
    from olmo_eqx.train import mfu

    mfu.cpu_peak_flops()
