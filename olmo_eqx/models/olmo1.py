"""OLMo 1, the family's first decoder (HF transformers' `olmo`), readable top to bottom.

    tokens -> embed -> [Block x n_layers] -> norm -> head

A pre-norm transformer like LLaMA, with one difference: every norm is a *non-parametric*
LayerNorm (mean and variance in float32, eps 1e-5, no weight and no bias), so a norm holds no
arrays at all. No QK-norm; q, k and v may be clamped to +-`clip_qkv` right after their
projections (OLMo 1.7, "0424", uses 8.0), then RoPE, then causal attention:

    h   = x + attention(layer_norm(x))
    out = h + mlp(layer_norm(h))

Projections, RoPE, the MLP and the attention kernels are OLMo 3's (`olmo3.py`,
`attention.py`); only the block and its norms differ. As in `olmoe.py` the attention's input
norm lives inside the attention module, so the KV-cached decode (`olmo_eqx.generate`) calls
`project` / `output` / `after_attention` on this block as on OLMo 3's.
"""

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .attention import HEADS, KV_HEADS, AttentionMask, attend, program_platform
from .base import CausalLM, Constrain, embed_tokens, over_layers, unconstrained
from .base import axes as _axes
from .config import ModelConfig
from .olmo3 import _REMAT_POLICIES, HIDDEN, MLP, Rope, _truncated_normal, dense

# HF's OlmoLayerNorm fixes its epsilon; the config's rms_norm_eps does not apply to OLMo 1.
LAYER_NORM_EPS = 1e-5


class LayerNorm(eqx.Module):
    """(x - mean) / sqrt(var + eps) over the last axis in float32; no learnable parameters."""

    eps: float = eqx.field(static=True, default=LAYER_NORM_EPS)

    def __call__(self, x: Float[Array, "*rest dim"]) -> Float[Array, "*rest dim"]:
        xf = x.astype(jnp.float32)
        centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
        variance = jnp.mean(centred * centred, axis=-1, keepdims=True)
        return (centred * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)


class Attention(eqx.Module):
    """The pre-norm, q/k/v/o projections (optionally clipped q/k/v) and RoPE; GQA allowed."""

    input_norm: LayerNorm  # HF: input_layernorm (no weights)
    q_proj: Float[Array, "d_model q_features"] = _axes("embed", "heads")
    k_proj: Float[Array, "d_model kv_features"] = _axes("embed", "kv_heads")
    v_proj: Float[Array, "d_model kv_features"] = _axes("embed", "kv_heads")
    o_proj: Float[Array, "q_features d_model"] = _axes("heads", "embed")

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        dtype = jnp.dtype(config.param_dtype)
        q_features = config.n_heads * config.head_dim
        kv_features = config.n_kv_heads * config.head_dim
        kq, kk, kv, ko = jax.random.split(key, 4)
        std = config.init_std
        self.input_norm = LayerNorm()
        self.q_proj = _truncated_normal(kq, (config.d_model, q_features), std, dtype)
        self.k_proj = _truncated_normal(kk, (config.d_model, kv_features), std, dtype)
        self.v_proj = _truncated_normal(kv, (config.d_model, kv_features), std, dtype)
        self.o_proj = _truncated_normal(ko, (q_features, config.d_model), std, dtype)

    def project(
        self, x: Float[Array, "batch seq d_model"], rope: Rope, *, config: ModelConfig, constrain: Constrain = unconstrained
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """q, k, v of the block input x: norm, projections, clipping, RoPE on q and k."""
        batch, seq, _ = x.shape
        x = self.input_norm(x)
        q = checkpoint_name(dense(x, self.q_proj, constrain), "q_proj")
        k = checkpoint_name(dense(x, self.k_proj, constrain), "k_proj")
        v = checkpoint_name(dense(x, self.v_proj, constrain), "v_proj")
        if config.clip_qkv is not None:
            q, k, v = (jnp.clip(a, -config.clip_qkv, config.clip_qkv) for a in (q, k, v))
        q = constrain(rope(q.reshape(batch, seq, config.n_heads, config.head_dim)), HEADS)
        k = constrain(rope(k.reshape(batch, seq, config.n_kv_heads, config.head_dim)), KV_HEADS)
        v = constrain(v.reshape(batch, seq, config.n_kv_heads, config.head_dim), KV_HEADS)
        return q, k, v

    def output(
        self, context: Float[Array, "batch seq heads head_dim"], constrain: Constrain = unconstrained
    ) -> Float[Array, "batch seq d_model"]:
        batch, seq = context.shape[:2]
        return checkpoint_name(dense(context.reshape(batch, seq, -1), self.o_proj, constrain), "o_proj")

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


class Block(eqx.Module):
    attention: Attention
    mlp_input_norm: LayerNorm  # HF: post_attention_layernorm (the MLP's pre-norm, no weights)
    mlp: MLP

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attention = Attention(config, key=ka)
        self.mlp_input_norm = LayerNorm()
        self.mlp = MLP(config, key=km)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        rope: Rope,
        *,
        config: ModelConfig,
        mask: AttentionMask,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        return self.after_attention(x, self.attention(x, rope, config=config, mask=mask, constrain=constrain), constrain)

    def after_attention(
        self,
        x: Float[Array, "batch seq d_model"],
        attention: Float[Array, "batch seq d_model"],
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        h = constrain(x + attention, HIDDEN)
        return constrain(h + self.mlp(self.mlp_input_norm(h), constrain), HIDDEN)


class OLMo1(CausalLM):
    """An OLMo 1 causal language model: token ids in, float32 logits out."""

    embed: Float[Array, "padded_vocab d_model"] = _axes("vocab", "embed")
    blocks: Block = eqx.field(metadata={"stacked": True})  # every array: (n_layers, ...)
    final_norm: LayerNorm  # HF: model.norm (no weights)
    lm_head: Float[Array, "d_model padded_vocab"] = _axes("embed", "vocab")
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        if config.sliding_window is not None:
            raise ValueError(f"model {config.name!r}: OLMo 1 has no sliding window; set sliding_window: null")
        dtype = jnp.dtype(config.param_dtype)
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.config = config
        self.embed = _truncated_normal(k_embed, (config.padded_vocab_size, config.d_model), config.init_std, dtype)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(jax.random.split(k_blocks, config.n_layers))
        self.final_norm = LayerNorm()
        self.lm_head = _truncated_normal(k_head, (config.d_model, config.padded_vocab_size), config.init_std, dtype)

    def hidden_states(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        config = self.config
        if positions is None:
            positions = jnp.arange(tokens.shape[1])[None, :]
        else:
            positions = constrain(positions, ("batch", "sequence"))
        x = embed_tokens(self.embed, tokens, config.compute_dtype, constrain)
        rope = Rope(positions, config, yarn=config.yarn is not None, platform=program_platform(constrain))
        mask = AttentionMask(None, segment_ids)

        def apply_block(block: Block, x):
            return block(x, rope, config=config, mask=mask, constrain=constrain)

        if config.remat != "none":
            apply_block = jax.checkpoint(apply_block, policy=_REMAT_POLICIES[config.remat])

        def layer(x, block: Block):
            return apply_block(block, x), None

        x, _ = over_layers(layer, x, self.blocks, scanned=config.scanned)
        return self.final_norm(x)

    def logits(
        self, hidden: Float[Array, "*batch d_model"], *, constrain: Constrain = unconstrained
    ) -> Float[Array, "*batch vocab"]:
        logits = jnp.einsum("...d,dv->...v", hidden, self.lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "sequence", "act_vocab"))
        return logits[..., : self.config.vocab_size]
