"""Instances: fixed-length chunks of token files, addressed by one global integer id.

As in OLMo-core, each file is cut into contiguous `sequence_length` chunks and the remainder
is dropped; documents may cross instance boundaries. Sources of a mix are laid end to end in
id space: source s owns ids [start_s, start_s + n_s). When a source has a target ratio, n_s
differs from its natural instance count and its ids map onto its instances by a fixed seeded
permutation (subsample: a fixed random subset; repeat: every instance floor/ceil times).
"""

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from jaxtyping import Bool, Int, Integer

from olmo_eqx.data.mixes import Source
from olmo_eqx.data.permutation import FeistelPermutation, derive_seed
from olmo_eqx.data.remote import RemoteReader, is_url, url_tail
from olmo_eqx.data.token_files import DataFileError, TokenFile, out_of_vocab_error

# OLMo-core's InstanceFilterConfig defaults (used for OLMo 3 32B and MaxText's 7B).
NGRAM_MAX_PERIOD = 13
NGRAM_MIN_PERIOD = 1
NGRAM_MAX_COUNT = 32
# Every memory map holds a file descriptor and a mix can list thousands of files: keep only
# the most recently read ones open.
MAX_OPEN_FILES = 128
# A file's content identity: SHA-256 of this many pages spread evenly over it, first and last
# included (the whole file when it is smaller), so a resume reads 32 KiB per file, not the data.
SAMPLE_PAGES = 8
PAGE_BYTES = 4096


