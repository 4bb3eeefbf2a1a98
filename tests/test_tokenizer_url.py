"""The tokenizer (a HF tokenizer.json) from a URL, for the tokenize tool and for eval / generate /
export: fetched once through the remote reader into `$OLMO_EQX_CACHE/remote`, one line naming
the URL when it is missing. Served by the tests' localhost range server (tests/rangeserver.py)."""

from pathlib import Path

import pytest

from olmo_eqx.checkpoint.paths import CheckpointLocation
from olmo_eqx.config import compose_config
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.data.remote import RemoteReader, cache_dir, local_copy
from olmo_eqx.data.tokenize import main
from olmo_eqx.errors import EvalError
from olmo_eqx.evaluation.run import find_tokenizer
from olmo_eqx.evaluation.tokens import TextTokenizer

from rangeserver import RangeServer

HOSTED = "/allenai/dolma2-tokenizer/tokenizer.json"  # where the served dir holds it
DOCS = "import os\nprint(os.getcwd())\n"
# A model directory without a tokenizer.json of its own: the one given is what counts.
MODEL = CheckpointLocation("hf", Path("/nonexistent/model"))


@pytest.fixture(scope="module")
def tokenizer_bytes():
    return embedded_corpus().tokenizer_path.read_bytes()  # before the cache moves (below)


@pytest.fixture
def server(tmp_path, monkeypatch, tokenizer_bytes):
    monkeypatch.setenv("OLMO_EQX_CACHE", str(tmp_path / "cache"))  # a fresh cache per test
    (tmp_path / "served" / HOSTED.lstrip("/")).parent.mkdir(parents=True)
    (tmp_path / "served" / HOSTED.lstrip("/")).write_bytes(tokenizer_bytes)
    served = RangeServer(tmp_path / "served")
    yield served
    served.stop()


def test_the_tokenize_tool_takes_a_tokenizer_url_and_fetches_it_once(server, tmp_path, tokenizer_bytes, capsys):
    (tmp_path / "doc.txt").write_text(DOCS)
    local = tmp_path / "local.json"
    local.write_bytes(tokenizer_bytes)
    url = server.url + HOSTED
    for out, tokenizer in (("ref", str(local)), ("a", url), ("b", url)):
        assert main([str(tmp_path / "doc.txt"), "--tokenizer", tokenizer, "--out-dir", str(tmp_path / out), "--workers", "1"]) == 0
        if out == "a":
            requests = server.requests
            assert requests == 1  # one range read of the whole file, no size request
    assert server.requests == requests  # the second run used the cached copy
    assert (tmp_path / "a" / "doc.npy").read_bytes() == (tmp_path / "b" / "doc.npy").read_bytes() == \
        (tmp_path / "ref" / "doc.npy").read_bytes()
    cached = local_copy(url)
    assert cached.parent.parent == cache_dir() == tmp_path / "cache" / "remote"
    assert cached.name == "tokenizer.json" and cached.read_bytes() == tokenizer_bytes
    assert (cached.parent / "url.txt").read_text() == url + "\n"


def test_a_missing_tokenizer_url_is_one_line_naming_it(server, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text(DOCS)
    url = server.url + "/allenai/nope/tokenizer.json"
    assert main([str(tmp_path / "doc.txt"), "--tokenizer", url, "--out-dir", str(tmp_path / "out")]) == 1
    line = f"tokenizer {url}: HTTP 404: it does not exist: check the URL"
    assert capsys.readouterr().err == f"error: {line}\n"
    config = compose_config([])
    with pytest.raises(EvalError) as refused:
        find_tokenizer(MODEL, url, config, 4096)  # eval, compare, generate, export and the harness
    assert str(refused.value) == line
    assert not list((tmp_path / "cache").rglob("tokenizer.json"))  # nothing cached


def test_eval_and_generate_take_a_tokenizer_url_behind_a_redirect_or_on_gs(server, tokenizer_bytes, monkeypatch):
    # A hub's resolve URL answers with a redirect to the file: followed.
    server.redirects["/resolve/main/tokenizer.json"] = HOSTED
    url = f"{server.url}/resolve/main/tokenizer.json"
    config = compose_config(["+stage=generate", f"stage.tokenizer={url}"])
    assert config.stage["tokenizer"] == url  # Hydra takes a URL as it is
    path = find_tokenizer(MODEL, config.stage["tokenizer"], config, 4096)
    assert path.read_bytes() == tokenizer_bytes and TextTokenizer(path).vocab_size == 4096
    # gs:// through the JSON API (STORAGE_EMULATOR_HOST, as for Google's own clients).
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    gs = find_tokenizer(MODEL, "gs://allenai/dolma2-tokenizer/tokenizer.json", config, 4096)
    assert gs.read_bytes() == tokenizer_bytes and gs != path


def test_a_larger_file_is_fetched_in_chunks(server, tokenizer_bytes):
    reader = RemoteReader()
    assert reader.fetch(server.url + HOSTED, chunk=100_000) == tokenizer_bytes
    assert reader.stats["data_requests"] == -(-len(tokenizer_bytes) // 100_000)
