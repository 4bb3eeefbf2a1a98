"""Shared helpers for the data tests (no tests here): small synthetic token files."""

from pathlib import Path

import numpy as np

from olmo_eqx.data.token_files import write_token_file

VOCAB = 60000  # below 65536: uint16 files, like a small tokenizer


def make_token_files(directory: Path, sizes: list[int], vocab_size: int = VOCAB, prefix: str = "part") -> list[Path]:
    """Files whose tokens count up across files (mod vocab), so every instance's content is known."""
    paths, start = [], 0
    for i, size in enumerate(sizes):
        tokens = (np.arange(start, start + size) % vocab_size).astype(np.int64)
        paths.append(write_token_file(Path(directory) / f"{prefix}-{i:03d}.npy", tokens, vocab_size))
        start += size
    return paths
