"""Integrity checks on the instance stream: a run-time repeat guard and an offline audit.

Both exist because of the OLMo 3 reproduction's silent memorisation bug (spec section 6): a
loader that strides its already-sharded stream again repeats records and replays data on
resume, and no single-process test can see it. The guard stops a run at the first repeat;
the audit simulates several processes before a run starts.
"""

from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator

import numpy as np
from jaxtyping import Integer

from olmo_eqx.data.sampler import StepSampler


class RepeatError(RuntimeError):
    """An instance was served twice in one epoch."""


class RepeatGuard:
    """Refuses any instance id served twice within one epoch, at O(1) per instance.

    One bit per instance for the current epoch (N/8 bytes: 125 MB at 10^9 instances, and
    pages are only committed once touched). To name the earlier step of a repeat it keeps
    the ids of the last `history_instances` served instances.
    """

    def __init__(self, num_instances: int, steps_per_epoch: int, history_instances: int = 1 << 20):
        self.num_instances = int(num_instances)
        self.steps_per_epoch = int(steps_per_epoch)
        self._bits = np.zeros((self.num_instances + 7) // 8, dtype=np.uint8)
        self._epoch: int | None = None
        self._history: deque[tuple[int, np.ndarray]] = deque()
        self._history_size = 0
        self._history_limit = int(history_instances)

    def _earlier_step(self, instance: int) -> str:
        for step, ids in reversed(self._history):
            if instance in ids:
                return f"step {step}"
        return "an earlier step of this epoch (older than the guard's history)"

    def check(self, step: int, instance_ids: Integer[np.ndarray, " n"]) -> None:
        """Record the ids served at global `step`; raise `RepeatError` on a repeat in this epoch."""
        ids = np.asarray(instance_ids, dtype=np.int64)
        epoch = step // self.steps_per_epoch
        if epoch != self._epoch:
            # A fresh calloc'd array rather than zero-filling: untouched pages cost no memory.
            self._bits = np.zeros(self._bits.shape, dtype=np.uint8)
            self._history.clear()
            self._history_size = 0
            self._epoch = epoch
        unique, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            instance = int(unique[np.argmax(counts > 1)])
            raise RepeatError(
                f"instance {instance} was served twice within step {step} (epoch {epoch}): the index "
                "stream is broken (sharded twice?); stop and audit with `python -m olmo_eqx.data.audit`"
            )
        byte, bit = ids >> 3, (np.uint8(1) << (ids & 7).astype(np.uint8))
        seen = (self._bits[byte] & bit) != 0
        if seen.any():
            instance = int(ids[np.argmax(seen)])
            raise RepeatError(
                f"instance {instance} served at step {step} was already served at {self._earlier_step(instance)} "
                f"of epoch {epoch}: the index stream repeats data (sharded twice?); stop the run and audit "
                "it with `python -m olmo_eqx.data.audit`"
            )
        np.bitwise_or.at(self._bits, byte, bit)
        self._history.append((step, ids))
        self._history_size += ids.size
        while self._history_size > self._history_limit and len(self._history) > 1:
            self._history_size -= self._history.popleft()[1].size


# A stream factory: (process_index, process_count) -> the instance ids that process reads at
# steps 0, 1, 2, ... (the trainer's view, whatever the loader does internally).
StreamFactory = Callable[[int, int], Iterator[np.ndarray]]


@dataclass
class AuditReport:
    """What a simulated run of `process_count` processes over `steps` steps served."""

    process_count: int
    steps: int
    duplicates: list[tuple[int, int, int, int]] = field(default_factory=list)  # (id, epoch, step, step)
    gaps: dict[int, int] = field(default_factory=dict)  # complete epoch -> ids never served
    wrong_batches: list[int] = field(default_factory=list)  # steps whose union != the reference batch
    heldout_overlap: int = 0  # held-out documents also in training data

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.gaps or self.wrong_batches or self.heldout_overlap)

    def summary(self) -> str:
        verdict = "OK" if self.ok else "PROBLEM"
        lines = [f"{verdict}: {self.process_count} process(es), {self.steps} steps"]
        if self.duplicates:
            i, e, s0, s1 = self.duplicates[0]
            lines.append(f"  {len(self.duplicates)} duplicate(s); first: instance {i} at steps {s0} and {s1} (epoch {e})")
        for epoch, missing in self.gaps.items():
            lines.append(f"  epoch {epoch}: {missing} instance(s) never served")
        if self.wrong_batches:
            lines.append(f"  {len(self.wrong_batches)} step(s) differ from the one-process order; first: {self.wrong_batches[0]}")
        if self.heldout_overlap:
            lines.append(f"  {self.heldout_overlap} held-out document(s) also appear in the training data")
        return "\n".join(lines)


def audit_stream(
    streams: StreamFactory, reference: StepSampler, process_count: int, steps: int, max_reported: int = 100
) -> AuditReport:
    """Simulate `process_count` processes for `steps` steps and compare with the one-process order.

    Every step's rows, concatenated in process order, must equal the reference global batch;
    no id may repeat within an epoch; every complete epoch must serve all ids except the
    N % B the sampler drops by design. Memory is 4 bytes per instance (meant for simulation).
    """
    n, spe, batch = reference.num_instances, reference.steps_per_epoch, reference.global_batch_size
    report = AuditReport(process_count=process_count, steps=steps)
    iterators = [streams(p, process_count) for p in range(process_count)]
    first_step = np.full(n, -1, dtype=np.int32)
    for step in range(steps):
        epoch = step // spe
        if step % spe == 0:
            first_step[:] = -1
        rows = np.concatenate([np.asarray(next(it), dtype=np.int64) for it in iterators])
        if rows.shape != (batch,) or not np.array_equal(rows, reference.global_batch(step)):
            report.wrong_batches.append(step)
        valid = rows[(rows >= 0) & (rows < n)]
        for i in valid.tolist():
            if first_step[i] >= 0:
                if len(report.duplicates) < max_reported:
                    report.duplicates.append((i, epoch, int(first_step[i]), step))
            else:
                first_step[i] = step
        if (step + 1) % spe == 0:
            missing = int((first_step < 0).sum()) - (n - spe * batch)
            if missing > 0:
                report.gaps[epoch] = missing
    return report
