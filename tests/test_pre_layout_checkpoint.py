"""A checkpoint written before the package layout changed (issue 41) restores with today's code:
every weight, every optimiser leaf, the step, the skip-step statistics, the data position, the
config and the health record, bit for bit (tests/data/README.md says how it was written)."""

import hashlib
import json
import shutil
from pathlib import Path

import jax
import numpy as np

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.data.sampler import LoaderState
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.sharding import MeshConfig, make_mesh
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.state import sharded_abstract_train_state

DATA = Path(__file__).resolve().parent / "data" / "pre_layout_checkpoint"
MODEL = ModelConfig(
    name="pre_layout", d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=8, mlp_hidden=32,
    vocab_size=64, padded_vocab_size=64, sliding_window=8, max_sequence_length=64,
)
OPTIM = OptimConfig(lr=3e-3)


def leaf_digests(tree) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            continue
        array = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = {
            "shape": list(array.shape), "dtype": str(array.dtype),
            "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest(),
        }
    return out


def test_checkpoint_written_before_the_layout_change_restores(tmp_path):
    expected = json.loads((DATA / "expected.json").read_text())
    shutil.copytree(DATA / "checkpoints", tmp_path / "checkpoints")
    with Checkpointer(tmp_path / "checkpoints", read_only=True) as checkpointer:
        assert checkpointer.all_steps() == [expected["step"]]
        assert checkpointer.verify(expected["step"])  # its digests.json still matches every file
        assert checkpointer.stored_model_config() == MODEL
        # Onto the suite's 8 devices (it was written on one): restores go through the new shardings.
        target = sharded_abstract_train_state(MODEL, OPTIM, make_mesh(MeshConfig()))
        restored = checkpointer.restore(target=target)
    state = restored.state
    assert restored.step == expected["step"] and int(state.step) == expected["step"]
    assert leaf_digests(state.model) == expected["model"]
    assert leaf_digests(state.opt_state) == expected["opt_state"]
    train = {"step": state.step, "loss_history": state.loss_history, "grad_norm_history": state.grad_norm_history}
    assert leaf_digests(train) == expected["train"]
    assert restored.loader_state == expected["loader"]
    assert LoaderState.from_dict(restored.loader_state).step == expected["step"]
    assert restored.config == expected["config"]
    assert restored.health == expected["health"]
    assert restored.model_config == MODEL
