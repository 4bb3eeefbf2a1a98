"""The pure train step: learning, gradient accumulation, skip-step, and 8 devices == 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.models.config import ModelConfig
from olmo_eqx.sharding import MeshConfig, ShardingRules, batch_sharding, make_mesh, train_state_shardings
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
from olmo_eqx.train.state import init_train_state
from olmo_eqx.train.step import make_eval_step, make_train_step

TINY = ModelConfig(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    vocab_size=256, padded_vocab_size=256, sliding_window=16,
)
OPTIM = OptimConfig(lr=3e-3)
SCHEDULE = make_schedule(ScheduleConfig(name="constant"), OPTIM.lr, 100)
BATCH, SEQ = 16, 32


def make_batch(mesh, seed=1):
    ids = jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, TINY.vocab_size, dtype=jnp.int32)
    mask = jnp.ones((BATCH, SEQ), jnp.float32).at[:3, :5].set(0.0)  # some ignored targets
    sharding = batch_sharding(mesh)
    return {"input_ids": jax.device_put(ids, sharding), "loss_mask": jax.device_put(mask, sharding)}


def fresh_state(mesh):
    return init_train_state(TINY, OPTIM, mesh, ShardingRules(), jax.random.key(0))


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def mesh8():
    return make_mesh(MeshConfig())


@pytest.fixture(scope="module")
def step8(mesh8):
    return make_train_step(OPTIM, SCHEDULE, mesh=mesh8)


@pytest.fixture(scope="module")
def run8(mesh8, step8):
    """30 steps on one fixed batch on 8 devices; the metrics of each step."""
    state, batch = fresh_state(mesh8), make_batch(mesh8)
    history = []
    for _ in range(30):
        state, metrics = step8(state, batch)
        history.append(metrics)
    return to_numpy(history), state


def test_runs_differing_only_in_their_schedule_share_one_compiled_step(mesh8, step8, run8):
    """The jobs of an LR sweep, a run made longer, or an anneal (linear, not constant) reuse the
    init and the step `step8` compiled: the schedule is an input of the step, and the peak lr no
    part of either program."""
    fresh_state(mesh8)  # the init program of OPTIM, traced before counting
    batch = make_batch(mesh8)
    schedule = make_schedule(ScheduleConfig(name="linear", warmup_steps=5), 1e-4, 40)
    traces = []

    def count_traces(event, _seconds, **_):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traces.append(event)

    jax.monitoring.register_event_duration_secs_listener(count_traces)
    try:
        state = init_train_state(TINY, OptimConfig(lr=1e-4), mesh8, ShardingRules(), jax.random.key(0))
        _, metrics = make_train_step(OptimConfig(lr=1e-4), schedule, mesh=mesh8)(state, batch)
        lr = float(metrics["lr"])
    finally:
        jax.monitoring.unregister_event_duration_listener(count_traces)
    assert lr == pytest.approx(1e-4 / 5)  # the first of 5 warmup updates to the new peak
    assert traces == []


def test_loss_falls(run8):
    history, state = run8
    losses = [float(m["loss"]) for m in history]
    assert losses[0] == pytest.approx(np.log(TINY.vocab_size), abs=0.1)  # near-uniform at init
    assert losses[-1] < losses[0] - 1.5, losses
    assert int(state.step) == 30 and int(state.history_count) == 30
    assert all(float(m["skipped"]) == 0.0 for m in history)
    first = history[0]
    assert float(first["tokens"]) == BATCH * (SEQ - 1) - 3 * 4
    assert float(first["lr"]) == pytest.approx(OPTIM.lr)
    assert 0 < float(first["z_loss"]) < 1e-3 and float(first["grad_norm"]) > 0


def test_state_keeps_its_layout(run8, mesh8):
    _, state = run8
    expected = train_state_shardings(state, mesh8, ShardingRules())
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def test_micro_batches_give_the_same_step(mesh8, run8):
    history, _ = run8
    step4 = make_train_step(OPTIM, SCHEDULE, mesh=mesh8, micro_batches=4)
    state, batch = fresh_state(mesh8), make_batch(mesh8)
    for i in range(3):
        state, metrics = step4(state, batch)
        # Same global normalisation: equal to float32 rounding of the different summation
        # order; later steps a little looser (Adam's early updates amplify rounding of tiny
        # gradient entries; measured up to 1.2e-5 on the grad norm of step 2).
        rtol = 2e-6 if i == 0 else 3e-5
        for name in ("loss", "z_loss", "grad_norm", "tokens"):
            np.testing.assert_allclose(metrics[name], history[i][name], rtol=rtol, err_msg=f"{name} at step {i}")


def test_eight_devices_equal_one(run8):
    history, _ = run8
    mesh1 = make_mesh(MeshConfig(), jax.devices()[:1])
    step1 = make_train_step(OPTIM, SCHEDULE, mesh=mesh1)
    state, batch = fresh_state(mesh1), make_batch(mesh1)
    for i in range(3):
        state, metrics = step1(state, batch)
        rtol = 2e-6 if i == 0 else 1e-5
        for name in ("loss", "grad_norm"):
            np.testing.assert_allclose(metrics[name], history[i][name], rtol=rtol, err_msg=f"{name} at step {i}")


def test_tensor_parallel_equals_fsdp(run8):
    history, _ = run8
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    state, batch = fresh_state(mesh), make_batch(mesh)
    assert state.model.blocks.mlp.up_proj.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    state, metrics = make_train_step(OPTIM, SCHEDULE, mesh=mesh)(state, batch)
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics[name], history[0][name], rtol=2e-6, err_msg=name)


def planted(state, mean, std, count, *, grad_norm_mean=1.0):
    """The state with a skip-step window of `count` values around mean (+- std)."""
    noise = np.random.default_rng(0).standard_normal(state.loss_history.shape).astype(np.float32)
    sharding = state.loss_history.sharding
    return state.replace(
        loss_history=jax.device_put(mean + std * noise, sharding),
        grad_norm_history=jax.device_put(grad_norm_mean + 0.01 * noise, sharding),
        history_count=jax.device_put(jnp.int32(count), state.history_count.sharding),
    )


def test_skip_step_skips_a_planted_spike(mesh8, step8):
    batch = make_batch(mesh8)
    # The first loss is ~5.5 (ln 256); a window of losses around 3.0 +- 0.1 makes it a spike.
    state = planted(fresh_state(mesh8), 3.0, 0.1, count=100, grad_norm_mean=1e9)
    before = to_numpy((state.model, state.opt_state))
    state, metrics = step8(state, batch)
    assert float(metrics["skipped"]) == 1.0
    after = to_numpy((state.model, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # params and moments untouched
    assert int(state.step) == 1  # ... but the step (and so the schedule) advances
    assert int(state.history_count) == 101 and float(state.loss_history[100]) == float(metrics["loss"])

    # The same loss is not a spike in a window around it, nor with too little history
    # (OLMo-core's minimum: 63 past steps of a 128-step window).
    assert OPTIM.skip_history_needed == 63
    for mean, std, count in ((5.5, 0.1, 100), (3.0, 0.1, 62)):
        state = planted(fresh_state(mesh8), mean, std, count=count, grad_norm_mean=1e9)
        state, metrics = step8(state, batch)
        assert float(metrics["skipped"]) == 0.0, (mean, std, count)


def test_skip_step_on_grad_norm_spike(mesh8, step8):
    state = planted(fresh_state(mesh8), 5.5, 0.5, count=128, grad_norm_mean=1e-4)
    state, metrics = step8(state, make_batch(mesh8))
    assert float(metrics["skipped"]) == 1.0 and float(metrics["grad_norm"]) > 0.01


def test_eval_step_sums(mesh8, run8):
    _, state = run8
    batch = make_batch(mesh8)
    sums = make_eval_step()(state.model, batch)
    assert float(sums.count) == BATCH * (SEQ - 1) - 3 * 4
    assert 0 < float(sums.ce) / float(sums.count) < np.log(TINY.vocab_size)


def test_bf16_params_keep_float32_moments():
    mesh1 = make_mesh(MeshConfig(), jax.devices()[:1])
    config = TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    state = init_train_state(config, OPTIM, mesh1, ShardingRules(), jax.random.key(0))
    state, metrics = make_train_step(OPTIM, SCHEDULE, mesh=mesh1)(state, make_batch(mesh1))
    assert np.isfinite(float(metrics["loss"]))
    assert {p.dtype for p in jax.tree.leaves(state.model)} == {jnp.dtype(jnp.bfloat16)}
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert moments and {m.dtype for m in moments} == {jnp.dtype(jnp.float32)}
