"""Model FLOPs utilisation: achieved model FLOP/s per device over the device's dense peak.

Accelerator peaks come from a table of known parts (bf16 dense, spec section 5). A CPU has
no meaningful datasheet number, so its peak is *measured* once per machine (float32 matmuls for
about two seconds) and cached in `$OLMO_EQX_CACHE/cpu_peak.json` (default ~/.cache/olmo_eqx):
every run on the machine divides by the same figure (`cpu_peak_flops`).
"""

import json
import os
import platform
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


def _machine() -> str:
    """This machine, as the cache tells machines apart: a home directory shared by several
    hosts must not hand one host's peak to another."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{platform.node()} | {model or platform.processor() or platform.machine()} | {os.cpu_count()} cores"


def _busy() -> Optional[str]:
    """'load L on N' when other work keeps the cores busy (a peak measured then is low)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"load {load:.1f} on {cores}" if load > cores else None


def _idle() -> bool:
    """Cores idle enough to replace a busy figure: at most half of them loaded, so that runs
    that merely share the cores (the test suite's workers) do not each measure again."""
    return os.getloadavg()[0] <= (os.cpu_count() or 1) / 2


def _cpu_seconds() -> Optional[tuple[float, float]]:
    """(CPU seconds all cores have been busy since boot, this process's CPU seconds), or None
    where /proc/stat cannot be read (not Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


# How the last `measure_cpu_peak` went: (matmuls timed, their size, seconds, cores other processes
# kept busy meanwhile, or None where that cannot be read). The 1-minute load average lags a minute behind:
# a run started right after other work (or right before it) was called idle whatever the load.
_LAST_MEASUREMENT: Optional[tuple[int, int, float, Optional[float]]] = None
# Other processes using this many cores on average during the measurement make it busy.
_OTHERS_BUSY = 0.5


def measure_cpu_peak(seconds: float = 2.0, size: int = 1024) -> float:
    """FLOP/s of one CPU device on float32 [size, size] matmuls, best of several timed runs."""
    global _LAST_MEASUREMENT
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    before = _cpu_seconds()
    best, start, runs = 0.0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        best = max(best, 2.0 * size**3 / (time.perf_counter() - t0))
        runs += 1
    elapsed, after = time.perf_counter() - start, _cpu_seconds()
    others = None
    if before is not None and after is not None:
        others = max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / elapsed)
    _LAST_MEASUREMENT = (runs, size, elapsed, others)
    return best


def _how_measured() -> str:
    """How the last measurement went, for the header and the cache ("" if not known)."""
    if _LAST_MEASUREMENT is None:
        return ""
    runs, size, elapsed, others = _LAST_MEASUREMENT
    how = f"best of {runs} float32 {size}x{size} matmuls in {elapsed:.1f} s"
    if others is not None:
        how += f", other processes using {others:.1f} of {os.cpu_count() or 1} cores meanwhile"
    return how


def _read_cache(path: Path) -> Optional[dict]:
    try:
        cached = json.loads(path.read_text())
        float(cached["flops_per_second"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # A figure from another machine (a shared home) is no figure for this one.
    return cached if cached.get("machine", _machine()) == _machine() else None


def cpu_peak_flops() -> float:
    """This machine's CPU peak: one figure for every run, so that their MFU compare.

    Measured once and cached in `$OLMO_EQX_CACHE/cpu_peak.json` with the machine it belongs to.
    Cores busy with other work give a low peak and so a high MFU (0.041 to 0.112 TFLOP/s on
    this project's shared 2-core machines, 0.319 idle): such a figure is cached too, marked
    busy and said so in every run's header, until a run starts on idle cores, which measures
    once more and keeps that.
    """
    global _CPU_PEAK, _CPU_PEAK_SOURCE
    if _CPU_PEAK is not None:
        return _CPU_PEAK
    path = _cache_file()
    cached = _read_cache(path)
    if cached is not None and not (cached.get("busy") and _idle()):
        _CPU_PEAK = float(cached["flops_per_second"])
        when = time.strftime("%Y-%m-%d", time.localtime(cached["measured_at"])) if "measured_at" in cached else "earlier"
        if cached.get("busy"):
            _CPU_PEAK_SOURCE = (f"measured {when} on busy cores ({cached['busy']}): an underestimate, so MFU reads high; "
                                f"cached in {path} so that runs compare, until a run starts on idle cores")
        else:
            how = f" ({cached['how']})" if cached.get("how") else ""
            _CPU_PEAK_SOURCE = (f"measured {when} on idle cores{how}, cached in {path} for every run here; delete it to "
                                "measure again")
        return _CPU_PEAK
    again = " again (the cached figure was measured on busy cores)" if cached is not None else ""
    print(f"measuring this CPU's float32 matmul peak for MFU{again}, about 2 s ...", file=sys.stderr, flush=True)
    global _LAST_MEASUREMENT
    _LAST_MEASUREMENT = None
    busy = _busy()
    _CPU_PEAK = measure_cpu_peak()
    how = _how_measured()
    if not busy and _LAST_MEASUREMENT is not None and (_LAST_MEASUREMENT[3] or 0) >= _OTHERS_BUSY:
        busy = f"other processes using {_LAST_MEASUREMENT[3]:.1f} of {os.cpu_count() or 1} cores"
    record = {"flops_per_second": _CPU_PEAK, "dtype": "float32", "measured_at": time.time(), "machine": _machine()}
    if how:
        record["how"] = how
    if busy:
        record["busy"] = busy
        _CPU_PEAK_SOURCE = f"measured now on busy cores ({busy}): an underestimate, so MFU reads high"
    else:
        _CPU_PEAK_SOURCE = "measured now on idle cores"
    if how:
        _CPU_PEAK_SOURCE += f" ({how})"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)  # atomic: concurrent processes never read half a file
    except OSError as e:
        _CPU_PEAK_SOURCE += f"; not cached ({path}: {e.strerror}), so the next run measures again"
        return _CPU_PEAK
    _CPU_PEAK_SOURCE += (f"; cached in {path} so that runs compare, until a run starts on idle cores" if busy
                         else f"; cached in {path} for every later run here")
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
