"""Expert parallelism (olmoe.py `expert_parallel`): 8 fake devices, experts split 4 ways and
FSDP 2 ways, give the single-device train step (float32): loss, router terms, every gradient,
the updated parameters. The compiled program really exchanges tokens by all-to-all, and each
device really holds a quarter of the experts."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from olmo_eqx import with_config
from olmo_eqx.batch import TokenBatch
from olmo_eqx.models.base import AUX_OBJECTIVE, unconstrained
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.olmoe import expert_parallel_axis
from olmo_eqx.sharding import ActivationSharding, MeshConfig, ShardingRules, batch_sharding, make_mesh
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
from olmo_eqx.train.state import init_train_state
from olmo_eqx.train.step import make_train_step, model_loss_sums_and_aux

CONFIG = ModelConfig(
    name="olmoe_ep_test", architecture="olmoe", vocab_size=256, padded_vocab_size=256, d_model=64, n_layers=2,
    n_heads=4, n_kv_heads=4, head_dim=16, mlp_hidden=32, n_experts=8, n_experts_per_token=2, sliding_window=None,
    rope_theta=10_000.0, init_std=0.1, scan_layers=True,  # routing far from uniform; layers scanned as at scale
)
OPTIM = OptimConfig(lr=1e-3)
SCHEDULE = make_schedule(ScheduleConfig(name="constant"), OPTIM.lr, 10)
BATCH, SEQ = 8, 16
EP = MeshConfig(fsdp=2, expert=4)


def make_batch(mesh) -> TokenBatch:
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, CONFIG.vocab_size, dtype=jnp.int32)
    mask = jnp.ones((BATCH, SEQ), jnp.float32).at[:2, :3].set(0.0)
    put = lambda x: jax.device_put(x, batch_sharding(mesh))  # noqa: E731
    return TokenBatch(put(ids), put(mask), None, None)


def fresh_state(mesh):
    return init_train_state(CONFIG, OPTIM, mesh, ShardingRules(), jax.random.key(0))


def compiled_grads(model, batch, constrain):
    """(objective, aux terms, gradients) and the compiled program's HLO text."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def value_and_grads(params, batch):
        def objective(params):
            sums, aux = model_loss_sums_and_aux(eqx.combine(params, static), batch, constrain)
            return sums.ce / sums.count + aux[AUX_OBJECTIVE], aux

        return jax.value_and_grad(objective, has_aux=True)(params)

    compiled = jax.jit(value_and_grads).lower(params, batch).compile()
    (value, aux), grads = compiled(params, batch)
    return (value, aux, grads), compiled.as_text()


@pytest.fixture(scope="module")
def meshes():
    return make_mesh(MeshConfig(), jax.devices()[:1]), make_mesh(EP)


@pytest.fixture(scope="module")
def grads(meshes):
    """Single device (plain dropless path) and expert-parallel: results and HLO of each."""
    one, ep = meshes
    single, single_hlo = compiled_grads(fresh_state(one).model, make_batch(one), unconstrained)
    split, split_hlo = compiled_grads(fresh_state(ep).model, make_batch(ep), ActivationSharding(ep))
    return single, single_hlo, split, split_hlo


def exchanges(hlo: str, op: str, jax_name: str) -> int:
    """HLO collectives `op` that jax's `lax.<jax_name>` (the MoE's, inside shard_map) emitted."""
    return sum(1 for line in hlo.splitlines() if op in line and "shard_map" in line and jax_name in line)


def assert_close_leaves(actual, expected, rtol):
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), jax.tree_util.keystr(path[0])


def test_only_an_expert_axis_of_size_above_one_splits_experts(meshes):
    one, ep = meshes
    assert expert_parallel_axis(unconstrained, 8) is None
    assert expert_parallel_axis(ActivationSharding(one), 8) is None
    assert expert_parallel_axis(ActivationSharding(make_mesh(MeshConfig())), 8) is None  # fsdp 8, expert 1
    assert expert_parallel_axis(ActivationSharding(ep), 8) == "expert"
    with pytest.raises(ValueError, match="not divisible by mesh.expert=4"):
        expert_parallel_axis(ActivationSharding(ep), 6)


