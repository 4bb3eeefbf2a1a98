"""Token files, mixes and instances: formats, chunking, resampling and the clear errors."""

import shutil

import numpy as np
import pytest

from olmo_eqx.data.instances import InstanceDataset, repeated_ngram_keep
from olmo_eqx.data.loader import read_batch
from olmo_eqx.data.mixes import read_mix, source_from_paths
from olmo_eqx.data.token_files import DataFileError, TokenFile, token_dtype_for_vocab, write_token_file
from test_data_support import VOCAB, make_token_files


def test_dtype_follows_vocab_size():
    assert token_dtype_for_vocab(4096) == np.uint16
    assert token_dtype_for_vocab(65535) == np.uint16
    assert token_dtype_for_vocab(65536) == np.uint32
    assert token_dtype_for_vocab(100278) == np.uint32


def test_headerless_file_roundtrip_uint32(tmp_path):
    tokens = np.array([0, 100257, 5, 100277], dtype=np.int64)
    path = write_token_file(tmp_path / "part.npy", tokens, vocab_size=100278)
    assert path.stat().st_size == 4 * 4  # no numpy header, 4 bytes per id
    f = TokenFile(path, vocab_size=100278)
    assert f.dtype == np.uint32 and f.num_tokens == 4
    np.testing.assert_array_equal(f.tokens, tokens)
    # OLMo-core files are raw arrays: a plain np.fromfile reads them too.
    np.testing.assert_array_equal(np.fromfile(path, dtype=np.uint32), tokens)


def test_dtype_override(tmp_path):
    path = tmp_path / "wide.npy"
    np.arange(10, dtype=np.uint32).tofile(path)
    f = TokenFile(path, vocab_size=100, dtype="uint32")
    np.testing.assert_array_equal(f.tokens, np.arange(10))


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataFileError, match=r"nope\.npy does not exist"):
        TokenFile(tmp_path / "nope.npy", vocab_size=VOCAB)


def test_truncated_file_names_it_and_the_fix(tmp_path):
    path = tmp_path / "cut.npy"
    path.write_bytes(b"\x01\x00\x02")  # 1.5 uint16 tokens
    with pytest.raises(DataFileError, match=r"cut\.npy has 3 bytes, not a multiple of 2.*truncated"):
        TokenFile(path, vocab_size=VOCAB)


def test_out_of_vocab_ids_found_when_asked(tmp_path):
    path = tmp_path / "big.npy"
    np.array([1, 2, 5000, 3], dtype=np.uint16).tofile(path)
    f = TokenFile(path, vocab_size=4096)  # construction stays cheap: no scan
    with pytest.raises(DataFileError, match=r"big\.npy holds token id 5000 at position 2.*vocab_size is 4096"):
        f.check_token_ids(chunk_tokens=2)
    with pytest.raises(DataFileError, match="token id 5000"):
        InstanceDataset([source_from_paths("x", path)], 2, 4096, check_token_ids=True)


def test_instances_are_contiguous_chunks_remainder_dropped(tmp_path):
    paths = make_token_files(tmp_path, [100, 35, 64])
    ds = InstanceDataset([source_from_paths("all", tmp_path / "*.npy")], 16, VOCAB)
    assert ds.natural_sizes == (6 + 2 + 4,)
    tokens, mask = ds.read(np.arange(len(ds)))
    assert tokens.dtype == np.int32 and mask.all()
    # file 1 starts at global token 100; its 3 leftover tokens are never served
    starts = [0, 16, 32, 48, 64, 80, 100, 116, 135, 151, 167, 183]
    np.testing.assert_array_equal(tokens[:, 0], starts)
    np.testing.assert_array_equal(tokens, np.array(starts)[:, None] + np.arange(16))
    assert [str(p) for p in ds.sources[0].paths] == [str(p) for p in paths]


def test_source_without_a_full_instance_is_refused(tmp_path):
    make_token_files(tmp_path, [10])
    with pytest.raises(DataFileError, match="no complete instance of 16 tokens"):
        InstanceDataset([source_from_paths("tiny", tmp_path / "*.npy")], 16, VOCAB)


def test_glob_matching_nothing_is_refused(tmp_path):
    with pytest.raises(DataFileError, match="matches no files"):
        source_from_paths("x", tmp_path / "*.npy")


