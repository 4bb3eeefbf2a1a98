"""Instances: fixed-length chunks of token files, addressed by one global integer id.

As in OLMo-core, each file is cut into contiguous `sequence_length` chunks and the remainder
is dropped; documents may cross instance boundaries. Sources of a mix are laid end to end in
id space: source s owns ids [start_s, start_s + n_s). When a source has a target ratio, n_s
differs from its natural instance count and its ids map onto its instances by a fixed seeded
permutation (subsample: a fixed random subset; repeat: every instance floor/ceil times).
"""

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from jaxtyping import Bool, Int, Integer

from olmo_eqx.data.mixes import Source
from olmo_eqx.data.permutation import FeistelPermutation, derive_seed
from olmo_eqx.data.token_files import DataFileError, TokenFile, out_of_vocab_error

# OLMo-core's InstanceFilterConfig defaults (used for OLMo 3 32B and MaxText's 7B).
NGRAM_MAX_PERIOD = 13
NGRAM_MIN_PERIOD = 1
NGRAM_MAX_COUNT = 32
# Every memory map holds a file descriptor and a mix can list thousands of files: keep only
# the most recently read ones open.
MAX_OPEN_FILES = 128


def repeated_ngram_keep(
    input_ids: Integer[np.ndarray, "batch seq"],
    max_period: int = NGRAM_MAX_PERIOD,
    min_period: int = NGRAM_MIN_PERIOD,
    max_count: int = NGRAM_MAX_COUNT,
) -> Bool[np.ndarray, " batch"]:
    """False for rows holding an n-gram (length min..max_period) repeated >= max_count times in a row.

    A run where x[i] == x[i + p] holds for L consecutive i is a period-p stretch of L + p
    tokens, i.e. (L + p) // p back-to-back repeats of a p-gram (OLMo-core's periodic-sequence
    test). Run lengths come from a cumulative sum that restarts at every mismatch.
    """
    batch, seq = input_ids.shape
    keep = np.ones(batch, dtype=bool)
    for period in range(min_period, max_period + 1):
        if period * max_count > seq:
            break
        needed = (max_count - 1) * period  # matches in a row that make max_count repeats
        equal = input_ids[:, period:] == input_ids[:, :-period]
        # Ordinary text has few matches at any period: only rows with enough of them can hold a run.
        rows = np.flatnonzero(equal.sum(axis=1) >= needed)
        if rows.size == 0:
            continue
        equal = equal[rows]
        count = np.cumsum(equal, axis=1)
        last_reset = np.maximum.accumulate(np.where(equal, 0, count), axis=1)
        longest = (count - last_reset).max(axis=1)
        keep[rows[longest >= needed]] = False
    return keep


