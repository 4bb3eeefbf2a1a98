"""Blockwise (flash-style) attention against the plain reference: values, gradients, skipping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.models import attention
from olmo_eqx.models.attention import (
    AttentionMask,
    _allowed,
    _key_blocks,
    _layout,
    _query_blocks,
    _Static,
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


@pytest.fixture(params=["unrolled", "loops"])
def block_loops(request, monkeypatch):
    """Both forms of the kernel: block loops run in Python (few blocks) and as fori_loops."""
    if request.param == "loops":
        monkeypatch.setattr(attention, "UNROLL_BLOCKS", 0)
    return request.param


@pytest.mark.parametrize("seq, heads, kv_heads, window, block", CASES)
def test_blockwise_matches_reference_values_and_gradients(seq, heads, kv_heads, window, block, block_loops):
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

    out, grads = value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, AttentionMask(window), block_size=block))
    ref_out, ref_grads = value_and_grads(lambda q, k, v: reference_attention(q, k, v, AttentionMask(window)))
    assert relative(out, ref_out) <= 1e-6, f"output differs by {relative(out, ref_out):.2e}"
    for name, g, ref in zip("qkv", grads, ref_grads):
        assert relative(g, ref) <= 1e-6, f"d{name} differs by {relative(g, ref):.2e}"


def test_bfloat16_inputs_keep_float32_statistics():
    q, k, v = (jax.random.normal(key, (1, 48, 2, 16)).astype(jnp.bfloat16) for key in jax.random.split(jax.random.key(3), 3))
    out = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, AttentionMask(20), block_size=16))(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), AttentionMask(20))
    assert relative(out.astype(jnp.float32), ref) < 2e-2


@pytest.mark.parametrize("length, block, window", [(64, 16, None), (64, 16, 16), (64, 8, 13), (50, 16, 100), (70, 16, 1)])
@pytest.mark.parametrize("documents", [False, True])
def test_visits_exactly_the_blocks_with_a_visible_key(length, block, window, documents):
    """The skipping is exact: a block pair is visited iff some query in it may see some key."""
    n_blocks = -(-length // block)
    padded = n_blocks * block
    positions = jnp.arange(padded)
    mask = np.asarray(_allowed(positions, positions, length, window))
    seg = None
    if documents:  # two rows whose document boundaries differ
        cuts = jnp.array([[5, 23, 40], [17, 18, 61]])
        seg = jnp.sum(positions[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)
        mask = mask[None] & np.asarray(seg[:, :, None] == seg[:, None, :])
        mask = mask.any(axis=0)
    st, lay = _Static(block, length, window), _layout(0, seg, seg, block, n_blocks)
    unrolled = _Static(block, length, window, unrolled=True)
    for i in range(n_blocks):
        for j in range(n_blocks):
            needed = mask[i * block : (i + 1) * block, j * block : (j + 1) * block].any()
            first_k, end_k = (int(x) for x in _key_blocks(i, st, lay, n_blocks))
            first_q, end_q = (int(x) for x in _query_blocks(j, st, lay, n_blocks))
            if not documents:  # the unrolled kernel's Python-int bounds are the same blocks
                assert _key_blocks(i, unrolled, lay, n_blocks) == (first_k, end_k)
                assert _query_blocks(j, unrolled, lay, n_blocks) == (first_q, end_q)
            # Padding queries (past the sequence) may add blocks, never drop needed ones.
            if i * block < length and (i + 1) * block <= length:
                assert (first_k <= j < end_k) == needed, (i, j)
                assert (first_q <= i < end_q) == needed, (i, j)
    if window is not None and window < length and not documents:
        # A sliding layer visits O(T x W): at most ceil((W - 1) / block) + 1 key blocks per query block.
        widest = max(int(e) - int(f) for f, e in (_key_blocks(i, st, lay, n_blocks) for i in range(n_blocks)))
        assert widest <= -(-(window - 1) // block) + 1


DOC_CASES = [
    pytest.param(64, 4, 2, None, 16, id="documents"),
    pytest.param(50, 4, 4, 9, 16, id="documents-window-ragged"),
]


@pytest.mark.parametrize("seq, heads, kv_heads, window, block", DOC_CASES)
def test_blockwise_with_documents_matches_reference(seq, heads, kv_heads, window, block):
    kq, kk, kv, kg = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(kq, (2, seq, heads, 8))
    k = jax.random.normal(kk, (2, seq, kv_heads, 8))
    v = jax.random.normal(kv, (2, seq, kv_heads, 8))
    cotangent = jax.random.normal(kg, q.shape)
    cuts = jnp.array([[3, 20, 21, 37], [30, 31, 45, 49]])  # documents of 1 token, and one longer than a block
    seg = jnp.sum(jnp.arange(seq)[None, :, None] >= cuts[:, None, :], axis=-1).astype(jnp.int32)
    mask = AttentionMask(window, seg)

    def value_and_grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cotangent)

    out, grads = jax.jit(lambda: value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, mask, block_size=block)))()
    ref, ref_grads = jax.jit(lambda: value_and_grads(lambda q, k, v: reference_attention(q, k, v, mask)))()
    assert relative(out, ref) <= 1e-6
    for name, g, r in zip("qkv", grads, ref_grads):
        assert relative(g, r) <= 1e-6, f"d{name} differs by {relative(g, r):.2e}"
    # The documents matter: without them the output differs.
    assert relative(reference_attention(q, k, v, AttentionMask(window)), ref) > 1e-2


def test_auto_picks_blockwise_on_cpu_and_matches():
    assert resolve_implementation("auto", jnp.float32) == "blockwise"
    assert resolve_implementation("xla", jnp.float32) == "xla"
    q, k, v = (jax.random.normal(key, (2, 24, 2, 8)) for key in jax.random.split(jax.random.key(4), 3))
    got = jax.jit(lambda q, k, v: attend(q, k, v, AttentionMask(7), implementation="auto"))(q, k, v)
    assert relative(got, reference_attention(q, k, v, AttentionMask(7))) <= 1e-6