def test_olmo_core_manifest_resolves_tokenizer_and_root(tmp_path):
    tok = "allenai/dolma2-tokenizer"
    (tmp_path / "web" / tok).mkdir(parents=True)
    (tmp_path / "code" / tok).mkdir(parents=True)
    make_token_files(tmp_path / "web" / tok, [64, 64], vocab_size=100278)
    make_token_files(tmp_path / "code" / tok, [64], vocab_size=100278)
    manifest = tmp_path / "mix.txt"
    manifest.write_text(
        "# a comment\n"
        "web,web/{TOKENIZER}/part-000.npy\n"
        "code,code/{TOKENIZER}/part-000.npy\n"
        "\n"
        "web,web/{TOKENIZER}/part-001.npy\n"
    )
    sources = read_mix(manifest, tmp_path, tok)
    assert [s.label for s in sources] == ["web", "code"]
    assert [len(s.paths) for s in sources] == [2, 1]
    ds = InstanceDataset(sources, 32, 100278)
    assert ds.sizes == (4, 2) and ds.source_labels == ("web", "code")
    np.testing.assert_array_equal(ds.source_index(np.arange(6)), [0, 0, 0, 0, 1, 1])
    # the same files under another mount point are the same dataset (a resume is allowed)
    shutil.copytree(tmp_path / "web", tmp_path / "mnt" / "web")
    shutil.copytree(tmp_path / "code", tmp_path / "mnt" / "code")
    moved = InstanceDataset(read_mix(manifest, tmp_path / "mnt", tok), 32, 100278)
    assert moved.fingerprint() == ds.fingerprint()
    assert InstanceDataset(sources[:1], 32, 100278).fingerprint() != ds.fingerprint()
    with pytest.raises(DataFileError, match=r"bad\.txt:2: expected"):
        bad = tmp_path / "bad.txt"
        bad.write_text("# x\njust-a-path.npy\n")
        read_mix(bad, tmp_path, tok)
    with pytest.raises(DataFileError, match="ratio for every label"):
        read_mix(manifest, tmp_path, tok, ratios={"web": 1.0})


def test_ratios_repeat_and_subsample_to_target_share(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    make_token_files(tmp_path / "a", [80 * 8], prefix="a")  # 80 instances of 8
    make_token_files(tmp_path / "b", [20 * 8], prefix="b")  # 20 instances
    sources = [
        source_from_paths("big", tmp_path / "a" / "*.npy", ratio=0.5),
        source_from_paths("small", tmp_path / "b" / "*.npy", ratio=0.5),
    ]
    ds = InstanceDataset(sources, 8, VOCAB, total_instances=100)
    assert ds.sizes == (50, 50)
    big, _ = ds.read(np.arange(50))
    small, _ = ds.read(np.arange(50, 100))
    # big is subsampled: 50 distinct instances out of its 80
    assert len({row[0] for row in big.tolist()}) == 50
    # small is repeated: each of its 20 instances 2 or 3 times
    _, counts = np.unique(small[:, 0], return_counts=True)
    assert len(counts) == 20 and set(counts.tolist()) <= {2, 3}


def test_repeated_ngram_filter():
    rng = np.random.default_rng(0)
    clean = rng.integers(0, 1000, size=(1, 512))
    ones = clean.copy()
    ones[0, 100:132] = 7  # a 1-gram 32 times in a row
    almost = clean.copy()
    almost[0, 100:131] = 7  # 31 times: kept
    trigram = clean.copy()
    trigram[0, 10 : 10 + 3 * 32] = np.tile([4, 5, 6], 32)  # a 3-gram 32 times
    thirteen = clean.copy()
    thirteen[0, 50 : 50 + 13 * 32] = np.tile(np.arange(13) + 900, 32)
    batch = np.concatenate([clean, ones, almost, trigram, thirteen])
    np.testing.assert_array_equal(repeated_ngram_keep(batch), [True, False, True, False, False])


def test_filter_zeroes_the_loss_mask_of_the_instance(tmp_path):
    tokens = np.concatenate([np.arange(64), np.full(64, 3)])
    path = write_token_file(tmp_path / "rep.npy", tokens, VOCAB)
    ds = InstanceDataset([source_from_paths("x", path)], 64, VOCAB, filter_repeated_ngrams=True)
    _, mask = ds.read(np.array([0, 1]))
    assert mask[0].all() and not mask[1].any()
    batch = read_batch(ds, np.array([1, 0]), step=0, epoch=0)  # what the loader hands the trainer
    np.testing.assert_array_equal(batch.loss_mask[:, 5], [0.0, 1.0])


def _brute_force_keep(row, max_period, max_count):
    for period in range(1, max_period + 1):
        for start in range(len(row) - period + 1):
            gram, copies, at = row[start : start + period], 1, start + period
            while at + period <= len(row) and np.array_equal(row[at : at + period], gram):
                copies, at = copies + 1, at + period
            if copies >= max_count:
                return False
    return True


def test_repeated_ngram_filter_matches_brute_force():
    rng = np.random.default_rng(3)
    # a tiny alphabet and a low threshold make repeats of every period common
    batch = rng.integers(0, 3, size=(200, 40))
    batch[::7, 5:20] = np.tile([1, 2, 0], 5)
    want = [_brute_force_keep(row, max_period=4, max_count=4) for row in batch]
    assert 20 < sum(want) < 180  # both outcomes occur
    np.testing.assert_array_equal(repeated_ngram_keep(batch, max_period=4, max_count=4), want)


def test_only_a_bounded_number_of_files_stay_open(tmp_path, monkeypatch):
    import os

    from olmo_eqx.data import instances

    monkeypatch.setattr(instances, "MAX_OPEN_FILES", 4)
    make_token_files(tmp_path, [2 * 8] * 20)
    ds = InstanceDataset([source_from_paths("many", tmp_path / "*.npy")], 8, VOCAB)
    before = len(os.listdir("/proc/self/fd"))
    tokens, _ = ds.read(np.arange(len(ds)))
    np.testing.assert_array_equal(tokens[:, 0], np.arange(0, 40 * 8, 8))
    assert sum(f._fd is not None for f in ds.files) == 4
    assert len(os.listdir("/proc/self/fd")) - before <= 4
