"""Issue 50, "signals and secrets": what the environment gives a run is used, never recorded or
printed in the clear, and a URL with a password in it is refused without repeating it."""

import json
import os

import pytest
from clihelp import TINY, olmo_eqx

from olmo_eqx.config import ConfigError, compose_config, config_to_dict, hide_secrets
from olmo_eqx.data.remote import RemoteFileError, RemoteReader
from olmo_eqx.data.stores import RetryPolicy

SECRET = "s3cr3t-Ab9Zk2Lq"


def test_a_setting_from_the_environment_is_recorded_as_its_interpolation(tmp_path, monkeypatch):
    from olmo_eqx.checkpoint import Checkpointer  # noqa: F401  (the same module the loop saves with)
    from olmo_eqx.train.loop import train

    checkpoints = tmp_path / f"ckpt-{SECRET}"
    monkeypatch.setenv("OLMO_EQX_TEST_SECRET_DIR", str(checkpoints))
    overrides = TINY + ["trainer.steps=2", "checkpoint.every=2", "trainer.eval_every=0", "schedule.warmup_steps=1",
                        "checkpoint.dir=${oc.env:OLMO_EQX_TEST_SECRET_DIR}"]
    config = compose_config(overrides)
    assert config.checkpoint.dir == str(checkpoints)  # the run uses the value
    assert config_to_dict(config)["checkpoint"]["dir"] == "${oc.env:OLMO_EQX_TEST_SECRET_DIR}"
    run_dir = tmp_path / "run"
    train(config, run_dir)
    written = {p: p.read_text(errors="replace") for p in [*run_dir.rglob("*"), *checkpoints.rglob("*")]
               if p.is_file() and p.suffix in (".json", ".log", ".jsonl", "") and p.stat().st_size < 1 << 20}
    assert json.loads((run_dir / "config.json").read_text())["checkpoint"]["dir"] == "${oc.env:OLMO_EQX_TEST_SECRET_DIR}"
    stored = [p for p in written if p.parent.name == "config"]
    assert stored, "the checkpoint's own config was not found"
    assert all("${oc.env:OLMO_EQX_TEST_SECRET_DIR}" in written[p] for p in stored)
    leaked = [str(p) for p, text in written.items() if SECRET in text]
    assert not leaked, f"the secret is written in the clear in {leaked}"
    # A resume compares what the checkpoint recorded with this run's config: the same interpolation.
    summary = train(compose_config(overrides), run_dir)
    assert summary["start_step"] == 2


def test_secret_values_are_hidden_in_messages(monkeypatch):
    monkeypatch.setenv("OLMO_EQX_TEST_SECRET", SECRET)
    compose_config(["+stage=pretrain", "checkpoint.load=${oc.env:OLMO_EQX_TEST_SECRET}"])
    assert hide_secrets(f"checkpoint.load={SECRET} does not exist") == "checkpoint.load=*** does not exist"


def test_a_url_with_a_password_is_refused_without_repeating_it():
    with pytest.raises(ConfigError) as refused:
        compose_config(["data.source=http://alice:hunter22@127.0.0.1:9/tokens.npy"])
    assert "hunter22" not in str(refused.value) and "alice" not in str(refused.value)
    assert "data.source=http://***@127.0.0.1:9/tokens.npy" in str(refused.value)
    # A URL that reaches the reader another way (a mix manifest's root) is refused before any
    # request: never retried as an unreachable server.
    reader = RemoteReader(RetryPolicy(attempts=8))
    with pytest.raises(RemoteFileError) as refused:
        reader.size("https://alice:hunter22@127.0.0.1:9/tokens.npy")
    assert "hunter22" not in str(refused.value) and "unreachable" not in str(refused.value)
    assert reader.stats["data_requests"] == 0 and reader.stats["data_retries"] == 0


def test_a_stage_without_its_plus_gets_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"^stage=pretrain: .*\(did you mean \+stage=pretrain\?\)$"):
        compose_config(["stage=pretrain"])
    result = olmo_eqx("stage=pretrain", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("error: stage=pretrain: stage is not in the defaults list, so it is selected "
                                     "with a + (did you mean +stage=pretrain?)")
    assert not (tmp_path / "run").exists()
