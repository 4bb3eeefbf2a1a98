"""Causal (optionally sliding-window) attention: the reference, the blockwise kernel, dispatch.

`reference_attention` is the definition, written for clarity: it materialises the
[batch, heads, T, T] scores, which at OLMo 3's sequence 8192 is 8 GiB per copy.

`blockwise_attention` computes the same thing flash-style: one query block x key block of
scores at a time, an online softmax with float32 statistics, and its own backward pass
(custom VJP) that recomputes each block's probabilities from the saved log-sum-exp instead
of storing them. Blocks outside the causal band and outside the sliding window are never
visited, so a sliding layer costs O(T x W) and a full layer about half of T^2. K/V heads are
shared by their query-head group through the einsum (GQA) instead of being repeated.

`attend` picks the implementation named by `ModelConfig.attention_impl`; "auto" means cuDNN
flash attention on GPU (bf16/fp16), the Pallas splash kernel on TPU, the blockwise one
elsewhere.
"""

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

DEFAULT_BLOCK = 512

# Logical axes of attention's inputs and outputs (see `olmo_eqx.sharding.ShardingRules`).
HEADS = ("batch", "sequence", "act_heads", "head_dim")
KV_HEADS = ("batch", "sequence", "act_kv_heads", "head_dim")


def reference_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    sliding_window: Optional[int],
) -> Float[Array, "batch seq heads head_dim"]:
    """Plain masked attention, written for clarity; tests hold the fast paths against it."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    allowed = _allowed(jnp.arange(q.shape[1]), jnp.arange(k.shape[1]), k.shape[1], sliding_window)
    scores = jnp.where(allowed, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _allowed(query: Int[Array, " q"], key: Int[Array, " k"], length: int, sliding_window: Optional[int]) -> Array:
    """[q, k] mask: causal, inside the window (which includes the query itself), a real key."""
    query, key = query[:, None], key[None, :]
    allowed = (key <= query) & (key < length)
    if sliding_window is not None:
        allowed &= key > query - sliding_window
    return allowed


# ---------------------------------------------------------------------------------------------
# The blockwise kernel. Inside it, arrays are head-major and padded to whole blocks:
#   q, dq, out, d_out: [batch, kv_heads, groups, T, head_dim]   (query head = kv_head * groups + g)
#   k, v, dk, dv:      [batch, kv_heads, T, head_dim]
#   lse, delta:        [batch, kv_heads, groups, T]             (float32)


def _key_blocks(i, block: int, n_blocks: int, sliding_window: Optional[int]):
    """[first, last + 1) of the key blocks that query block i can see."""
    first = 0 if sliding_window is None else jnp.maximum(i * block - sliding_window + 1, 0) // block
    return first, i + 1  # causal: nothing right of the diagonal block


def _query_blocks(j, block: int, n_blocks: int, sliding_window: Optional[int]):
    """[first, last + 1) of the query blocks that can see key block j."""
    if sliding_window is None:
        return j, n_blocks
    return j, jnp.minimum(((j + 1) * block - 1 + sliding_window - 1) // block + 1, n_blocks)


def _slice(x: Array, start, block: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start * block, block, axis=axis)


def _block_scores(q_blk, k_blk, i, j, block: int, length: int, sliding_window: Optional[int], scale: float):
    """Scaled scores of query block i against key block j, -inf where masked: [b, h, g, q, k] f32."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    positions = jnp.arange(block)
    allowed = _allowed(i * block + positions, j * block + positions, length, sliding_window)
    return jnp.where(allowed, s, -jnp.inf)


def _forward(q, k, v, *, block: int, length: int, sliding_window: Optional[int]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_blocks = q.shape[3] // block
    b, h, g, _, d = q.shape

    def query_block(i, carry):
        out, lse = carry
        q_blk = _slice(q, i, block, 3)

        def key_block(j, stats):
            m, l, acc = stats
            s = _block_scores(q_blk, _slice(k, j, block, 2), i, j, block, length, sliding_window, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not nan.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            correction = jnp.exp(m - shift)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), _slice(v, j, block, 2), preferred_element_type=jnp.float32)
            return m_new, l * correction + jnp.sum(p, axis=-1), acc * correction[..., None] + pv

        init = (
            jnp.full((b, h, g, block), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, g, block), jnp.float32),
            jnp.zeros((b, h, g, block, d), jnp.float32),
        )
        m, l, acc = jax.lax.fori_loop(*_key_blocks(i, block, n_blocks, sliding_window), key_block, init)
        # Every real query sees at least itself; a padding row may see nothing: its output is
        # 0 and its lse +inf, so the backward pass gives it probabilities of exactly 0.
        seen = l > 0
        row_out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        row_lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        out = jax.lax.dynamic_update_slice_in_dim(out, row_out.astype(q.dtype), i * block, axis=3)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, row_lse, i * block, axis=3)
        return out, lse

    init = (jnp.zeros_like(q), jnp.zeros(q.shape[:-1], jnp.float32))
    return jax.lax.fori_loop(0, n_blocks, query_block, init)


