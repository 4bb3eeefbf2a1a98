"""What a compiled program needs per device, what a device offers, and the fewest micro-batches
that fit: shared by the run (`trainer.micro_batches=auto`, `olmo_eqx.train.micro_batches`) and the
planner (`olmo_eqx.plan`), which sits above the train loop and so cannot be imported by it.

- `compile_lowered` compiles a lowered program, saying what and how long, and turns the
  compiler's out-of-memory refusal (XLA:TPU refuses a program whose temporaries exceed HBM)
  into `CompileRefused`.
- `memory_bytes` / `needed_bytes` read XLA's memory analysis of one device's program. XLA:TPU
  holds its temporaries alone against HBM: a v5e chip ran programs whose arguments +
  temporaries exceeded its 15.75 GiB, and every one of twelve verdicts measured there was
  "temporaries <= HBM" (docs/planning.md, "Checked on a chip"). Elsewhere (XLA:CPU, XLA:GPU)
  the bound is arguments + outputs - aliased + temporaries.
- `device_budget` is what one device offers: `trainer.device_memory_gib` when set, else the
  device's own `memory_stats()["bytes_limit"]` (TPU, GPU), else, on CPU, which keeps no such
  limit, the host's physical memory shared by its local devices.
- `micro_batch_candidates` / `fewest_that_fit`: the counts the divisibility rule allows, fewest
  first, and the search over them.
"""

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

GIB = 1024**3


class CompileRefused(Exception):
    """The target's compiler refused the program (XLA:TPU: it does not fit in HBM).

    `str()` is the compiler's verdict in a line; `details` its whole message (XLA:TPU lists
    the program's largest allocations there)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def compiler_refusal(error: BaseException) -> Optional[str]:
    """The compiler's (or runtime's) own out-of-memory message, in a line or two, or None for
    other errors."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if "RESOURCE_EXHAUSTED" in line or "Ran out of memory" in line or "Exceeded" in line]
    return " ".join(keep or lines[:1])[:600]


def compile_lowered(
    lowered, what: str, *, effort: Optional[float] = None, progress: Optional[Callable[[str], None]] = None,
    label: str = "compile",
):
    """`lowered.compile()`, saying `what` and how long through `progress`; the compiler's
    out-of-memory refusal becomes `CompileRefused`. `effort`: XLA's execution-time optimisation
    effort, -1 to 1 (None: the compiler's default, what a chip runs)."""
    if effort is not None:
        what += f", optimisation effort {effort:g} (XLA's counts only)"
    if progress:
        progress(f"  {label}: {what} ...")
    started = time.perf_counter()
    options = None if effort is None else {"exec_time_optimization_effort": effort}
    try:
        compiled = lowered.compile(compiler_options=options)
    except Exception as e:
        if (message := compiler_refusal(e)) is not None:
            if progress:
                progress(f"  {label}: refused by the compiler after {time.perf_counter() - started:.0f} s")
            raise CompileRefused(message, str(e)) from None
        raise
    if progress:
        progress(f"  {label}: done in {time.perf_counter() - started:.0f} s")
    return compiled


def memory_bytes(memory) -> dict:
    """XLA's memory analysis of one device's program, per kind, and their sum ("total": what
    XLA:CPU and XLA:GPU need; XLA:TPU holds its temporaries alone against HBM, `needed_bytes`)."""
    arguments, outputs = memory.argument_size_in_bytes, memory.output_size_in_bytes
    aliased, temporaries = memory.alias_size_in_bytes, memory.temp_size_in_bytes
    return {
        "arguments": arguments,
        "outputs": outputs,
        "aliased": aliased,
        "temporaries": temporaries,
        # Donated arguments are aliased by the outputs: counted once.
        "total": arguments + outputs - aliased + temporaries,
        "host": getattr(memory, "host_temp_size_in_bytes", 0) + getattr(memory, "host_argument_size_in_bytes", 0),
    }


def size(n: Union[int, float]) -> str:
    """Bytes as GiB, or MiB below one GiB (a tiny model's step needs a few MiB)."""
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 2**20:.3g} MiB"


def needed_bytes(memory: dict, platform: str) -> int:
    """What the platform's compiler holds against a device's memory, from `memory_bytes`."""
    return memory["temporaries"] if platform == "tpu" else memory["total"]


def needed_what(platform: str) -> str:
    return "temporaries, XLA:TPU's own verdict" if platform == "tpu" else "arguments + temporaries"


def host_memory_bytes() -> int:
    """The host's physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class Budget:
    """The memory one device offers a program, and where that figure comes from."""

    bytes: int
    source: str


def device_budget(device, configured_gib: Optional[float] = None, local_devices: int = 1) -> Budget:
    """What `device` offers: `configured_gib` (trainer.device_memory_gib) when given, else its
    `memory_stats()["bytes_limit"]`, else (CPU) the host's memory over its `local_devices`."""
    if configured_gib is not None:
        return Budget(int(configured_gib * GIB), "trainer.device_memory_gib")
    try:
        stats = device.memory_stats() or {}
    except Exception:  # abstract devices, and backends without the call
        stats = {}
    if stats.get("bytes_limit"):
        return Budget(int(stats["bytes_limit"]), f"the {device.device_kind}'s memory_stats() bytes_limit")
    host = host_memory_bytes() if device.platform == "cpu" else 0
    if host:
        return Budget(host // max(local_devices, 1), f"the host's memory over its {local_devices} local device" + ("" if local_devices == 1 else "s"))
    raise ValueError(
        f"trainer.micro_batches=auto: the {device.platform} device {device.device_kind!r} reports no memory limit "
        "(memory_stats()); set trainer.device_memory_gib to what one device offers, or a fixed trainer.micro_batches"
    )


def micro_batch_candidates(global_batch: int, batch_shards: int) -> list[int]:
    """The micro-batch counts to try, fewest first: those the global batch divides
    (`olmo_eqx.config.check_across_groups`), down to one sequence per micro-batch per batch shard.
    Where the batch shards divide the global batch, only counts that keep every micro-batch
    spread over all of them (each device then holds the same rows as with one micro-batch)."""
    per_shard = global_batch // batch_shards if batch_shards and global_batch % batch_shards == 0 else 0
    if per_shard:
        return [m for m in range(1, per_shard + 1) if per_shard % m == 0]
    return [m for m in range(1, global_batch + 1) if global_batch % m == 0]


@dataclass
class Attempt:
    """One candidate compiled: whether it fits, and what it needs (None when the compiler refused)."""

    micro_batches: int
    fits: bool
    needed: Optional[int]
    refused: Optional[str] = None
    payload: Any = None


def fewest_that_fit(candidates: Sequence[int], attempt: Callable[[int], Attempt]) -> tuple[Optional[Attempt], list[Attempt]]:
    """(the fewest-micro-batch attempt that fits or None, every attempt made, in order).

    The first candidate first, so a run that fits as configured compiles once; then a bisection
    over the rest (more micro-batches need less memory), each probe one compile."""
    tried: list[Attempt] = []

    def run(m: int) -> Attempt:
        tried.append(attempt(m))
        return tried[-1]

    first = run(candidates[0])
    if first.fits:
        return first, tried
    best, lo, hi = None, 1, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        probe = run(candidates[mid])
        if probe.fits:
            best, hi = probe, mid - 1
        else:
            lo = mid + 1
    return best, tried
