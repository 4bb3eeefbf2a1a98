"""OLMo 3 (and OLMo 2) as Equinox modules, readable top to bottom.

    tokens -> embed -> [Block x n_layers, one attention cycle at a time] -> norm -> head

A Block is the *reordered-norm* transformer block (no pre-norm):

    h   = x + attention_norm(attention(x))
    out = h + mlp_norm(mlp(h))

OLMo 3 cycles three sliding-window layers and one full-attention layer; OLMo 2 is the same
model with every layer full attention. Every array field declares its shape and its logical
axes (used by `olmo_eqx.sharding` to place it on a mesh). Linear weights are stored
[in_features, out_features], so a projection is `x @ w`.

Numerics: parameters are stored in `param_dtype` and cast to `compute_dtype` where used;
RMSNorm, RoPE and the logits are always float32.

Placement: activations carry logical axis names too. The caller may pass `constrain(x, axes)`
(`olmo_eqx.sharding.ActivationSharding`), which pins them to the mesh at the points that
decide the layout: the embedding output, every block's output, attention's q/k/v and context,
the MLP's hidden layer and the logits. Without it (one device, tests) nothing is pinned.
"""

import functools
import math
from typing import Optional

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .attention import HEADS, KV_HEADS, AttentionMask, attend, program_platform, sequence_sharded
from .base import CausalLM, Constrain, embed_tokens, over_layers, unconstrained
from .base import axes as _axes
from .config import ModelConfig
from .quantization import quantized_matmul


# Logical axes of the activations the model pins (see `olmo_eqx.sharding.ShardingRules`).
HIDDEN = ("batch", "sequence", "act_embed")


def dense(
    x: Float[Array, "batch seq d_in"],
    weight: Float[Array, "d_in d_out"],
    constrain: Constrain = unconstrained,
    *,
    out_dtype=None,
    quantization: Optional[str] = None,
) -> Float[Array, "batch seq d_out"]:
    """`x @ weight` (weight cast to x's dtype; the result in `out_dtype`, default x's), as one
    2-D matmul over all batch x seq tokens; with `quantization` ("int8") an integer matmul
    forward and backward (`quantization.py`).

    Why 2-D: XLA:CPU turns the weight gradient of the 3-D form (a contraction over batch and
    sequence) into a transposed copy of the output gradient plus a slow transposed dot, which
    doubled the backward pass (docs/performance.md). Merging batch and sequence is a free
    reshape, except when the sequence is sharded (context parallelism): then the merged axis
    has no layout GSPMD can keep, so the 3-D form stays.
    """
    weight = weight.astype(x.dtype)
    if sequence_sharded(constrain, x.shape):
        if quantization is not None:
            return quantized_matmul(x, weight, quantization, out_dtype=out_dtype)
        return jnp.einsum("bsd,df->bsf", x, weight, preferred_element_type=out_dtype)
    flat = x.reshape(-1, x.shape[-1])
    if quantization is not None:
        flat = quantized_matmul(flat, weight, quantization, out_dtype=out_dtype)
    else:
        flat = jnp.matmul(flat, weight, preferred_element_type=out_dtype)
    return flat.reshape(*x.shape[:-1], weight.shape[-1])


def _truncated_normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float, dtype) -> Array:
    # OLMo's init: normal(0, std) cut at +-3 std.
    return (std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)).astype(dtype)


class RMSNorm(eqx.Module):
    weight: Float[Array, " dim"] = _axes("norm")
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*rest dim"]) -> Float[Array, "*rest dim"]:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight.astype(jnp.float32) * normed).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding (rotate-half, non-interleaved), always float32.


def rope_inverse_frequencies(config: ModelConfig, *, yarn: bool) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies and the cos/sin scale (YaRN's attention factor, else 1)."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    base_freq = np.float32(config.rope_theta) ** exponents
    inv_freq = (1.0 / base_freq).astype(np.float32)
    if not yarn or config.yarn is None:
        return inv_freq, 1.0
    y = config.yarn
    scale = y.attention_factor if y.attention_factor is not None else 0.1 * math.log(y.factor) + 1.0

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(config.rope_theta)
        )

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep_original = (1 - ramp).astype(np.float32)  # high-frequency pairs extrapolate unchanged
    interpolated = (1.0 / (np.float32(y.factor) * base_freq)).astype(np.float32)
    return (interpolated * (1 - keep_original) + inv_freq * keep_original).astype(np.float32), scale


