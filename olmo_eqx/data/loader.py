"""The data loader the trainer calls: process-local numpy batches, resumable on any topology.

    loader = DataLoader(dataset, global_batch_size=B, seed=s,
                        process_index=jax.process_index(), process_count=jax.process_count(),
                        state=None or LoaderState.from_dict(ckpt["data"]))
    batch = loader.next_batch()          # this process's rows of global batch `batch.step`
    ckpt["data"] = loader.state.to_dict()

Rows are exactly `StepSampler.process_slice`: the loader never strides or reshuffles them.
Labels are not produced here: the loss shifts `input_ids` left by one itself.
"""

import collections
import queue
import threading
import dataclasses
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import jax
import numpy as np
from jaxtyping import Float, Int, Shaped

from olmo_eqx.batch import TokenBatch, document_layout
from olmo_eqx.data.guard import RepeatGuard
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.sampler import LoaderState, StepSampler, process_slice_bounds


@dataclass(frozen=True)
class Batch:
    """One process's rows of one global batch.

    `loss_mask` is float32, 1.0 where a token counts as a target and 0.0 where the loss must
    ignore it (filtered instances, padding of a final held-out batch): the train step's
    convention, so it goes to the device as is; `instance_ids` are -1 on padding rows; `source_ids` index the
    dataset's `source_labels` (per-source metrics).
    """

    input_ids: Int[np.ndarray, "batch seq"]
    loss_mask: Float[np.ndarray, "batch seq"]
    instance_ids: Int[np.ndarray, " batch"]
    source_ids: Int[np.ndarray, " batch"]
    step: int
    epoch: int


def read_batch(dataset: InstanceDataset, instance_ids: Int[np.ndarray, " batch"], step: int, epoch: int) -> Batch:
    """Fetch the given instances (ids < 0 are padding: zeros with a zero loss mask)."""
    ids = np.asarray(instance_ids, dtype=np.int64)
    real = ids >= 0
    input_ids = np.zeros((ids.size, dataset.sequence_length), dtype=np.int32)
    loss_mask = np.zeros((ids.size, dataset.sequence_length), dtype=np.float32)
    source_ids = np.full(ids.size, -1, dtype=np.int64)
    if real.any():
        input_ids[real], loss_mask[real] = dataset.read(ids[real])
        source_ids[real] = dataset.source_index(ids[real])
    return Batch(input_ids=input_ids, loss_mask=loss_mask, instance_ids=ids, source_ids=source_ids, step=step, epoch=epoch)


