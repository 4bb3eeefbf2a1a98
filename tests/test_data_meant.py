"""Data is what was meant (issue 50, rows 1-8): every input that used to train, or crash,
silently on the wrong data is refused in one line naming the input and the fix."""

import shutil

import numpy as np
import pytest

from olmo_eqx.data.config import DataConfig
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.mixes import read_mix, real_file, source_from_paths
from olmo_eqx.data.sources import build_datasets, check_against_model
from olmo_eqx.data.token_files import DataFileError, TokenFile, write_token_file
from olmo_eqx.interop.generate import check_prompt_lengths

from clihelp import TINY, olmo_eqx
from test_data_support import VOCAB, make_token_files


# Row 6: an EOS id outside the vocabulary is never found: document masking would mask nothing.
@pytest.mark.parametrize("eos", [99999, -1, 4096])
def test_eos_outside_the_vocab_with_document_masking_is_refused(eos):
    data = DataConfig(document_masking=True, eos_token_id=eos)
    with pytest.raises(DataFileError, match=rf"data.eos_token_id={eos} is outside .*\[0, 4096\).*set data.eos_token_id"):
        check_against_model(data, 4096, 1024)


def test_eos_is_only_checked_when_documents_are_masked_and_the_default_is_checked_too():
    check_against_model(DataConfig(eos_token_id=99999), 4096, 1024)  # unused without document masking
    check_against_model(DataConfig(document_masking=True, eos_token_id=4095), 4096, 1024)
    check_against_model(DataConfig(document_masking=True), 4096, 1024)  # the embedded corpus' own EOS
    # Token files with the default EOS (dolma2's 100257) and a small vocab: no boundary either.
    with pytest.raises(DataFileError, match="the default EOS id"):
        check_against_model(DataConfig(source="x/*.npy", document_masking=True), 60000, 1024)


# Row 8: a sequence longer than the model's context.
def test_sequence_longer_than_the_model_is_refused():
    check_against_model(DataConfig(sequence_length=1024), 4096, 1024)
    with pytest.raises(DataFileError, match=r"data.sequence_length=1025 is above the model's max_sequence_length=1024"):
        check_against_model(DataConfig(sequence_length=1025), 4096, 1024)


def test_a_prompt_plus_new_tokens_longer_than_the_model_names_the_prompts_length():
    check_prompt_lengths([10, 1000], 24, 1024)
    with pytest.raises(ValueError, match=r"prompt 2 is 1001 tokens: with max_new_tokens=24 .*1025 tokens.*max_new_tokens<=23"):
        check_prompt_lengths([10, 1001], 24, 1024)


def test_cli_refuses_a_long_sequence_in_one_line_and_leaves_no_run_dir(tmp_path):
    run_dir = tmp_path / "outputs" / "run"
    result = olmo_eqx(*TINY, "data.sequence_length=2048", f"hydra.run.dir={run_dir}")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.startswith("error: ") and output.count("\n") == 1, output
    assert "data.sequence_length=2048" in output and "max_sequence_length=1024" in output
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.json").exists()


# Rows 1-2: files are counted by what they are, not by the path text that reached them.
def test_a_glob_through_a_symlink_loop_is_refused_naming_both_paths(tmp_path):
    (tmp_path / "d").mkdir()
    make_token_files(tmp_path / "d", [64])
    (tmp_path / "d" / "loop").symlink_to("..")
    with pytest.raises(DataFileError, match=r"d/part-000.npy and .*d/loop/d/part-000.npy are the same file"):
        source_from_paths("train", f"{tmp_path}/d/**/*.npy")
    assert len(source_from_paths("train", f"{tmp_path}/d/*.npy").paths) == 1