# Where RoPE's rotate-half runs as a matmul with a signed permutation (`_rotate_half_matrix`)
# rather than as slices and a concatenation of the head's halves. On a TPU the halves (40
# columns of an 80-wide head) fill a third of the 128 lanes, and XLA wrote them to memory as
# padded float32 arrays in every pass: 430 ms of a 3.01 s olmo3_600m step; with the matmul,
# 2.565 s (docs/performance.md). The matmul keeps whole heads, and its product is exact (one +-1
# term per output): on a v5e the two forms gave the same bits, forward and gradient, under jit;
# under XLA:CPU's jit they can differ where it fuses a multiply-add (one bf16 ulp, a few elements
# in a million). CPU and GPU keep the sliced form: not measured there, and a CPU pays the
# matmul's FLOPs.
ROTATE_BY_MATMUL_ON = ("tpu",)


def _rotate_half_matrix(dim: int) -> np.ndarray:
    """R with x @ R == concatenate([-x[d/2:], x[:d/2]]) (rotate-half)."""
    half = dim // 2
    matrix = np.zeros((dim, dim), np.float32)
    matrix[half + np.arange(half), np.arange(half)] = -1.0
    matrix[np.arange(half), half + np.arange(half)] = 1.0
    return matrix


def _rotated(x: Array, transpose: bool = False) -> Array:
    # HIGHEST: float32 operands pass through the MXU unrounded (bf16 ones need one pass anyway).
    matrix = _rotate_half_matrix(x.shape[-1])
    matrix = jnp.asarray(matrix.T if transpose else matrix, x.dtype)
    return jnp.einsum("...d,de->...e", x, matrix, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


@jax.custom_vjp
def _rope_by_matmul(x: Array, cos: Array, sin: Array) -> Array:
    return (x.astype(jnp.float32) * cos + _rotated(x) * sin).astype(x.dtype)


def _rope_by_matmul_forward(x, cos, sin):
    return _rope_by_matmul(x, cos, sin), (cos, sin)


def _rope_by_matmul_backward(residuals, d_out):
    # What autodiff of the sliced form computes: d_x = d*cos + rotate-half transposed (d*sin),
    # in float32, rounded once to x's dtype (the output's, so d_out's).
    cos, sin = residuals
    d = d_out.astype(jnp.float32)
    d_x = (d * cos + _rotated(d * sin, transpose=True)).astype(d_out.dtype)
    return d_x, jnp.zeros_like(cos), jnp.zeros_like(sin)


_rope_by_matmul.defvjp(_rope_by_matmul_forward, _rope_by_matmul_backward)


class Rope(eqx.Module):
    """cos/sin tables for one sequence layout, shared by every layer of one attention kind.

    `platform`: where the program runs (default: JAX's backend), which picks how rotate-half
    is computed (`ROTATE_BY_MATMUL_ON`); the values are the same either way."""

    cos: Float[Array, "#batch seq head_dim"]
    sin: Float[Array, "#batch seq head_dim"]
    by_matmul: bool = eqx.field(static=True)

    def __init__(self, positions: Int[Array, "#batch seq"], config: ModelConfig, *, yarn: bool, platform: Optional[str] = None):
        inv_freq, scale = rope_inverse_frequencies(config, yarn=yarn)
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
        angles = jnp.concatenate([angles, angles], axis=-1)
        self.cos = jnp.cos(angles) * scale
        self.sin = jnp.sin(angles) * scale
        self.by_matmul = (platform or jax.default_backend()) in ROTATE_BY_MATMUL_ON

    def __call__(self, x: Float[Array, "batch seq heads head_dim"]) -> Float[Array, "batch seq heads head_dim"]:
        cos, sin = self.cos[:, :, None, :], self.sin[:, :, None, :]
        if self.by_matmul:
            return _rope_by_matmul(x, cos, sin)
        xf = x.astype(jnp.float32)
        first, second = jnp.split(xf, 2, axis=-1)
        rotated = jnp.concatenate([-second, first], axis=-1)
        return (xf * cos + rotated * sin).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Attention: full-width QK-norm, GQA, causal with an optional sliding window. The kernels
# (reference, blockwise, cuDNN, splash) live in `attention.py`; `attend` picks one.


class Attention(eqx.Module):
    q_proj: Float[Array, "d_model q_features"] = _axes("embed", "heads", matmul=True)
    k_proj: Float[Array, "d_model kv_features"] = _axes("embed", "kv_heads", matmul=True)
    v_proj: Float[Array, "d_model kv_features"] = _axes("embed", "kv_heads", matmul=True)
    o_proj: Float[Array, "q_features d_model"] = _axes("heads", "embed", matmul=True)
    # QK-norm normalises the whole projection (all heads together), not each head.
    q_norm: RMSNorm
    k_norm: RMSNorm
    # `model.quantization` of the projections (None: the compute dtype's matmuls).
    quantization: Optional[str] = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        dtype = jnp.dtype(config.param_dtype)
        q_features = config.n_heads * config.head_dim
        kv_features = config.n_kv_heads * config.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        std = config.init_std
        self.q_proj = _truncated_normal(kq, (config.d_model, q_features), std, dtype)
        self.k_proj = _truncated_normal(kk, (config.d_model, kv_features), std, dtype)
        self.v_proj = _truncated_normal(kv, (config.d_model, kv_features), std, dtype)
        self.o_proj = _truncated_normal(ko, (q_features, config.d_model), std, dtype)
        self.q_norm = RMSNorm(q_features, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(kv_features, config.rms_norm_eps, dtype)
        self.quantization = config.quantization

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        rope: Rope,
        *,
        config: ModelConfig,
        mask: AttentionMask,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        q, k, v = self.project(x, rope, config=config, constrain=constrain)
        context = attend(
            q, k, v, mask, implementation=config.attention_impl, constrain=constrain, block_size=config.attention_block_size
        )
        return self.output(constrain(context, HEADS), constrain)

    def project(
        self, x: Float[Array, "batch seq d_model"], rope: Rope, *, config: ModelConfig, constrain: Constrain = unconstrained
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """q, k, v after QK-norm, clipping (OLMoE's `clip_qkv`, None elsewhere) and RoPE (k and v
        are what a KV cache keeps: `olmo_eqx.generate`)."""
        batch, seq, _ = x.shape
        # The names mark what the "save_projections" remat policy keeps for the backward pass.
        project = functools.partial(dense, x, constrain=constrain, quantization=self.quantization)
        q = self.q_norm(checkpoint_name(project(self.q_proj), "q_proj"))
        k = self.k_norm(checkpoint_name(project(self.k_proj), "k_proj"))
        v = checkpoint_name(project(self.v_proj), "v_proj")
        if config.clip_qkv is not None:  # after the QK-norm, before RoPE, as HF's OLMoE
            q, k, v = (jnp.clip(a, -config.clip_qkv, config.clip_qkv) for a in (q, k, v))
        q = constrain(rope(q.reshape(batch, seq, config.n_heads, config.head_dim)), HEADS)
        k = constrain(rope(k.reshape(batch, seq, config.n_kv_heads, config.head_dim)), KV_HEADS)
        v = constrain(v.reshape(batch, seq, config.n_kv_heads, config.head_dim), KV_HEADS)
        return q, k, v

    def output(
        self, context: Float[Array, "batch seq heads head_dim"], constrain: Constrain = unconstrained
    ) -> Float[Array, "batch seq d_model"]:
        """The output projection of the attention context."""
        batch, seq = context.shape[:2]
        projected = dense(context.reshape(batch, seq, -1), self.o_proj, constrain, quantization=self.quantization)
        return checkpoint_name(projected, "o_proj")


@jax.custom_vjp
def swiglu(gate: Float[Array, "*tokens hidden"], up: Float[Array, "*tokens hidden"]) -> Float[Array, "*tokens hidden"]:
    """silu(gate) * up. Its backward keeps only gate and up (which the projections produce
    anyway) and recomputes the sigmoid: autodiff of the plain expression also stores
    exp(-gate) and silu(gate), three passes over the MLP's widest activation instead of one."""
    return jax.nn.silu(gate) * up


def _swiglu_forward(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_backward(residuals, d_out):
    # The barrier keeps XLA from reusing the forward's sigmoid (common subexpressions): that
    # would store it, and silu(gate), after all, and split the forward into three passes.
    gate, up = jax.lax.optimization_barrier(residuals)
    sigmoid = jax.nn.sigmoid(gate)
    silu = gate * sigmoid
    d_gate = d_out * up * (sigmoid + silu * (1 - sigmoid))
    return d_gate, d_out * silu


swiglu.defvjp(_swiglu_forward, _swiglu_backward)


class MLP(eqx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    gate_proj: Float[Array, "d_model hidden"] = _axes("embed", "mlp", matmul=True)
    up_proj: Float[Array, "d_model hidden"] = _axes("embed", "mlp", matmul=True)
    down_proj: Float[Array, "hidden d_model"] = _axes("mlp", "embed", matmul=True)
    quantization: Optional[str] = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        dtype = jnp.dtype(config.param_dtype)
        kg, ku, kd = jax.random.split(key, 3)
        shape_in = (config.d_model, config.mlp_hidden)
        self.gate_proj = _truncated_normal(kg, shape_in, config.init_std, dtype)
        self.up_proj = _truncated_normal(ku, shape_in, config.init_std, dtype)
        self.down_proj = _truncated_normal(kd, shape_in[::-1], config.init_std, dtype)
        self.quantization = config.quantization

    def __call__(
        self, x: Float[Array, "batch seq d_model"], constrain: Constrain = unconstrained
    ) -> Float[Array, "batch seq d_model"]:
        hidden = ("batch", "sequence", "act_mlp")
        quantization = self.quantization
        gate = constrain(checkpoint_name(dense(x, self.gate_proj, constrain, quantization=quantization), "gate_proj"), hidden)
        up = constrain(checkpoint_name(dense(x, self.up_proj, constrain, quantization=quantization), "up_proj"), hidden)
        return checkpoint_name(dense(swiglu(gate, up), self.down_proj, constrain, quantization=quantization), "down_proj")


class Block(eqx.Module):
    attention: Attention
    attention_norm: RMSNorm  # HF: post_attention_layernorm
    mlp: MLP
    mlp_norm: RMSNorm  # HF: post_feedforward_layernorm

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        dtype = jnp.dtype(config.param_dtype)
        self.attention = Attention(config, key=ka)
        self.attention_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, key=km)
        self.mlp_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        rope: Rope,
        *,
        config: ModelConfig,
        mask: AttentionMask,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        attention = self.attention(x, rope, config=config, mask=mask, constrain=constrain)
        return self.after_attention(x, attention, constrain)

    def after_attention(
        self,
        x: Float[Array, "batch seq d_model"],
        attention: Float[Array, "batch seq d_model"],
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        """The rest of the block once attention's output is known (the KV-cached decode shares it)."""
        h = constrain(x + self.attention_norm(attention), HIDDEN)
        return constrain(h + self.mlp_norm(self.mlp(h, constrain)), HIDDEN)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "attention_context", "gate_proj", "up_proj", "down_proj")
# What a block keeps for its backward pass (remat); the block input is always kept.
_REMAT_POLICIES = {
    "full": None,  # save nothing inside a block; recompute it all in the backward pass
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # The OLMo 3 7B reproduction's policy (MaxText): keep the q/k/v/o and MLP projection
    # outputs and the attention context, recompute norms, RoPE, activations and the rest.
    "save_projections": jax.checkpoint_policies.save_only_these_names(*_PROJECTIONS),
    # Keep what attention needs (q/k/v and its context, so the attention kernel never runs
    # again) and recompute the MLP, whose gate/up outputs are the widest activations.
    "save_attention": jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "v_proj", "attention_context"),
    # Keep only attention's context (with the splash kernel: its output and log-sum-exp, so the
    # kernel's forward never runs again) and recompute the rest, q/k/v included: on a v5e
    # those projections cost less than a second pass of the kernel, and keep little memory.
    "save_context": jax.checkpoint_policies.save_only_these_names("attention_context"),
    # save_context's, and the two outputs each sub-block adds to the residual stream (o_proj,
    # down_proj) before its post-norm: the backward pass needs them for the norms' gradients,
    # and per byte kept they cost the most to recompute (down_proj: a matmul over the MLP's
    # whole width per element). q/k/v and gate/up are still recomputed. olmo3_600m at 16 x 4096
    # on a v5e: 92 ms less of projections a step for 0.7 GiB more (docs/performance.md).
    "save_outputs": jax.checkpoint_policies.save_only_these_names("attention_context", "o_proj", "down_proj"),
    # Keep only the q/k/v projections (MaxText's `save_qkv_proj`, its fastest OLMo 3 layout on
    # a v5e): the backward pass recomputes attention from them, and the MLP.
    "save_qkv": jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "v_proj"),
    # save_context's context, parked in host memory between the passes (TPU, GPU), where the
    # chip cannot hold every layer's. olmo3_600m at 2 x 32,768 on a v5e: the attention forward
    # no longer runs twice (600 ms less of ops), but the chip then waits on the host link for the
    # 4.3 GB a pass (heads-major, padded to 128 lanes): 4.617 s against `full`'s 4.635.
    "offload_context": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["attention_context"],
        offload_src="device",
        offload_dst="pinned_host",
    ),
    # save_projections' activations, parked in host memory between the passes (TPU, GPU):
    # HBM holds one block's at a time, the host link carries them.
    "offload_projections": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(_PROJECTIONS),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


class OLMo(CausalLM):
    """An OLMo 2 / OLMo 3 causal language model: token ids in, float32 logits out."""

    embed: Float[Array, "padded_vocab d_model"] = _axes("vocab", "embed")
    # One Block whose every array has a leading layer axis (n_layers, ...).
    blocks: Block = eqx.field(metadata={"stacked": True})
    final_norm: RMSNorm
    lm_head: Float[Array, "d_model padded_vocab"] = _axes("embed", "vocab", matmul=True)
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        dtype = jnp.dtype(config.param_dtype)
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.config = config
        self.embed = _truncated_normal(k_embed, (config.padded_vocab_size, config.d_model), config.init_std, dtype)
        make_block = lambda k: Block(config, key=k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(k_blocks, config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.lm_head = _truncated_normal(k_head, (config.d_model, config.padded_vocab_size), config.init_std, dtype)

    def hidden_states(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        """The final-normed hidden states, which the head turns into logits."""
        config = self.config
        if positions is None:  # one row of RoPE tables, broadcast over the batch
            positions = jnp.arange(tokens.shape[1])[None, :]
        else:
            positions = constrain(positions, ("batch", "sequence"))
        # Pinned here: otherwise the gather may inherit the embedding table's layout
        # (d_model over "fsdp") and every device would compute the whole global batch.
        x = embed_tokens(self.embed, tokens, config.compute_dtype, constrain)
        platform = program_platform(constrain)
        rope_sliding = Rope(positions, config, yarn=False, platform=platform)
        rope_full = Rope(positions, config, yarn=config.yarn is not None, platform=platform)
        sliding_mask = AttentionMask(config.sliding_window, segment_ids)
        full_mask = AttentionMask(None, segment_ids)

        def apply_block(block: Block, x, rope: Rope, mask: AttentionMask):
            return block(x, rope, config=config, mask=mask, constrain=constrain)

        def checkpointed(policy: str):
            return apply_block if policy == "none" else jax.checkpoint(apply_block, policy=_REMAT_POLICIES[policy])

        full_block, sliding_block = checkpointed(config.remat), checkpointed(config.remat_of(sliding=True))

        def run_cycle(x, cycle: Block):
            # One attention cycle (3 sliding + 1 full on OLMo 3), unrolled; cycles are scanned
            # (unrolled too for small models: `ModelConfig.scan_layers`).
            for j in range(config.cycle_length):
                block = jax.tree.map(lambda a: a[j], cycle)
                sliding = config.is_sliding(j)
                rope, mask = (rope_sliding, sliding_mask) if sliding else (rope_full, full_mask)
                x = (sliding_block if sliding else full_block)(block, x, rope, mask)
            return x, None

        n_cycles = config.n_layers // config.cycle_length
        cycles = jax.tree.map(lambda a: a.reshape(n_cycles, config.cycle_length, *a.shape[1:]), self.blocks)
        x, _ = over_layers(run_cycle, x, cycles, scanned=config.scanned_on(platform))
        return self.final_norm(x)

    def logits(
        self, hidden: Float[Array, "*batch d_model"], *, constrain: Constrain = unconstrained
    ) -> Float[Array, "*batch vocab"]:
        logits = jnp.einsum("...d,dv->...v", hidden, self.lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "sequence", "act_vocab"))
        # Padding rows exist for matmul alignment only; they never enter a prediction.
        return logits[..., : self.config.vocab_size]
