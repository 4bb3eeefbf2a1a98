"""OLMo-core token files: headerless flat arrays of token ids.

OLMo-core names them `.npy` but writes no numpy header: the file is the raw little-endian
array, so its length is `file_size // itemsize`. The dtype follows the vocabulary size
(uint16 below 65536 ids, uint32 above) unless the caller overrides it.
"""

import os
from pathlib import Path

import numpy as np
from jaxtyping import Integer

UINT16_VOCAB_LIMIT = 65536
# What `TokenFile` reads of a local file's first page to check its dtype (one pread).
DTYPE_SAMPLE_BYTES = 8192


class DataFileError(ValueError):
    """A token file, manifest or data position that cannot be used as given."""


def out_of_vocab_error(path: Path | str, token_id: int, position: int, vocab_size: int) -> DataFileError:
    """The one message for a token id >= vocab_size: the file and the offset in it."""
    return DataFileError(
        f"token file {path} holds token id {token_id} at position {position}, but vocab_size is "
        f"{vocab_size}: it was tokenized with another tokenizer or read with the wrong dtype; "
        "re-tokenize it or fix model.vocab_size / the dtype"
    )


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The dtype OLMo-core uses for a vocabulary of `vocab_size` ids."""
    if vocab_size <= 0:
        raise DataFileError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < UINT16_VOCAB_LIMIT else np.dtype(np.uint32)


class TokenFile:
    """One headerless token file, memory-mapped on first access and never read whole.

    A URL (`olmo_eqx.data.remote`) is read by byte ranges through `reader` instead, its size
    given by the caller (fetched for all files at once, or from the run's size cache).
    Construction checks only what is cheap (the file exists, its size fits the dtype);
    `check_token_ids` scans the ids when asked.
    """

    def __init__(
        self, path: str | os.PathLike, vocab_size: int, dtype: np.dtype | str | None = None, *,
        reader=None, size: int | None = None,
    ):
        self.remote = reader is not None
        self.path = path if self.remote else Path(path)
        self.reader = reader
        self.vocab_size = int(vocab_size)
        self.dtype = np.dtype(dtype) if dtype is not None else token_dtype_for_vocab(vocab_size)
        if self.remote:
            if size is None:
                raise ValueError(f"a remote token file needs its size: {path}")
        elif self.path.is_dir():
            raise DataFileError(f"token file {self.path} is a directory: name a token file (.npy) in it")
        elif not self.path.is_file():
            raise DataFileError(
                f"token file {self.path} does not exist: check the data root / tokenizer name "
                "in the mix, or create it with `python -m olmo_eqx.data.tokenize`"
            )
        else:
            stat = self.path.stat()
            size, self._mtime_ns = stat.st_size, stat.st_mtime_ns
        self.size = int(size)
        if size % self.dtype.itemsize != 0:
            raise DataFileError(
                f"token file {self.path} has {size} bytes, not a multiple of {self.dtype.itemsize} "
                f"({self.dtype.name}): it is truncated or was written with another dtype; "
                "re-create it, or pass the dtype it was written with"
            )
        self.num_tokens = size // self.dtype.itemsize
        self._array: np.memmap | None = None
        self._fd: int | None = None
        if not self.remote and self.num_tokens:
            self._check_dtype(self.read_bytes(0, min(size, DTYPE_SAMPLE_BYTES)))

    def _check_dtype(self, page: bytes) -> None:
        """Refuse a file that its first page shows was written with the other dtype: OLMo-core's
        files carry no header, so nothing else says, and a wrong one trains on garbage silently."""
        width = 16 if self.dtype.itemsize == 2 else 32
        other = "uint32" if width == 16 else "uint16"
        hint = (f"it looks written as {other} and read as {self.dtype.name}: set data.token_dtype={other} "
                "(or re-tokenize it for this model's vocab)")
        if width == 16:
            # uint32 ids below 2**16 read as uint16 are the id, then a high half of 0 (or 1 for
            # vocabularies up to 2**17): every other value that small, the others not.
            pairs = np.frombuffer(page[: len(page) // 4 * 4], dtype="<u2").reshape(-1, 2)
            high = (self.vocab_size - 1) >> 16
            if len(pairs) >= 32 and (pairs[:, 1] <= high).all() and (pairs[:, 0] > high).any():
                raise DataFileError(f"token file {self.path}: every other id is {high} or less; {hint}")
        elif self.dtype.itemsize == 4:
            # Two uint16 ids read as one uint32 are lo + 65536 * hi: mostly past any vocabulary.
            ids = np.frombuffer(page[: len(page) // 4 * 4], dtype="<u4")
            if len(ids) >= 32 and (ids >= self.vocab_size).mean() > 0.5:
                raise DataFileError(f"token file {self.path}: most ids of its first page are >= vocab_size "
                                    f"{self.vocab_size}; {hint}")

    def read_bytes(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the file (one range request when remote)."""
        if self.remote:
            return self.reader.read(self.path, offset, length, self.size)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def read(self, start: int, count: int) -> Integer[np.ndarray, " count"]:
        """Tokens [start, start + count) in the file's dtype.

        A local file is read with pread through a descriptor kept open (until `close`), never
        through the memory map: a mapped file that shrinks under a running job kills it with
        SIGBUS (exit 135, no message, a stale run lock); a short read or a changed size or
        modification time is a `DataFileError` instead.
        """
        itemsize = self.dtype.itemsize
        if self.remote:
            data = self.read_bytes(start * itemsize, count * itemsize)
        else:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            stat = os.fstat(self._fd)
            data = os.pread(self._fd, count * itemsize, start * itemsize)
            if (stat.st_size, stat.st_mtime_ns) != (self.size, self._mtime_ns) or len(data) < min(
                count * itemsize, self.size - start * itemsize
            ):
                raise DataFileError(
                    f"token file {self.path} changed while the run read it (now {stat.st_size} bytes, "
                    f"{self.size} when the run started): restore the file as it was and resume "
                    "(the run resumes from its last checkpoint), or start a new run on the new data"
                )
        return np.frombuffer(data, dtype=self.dtype.newbyteorder("<"))

    @property
    def tokens(self) -> np.ndarray:
        """The whole file as a read-only memory map (pages are read only when touched)."""
        if self.remote:
            raise TypeError(f"{self.path} is remote: read it by ranges (TokenFile.read), never whole")
        if self._array is None:
            if self.num_tokens == 0:
                # np.memmap refuses empty files; an empty file is legal and holds no instances.
                self._array = np.zeros((0,), dtype=self.dtype)
            else:
                self._array = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._array

    def close(self) -> None:
        """Drop the memory map and the read descriptor; the next access re-opens them."""
        self._array = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __getstate__(self) -> dict:
        # Memory maps do not pickle; worker processes re-open the file lazily.
        state = self.__dict__.copy()
        state["_array"] = None
        state["_fd"] = None
        return state

    def check_token_ids(self, chunk_tokens: int = 1 << 24) -> None:
        """Raise `DataFileError` if any id is >= vocab_size (scans the file in chunks)."""
        for start in range(0, self.num_tokens, chunk_tokens):
            chunk = self.read(start, min(chunk_tokens, self.num_tokens - start))
            if chunk.size and int(chunk.max()) >= self.vocab_size:
                offset = start + int(np.argmax(chunk >= self.vocab_size))
                raise out_of_vocab_error(self.path, int(chunk[offset - start]), offset, self.vocab_size)

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, tokens={self.num_tokens}, dtype={self.dtype.name})"


def write_token_file(
    path: str | os.PathLike, tokens: Integer[np.ndarray, " n"], vocab_size: int, dtype: np.dtype | str | None = None
) -> Path:
    """Write `tokens` as an OLMo-core headerless token file, atomically (temp file + rename)."""
    path = Path(path)
    dtype = np.dtype(dtype) if dtype is not None else token_dtype_for_vocab(vocab_size)
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise DataFileError(f"refusing to write {path}: token ids outside [0, {vocab_size})")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tokens.astype(dtype.newbyteorder("<"), copy=False).tofile(tmp)
    os.replace(tmp, path)
    return path
