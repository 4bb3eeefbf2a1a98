"""Gated DeltaNet's kernels (models/gated_deltanet.py): the chunked form equals the recurrent
form equals a per-token NumPy reference written from the update rule, with and without packed
documents (state reset at each document start), for sequences of several chunks and ragged
lengths; gradients of the chunked and recurrent forms agree; the convolution continues from
its tail exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.models import gated_deltanet as gdn

B, T, H, DK, DV = 2, 45, 3, 8, 12  # T not a multiple of the chunk: padding is exercised


def inputs(seed=0, t=T):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, H, DK)).astype(np.float32)
    k = rng.normal(size=(B, t, H, DK)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as the layer feeds it: unit keys
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(DK)
    v = rng.normal(size=(B, t, H, DV)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, size=(B, t, H)).astype(np.float32)
    beta = rng.uniform(0, 2, size=(B, t, H)).astype(np.float32)  # OLMo-Hybrid allows (0, 2)
    return tuple(jnp.asarray(a) for a in (q, k, v, g, beta))


def segments(t=T):
    seg = np.zeros((B, t), np.int32)
    seg[0, 7:] = 1
    seg[0, 30:] = 2  # a document start inside a chunk of 16 and one near a chunk edge
    seg[1, 16:] = 5  # a start exactly at a chunk edge
    return seg


def naive(q, k, v, g, beta, seg=None):
    """S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t; S reset at document starts."""
    q, k, v, g, beta = (np.asarray(a) for a in (q, k, v, g, beta))
    b, t, h, dk = k.shape
    out = np.zeros((b, t, h, v.shape[-1]), np.float64)
    for row in range(b):
        for head in range(h):
            s = np.zeros((dk, v.shape[-1]))
            for i in range(t):
                if seg is not None and i > 0 and seg[row, i] != seg[row, i - 1]:
                    s = np.zeros_like(s)
                kk, a, bt = k[row, i, head].astype(np.float64), np.exp(g[row, i, head]), beta[row, i, head]
                s = a * (np.eye(dk) - bt * np.outer(kk, kk)) @ s + bt * np.outer(kk, v[row, i, head])
                out[row, i, head] = s.T @ q[row, i, head]
    return out


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "packed"])
@pytest.mark.parametrize("chunk_size", [16, 8])
def test_chunked_equals_recurrent_equals_naive(documents, chunk_size):
    args = inputs()
    seg = segments() if documents else None
    docs = None if seg is None else gdn.document_index(jnp.asarray(seg))
    expected = naive(*args, seg)
    rec, rec_state = jax.jit(gdn.recurrent)(*args, docs)
    chk, chk_state = jax.jit(lambda *a: gdn.chunked(*a, chunk_size=chunk_size))(*args, docs)
    scale = np.abs(expected).max()
    assert np.abs(np.asarray(rec) - expected).max() <= 1e-5 * scale
    assert np.abs(np.asarray(chk) - expected).max() <= 1e-5 * scale
    np.testing.assert_allclose(np.asarray(chk_state), np.asarray(rec_state), rtol=1e-4, atol=1e-5)


def test_chunked_continues_from_a_state():
    """Two halves, the second starting from the first's state, equal the whole (prefill + decode)."""
    q, k, v, g, beta = inputs(1)
    whole, whole_state = gdn.chunked(q, k, v, g, beta, chunk_size=16)
    cut = 29
    first, state = gdn.chunked(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], chunk_size=16)
    second, end = gdn.recurrent(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], state=state)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), whole, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(end, whole_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "packed"])
def test_chunked_gradients_equal_recurrent_gradients(documents):
    args = inputs(2)
    docs = gdn.document_index(jnp.asarray(segments())) if documents else None
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, H, DV)).astype(np.float32))

    def loss(fn, *a):
        return jnp.sum(fn(*a, docs)[0] * weights)

    chunked = lambda *a: gdn.chunked(*a, chunk_size=16)  # noqa: E731
    expected = jax.jit(jax.grad(lambda *a: loss(gdn.recurrent, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    got = jax.jit(jax.grad(lambda *a: loss(chunked, *a), argnums=(0, 1, 2, 3, 4)))(*args)
    for name, a, b in zip("q k v g beta".split(), got, expected):
        ratio = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert ratio <= 1e-5, f"gradient of {name}: {ratio:.2e}"


def test_conv_tail_and_documents():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(B, 20, 6)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(4, 6)).astype(np.float32))
    whole, tail = gdn.causal_conv(x, w)
    first, t1 = gdn.causal_conv(x[:, :11], w)
    steps = [first]
    for i in range(11, 20):  # one token at a time from the tail, as decoding does
        y, t1 = gdn.causal_conv(x[:, i : i + 1], w, tail=t1)
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(t1, tail)
    # Packed documents: the convolution of a document equals that document convolved alone.
    seg = np.zeros((B, 20), np.int32)
    seg[:, 9:] = 1
    packed, _ = gdn.causal_conv(x, w, gdn.document_index(jnp.asarray(seg)))
    alone, _ = gdn.causal_conv(x[:, 9:], w)
    np.testing.assert_allclose(packed[:, 9:], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(packed[:, :9], whole[:, :9], rtol=1e-6, atol=1e-6)


def test_backward_keeps_no_per_token_state():
    """At 4096 tokens the compiled backward's temporaries stay far below one state per token."""
    t = 4096
    q, k, v, g, beta = (jnp.zeros((1, t, 2, 32) if i < 2 else (1, t, 2, 64) if i == 2 else (1, t, 2)) for i in range(5))

    def loss(q, k, v, g, beta):
        return jnp.sum(gdn.chunked(q, k, v, g, beta, chunk_size=64)[0])

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q, k, v, g, beta).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    per_token_states = t * 2 * 32 * 64 * 4  # 64 MiB
    print(f"backward temporaries {temp / 2**20:.1f} MiB against {per_token_states / 2**20:.0f} MiB of per-token states")
    assert temp < per_token_states / 8
