"""Checkpoints on an object store (`checkpoint.dir=s3://...`), against moto's S3 server on
127.0.0.1: digests written with the save and a commit object written last, verified on restore,
a damaged step marked set aside and the previous one used, retention that keeps the last
verified step; and a whole run that falls back to its previous step."""

import json

import jax
import numpy as np
import pytest

from olmo_eqx.checkpoint import CheckpointCorruptError, Checkpointer
from olmo_eqx.checkpoint.remote import COMMITTED, SET_ASIDE_MARKER
from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh
from olmo_eqx.train.state import init_train_state, sharded_abstract_train_state

from test_checkpoint import OPTIM, TINY

BUCKET = "olmo-ckpt"


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1 with an empty bucket; the boto3 client the tests inspect with."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        env.setenv("AWS_ACCESS_KEY_ID", "testing")
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client
    server.stop()


def keys(client, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", []))


def largest_model_object(client, prefix, step):
    sizes = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}{step}/model/")["Contents"]}
    return max(sizes, key=sizes.get)


@pytest.fixture(scope="module")
def state():
    mesh = make_mesh(MeshConfig())
    return init_train_state(TINY, OPTIM, mesh, ShardingRules(), jax.random.key(0)), mesh


def test_save_verify_corrupt_fall_back_and_retention_on_s3(s3, state, tmp_path):
    state, mesh = state
    url, prefix = f"s3://{BUCKET}/run1", "run1/"
    with Checkpointer(url, keep_last=2, async_save=False, staging=tmp_path / "staging") as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(step, state, loader_state={"step": step})
        assert checkpointer.all_steps() == [2, 3]  # retention removed step 1 from the store
        # The staged copies are gone once uploaded: the store holds the checkpoints.
        assert not [p for p in (tmp_path / "staging").iterdir() if p.name.isdigit()]
    objects = keys(s3, prefix)
    assert not [k for k in objects if k.startswith("1/")]
    committed = json.loads(s3.get_object(Bucket=BUCKET, Key=f"{prefix}3/{COMMITTED}")["Body"].read())
    assert committed["step"] == 3 and committed["algorithm"] == "sha256"
    assert any(name.startswith("model/") for name in committed["files"])
    assert all(f"3/{name}" in objects for name in committed["files"])

    # One byte range of the newest step's weights overwritten in the store.
    key = largest_model_object(s3, prefix, 3)
    body = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[100:140] = bytes(40)
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    target = sharded_abstract_train_state(TINY, OPTIM, mesh, ShardingRules())
    with Checkpointer(url, keep_last=2, async_save=False, staging=tmp_path / "staging2") as checkpointer:
        with pytest.raises(CheckpointCorruptError) as damaged:
            checkpointer.restore(3, target=target)
        message = str(damaged.value)
        assert message.startswith(f"checkpoint {url}/3 (step 3) is unusable: model/")
        assert "contents changed since the save" in message
        marker = checkpointer.set_aside(3, damaged.value.reason)
        assert marker == f"{url}/3/{SET_ASIDE_MARKER}"
        assert checkpointer.all_steps() == [2]  # the marked step is no longer listed ...
        restored = checkpointer.restore(target=target)  # ... and the previous one is used
        assert restored.step == 2 and restored.loader_state == {"step": 2}
        for a, b in zip(jax.tree.leaves(restored.state.model), jax.tree.leaves(state.model)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        # Saving step 3 again: the marked objects are copied under set_aside/, not overwritten.
        checkpointer.save(3, state, loader_state={"step": 3})
        checkpointer.save(4, state, loader_state={"step": 4})
        assert checkpointer.all_steps() == [3, 4]
        # keep_last=1 with the last verified step protected by the caller: retention keeps it.
        checkpointer.keep_last = 1
        checkpointer.protect(3)
        checkpointer.save(5, state)
        assert checkpointer.all_steps() == [3, 5]
    aside = [k for k in keys(s3, prefix) if k.startswith("set_aside/")]
    assert aside and all(k.startswith("set_aside/3-") for k in aside)
    assert any(k.endswith(f"/{SET_ASIDE_MARKER}") for k in aside) and any(k.endswith(key[len(prefix) + 2:]) for k in aside)


def test_retention_never_deletes_the_last_verified_step(s3, state, tmp_path):
    """A newer step that is committed but damaged in the store does not push out the last
    step this process verified."""
    state, mesh = state
    url, prefix = f"s3://{BUCKET}/run2", "run2/"
    writer = Checkpointer(url, keep_last=1, async_save=False, staging=tmp_path / "a")
    writer.save(1, state)
    # Another writer's step 2 (committed in the store), unverified by this checkpointer.
    with Checkpointer(url, keep_last=None, async_save=False, staging=tmp_path / "b") as other:
        other.save(2, state)
    writer.keep_last = 1
    writer._prune()
    assert writer.all_steps() == [1, 2]  # 1 is the last step this one verified: kept
    writer.close()


def test_an_interrupted_upload_is_no_checkpoint(s3, state, tmp_path):
    """Objects of a step without its committed.json (an upload killed midway) are not listed,
    and a save of that step moves them aside instead of mixing with them."""
    state, mesh = state
    url, prefix = f"s3://{BUCKET}/run3", "run3/"
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}7/model/partial", Body=b"half")
    with Checkpointer(url, keep_last=3, async_save=False, staging=tmp_path / "s") as checkpointer:
        assert checkpointer.all_steps() == []
        checkpointer.save(7, state)
        assert checkpointer.all_steps() == [7] and checkpointer.verify(7)
    assert any(k.startswith("set_aside/7-uncommitted") for k in keys(s3, prefix))
    assert f"7/model/partial" not in keys(s3, prefix)


