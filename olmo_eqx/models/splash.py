"""Splash attention (the TPU Pallas flash-attention kernel) behind the model's attention signature.

This is the TPU path of `model.attention_impl=auto`: XLA's own attention materializes the
[seq, seq] scores, and `jax.nn.dot_product_attention`'s fused kernels exist only for GPUs.
Splash skips the key blocks a causal or sliding-window mask rules out entirely, so a sliding
layer costs O(seq * window), not O(seq^2).

The adapter only bridges conventions: our [batch, seq, heads, head_dim] layout against the
kernel's per-example [heads, seq, head_dim]; OLMo's window (which counts the query itself)
against splash's (left, right) window; the 1/sqrt(head_dim) scale, which splash leaves to its
caller; and sequence lengths that are not a multiple of the kernel's block size.
"""

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

# Splash tiles the sequence in blocks whose sizes must be multiples of the TPU lane width.
LANES = 128


# The most key blocks for which the backward pass always runs as one fused kernel (see _kernel).
FUSED_BACKWARD_MAX_KEY_BLOCKS = 4
# Past that, a causal (full-attention) layer still fuses while one sequence's partial dq copies
# take at most this many bytes (see _kernel): olmo3_190m's at 32,768 tokens (1.5 GiB); a
# layer with more runs its heads in groups that stay under it (head_groups), as olmo3_600m's
# do (2 GiB for all 16 heads took its step with the full layers' context kept to 16.51 GiB of
# a v5e's 15.75).
FUSED_BACKWARD_MAX_DQ_BYTES = int(1.5 * 2**30)
# The checkpoint name of the attention context (attention.CONTEXT_NAME, which `attend` leaves to
# this kernel's own residuals).
RESIDUAL_NAME = "attention_context"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def key_block(seq: int, block_size: int, sliding_window: Optional[int] = None, *, context_parallel: bool = False) -> int:
    """The key block of the forward and dk/dv kernels: `block_size`, but twice that on a causal
    layer of more than FUSED_BACKWARD_MAX_KEY_BLOCKS blocks (fewer grid steps; half the fused
    backward's partial dq copies). olmo3_190m's 12 heads of 64 at 2 x 32,768 tokens on a v5e,
    per layer: forward 54.6 -> 48.6 ms, dk/dv 5.8 ms less (`scripts/bench_splash.py`)."""
    block = min(block_size, _round_up(seq, LANES))
    padded = _round_up(seq, block)
    long = padded // block > FUSED_BACKWARD_MAX_KEY_BLOCKS
    if long and sliding_window is None and not context_parallel and padded % (2 * block) == 0:
        return 2 * block
    return block


def fused_backward(
    seq: int,
    block_size: int,
    *,
    heads: Optional[int] = None,
    head_dim: int = LANES,
    sliding_window: Optional[int] = None,
) -> bool:
    """Whether the backward pass of a `seq`-token sequence in `block_size` blocks runs as one
    fused kernel (see _kernel), as `splash_attention` pads and blocks it, for a layer of
    `heads` heads of `head_dim` with `sliding_window` (None: causal over the whole sequence).
    Without `heads`, only the key-block rule (context parallelism's kernels)."""
    block = min(block_size, _round_up(seq, LANES))
    padded = _round_up(seq, block)
    if padded // block <= FUSED_BACKWARD_MAX_KEY_BLOCKS:
        return True
    if heads is None or (sliding_window is not None and sliding_window < seq):
        return False
    # One bf16 dq per key block of the dk/dv kernel, its head_dim padded to the 128 lanes of
    # the TPU's tiles.
    key_blocks = padded // key_block(seq, block_size, sliding_window)
    return key_blocks * heads * padded * _round_up(head_dim, LANES) * 2 <= FUSED_BACKWARD_MAX_DQ_BYTES


