"""`trainer.micro_batches=auto`: the fewest micro-batches whose train step fits on the devices the
run has now, so a run resumed on a quarter of its devices needs nothing re-tuned.

Micro-batching splits the same global batch into sequential slices and sums their float32
gradients, every slice normalised by the global batch's target count (`olmo_eqx.train.step`):
the data order and the recipe stay, and the step's loss and update are the one-slice step's
within float32 noise. So the count is a layout choice, like the mesh, and may change between
sessions of a run (`olmo_eqx.config.RESUME_COMPARED` leaves it out).

How a count is judged: the run's own jitted step is lowered for the run's state and a batch of
its shapes and layout, compiled, and XLA's memory analysis of one device's program
(`olmo_eqx.train.memory`) is held against what a device offers (`trainer.device_memory_gib`, else
the device's `bytes_limit`, else on CPU the host's memory over its local devices); XLA:TPU's
own refusal counts as "does not fit". The first candidate (one micro-batch, or the fewest the
batch allows) is tried first: when it fits, that compiled program is the one the loop runs
(JAX's jit keeps it; no second compile). Otherwise a bisection over the candidates, each probe
one compile. In a run of several processes every probe's verdict is agreed by all of them.

Only the micro-batches are chosen, not the remat policy: with a quarter of the devices and the
same global batch, four times the micro-batches give each device the same rows per slice as
before, so activations need what they needed; what grows is each device's share of the state
(FSDP shards four times larger), which no remat policy shrinks.
"""

import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh

from olmo_eqx.config import Config
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import global_batch_arrays, read_batch
from olmo_eqx.data.sources import document_options
from olmo_eqx.errors import TrainError
from olmo_eqx.run.signals import any_process
from olmo_eqx.sharding import ShardingRules, batch_sharding
from olmo_eqx.train.memory import (
    Attempt, Budget, CompileRefused, compile_lowered, device_budget, fewest_that_fit, memory_bytes,
    micro_batch_candidates, needed_bytes, needed_what, size,
)
from olmo_eqx.train.schedules import Schedule
from olmo_eqx.train.state import TrainState
from olmo_eqx.train.step import make_train_step


@dataclass
class MicroBatchChoice:
    """The micro-batch count this session trains with, and, when `auto` chose it, why."""

    micro_batches: int
    auto: bool
    devices: int
    processes: int
    device_kind: str
    platform: str
    budget: Optional[Budget] = None
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def chosen(self) -> Optional[Attempt]:
        return next((a for a in self.attempts if a.micro_batches == self.micro_batches and a.fits), None)

    def record(self) -> dict:
        """What config.json and every checkpoint's config keep of this session (key `session`),
        for the next session's line."""
        record = {"devices": self.devices, "processes": self.processes, "device_kind": self.device_kind,
                  "micro_batches": self.micro_batches, "micro_batches_auto": self.auto}
        if self.chosen is not None and self.budget is not None:
            record.update(needed_bytes=self.chosen.needed, budget_bytes=self.budget.bytes, budget_from=self.budget.source)
        return record

    def line(self, previous: Optional[dict] = None) -> Optional[str]:
        """One line: what auto chose, and what changed against the previous session (its
        `record()`, from the checkpoint resumed); None for a fixed count with nothing changed."""
        previous = previous or {}
        before_devices, before_micro = previous.get("devices"), previous.get("micro_batches")
        plural = lambda n: f"{n} device" + ("" if n == 1 else "s")  # noqa: E731
        devices = plural(self.devices) if before_devices in (None, self.devices) else f"{before_devices} -> {plural(self.devices)}"
        if before_micro is not None and before_micro != self.micro_batches:
            micro = f"micro-batches {before_micro} -> {self.micro_batches}"
        else:
            micro = f"micro-batches {self.micro_batches}" + (" (unchanged)" if before_micro is not None else "")
        if not self.auto:
            if before_devices in (None, self.devices) and before_micro in (None, self.micro_batches):
                return None
            return f"{devices}: {micro} (trainer.micro_batches={self.micro_batches}, fixed)"
        chosen = self.chosen
        if chosen is None:  # a session with no step to train compiled nothing
            return None
        why = (f"fits {size(chosen.needed)} of {size(self.budget.bytes)} per device, "
               f"{needed_what(self.platform)} against {self.budget.source}")
        refused = [a.micro_batches for a in self.attempts if not a.fits]
        fewer = [m for m in refused if m < self.micro_batches]
        if fewer:
            why += f"; {', '.join(map(str, fewer))} did not fit"
        return f"{devices}: {micro} (trainer.micro_batches=auto: {why})"