def test_a_run_checkpointing_to_s3_falls_back_from_a_damaged_step_and_recomputes_it(s3, tmp_path, monkeypatch):
    from olmo_eqx.config import compose_config
    from olmo_eqx.train.loop import LOG_FILE, train

    from clihelp import TINY
    from test_pretrain import read_metrics

    monkeypatch.setenv("OLMO_EQX_CHECKPOINT_STAGING", str(tmp_path / "staging"))
    url, prefix = f"s3://{BUCKET}/run4", "run4/"
    config = compose_config(TINY + [f"checkpoint.dir={url}", "checkpoint.keep_last=3"])
    assert train(config, tmp_path / "run")["stage_completed"]
    first = read_metrics(tmp_path / "run")
    with Checkpointer(url, read_only=True, staging=tmp_path / "look") as reader:
        assert reader.all_steps() == [6, 12]
    key = largest_model_object(s3, prefix, 12)
    s3.put_object(Bucket=BUCKET, Key=key, Body=s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()[:-8])

    summary = train(config, tmp_path / "run")
    assert summary["start_step"] == 6 and summary["stage_completed"]
    log = (tmp_path / "run" / LOG_FILE).read_text()
    assert f"checkpoint {url}/12 (step 12) is unusable: model/" in log and "truncated" in log
    assert f"set aside: {url}/12/{SET_ASIDE_MARKER}; falling back to step 6" in log
    again = read_metrics(tmp_path / "run")
    assert [again[s]["loss"] for s in range(7, 13)] == [first[s]["loss"] for s in range(7, 13)]
    assert any(k.startswith("set_aside/12-") for k in keys(s3, prefix))  # the damaged step, kept
    with Checkpointer(url, read_only=True, staging=tmp_path / "look2") as reader:
        assert reader.all_steps() == [6, 12] and reader.verify(12)

    # A later stage finds it as it finds a local one: the URL, a step under it, or the run dir
    # (whose config.json names the URL); the weights come back verified.
    from olmo_eqx.checkpoint.paths import CheckpointNotFoundError
    from olmo_eqx.warm_start import load_model, locate

    assert str(locate(url)) == f"{url}/12" and locate(url).label == "run4@12"
    assert locate(f"{url}/6").step == 6 and locate(tmp_path / "run").step == 12
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoint of step 7 there; committed steps: \[6, 12\]"):
        locate(f"{url}/7", error=CheckpointNotFoundError)
    model = load_model(locate(url), make_mesh(MeshConfig()))
    with Checkpointer(url, read_only=True) as reader:
        target = sharded_abstract_train_state(config.model, config.optim, make_mesh(MeshConfig()), ShardingRules())
        saved = reader.restore(12, target=target).state.model
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(saved)))


