"""Model FLOPs utilisation: achieved model FLOP/s per device over the device's dense peak.

Accelerator peaks come from a table of known parts (bf16 dense, spec section 5). A CPU has
no meaningful datasheet number, so its peak is *measured* once (float32 matmuls for about
two seconds) and cached in `$OLMO_EQX_CACHE/cpu_peak.json` (default ~/.cache/olmo_eqx).
"""

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

# device_kind substring (lower case) -> peak dense bf16 FLOP/s per device. Order matters:
# more specific names first ("v5p" / "v5 lite" before a bare "v5").
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("h200", 989.5e12),
    ("h100", 989.5e12),
    ("a100", 312e12),
    ("v6e", 918e12),
    ("v6 lite", 918e12),
    ("v5p", 459e12),
    ("v5e", 197e12),
    ("v5 lite", 197e12),
    ("v5litepod", 197e12),
    ("v4", 275e12),
)

_CPU_PEAK: Optional[float] = None
_CPU_PEAK_SOURCE = ""  # where the figure came from, for the run header


def _cache_file() -> Path:
    root = os.environ.get("OLMO_EQX_CACHE") or Path.home() / ".cache" / "olmo_eqx"
    return Path(root) / "cpu_peak.json"


def measure_cpu_peak(seconds: float = 2.0, size: int = 1024) -> float:
    """FLOP/s of one CPU device on float32 [size, size] matmuls, best of several timed runs."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        best = max(best, 2.0 * size**3 / (time.perf_counter() - t0))
    return best


def cpu_peak_flops(*, cache_when_busy: bool = False) -> float:
    """The cached measured CPU peak (measuring and caching it the first time). A figure
    measured on busy cores is not cached unless `cache_when_busy` (the test suite's choice: it
    measures once for all its runs and asserts no MFU)."""
    global _CPU_PEAK, _CPU_PEAK_SOURCE
    if _CPU_PEAK is not None:
        return _CPU_PEAK
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
        _CPU_PEAK = float(cached["flops_per_second"])
        when = time.strftime("%Y-%m-%d", time.localtime(cached["measured_at"])) if "measured_at" in cached else "earlier"
        _CPU_PEAK_SOURCE = f"measured {when}, cached in {path}; delete it to measure again"
        return _CPU_PEAK
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"measuring this CPU's float32 matmul peak once for MFU (cached in {path}) ...", file=sys.stderr, flush=True)
    _CPU_PEAK = measure_cpu_peak()
    # Cores busy with other work give a low peak and so an inflated MFU (0.286 against 0.319
    # TFLOP/s idle, measured on this project's 2-core machines): such a figure serves this run
    # only, said as such, and the next run measures again.
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores and not cache_when_busy:
        _CPU_PEAK_SOURCE = (f"measured now on busy cores (load {load:.1f} on {cores}): an underestimate, so MFU reads "
                            "high; not cached")
        return _CPU_PEAK
    _CPU_PEAK_SOURCE = f"measured now, cached in {path}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"flops_per_second": _CPU_PEAK, "dtype": "float32", "measured_at": time.time()}))
        tmp.replace(path)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return _CPU_PEAK


def cpu_peak_source() -> str:
    """Where the CPU peak figure came from (measured now, or when it was cached)."""
    cpu_peak_flops()
    return _CPU_PEAK_SOURCE


def peak_flops_per_device(device: Optional[jax.Device] = None) -> Optional[float]:
    """Dense peak FLOP/s of `device` (default: the first device); None for an unknown accelerator.

    On CPU: the measured peak of the whole CPU divided by the number of (fake) CPU devices.
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # Fake CPU devices (xla_force_host_platform_device_count) share the same cores, so
        # each gets an equal share of the measured whole-CPU peak.
        return cpu_peak_flops() / len(jax.local_devices(backend="cpu"))
    kind = device.device_kind.lower()
    for name, peak in PEAK_FLOPS:
        if name in kind:
            return peak
    return None


def mfu(flops_per_token: float, tokens_per_second: float, n_devices: int, peak: Optional[float] = None) -> Optional[float]:
    """Fraction of peak: flops_per_token * tokens_per_second / n_devices / peak (None if peak unknown)."""
    peak = peak_flops_per_device() if peak is None else peak
    if not peak:
        return None
    return flops_per_token * tokens_per_second / max(n_devices, 1) / peak
