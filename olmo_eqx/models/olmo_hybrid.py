"""OLMo-Hybrid: Gated DeltaNet layers between OLMo 3 attention layers, readable top to bottom.

    tokens -> embed -> [layer_pattern, one cycle at a time] -> norm -> head

The layers repeat `config.layer_pattern` (the released 7B: gdn, gdn, gdn, attention, eight
times); each cycle is one step of a `lax.scan`, as OLMo 3's attention cycles are. The two layer
kinds place their norms differently (HF transformers' `modeling_olmo_hybrid.py`):

    "gdn" (pre-norm):                          "attention" (OLMo 3's reordered norm):
    h   = x + gated_deltanet(input_norm(x))    h   = x + attention_norm(attention(x))
    out = h + mlp(mlp_input_norm(h))           out = h + mlp_norm(mlp(h))

The attention layer is OLMo 3's `Block` (full-width QK-norm, full causal attention), with RoPE
or without it (`use_rope: false`, NoPE: the released stage-3 model). A Gated DeltaNet layer:

    q, k, v = silu(causal_conv([x W_q, x W_k, x W_v]))     per-channel conv of width 4
    q, k    = l2_normalise(q), l2_normalise(k);  q /= sqrt(key_dim)
    beta    = sigmoid(x W_b)  (times 2 with gdn_allow_neg_eigval)
    g       = -exp(A_log) * softplus(x W_a + dt_bias)        log of the per-head decay
    o       = delta_rule(q, k, v, g, beta)                   models/gated_deltanet.py
    out     = (rms_norm(o) * w * silu(x W_g)) W_o              per-head norm, gated

Key heads may be fewer than value heads (each q/k head serves gdn_heads // gdn_key_heads
consecutive value heads). Under document masking the delta rule's state and the convolution
restart at every document start. Decoding keeps, per GDN layer, the state and the
convolution's last inputs instead of a KV cache (`olmo_eqx.generate`).

Context parallelism (`mesh.context=N`) splits the attention layers only: the GDN layers have
no context-parallel form yet. Their scan inputs are gathered to whole sequences once per layer
(logical axis `gdn_sequence`) and every device of the context group runs the whole chunk scan
(N-fold GDN work, full-sequence GDN activations per device); a real one would pass each
shard's final state to the next (docs/planning.md).
"""

import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import gated_deltanet
from .attention import AttentionMask, program_platform
from .base import CausalLM, Constrain, embed_tokens, over_layers, unconstrained
from .base import axes as _axes
from .config import ModelConfig
from .olmo3 import _REMAT_POLICIES, HIDDEN, MLP, Block, RMSNorm, Rope, _truncated_normal, dense

# HF's gated output norm keeps FLA's epsilon, not the config's.
GATED_NORM_EPS = 1e-5
L2_NORM_EPS = 1e-6


def l2_normalise(x: Float[Array, "*rest dim"]) -> Float[Array, "*rest dim"]:
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_NORM_EPS)