def test_expert_parallel_gradients_equal_one_device(grads):
    (value1, aux1, grads1), _, (value8, aux8, grads8), _ = grads
    np.testing.assert_allclose(value8, value1, rtol=1e-6)
    for name in aux1:
        np.testing.assert_allclose(aux8[name], aux1[name], rtol=1e-6, err_msg=name)
    assert_close_leaves(grads8, grads1, 1e-5)


def test_all_gather_exchange_equals_one_device(grads, meshes):
    """`moe_exchange: all_gather`: the group's tokens gathered, results reduce-scattered."""
    (value1, aux1, grads1), _, _, _ = grads
    _, ep = meshes
    model = with_config(fresh_state(ep).model, moe_exchange="all_gather")
    (value8, aux8, grads8), hlo = compiled_grads(model, make_batch(ep), ActivationSharding(ep))
    np.testing.assert_allclose(value8, value1, rtol=1e-6)
    assert_close_leaves(grads8, grads1, 1e-5)
    assert exchanges(hlo, "all-to-all(", "all_to_all") == 0
    # Per scanned layer: the forward reduce-scatter, and the backward ones of x and the weights.
    assert exchanges(hlo, "reduce-scatter(", "reduce_scatter") >= 3 and exchanges(hlo, "all-gather(", "all_gather") >= 2


def test_compiled_program_exchanges_tokens_all_to_all(grads):
    _, single_hlo, _, split_hlo = grads
    assert "all-to-all" not in single_hlo  # one device: today's plain path
    # Forward: tokens out and results back per layer; backward: the same two transposed.
    # (GSPMD adds an all-to-all of its own for the embedding lookup: counted apart.)
    assert exchanges(split_hlo, "all-to-all(", "all_to_all") >= 4


def test_expert_weights_are_split_over_devices(meshes):
    _, ep = meshes
    model = fresh_state(ep).model
    gate = model.blocks.moe.experts.gate_proj  # [layers, experts, d_model, hidden]
    assert gate.sharding.spec == P(None, "expert", "fsdp", None)
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 2, 32, 32)}  # 2 of 8 experts, half of d_model
    # Every weight but the norms is split 8 ways: per-device bytes are about an eighth.
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    total = sum(x.nbytes for x in leaves)
    on_device0 = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == ep.devices.flat[0])
    assert on_device0 < 0.13 * total


def test_expert_parallel_train_step_equals_one_device(meshes):
    one, ep = meshes
    state1, metrics1 = make_train_step(OPTIM, SCHEDULE, mesh=one)(fresh_state(one), make_batch(one))
    state8, metrics8 = make_train_step(OPTIM, SCHEDULE, mesh=ep)(fresh_state(ep), make_batch(ep))
    assert float(metrics8["moe_dropped_tokens"]) == 0.0
    for name in metrics1:
        np.testing.assert_allclose(metrics8[name], metrics1[name], rtol=1e-5, err_msg=name)
    assert_close_leaves(eqx.filter(state8.model, eqx.is_array), eqx.filter(state1.model, eqx.is_array), 1e-5)
    assert state8.model.blocks.moe.experts.down_proj.sharding.spec == P(None, "expert", None, "fsdp")


def test_planner_counts_the_all_to_all_of_expert_parallelism():
    from olmo_eqx.plan import plan

    p = plan(["model=olmoe_tiny", "mesh.fsdp=2", "mesh.expert=4", "data.sequence_length=64", "data.global_batch_size=8"], 8)
    assert p["mesh"]["expert"] == 4 and p["per_device_batch"] == 1
    assert p["experts"] == {
        "n_experts": 8, "active": 2, "expert_parallel": 4, "experts_per_device": 2,
        "tokens_per_device_per_micro_batch": 64, "all_to_all_slots_per_peer": 128,
    }
    # 4 layers x (2 forward + 2 backward) token exchanges, and the counts' own.
    assert p["collectives"]["all-to-all"]["count"] >= 16 and p["collectives"]["all-to-all"]["bytes"] > 0