class DataLoader:
    """Serves this process's slice of global batch 0, 1, 2, ... of a dataset, forever.

    Batch k is a pure function of (dataset, seed, k, process_index, process_count); epochs
    roll over every `steps_per_epoch` steps with a fresh permutation. A `RepeatGuard`
    (on by default) stops the run if an instance is ever served twice in one epoch.
    """

    def __init__(
        self,
        dataset: InstanceDataset,
        global_batch_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        state: LoaderState | None = None,
        guard: bool = True,
    ):
        self.dataset = dataset
        self.global_batch_size = int(global_batch_size)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.sampler = StepSampler(len(dataset), self.global_batch_size, seed)
        self.rows = process_slice_bounds(self.global_batch_size, self.process_index, self.process_count)
        self.fingerprint = dataset.fingerprint()
        self._step = 0
        if state is not None:
            dataset.check_unchanged(state.fingerprint, state.files)  # names the file that changed
            self.sampler.check_resumable(state, state.fingerprint)
            self._step = state.step
        self.guard = RepeatGuard(len(dataset), self.sampler.steps_per_epoch) if guard else None

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def local_batch_size(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def step(self) -> int:
        """The global step of the next batch `next_batch` returns."""
        return self._step

    @property
    def state(self) -> LoaderState:
        """The position after the batches served so far: store it in the checkpoint."""
        state = self.sampler.state_after(self._step, self.fingerprint)
        return dataclasses.replace(state, files=tuple(self.dataset.file_records()))

    def local_instance_ids(self, step: int) -> Int[np.ndarray, " batch"]:
        """The instance ids this process reads at global `step` (its contiguous slice)."""
        return self.sampler.rows(step, *self.rows)

    def batch_at(self, step: int) -> Batch:
        """This process's batch at global `step`, without moving the loader (pure)."""
        return read_batch(self.dataset, self.local_instance_ids(step), step, self.sampler.epoch_of(step))

    def accept(self, batch: Batch) -> Batch:
        """Mark `batch` as served: it must be the next step; the guard checks its ids."""
        if batch.step != self._step:
            raise RuntimeError(f"batch for step {batch.step} served when the loader is at step {self._step}")
        if self.guard is not None:
            self.guard.check(batch.step, batch.instance_ids)
        self._step += 1
        return batch

    def next_batch(self) -> Batch:
        """This process's batch at the current step; advances the loader by one step."""
        return self.accept(self.batch_at(self._step))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()


class Interrupted(Exception):
    """A stop was asked for while the next batch was still being read (`Prefetcher.interrupted`)."""


class Prefetcher:
    """Reads the next `depth` batches in background threads so the device never waits.

    Batches are computed by the loader's pure `batch_at` ahead of time, and marked served
    (guard, position) only when handed out, so `state` is always the trainer's position,
    never the read-ahead one. `workers` batches are read at once (remote token files: each
    batch is a round trip per row, so several batches in flight hide the latency); they are
    handed out in step order. At most `depth + workers` batches are in memory. `transform`
    (e.g. `global_batch_arrays`) runs in one thread, in step order.
    """

    def __init__(
        self, loader: DataLoader, depth: int = 2, transform: Callable[[Batch], Any] | None = None, workers: int = 1
    ):
        self.loader = loader
        self._transform = transform
        self._workers = max(1, int(workers))
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="olmo-eqx-read") if self._workers > 1 else None
        self._thread = threading.Thread(target=self._work, args=(loader.step,), daemon=True, name="olmo-eqx-prefetch")
        self._thread.start()
        # When it says True while `__next__` waits for a batch, the remote reads are cut and
        # `Interrupted` raised: a stop signal must not wait minutes for a slow server.
        self.interrupted: Callable[[], bool] | None = None

    def _work(self, step: int) -> None:
        ahead: collections.deque = collections.deque()
        try:
            while not self._stop.is_set():
                if self._pool is None:
                    batch = self.loader.batch_at(step)
                else:
                    while len(ahead) < self._workers:
                        ahead.append(self._pool.submit(self.loader.batch_at, step + len(ahead)))
                    batch = ahead.popleft().result()
                item = (batch, self._transform(batch) if self._transform else batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BaseException as error:  # surfaced in the consumer's thread
            self._queue.put((None, error))
        finally:
            for future in ahead:
                future.cancel()

    @property
    def state(self) -> LoaderState:
        return self.loader.state

    def __next__(self) -> Any:
        while True:
            try:
                batch, item = self._queue.get(timeout=None if self.interrupted is None else 0.2)
                break
            except queue.Empty:
                if self.interrupted():
                    self._cancel_reads()
                    raise Interrupted from None
        if batch is None:
            raise item
        self.loader.accept(batch)
        return item

    def __iter__(self) -> "Prefetcher":
        return self

    def _cancel_reads(self) -> None:
        reader = getattr(self.loader.dataset, "reader", None)
        if reader is not None:
            reader.cancel()

    def close(self) -> None:
        self._stop.set()
        if self.interrupted is not None and self.interrupted():
            self._cancel_reads()  # the reads ahead are not needed: don't wait for a slow server
        self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def to_global_array(local: Shaped[np.ndarray, "rows *rest"], sharding: jax.sharding.Sharding) -> jax.Array:
    """One global `jax.Array` from every process's rows (`jax.make_array_from_process_local_data`).

    `sharding` (e.g. `NamedSharding(mesh, P("data"))`) must give this process exactly rows
    [p*B/P, (p+1)*B/P) of the batch dimension, the rows `DataLoader` read; a mesh whose
    data axis is not ordered by process would silently pair rows with the wrong process,
    so that is checked and refused.
    """
    process_count = jax.process_count()
    global_shape = (local.shape[0] * process_count, *local.shape[1:])
    lo, hi = process_slice_bounds(global_shape[0], jax.process_index(), process_count)
    index_map = sharding.addressable_devices_indices_map(global_shape)
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [global_shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    if (min(starts), max(stops)) != (lo, hi):
        raise ValueError(
            f"the sharding gives process {jax.process_index()} batch rows [{min(starts)}, {max(stops)}) but the "
            f"loader read rows [{lo}, {hi}): shard the batch dimension over a mesh axis ordered by process "
            "(jax.make_mesh does this), or build the loader with process_count=1 if every process holds all rows"
        )
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def global_batch_arrays(
    batch: Batch, sharding: jax.sharding.Sharding, *, eos_id: Optional[int] = None, reset_positions: bool = False
) -> TokenBatch:
    """A process-local batch as a `TokenBatch` of global arrays on `sharding`.

    With `eos_id` (document masking) it also carries the documents' segment ids, and with
    `reset_positions` positions restarting at each document, derived here on the host.
    """
    segment_ids = positions = None
    if eos_id is not None:
        segment_ids, positions = document_layout(batch.input_ids, eos_id, reset_positions=reset_positions)
    put = lambda x: None if x is None else to_global_array(x, sharding)  # noqa: E731
    return TokenBatch(put(batch.input_ids), put(batch.loss_mask), put(segment_ids), put(positions))