def test_a_store_that_cannot_be_listed_stops_before_training(s3, state, tmp_path, monkeypatch):
    from olmo_eqx.checkpoint.storage import CheckpointSaveError, check_storage

    monkeypatch.setenv("OLMO_EQX_CHECKPOINT_STAGING", str(tmp_path))

    with pytest.raises(CheckpointSaveError, match=r"^checkpoint store s3://no-such-bucket/x: listing failed: .*NoSuchBucket"):
        check_storage("s3://no-such-bucket/x", state[0])
    check_storage(f"s3://{BUCKET}/fine", state[0])  # reachable, and the staging dir has room


def test_the_same_on_gcs_through_its_json_api(state, tmp_path, monkeypatch):
    """gs:// through GCS's JSON API on rangeserver's emulation (uploads, listing, deletes,
    copies): commit last, verify, a damaged step marked and the previous one used, retention."""
    from rangeserver import RangeServer

    state, mesh = state
    (tmp_path / "served" / "ckpts").mkdir(parents=True)
    server = RangeServer(tmp_path / "served")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    url, bucket_dir = "gs://ckpts/run", tmp_path / "served" / "ckpts" / "run"
    try:
        with Checkpointer(url, keep_last=2, async_save=False, staging=tmp_path / "s1") as checkpointer:
            for step in (1, 2, 3):
                checkpointer.save(step, state, loader_state={"step": step})
            assert checkpointer.all_steps() == [2, 3] and not [p for p in (bucket_dir / "1").rglob("*") if p.is_file()]
        assert (bucket_dir / "3" / COMMITTED).is_file()
        weights = max((bucket_dir / "3" / "model").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
        data = bytearray(weights.read_bytes())
        data[50:60] = bytes(10)
        weights.write_bytes(bytes(data))
        target = sharded_abstract_train_state(TINY, OPTIM, mesh, ShardingRules())
        with Checkpointer(url, keep_last=2, async_save=False, staging=tmp_path / "s2") as checkpointer:
            with pytest.raises(CheckpointCorruptError, match=rf"^checkpoint {url}/3 \(step 3\) is unusable: model/.*contents changed"):
                checkpointer.restore(3, target=target)
            assert checkpointer.set_aside(3, "contents changed") == f"{url}/3/{SET_ASIDE_MARKER}"
            assert checkpointer.restore(target=target).step == 2
            checkpointer.save(3, state)  # the marked objects are copied aside first
            assert checkpointer.all_steps() == [2, 3]
        assert [p.name.split("-")[0] for p in (bucket_dir / "set_aside").iterdir()] == ["3"]
    finally:
        server.stop()


def test_a_save_committed_locally_but_never_uploaded_is_uploaded_by_the_next_writer(s3, state, tmp_path):
    """A run killed after Orbax committed a step into the staging dir, before its upload (which
    runs at the next save or the close): the next writer of that URL uploads it."""
    state, mesh = state
    url = f"s3://{BUCKET}/run5"
    first = Checkpointer(url, keep_last=3, staging=tmp_path / "s")
    first.save(1, state)
    first.wait_until_finished()
    first.save(2, state)
    first._manager.wait_until_finished()  # step 2 committed locally ...
    first._manager.close()  # ... and the process dies before uploading it
    with Checkpointer(url, read_only=True, staging=tmp_path / "r") as reader:
        assert reader.all_steps() == [1]
    with Checkpointer(url, keep_last=3, staging=tmp_path / "s") as second:
        assert second.all_steps() == [1, 2]
        assert not [p for p in (tmp_path / "s").iterdir() if p.name.isdigit()]
        # The rerun resumes from it (it used to find its staged copy removed by the upload:
        # FileNotFoundError, issue 42 row 3).
        target = sharded_abstract_train_state(TINY, OPTIM, mesh, ShardingRules())
        assert second.restore(target=target).step == 2 and second.verify(2)


def test_a_prefix_belongs_to_one_run_dir_on_s3_and_gcs_and_a_store_refusing_writes_is_one_line(
    s3, state, tmp_path, monkeypatch
):
    """Issue 42: a second run dir on a claimed s3:// or gs:// prefix is refused before anything
    is written there (and a claim taken over mid-run stops the first run's next upload); a
    store that starts refusing writes (403) stops the save in one line naming the URL, the step
    staged; the next writer uploads it."""
    from olmo_eqx.checkpoint.paths import CheckpointDirOwnedError, claim_checkpoint_dir
    from olmo_eqx.checkpoint.storage import CheckpointSaveError
    from rangeserver import RangeServer

    state, mesh = state
    (tmp_path / "served" / "ckpts").mkdir(parents=True)
    server = RangeServer(tmp_path / "served")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    try:
        for url in (f"s3://{BUCKET}/owned", "gs://ckpts/owned"):
            assert claim_checkpoint_dir(url, run_a) is None
            assert claim_checkpoint_dir(url, run_a) is None  # its own run dir again: a resume
            with pytest.raises(CheckpointDirOwnedError, match=rf"^checkpoint.dir={url} belongs to the run dir {run_a} "
                                                              rf"\(its owner.json\), not {run_b}"):
                claim_checkpoint_dir(url, run_b)
        # Two runs started at once both saw no owner; the later claim won: the first stops at its upload.
        monkeypatch.setattr("olmo_eqx.checkpoint.remote._CLAIMED", {f"s3://{BUCKET}/owned": str(run_b)})
        with Checkpointer(f"s3://{BUCKET}/owned", async_save=False, staging=tmp_path / "s0") as checkpointer:
            with pytest.raises(CheckpointSaveError, match=rf"belongs to the run dir {run_a} \(its owner.json\), not {run_b}"):
                checkpointer.save(1, state)
            assert checkpointer.all_steps() == []

        url = "gs://ckpts/refused"
        with pytest.raises(CheckpointSaveError) as refused:
            with Checkpointer(url, keep_last=3, async_save=False, staging=tmp_path / "s1") as checkpointer:
                checkpointer.save(1, state)
                server.refuse_writes = True
                checkpointer.save(2, state)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"uploading checkpoint step 2 to {url}/2 failed: checkpoint "
                                                          f"store {url}: write of ") and "HTTP Error 403" in message
        server.refuse_writes = False
        with Checkpointer(url, keep_last=3, staging=tmp_path / "s1") as rerun:
            assert rerun.all_steps() == [1, 2] and rerun.verify(2)
    finally:
        server.refuse_writes = False
        server.stop()


