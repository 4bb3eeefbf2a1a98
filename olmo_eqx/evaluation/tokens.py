"""The model's tokenizer (a HF `tokenizer.json`): encoding requests and counting bytes.

Bits per byte needs the number of UTF-8 bytes each predicted token stands for. For byte-level
BPE tokenizers (GPT-2 style, as OLMo's dolma2 and the embedded corpus's) that is exact per
token: every character of a vocabulary entry is one byte under the byte-to-unicode map.
Special tokens decode to nothing (they are skipped when text is decoded) and count 0 bytes.
Other tokenizers fall back to decoding each id alone.
"""

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np
from jaxtyping import Int
from tokenizers import Tokenizer

from olmo_eqx.data.tokenize import EOS_CANDIDATES


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _uses_byte_level(node) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in node.get("decoders", []) or [])


class TextTokenizer:
    """A `tokenizers.Tokenizer` read from a tokenizer.json, plus what evaluation needs of it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} does not exist")
        self._tokenizer = Tokenizer.from_file(str(self.path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: Optional[int] = next(
            (i for i in (self._tokenizer.token_to_id(t) for t in EOS_CANDIDATES) if i is not None), None
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (OLMo adds no BOS)."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    @cached_property
    def byte_lengths(self) -> Int[np.ndarray, " vocab"]:
        """UTF-8 bytes each token id decodes to (0 for special tokens)."""
        spec = json.loads(self.path.read_text())
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        if _uses_byte_level(spec.get("decoder")):
            alphabet = set(_bytes_to_unicode().values())
            for token, i in self._tokenizer.get_vocab(with_added_tokens=True).items():
                if i in special:
                    continue
                lengths[i] = len(token) if all(c in alphabet for c in token) else len(token.encode("utf-8"))
        else:
            for i in range(self.vocab_size):
                if i not in special:
                    lengths[i] = len(self._tokenizer.decode([i], skip_special_tokens=True).encode("utf-8"))
        return lengths

    @cached_property
    def sha256(self) -> str:
        import hashlib

        return hashlib.sha256(self.path.read_bytes()).hexdigest()