class GatedDeltaNet(eqx.Module):
    q_proj: Float[Array, "d_model key_features"] = _axes("embed", "heads")
    k_proj: Float[Array, "d_model key_features"] = _axes("embed", "heads")
    v_proj: Float[Array, "d_model value_features"] = _axes("embed", "heads")
    a_proj: Float[Array, "d_model heads"] = _axes("embed", "heads")  # the decay's input
    b_proj: Float[Array, "d_model heads"] = _axes("embed", "heads")  # beta's input
    g_proj: Float[Array, "d_model value_features"] = _axes("embed", "heads")  # the output gate
    o_proj: Float[Array, "value_features d_model"] = _axes("heads", "embed")
    # Taps of the depthwise causal convolutions of q, k and v (HF files: {q,k,v}_conv1d.weight).
    q_conv: Float[Array, "kernel key_features"] = _axes("conv", "heads")
    k_conv: Float[Array, "kernel key_features"] = _axes("conv", "heads")
    v_conv: Float[Array, "kernel value_features"] = _axes("conv", "heads")
    A_log: Float[Array, " heads"] = _axes("norm")
    dt_bias: Float[Array, " heads"] = _axes("norm")
    o_norm: RMSNorm  # over one head's value_dim, shared by all heads

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        dtype = jnp.dtype(config.param_dtype)
        d, h, std = config.d_model, config.gdn_heads, config.init_std
        key_features = config.gdn_key_heads * config.gdn_key_dim
        value_features = h * config.gdn_value_dim
        keys = jax.random.split(key, 12)
        self.q_proj = _truncated_normal(keys[0], (d, key_features), std, dtype)
        self.k_proj = _truncated_normal(keys[1], (d, key_features), std, dtype)
        self.v_proj = _truncated_normal(keys[2], (d, value_features), std, dtype)
        self.a_proj = _truncated_normal(keys[3], (d, h), std, dtype)
        self.b_proj = _truncated_normal(keys[4], (d, h), std, dtype)
        self.g_proj = _truncated_normal(keys[5], (d, value_features), std, dtype)
        self.o_proj = _truncated_normal(keys[6], (value_features, d), std, dtype)
        bound = 1 / math.sqrt(config.gdn_conv_kernel)  # PyTorch's default for a depthwise conv
        taps = lambda k, channels: jax.random.uniform(k, (config.gdn_conv_kernel, channels), dtype, -bound, bound)  # noqa: E731
        self.q_conv, self.k_conv = taps(keys[7], key_features), taps(keys[10], key_features)
        self.v_conv = taps(keys[11], value_features)
        # HF's init: A ~ U(1, 16) (HF: U(0, 16)), dt log-uniform in [1e-3, 0.1], dt_bias = softplus^-1(dt).
        self.A_log = jnp.log(jax.random.uniform(keys[8], (h,), jnp.float32, 1.0, 16.0)).astype(dtype)
        dt = jnp.exp(jax.random.uniform(keys[9], (h,), jnp.float32, math.log(1e-3), math.log(0.1)))
        self.dt_bias = (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
        self.o_norm = RMSNorm(config.gdn_value_dim, GATED_NORM_EPS, dtype)

    def inputs(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        config: ModelConfig,
        documents: Optional[Int[Array, "batch seq"]] = None,
        conv_tails: Optional[tuple[Array, Array, Array]] = None,
        constrain: Constrain = unconstrained,
    ):
        """(q, k, v, g, beta) of the delta rule, and the convolutions' new tails (q, k, v:
        each [batch, kernel - 1, features], the inputs a decoder's next token convolves with)."""
        batch, seq, _ = x.shape
        tails_in = conv_tails if conv_tails is not None else (None, None, None)
        mixed, tails = [], []
        for name, weight, conv, tail in zip(("q_proj", "k_proj", "v_proj"), (self.q_proj, self.k_proj, self.v_proj),
                                            (self.q_conv, self.k_conv, self.v_conv), tails_in):
            y, tail = gated_deltanet.causal_conv(checkpoint_name(dense(x, weight, constrain), name), conv, documents, tail)
            mixed.append(jax.nn.silu(y))
            tails.append(tail)
        q, k, v = mixed
        conv_tail = tuple(tails)
        group = config.gdn_heads // config.gdn_key_heads
        heads = lambda a, dim: a.reshape(batch, seq, -1, dim)  # noqa: E731
        q = jnp.repeat(l2_normalise(heads(q, config.gdn_key_dim)), group, axis=2) / math.sqrt(config.gdn_key_dim)
        k = jnp.repeat(l2_normalise(heads(k, config.gdn_key_dim)), group, axis=2)
        v = heads(v, config.gdn_value_dim)
        beta = jax.nn.sigmoid(dense(x, self.b_proj, constrain, out_dtype=jnp.float32))
        if config.gdn_allow_neg_eigval:
            beta = 2.0 * beta
        a = dense(x, self.a_proj, constrain, out_dtype=jnp.float32) + self.dt_bias.astype(jnp.float32)
        g = -jnp.exp(self.A_log.astype(jnp.float32)) * jax.nn.softplus(a)
        return (q, k, v, g, beta), conv_tail

    def output(
        self, o: Float[Array, "batch seq heads value_dim"], x: Float[Array, "batch seq d_model"], constrain: Constrain
    ) -> Float[Array, "batch seq d_model"]:
        """The gated per-head norm and the output projection."""
        batch, seq = x.shape[:2]
        gate = dense(x, self.g_proj, constrain).reshape(o.shape).astype(jnp.float32)
        normed = self.o_norm(o.astype(jnp.float32)) * jax.nn.silu(gate)
        return checkpoint_name(dense(normed.astype(x.dtype).reshape(batch, seq, -1), self.o_proj, constrain), "o_proj")

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        config: ModelConfig,
        documents: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        args, _ = self.inputs(x, config=config, documents=documents, constrain=constrain)
        # Under context parallelism XLA:TPU would otherwise gather the whole chunk-stacked input
        # in every iteration of the chunk scan: gather the sequence once, before it.
        whole = ("batch", "gdn_sequence", "act_heads", "head_dim")
        args = tuple(constrain(a, whole[: a.ndim]) for a in args)
        if documents is not None:
            documents = constrain(documents, whole[:2])
        o, _ = gated_deltanet.chunked(*args, documents, chunk_size=config.gdn_chunk_size)
        o = constrain(o, ("batch", "sequence", "act_heads", "head_dim"))
        return self.output(checkpoint_name(o, "attention_context"), x, constrain)


class GDNBlock(eqx.Module):
    input_norm: RMSNorm  # HF: input_layernorm
    gdn: GatedDeltaNet  # HF: linear_attn
    mlp_input_norm: RMSNorm  # HF: post_attention_layernorm (the MLP's pre-norm)
    mlp: MLP

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        kg, km = jax.random.split(key)
        dtype = jnp.dtype(config.param_dtype)
        self.input_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.gdn = GatedDeltaNet(config, key=kg)
        self.mlp_input_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, key=km)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        *,
        config: ModelConfig,
        documents: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        mixed = self.gdn(self.input_norm(x), config=config, documents=documents, constrain=constrain)
        return self.after_mixer(x, mixed, constrain)

    def after_mixer(
        self, x: Float[Array, "batch seq d_model"], mixed: Float[Array, "batch seq d_model"], constrain: Constrain
    ) -> Float[Array, "batch seq d_model"]:
        h = constrain(x + mixed, HIDDEN)
        return constrain(h + self.mlp(self.mlp_input_norm(h), constrain), HIDDEN)


