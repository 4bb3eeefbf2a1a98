"""Token files at URLs, served on 127.0.0.1 by real servers: `rangeserver.RangeServer` (HTTP
with ranges and injectable faults, also GCS's JSON API) and moto's S3 server.

A short pretrain from the files over HTTP and over S3 equals the local-file run bit for bit
(losses, grad norms, held-out loss, final weights); a server stopped mid-run stops the run
with one line naming the URL, and the rerun resumes to the same bits; 404s, shortened files,
servers that ignore ranges and transient errors behave as olmo_eqx/data/remote.py says.
"""

import json
import os

import jax
import numpy as np
import pytest

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.config import compose_config
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.mixes import read_mix, source_from_paths
from olmo_eqx.data.remote import RemoteFileError, RemoteReader, RetryPolicy, SizeCache
from olmo_eqx.data.token_files import DataFileError, write_token_file
from olmo_eqx.sharding import ShardingRules, make_mesh
from olmo_eqx.train.loop import TrainError, train
from olmo_eqx.train.state import sharded_abstract_train_state

from clihelp import TINY
from rangeserver import RangeServer, TrickleProxy
from test_pretrain import read_metrics

VOCAB = 4096  # olmo3_nano's
TOKENIZER = "allenai/dolma2-tokenizer"
FILES = 3
SEQ = 64
BUCKET = "olmo-data"
QUICK = RetryPolicy(attempts=3, backoff_s=0.01)
# Few, fast retries, so a dead server stops a run within a second.
RUN_RETRIES = ["data.remote_attempts=3", "data.remote_backoff_s=0.01"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three training files and one held-out file laid out like OLMo-core's, and a mix manifest."""
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(21)
    data = root / "olmo" / "data"
    for i in range(FILES):
        write_token_file(data / TOKENIZER / f"part-{i:03d}.npy", rng.integers(0, VOCAB, SEQ * (40 + 7 * i) + 5), VOCAB)
    write_token_file(data / "eval" / "heldout.npy", rng.integers(0, VOCAB, SEQ * 8), VOCAB)
    manifest = root / "mix.txt"
    manifest.write_text("".join(f"train,{{TOKENIZER}}/part-{i:03d}.npy\n" for i in range(FILES)))
    return root, manifest


@pytest.fixture(scope="module")
def http(corpus):
    server = RangeServer(corpus[0])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3(corpus):
    """moto's S3 server on 127.0.0.1 holding the files under s3://olmo-data/olmo/data/..."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as env:
        # boto3's standard configuration chain: what a user sets for any S3-compatible store.
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for path in (corpus[0] / "olmo").rglob("*.npy"):
            client.upload_file(str(path), BUCKET, str(path.relative_to(corpus[0])))
        yield f"s3://{BUCKET}"
    server.stop()


def run_args(manifest, root: str) -> list[str]:
    return TINY + [f"data.source={manifest}", f"data.data_root={root}/olmo/data", f"data.tokenizer={TOKENIZER}",
                   f"+data.heldout.eval={root}/olmo/data/eval/heldout.npy"] + RUN_RETRIES


def final_weights(run_dir, config):
    mesh, rules = make_mesh(config.mesh), ShardingRules()
    with Checkpointer(run_dir / "checkpoints", read_only=True) as checkpointer:
        state = checkpointer.restore(12, target=sharded_abstract_train_state(config.model, config.optim, mesh, rules)).state
    return [np.asarray(x) for x in jax.tree.leaves((state.model, state.opt_state))]


def assert_same_run(run_dir, reference_dir, config):
    """Every training and held-out number, and the final weights and optimiser state, bit for bit."""
    runs = [read_metrics(run_dir), read_metrics(reference_dir)]
    assert sorted(runs[0]) == sorted(runs[1]) == list(range(1, 13))
    for step in range(1, 13):
        for key in ("loss", "grad_norm", "lr"):
            assert runs[0][step][key] == runs[1][step][key], (step, key)
    heldout = [[r["heldout_loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
                if "heldout_loss" in r] for d in (run_dir, reference_dir)]
    assert heldout[0] == heldout[1] and len(heldout[0]) == 2
    for a, b in zip(final_weights(run_dir, config), final_weights(reference_dir, config)):
        assert np.array_equal(a, b)


@pytest.fixture(scope="module")
def local_run(corpus, tmp_path_factory):
    root, manifest = corpus
    run_dir = tmp_path_factory.mktemp("local_run")
    config = compose_config(run_args(manifest, str(root)))
    train(config, run_dir)
    return run_dir, config


# ---------------------------------------------------------------------------------------------
# Whole runs


def test_a_run_over_http_equals_the_local_run_bitwise_and_counts_retries(corpus, http, local_run, tmp_path):
    root, manifest = corpus
    http.error_rate = 0.03  # transient 503s, retried: they change no number
    try:
        summary = train(compose_config(run_args(manifest, http.url)), tmp_path)
    finally:
        http.error_rate = 0.0
    assert summary["stage_completed"]
    assert_same_run(tmp_path, *local_run)
    last = read_metrics(tmp_path)[12]
    assert last["data_requests"] > 0 and last["data_retries"] > 0  # the retries show in the metrics
    # The sizes are cached in the run dir: a later session asks for none.
    sizes = SizeCache(tmp_path / SizeCache.FILE).load()
    assert len(sizes) == FILES + 1 and all(url.startswith(http.url) for url in sizes)


def test_a_run_over_s3_equals_the_local_run_bitwise(corpus, s3, local_run, tmp_path):
    root, manifest = corpus
    train(compose_config(run_args(manifest, s3)), tmp_path)
    assert_same_run(tmp_path, *local_run)


def test_a_server_killed_mid_run_stops_it_with_one_line_and_the_rerun_resumes_bitwise(
    corpus, http, local_run, tmp_path
):
    root, manifest = corpus
    config = compose_config(run_args(manifest, http.url))
    # Requests of the first session: 4 sizes, 4 content samples (whole small files), 8 rows of the
    # held-out batch, then 8 rows a step. The server dies during the reads of steps 7-8, after
    # the step-6 checkpoint (two batches are read at once: step 8's start only after step 6's end).
    http.dies_after = http.requests + 16 + 8 * 7
    try:
        with pytest.raises(TrainError) as stopped:
            train(config, tmp_path)
    finally:
        http.dies_after = None
    # A real stop and restart on the same port too: the reader reconnects.
    http.stop()
    http.start()
    message = str(stopped.value)
    assert "\n" not in message and f"token file {http.url}/olmo/data/" in message
    assert "failed 3 times" in message and "rerun to resume" in message
    before = http.size_requests
    summary = train(config, tmp_path)
    assert summary["start_step"] == 6 and summary["stage_completed"]
    assert http.size_requests == before  # the restart took every size from the run dir's cache
    assert_same_run(tmp_path, *local_run)


# ---------------------------------------------------------------------------------------------
# Permanent errors: one line naming the URL, before any work


def test_a_missing_file_stops_the_run_at_start_naming_the_url(corpus, http, tmp_path):
    root, manifest = corpus
    missing = f"/olmo/data/{TOKENIZER}/part-001.npy"
    http.missing.add(missing)
    try:
        with pytest.raises(TrainError) as refused:
            train(compose_config(run_args(manifest, http.url)), tmp_path)
    finally:
        http.missing.clear()
    assert str(refused.value) == (
        f"token file {http.url}{missing}: HTTP 404 on its size request: it does not exist: check the data root "
        "and the tokenizer name in the paths"
    )


def test_a_shortened_file_is_refused_even_with_its_size_cached(corpus, http, tmp_path):
    root, manifest = corpus
    served = root / "short"
    files = [write_token_file(served / f"p{i}.npy", np.arange(SEQ * 10) % VOCAB, VOCAB) for i in range(2)]
    urls = [f"{http.url}/short/p{i}.npy" for i in range(2)]
    cache = SizeCache(tmp_path / SizeCache.FILE)
    first = InstanceDataset([source_from_paths("train", urls)], SEQ, VOCAB, reader=RemoteReader(QUICK))
    cache.save(first.remote_sizes)
    files[1].write_bytes(files[1].read_bytes()[: -SEQ * 4])  # shortened on the server
    with pytest.raises(RemoteFileError, match=rf"^token file {urls[1]}: it is now {SEQ * 16} bytes, but the run recorded {SEQ * 20}"):
        InstanceDataset([source_from_paths("train", urls)], SEQ, VOCAB, reader=RemoteReader(QUICK), sizes=cache.load())
    # Shortened while a run reads it: the range past its new end is refused the same way.
    with pytest.raises(RemoteFileError, match=rf"token file {urls[1]}: (it is now|HTTP 416)"):
        first.read(np.arange(len(first)))


def test_a_server_that_ignores_ranges_is_refused(corpus, http):
    url = f"{http.url}/olmo/data/eval/heldout.npy"
    http.ignore_ranges = True
    try:
        with pytest.raises(RemoteFileError, match=f"^token file {url}: the server ignored the Range header.*olmo_eqx.data.serve"):
            InstanceDataset([source_from_paths("eval", [url])], SEQ, VOCAB, reader=RemoteReader(QUICK))
    finally:
        http.ignore_ranges = False


def test_the_shipped_range_server_serves_what_a_run_reads(corpus):
    """`python -m olmo_eqx.data.serve DIR` (the local way to try training from a URL, which the
    refusal above names) answers sizes and byte ranges as the reader needs."""
    import threading
    import urllib.error
    import urllib.request

    from olmo_eqx.data.serve import make_server

    server = make_server(corpus[0], port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/olmo/data/eval/heldout.npy"
        local = (corpus[0] / "olmo/data/eval/heldout.npy").read_bytes()
        reader = RemoteReader(QUICK)
        assert reader.size(url) == len(local)
        assert reader.read(url, 10, 100, len(local)) == local[10:110]
        dataset = InstanceDataset([source_from_paths("eval", [url])], SEQ, VOCAB, reader=reader)
        assert len(dataset) == len(local) // 2 // SEQ  # uint16 tokens, whole instances
        past = urllib.request.Request(url, headers={"Range": f"bytes={len(local) + 5}-{len(local) + 9}"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(past, timeout=10)
        assert answer.value.code == 416 and answer.value.headers["Content-Range"] == f"bytes */{len(local)}"
    finally:
        server.shutdown()
        server.server_close()


def test_globs_and_unknown_schemes_at_urls_are_refused(corpus, http):
    with pytest.raises(DataFileError, match="a glob cannot be expanded at a URL"):
        source_from_paths("train", f"{http.url}/olmo/*.npy")
    with pytest.raises(DataFileError, match="the URL schemes read are"):
        read_mix(corpus[1], "ftp://example.org/data", TOKENIZER)


# ---------------------------------------------------------------------------------------------
# Reads


def test_transient_errors_are_retried_counted_and_change_nothing(corpus, http):
    root, manifest = corpus
    local = InstanceDataset(read_mix(manifest, root / "olmo" / "data", TOKENIZER), SEQ, VOCAB)
    http.error_rate, sent = 0.2, http.errors_sent
    try:
        reader = RemoteReader(RetryPolicy(attempts=10, backoff_s=0.001))
        remote = InstanceDataset(read_mix(manifest, f"{http.url}/olmo/data", TOKENIZER), SEQ, VOCAB, reader=reader)
        ids = np.arange(len(local))
        assert np.array_equal(remote.read(ids)[0], local.read(ids)[0])
    finally:
        http.error_rate = 0.0
    assert reader.stats["data_retries"] == http.errors_sent - sent > 0
    # Same files, same tail of their paths: the same dataset to a checkpoint.
    assert remote.fingerprint() == local.fingerprint()


def test_gs_urls_through_a_storage_emulator(corpus, http, monkeypatch):
    root, manifest = corpus
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", http.url)  # the bucket is the served dir "olmo"
    local = InstanceDataset(read_mix(manifest, root / "olmo" / "data", TOKENIZER), SEQ, VOCAB)
    remote = InstanceDataset(read_mix(manifest, "gs://olmo/data", TOKENIZER), SEQ, VOCAB)
    ids = np.arange(len(local))
    assert np.array_equal(remote.read(ids)[0], local.read(ids)[0])
    assert remote.fingerprint() == local.fingerprint()
    before = http.size_requests
    InstanceDataset(read_mix(manifest, "gs://olmo/data", TOKENIZER), SEQ, VOCAB, sizes=remote.remote_sizes)
    assert http.size_requests == before  # known sizes are not asked for


def test_olmo_cores_official_mix_at_its_public_root_without_a_request():
    """The stage-1 manifest from the installed ai2-olmo-core wheel (read as a file), rooted at
    AI2's HTTP host: 950 URLs; nothing is fetched until a dataset is built."""
    import subprocess
    import sys

    sources = read_mix("olmo_core:OLMo-mix-0925-official.txt", "https://olmo-data.org", TOKENIZER)
    urls = [p for s in sources for p in s.paths]
    assert len(urls) == 950 and all(isinstance(u, str) for u in urls)
    # OLMo-core's own substitution (`DataMix.build`): the OLMo 3 mixes' files sit under
    # allenai/dolma3-tokenizer/, the held-out sets under v3_small_dolma2-tokenizer/.
    assert urls[0] == ("https://olmo-data.org/preprocessed/dolma3-0625/v0.1-official/allenai/dolma3-tokenizer/"
                       "common_crawl/adult_content/000000.npy")
    # Located, never imported (olmo_core imports torch):
    check = ("import sys; from olmo_eqx.data.mixes import read_mix; "
             "read_mix('olmo_core:OLMo-mix-0925-official.txt', 'https://olmo-data.org', 'x'); "
             "assert 'olmo_core' not in sys.modules and 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0
    heldout = read_mix("olmo_core:v3-small-ppl-validation.txt", "s3://ai2-llm", TOKENIZER)
    assert all(p.startswith("s3://ai2-llm/") for s in heldout for p in s.paths)
    assert heldout[0].paths[0] == "s3://ai2-llm/eval-data/perplexity/v3_small_dolma2-tokenizer/c4_en/val/part-0-00000.npy"
    with pytest.raises(DataFileError, match="ai2-olmo-core ships no mix 'nope.txt'"):
        read_mix("olmo_core:nope.txt", "https://olmo-data.org", TOKENIZER)


def test_a_heldout_manifest_gives_one_set_per_label_at_the_data_root(corpus, http, tmp_path):
    from olmo_eqx.config import DataConfig
    from olmo_eqx.data.sources import build_datasets, remote_sizes

    root, manifest = corpus
    ppl = tmp_path / "ppl.txt"
    ppl.write_text("c4_en-validation,eval/heldout.npy\nbooks-validation,{TOKENIZER}/part-000.npy\n")
    data = DataConfig(source=str(manifest), data_root=f"{http.url}/olmo/data", tokenizer=TOKENIZER,
                      heldout={"v3_small": str(ppl)}, sequence_length=SEQ, allow_heldout_in_training=True)
    train_set, heldout = build_datasets(data, VOCAB)
    assert [h.name for h in heldout] == ["c4_en-validation", "books-validation"]
    assert heldout[0].dataset.files[0].path == f"{http.url}/olmo/data/eval/heldout.npy"
    assert len(remote_sizes(train_set, heldout)) == FILES + 1  # one file shared by both


def test_a_small_file_is_fetched_whole_over_s3_as_over_http(corpus, http, s3):
    """`RemoteReader.fetch` (what a tokenizer URL is read with): range reads from the start, no
    size request; S3's answers carry the size in ContentRange as HTTP's do."""
    root, _ = corpus
    local = (root / "olmo" / "data" / "eval" / "heldout.npy").read_bytes()
    assert RemoteReader().fetch(f"{s3}/olmo/data/eval/heldout.npy", chunk=1000) == local
    assert RemoteReader().fetch(f"{http.url}/olmo/data/eval/heldout.npy") == local


def test_the_eval_stages_heldout_sets_read_urls_and_manifests_at_a_url_root(corpus, http, tmp_path):
    """What `+stage=eval` / `compare` evaluate (`build_heldout_sets`): a set at a URL
    (stage.heldout or data.heldout), and a held-out manifest under a URL data root, one set per
    label as training logs them; the same tokens as the local files."""
    from olmo_eqx.evaluation.heldout import build_heldout_sets
    from olmo_eqx.errors import EvalError

    root, _ = corpus
    ppl = tmp_path / "ppl.txt"
    ppl.write_text("c4_en-validation,eval/heldout.npy\nbooks-validation,{TOKENIZER}/part-000.npy\n")
    local = InstanceDataset([source_from_paths("x", root / "olmo" / "data" / "eval" / "heldout.npy")], SEQ, VOCAB)
    expected = local.read(np.arange(len(local)))[0]
    at_url = build_heldout_sets({"eval": f"{http.url}/olmo/data/eval/heldout.npy"}, "x", {}, SEQ, VOCAB)
    manifest = build_heldout_sets({}, "x", {"v3_small": str(ppl)}, SEQ, VOCAB, data_root=f"{http.url}/olmo/data",
                                  tokenizer=TOKENIZER)
    assert [s.name for s in at_url] == ["eval"] and [s.name for s in manifest] == ["c4_en-validation", "books-validation"]
    for sets in (at_url, manifest):
        dataset = sets[0].dataset
        assert dataset.files[0].path == f"{http.url}/olmo/data/eval/heldout.npy"
        assert np.array_equal(dataset.read(np.arange(len(dataset)))[0], expected)
    with pytest.raises(EvalError, match="is a mix manifest: set data.data_root and data.tokenizer"):
        build_heldout_sets({}, "x", {"v3_small": str(ppl)}, SEQ, VOCAB)


# ---------------------------------------------------------------------------------------------
# Issue 42: servers that answer another range, too many bytes, a rewritten file, a trickle


def test_another_range_or_too_many_bytes_is_one_line_naming_the_url(corpus, http):
    url = f"{http.url}/olmo/data/eval/heldout.npy"
    reader = RemoteReader(QUICK)
    size = reader.size(url)
    assert reader.read(url, 256, 128, size) == (corpus[0] / "olmo" / "data" / "eval" / "heldout.npy").read_bytes()[256:384]
    http.wrong_range = True  # answers bytes 0-127 to bytes=256-383, and says so
    try:
        with pytest.raises(RemoteFileError) as wrong:
            reader.read(url, 256, 128, size)
    finally:
        http.wrong_range = False
    assert str(wrong.value) == (f"token file {url}: asked for bytes 256-383, the server answered bytes 0-127 "
                                "(Content-Range): it does not serve byte ranges correctly; serve the files from one that does")
    http.extra_bytes = 3
    try:
        with pytest.raises(RemoteFileError, match=rf"^token file {url}: asked for bytes 256-383, the server sent 131 "
                                                  "bytes, 3 too many") as extra:
            reader.read(url, 256, 128, size)
    finally:
        http.extra_bytes = 0
    assert "\n" not in str(extra.value) and reader.stats["data_retries"] == 0  # permanent: not retried


def test_a_same_size_rewrite_is_caught_at_the_next_read_over_http_gcs_and_s3(corpus, http, s3, monkeypatch):
    """Each store's version of a file (ETag, GCS generation, S3 ETag) is pinned when the run
    first sees it; an answer of another version stops the read, naming the URL."""
    import boto3

    root, _ = corpus
    served = root / "olmo" / "rewritten"
    data = np.arange(SEQ * 4) % VOCAB
    path = write_token_file(served / "p.npy", data, VOCAB)
    original = path.read_bytes()
    client = boto3.client("s3")
    client.put_object(Bucket=BUCKET, Key="olmo/rewritten/p.npy", Body=original)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", http.url)  # gs://olmo/... is the served dir olmo/
    for url, pinned in ((f"{http.url}/olmo/rewritten/p.npy", "etag"), ("gs://olmo/rewritten/p.npy", "x-goog-generation"),
                        (f"{s3}/olmo/rewritten/p.npy", "ETag")):
        path.write_bytes(original)
        client.put_object(Bucket=BUCKET, Key="olmo/rewritten/p.npy", Body=original)
        reader = RemoteReader(QUICK)
        size = reader.size(url)
        assert reader.read(url, 0, 128, size) == original[:128]
        changed = original[128:] + original[:128]  # the same size, other tokens
        stamp = path.stat().st_mtime_ns
        path.write_bytes(changed)
        os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # a new version even on a coarse clock
        client.put_object(Bucket=BUCKET, Key="olmo/rewritten/p.npy", Body=changed)
        with pytest.raises(RemoteFileError, match=rf"^token file {url}: it changed on the server during the run \("
                                                  rf"{pinned} .* -> {pinned} .*\): a run's data must not "
                                                  "change under it. Restore the original file and rerun to resume"):
            reader.read(url, 128, 128, size)
        assert reader.stats["data_retries"] == 0


def test_a_file_rewritten_mid_run_stops_it_before_training_on_it(corpus, http, tmp_path):
    root, manifest = corpus
    config = compose_config(run_args(manifest, http.url))
    path = root / "olmo" / "data" / TOKENIZER / "part-001.npy"
    original = path.read_bytes()
    # During the reads of steps 7-8, after the step-6 checkpoint (as the killed-server test).
    due = http.requests + 16 + 8 * 7

    def rewrite(n):
        if n == due:
            stamp = path.stat().st_mtime_ns
            path.write_bytes(original[SEQ * 2:] + original[:SEQ * 2])
            os.utime(path, ns=(stamp + 10**9, stamp + 10**9))

    http.on_request = rewrite
    try:
        with pytest.raises(TrainError) as stopped:
            train(config, tmp_path)
    finally:
        http.on_request = None
        path.write_bytes(original)
    message = str(stopped.value)
    assert "\n" not in message and message.startswith(f"token file {http.url}/olmo/data/{TOKENIZER}/part-001.npy: it "
                                                      "changed on the server during the run")
    assert message.endswith("Stopped before training on it; the checkpoints are intact")
    steps = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert max(steps) < 9 and Checkpointer(tmp_path / "checkpoints", read_only=True).all_steps() == [6]


def test_a_trickling_server_times_out_and_sigterm_ends_the_run_within_seconds(corpus, http, local_run, tmp_path):
    """A server sending one byte every 50 ms (each gap far under the socket timeout): a read's
    deadline (data.remote_timeout_s) ends it; a SIGTERM ends the run in seconds with a
    checkpoint of the last step trained, and the rerun resumes to the same bits."""
    import os
    import signal
    import threading
    import time

    url = f"{http.url}/olmo/data/eval/heldout.npy"
    http.trickle_s = 0.05  # 128 bytes: 6.4 s
    try:
        reader = RemoteReader(RetryPolicy(attempts=1, timeout_s=0.5))
        size = reader.size(url)
        started = time.monotonic()
        with pytest.raises(RemoteFileError, match=rf"^token file {url}: reading bytes 0-127 failed 1 times, last with "
                                                  r"no complete answer within 0.5s \(data.remote_timeout_s\)"):
            reader.read(url, 0, 128, size)
        assert time.monotonic() - started < 2
    finally:
        http.trickle_s = 0.0
    root, manifest = corpus
    config = compose_config(run_args(manifest, http.url))
    # Every read from request `due` on trickles (a row takes 26 s); by the signal, 1.5 s later,
    # the loop waits on such a batch: only cutting the reads lets it stop within 5 s.
    due, signalled = http.requests + 16 + 8 * 7, []

    def trickle_then_signal(n):
        if n == due:
            http.trickle_s = 0.2
            signalled.append(time.monotonic() + 1.5)
            threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()

    http.on_request = trickle_then_signal
    try:
        summary = train(config, tmp_path)
        took = time.monotonic() - signalled[0]
    finally:
        http.on_request, http.trickle_s = None, 0.0
    assert summary["interrupted"] == "SIGTERM" and summary["end_step"] < 12 and took < 5, (summary, took)
    assert Checkpointer(tmp_path / "checkpoints", read_only=True).all_steps()[-1] == summary["end_step"]
    again = train(config, tmp_path)
    assert again["start_step"] == summary["end_step"] and again["stage_completed"]
    assert_same_run(tmp_path, *local_run)


def test_a_trickling_s3_server_times_out_and_cancel_cuts_its_reads(s3, monkeypatch):
    """The same trickle in front of moto's S3 (a proxy sending its answers a byte every 50 ms,
    headers and body): botocore's read timeout, per socket read, never fires, but the read's
    wall-clock deadline ends it; and `cancel`, what a SIGTERM calls (the HTTP test above runs
    the signal end to end), cuts a read in flight at once rather than after the trickle."""
    import threading
    import time
    import urllib.parse

    moto = urllib.parse.urlsplit(os.environ["AWS_ENDPOINT_URL"])
    proxy = TrickleProxy((moto.hostname, moto.port))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # read by each S3 client made from here on
    url = f"{s3}/olmo/data/eval/heldout.npy"
    try:
        reader = RemoteReader(RetryPolicy(attempts=1, timeout_s=0.5))
        size = reader.size(url)
        proxy.trickle_s = 0.05  # an answer of ~500 bytes: ~25 s
        started = time.monotonic()
        with pytest.raises(RemoteFileError, match=rf"^token file {url}: reading bytes 0-127 failed 1 times, last with "
                                                  r"no complete answer within 0.5s \(data.remote_timeout_s\)"):
            reader.read(url, 0, 128, size)
        assert time.monotonic() - started < 2

        proxy.trickle_s = 0.0
        reader, ended = RemoteReader(RetryPolicy(attempts=3, backoff_s=0.01, timeout_s=60.0)), []
        size = reader.size(url)
        proxy.trickle_s = 0.05

        def read():
            try:
                reader.read(url, 0, 128, size)
            except RemoteFileError as e:
                ended.append((time.monotonic(), str(e)))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        time.sleep(0.5)
        cancelled = time.monotonic()
        reader.cancel()
        thread.join(3)
        assert ended and ended[0][0] - cancelled < 1, ended
        assert ended[0][1] == f"token file {url}: reading bytes 0-127 stopped: the run is stopping"
    finally:
        proxy.trickle_s = 0.0
        proxy.stop()