class InstanceDataset:
    """All instances of a list of sources, fetched by global id.

    Args:
        sources: the labelled file lists (see `olmo_eqx.data.mixes`).
        sequence_length: tokens per instance.
        vocab_size: the tokenizer's vocabulary size (chooses the file dtype and bounds ids).
        dtype: override the on-disk dtype (default: uint16 below 65536 ids, else uint32).
        total_instances: size of the mix when sources have ratios (default: the natural total).
        mix_seed: seed of the fixed subsample/repeat maps of ratio'd sources.
        filter_repeated_ngrams: zero the loss mask of instances with a long repeated n-gram.
        check_token_ids: scan every file for ids >= vocab_size now (reads all data once).
            Without it ids are still checked, per instance as `read` fetches it.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        sequence_length: int,
        vocab_size: int,
        dtype: np.dtype | str | None = None,
        total_instances: int | None = None,
        mix_seed: int = 0,
        filter_repeated_ngrams: bool = False,
        check_token_ids: bool = False,
    ):
        if sequence_length <= 0:
            raise DataFileError(f"sequence_length must be positive, got {sequence_length}")
        if not sources:
            raise DataFileError("a dataset needs at least one source")
        labels = [s.label for s in sources]
        if len(set(labels)) != len(labels):
            raise DataFileError(f"source labels must be unique, got {labels}")
        self.sources = tuple(sources)
        self.sequence_length = int(sequence_length)
        self.vocab_size = int(vocab_size)
        self.filter_repeated_ngrams = filter_repeated_ngrams
        self.mix_seed = int(mix_seed)

        self.files: list[TokenFile] = []
        self._open_files: OrderedDict[int, None] = OrderedDict()
        self._open_lock = threading.Lock()
        self._file_starts: list[np.ndarray] = []  # per source: cumulative instance counts, first 0
        self._file_offsets: list[int] = []  # per source: index of its first file in self.files
        natural = []
        for source in self.sources:
            files = [TokenFile(p, vocab_size, dtype) for p in source.paths]
            if check_token_ids:
                for f in files:
                    f.check_token_ids()
            counts = np.array([f.num_tokens // self.sequence_length for f in files], dtype=np.int64)
            self._file_offsets.append(len(self.files))
            self._file_starts.append(np.concatenate([[0], np.cumsum(counts)]))
            self.files.extend(files)
            natural.append(int(counts.sum()))
            if natural[-1] == 0:
                raise DataFileError(
                    f"source {source.label!r} has no complete instance of {sequence_length} tokens "
                    f"(files: {[str(p) for p in source.paths][:3]}...): lower sequence_length or add data"
                )
        self.natural_sizes = tuple(natural)
        self.sizes = self._mixed_sizes(total_instances)
        self._source_starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_instances = int(self._source_starts[-1])
        self._source_maps = tuple(
            None if n == nat else FeistelPermutation(nat, derive_seed(self.mix_seed, i))
            for i, (n, nat) in enumerate(zip(self.sizes, self.natural_sizes))
        )

    def _mixed_sizes(self, total_instances: int | None) -> tuple[int, ...]:
        ratios = [s.ratio for s in self.sources]
        if all(r is None for r in ratios):
            if total_instances is not None and total_instances != sum(self.natural_sizes):
                raise DataFileError("total_instances needs a ratio on every source to know how to resample")
            return self.natural_sizes
        if any(r is None for r in ratios):
            raise DataFileError(f"give a ratio for every source or none; got {dict(zip(self.source_labels, ratios))}")
        total = sum(self.natural_sizes) if total_instances is None else int(total_instances)
        norm = sum(ratios)
        sizes = tuple(int(total * r / norm) for r in ratios)
        if min(sizes) == 0:
            raise DataFileError(f"a ratio gives a source no instances (sizes {sizes}); raise total_instances")
        return sizes

    @property
    def source_labels(self) -> tuple[str, ...]:
        return tuple(s.label for s in self.sources)

    def __len__(self) -> int:
        return self.num_instances

    def fingerprint(self) -> str:
        """A digest of what the ids mean: checkpoints refuse to resume on another dataset.

        It covers labels, the last three path components and sizes of every file, the
        sequence length and the mix sizes, but not the data root, so a run can resume from
        the same files mounted elsewhere.
        """
        h = hashlib.sha256()
        # Not the n-gram filter: it changes loss masks, not which instance an id names.
        h.update(f"seq={self.sequence_length};mix_seed={self.mix_seed}".encode())
        for source, size, offset in zip(self.sources, self.sizes, self._file_offsets):
            h.update(f"|{source.label}:{size}".encode())
            for f in self.files[offset : offset + len(source.paths)]:
                tail = "/".join(f.path.parts[-3:])
                h.update(f";{tail}:{f.num_tokens}:{f.dtype.name}".encode())
        return h.hexdigest()[:16]

    def source_index(self, instance_ids: Integer[np.ndarray, " n"]) -> Int[np.ndarray, " n"]:
        """Index into `source_labels` of each instance id."""
        return (np.searchsorted(self._source_starts, instance_ids, side="right") - 1).astype(np.int64)

    def locate(self, instance_ids: Integer[np.ndarray, " n"]) -> tuple[Int[np.ndarray, " n"], Int[np.ndarray, " n"]]:
        """(index into self.files, first token offset) of each instance id."""
        ids = np.asarray(instance_ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_instances):
            raise IndexError(f"instance ids must lie in [0, {self.num_instances})")
        sources = self.source_index(ids)
        file_index = np.empty_like(ids)
        offset = np.empty_like(ids)
        for s in np.unique(sources):
            rows = sources == s
            local = ids[rows] - self._source_starts[s]
            if self._source_maps[s] is not None:
                local = self._source_maps[s](local % self.natural_sizes[s])
            starts = self._file_starts[s]
            f = np.searchsorted(starts, local, side="right") - 1
            file_index[rows] = f + self._file_offsets[s]
            offset[rows] = (local - starts[f]) * self.sequence_length
        return file_index, offset

    def _tokens(self, file_index: int) -> np.ndarray:
        with self._open_lock:
            self._open_files[file_index] = None
            self._open_files.move_to_end(file_index)
            while len(self._open_files) > MAX_OPEN_FILES:
                oldest, _ = self._open_files.popitem(last=False)
                self.files[oldest].close()
            return self.files[file_index].tokens

    def read(
        self, instance_ids: Integer[np.ndarray, " n"]
    ) -> tuple[Int[np.ndarray, "n seq"], Bool[np.ndarray, "n seq"]]:
        """Token ids (int32) and loss mask of the given instances, in the given order."""
        file_index, offset = self.locate(instance_ids)
        out = np.empty((len(file_index), self.sequence_length), dtype=np.int32)
        for row, (f, start) in enumerate(zip(file_index.tolist(), offset.tolist())):
            out[row] = self._tokens(f)[start : start + self.sequence_length]
        # Every id is checked as it is read (two reductions over the batch, far below the
        # cost of the read): an id >= vocab_size would index past the embedding and train
        # on NaN. A uint32 id >= 2**31 shows up negative in int32.
        if out.size and (int(out.max()) >= self.vocab_size or int(out.min()) < 0):
            row, col = (int(i) for i in np.argwhere((out >= self.vocab_size) | (out < 0))[0])
            f, position = int(file_index[row]), int(offset[row]) + col
            raise out_of_vocab_error(self.files[f].path, int(self._tokens(f)[position]), position, self.vocab_size)
        mask = np.ones(out.shape, dtype=bool)
        if self.filter_repeated_ngrams and len(out):
            mask &= repeated_ngram_keep(out)[:, None]
        return out, mask

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.label}={n}" for s, n in zip(self.sources, self.sizes))
        return f"InstanceDataset({parts}, seq={self.sequence_length}, vocab={self.vocab_size})"
