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
from jaxtyping import Array, Float

# Splash tiles the sequence in blocks whose sizes must be multiples of the TPU lane width.
LANES = 128


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=64)
def _kernel(
    seq: int, heads: int, sliding_window: Optional[int], block: int, interpret: bool
) -> splash.SplashAttentionKernel:
    # Building a kernel walks the mask block by block in numpy; cache it so each layer kind
    # pays that once per shape, not once per trace.
    if sliding_window is None:
        mask = masks.CausalMask((seq, seq))
    else:
        # Splash's left window counts keys besides the query: key j is allowed iff
        # i - left <= j <= i, so OLMo's W (query included) is left = W - 1.
        mask = masks.LocalMask((seq, seq), window_size=(sliding_window - 1, 0), offset=0)
    # Without the backward block sizes the kernel has no VJP.
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # The first call usually comes from inside a jit/shard_map trace, where the kernel's
    # jnp.array(mask info) would be a tracer that the cache leaks into the next trace: build
    # eagerly and keep the mask info as numpy, which every later trace embeds as a constant.
    with jax.ensure_compile_time_eval():
        kernel = splash.make_splash_mha_single_device(
            masks.MultiHeadMask([mask] * heads), block_sizes=sizes, interpret=interpret
        )
    return jax.tree.map(np.asarray, kernel)


def splash_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    *,
    sliding_window: Optional[int],
    interpret: Optional[bool] = None,
    block_size: int = 512,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal attention, optionally limited to the last `sliding_window` keys (query included).

    Same contract as `reference_attention`. `interpret=True` runs the kernel's own numerics on
    CPU; the default (None) interprets everywhere but on a TPU, so tests can run this path.
    One device's kernel: under a multi-device mesh call it per shard (`attention.attend` does).
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if block_size % LANES:
        raise ValueError(f"splash block_size must be a multiple of {LANES}, got {block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    seq = q.shape[1]
    if sliding_window is not None and sliding_window >= seq:
        sliding_window = None  # a window wider than the sequence is plain causal
    block = min(block_size, _round_up(seq, LANES))
    padded = _round_up(seq, block)
    # Padded keys sit after every real query, so the causal mask already hides them from the
    # rows we keep; the padded query rows attend to something finite and are sliced off.
    pad = [(0, 0), (0, padded - seq), (0, 0), (0, 0)]
    # The kernel does not scale the logits itself.
    q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
    # The kernel wants [heads, seq, head_dim] per example; GQA is native (query head h reads
    # kv head h // (heads // kv_heads)), so K and V are never repeated.
    q, k, v = (jnp.swapaxes(jnp.pad(x, pad), 1, 2) for x in (q, k, v))
    kernel = _kernel(padded, q.shape[1], sliding_window, block, interpret)
    out = jax.vmap(kernel)(q, k, v)
    return jnp.swapaxes(out, 1, 2)[:, :seq]