def test_a_bucket_refusing_writes_mid_run_stops_it_in_one_line_and_the_rerun_resumes(s3, tmp_path, monkeypatch):
    """Issue 42 row 8 on S3: from step 6's upload on, moto answers every write with 403
    AccessDenied (its backend's put_object, which uploads, copies and multipart completions all
    go through), so boto3's upload_file raises S3UploadFailedError. The run stops with one line
    naming the step's URL (a RunError: status 2 at the command line), step 6 is not committed
    there but kept staged, and the rerun, the bucket writable again, uploads it and resumes from it."""
    from moto.s3.exceptions import S3AccessDeniedError
    from moto.s3.models import S3Backend

    from olmo_eqx.checkpoint.storage import CheckpointSaveError
    from olmo_eqx.config import compose_config
    from olmo_eqx.errors import RunError
    from olmo_eqx.train.loop import train

    from clihelp import TINY

    monkeypatch.setenv("OLMO_EQX_CHECKPOINT_STAGING", str(tmp_path / "staging"))
    url, prefix = f"s3://{BUCKET}/run8", "run8/"
    put, refused_keys = S3Backend.put_object, []

    def put_until_step_6(self, bucket_name, key_name, *args, **kwargs):
        if key_name.startswith(f"{prefix}6/") or refused_keys:  # the bucket turns read-only
            refused_keys.append(key_name)
            raise S3AccessDeniedError()
        return put(self, bucket_name, key_name, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "put_object", put_until_step_6)
    config = compose_config(TINY + [f"checkpoint.dir={url}", "trainer.eval_every=0"])
    with pytest.raises(CheckpointSaveError) as refused:
        train(config, tmp_path / "run")
    message = str(refused.value)
    assert isinstance(refused.value, RunError) and "\n" not in message, message
    assert message.startswith(f"uploading checkpoint step 6 to {url}/6 failed: checkpoint store {url}: upload of 6/"), message
    assert "S3UploadFailedError" in message and "AccessDenied" in message and "rerun to resume" in message
    assert refused_keys and not [k for k in keys(s3, prefix) if k.startswith("6/")]  # nothing of step 6 there

    monkeypatch.setattr(S3Backend, "put_object", put)
    summary = train(config, tmp_path / "run")
    assert summary["start_step"] == 6 and summary["stage_completed"]
    with Checkpointer(url, read_only=True, staging=tmp_path / "look") as reader:
        assert reader.all_steps() == [6, 12]


