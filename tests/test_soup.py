"""The soup stage: the average of identical checkpoints is the checkpoint, of two different ones
their (weighted) mean; models must match; it runs on any mesh restoring one checkpoint at a time."""

import json
import re

import equinox as eqx
import jax
import numpy as np
import pytest

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.checkpoint.paths import resolve_checkpoint
from olmo_eqx.config import ConfigError, compose_config, stage_settings
from olmo_eqx.sharding import ShardingRules, make_mesh
from olmo_eqx.stages import StageError, load_stage
from olmo_eqx.train.state import init_train_state, sharded_abstract_train_state

from clihelp import olmo_eqx, xla_flags

NANO = ["model=olmo3_nano"]


def save_random_checkpoint(directory, seed, overrides=()):
    """A freshly initialised nano state saved as step 3 (as a run's checkpoints dir)."""
    config = compose_config(["+stage=pretrain", *NANO, *overrides])
    mesh = make_mesh(config.mesh)
    state = init_train_state(config.model, config.optim, mesh, ShardingRules(), jax.random.key(seed))
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(3, state, config={})
    return jax.tree.map(np.asarray, state.model)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    return {name: (root / name, save_random_checkpoint(root / name, seed)) for name, seed in (("a", 1), ("b", 2))}


def soup(paths, run_dir, overrides=()):
    listed = ",".join(str(p) for p in paths)
    summary = load_stage("soup").run(compose_config(["+stage=soup", f"stage.checkpoints=[{listed}]", *overrides]), run_dir)
    return summary, read_soup(run_dir)


def read_soup(run_dir):
    location = resolve_checkpoint(run_dir)  # the soup is a checkpoint like any other
    assert location.step == 0
    with Checkpointer(location.directory, read_only=True) as checkpointer:
        config = checkpointer.stored_model_config()
        state = checkpointer.restore(target=sharded_abstract_train_state(config, compose_config().optim, make_mesh()))
    return state.state


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_soup_of_identical_checkpoints_is_the_checkpoint(checkpoints, tmp_path):
    path, model = checkpoints["a"]
    summary, state = soup([path, path / "3"], tmp_path)  # a checkpoints dir and its step dir
    assert summary["weights"] == [0.5, 0.5]
    for got, want in zip(leaves(state.model), leaves(model)):
        assert np.array_equal(got, want)
    # Saved with a fresh optimiser: step 0, zero moments.
    assert int(state.step) == 0 and not any(np.any(x) for x in leaves(state.opt_state) if x.ndim)


def test_soup_of_two_checkpoints_is_their_mean(checkpoints, tmp_path):
    (path_a, a), (path_b, b) = checkpoints["a"], checkpoints["b"]
    _, state = soup([path_a, path_b], tmp_path / "uniform")
    for got, x, y in zip(leaves(state.model), leaves(a), leaves(b)):
        assert np.array_equal(got, (x + y) / np.float32(2))
    _, state = soup([path_a, path_b], tmp_path / "weighted", ["stage.weights=[3,1]"])
    for got, x, y in zip(leaves(state.model), leaves(a), leaves(b)):
        np.testing.assert_allclose(got, (3 * x + y) / 4, rtol=1e-6, atol=1e-7)


def test_soup_restores_one_checkpoint_at_a_time(checkpoints, tmp_path, monkeypatch):
    """Device memory while averaging: the running sum plus the one model just restored."""
    model_bytes = sum(x.nbytes for x in leaves(checkpoints["a"][1]))
    baseline = sum(x.nbytes for x in jax.live_arrays())
    peaks = []
    restore_model = Checkpointer.restore_model

    def recording(self, *args, **kwargs):
        model = restore_model(self, *args, **kwargs)
        peaks.append(sum(x.nbytes for x in jax.live_arrays()) - baseline)
        return model

    monkeypatch.setattr(Checkpointer, "restore_model", recording)
    path_a, path_b = checkpoints["a"][0], checkpoints["b"][0]
    soup([path_a, path_b, path_a, path_b], tmp_path)
    assert len(peaks) == 4
    assert max(peaks) <= 2 * model_bytes * 1.01, (peaks, model_bytes)  # float32 params: sum + one model


