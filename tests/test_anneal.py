"""Stage 2 (anneal): starts from a pretrain checkpoint saved on another device count, keeps or
resets the optimiser, decays the LR linearly to exactly 0 at its last step, resumes its own
checkpoints first; and the forgiving checkpoint paths it (and soup) accept."""

import json

import jax
import numpy as np
import pytest

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.checkpoint.paths import CheckpointNotFoundError, resolve_checkpoint
from olmo_eqx.config import compose_config
from olmo_eqx.interop.hf import save_hf
from olmo_eqx.models.config import YarnConfig
from olmo_eqx.sharding import ShardingRules, make_mesh
from olmo_eqx.stages import StageError, load_stage
from olmo_eqx.train.loop import train
from olmo_eqx.train.state import sharded_abstract_train_state
from olmo_eqx.warm_start import load_model, locate, stored_model_config

from clihelp import TINY, olmo_eqx, xla_flags
from test_pretrain import read_metrics

# The anneal counterpart of TINY (nano model, short sequences), 5 steps with its own batch.
ANNEAL = [
    "+stage=anneal",
    "model=olmo3_nano",
    "data.sequence_length=64",
    "data.global_batch_size=16",
    "trainer.steps=5",
    "trainer.log_every=1",
    "trainer.eval_every=5",
    "trainer.eval_batches=1",
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """An 8-step pretrain of the nano model on the tests' 8 fake devices (checkpoints 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("pretrain")
    train(compose_config(TINY + ["trainer.steps=8", "checkpoint.every=4", "trainer.eval_every=8"]), run_dir)
    return run_dir


def anneal(overrides, run_dir):
    """Run the anneal stage in this process (8 devices), as `python -m olmo_eqx` would."""
    return load_stage("anneal").run(compose_config(ANNEAL + overrides), run_dir)


def test_anneal_cli_on_one_device_from_an_8_device_checkpoint(pretrained, tmp_path):
    run_dir = tmp_path / "anneal"
    result = olmo_eqx(
        *ANNEAL,
        f"checkpoint.load={pretrained}",  # a run dir: its latest checkpoint (step 8)
        f"hydra.run.dir={run_dir}",
        env={"XLA_FLAGS": xla_flags(1)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 cpu device(s)" in result.stdout
    assert f"starting from {pretrained / 'checkpoints' / '8'} (weights and optimiser state)" in result.stdout
    metrics = read_metrics(run_dir)
    lrs = [metrics[s]["lr"] for s in range(1, 6)]
    # Its own LR, no warmup, as OLMo-core's LinearWithWarmup(warmup=0) stepped by its trainer
    # (steps count from 1): the first of 5 updates is already a fifth of the way down.
    assert lrs[0] == pytest.approx(2.0712e-4 * 4 / 5, rel=1e-6)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # linear decay ...
    assert lrs[-1] == 0.0  # ... to exactly 0 at the last step
    assert np.allclose(np.diff(lrs), -2.0712e-4 / 5, rtol=1e-4)
    # It started from the trained weights, not from scratch (~ln 4096 = 8.3).
    reference = read_metrics(pretrained)
    assert abs(metrics[1]["loss"] - reference[8]["loss"]) < abs(metrics[1]["loss"] - reference[1]["loss"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stage_completed"] and summary["start_step"] == 0 and summary["end_step"] == 5
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["seed"] == 1337 and config["data"]["global_batch_size"] == 16
    assert config["schedule"]["name"] == "linear" and config["schedule"]["warmup_steps"] == 0
    assert (run_dir / "checkpoints" / "5" / "commit_success.txt").exists()

    # Its own checkpoint wins over checkpoint.load: resume the 1-device run on 8 devices (two
    # steps longer: a change a resume makes only when asked for by name).
    summary = anneal([f"checkpoint.load={pretrained}", "trainer.steps=7", "checkpoint.accept_changes=[trainer.steps]"],
                     run_dir)
    assert summary["start_step"] == 5 and summary["end_step"] == 7
    assert read_metrics(run_dir)[7]["lr"] == 0.0


def _initial_state(pretrained, overrides):
    """The state the anneal would start from (what the loop's init_state hook returns)."""
    from olmo_eqx.warm_start import source as warm_start_source
    from olmo_eqx_plugins.anneal import AnnealSettings

    config = compose_config(ANNEAL + [f"checkpoint.load={pretrained}"] + overrides)
    settings = AnnealSettings(**config.stage)
    source = warm_start_source("anneal", config, settings.optimizer)
    mesh, rules = make_mesh(config.mesh), ShardingRules()
    return source.init_state(config, mesh, rules), config, mesh, rules


def test_keep_or_reset_the_optimiser(pretrained):
    kept, config, mesh, rules = _initial_state(pretrained / "checkpoints", ["stage.optimizer=keep"])
    with Checkpointer(pretrained / "checkpoints", read_only=True) as checkpointer:
        saved = checkpointer.restore(8, target=sharded_abstract_train_state(config.model, config.optim, mesh, rules)).state
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    assert same(kept.model, saved.model) and same(kept.opt_state, saved.opt_state)
    # The anneal counts its own steps, with fresh skip-step statistics.
    assert int(kept.step) == 0 and int(kept.history_count) == 0 and not np.any(kept.loss_history)
    assert kept.model.embed.sharding == saved.model.embed.sharding

    reset, *_ = _initial_state(pretrained / "checkpoints" / "8", ["stage.optimizer=reset"])  # a step dir
    assert same(reset.model, saved.model)
    moments = [x for x in jax.tree.leaves(reset.opt_state) if x.ndim > 0]
    assert moments and not any(np.any(x) for x in moments)


def test_from_hf_weights(pretrained, tmp_path):
    with Checkpointer(pretrained / "checkpoints", read_only=True) as checkpointer:
        from olmo_eqx.models.registry import abstract_model

        model = checkpointer.restore_model(target=abstract_model(checkpointer.stored_model_config()))
    save_hf(model, tmp_path / "hf")
    state, config, *_ = _initial_state(tmp_path / "hf", [])  # auto: HF has no optimiser state
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(model)):
        assert np.array_equal(a, b)
    assert int(state.step) == 0
    with pytest.raises(StageError, match="no optimiser state.*stage.optimizer=reset"):
        _initial_state(tmp_path / "hf", ["stage.optimizer=keep"])
    # Read as a continuing config (stage 3: YaRN, a longer context), HF weights keep those fields.
    hf = locate(tmp_path / "hf")
    longer = stored_model_config(hf).replace(yarn=YarnConfig(original_max_position_embeddings=64), max_sequence_length=256)
    assert load_model(hf, make_mesh(config.mesh), model_config=longer).config == longer


def test_checkpoint_paths_are_forgiving(pretrained, tmp_path):
    expected = resolve_checkpoint(pretrained / "checkpoints" / "8")
    assert expected.kind == "olmo_eqx" and expected.step == 8
    assert resolve_checkpoint(pretrained) == expected
    assert resolve_checkpoint(pretrained / "checkpoints") == expected
    assert resolve_checkpoint(pretrained / "checkpoints" / "4").step == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint.*run dir, its checkpoints dir"):
        resolve_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(StageError, match="checkpoint.load=PATH"):
        anneal([], tmp_path / "no_load")
    with pytest.raises(StageError, match="checkpoint.load: no complete checkpoint"):
        anneal([f"checkpoint.load={tmp_path / 'empty'}"], tmp_path / "bad_load")


def test_long_context_from_a_checkpoint_with_context_parallelism(pretrained, tmp_path, capsys):
    """Stage 3 on the 8 test devices split fsdp 4 x context 2: YaRN from the source's sequence
    length, 4x the sequence, document masking, the optimiser kept, LR warmup then exactly 0."""
    overrides = [
        "+stage=long_context", "model=olmo3_nano", f"checkpoint.load={pretrained}",
        "data.sequence_length=256", "data.global_batch_size=4", "mesh.fsdp=4", "mesh.context=2",
        "trainer.steps=3", "schedule.warmup_steps=1", "trainer.log_every=1", "trainer.eval_every=3", "trainer.eval_batches=1",
    ]
    config = compose_config(overrides)
    assert config.data.document_masking and config.optim.lr == 2.07e-4
    summary = load_stage("long_context").run(config, tmp_path)
    out = capsys.readouterr().out
    assert "(weights and optimiser state)" in out and "mesh {'slice': 1, 'data': 1, 'fsdp': 4, 'context': 2, 'tensor': 1, 'expert': 1}" in out
    assert "held-out loss at sequence length 256" in out
    assert "held-out loss at sequence length 256" in (tmp_path / "train.log").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["heldout_loss_before"] == summary["heldout_loss_before"]
    assert np.isfinite(summary["heldout_loss_before"]) and np.isfinite(summary["final_heldout_loss"])
    # metrics.jsonl holds it too, as the held-out record of the stage's first step (loss.png's first point).
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    before = [r for r in records if r.get("before_stage")]
    assert len(before) == 1 and before[0]["step"] == 0 and before[0]["heldout_loss"] == summary["heldout_loss_before"]
    assert set(before[0]["heldout"]) == set(next(r for r in records if "heldout" in r and r["step"] == 3)["heldout"])
    with Checkpointer(tmp_path / "checkpoints", keep_last=None, read_only=True) as checkpointer:
        model = checkpointer.stored_model_config()
    assert model.yarn.factor == 8.0 and model.yarn.original_max_position_embeddings == 64  # the pretrain's sequence
    assert model.max_sequence_length >= 256
    lrs = [m["lr"] for _, m in sorted(read_metrics(tmp_path).items())]
    assert lrs[-1] == 0.0 and max(lrs) == pytest.approx(2.07e-4)