def choose_micro_batches(
    config: Config, state: TrainState, mesh: Mesh, rules: ShardingRules, schedule: Schedule, dataset: InstanceDataset,
    progress: Optional[Callable[[str], None]] = None, previous: Optional[dict] = None, trains: bool = True,
) -> MicroBatchChoice:
    """The session's micro-batch count: `trainer.micro_batches` when fixed, else the fewest that
    fit (compiled now, for `state` and a batch laid out as the loop's; the loop's first step then
    runs that very program). Raises `TrainError` when none fits.

    trains=False (the checkpoint is already at the run's last step): nothing is compiled, and
    auto keeps the `previous` session's count (its `record()`), else 1."""
    device = jax.devices()[0]
    base = dict(devices=jax.device_count(), processes=jax.process_count(), device_kind=device.device_kind,
                platform=device.platform)
    setting, trainer, data = config.trainer.micro_batches, config.trainer, config.data
    if setting != "auto":
        return MicroBatchChoice(micro_batches=setting, auto=False, **base)
    if not trains:
        kept = (previous or {}).get("micro_batches")
        return MicroBatchChoice(micro_batches=kept if isinstance(kept, int) else 1, auto=True, **base)
    try:
        budget = device_budget(device, trainer.device_memory_gib, jax.local_device_count())
    except ValueError as e:
        raise TrainError(str(e)) from None
    shards = math.prod(mesh.shape[axis] for axis in rules.batch)
    candidates = micro_batch_candidates(data.global_batch_size, shards)
    # The loop's batch layout and fields, all padding (nothing is read from the token files).
    rows = data.global_batch_size // jax.process_count()
    padding = read_batch(dataset, np.full(rows, -1, dtype=np.int64), step=0, epoch=0)
    batch = global_batch_arrays(padding, batch_sharding(mesh, rules), **document_options(data))
    platform = device.platform

    def attempt(m: int) -> Attempt:
        train_step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=m)
        what = (f"the train step, {m} micro-batch(es) of {data.global_batch_size // m} x {data.sequence_length} "
                f"on {base['devices']} {platform} device(s)")
        try:
            compiled = compile_lowered(train_step.lower(state, batch), what, progress=progress,
                                       label="trainer.micro_batches=auto")
        except CompileRefused as refusal:
            result = Attempt(m, False, None, refused=str(refusal))
        else:
            needed = needed_bytes(memory_bytes(compiled.compiled.memory_analysis()), platform)
            result = Attempt(m, needed <= budget.bytes, needed)
            if progress:
                verdict = "fits" if result.fits else "does not fit"
                progress(f"  {size(needed)} per device ({needed_what(platform)}) of {size(budget.bytes)}: {verdict}")
        # Every process must train the same program: a count fits only where it fits on all.
        result.fits = not any_process(not result.fits)
        return result

    best, attempts = fewest_that_fit(candidates, attempt)
    if best is None:
        raise TrainError(_nothing_fits(config, base["devices"], shards, platform, budget, attempts))
    return MicroBatchChoice(micro_batches=best.micro_batches, auto=True, budget=budget, attempts=attempts, **base)


def _nothing_fits(config: Config, devices: int, shards: int, platform: str, budget: Budget, attempts: list[Attempt]) -> str:
    last = max(attempts, key=lambda a: a.micro_batches)
    rows = max(config.data.global_batch_size // last.micro_batches // shards, 1)
    need = (f"needs {size(last.needed)} per device ({needed_what(platform)})" if last.needed is not None
            else f"is refused by the compiler ({last.refused})")
    return (
        f"trainer.micro_batches=auto: the train step fits on none of the {devices} {platform} device(s): even with "
        f"{last.micro_batches} micro-batches ({rows} x {config.data.sequence_length} tokens per batch shard each, the "
        f"fewest the global batch allows) it {need}, and a device offers {size(budget.bytes)} ({budget.source}). "
        f"Run on more devices (FSDP splits the state over them), lower model.remat (full keeps least), shorten "
        f"data.sequence_length, or set trainer.device_memory_gib if the device has more"
    )
