"""Blockwise (flash-style) attention against the plain reference: values, gradients, skipping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.models.attention import (
    _allowed,
    _key_blocks,
    _query_blocks,
    attend,
    blockwise_attention,
    reference_attention,
    resolve_implementation,
)

CASES = [
    # (seq, heads, kv_heads, window, block)
    pytest.param(64, 4, 4, None, 16, id="causal"),
    pytest.param(64, 4, 4, 16, 16, id="window"),
    pytest.param(50, 6, 2, 13, 16, id="gqa-ragged-window"),
    pytest.param(37, 4, 1, None, 16, id="mqa-ragged"),
    pytest.param(40, 2, 2, 100, 16, id="window-longer-than-seq"),
    pytest.param(33, 4, 2, 5, 64, id="one-block"),
]


def relative(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("seq, heads, kv_heads, window, block", CASES)
def test_blockwise_matches_reference_values_and_gradients(seq, heads, kv_heads, window, block):
    kq, kk, kv, kg = jax.random.split(jax.random.key(seq + heads + kv_heads), 4)
    q = jax.random.normal(kq, (2, seq, heads, 8))
    k = jax.random.normal(kk, (2, seq, kv_heads, 8))
    v = jax.random.normal(kv, (2, seq, kv_heads, 8))
    cotangent = jax.random.normal(kg, q.shape)

    def value_and_grads(fn):
        def f(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, vjp(cotangent)

        return jax.jit(f)(q, k, v)

    out, grads = value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, window, block_size=block))
    ref_out, ref_grads = value_and_grads(lambda q, k, v: reference_attention(q, k, v, window))
    assert relative(out, ref_out) <= 1e-6, f"output differs by {relative(out, ref_out):.2e}"
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert relative(g, ref) <= 1e-6, f"d{name} differs by {relative(g, ref):.2e}"


def test_bfloat16_inputs_keep_float32_statistics():
    q, k, v = (jax.random.normal(key, (1, 48, 2, 16)).astype(jnp.bfloat16) for key in jax.random.split(jax.random.key(3), 3))
    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, 20, block_size=16))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), 20)
    assert relative(out.astype(jnp.float32), ref) < 2e-2


@pytest.mark.parametrize("length, block, window", [(64, 16, None), (64, 16, 16), (64, 8, 13), (50, 16, 100), (70, 16, 1)])
def test_visits_exactly_the_blocks_with_a_visible_key(length, block, window):
    """The skipping is exact: a block pair is visited iff some query in it may see some key."""
    n_blocks = -(-length // block)
    mask = np.asarray(_allowed(jnp.arange(n_blocks * block), jnp.arange(n_blocks * block), length, window))
    for i in range(n_blocks):
        for j in range(n_blocks):
            needed = mask[i * block : (i + 1) * block, j * block : (j + 1) * block].any()
            first_k, end_k = (int(x) for x in _key_blocks(i, block, n_blocks, window))
            first_q, end_q = (int(x) for x in _query_blocks(j, block, n_blocks, window))
            # Padding queries (past the sequence) may add blocks, never drop needed ones.
            if i * block < length:
                assert (first_k <= j < end_k) == needed, (i, j)
                assert (first_q <= i < end_q) == needed, (i, j)
    if window is not None and window < length:
        # A sliding layer visits O(T x W): at most ceil((W - 1) / block) + 1 key blocks per query block.
        widest = max(int(e) - int(f) for f, e in (_key_blocks(i, block, n_blocks, window) for i in range(n_blocks)))
        assert widest <= -(-(window - 1) // block) + 1


def test_auto_picks_blockwise_on_cpu_and_matches():
    assert resolve_implementation("auto", jnp.float32) == "blockwise"
    assert resolve_implementation("xla", jnp.float32) == "xla"
    q, k, v = (jax.random.normal(key, (2, 24, 2, 8)) for key in jax.random.split(jax.random.key(4), 3))
    got = jax.jit(lambda q, k, v: attend(q, k, v, sliding_window=7, implementation="auto"))(q, k, v)
    assert relative(got, reference_attention(q, k, v, 7)) <= 1e-6
