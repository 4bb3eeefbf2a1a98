"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024): the linear-attention token mixer of
OLMo-Hybrid, as a chunked parallel form for training and a recurrent form for decoding.

Per head, a state S [key_dim, value_dim] is updated token by token with a decay a_t = exp(g_t)
(g_t <= 0), a write strength beta_t and the delta rule (write the error of the state's own
prediction of v_t from k_t, not v_t itself), and read by the query:

    S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

`recurrent` runs exactly that, one token at a time (decoding, and the reference of tests).
`chunked` computes the same outputs a chunk of C tokens at a time. Within a chunk, with
gamma_i = a_1 ... a_i and S0 the state entering the chunk, the writes
delta_i = beta_i (v_i - a_i S_{i-1}^T k_i) solve a unit lower-triangular system

    (I + A) delta = beta v - (beta gamma k) S0,   A_ij = beta_i (gamma_i / gamma_j) k_i . k_j  (j < i)

after which o = (q gamma) S0 + [(q k^T) * decay] delta and the state leaving the chunk is
gamma_C S0 + sum_j (gamma_C / gamma_j) k_j delta_j^T: matmuls of C x C and C x d, the
inverse of (I + A) (by 2 x 2 blocks, log2 C rounds of matmuls: `unit_lower_inverse`), and a
`lax.scan` over chunks carrying S in float32. Memory is linear in the
sequence; the chunk step is rematerialised (`jax.checkpoint`), so the backward pass keeps one
state per chunk, never one per token.