def test_a_file_and_a_link_to_it_are_refused_in_a_glob_and_in_a_manifest(tmp_path):
    tok = "tok"
    (tmp_path / "web" / tok).mkdir(parents=True)
    make_token_files(tmp_path / "web" / tok, [64])
    (tmp_path / "web" / tok / "alias.npy").symlink_to("part-000.npy")
    with pytest.raises(DataFileError, match="are the same file"):
        source_from_paths("train", f"{tmp_path}/web/{tok}/*.npy")
    manifest = tmp_path / "mix.txt"
    manifest.write_text("web,web/{TOKENIZER}/part-000.npy\ncode,web/{TOKENIZER}/alias.npy\n")
    with pytest.raises(DataFileError, match=r"mix.txt:2: web/tok/alias.npy is already listed on line 1 \(the same file"):
        read_mix(manifest, tmp_path, tok)
    # A data root reached through a link is still one file per line.
    (tmp_path / "root").symlink_to(tmp_path)
    manifest.write_text("web,web/{TOKENIZER}/part-000.npy\n")
    assert len(read_mix(manifest, tmp_path / "root", tok)[0].paths) == 1


# Row 3: a manifest reads under its data root, unless told otherwise by name.
@pytest.mark.parametrize("line", ["../outside.npy", "web/../../outside.npy", "ABSOLUTE"])
def test_a_manifest_line_outside_the_data_root_is_refused_unless_allowed(tmp_path, line):
    root = tmp_path / "root"
    (root / "web").mkdir(parents=True)
    outside = make_token_files(tmp_path, [64], prefix="outside")[0]
    line = str(outside) if line == "ABSOLUTE" else line.replace("outside.npy", outside.name)
    manifest = tmp_path / "mix.txt"
    manifest.write_text(f"web,{line}\n")
    with pytest.raises(DataFileError, match=r"mix.txt:1: .* lies outside the data root .*data.allow_outside_root=true"):
        read_mix(manifest, root, "tok")
    (source,) = read_mix(manifest, root, "tok", allow_outside_root=True)
    assert real_file(source.paths[0]) == real_file(outside)
    # Going down and back up inside the root is fine, and so is a URL root's leading "/".
    manifest.write_text("web,web/../web/x.npy\n")
    read_mix(manifest, root, "tok")
    manifest.write_text("web,/web/x.npy\n")
    assert read_mix(manifest, "https://example.org/data", "tok")[0].paths == ("https://example.org/data/web/x.npy",)


# Row 5: a held-out set that is a training file measures training loss.
def test_a_heldout_file_that_is_a_training_file_is_refused(tmp_path):
    train = make_token_files(tmp_path, [256, 256])
    other = make_token_files(tmp_path, [256], prefix="other")[0]  # counts from 0 again: same content as part-000
    held = make_token_files(tmp_path / "held", [512])[0]
    (tmp_path / "link.npy").symlink_to(train[1])
    shutil.copy(train[1], tmp_path / "copy.npy")
    base = dict(source=f"{tmp_path}/part-*.npy", sequence_length=64)
    for given, same in [(str(train[1]), "part-001"), (str(tmp_path / "link.npy"), "part-001"),
                        (str(tmp_path / "copy.npy"), "part-001"), (str(other), "part-000")]:
        with pytest.raises(DataFileError, match=rf"held-out set 'val' reads {given}, which is the training file .*{same}"):
            build_datasets(DataConfig(**base, heldout={"val": given}), VOCAB)
    _, (val,) = build_datasets(DataConfig(**base, heldout={"val": str(held)}), VOCAB)
    assert val.name == "val" and len(val.dataset) == 8
    # A training sample measured on purpose, by name.
    build_datasets(DataConfig(**base, heldout={"train_sample": str(train[1])}, allow_heldout_in_training=True), VOCAB)


