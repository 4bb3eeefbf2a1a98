"""Test-wide setup: 8 fake CPU devices (must be set before jax is imported) and float32 matmuls."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
