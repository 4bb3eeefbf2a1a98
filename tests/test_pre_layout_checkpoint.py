"""A checkpoint written before the package layout changed (issue 41) restores with today's code:
every weight, every optimiser leaf, the step, the skip-step statistics, the data position, the
config and the health record, bit for bit (tests/data/README.md says how it was written)."""

import importlib.util
import json
import shutil
from pathlib import Path

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.data.sampler import LoaderState
from olmo_eqx.sharding import MeshConfig, make_mesh
from olmo_eqx.train.state import sharded_abstract_train_state

TEST_DATA = Path(__file__).resolve().parent / "data"
DATA = TEST_DATA / "pre_layout_checkpoint"


def _writer():
    """The script that wrote the checkpoint: its model, optimiser and leaf digests, not copies."""
    spec = importlib.util.spec_from_file_location("write_pre_layout_checkpoint", TEST_DATA / "write_pre_layout_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WRITER = _writer()
MODEL, OPTIM, leaf_digests = WRITER.MODEL, WRITER.OPTIM, WRITER.leaf_digests


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