# Row 4: a headerless file read with the other dtype is refused, valid files are not.
def test_a_token_file_read_with_the_wrong_dtype_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    small = write_token_file(tmp_path / "u32.npy", rng.integers(0, 4096, 4096), 4096, "uint32")
    with pytest.raises(DataFileError, match=r"u32.npy: every other id is 0 or less.*set data.token_dtype=uint32"):
        TokenFile(small, 4096)  # a 4096-id vocab reads uint16 by default
    assert TokenFile(small, 4096, "uint32").num_tokens == 4096
    dolma = write_token_file(tmp_path / "u16.npy", rng.integers(0, 50000, 4096), 100278, "uint16")
    with pytest.raises(DataFileError, match=r"most ids of its first page are >= vocab_size 100278.*data.token_dtype=uint16"):
        TokenFile(dolma, 100278)  # dolma2's vocab reads uint32 by default
    assert TokenFile(dolma, 100278, "uint16").num_tokens == 4096
    with pytest.raises(DataFileError, match="every other id is 1 or less"):
        TokenFile(write_token_file(tmp_path / "big.npy", rng.integers(0, 100278, 4096), 100278, "uint32"), 100278, "uint16")
    # Valid files pass: ids counting up, all zeros, a single stray id, a file shorter than the sample.
    for tokens in (np.arange(4096), np.zeros(4096, np.int64), np.r_[np.arange(100), [4095], np.arange(100)], np.arange(7)):
        TokenFile(write_token_file(tmp_path / "ok.npy", tokens, 4096), 4096)
    # A size that no uint32 file can have.
    (tmp_path / "odd.npy").write_bytes(b"\0" * 6)
    with pytest.raises(DataFileError, match="6 bytes, not a multiple of 4"):
        TokenFile(tmp_path / "odd.npy", 4096, "uint32")


def test_data_token_dtype_reaches_the_files(tmp_path):
    make_token_files(tmp_path, [512], vocab_size=VOCAB)
    u32 = write_token_file(tmp_path / "wide.npy", np.arange(512) % VOCAB, VOCAB, "uint32")
    data = DataConfig(source=str(u32), sequence_length=64)
    with pytest.raises(DataFileError, match="set data.token_dtype=uint32"):
        build_datasets(data, VOCAB)
    train, _ = build_datasets(DataConfig(source=str(u32), sequence_length=64, token_dtype="uint32"), VOCAB)
    tokens, _ = train.read(np.arange(8))
    np.testing.assert_array_equal(tokens.reshape(-1), np.arange(512))


# Row 7: a local file that shrinks or changes under a running job: one error, never SIGBUS.
def test_a_local_file_truncated_or_changed_mid_run_is_an_error_not_a_bus_error(tmp_path):
    import os

    path = make_token_files(tmp_path, [64 * 64])[0]
    ds = InstanceDataset([source_from_paths("train", path)], 64, VOCAB)
    first, _ = ds.read(np.arange(64))
    os.truncate(path, 64 * 2 * 10)  # ten instances left: the memory map of old would SIGBUS here
    with pytest.raises(DataFileError, match=rf"token file {path} changed while the run read it \(now 1280 bytes, 8192"):
        ds.read(np.arange(64))
    with pytest.raises(DataFileError, match="changed while the run read it"):
        ds.read(np.arange(2))  # even where the bytes are still there
    # Rewritten in place at the same size: the modification time says so.
    ds = InstanceDataset([source_from_paths("train", path)], 64, VOCAB)
    with open(path, "r+b") as f:
        f.write(b"\1\0")
    os.utime(path, ns=(0, 10**9))
    with pytest.raises(DataFileError, match="changed while the run read it"):
        ds.read(np.arange(2))
    np.testing.assert_array_equal(first[:, 0], np.arange(0, 64 * 64, 64))


# data.source= a directory: say so, and what to give instead.
def test_a_directory_as_the_source_says_it_is_a_directory_and_what_to_give(tmp_path):
    make_token_files(tmp_path, [128])
    with pytest.raises(DataFileError, match=rf"{tmp_path} is a directory, not a token file: .*'{tmp_path}/\*.npy'"):
        build_datasets(DataConfig(source=str(tmp_path), sequence_length=64), VOCAB)
    with pytest.raises(DataFileError, match="is a directory: name a token file"):
        TokenFile(tmp_path, VOCAB)
    assert len(build_datasets(DataConfig(source=f"{tmp_path}/*.npy", sequence_length=64), VOCAB)[0]) == 2