Documents (packed sequences): a token that starts a document resets the state to zero before
its own write (a_t = 0). Both forms take a document index per token; the chunked form masks
every decay that would cross a document start rather than putting -inf into a cumulative sum.
The short causal convolution in front of the kernel (`causal_conv`) stops at document starts
too, and keeps its last `kernel - 1` inputs as the decoder's tail.
"""

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def document_index(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """0, 1, 2, ... counting document starts (a token whose segment id differs from the one before)."""
    starts = jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1]), (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(segment_ids.dtype)],
        axis=1,
    )
    return jnp.cumsum(starts, axis=1)


def causal_conv(
    x: Float[Array, "batch seq channels"],
    weight: Float[Array, "kernel channels"],
    documents: Optional[Int[Array, "batch seq"]] = None,
    tail: Optional[Float[Array, "batch kernel_minus_1 channels"]] = None,
) -> tuple[Float[Array, "batch seq channels"], Float[Array, "batch kernel_minus_1 channels"]]:
    """Depthwise causal convolution (no bias, no activation): y_t = sum_k w_k x_{t - K + 1 + k},
    over inputs of the same document only. `tail` (the K - 1 inputs before x, zeros at a
    sequence start) continues a previous call; returns y and the new tail."""
    kernel = weight.shape[0]
    batch, seq, channels = x.shape
    if tail is None:
        tail = jnp.zeros((batch, kernel - 1, channels), x.dtype)
    padded = jnp.concatenate([tail.astype(x.dtype), x], axis=1)
    w = weight.astype(x.dtype)
    y = jnp.zeros_like(x)
    for k in range(kernel):
        shift = kernel - 1 - k  # tap k reads the input `shift` tokens back
        tap = padded[:, k : k + seq]
        if documents is not None and shift:
            back = jnp.concatenate([jnp.full((batch, shift), -1, documents.dtype), documents[:, :-shift]], axis=1)
            tap = jnp.where((back == documents)[..., None], tap, 0)
        y = y + tap * w[k]
    return y, padded[:, seq:]


def recurrent(
    q: Float[Array, "batch seq heads key_dim"],
    k: Float[Array, "batch seq heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    documents: Optional[Int[Array, "batch seq"]] = None,
    state: Optional[Float[Array, "batch heads key_dim value_dim"]] = None,
) -> tuple[Float[Array, "batch seq heads value_dim"], Float[Array, "batch heads key_dim value_dim"]]:
    """The gated delta rule one token at a time (float32 state); returns outputs and the final state."""
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if state is None:
        state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    if documents is None:
        documents = jnp.zeros((batch, seq), jnp.int32)
    f32 = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # noqa: E731  time first
    xs = (f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.moveaxis(documents, 1, 0))

    def step(carry, x):
        s, previous = carry
        q_t, k_t, v_t, g_t, b_t, doc_t = x
        keep = (doc_t == previous)[:, None, None, None]  # a document start forgets everything
        s = jnp.where(keep, s, 0.0) * jnp.exp(g_t)[..., None, None]
        delta = b_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * delta[..., None, :]
        return (s, doc_t), jnp.einsum("bhkv,bhk->bhv", s, q_t)

    (state, _), out = jax.lax.scan(step, (state, documents[:, 0]), xs)
    return jnp.moveaxis(out, 0, 1).astype(v.dtype), state


def _block_inverse(m):
    """The inverse of unit lower-triangular [..., C, C] matrices, C a power of two, by blocks:
    [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], from 1 x 1 blocks (the unit
    diagonal) up to C x C in log2(C) rounds of batched matmuls."""
    size = m.shape[-1]
    batch = m.shape[:-2]
    inverse = jnp.ones((*batch, size, 1, 1), m.dtype)  # the 1 x 1 diagonal blocks' inverses
    block = 1
    while block < size:
        pairs = size // (2 * block)
        # The sub-diagonal block B of each diagonal 2b x 2b block of m: rows b..2b, columns 0..b.
        tiles = m.reshape(*batch, pairs, 2 * block, pairs, 2 * block)
        diagonal = jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)  # [..., pairs, 2b, 2b]
        lower = diagonal[..., block:, :block]
        upper_inverse, lower_inverse = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -(lower_inverse @ lower @ upper_inverse)
        zeros = jnp.zeros_like(corner)
        inverse = jnp.concatenate(
            [jnp.concatenate([upper_inverse, zeros], axis=-1), jnp.concatenate([corner, lower_inverse], axis=-1)], axis=-2
        )
        block *= 2
    return inverse[..., 0, :, :]


@jax.custom_vjp
def unit_lower_inverse(m: Float[Array, "*batch size size"]) -> Float[Array, "*batch size size"]:
    """The inverse of unit lower-triangular matrices (only the strictly lower part of `m` is read).

    Matmuls only: XLA:CPU's `triangular_solve` ran the chunk's 64 x 64 solve about 400x slower
    than a matmul of the same shapes. The backward pass is d(M^-1) = -M^-T dX M^-T, also matmuls,
    kept to the strictly lower part."""
    size = m.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()  # the next power of two: pad with the identity
    if padded != size:
        pad = [(0, 0)] * (m.ndim - 2) + [(0, padded - size)] * 2
        return _block_inverse(jnp.pad(m, pad))[..., :size, :size]
    return _block_inverse(m)


def _inverse_fwd(m):
    inverse = unit_lower_inverse(m)
    return inverse, inverse


def _inverse_bwd(inverse, d_inverse):
    transposed = jnp.swapaxes(inverse, -1, -2)
    return (jnp.tril(-(transposed @ d_inverse @ transposed), -1),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _chunk_step(state, chunk):
    """One chunk: (state entering [b, h, dk, dv]) -> (state leaving, outputs [b, h, C, dv])."""
    q, k, v, g, beta, doc, previous_doc = chunk  # [b, h, C, d], [b, h, C], docs [b, C] / [b]
    size = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # log gamma_i
    same = (doc[:, :, None] == doc[:, None, :])[:, None]  # [b, 1, C, C]: no document start between
    lower = jnp.tril(jnp.ones((size, size), bool))
    pair = lower & same
    # gamma_i / gamma_j for j <= i in one document, else 0 (masked before exp: no overflow).
    decay = jnp.exp(jnp.where(pair, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    reaches = (doc == previous_doc[:, None])[:, None]  # [b, 1, C]: the entering state still counts
    gamma = jnp.where(reaches, jnp.exp(cum), 0.0)
    strictly_lower = decay * (1 - jnp.eye(size, dtype=decay.dtype))
    system = jnp.eye(size, dtype=decay.dtype) + beta[..., :, None] * (k @ jnp.swapaxes(k, -1, -2)) * strictly_lower
    rhs = jnp.concatenate([beta[..., None] * v, (beta * gamma)[..., None] * k], axis=-1)
    solved = unit_lower_inverse(system) @ rhs
    new_values, decayed_keys = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    delta = new_values - decayed_keys @ state  # the writes delta_i
    scores = (q @ jnp.swapaxes(k, -1, -2)) * decay
    out = (q * gamma[..., None]) @ state + scores @ delta
    last = doc[:, -1:]
    to_end = jnp.where((doc == last)[:, None], jnp.exp(cum[..., -1:] - cum), 0.0)  # gamma_C / gamma_j
    state = gamma[..., -1:, None] * state + jnp.swapaxes(k * to_end[..., None], -1, -2) @ delta
    return state, out


def chunked(
    q: Float[Array, "batch seq heads key_dim"],
    k: Float[Array, "batch seq heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    documents: Optional[Int[Array, "batch seq"]] = None,
    state: Optional[Float[Array, "batch heads key_dim value_dim"]] = None,
    *,
    chunk_size: int = 64,
) -> tuple[Float[Array, "batch seq heads value_dim"], Float[Array, "batch heads key_dim value_dim"]]:
    """The gated delta rule a chunk at a time, equal to `recurrent`; returns outputs and the final state."""
    batch, seq, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    if state is None:
        state = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32)
    if documents is None:
        documents = jnp.zeros((batch, seq), jnp.int32)
    pad = -seq % chunk_size
    n = (seq + pad) // chunk_size
    # Padding at the end writes nothing (beta = 0, k = 0) and is cut from the outputs.
    padded = lambda a: jnp.pad(a.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731

    def chunks(a):  # [b, t, h, ...] -> [n, b, h, C, ...]
        a = padded(a).reshape(batch, n, chunk_size, heads, *a.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    docs = jnp.pad(documents, [(0, 0), (0, pad)], mode="edge").reshape(batch, n, chunk_size)
    previous = jnp.concatenate([docs[:, :1, 0], docs[:, :-1, -1]], axis=1)  # the token before each chunk
    xs = (chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta), jnp.moveaxis(docs, 1, 0), jnp.moveaxis(previous, 1, 0))
    state, out = jax.lax.scan(jax.checkpoint(_chunk_step), state.astype(jnp.float32), xs)
    out = jnp.moveaxis(out, 0, 1)  # [b, n, h, C, dv]
    out = jnp.swapaxes(out, 2, 3).reshape(batch, n * chunk_size, heads, value_dim)[:, :seq]
    return out.astype(v.dtype), state
