"""Model FLOPs per token, the numerator of MFU (docs/olmo3.md section 5).

    6 * N_matmul + 12 * sum over layers of (n_heads * head_dim * context)

N_matmul counts every matmul weight, the output head included (its padded rows too, since the
hardware multiplies them), the input embedding (a gather) and norm weights excluded. A layer's
attention context is the sequence length, or `min(window, seq_len)` on sliding-window layers;
like OLMo-core's formula, causal masking is not discounted.

A mixture of experts counts the parameters a token *uses*: the router and its k experts'
MLPs, not all E (the MFU of a sparse model is of the work it does; dropless routing does no
more). The dense reference path (`moe_impl: dense`) does E/k times the MLP work, uncounted.
"""

from .models.config import ModelConfig


def matmul_params(config: ModelConfig) -> int:
    q = config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    attention = config.d_model * (2 * q + 2 * kv)
    mlp = 3 * config.d_model * config.mlp_hidden
    if config.n_experts is not None:  # router + the k active experts
        mlp = config.d_model * config.n_experts + config.n_experts_per_token * mlp
    return config.n_layers * (attention + mlp) + config.d_model * config.padded_vocab_size


def total_matmul_params(config: ModelConfig) -> int:
    """Every matmul weight, all experts included (what memory holds, not what a token uses)."""
    if config.n_experts is None:
        return matmul_params(config)
    return matmul_params(config.replace(n_experts_per_token=config.n_experts))


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Attention's training FLOPs (scores and context, forward + backward) per token."""
    attention = 0
    for layer in range(config.n_layers):
        context = min(config.sliding_window, seq_len) if config.is_sliding(layer) else seq_len
        attention += 12 * config.n_heads * config.head_dim * context
    return attention


def flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
    return 6 * matmul_params(config) + attention_flops_per_token(config, seq_len)
