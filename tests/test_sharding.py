"""Mesh, logical-axis rules, train-state layout and the multi-process bootstrap."""

import sys
import textwrap

import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.base import LogicalAxes
from olmo_eqx.sharding import (
    MeshConfig,
    ShardingRules,
    batch_sharding,
    make_mesh,
    model_shardings,
    spec_for,
    train_state_shardings,
)
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.state import abstract_train_state

from localcluster import launch_local_cluster

TINY = ModelConfig(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    vocab_size=256, padded_vocab_size=256, sliding_window=16,
)


def test_mesh_shapes_and_axis_types():
    mesh = make_mesh(MeshConfig())
    assert dict(mesh.shape) == {"slice": 1, "data": 1, "fsdp": 8, "context": 1, "tensor": 1, "expert": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 6  # not jax 0.10's Explicit default
    assert dict(make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2)).shape) == {
        "slice": 1, "data": 2, "fsdp": 2, "context": 1, "tensor": 2, "expert": 1
    }
    assert make_mesh(MeshConfig(fsdp=2, expert=4)).shape["expert"] == 4
    assert make_mesh(MeshConfig(), jax.devices()[:4]).size == 4
    for bad in (MeshConfig(data=3), MeshConfig(data=-1, fsdp=-1), MeshConfig(fsdp=2, tensor=2)):
        with pytest.raises(ValueError, match="mesh"):
            make_mesh(bad)


def test_spec_replicates_what_the_mesh_does_not_divide():
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    rules = ShardingRules()
    assert spec_for(LogicalAxes(("embed", "mlp")), (64, 128), mesh, rules) == P("fsdp", "tensor")
    assert spec_for(LogicalAxes(("embed", "mlp")), (6, 128), mesh, rules) == P(None, "tensor")
    assert spec_for(LogicalAxes(("layers", "kv_heads", "embed")), (4, 3, 64), mesh, rules) == P(None, None, "fsdp")
    assert spec_for(LogicalAxes(("norm",)), (64,), mesh, rules) == P(None)
    # A mesh axis can shard one dimension of an array only.
    fsdp_everywhere = ShardingRules(mlp="fsdp")
    assert spec_for(LogicalAxes(("embed", "mlp")), (64, 128), mesh, fsdp_everywhere) == P("fsdp", None)
    # A later dimension keeps the rest of its mesh axes: an expert weight's model dimension
    # (embed: fsdp, expert) keeps fsdp once its expert dimension took "expert".
    ep = make_mesh(MeshConfig(fsdp=2, expert=4))
    assert spec_for(LogicalAxes(("expert", "embed", "mlp")), (8, 64, 32), ep, rules) == P("expert", "fsdp", None)
    assert spec_for(LogicalAxes(("embed", "mlp")), (64, 32), ep, rules) == P(("fsdp", "expert"), None)
    with pytest.raises(ValueError, match="no entry for logical axis"):
        spec_for(LogicalAxes(("experts",)), (8,), mesh, rules)


def test_pure_fsdp_and_tensor_parallel_layouts():
    state = abstract_train_state(TINY, OptimConfig())
    fsdp = train_state_shardings(state, make_mesh(MeshConfig()), ShardingRules())
    assert fsdp.model.blocks.mlp.up_proj.spec == P(None, "fsdp", None)
    assert fsdp.model.embed.spec == P(None, "fsdp")
    assert fsdp.model.final_norm.weight.spec == P(None)
    tp = model_shardings(state.model, make_mesh(MeshConfig(fsdp=4, tensor=2)), ShardingRules())
    assert tp.blocks.attention.q_proj.spec == P(None, "fsdp", "tensor")
    assert tp.blocks.attention.o_proj.spec == P(None, "tensor", "fsdp")
    assert tp.lm_head.spec == P("fsdp", "tensor")


def test_optimizer_moments_follow_their_parameters():
    state = abstract_train_state(TINY, OptimConfig())
    shardings = train_state_shardings(state, make_mesh(MeshConfig(fsdp=4, tensor=2)), ShardingRules())
    adam = shardings.opt_state[1]  # (clip, adam, decay)
    assert adam.mu == shardings.model and adam.nu == shardings.model
    assert adam.count.spec == P() and shardings.step.spec == P() and shardings.loss_history.spec == P()
    assert jax.tree.structure(shardings) == jax.tree.structure(state)


def test_rules_name_real_mesh_axes():
    assert hash(ShardingRules(embed=None)) != hash(ShardingRules())  # hashable: keys jit caches
    with pytest.raises(ValueError, match="mesh axes are"):
        ShardingRules(embed="model")


def test_batch_sharding():
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1))
    assert batch_sharding(mesh).spec == P(("slice", "data", "fsdp", "expert"), None)


TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import jax
    from olmo_eqx.infra.cluster import start_cluster
    from olmo_eqx.sharding import MeshConfig, make_mesh
    assert start_cluster().kind == "jax" and start_cluster() is start_cluster()  # later calls: the same, no-op
    mesh = make_mesh(MeshConfig())
    print("OK", jax.process_index(), jax.process_count(), mesh.size, flush=True)
    """
)


def test_two_processes_from_launcher_env():
    procs = launch_local_cluster([sys.executable, "-c", TWO_PROCESS_SCRIPT])
    outputs = [p.communicate(timeout=120) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, err[-3000:]
        assert f"OK {i} 2 4" in out  # 2 processes x 2 devices in one global mesh
