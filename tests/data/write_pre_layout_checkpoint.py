"""Writes tests/data/pre_layout_checkpoint/: a tiny real checkpoint, saved by the code before the
package layout changed (issue 41), that tests/test_pre_layout_checkpoint.py restores with today's code.

    python tests/data/write_pre_layout_checkpoint.py   # at commit 4074dd5, on one CPU device

It trains a 4-layer, 16-wide OLMo 3 two steps (so the optimiser state is not its initial value),
saves step 2 with a loader state, a config, and a health record, and writes expected.json: the
SHA-256 of every array leaf's bytes, with shape and dtype, and the JSON items as saved.
"""

import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.data.sampler import LoaderState
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
from olmo_eqx.train.state import init_train_state
from olmo_eqx.train.step import make_train_step

OUT = Path(__file__).resolve().parent / "pre_layout_checkpoint"
MODEL = ModelConfig(
    name="pre_layout", d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=8, mlp_hidden=32,
    vocab_size=64, padded_vocab_size=64, sliding_window=8, max_sequence_length=64,
)
OPTIM = OptimConfig(lr=3e-3)
STEPS = 2
LOADER = LoaderState(seed=7, epoch=0, step=STEPS, instances_consumed=STEPS * 4, fingerprint="pre-layout")
CONFIG = {"optim": {"lr": OPTIM.lr}, "trainer": {"steps": 10}, "note": "written before issue 41's layout"}
HEALTH = {"last_good": STEPS}


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


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    mesh = make_mesh(MeshConfig())
    schedule = make_schedule(ScheduleConfig(name="cosine", warmup_steps=1), OPTIM.lr, 10)
    step_fn = make_train_step(OPTIM, schedule, mesh=mesh)
    state = init_train_state(MODEL, OPTIM, mesh, ShardingRules(), jax.random.key(0))
    for step in range(STEPS):
        ids = jax.random.randint(jax.random.key(100 + step), (4, 16), 0, MODEL.vocab_size, dtype=jnp.int32)
        state, _ = step_fn(state, {"input_ids": ids, "loss_mask": jnp.ones((4, 16))})
    with Checkpointer(OUT / "checkpoints", async_save=False) as checkpointer:
        checkpointer.save(STEPS, state, loader_state=LOADER, config=CONFIG, health=HEALTH)
    expected = {
        "step": STEPS, "loader": LOADER.to_dict(), "config": CONFIG, "health": HEALTH,
        "model": leaf_digests(state.model),
        "opt_state": leaf_digests(state.opt_state),
        "train": leaf_digests({"step": state.step, "loss_history": state.loss_history,
                               "grad_norm_history": state.grad_norm_history}),
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
