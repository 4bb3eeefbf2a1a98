"""Model FLOPs per token, the numerator of MFU (docs/olmo3.md section 5).

    6 * N_matmul + 12 * sum over layers of (n_heads * head_dim * context)

N_matmul counts every matmul weight, the output head included (its padded rows too, since the
hardware multiplies them), the input embedding (a gather) and norm weights excluded. A layer's
attention context is the sequence length, or `min(window, seq_len)` on sliding-window layers;
like OLMo-core's formula, causal masking is not discounted.

OLMo-Hybrid: attention's term counts its attention layers only; a Gated DeltaNet layer
counts its projections (q, k, v, a, b, gate, out) and convolution taps as matmul weights, and
its delta-rule kernel as `gdn_flops_per_token` (per token, independent of the sequence:
that is the point of it).

A mixture of experts counts the parameters a token *uses*: the router and its k experts'
MLPs, not all E (the MFU of a sparse model is of the work it does; dropless routing does no
more). The dense reference path (`moe_impl: dense`) does E/k times the MLP work, uncounted.
"""

from typing import Optional

from olmo_eqx.models.config import ModelConfig


def _kinds(config: ModelConfig) -> list[str]:
    """Each layer's token mixer: "attention", or "gdn" (OLMo-Hybrid's Gated DeltaNet)."""
    if config.architecture != "olmo_hybrid":
        return ["attention"] * config.n_layers
    return [config.layer_pattern[i % config.cycle_length] for i in range(config.n_layers)]


def gdn_matmul_params(config: ModelConfig) -> int:
    """One Gated DeltaNet layer's projections and convolution taps."""
    keys = config.gdn_key_heads * config.gdn_key_dim
    values = config.gdn_heads * config.gdn_value_dim
    projections = config.d_model * (2 * keys + 3 * values + 2 * config.gdn_heads)  # q k | v gate out | a b
    return projections + config.gdn_conv_kernel * (2 * keys + values)


def matmul_params(config: ModelConfig) -> int:
    q = config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    attention = config.d_model * (2 * q + 2 * kv)
    mlp = 3 * config.d_model * config.mlp_hidden
    if config.n_experts is not None:  # router + the k active experts
        mlp = config.d_model * config.n_experts + config.n_experts_per_token * mlp
    mixers = sum(attention if kind == "attention" else gdn_matmul_params(config) for kind in _kinds(config))
    return mixers + config.n_layers * mlp + config.d_model * config.padded_vocab_size


def gdn_flops_per_token(config: ModelConfig) -> int:
    """The chunked delta rule's training FLOPs (forward + backward, 3x the forward's) per token
    of one GDN layer, chunk C, per head: C x C products q k^T and k k^T (2 C dk multiply-adds),
    the triangular solve for the writes and decayed keys (C (dk + dv) / 2), the chunk's
    scores times its writes (C dv), and three products with the state (3 dk dv: the read by
    the decayed keys and by the queries, the state update). The chunk rematerialised in the
    backward pass is not counted (as remat never is in model FLOPs)."""
    c, dk, dv = config.gdn_chunk_size, config.gdn_key_dim, config.gdn_value_dim
    per_head = c * (2 * dk + (dk + dv) // 2 + dv) + 3 * dk * dv
    return 6 * config.gdn_heads * per_head


def total_matmul_params(config: ModelConfig) -> int:
    """Every matmul weight, all experts included (what memory holds, not what a token uses)."""
    if config.n_experts is None:
        return matmul_params(config)
    return matmul_params(config.replace(n_experts_per_token=config.n_experts))


def attention_layers(config: ModelConfig, seq_len: int) -> list[tuple[int, Optional[int]]]:
    """Each attention layer's (context, sliding window or None), GDN layers left out."""
    return [
        (min(config.sliding_window, seq_len), config.sliding_window) if config.is_sliding(layer) else (seq_len, None)
        for layer, kind in enumerate(_kinds(config))
        if kind == "attention"
    ]


def attention_context_flops(config: ModelConfig, context: int) -> int:
    """One attention layer's training FLOPs (scores and context, forward + backward) per token."""
    return 12 * config.n_heads * config.head_dim * context


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Attention's training FLOPs (scores and context, forward + backward) per token; on
    OLMo-Hybrid's GDN layers, the delta rule's."""
    gdn_layers = _kinds(config).count("gdn")
    attention = sum(attention_context_flops(config, context) for context, _ in attention_layers(config, seq_len))
    return attention + gdn_layers * gdn_flops_per_token(config)


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    return 6 * matmul_params(config) + attention_flops_per_token(config, seq_len)
