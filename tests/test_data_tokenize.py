"""The tokenize tool: text and JSONL (plain, .gz, .zst) to OLMo-core token files with EOS per document."""

import gzip
import importlib.util
import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.data.heldout import document_bounds
from olmo_eqx.data.token_files import DataFileError, TokenFile
from olmo_eqx.data.tokenize import main, tokenize_files


@pytest.fixture(scope="module")
def tokenizer_path():
    return embedded_corpus().tokenizer_path


DOCS = ["import os\nprint(os.getcwd())\n", "def f(x):\n    return x + 1\n", "class A:\n    pass\n"]


def _decode_docs(path, tokenizer_path, eos_id=0):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokens = np.asarray(TokenFile(path, tokenizer.get_vocab_size()).tokens)
    bounds = document_bounds(tokens, eos_id)
    assert all(tokens[end - 1] == eos_id for _, end in bounds)  # every document ends with EOS
    return [tokenizer.decode(tokens[start : end - 1].tolist()) for start, end in bounds]


def test_tokenize_txt_jsonl_and_gz_in_parallel(tmp_path, tokenizer_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "notes.txt").write_text(DOCS[0])
    (raw / "code.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    with gzip.open(raw / "more.jsonl.gz", "wt") as handle:
        handle.write("\n".join(json.dumps({"body": d}) for d in DOCS[1:]) + "\n")

    results = tokenize_files([str(raw / "*.jsonl"), str(raw / "notes.txt")], tokenizer_path, tmp_path / "out", workers=2)
    assert [(r.output.name, r.documents) for r in results] == [("code.npy", 3), ("notes.npy", 1)]
    assert _decode_docs(tmp_path / "out" / "code.npy", tokenizer_path) == DOCS
    assert _decode_docs(tmp_path / "out" / "notes.npy", tokenizer_path) == DOCS[:1]
    assert "[2/2]" in capsys.readouterr().err  # progress

    assert main([str(raw / "more.jsonl.gz"), "--tokenizer", str(tokenizer_path), "--out-dir", str(tmp_path / "gz"),
                 "--text-field", "body", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "tokenized 1 files: 2 documents" in out
    assert _decode_docs(tmp_path / "gz" / "more.npy", tokenizer_path) == DOCS[1:]


def test_zstd_input(tmp_path, tokenizer_path):
    path = tmp_path / "docs.jsonl.zst"
    payload = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    if importlib.util.find_spec("zstandard") is None:
        path.write_bytes(b"\x28\xb5\x2f\xfd")  # the zstd magic; zstandard is optional
        with pytest.raises(DataFileError, match="pip install zstandard"):
            tokenize_files([str(path)], tokenizer_path, tmp_path / "out")
    else:
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(payload))
        tokenize_files([str(path)], tokenizer_path, tmp_path / "out")
        assert _decode_docs(tmp_path / "out" / "docs.npy", tokenizer_path) == DOCS


def test_bad_inputs_get_clear_errors(tmp_path, tokenizer_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: not valid JSON"):
        tokenize_files([str(bad)], tokenizer_path, tmp_path / "out")
    with pytest.raises(DataFileError, match="no string field 'content'"):
        tokenize_files([str(bad)], tokenizer_path, tmp_path / "out", text_field="content")
    with pytest.raises(DataFileError, match="has no token '<eos>'"):
        tokenize_files([str(bad)], tokenizer_path, tmp_path / "out", eos_token="<eos>")
    assert main([str(tmp_path / "absent.txt"), "--tokenizer", str(tokenizer_path), "--out-dir", str(tmp_path)]) == 1
    assert "absent.txt does not exist" in capsys.readouterr().err


def test_text_spelling_the_eos_token_does_not_end_a_document(tmp_path, tokenizer_path):
    doc = 'SEP = "<|endoftext|>"  # a string, not a boundary\n'
    (tmp_path / "doc.txt").write_text(doc)
    tokenize_files([str(tmp_path / "doc.txt")], tokenizer_path, tmp_path / "out")
    assert _decode_docs(tmp_path / "out" / "doc.npy", tokenizer_path) == [doc]