def test_a_host_lost_before_an_upload_the_rerun_elsewhere_resumes_from_the_bucket_naming_the_step_it_lacks(
    s3, tmp_path, monkeypatch, capsys
):
    """Issue 42 row 5: step 6 reached the bucket, then the host was lost once step 12 was
    committed in its staging dir, before its upload (emulated: the upload of step 12 never
    runs, nor anything after it). A rerun with another staging dir (another host) resumes from
    step 6 and says so, names step 12 and where it is staged, and that steps 7-12 are trained
    again; following its advice (the first staging dir) uploads step 12. The run dir's
    checkpoint_staged.json is what knows of step 12; it is gone once uploaded."""
    from olmo_eqx.checkpoint.remote import STAGED_RECORD, default_staging
    from olmo_eqx.config import compose_config
    from olmo_eqx.train.loop import train

    from clihelp import TINY

    url, run_dir = f"s3://{BUCKET}/run5e", tmp_path / "run"
    args = [*TINY, f"checkpoint.dir={url}", "trainer.eval_every=0"]
    upload = Checkpointer._upload

    class HostLost(BaseException):
        pass

    def upload_until_12(self, step):
        if step == 12:
            raise HostLost()
        return upload(self, step)

    monkeypatch.setenv("OLMO_EQX_CHECKPOINT_STAGING", str(tmp_path / "host_a"))
    monkeypatch.setattr(Checkpointer, "_upload", upload_until_12)
    with pytest.raises(HostLost):
        train(compose_config(args), run_dir)
    monkeypatch.setattr(Checkpointer, "_upload", upload)
    staged = default_staging(url) / "12"
    record = json.loads((run_dir / STAGED_RECORD).read_text())
    assert list(record) == ["12"] and record["12"]["path"] == str(staged) and (staged / "commit_success.txt").is_file()
    host = record["12"]["host"]
    with Checkpointer(url, read_only=True, staging=tmp_path / "look") as reader:
        assert reader.all_steps() == [6]

    monkeypatch.setenv("OLMO_EQX_CHECKPOINT_STAGING", str(tmp_path / "host_b"))
    capsys.readouterr()
    # stop_at=6: the resume and what it says are the point here, not training steps 7-12 again.
    assert train(compose_config([*args, "trainer.stop_at=6"]), run_dir)["start_step"] == 6
    said = capsys.readouterr().out.splitlines()
    assert f"Resuming from {url}/6 (step 6)" in said
    assert (f"checkpoint step 12 was saved in the staging dir {staged} on host {host} but never uploaded to {url}/12 "
            f"(the run stopped, or its upload failed): resuming from step 6. To resume from step 12 instead, stop this "
            f"run and rerun on {host} with OLMO_EQX_CHECKPOINT_STAGING={tmp_path / 'host_a'}, which uploads it first") in said
    assert (f"{run_dir / 'metrics.jsonl'} records steps up to 12, past the checkpoint resumed (step 6): steps 7-12 "
            "are trained again") in said

    # The advice: the run's writer on the first staging dir uploads step 12 before anything
    # else (a rerun then resumes from it: test_a_save_committed_locally_but_never_uploaded_...).
    with Checkpointer(url, staging=staged.parent, staged_record=run_dir / STAGED_RECORD) as rerun:
        assert rerun.all_steps() == [6, 12] and rerun.verify(12)
    assert not (run_dir / STAGED_RECORD).exists()
