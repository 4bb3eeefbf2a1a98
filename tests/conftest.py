"""Test-wide setup: 8 fake CPU devices (must be set before jax is imported) and float32 matmuls."""

import os
from pathlib import Path

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
# Tests never reach a model hub, and HF progress bars only clutter the log.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402

# Parity tests compare against float32 PyTorch; keep XLA's CPU matmuls at full precision.
jax.config.update("jax_default_matmul_precision", "highest")