def test_soup_on_another_mesh_from_the_command_line(checkpoints, tmp_path):
    (path_a, a), (path_b, b) = checkpoints["a"], checkpoints["b"]
    result = olmo_eqx(
        "+stage=soup",
        f"stage.checkpoints=[{path_a},{path_b}]",
        "mesh=data_parallel",
        f"hydra.run.dir={tmp_path}",
        env={"XLA_FLAGS": xla_flags(2)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "'data': 2" in result.stdout and "0.5000 x" in result.stdout
    assert re.match(r"^cluster: local( \(TPU_WORKER_HOSTNAMES lists one host\))?, 1 process x 2 cpu devices, mesh slice=1 data=2 fsdp=1 ", (tmp_path / "soup.log").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["checkpoint"] == str(tmp_path / "checkpoints" / "0")
    state = read_soup(tmp_path)  # written on 2 devices, read here on 8
    for got, x, y in zip(leaves(state.model), leaves(a), leaves(b)):
        assert np.array_equal(got, (x + y) / np.float32(2))


def test_soup_refuses_different_models_and_bad_settings(checkpoints, tmp_path):
    other = tmp_path / "wide"
    save_random_checkpoint(other, 3, ["model.d_model=96"])
    with pytest.raises(StageError, match="different models cannot be averaged.*d_model"):
        soup([checkpoints["a"][0], other], tmp_path / "mixed")
    with pytest.raises(StageError, match="stage.checkpoints=\\[PATH"):
        load_stage("soup").run(compose_config(["+stage=soup"]), tmp_path / "none")
    with pytest.raises(ConfigError, match="one weight each"):
        stage_settings(load_stage("soup"), "soup", {"checkpoints": [str(checkpoints["a"][0])], "weights": [1, 2]})
    with pytest.raises(StageError, match=r"stage.checkpoints\[1\]: .*does not exist"):
        soup([checkpoints["a"][0], tmp_path / "missing"], tmp_path / "missing_input")
    soup([checkpoints["a"][0]], tmp_path / "once")
    with pytest.raises(StageError, match="already holds a checkpoint"):
        soup([checkpoints["a"][0]], tmp_path / "once")


def test_soup_refuses_non_finite_weights_and_a_non_finite_average_writing_nothing(checkpoints, tmp_path):
    path = str(checkpoints["a"][0])
    for weights, said in (([float("inf"), 1.0], "must be finite"), ([1e308, 1e308], "sum past the largest float")):
        with pytest.raises(ConfigError, match=said):
            stage_settings(load_stage("soup"), "soup", {"checkpoints": [path, path], "weights": weights})
    # Large weights whose sum still fits are normalised in float64 (float32 would overflow).
    settings = stage_settings(load_stage("soup"), "soup", {"checkpoints": [path, path], "weights": [1e300, 3e300]})
    assert settings.normalised_weights() == (0.25, 0.75)

    # A checkpoint holding a nan: refused, naming the parameter, with no checkpoint written.
    config = compose_config(["+stage=pretrain", *NANO])
    state = init_train_state(config.model, config.optim, make_mesh(config.mesh), ShardingRules(), jax.random.key(4))
    flat, tree = jax.tree_util.tree_flatten(state.model)
    index = next(i for i, x in enumerate(flat) if np.issubdtype(x.dtype, np.floating))
    flat[index] = flat[index].at[(0,) * flat[index].ndim].set(np.nan)
    state = eqx.tree_at(lambda s: s.model, state, jax.tree_util.tree_unflatten(tree, flat))
    with Checkpointer(tmp_path / "nan") as checkpointer:
        checkpointer.save(3, state, config={})
    with pytest.raises(StageError, match=r"not finite \(nan or inf\) in model\..*nothing was written"):
        soup([checkpoints["a"][0], tmp_path / "nan"], tmp_path / "soup")
    assert not (tmp_path / "soup" / "checkpoints").exists() and not (tmp_path / "soup" / "summary.json").exists()
