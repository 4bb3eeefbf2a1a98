"""The step-indexed sampler: which instances global batch k holds, and which rows each process reads.

The order is a function of (seed, epoch, global position) only:

    epoch(k)       = k // steps_per_epoch                  steps_per_epoch = N // B
    batch(k)       = perm_{seed, epoch}(positions [j*B, (j+1)*B)),   j = k % steps_per_epoch
    slice(k, p, P) = batch(k)[p*B/P : (p+1)*B/P]

so a resume at step k on any number of processes computes exactly the rows an uninterrupted
run would have read, with no per-process state. The last N % B positions of each epoch are
dropped (a partial batch would change the batch size). Process slices are contiguous and
nothing downstream may stride them again (spec section 6: the memorisation bug).
"""

import dataclasses
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import numpy as np
from jaxtyping import Int

from olmo_eqx.data.permutation import FeistelPermutation, derive_seed
from olmo_eqx.data.token_files import DataFileError


@dataclass(frozen=True)
class LoaderState:
    """The data position a checkpoint stores: enough to resume on any topology.

    `step` counts global batches served since the start of training (across epochs);
    `epoch` and `instances_consumed` follow from it and the batch size and are kept as
    cross-checks; `fingerprint` identifies the dataset the ids refer to, `files` describes
    each of its files (`InstanceDataset.file_records`) so a refusal can name what changed.
    """

    seed: int
    epoch: int
    step: int
    instances_consumed: int
    fingerprint: str
    files: tuple = dataclasses.field(default=(), compare=False)  # dicts: the fingerprint stands for them

    def to_dict(self) -> dict[str, Any]:
        """Plain Python types only, for any checkpoint format (JSON's: `files` as a list)."""
        state = dataclasses.asdict(self)
        state["files"] = list(state["files"])
        return state

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LoaderState":
        fields = {f.name for f in dataclasses.fields(cls)} - {"files"}  # older checkpoints have no files
        missing = fields - set(data)
        if missing:
            raise DataFileError(f"loader state is missing {sorted(missing)}: got keys {sorted(data)}")
        return cls(
            seed=int(data["seed"]),
            epoch=int(data["epoch"]),
            step=int(data["step"]),
            instances_consumed=int(data["instances_consumed"]),
            fingerprint=str(data["fingerprint"]),
            files=tuple(dict(record) for record in data.get("files") or ()),
        )


def process_slice_bounds(global_batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    """Rows [lo, hi) of every global batch that process `process_index` of `process_count` reads."""
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if global_batch_size % process_count:
        raise DataFileError(
            f"global batch size {global_batch_size} does not split evenly over {process_count} processes: "
            "choose a global batch size divisible by the process count"
        )
    per_process = global_batch_size // process_count
    return process_index * per_process, (process_index + 1) * per_process


class StepSampler:
    """Global batch k of a dataset of `num_instances` ids, computed from (seed, k) alone.

    Memory is O(1) in the dataset size: each epoch's permutation is a Feistel network
    (`olmo_eqx.data.permutation`), evaluated only at the positions a batch needs.
    """

    def __init__(self, num_instances: int, global_batch_size: int, seed: int):
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if num_instances < global_batch_size:
            raise DataFileError(
                f"the dataset has {num_instances} instances, fewer than one global batch of "
                f"{global_batch_size}: add data, or lower the batch size or sequence length"
            )
        self.num_instances = int(num_instances)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.steps_per_epoch = self.num_instances // self.global_batch_size
        self._cached: tuple[int, FeistelPermutation] | None = None

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> FeistelPermutation:
        """Epoch `epoch`'s order over all ids (a fresh bijection per epoch)."""
        cached = self._cached  # one read: a prefetch thread may swap it concurrently
        if cached is None or cached[0] != epoch:
            cached = (epoch, FeistelPermutation(self.num_instances, derive_seed(self.seed, epoch)))
            self._cached = cached
        return cached[1]

    def rows(self, step: int, lo: int, hi: int) -> Int[np.ndarray, " rows"]:
        """Instance ids of rows [lo, hi) of global batch `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index_in_epoch = divmod(step, self.steps_per_epoch)
        first = index_in_epoch * self.global_batch_size
        return self.permutation(epoch)(np.arange(first + lo, first + hi, dtype=np.int64))

    def global_batch(self, step: int) -> Int[np.ndarray, " batch"]:
        """All instance ids of global batch `step`, in row order."""
        return self.rows(step, 0, self.global_batch_size)

    def process_slice(self, step: int, process_index: int, process_count: int) -> Int[np.ndarray, " rows"]:
        """The contiguous slice of global batch `step` that one process reads."""
        lo, hi = process_slice_bounds(self.global_batch_size, process_index, process_count)
        return self.rows(step, lo, hi)

    def state_after(self, steps_served: int, fingerprint: str) -> LoaderState:
        """The checkpointable position once `steps_served` global batches have been served."""
        return LoaderState(
            seed=self.seed,
            epoch=self.epoch_of(steps_served),
            step=steps_served,
            instances_consumed=steps_served * self.global_batch_size,
            fingerprint=fingerprint,
        )

    def check_resumable(self, state: LoaderState, fingerprint: str) -> None:
        """Raise a clear error if `state` was not produced by this dataset, seed and batch size."""
        if state.fingerprint != fingerprint:
            raise DataFileError(
                f"cannot resume: the checkpoint's data fingerprint {state.fingerprint} differs from this "
                f"dataset's {fingerprint}. The data sources, sequence length or mix changed since the "
                "checkpoint was written; point the run at the original data, or start a fresh data "
                "position deliberately (no loader state)"
            )
        if state.seed != self.seed:
            raise DataFileError(
                f"cannot resume: the checkpoint's data seed is {state.seed}, the config's is {self.seed}; "
                "use the checkpoint's seed"
            )
        expected = self.state_after(state.step, fingerprint)
        if (state.epoch, state.instances_consumed) != (expected.epoch, expected.instances_consumed):
            raise DataFileError(
                f"cannot resume: the checkpoint served {state.instances_consumed} instances in {state.step} "
                f"steps (epoch {state.epoch}), which a global batch of {self.global_batch_size} over "
                f"{self.num_instances} instances cannot produce; keep the global batch size of the run"
            )
