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
elsewhere. The platform is the one the program is compiled *for*: the mesh's devices, which
are abstract TPU or GPU devices when a CPU host compiles ahead of time for a target
(`olmo_eqx.plan`), never the host's `jax.default_backend()`.
"""

import functools
import math
from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

DEFAULT_BLOCK = 512
# The checkpoint name of attention's output (its context, before the output projection), by
# which the remat policies keep it (models/olmo3.py); splash's kernel names its own residuals so.
CONTEXT_NAME = "attention_context"
# Splash's block on a TPU (capped at the padded sequence): at 16 x 4096 tokens on a v5e,
# 1024-blocks beat 512 for both OLMo 3 190M and 600M (docs/performance.md, "Speed on TPU").
SPLASH_BLOCK = 1024
# On CPU small blocks keep a block pair's scores in cache: attention's forward and backward
# at the 12.6M benchmark model's shapes (seq 256, 4 heads of 64) take 31 ms with one 256-block,
# 17 ms with 128-blocks and 12 ms with 64-blocks (PyTorch's sdpa: 9 ms); 32-blocks are slower.
CPU_BLOCK = 64
# Up to this many query blocks, with a mask known when tracing (no segment ids, queries from
# position 0), the block loops run in Python: every slice and mask is a constant XLA folds,
# and no while loop runs. Longer sequences keep the compact fori_loops.
UNROLL_BLOCKS = 4


def target_platform(mesh=None) -> str:
    """The platform a program is compiled for: its mesh's devices ("tpu" for the abstract
    devices of an ahead-of-time TPU compile on a CPU host), else JAX's default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def program_platform(constrain) -> str:
    """`target_platform` of the mesh a model's activation sharding (`constrain`) pins to: what
    every layer that picks a form by platform (attention's kernel, RoPE's rotation, unrolled
    layers) must agree on, so that a plan compiled for a TPU from a CPU host is the chip's program."""
    return target_platform(getattr(constrain, "mesh", None))


def default_block_size(platform: Optional[str] = None) -> int:
    """The attention kernels' block: `CPU_BLOCK` on CPU, `DEFAULT_BLOCK` on accelerators."""
    return CPU_BLOCK if (platform or jax.default_backend()) == "cpu" else DEFAULT_BLOCK

# Logical axes of attention's inputs and outputs (see `olmo_eqx.sharding.ShardingRules`).
HEADS = ("batch", "sequence", "act_heads", "head_dim")
KV_HEADS = ("batch", "sequence", "act_kv_heads", "head_dim")


class AttentionMask(eqx.Module):
    """Who may attend to whom, the one description every attention implementation reads.

    Always causal. `sliding_window` W: query i sees keys i-W+1 .. i (the query itself
    included). `segment_ids` (packed documents, intra-document masking): query and key must
    carry the same id; ids must be non-decreasing along each row, as packing produces them.
    """

    sliding_window: Optional[int] = eqx.field(static=True, default=None)
    segment_ids: Optional[Int[Array, "batch seq"]] = None


