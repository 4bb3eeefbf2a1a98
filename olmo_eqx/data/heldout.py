"""Held-out sets: named evaluation data read in a fixed order, and train/held-out splits by document.

A held-out set is read front to back (instance 0, 1, 2, ...) so every evaluation at every
step sees the same tokens; the final partial batch is padded with masked rows so batch
shapes never change. Splitting assigns whole documents (EOS-terminated spans) to one side
by a hash of their content, so duplicate documents can never straddle the split.
"""

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator, Sequence

import numpy as np
from jaxtyping import Int, Integer

from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import Batch, read_batch
from olmo_eqx.data.mixes import Source
from olmo_eqx.data.sampler import process_slice_bounds
from olmo_eqx.data.token_files import TokenFile, write_token_file


@dataclass(frozen=True)
class HeldOutSet:
    """A named evaluation dataset, read in instance order."""

    name: str
    dataset: InstanceDataset

    def num_batches(self, global_batch_size: int) -> int:
        return -(-len(self.dataset) // global_batch_size)

    def batches(self, global_batch_size: int, process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
        """This process's contiguous slice of each global evaluation batch, in order.

        Global batch j holds instances [j*B, (j+1)*B); ids past the end are padding (-1,
        loss mask False). `Batch.step` is j and `Batch.epoch` is 0.
        """
        lo, hi = process_slice_bounds(global_batch_size, process_index, process_count)
        for j in range(self.num_batches(global_batch_size)):
            ids = np.arange(j * global_batch_size + lo, j * global_batch_size + hi, dtype=np.int64)
            ids[ids >= len(self.dataset)] = -1
            yield read_batch(self.dataset, ids, j, 0)


def heldout_sets(
    named_sources: Sequence[Source], sequence_length: int, vocab_size: int, dtype: np.dtype | str | None = None,
    **remote,
) -> list[HeldOutSet]:
    """One held-out set per source (its label is the set's name), in the order given; `remote`:
    `InstanceDataset`'s reader and sizes, for sets at URLs."""
    return [
        HeldOutSet(source.label, InstanceDataset([source], sequence_length, vocab_size, dtype=dtype, **remote))
        for source in named_sources
    ]


def document_bounds(tokens: Integer[np.ndarray, " n"], eos_id: int) -> Int[np.ndarray, "docs 2"]:
    """[start, end) of each document; a document ends with (and includes) its EOS.

    Tokens after the last EOS form a final document without one.
    """
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    if len(tokens) and (not len(ends) or ends[-1] != len(tokens)):
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return np.stack([starts, ends.astype(np.int64)], axis=1).reshape(-1, 2)


def _document_digest(doc: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(doc, dtype=np.int64).tobytes(), digest_size=8).digest()


def document_digests(files: Sequence[TokenFile], eos_id: int) -> set[bytes]:
    """Content digests of every non-empty document in the files (EOS excluded from the content)."""
    digests = set()
    for f in files:
        tokens = np.asarray(f.tokens)
        for start, end in document_bounds(tokens, eos_id).tolist():
            doc = tokens[start:end]
            if len(doc) and doc[-1] == eos_id:
                doc = doc[:-1]
            if len(doc):
                digests.add(_document_digest(doc))
    return digests


def heldout_overlap(train_files: Sequence[TokenFile], heldout_files: Sequence[TokenFile], eos_id: int) -> int:
    """How many distinct held-out documents also occur, token for token, in the training files."""
    return len(document_digests(heldout_files, eos_id) & document_digests(train_files, eos_id))


def split_train_heldout(
    files: Sequence[TokenFile],
    eos_id: int,
    heldout_fraction: float,
    out_dir: str | os.PathLike,
    salt: str = "olmo_eqx",
) -> tuple[Path, Path]:
    """Split documents of `files` into `out_dir/train.npy` and `out_dir/heldout.npy`.

    A document goes to held-out when a salted hash of its content falls under
    `heldout_fraction`, so the split is deterministic and identical documents share a side.
    Raises if the result overlaps (it cannot, unless the hash assignment is broken).
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    threshold = int(heldout_fraction * 2**64)
    vocab_size = max(f.vocab_size for f in files)
    dtype = files[0].dtype
    parts: dict[str, list[np.ndarray]] = {"train": [], "heldout": []}
    for f in files:
        tokens = np.asarray(f.tokens)
        for start, end in document_bounds(tokens, eos_id).tolist():
            doc = tokens[start:end]
            content = doc[:-1] if doc[-1] == eos_id else doc
            key = hashlib.blake2b(salt.encode() + np.ascontiguousarray(content, dtype=np.int64).tobytes(), digest_size=8)
            side = "heldout" if int.from_bytes(key.digest(), "little") < threshold else "train"
            parts[side].append(doc)
    out_dir = Path(out_dir)
    paths = []
    for side in ("train", "heldout"):
        tokens = np.concatenate(parts[side]) if parts[side] else np.zeros(0, dtype=dtype)
        paths.append(write_token_file(out_dir / f"{side}.npy", tokens, vocab_size, dtype))
    train, heldout = (TokenFile(p, vocab_size, dtype) for p in paths)
    overlap = heldout_overlap([train], [heldout], eos_id)
    if overlap:
        raise RuntimeError(f"split of {[str(f.path) for f in files]} put {overlap} documents on both sides")
    return paths[0], paths[1]
