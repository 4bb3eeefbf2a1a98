"""The embedded default corpus: the Python standard library's own source, tokenized offline.

Every machine with Python has it, so `python -m olmo_eqx +stage=pretrain` trains on real
text with no download. The build (a few seconds) runs once and is cached:

- documents: every stdlib `.py` file (site-packages excluded), exact duplicates and empty
  files dropped, in a fixed order given by a hash of the module name;
- split by module: a module whose name hashes under HELDOUT_FRACTION is held out;
  train text is capped at TRAIN_TEXT_CHARS and held-out text at HELDOUT_TEXT_CHARS;
- tokenizer: a byte-level BPE trained with HF `tokenizers` on the training text only,
  exactly VOCAB_SIZE ids including `<|endoftext|>` (EOS, id 0) and `<|pad|>` (id 1);
- files: `train.npy`, `heldout.npy` (OLMo-core headerless uint16, EOS after every
  document), `tokenizer.json`, `manifest.json`.

The cache lives in `$OLMO_EQX_CACHE/embedded-v1` (default `~/.cache/olmo_eqx/embedded-v1`).
It is built in a temporary sibling directory and renamed into place, under a file lock,
so a killed build leaves no half cache and concurrent builders (pytest workers, several
processes of one run) agree on one result.
"""

import fcntl
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo_eqx.data.heldout import HeldOutSet, heldout_overlap
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.mixes import Source
from olmo_eqx.data.token_files import DataFileError, TokenFile, write_token_file

CACHE_NAME = "embedded-v1"
VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
HELDOUT_FRACTION = 0.05
TRAIN_TEXT_CHARS = 12_000_000
HELDOUT_TEXT_CHARS = 1_500_000
_SPLIT_SALT = b"olmo_eqx-embedded-v1"


@dataclass(frozen=True)
class EmbeddedCorpus:
    """Paths and facts of the built embedded corpus."""

    root: Path
    train_files: tuple[Path, ...]
    heldout_files: tuple[Path, ...]
    tokenizer_path: Path
    vocab_size: int
    eos_id: int
    pad_id: int
    manifest: dict

    def train_source(self) -> Source:
        return Source("python-stdlib", self.train_files)

    def heldout_source(self) -> Source:
        return Source("python-stdlib-heldout", self.heldout_files)

    def train_dataset(self, sequence_length: int, **kwargs) -> InstanceDataset:
        """Training instances of `sequence_length` tokens (kwargs go to `InstanceDataset`)."""
        return InstanceDataset([self.train_source()], sequence_length, self.vocab_size, **kwargs)

    def heldout_set(self, sequence_length: int) -> HeldOutSet:
        """The held-out modules as one evaluation set named `python-stdlib-heldout`."""
        source = self.heldout_source()
        return HeldOutSet(source.label, InstanceDataset([source], sequence_length, self.vocab_size))


def embedded_cache_dir() -> Path:
    """Where the embedded corpus is cached: `$OLMO_EQX_CACHE/embedded-v1` or `~/.cache/olmo_eqx/embedded-v1`."""
    base = os.environ.get("OLMO_EQX_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "olmo_eqx") / CACHE_NAME


def _stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted module name, path) of every stdlib source file outside site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        modules.append((".".join(rel.with_suffix("").parts), path))
    if not modules:
        raise DataFileError(f"found no Python source files under the stdlib path {root}")
    return modules