def reference_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    mask: AttentionMask = AttentionMask(),
) -> Float[Array, "batch seq heads head_dim"]:
    """Plain masked attention, written for clarity; tests hold the fast paths against it."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    scores = jnp.where(_dense_mask(mask, q.shape[0], q.shape[1]), scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _dense_mask(mask: AttentionMask, batch: int, length: int) -> Array:
    """[batch, 1, seq, seq] boolean: the whole mask at once (for the T x T implementations)."""
    positions = jnp.arange(length)
    allowed = _allowed(positions, positions, length, mask.sliding_window)[None, None]
    if mask.segment_ids is not None:
        seg = mask.segment_ids
        allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    return jnp.broadcast_to(allowed, (batch, 1, length, length))


def _allowed(query: Int[Array, " q"], key: Int[Array, " k"], length: int, sliding_window: Optional[int]) -> Array:
    """[q, k] mask: causal, inside the window (which includes the query itself), a real key."""
    query, key = query[:, None], key[None, :]
    allowed = (key <= query) & (key < length)
    if sliding_window is not None:
        allowed &= key > query - sliding_window
    return allowed


# ---------------------------------------------------------------------------------------------
# The blockwise kernel. Inside it, arrays are block-major, then head-major, padded to whole
# blocks, so that a block is one contiguous slab (taking it out is free, not a strided copy):
#   q, dq, out, d_out: [n_q, batch, kv_heads, groups, block, head_dim]   (query head = kv_head * groups + g)
#   k, v, dk, dv:      [n_k, batch, kv_heads, block, head_dim]
#   lse, delta:        [n_q, batch, kv_heads, groups, block]             (float32)
# Queries may be a slice of the keys' sequence starting at `q_offset` (context parallelism:
# this shard's queries against every key).


class _Static(NamedTuple):
    block: int
    length: int  # real keys (the rest is padding)
    sliding_window: Optional[int]
    unrolled: bool = False  # block loops in Python (see UNROLL_BLOCKS); queries start at 0


class _Layout(NamedTuple):
    """The traced part of the mask: query offset, segment ids, and the block ranges they allow."""

    q_offset: Array
    seg_q: Optional[Array]  # [batch, Tq]
    seg_k: Optional[Array]  # [batch, Tk]
    first_key_block: Optional[Array]  # [n_q]: no key block before it shares a document with the query block
    end_query_block: Optional[Array]  # [n_k]: no query block from it on shares a document with the key block


def _layout(q_offset, seg_q, seg_k, block: int, n_q: int) -> _Layout:
    if seg_k is None:
        return _Layout(jnp.asarray(q_offset, jnp.int32), None, None, None, None)
    positions = jnp.arange(seg_k.shape[1])
    starts = jnp.where(jnp.diff(seg_k, axis=1, prepend=seg_k[:, :1] - 1) != 0, positions, 0)
    doc_start = jax.lax.cummax(starts, axis=1)  # first position of each key's document
    ends = jnp.where(jnp.diff(seg_k, axis=1, append=seg_k[:, -1:] + 1) != 0, positions, positions[-1])
    doc_end = jax.lax.cummin(ends, axis=1, reverse=True)  # last position of each key's document
    query_starts = q_offset + jnp.arange(n_q) * block
    first_key = jnp.min(jnp.take(doc_start, query_starts, axis=1), axis=0) // block
    last_keys = jnp.arange(seg_k.shape[1] // block) * block + block - 1
    end_query = (jnp.max(jnp.take(doc_end, last_keys, axis=1), axis=0) - q_offset) // block + 1
    return _Layout(jnp.asarray(q_offset, jnp.int32), seg_q, seg_k, first_key, end_query)


# Block bounds are Python ints in unrolled kernels and traced integers otherwise.
def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _offset(st: _Static, lay: _Layout):
    return 0 if st.unrolled else lay.q_offset


def _loop(first, end, body, init):
    """`fori_loop`, run in Python when both bounds are known when tracing."""
    if isinstance(first, int) and isinstance(end, int):
        for i in range(first, end):
            init = body(i, init)
        return init
    return jax.lax.fori_loop(first, end, body, init)


def _key_blocks(i, st: _Static, lay: _Layout, n_k: int):
    """[first, end) of the key blocks that query block i can see."""
    q_first = _offset(st, lay) + i * st.block
    first = 0 if st.sliding_window is None else _max(q_first - st.sliding_window + 1, 0) // st.block
    if lay.first_key_block is not None:
        first = jnp.maximum(first, lay.first_key_block[i])
    return first, _min((q_first + st.block - 1) // st.block + 1, n_k)  # causal: up to the diagonal


def _query_blocks(j, st: _Static, lay: _Layout, n_q: int):
    """[first, end) of the query blocks that can see key block j."""
    k_last = j * st.block + st.block - 1
    offset = _offset(st, lay)
    first = _max(j * st.block - offset, 0) // st.block  # causal: queries at or after the keys
    end = n_q
    if st.sliding_window is not None:
        end = _min(end, _max(k_last + st.sliding_window - 1 - offset, -1) // st.block + 1)
    if lay.end_query_block is not None:
        end = jnp.minimum(end, lay.end_query_block[j])
    return first, _max(end, first)


def _slice(x: Array, start, block: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start * block, block, axis=axis)


def _block(x: Array, i) -> Array:
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _set_block(x: Array, i, value: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), i, 0)


def _block_scores(q_blk, k_blk, i, j, st: _Static, lay: _Layout, scale: float):
    """Scaled scores of query block i against key block j, -inf where masked: [b, h, g, q, k] f32."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    positions = jnp.arange(st.block)
    allowed = _allowed(_offset(st, lay) + i * st.block + positions, j * st.block + positions, st.length, st.sliding_window)
    allowed = allowed[None, None, None]
    if lay.seg_q is not None:
        same = _slice(lay.seg_q, i, st.block, 1)[:, :, None] == _slice(lay.seg_k, j, st.block, 1)[:, None, :]
        allowed = allowed & same[:, None, None]
    return jnp.where(allowed, s, -jnp.inf)