def head_groups(
    seq: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    *,
    head_dim: int = LANES,
    sliding_window: Optional[int] = None,
) -> int:
    """In how many groups of heads, one group at a time, a layer's kernel runs: the fewest that
    let a long causal layer's backward fuse (its partial dq copies under
    FUSED_BACKWARD_MAX_DQ_BYTES in each group), 1 where all heads fuse at once or no split
    does. A group takes whole kv heads with their query heads (GQA's grouping). olmo3_600m's
    16 heads of 80 at 2 x 32,768 tokens: 2 groups of 8 (a full layer fused, forward and
    backward, 258 -> 214 ms on a v5e, `scripts/bench_splash.py`; its step 4.274 -> 4.089 s)."""
    fuses = functools.partial(fused_backward, seq, block_size, head_dim=head_dim, sliding_window=sliding_window)
    if fuses(heads=heads):
        return 1
    for groups in range(2, kv_heads + 1):
        if kv_heads % groups == 0 and fuses(heads=heads // groups):
            return groups
    return 1


def block_sizes(
    seq: int, heads: int, sliding_window: Optional[int], block: int, q_seq_shards: int = 1, head_dim: int = LANES
) -> splash.BlockSizes:
    """The kernel's blocks for a `seq`-token (padded) layer in `block`-token blocks (see _kernel)."""
    layer = dict(heads=heads, head_dim=head_dim, sliding_window=sliding_window) if q_seq_shards == 1 else {}
    fused = fused_backward(seq, block, **layer)
    keys = key_block(seq, block, sliding_window, context_parallel=q_seq_shards > 1)
    # A long layer's forward scores half a block of keys (512) at a time: a sliding-window
    # layer's 17.0 -> 15.5 ms, a causal one's inside its 2x key blocks 48.6 -> 46.1 ms (the
    # 190m's at 2 x 32,768 on a v5e; the 600m's causal 66.9 -> 64.0).
    long = seq // block > FUSED_BACKWARD_MAX_KEY_BLOCKS and q_seq_shards == 1
    compute = block // 2 if long and block % (2 * LANES) == 0 else block
    return splash.BlockSizes(
        block_q=block,
        block_kv=keys,
        block_kv_compute=compute,
        block_q_dkv=block,
        block_kv_dkv=keys,
        block_kv_dkv_compute=block,
        block_q_dq=None if fused else block,
        block_kv_dq=None if fused else block,
        use_fused_bwd_kernel=fused,
    )


@functools.lru_cache(maxsize=64)
def _kernel(
    seq: int,
    heads: int,
    sliding_window: Optional[int],
    block: int,
    interpret: bool,
    q_seq_shards: int = 1,
    head_dim: int = LANES,
) -> splash.SplashAttentionKernel:
    # Building a kernel walks the mask block by block in numpy; cache it so each layer kind
    # pays that once per shape, not once per trace.
    if sliding_window is None:
        mask = masks.CausalMask((seq, seq))
    else:
        # Splash's left window counts keys besides the query: key j is allowed iff
        # i - left <= j <= i, so OLMo's W (query included) is left = W - 1.
        mask = masks.LocalMask((seq, seq), window_size=(sliding_window - 1, 0), offset=0)
    # Without the backward block sizes the kernel has no VJP. One fused backward kernel forms
    # dq beside dk and dv (the separate dq kernel would compute the scores a third time):
    # olmo3_600m on a v5e, full remat, 16 x 4096: 3.29 -> 3.15 s a step (docs/performance.md).
    # It writes one partial dq per key block (key_block's) and sums them after, so it holds
    # that many copies of dq: fine at 4 (4096 tokens in 1024-token blocks). Past that only a
    # causal layer fuses, and only while the copies stay small (FUSED_BACKWARD_MAX_DQ_BYTES;
    # splash_attention then runs the examples, and groups of heads, one at a time): on
    # olmo3_190m at 32,768 tokens a full layer's backward went 138 -> 99 ms. A sliding-window
    # layer keeps the separate dq kernel: the fused kernel walks every (query, key) block pair,
    # masked ones too, and ran no faster there (37 ms against 38), holding 32 copies for
    # nothing (docs/performance.md, long sequences).
    # Context parallelism's kernels (q_seq_shards > 1) keep the key-block rule: not measured past it.
    sizes = block_sizes(seq, heads, sliding_window, block, q_seq_shards, head_dim)
    # The first call usually comes from inside a jit/shard_map trace, where the kernel's
    # jnp.array(mask info) would be a tracer that the cache leaks into the next trace: build
    # eagerly and keep the mask info as numpy, which every later trace embeds as a constant.
    # q_seq_shards > 1 lays the mask info out per query shard (context parallelism), so that
    # shard_map hands each device the blocks of its own queries.
    with jax.ensure_compile_time_eval():
        kernel = splash.make_splash_mha(
            masks.MultiHeadMask([mask] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=q_seq_shards,
            # Names the kernel's output and log-sum-exp (the residuals its backward needs) like
            # the context attention.attend names, so a remat policy that keeps the context
            # keeps these too and the backward pass never runs the forward kernel again.
            residual_checkpoint_name=RESIDUAL_NAME,
            interpret=interpret,
        )
    return jax.tree.map(np.asarray, kernel)


def _segments(segment_ids: Optional[Array], q_ids: Optional[Array] = None):
    """Per-example splash SegmentIds (query ids may be a shard of the key ids), or None."""
    if segment_ids is None:
        return None
    return splash.SegmentIds(q=segment_ids if q_ids is None else q_ids, kv=segment_ids)


def splash_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    sliding_window: Optional[int],
    segment_ids: Optional[Int[Array, "batch seq"]] = None,
    interpret: Optional[bool] = None,
    block_size: int = 512,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention, optionally limited to the last `sliding_window` keys (query included)
    and to keys of the query's own document (`segment_ids`, intra-document masking).

    Same contract as `reference_attention`. `interpret=True` runs the kernel's own numerics on
    CPU; the default (None) interprets everywhere but on a TPU, so tests can run this path.
    One device's kernel: under a multi-device mesh call it per shard (`attention.attend` does).
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    _check(block_size, sliding_window)
    seq = q.shape[1]
    if sliding_window is not None and sliding_window >= seq:
        sliding_window = None  # a window wider than the sequence is plain causal
    block = min(block_size, _round_up(seq, LANES))
    padded = _round_up(seq, block)
    # Padded keys sit after every real query, so the causal mask already hides them from the
    # rows we keep; the padded query rows attend to something finite and are sliced off.
    pad = [(0, 0), (0, padded - seq), (0, 0), (0, 0)]
    if segment_ids is not None:  # padding continues the last document; causality hides it
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, padded - seq)], mode="edge")
    q, k, v = (_heads_major(jnp.pad(x, pad)) for x in (_scaled(q), k, v))
    batch, heads, _, head_dim = q.shape
    groups = head_groups(padded, block, heads, k.shape[1], head_dim=head_dim, sliding_window=sliding_window)
    kernel = _kernel(padded, heads // groups, sliding_window, block, interpret, head_dim=head_dim)

    def one(q, k, v, seg):
        return kernel(q, k, v, segment_ids=_segments(seg))

    if padded // block > FUSED_BACKWARD_MAX_KEY_BLOCKS:
        # A long sequence runs one example (and one group of heads, head_groups) at a time:
        # a fused backward's partial dq copies were sized for one (fused_backward), and on
        # olmo3_190m at 2 x 32,768 tokens this also took 70 ms of copies and transposes
        # around the kernels out of the step.
        def split(x):  # [batch, heads, ...] -> [batch * groups, heads / groups, ...]
            return x.reshape(batch * groups, x.shape[1] // groups, *x.shape[2:])

        if segment_ids is not None:
            segment_ids = jnp.repeat(segment_ids, groups, axis=0)
        out = jax.lax.map(lambda args: one(*args), (split(q), split(k), split(v), segment_ids))
        out = out.reshape(batch, heads, *out.shape[2:])
    else:
        out = jax.vmap(one)(q, k, v, segment_ids)
    return jnp.swapaxes(out, 1, 2)[:, :seq]


def context_parallel_splash(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    sliding_window: Optional[int],
    segment_ids: Optional[Int[Array, "batch seq"]],
    mesh: jax.sharding.Mesh,
    q_spec: P,
    kv_spec: P,
    interpret: bool,
    block_size: int = 512,
) -> Float[Array, "batch seq heads head_dim"]:
    """Splash with the sequence split over a mesh axis (context parallelism, llama3-style):
    each device's queries against the keys and values all-gathered over that axis.

    `q_spec` / `kv_spec` are the activations' PartitionSpecs ([batch, seq, heads, head_dim]);
    the sequence entry names the context axis. The kernel's mask info is laid out per query
    shard (splash's `q_seq_shards`), so every device walks only the blocks of its own queries.
    """
    _check(block_size, sliding_window)
    seq, context = q.shape[1], q_spec[1]
    shards = math.prod(mesh.shape[a] for a in (context if isinstance(context, tuple) else (context,)))
    block = min(block_size, seq // shards)
    if seq % (shards * LANES) or (seq // shards) % block:
        raise ValueError(
            f"context-parallel splash attention needs the sequence ({seq}) split over {shards} devices in whole "
            f"blocks of a multiple of {LANES} tokens; choose a sequence length that is a multiple of {shards * block}"
        )
    if sliding_window is not None and sliding_window >= seq:
        sliding_window = None
    heads = q.shape[2] // math.prod(mesh.shape[a] for a in _axes(q_spec[2]))
    kernel = _kernel(seq, heads, sliding_window, block, interpret, shards)
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, context)))
    whole_kv = P(kv_spec[0], None, kv_spec[2], kv_spec[3])  # K/V all-gathered over the context axis
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)

    def shard(kernel, q, k, v, q_seg, kv_seg):
        q, k, v = (_heads_major(x) for x in (_scaled(q), k, v))
        out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=splash.SegmentIds(q=qs, kv=ks)))(
            q, k, v, q_seg, kv_seg
        )
        return jnp.swapaxes(out, 1, 2)

    run = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(kernel_spec, q_spec, whole_kv, whole_kv, P(q_spec[0], context), P(q_spec[0], None)),
        out_specs=q_spec,
        check_vma=False,
    )
    return run(kernel, q, k, v, segment_ids, segment_ids)


def _axes(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _check(block_size: int, sliding_window: Optional[int]) -> None:
    if block_size % LANES:
        raise ValueError(f"splash block_size must be a multiple of {LANES}, got {block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")


def _scaled(q: Array) -> Array:
    # The kernel does not scale the logits itself.
    return q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)


def _heads_major(x: Array) -> Array:
    # The kernel wants [heads, seq, head_dim] per example; GQA is native (query head h reads
    # kv head h // (heads // kv_heads)), so K and V are never repeated.
    return jnp.swapaxes(x, 1, 2)