def _hash_fraction(name: str) -> float:
    digest = hashlib.blake2b(_SPLIT_SALT + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _collect_documents() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(module, text) documents for train and held-out, deduplicated, capped, in hash order."""
    modules = sorted(_stdlib_modules(), key=lambda m: _hash_fraction("order:" + m[0]))
    seen: set[str] = set()
    train, heldout = [], []
    budget = {"train": TRAIN_TEXT_CHARS, "heldout": HELDOUT_TEXT_CHARS}
    for name, path in modules:
        text = path.read_text(encoding="utf-8", errors="replace")
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        side = "heldout" if _hash_fraction(name) < HELDOUT_FRACTION else "train"
        if len(text) > budget[side]:
            continue
        budget[side] -= len(text)
        (heldout if side == "heldout" else train).append((name, text))
    return train, heldout


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} ids, expected {VOCAB_SIZE}")
    return tokenizer


def _tokenize(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    tokenizer.encode_special_tokens = True  # text spelling "<|endoftext|>" is not a document end
    pieces = []
    for encoding in tokenizer.encode_batch(texts):
        pieces.append(np.asarray(encoding.ids, dtype=np.int64))
        pieces.append(np.array([eos_id], dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def build_embedded_corpus(out_dir: str | os.PathLike) -> dict:
    """Build the corpus into `out_dir` (which must not exist yet) and return its manifest."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    train_docs, heldout_docs = _collect_documents()
    tokenizer = _train_tokenizer([text for _, text in train_docs])
    eos_id, pad_id = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    counts = {}
    for side, docs in (("train", train_docs), ("heldout", heldout_docs)):
        tokens = _tokenize(tokenizer, [text for _, text in docs], eos_id)
        write_token_file(out_dir / f"{side}.npy", tokens, VOCAB_SIZE)
        counts[side] = {
            "documents": len(docs),
            "characters": sum(len(t) for _, t in docs),
            "tokens": int(tokens.size),
            "sha256": hashlib.sha256(tokens.astype(np.uint16).tobytes()).hexdigest(),
        }
    manifest = {
        "name": CACHE_NAME,
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "vocab_size": VOCAB_SIZE,
        "eos_id": eos_id,
        "pad_id": pad_id,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "dtype": "uint16",
        "train": counts["train"],
        "heldout": counts["heldout"],
        "heldout_modules": [name for name, _ in heldout_docs],
        "train_modules": [name for name, _ in train_docs],
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    # Written last: a directory holding manifest.json is complete.
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def _load(root: Path) -> EmbeddedCorpus:
    manifest = json.loads((root / "manifest.json").read_text())
    corpus = EmbeddedCorpus(
        root=root,
        train_files=(root / "train.npy",),
        heldout_files=(root / "heldout.npy",),
        tokenizer_path=root / "tokenizer.json",
        vocab_size=int(manifest["vocab_size"]),
        eos_id=int(manifest["eos_id"]),
        pad_id=int(manifest["pad_id"]),
        manifest=manifest,
    )
    # Cheap (a few MB) and the embedded data is the default: always verify the ids.
    for path in corpus.train_files + corpus.heldout_files:
        TokenFile(path, corpus.vocab_size).check_token_ids()
    return corpus


def embedded_corpus(cache_dir: str | os.PathLike | None = None) -> EmbeddedCorpus:
    """The embedded corpus, built on first use (see the module docstring) and loaded from cache after."""
    root = Path(cache_dir) if cache_dir is not None else embedded_cache_dir()
    if (root / "manifest.json").is_file():
        return _load(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building: wait for it
        if not (root / "manifest.json").is_file():
            # Builders hold the lock, so any staging directory here was left by a killed build.
            for stale in root.parent.glob(f".{root.name}.build-*"):
                shutil.rmtree(stale, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.build-", dir=root.parent))
            # Building takes 10-20 s once per machine: say so rather than look stuck.
            print(f"building the embedded corpus (once) into {root} ...", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                manifest = build_embedded_corpus(staging / "corpus")
                try:
                    os.rename(staging / "corpus", root)
                except OSError:
                    # Someone without the lock (e.g. on a filesystem ignoring flock) won the race.
                    if not (root / "manifest.json").is_file():
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            print(f"embedded corpus built in {time.perf_counter() - started:.1f} s: "
                  f"{manifest['train']['tokens']:,} train tokens, {manifest['heldout']['tokens']:,} held-out tokens",
                  file=sys.stderr, flush=True)
    return _load(root)


def check_embedded_split(corpus: EmbeddedCorpus) -> int:
    """Held-out documents that also occur in the training file (0 for a sound build)."""
    files = lambda paths: [TokenFile(p, corpus.vocab_size) for p in paths]  # noqa: E731
    return heldout_overlap(files(corpus.train_files), files(corpus.heldout_files), corpus.eos_id)
