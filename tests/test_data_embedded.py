"""The embedded stdlib corpus: real BPE of exactly 4096 ids, a module split without overlap, a safe cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from olmo_eqx.data import embedded
from olmo_eqx.data.embedded import EmbeddedCorpus, check_embedded_split, embedded_corpus
from olmo_eqx.data.loader import DataLoader
from olmo_eqx.data.token_files import TokenFile


@pytest.fixture(scope="session")
def corpus() -> EmbeddedCorpus:
    return embedded_corpus()  # the real cache: built once per machine, then loaded


def test_vocab_is_exactly_4096_with_eos_and_pad(corpus):
    tokenizer = Tokenizer.from_file(str(corpus.tokenizer_path))
    assert corpus.vocab_size == tokenizer.get_vocab_size() == 4096
    assert corpus.eos_id == tokenizer.token_to_id("<|endoftext|>")
    assert corpus.pad_id == tokenizer.token_to_id("<|pad|>") != corpus.eos_id
    text = "def answer(x):\n    return x * 42  # ünïcode\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_token_files_match_the_manifest(corpus):
    for side, files in (("train", corpus.train_files), ("heldout", corpus.heldout_files)):
        (path,) = files
        f = TokenFile(path, corpus.vocab_size)
        assert f.dtype == np.uint16
        tokens = np.asarray(f.tokens)
        facts = corpus.manifest[side]
        assert f.num_tokens == facts["tokens"]
        assert int((tokens == corpus.eos_id).sum()) == facts["documents"]  # EOS closes every document
        assert tokens[-1] == corpus.eos_id and int(tokens.max()) < corpus.vocab_size
    assert corpus.manifest["train"]["tokens"] > 1_000_000
    assert corpus.manifest["heldout"]["tokens"] > 100_000


def test_split_is_by_module_deterministic_and_disjoint(corpus):
    train, heldout = set(corpus.manifest["train_modules"]), set(corpus.manifest["heldout_modules"])
    assert train and heldout and not train & heldout
    assert check_embedded_split(corpus) == 0  # no held-out document's tokens occur in train
    again_train, again_heldout = embedded._collect_documents()
    assert [m for m, _ in again_heldout] == corpus.manifest["heldout_modules"]
    assert [m for m, _ in again_train] == corpus.manifest["train_modules"]


def test_embedded_data_feeds_the_loader(corpus):
    dataset = corpus.train_dataset(256)
    batch = DataLoader(dataset, 8, seed=0).next_batch()
    assert batch.input_ids.shape == (8, 256) and batch.input_ids.max() < 4096
    heldout = corpus.heldout_set(256)
    first = next(heldout.batches(8))
    assert first.instance_ids.tolist() == list(range(8))


# Subprocess builds with the text capped small, into a private cache directory.
_BUILD = """
import os, signal, sys
from olmo_eqx.data import embedded
embedded.TRAIN_TEXT_CHARS, embedded.HELDOUT_TEXT_CHARS = 300_000, 40_000
if sys.argv[2] == "die":
    def die(texts):
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build: no cleanup code runs
    embedded._train_tokenizer = die
print(embedded.embedded_corpus(sys.argv[1]).manifest["train"]["sha256"])
"""


def _build(cache: Path, mode: str = "ok") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _BUILD, str(cache), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_killed_build_leaves_no_cache_and_concurrent_builds_agree(tmp_path):
    cache = tmp_path / "embedded-v1"
    killed = _build(cache, "die")
    killed.communicate(timeout=120)
    assert killed.returncode == -9
    assert not cache.exists()  # nothing half-built where readers look
    assert list(tmp_path.glob(".embedded-v1.build-*"))  # the dead build's staging directory

    builders = [_build(cache), _build(cache)]
    outputs = [b.communicate(timeout=120) for b in builders]
    assert all(b.returncode == 0 for b in builders), [err for _, err in outputs]
    assert outputs[0][0] == outputs[1][0]  # both see the same corpus
    assert not list(tmp_path.glob(".embedded-v1.build-*"))  # stale staging cleaned up
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["vocab_size"] == 4096 and sorted(os.listdir(cache)) == [
        "heldout.npy",
        "manifest.json",
        "tokenizer.json",
        "train.npy",
    ]
