"""Cross-entropy + z-loss: shift by one, masks, float32 sums and the global reduction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.train.loss import loss_sums, objective, target_count


def reference(logits, ids, mask):
    """Plain numpy, one position at a time."""
    ce = z = count = 0.0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if mask[b, t + 1]:
                row = logits[b, t].astype(np.float64)
                lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
                ce += lse - row[ids[b, t + 1]]
                z += lse**2
                count += 1
    return ce, z, count


def test_matches_reference_with_mask():
    key1, key2, key3 = jax.random.split(jax.random.key(0), 3)
    logits = 3.0 * jax.random.normal(key1, (3, 7, 11))
    ids = jax.random.randint(key2, (3, 7), 0, 11)
    mask = (jax.random.uniform(key3, (3, 7)) > 0.3).astype(jnp.float32)
    sums = loss_sums(logits, ids, mask)
    ce, z, count = reference(np.asarray(logits), np.asarray(ids), np.asarray(mask))
    assert float(sums.count) == count == float(target_count(mask))
    assert float(sums.ce) == pytest.approx(ce, rel=1e-5)
    assert float(sums.z) == pytest.approx(z, rel=1e-5)
    assert float(objective(sums, 1e-5, sums.count)) == pytest.approx((ce + 1e-5 * z) / count, rel=1e-5)


def test_last_position_and_first_mask_entry_are_ignored():
    logits = jax.random.normal(jax.random.key(1), (2, 5, 9))
    ids = jnp.arange(10).reshape(2, 5) % 9
    full = loss_sums(logits, ids, jnp.ones((2, 5)))
    assert float(full.count) == 2 * 4
    # The last logits predict nothing: changing them changes no sum.
    changed = loss_sums(logits.at[:, -1].set(100.0), ids, jnp.ones((2, 5)))
    assert float(changed.ce) == float(full.ce) and float(changed.z) == float(full.z)
    # loss_mask[:, 0] masks a token that is never a target.
    assert float(loss_sums(logits, ids, jnp.ones((2, 5)).at[:, 0].set(0.0)).ce) == float(full.ce)


def test_bf16_logits_are_summed_in_float32():
    logits = jax.random.normal(jax.random.key(2), (2, 6, 5)).astype(jnp.bfloat16)
    sums = loss_sums(logits, jnp.zeros((2, 6), jnp.int32), jnp.ones((2, 6)))
    assert sums.ce.dtype == sums.z.dtype == jnp.float32


def fused(hidden, head, ids, mask, head_grad=None, **kw):
    """`fused_head_loss` as the training step takes it: ((value, sums), (autodiff's gradient of
    the value for the hidden states, for the head), the head's gradient it returns summed into
    `head_grad`, zeros by default)."""
    from olmo_eqx.train.loss import fused_head_loss

    start = jnp.zeros(head.shape, jnp.float32) if head_grad is None else head_grad

    def objective(hidden, head):
        value, sums, summed = fused_head_loss(hidden, head, ids, mask, start, **kw)
        return value, (sums, summed)

    (value, (sums, summed)), grads = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(hidden, head)
    return (value, sums), grads, summed


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_fused_head_loss_equals_autodiff_of_the_chunked_loss(chunk_size):
    """The training head (gradient formed with the logits, `fused_head_loss`) against autodiff
    of `chunked_loss_sums`: same sums, same gradients of ce + z_w * z (the head's returned, not
    autodiff's, which gives it none), with a padded vocabulary, masked targets and a sequence
    that is not a whole number of chunks (float32)."""
    from olmo_eqx.train.loss import chunked_loss_sums

    k1, k2, k3, k4 = jax.random.split(jax.random.key(3), 4)
    hidden = jax.random.normal(k1, (2, 11, 8))
    head = 0.5 * jax.random.normal(k2, (8, 16))  # 13 real columns + 3 padding
    ids = jax.random.randint(k3, (2, 11), 0, 13)
    mask = (jax.random.uniform(k4, (2, 11)) > 0.2).astype(jnp.float32)
    z_w = 0.1  # large, so that a wrong z-loss gradient shows
    kw = dict(vocab_size=13, chunk_size=chunk_size)

    def reference(hidden, head):
        sums = chunked_loss_sums(hidden, head, ids, mask, **kw)
        return sums.ce + z_w * sums.z, sums

    (want, want_sums), want_grads = jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)(hidden, head)
    training = jax.jit(lambda hidden, head: fused(hidden, head, ids, mask, z_loss_weight=z_w, **kw))
    (got, got_sums), (d_hidden, d_head_autodiff), d_head = training(hidden, head)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(got_sums, want_sums):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for a, b in zip((d_hidden, d_head), want_grads):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    assert not np.any(np.asarray(d_head_autodiff))
    # The sums are metrics: no gradient flows through them.
    from olmo_eqx.train.loss import fused_head_loss

    grad_of_ce = jax.grad(lambda h: fused_head_loss(h, head, ids, mask, jnp.zeros(head.shape), z_loss_weight=z_w, **kw)[1].ce)
    assert not np.any(np.asarray(grad_of_ce(hidden)))
    # The planner's counting programs run the same chunks with no loop (XLA's cost analysis
    # counts a loop's body once): same values, and no while loop left to count.
    from olmo_eqx.train.loss import unrolled_loss_chunks

    with unrolled_loss_chunks():
        unrolled = jax.jit(lambda hidden, head: fused(hidden, head, ids, mask, z_loss_weight=z_w, **kw))
        (flat, _), (flat_hidden, _), flat_head = unrolled(hidden, head)
        assert "while" not in unrolled.lower(hidden, head).as_text()
    assert ("while" in training.lower(hidden, head).as_text()) == (chunk_size < hidden.shape[1])
    np.testing.assert_allclose(flat, got, rtol=1e-6)
    for a, b in zip((flat_hidden, flat_head), (d_hidden, d_head)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_logits_in_the_compute_dtype_are_rounded_once_as_olmo_core_does():
    """`logits_dtype="compute"`: the head's matmul writes bf16 logits, as OLMo-core's head under
    bf16 mixed precision, and the loss upcasts them: its sums are `loss_sums` of exactly those
    bf16 logits (float32 logits give other sums), and the fused gradient is autodiff's."""
    from olmo_eqx.train.loss import chunked_loss_sums

    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    hidden = jax.random.normal(k1, (2, 12, 16)).astype(jnp.bfloat16)
    head = (2.0 * jax.random.normal(k2, (16, 32))).astype(jnp.bfloat16)  # 30 real columns
    ids = jax.random.randint(k3, (2, 12), 0, 30)
    mask = jnp.ones((2, 12))
    logits = jnp.matmul(hidden, head)  # bf16, as torch's bf16 Linear
    assert logits.dtype == jnp.bfloat16
    want = loss_sums(jnp.where(jnp.arange(32) < 30, logits, -jnp.inf), ids, mask)
    kw = dict(vocab_size=30, chunk_size=4)
    rounded = chunked_loss_sums(hidden, head, ids, mask, logits_dtype="compute", **kw)
    exact = chunked_loss_sums(hidden, head, ids, mask, logits_dtype="float32", **kw)
    np.testing.assert_allclose(rounded.ce, want.ce, rtol=1e-6)
    np.testing.assert_allclose(rounded.z, want.z, rtol=1e-6)
    assert rounded.ce.dtype == jnp.float32
    assert abs(float(exact.ce) - float(rounded.ce)) > 1e-4 * abs(float(exact.ce))  # the knob is not a no-op

    def reference(hidden, head):
        sums = chunked_loss_sums(hidden, head, ids, mask, logits_dtype="compute", **kw)
        return sums.ce + 0.1 * sums.z

    training = jax.jit(lambda hidden, head: fused(hidden, head, ids, mask, z_loss_weight=0.1, logits_dtype="compute", **kw))
    (value, _), (d_hidden, _), d_head = training(hidden, head)
    np.testing.assert_allclose(value, reference(hidden, head), rtol=1e-6)
    for a, b in zip((d_hidden, d_head), jax.grad(reference, argnums=(0, 1))(hidden, head)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def test_the_head_gradient_is_summed_into_the_callers_array():
    """The head's gradient adds into the caller's float32 sum (gradient accumulation's, which
    scales it once): what earlier micro-batches summed plus this batch's, exactly as from zero."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
    hidden = jax.random.normal(k1, (2, 9, 8))
    head = 0.5 * jax.random.normal(k2, (8, 16))
    ids = jax.random.randint(k3, (2, 9), 0, 13)
    mask = (jax.random.uniform(k4, (2, 9)) > 0.2).astype(jnp.float32)
    kw = dict(vocab_size=13, chunk_size=4, z_loss_weight=0.1)
    earlier = jax.random.normal(jax.random.key(6), head.shape)  # what earlier micro-batches summed
    _, _, alone = fused(hidden, head, ids, mask, **kw)
    _, (d_hidden, _), summed = jax.jit(lambda e: fused(hidden, head, ids, mask, head_grad=e, **kw))(earlier)
    assert summed.dtype == jnp.float32
    np.testing.assert_allclose(summed, earlier + alone, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d_hidden, fused(hidden, head, ids, mask, **kw)[1][0], rtol=1e-6)
