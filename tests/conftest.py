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


# The files that keep a worker busy longest, longest first (seconds of one worker's time in a
# cold-cache run of the suite on 2 shared cores, summed over each file's slowest tests). xdist
# hands out whole files (`--dist loadfile`) in collection order (`--no-loadscope-reorder`;
# its default order is by number of tests, which put test_anneal, test_compare and
# test_zoo_training last, where one worker ran them while the other sat idle). Longest first,
# the last files handed out are the short ones; files not listed follow, most tests first.
# Only the order changes: every file still runs whole on one worker, its tests in file order.
SLOWEST_FILES = (
    "test_faults.py",  # ~125 s
    "test_pretrain.py",  # ~95 s
    "test_checkpoint_remote.py",  # ~70 s
    "test_tpu_compile.py",  # ~60 s
    "test_slices.py",  # ~60 s
    "test_model_parity.py",  # ~60 s
    "test_hybrid_parity.py",
    "test_anneal.py",
    "test_cli_config.py",
    "test_trajectory_parity.py",
    "test_data_remote.py",
    "test_checkpoint.py",
    "test_micro_batches.py",  # ~60 s: three runs on 8, 2 and 8 devices
    "test_lm_eval.py",
    "test_scale.py",
    "test_context_parallel.py",
    "test_zoo_training.py",
    "test_generate.py",
    "test_compare.py",
    "test_stages.py",
    "test_moe_parity.py",
    "test_soup.py",
    "test_train_step.py",
    "test_attention.py",
    "test_expert_parallel.py",
    "test_olmo_core_trajectory.py",
)


def pytest_collection_modifyitems(config, items):
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(item):
        name = item.path.name
        return (SLOWEST_FILES.index(name), 0) if name in SLOWEST_FILES else (len(SLOWEST_FILES), -counts[name])

    items.sort(key=rank)  # stable: each file's tests keep their order