def _backward(q, k, v, out, lse, d_out, *, block: int, length: int, sliding_window: Optional[int]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_blocks = q.shape[3] // block
    # delta_i = sum_d dO_i * O_i: the softmax Jacobian's row term, once per query.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def block_grads(i, j, q_blk, k_blk, v_blk):
        """(p, ds) of query block i against key block j, from the saved log-sum-exp."""
        s = _block_scores(q_blk, k_blk, i, j, block, length, sliding_window, scale)
        p = jnp.exp(s - _slice(lse, i, block, 3)[..., None])
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", _slice(d_out, i, block, 3), v_blk, preferred_element_type=jnp.float32)
        return p, p * (dp - _slice(delta, i, block, 3)[..., None])

    # Pass 1, dq: each query block gathers over the key blocks it sees.
    def dq_block(i, dq):
        q_blk = _slice(q, i, block, 3)

        def key_block(j, acc):
            k_blk = _slice(k, j, block, 2)
            _, ds = block_grads(i, j, q_blk, k_blk, _slice(v, j, block, 2))
            return acc + jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k_blk, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(
            *_key_blocks(i, block, n_blocks, sliding_window), key_block, jnp.zeros(q_blk.shape, jnp.float32)
        )
        return jax.lax.dynamic_update_slice_in_dim(dq, (acc * scale).astype(q.dtype), i * block, axis=3)

    # Pass 2, dk and dv: each key block gathers over the query blocks that see it (and over
    # the query heads of its group, which is GQA's gradient of the shared K/V).
    def dkv_block(j, dkv):
        dk, dv = dkv
        k_blk, v_blk = _slice(k, j, block, 2), _slice(v, j, block, 2)

        def query_block(i, acc):
            dk_acc, dv_acc = acc
            q_blk = _slice(q, i, block, 3)
            p, ds = block_grads(i, j, q_blk, k_blk, v_blk)
            dv_acc += jnp.einsum(
                "bhgqk,bhgqd->bhkd", p.astype(v.dtype), _slice(d_out, i, block, 3), preferred_element_type=jnp.float32
            )
            dk_acc += jnp.einsum("bhgqk,bhgqd->bhkd", ds.astype(q.dtype), q_blk, preferred_element_type=jnp.float32)
            return dk_acc, dv_acc

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        dk_blk, dv_blk = jax.lax.fori_loop(*_query_blocks(j, block, n_blocks, sliding_window), query_block, (zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, (dk_blk * scale).astype(k.dtype), j * block, axis=2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_blk.astype(v.dtype), j * block, axis=2)
        return dk, dv

    dq = jax.lax.fori_loop(0, n_blocks, dq_block, jnp.zeros_like(q))
    dk, dv = jax.lax.fori_loop(0, n_blocks, dkv_block, (jnp.zeros_like(k), jnp.zeros_like(v)))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _blockwise(q, k, v, block: int, length: int, sliding_window: Optional[int]):
    out, _ = _forward(q, k, v, block=block, length=length, sliding_window=sliding_window)
    return out


def _blockwise_fwd(q, k, v, block, length, sliding_window):
    out, lse = _forward(q, k, v, block=block, length=length, sliding_window=sliding_window)
    return out, (q, k, v, out, lse)


def _blockwise_bwd(block, length, sliding_window, residuals, d_out):
    return _backward(*residuals, d_out, block=block, length=length, sliding_window=sliding_window)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    sliding_window: Optional[int],
    *,
    block_size: int = DEFAULT_BLOCK,
) -> Float[Array, "batch seq heads head_dim"]:
    """Memory-efficient causal attention: never holds more than one block x block of scores.

    Equal to `reference_attention` (float32: to rounding); any sequence length (padded to a
    whole number of blocks inside); block_size is clipped to the sequence.
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    block = min(block_size, length)
    padded = -(-length // block) * block

    def head_major(x: Array, *group: int) -> Array:
        # [b, T, h, d] -> [b, kv_heads, (groups,) T_padded, d]
        x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
        x = x.reshape(batch, padded, kv_heads, *group, head_dim)
        return jnp.moveaxis(x, 1, -2)

    out = _blockwise(
        head_major(q, heads // kv_heads), head_major(k), head_major(v), block, length, sliding_window
    )
    out = jnp.moveaxis(out, -2, 1).reshape(batch, padded, heads, head_dim)
    return out[:, :length]


# ---------------------------------------------------------------------------------------------
# Dispatch


def resolve_implementation(implementation: str, dtype) -> str:
    """The concrete kernel for `implementation` on this platform ("auto" picks per platform)."""
    if implementation != "auto":
        return implementation
    platform = jax.default_backend()
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"  # cuDNN's fused flash attention takes half precision only
    if platform == "tpu":
        return "splash"
    return "blockwise"


def attend(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    sliding_window: Optional[int],
    implementation: str,
    constrain=None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention over [batch, seq, heads, head_dim] by the named implementation.

    `constrain` (the model's activation sharding) matters only to kernels that GSPMD cannot
    partition (splash): they run once per shard of its mesh.
    """
    implementation = resolve_implementation(implementation, q.dtype)
    if implementation == "reference":
        return reference_attention(q, k, v, sliding_window)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, sliding_window)
    if implementation == "splash":
        from .splash import splash_attention  # imports Pallas

        kernel = functools.partial(splash_attention, sliding_window=sliding_window)
        mesh = getattr(constrain, "mesh", None)
        if mesh is not None and mesh.size > 1:
            # A Mosaic kernel cannot be split by the compiler: run it on each shard's batch
            # rows and heads (attention never mixes either).
            q_spec, kv_spec = constrain.spec(q.shape, HEADS), constrain.spec(k.shape, KV_HEADS)
            kernel = jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
        return kernel(q, k, v)
    # "xla" / "cudnn": jax's own. Its window is (left, right) tokens besides the query.
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=window, implementation=implementation
    )