def _forward(q, k, v, lay: _Layout, st: _Static):
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[0], k.shape[0]
    b, h, g, _, d = q.shape[1:]

    def query_block(i, carry):
        out, lse = carry
        q_blk = _block(q, i)

        def key_block(j, stats):
            m, l, acc = stats
            s = _block_scores(q_blk, _block(k, j), i, j, st, lay, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not nan.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            correction = jnp.exp(m - shift)
            v_blk = _block(v, j)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, l * correction + jnp.sum(p, axis=-1), acc * correction[..., None] + pv

        init = (
            jnp.full((b, h, g, st.block), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, g, st.block), jnp.float32),
            jnp.zeros((b, h, g, st.block, d), jnp.float32),
        )
        m, l, acc = _loop(*_key_blocks(i, st, lay, n_k), key_block, init)
        # Every real query sees at least itself; a padding row may see nothing: its output is
        # 0 and its lse +inf, so the backward pass gives it probabilities of exactly 0.
        seen = l > 0
        row_out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        row_lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return _set_block(out, i, row_out), _set_block(lse, i, row_lse)

    init = (jnp.zeros_like(q), jnp.zeros(q.shape[:-1], jnp.float32))
    return _loop(0, n_q, query_block, init)


def _backward(q, k, v, out, lse, d_out, lay: _Layout, st: _Static):
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_q, n_k = q.shape[0], k.shape[0]
    # delta_i = sum_d dO_i * O_i: the softmax Jacobian's row term, once per query.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

    def block_grads(i, j, q_blk, k_blk, v_blk):
        """(p, ds) of query block i against key block j, from the saved log-sum-exp."""
        s = _block_scores(q_blk, k_blk, i, j, st, lay, scale)
        p = jnp.exp(s - _block(lse, i)[..., None])
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", _block(d_out, i), v_blk, preferred_element_type=jnp.float32)
        return p, p * (dp - _block(delta, i)[..., None])

    # One pass (FlashAttention-2's order): each key block gathers its dk and dv over the query
    # blocks that see it (and over the query heads of its group, which is GQA's gradient of
    # the shared K/V), and adds each block pair's share to dq, accumulated in float32. Scores,
    # probabilities and dp are computed once per block pair, not once for dq and again for
    # dk/dv (that was 7 matmuls and 2 exp passes per pair; this is 5 and 1).
    def dkv_block(j, grads):
        dq, dk, dv = grads
        k_blk, v_blk = _block(k, j), _block(v, j)

        def query_block(i, acc):
            dk_t, dv_t, dq = acc
            q_blk = _block(q, i)
            p, ds = block_grads(i, j, q_blk, k_blk, v_blk)
            d_out_blk = _block(d_out, i)
            # dk and dv are gathered transposed, [d, k] = [d, q] @ [q, k]: contracting over the
            # queries this way transposes the [q, d] operand, not the 4x larger [q, k] block.
            dv_t += jnp.einsum("bhgqd,bhgqk->bhdk", d_out_blk, p.astype(v.dtype), preferred_element_type=jnp.float32)
            dk_t += jnp.einsum("bhgqd,bhgqk->bhdk", q_blk, ds.astype(q.dtype), preferred_element_type=jnp.float32)
            dq_blk = _block(dq, i) + jnp.einsum(
                "bhgqk,bhkd->bhgqd", ds.astype(k.dtype), k_blk, preferred_element_type=jnp.float32
            )
            return dk_t, dv_t, _set_block(dq, i, dq_blk)

        *batch_heads, keys, head_dim = k_blk.shape
        zeros = jnp.zeros((*batch_heads, head_dim, keys), jnp.float32)
        dk_t, dv_t, dq = _loop(*_query_blocks(j, st, lay, n_q), query_block, (zeros, zeros, dq))
        # The barrier keeps XLA from folding the transpose back into the matmuls (one query
        # block: no loop), which would bring the large transposed copy back.
        dk_blk, dv_blk = (jnp.swapaxes(t, -1, -2) for t in jax.lax.optimization_barrier((dk_t, dv_t)))
        return dq, _set_block(dk, j, dk_blk * scale), _set_block(dv, j, dv_blk)

    zeros = (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v))
    dq, dk, dv = _loop(0, n_k, dkv_block, zeros)
    return (dq * scale).astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q, k, v, lay: _Layout, st: _Static):
    return _forward(q, k, v, lay, st)[0]