def stack_layers(config: ModelConfig, kind: str) -> list[int]:
    """The model's layer numbers (HF's `model.layers.{i}`) of the `kind` layers, in stack order."""
    return [i for i in range(config.n_layers) if config.layer_pattern[i % config.cycle_length] == kind]


def identity_rope(positions: Int[Array, "#batch seq"], config: ModelConfig, platform: Optional[str] = None) -> Rope:
    """A Rope that changes nothing (cos 1, sin 0): NoPE through OLMo 3's attention unchanged."""
    rope = Rope(positions, config, yarn=False, platform=platform)
    return eqx.tree_at(lambda r: (r.cos, r.sin), rope, (jnp.ones_like(rope.cos), jnp.zeros_like(rope.sin)))


class OLMoHybrid(CausalLM):
    """An OLMo-Hybrid causal language model: token ids in, float32 logits out."""

    embed: Float[Array, "padded_vocab d_model"] = _axes("vocab", "embed")
    gdn_blocks: GDNBlock = eqx.field(metadata={"stacked": True})  # the "gdn" layers, in order
    attention_blocks: Block = eqx.field(metadata={"stacked": True})  # the "attention" layers, in order
    final_norm: RMSNorm
    lm_head: Float[Array, "d_model padded_vocab"] = _axes("embed", "vocab")
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        if config.architecture != "olmo_hybrid":
            raise ValueError(f"model {config.name!r}: OLMoHybrid builds architecture 'olmo_hybrid', got {config.architecture!r}")
        dtype = jnp.dtype(config.param_dtype)
        k_embed, k_gdn, k_attention, k_head = jax.random.split(key, 4)
        self.config = config
        n_gdn, n_attention = len(stack_layers(config, "gdn")), len(stack_layers(config, "attention"))
        self.embed = _truncated_normal(k_embed, (config.padded_vocab_size, config.d_model), config.init_std, dtype)
        self.gdn_blocks = eqx.filter_vmap(lambda k: GDNBlock(config, key=k))(jax.random.split(k_gdn, n_gdn))
        self.attention_blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(jax.random.split(k_attention, n_attention))
        self.final_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.lm_head = _truncated_normal(k_head, (config.d_model, config.padded_vocab_size), config.init_std, dtype)

    def cycles(self) -> tuple[GDNBlock, Block]:
        """Both stacks reshaped to [cycles, layers of that kind per cycle, ...] for the scan."""
        config = self.config
        n_cycles = config.n_layers // config.cycle_length
        per_cycle = lambda stack: jax.tree.map(lambda a: a.reshape(n_cycles, -1, *a.shape[1:]), stack)  # noqa: E731
        return per_cycle(self.gdn_blocks), per_cycle(self.attention_blocks)

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
        platform = program_platform(constrain)
        rope = (
            Rope(positions, config, yarn=config.yarn is not None, platform=platform)
            if config.use_rope else identity_rope(positions, config, platform)
        )
        mask = AttentionMask(None, segment_ids)
        documents = None if segment_ids is None else gated_deltanet.document_index(segment_ids)

        def gdn_layer(block: GDNBlock, x):
            return block(x, config=config, documents=documents, constrain=constrain)

        def attention_layer(block: Block, x):
            return block(x, rope, config=config, mask=mask, constrain=constrain)

        if config.remat != "none":
            policy = _REMAT_POLICIES[config.remat]
            gdn_layer, attention_layer = (jax.checkpoint(f, policy=policy) for f in (gdn_layer, attention_layer))

        def run_cycle(x, cycle):
            gdn, attention = cycle
            counts = {"gdn": 0, "attention": 0}
            for kind in config.layer_pattern:
                stack, layer = (gdn, gdn_layer) if kind == "gdn" else (attention, attention_layer)
                x = layer(jax.tree.map(lambda a: a[counts[kind]], stack), x)
                counts[kind] += 1
            return x, None

        x, _ = over_layers(run_cycle, x, self.cycles(), scanned=config.scanned)
        return self.final_norm(x)

    def logits(
        self, hidden: Float[Array, "*batch d_model"], *, constrain: Constrain = unconstrained
    ) -> Float[Array, "*batch vocab"]:
        logits = jnp.einsum("...d,dv->...v", hidden, self.lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "sequence", "act_vocab"))
        return logits[..., : self.config.vocab_size]
