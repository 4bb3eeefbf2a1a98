"""The optimiser recipe: float32 moments whatever the parameter dtype, masked weight decay,
clipping, and the learning-rate schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.registry import abstract_model
from olmo_eqx.train.optim import OptimConfig, apply_updates, decay_mask, make_optimizer
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule

TINY = ModelConfig(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    vocab_size=256, padded_vocab_size=256, sliding_window=16,
)


def floating_state_dtypes(opt_state) -> set:
    return {leaf.dtype for leaf in jax.tree.leaves(opt_state) if jnp.issubdtype(leaf.dtype, jnp.floating)}


def filled_params(config: ModelConfig, value: float = 0.5):
    """The model's parameter tree filled with `value` (no slow eager init needed here)."""
    return jax.tree.map(lambda s: jnp.full(s.shape, value, s.dtype), abstract_model(config))


@pytest.fixture(scope="module")
def bf16_params():
    return filled_params(TINY.replace(param_dtype="bfloat16"))


def test_moments_are_float32_with_bf16_params(bf16_params):
    optimizer = make_optimizer(OptimConfig())
    state = optimizer.init(bf16_params)
    assert floating_state_dtypes(state) == {jnp.dtype(jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), bf16_params)
    updates, state = jax.jit(optimizer.update)(grads, state, bf16_params)
    assert floating_state_dtypes(state) == {jnp.dtype(jnp.float32)}
    assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(jnp.float32)}
    new = apply_updates(bf16_params, updates, jnp.float32(1e-3))
    assert {p.dtype for p in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}


def test_the_moment_check_catches_optax_default(bf16_params):
    # The trap the test above guards against: optax's mu_dtype covers mu only, nu follows
    # the parameters. If this ever stops failing, optax changed and the wrapper is moot.
    state = optax.adamw(1e-3, mu_dtype=jnp.float32).init(bf16_params)
    assert jnp.dtype(jnp.bfloat16) in floating_state_dtypes(state)


def test_weight_decay_skips_embedding_only():
    model = filled_params(TINY)
    mask = decay_mask(model)
    assert mask.embed is False and mask.lm_head is True and mask.final_norm.weight is True
    assert mask.blocks.attention.q_norm.weight is True and mask.blocks.mlp.up_proj is True

    config = OptimConfig(weight_decay=0.1, clip_grad_norm=None)
    optimizer = make_optimizer(config)
    zeros = jax.tree.map(jnp.zeros_like, model)  # Adam's direction is 0: only decay moves weights
    updates, _ = optimizer.update(zeros, optimizer.init(model), model)
    lr = jnp.float32(0.5)
    new = apply_updates(model, updates, lr)
    np.testing.assert_array_equal(new.embed, model.embed)
    np.testing.assert_allclose(new.lm_head, model.lm_head * (1 - 0.5 * 0.1), rtol=1e-6)
    np.testing.assert_allclose(new.final_norm.weight, model.final_norm.weight * (1 - 0.5 * 0.1), rtol=1e-6)
    decay_all = make_optimizer(OptimConfig(decay_embedding=True, clip_grad_norm=None))
    updates, _ = decay_all.update(zeros, decay_all.init(model), model)
    np.testing.assert_allclose(apply_updates(model, updates, lr).embed, model.embed * 0.95, rtol=1e-6)


def test_gradients_clipped_to_global_norm():
    params = {"a": jnp.ones((4,)), "b": jnp.ones((3, 3))}
    grads = {"a": jnp.full((4,), 10.0), "b": jnp.full((3, 3), 10.0)}
    optimizer = make_optimizer(OptimConfig(clip_grad_norm=1.0, weight_decay=0.0, b1=0.0, b2=0.0, eps=0.0))
    # With b1 = b2 = 0 Adam returns sign(g): check clipping through its state instead.
    clip = optax.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(params))
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-6)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    np.testing.assert_allclose(updates["a"], 1.0, rtol=1e-5)


# --- schedules: their values, update by update, are checked against OLMo-core's own scheduler
# in test_olmo_core_schedules.py; here only what OLMo-core has no counterpart for.


def test_schedule_errors_name_the_setting():
    with pytest.raises(ValueError, match="total_steps"):
        make_schedule(ScheduleConfig(), 1.0, None)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_schedule(ScheduleConfig(warmup_steps=10), 1.0, 10)
    # Under the test suite's type checks the Literal already refuses the name; without them
    # make_schedule does.
    with pytest.raises((ValueError, TypeError), match="name"):
        make_schedule(ScheduleConfig(name="exp"), 1.0, 10)
    with pytest.raises(ValueError, match="final_lr_ratio"):
        make_schedule(ScheduleConfig(name="constant", final_lr_ratio=0.1), 1.0, 10)


def test_schedule_holds_its_final_value_beyond_its_end():
    for name, final in (("cosine", 0.1), ("linear", 0.0), ("constant", 1.0), ("wsd", 0.0)):
        lr = np.asarray(make_schedule(ScheduleConfig(name=name, warmup_steps=3), 1.0, 20)(jnp.arange(20, 30)))
        np.testing.assert_allclose(lr, final, rtol=1e-6, err_msg=name)