def sample_digest(file: TokenFile) -> str:
    """SHA-256 (16 hex digits) of `SAMPLE_PAGES` pages of `file` spread over its bytes (range
    reads when it is remote: its first read also checks that its size is still the recorded one)."""
    h = hashlib.sha256()
    size = file.size
    if size <= SAMPLE_PAGES * PAGE_BYTES:
        h.update(file.read_bytes(0, size) if size else b"")
    else:
        last = size - PAGE_BYTES
        for i in range(SAMPLE_PAGES):
            h.update(file.read_bytes(last * i // (SAMPLE_PAGES - 1), PAGE_BYTES))
    return h.hexdigest()[:16]


def file_tail(file: TokenFile) -> str:
    """The last three components of a file's path or URL: what identifies it in a checkpoint
    (not the data root, so the same files mounted or served elsewhere match)."""
    return url_tail(file.path) if file.remote else "/".join(file.path.parts[-3:])


def _name(record: Mapping) -> str:
    return f"token file {record['file']} (source {record['source']!r})"


def describe_data_change(stored: Sequence[Mapping], current: Sequence[Mapping]) -> list[str]:
    """What changed between the file records a checkpoint stored and today's, one line per file
    (`InstanceDataset.file_records`); empty when the files are the same and in the same order."""
    changes: list[str] = []
    now = {(r["source"], r["file"]): r for r in current}
    before = {(r["source"], r["file"]): r for r in stored}
    by_content = {r["sample"]: r for r in stored}
    for key, old in before.items():
        new = now.get(key)
        if new is None:
            changes.append(f"{_name(old)} is gone from the dataset")
        elif new["tokens"] != old["tokens"]:
            kind = "truncated" if new["tokens"] < old["tokens"] else "appended to"
            changes.append(f"{_name(new)} was {kind}: {new['tokens']} tokens, the checkpoint's had {old['tokens']}")
        elif new["dtype"] != old["dtype"]:
            changes.append(f"{_name(new)} is read as {new['dtype']}, the checkpoint's as {old['dtype']}")
        elif new["sample"] != old["sample"]:
            was = by_content.get(new["sample"])
            hint = f"; it now holds what {was['file']} held (files swapped?)" if was and was is not old else ""
            changes.append(f"{_name(new)}: its contents changed at the same size (rewritten in place){hint}")
    changes += [f"{_name(r)} is new to the dataset" for key, r in now.items() if key not in before]
    if not changes and [(r["source"], r["file"]) for r in stored] != [(r["source"], r["file"]) for r in current]:
        moved = next(r for r, o in zip(current, stored) if (r["source"], r["file"]) != (o["source"], o["file"]))
        changes.append(f"the files are in another order: {_name(moved)} moved (instance ids would name other data)")
    return changes


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
        reader: reads the files given as URLs (`olmo_eqx.data.remote`); one is made when needed.
        sizes: known sizes of remote files (the run's size cache): no size request for them.
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
        reader: RemoteReader | None = None,
        sizes: Mapping[str, int] | None = None,
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
        self._file_records: list[dict] | None = None
        self._open_files: OrderedDict[int, None] = OrderedDict()
        self._open_lock = threading.Lock()
        self._file_starts: list[np.ndarray] = []  # per source: cumulative instance counts, first 0
        self._file_offsets: list[int] = []  # per source: index of its first file in self.files
        urls = [p for s in self.sources for p in s.paths if is_url(p)]
        self.reader = (reader or RemoteReader()) if urls else None  # local files need none
        # All sizes at once, concurrently: a 950-file mix would otherwise wait on 950 round trips.
        self.remote_sizes = self.reader.sizes(urls, sizes or {}) if urls else {}
        natural = []
        for source in self.sources:
            files = [
                TokenFile(p, vocab_size, dtype, reader=self.reader, size=self.remote_sizes[p]) if is_url(p)
                else TokenFile(p, vocab_size, dtype)
                for p in source.paths
            ]
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
        self.file_records()  # the files' identity as they were when opened

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

    def file_records(self) -> list[dict]:
        """Per file, in id order: its source, the last three path components (not the data
        root, so the same files mounted elsewhere match), tokens, dtype and `sample_digest`
        (computed once, a few files at a time). A checkpoint stores them to name what changed."""
        if self._file_records is None:
            owners = [s.label for s, offset in zip(self.sources, self._file_offsets) for _ in s.paths]
            if self.reader is not None:  # remote: many round trips in flight
                samples = list(self.reader.pool.map(sample_digest, self.files))
            else:
                with ThreadPoolExecutor(max_workers=8) as pool:
                    samples = list(pool.map(sample_digest, self.files))
            self._file_records = [
                {"source": owner, "file": file_tail(f), "tokens": f.num_tokens,
                 "dtype": f.dtype.name, "sample": sample}
                for owner, f, sample in zip(owners, self.files, samples)
            ]
        return self._file_records

    def fingerprint(self, content: bool = True) -> str:
        """A digest of what the ids mean: checkpoints refuse to resume on another dataset.

        It covers labels, the last three path components, sizes and content samples
        (`file_records`) of every file, the sequence length and the mix sizes, but not the
        data root, so a run can resume from the same files mounted elsewhere. content=False:
        without the samples, as checkpoints of older olmo_eqx versions recorded it.
        """
        h = hashlib.sha256()
        # Not the n-gram filter: it changes loss masks, not which instance an id names.
        h.update(f"seq={self.sequence_length};mix_seed={self.mix_seed}".encode())
        for source, size, offset in zip(self.sources, self.sizes, self._file_offsets):
            h.update(f"|{source.label}:{size}".encode())
            for i, f in enumerate(self.files[offset : offset + len(source.paths)], start=offset):
                tail = file_tail(f)
                h.update(f";{tail}:{f.num_tokens}:{f.dtype.name}".encode())
                if content:
                    h.update(f":{self.file_records()[i]['sample']}".encode())
        return h.hexdigest()[:16]

    def check_unchanged(self, fingerprint: str, records: Sequence[Mapping] = ()) -> None:
        """Raise `DataFileError` unless this is the dataset a checkpoint recorded as
        (`fingerprint`, `records` = its `file_records`), naming each file and what changed."""
        if fingerprint == self.fingerprint() or (not records and fingerprint == self.fingerprint(content=False)):
            return
        changes = describe_data_change(records, self.file_records()) if records else []
        what = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        raise DataFileError(
            f"cannot resume: the checkpoint's data fingerprint {fingerprint} differs from this dataset's "
            f"{self.fingerprint()}: "
            + (what if changes else "the data sources, sequence length or mix changed since the checkpoint was written")
            + ". Point the run at the original data, or start a fresh data position deliberately (no loader state)"
        )

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

    def _read_local(self, file_index: int, start: int) -> np.ndarray:
        # Under the lock: the LRU may close a descriptor another thread is about to pread from.
        with self._open_lock:
            self._open_files[file_index] = None
            self._open_files.move_to_end(file_index)
            while len(self._open_files) > MAX_OPEN_FILES:
                oldest, _ = self._open_files.popitem(last=False)
                self.files[oldest].close()
            return self.files[file_index].read(start, self.sequence_length)

    def read(
        self, instance_ids: Integer[np.ndarray, " n"]
    ) -> tuple[Int[np.ndarray, "n seq"], Bool[np.ndarray, "n seq"]]:
        """Token ids (int32) and loss mask of the given instances, in the given order."""
        file_index, offset = self.locate(instance_ids)
        out = np.empty((len(file_index), self.sequence_length), dtype=np.int32)
        rows = list(zip(file_index.tolist(), offset.tolist()))
        if self.reader is not None:  # one range request per row, all of them in flight together
            for row, tokens in enumerate(self.reader.pool.map(lambda fs: self.files[fs[0]].read(fs[1], self.sequence_length), rows)):
                out[row] = tokens
        else:
            for row, (f, start) in enumerate(rows):
                out[row] = self._read_local(f, start)
        # Every id is checked as it is read (two reductions over the batch, far below the
        # cost of the read): an id >= vocab_size would index past the embedding and train
        # on NaN. A uint32 id >= 2**31 shows up negative in int32.
        if out.size and (int(out.max()) >= self.vocab_size or int(out.min()) < 0):
            row, col = (int(i) for i in np.argwhere((out >= self.vocab_size) | (out < 0))[0])
            f, position = int(file_index[row]), int(offset[row]) + col
            raise out_of_vocab_error(self.files[f].path, int(self.files[f].read(position, 1)[0]), position, self.vocab_size)
        mask = np.ones(out.shape, dtype=bool)
        if self.filter_repeated_ngrams and len(out):
            mask &= repeated_ngram_keep(out)[:, None]
        return out, mask

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.label}={n}" for s, n in zip(self.sources, self.sizes))
        return f"InstanceDataset({parts}, seq={self.sequence_length}, vocab={self.vocab_size})"