def _blockwise_fwd(q, k, v, lay, st):
    out, lse = _forward(q, k, v, lay, st)
    return out, (q, k, v, out, lse, lay)


def _blockwise_bwd(st, residuals, d_out):
    q, k, v, out, lse, lay = residuals
    # The layout (offsets, segment ids) is integer data: no cotangent.
    return (*_backward(q, k, v, out, lse, d_out, lay, st), None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    mask: AttentionMask = AttentionMask(),
    *,
    block_size: Optional[int] = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Memory-efficient causal attention: never holds more than one block x block of scores.

    Equal to `reference_attention` (float32: to rounding); any sequence length (padded to a
    whole number of blocks inside); block_size (default `default_block_size()`) is clipped to
    the sequence. Blocks that no query may see (causal band, window, other documents) are
    never visited.
    """
    block_size = block_size or default_block_size()
    return _attention_of_shard(q, k, v, mask.sliding_window, mask.segment_ids, mask.segment_ids, 0, block_size)


def _attention_of_shard(q, k, v, sliding_window, seg_q, seg_k, q_offset, block_size: int):
    """Queries (starting at position `q_offset` of the keys' sequence) against all keys."""
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    block = min(block_size, q_len, k_len)
    q_pad, k_pad = -(-q_len // block) * block, -(-k_len // block) * block

    def block_major(x: Array, padded: int, *group: int) -> Array:
        # [b, T, h, d] -> [T_padded / block, b, kv_heads, (groups,) block, d]
        x = jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
        x = x.reshape(batch, padded // block, block, kv_heads, *group, head_dim)
        return jnp.moveaxis(x, (1, 2), (0, -2))

    def pad_segments(seg, padded):  # padding continues the last document; the length mask hides it
        return None if seg is None else jnp.pad(seg, ((0, 0), (0, padded - seg.shape[1])), mode="edge")

    lay = _layout(q_offset, pad_segments(seg_q, q_pad), pad_segments(seg_k, k_pad), block, q_pad // block)
    unrolled = seg_q is None and isinstance(q_offset, int) and q_offset == 0 and q_pad // block <= UNROLL_BLOCKS
    out = _blockwise(
        block_major(q, q_pad, heads // kv_heads), block_major(k, k_pad), block_major(v, k_pad), lay,
        _Static(block, k_len, sliding_window, unrolled),
    )
    out = jnp.moveaxis(out, (0, -2), (1, 2)).reshape(batch, q_pad, heads, head_dim)
    return out[:, :q_len]


# ---------------------------------------------------------------------------------------------
# Dispatch


def sequence_sharded(constrain, shape: tuple[int, ...]) -> bool:
    """Whether `constrain` (the model's activation sharding; `olmo_eqx.sharding.ActivationSharding`)
    splits the sequence (dimension 1) of a [batch, seq, ...] activation over the mesh: context
    parallelism. Never with the no-op `unconstrained` or a one-device mesh."""
    spec = getattr(constrain, "spec", None)
    return spec is not None and spec(shape[:2], ("batch", "sequence"))[1] is not None


def resolve_implementation(implementation: str, dtype, platform: Optional[str] = None) -> str:
    """The concrete kernel for `implementation` on `platform` (default: JAX's default backend;
    pass the target's, `target_platform(mesh)`, when compiling for another)."""
    if implementation != "auto":
        return implementation
    platform = platform or jax.default_backend()
    if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
        return "cudnn"  # cuDNN's fused flash attention takes half precision only
    if platform == "tpu":
        return "splash"
    return "blockwise"


def attend(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    mask: AttentionMask,
    *,
    implementation: str,
    constrain=None,
    block_size: Optional[int] = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention over [batch, seq, heads, head_dim] by the named implementation.

    `block_size` (blockwise and splash kernels; None: `SPLASH_BLOCK` for splash, else
    `default_block_size` of the target platform) is the query and key block.

    `constrain` is the model's activation sharding (`olmo_eqx.sharding.ActivationSharding`).
    When it shards the sequence (context parallelism) attention runs per shard: each shard's
    queries against K/V all-gathered over the context axis (llama3-style), with the blockwise
    kernel. Kernels the compiler cannot partition (splash) also run per shard.
    """
    platform = program_platform(constrain)
    implementation = resolve_implementation(implementation, q.dtype, platform)
    context = _attend(q, k, v, mask, implementation, platform, constrain, block_size)
    # The remat policies keep the context by this name. Splash's kernel names its own output
    # and log-sum-exp, the same context heads-major, so that its backward never reruns the
    # forward kernel: naming our transposed copy as well kept the context twice (2.7 GB more
    # for olmo3_600m at 2 x 32,768 tokens, where `save_context` then did not fit a v5e).
    return context if implementation == "splash" else checkpoint_name(context, CONTEXT_NAME)


def _attend(q, k, v, mask: AttentionMask, implementation: str, platform: str, constrain, block_size: Optional[int]):
    mesh = getattr(constrain, "mesh", None)
    # Splash tiles in multiples of 128 lanes whatever the platform; the blockwise kernel's
    # best block depends on it (cache-sized on CPU).
    block_size = block_size or (SPLASH_BLOCK if implementation == "splash" else default_block_size(platform))
    if sequence_sharded(constrain, q.shape):
        if implementation == "splash":
            from .splash import context_parallel_splash  # imports Pallas

            return context_parallel_splash(
                q, k, v, sliding_window=mask.sliding_window, segment_ids=mask.segment_ids, mesh=mesh,
                q_spec=constrain.spec(q.shape, HEADS), kv_spec=constrain.spec(k.shape, KV_HEADS),
                interpret=platform != "tpu", block_size=block_size,
            )
        if implementation != "blockwise":
            raise ValueError(
                f"attention_impl={implementation!r} cannot run with the sequence sharded over the mesh "
                "(context parallelism); use attention_impl=blockwise, splash or auto"
            )
        return _context_parallel(q, k, v, mask, constrain, block_size)
    if implementation == "reference":
        return reference_attention(q, k, v, mask)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, mask, block_size=block_size)
    if implementation == "splash":
        from .splash import splash_attention  # imports Pallas

        kernel = functools.partial(
            splash_attention, sliding_window=mask.sliding_window, interpret=platform != "tpu", block_size=block_size
        )
        if mesh is None or mesh.size == 1:
            return kernel(q, k, v, segment_ids=mask.segment_ids)
        # A Mosaic kernel cannot be split by the compiler: run it on each shard's batch rows
        # and heads (attention never mixes either).
        q_spec, kv_spec = constrain.spec(q.shape, HEADS), constrain.spec(k.shape, KV_HEADS)
        segments = mask.segment_ids
        if segments is None:
            segments = jnp.zeros(q.shape[:2], jnp.int32)  # one document per row
        per_shard = jax.shard_map(
            lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg),
            mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, jax.sharding.PartitionSpec(q_spec[0], None)),
            out_specs=q_spec,
            check_vma=False,
        )
        return per_shard(q, k, v, segments)
    if mask.segment_ids is not None and implementation != "xla":
        raise ValueError(
            f"attention_impl={implementation!r} does not take document masking (segment ids) here; "
            "use attention_impl=blockwise, splash or auto"
        )
    if mask.segment_ids is not None:  # "xla" holds T x T anyway: hand it the whole mask
        dense = _dense_mask(mask, q.shape[0], q.shape[1])
        return jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla")
    # "xla" / "cudnn": jax's own. Its window is (left, right) tokens besides the query.
    window = None if mask.sliding_window is None else (mask.sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=window, implementation=implementation
    )


def _context_parallel(q, k, v, mask: AttentionMask, constrain, block_size: int) -> Array:
    """Attention with the sequence sharded: every shard's queries against all keys."""
    q_spec, kv_spec = constrain.spec(q.shape, HEADS), constrain.spec(k.shape, KV_HEADS)
    context = q_spec[1]  # the mesh axis (or axes) the sequence is split over
    seg_spec = jax.sharding.PartitionSpec(q_spec[0], context)
    segments = mask.segment_ids
    if segments is None:  # one document per row: every key shares it
        segments = jnp.zeros(q.shape[:2], jnp.int32)

    def shard(q, k, v, seg):
        gather = functools.partial(jax.lax.all_gather, axis_name=context, axis=1, tiled=True)
        offset = jax.lax.axis_index(context) * q.shape[1]
        return _attention_of_shard(q, gather(k), gather(v), mask.sliding_window, seg, gather(seg), offset, block_size)

    run = jax.shard_map(
        shard, mesh=constrain.mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec, check_vma=False
    )
    return run(q, k, v, segments)
