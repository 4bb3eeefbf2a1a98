"""Named model configurations: OLMo 3 and OLMo 2 as OLMo-core defines them, plus `olmo3_tiny`.

Sizes follow OLMo-core's `TransformerConfig.olmo2_*` / `olmo3_*` constructors: the MLP width is
`8/3 * d_model`, optionally times a multiplier, rounded up to a multiple (256 unless noted).
Every named model uses the dolma2 vocabulary (100278 tokens, padded to 100352); OLMo 3 adds the
3:1 sliding-window pattern (window 4096, every fourth layer full attention).
"""

import math

from .config import ModelConfig

DOLMA2_VOCAB = 100_278
DOLMA2_PADDED_VOCAB = 100_352


def _mlp_hidden(d_model: int, multiplier: float | None, multiple_of: int) -> int:
    hidden = int(8 * d_model / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


# name suffix: (d_model, n_layers, n_heads, n_kv_heads, mlp multiplier, multiple_of)
_OLMO2_SHAPES = {
    "14m": (128, 4, 8, 8, None, 256),
    "30m": (256, 4, 8, 8, None, 256),
    "60m": (384, 8, 8, 8, 1.5, 256),
    "100m": (512, 12, 8, 8, 1.5, 256),
    "190m": (768, 12, 12, 12, 1.5, 256),
    "370m": (1024, 16, 16, 16, 1.5, 256),
    "600m": (1344, 16, 16, 16, 1.5, 256),
    "760m": (1536, 16, 16, 16, 1.5, 256),
    "1b": (2048, 16, 16, 16, 1.5, 256),  # OLMo-core's olmo2_1B_v2 (olmo2_1B has 18 layers)
    "3b": (3328, 16, 16, 16, 1.5, 256),
    "7b": (4096, 32, 32, 32, None, 256),
    "13b": (5120, 40, 40, 40, None, 256),
    "32b": (5120, 64, 40, 8, 27648 / (8 * 5120 / 3), 512),
}


def _named(family: str, size: str, d_model, n_layers, n_heads, n_kv_heads, multiplier, multiple_of) -> ModelConfig:
    return ModelConfig(
        name=f"{family}_{size}",
        vocab_size=DOLMA2_VOCAB,
        padded_vocab_size=DOLMA2_PADDED_VOCAB,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=d_model // n_heads,
        mlp_hidden=_mlp_hidden(d_model, multiplier, multiple_of),
        sliding_window=4096 if family == "olmo3" else None,
        max_sequence_length=8192 if family == "olmo3" else 4096,
    )


# The mixture-of-experts models (olmoe.py). OLMoE-1B-7B is the released allenai/OLMoE-1B-7B-0924
# config.json: 1.3B active of 6.9B parameters, GPT-NeoX-derived vocabulary of 50304 (already a
# multiple of 128), RoPE theta 10^4. The tiny ones are CPU-sized, for tests and the default
# MoE pretrain (8 experts, 2 active, expert width 128: active MLP width 256, 1/4 of the experts).
_MOE_TINY = dict(
    sliding_window=None, n_experts=8, n_experts_per_token=2, mlp_hidden=128, rope_theta=10_000.0, rms_norm_eps=1e-5
)
_MOE_ZOO = {
    "olmoe_1b_7b": ModelConfig(
        name="olmoe_1b_7b", architecture="olmoe", vocab_size=50_304, padded_vocab_size=50_304, d_model=2048,
        n_layers=16, n_heads=16, n_kv_heads=16, head_dim=128, mlp_hidden=1024, n_experts=64, n_experts_per_token=8,
        sliding_window=None, rope_theta=10_000.0, rms_norm_eps=1e-5, max_sequence_length=4096,
    ),
    "olmoe_tiny": ModelConfig(name="olmoe_tiny", architecture="olmoe", **_MOE_TINY),
    "flex_olmo_tiny": ModelConfig(name="flex_olmo_tiny", architecture="flex_olmo", **_MOE_TINY),
}


# OLMo 1 (olmo1.py): the released allenai/OLMo-7B-hf (February 2024) and OLMo-7B-0424-hf
# (OLMo 1.7: clip_qkv 8, 4096 context) config.json; GPT-NeoX-derived vocabulary of 50280 ids
# in an embedding of 50304 rows (HF's vocab_size), RoPE theta 10^4. The tiny one is CPU-sized.
_OLMO1 = dict(architecture="olmo", sliding_window=None, rope_theta=10_000.0)
_OLMO1_7B = dict(
    vocab_size=50_304, padded_vocab_size=50_304, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
    mlp_hidden=11_008, **_OLMO1,
)
_OLMO1_ZOO = {
    "olmo1_7b": ModelConfig(name="olmo1_7b", max_sequence_length=2048, **_OLMO1_7B),
    "olmo1_7b_0424": ModelConfig(name="olmo1_7b_0424", max_sequence_length=4096, clip_qkv=8.0, **_OLMO1_7B),
    "olmo1_tiny": ModelConfig(name="olmo1_tiny", **_OLMO1),
}


# OLMo-Hybrid (olmo_hybrid.py): the released allenai/Olmo-Hybrid-7B shapes (32 layers of
# [gdn, gdn, gdn, attention], d_model 3840, 30 heads of 128 on the attention layers, 30 GDN heads
# with keys of 96 and values of 192, convolutions of width 4, beta in (0, 2)), its final stage's
# NoPE attention and 65,536-token context, on the dolma2 vocabulary. The tiny one is CPU-sized
# (4 GDN heads, keys 24, values 48: HF's defaults of 0.75 * d_model / heads and twice that).
_HYBRID = dict(architecture="olmo_hybrid", sliding_window=None, layer_pattern=("gdn", "gdn", "gdn", "attention"))
_HYBRID_ZOO = {
    "olmo_hybrid_7b": ModelConfig(
        name="olmo_hybrid_7b", vocab_size=DOLMA2_VOCAB, padded_vocab_size=DOLMA2_PADDED_VOCAB, d_model=3840,
        n_layers=32, n_heads=30, n_kv_heads=30, head_dim=128, mlp_hidden=11_008, gdn_heads=30, gdn_key_heads=30,
        gdn_key_dim=96, gdn_value_dim=192, use_rope=False, max_sequence_length=65_536, **_HYBRID,
    ),
    "olmo_hybrid_tiny": ModelConfig(name="olmo_hybrid_tiny", **_HYBRID),
}


def _build_zoo() -> dict[str, ModelConfig]:
    zoo = {}
    for size, shape in _OLMO2_SHAPES.items():
        zoo[f"olmo2_{size}"] = _named("olmo2", size, *shape)
        olmo3_shape = shape
        if size == "600m":  # OLMo-core narrows the OLMo 3 600M to d_model 1280
            olmo3_shape = (1280,) + shape[1:]
        zoo[f"olmo3_{size}"] = _named("olmo3", size, *olmo3_shape)
    zoo["olmo3_tiny"] = ModelConfig()
    # A grouped-query twin of the tiny model, for tests of the GQA paths.
    zoo["olmo3_tiny_gqa"] = ModelConfig(name="olmo3_tiny_gqa", n_kv_heads=2)
    zoo.update(_MOE_ZOO)
    zoo.update(_OLMO1_ZOO)
    zoo.update(_HYBRID_ZOO)
    return zoo


ZOO: dict[str, ModelConfig] = _build_zoo()


def get_model_config(name: str, **overrides) -> ModelConfig:
    """The named configuration, with optional field overrides (e.g. `padded_vocab_size=...`)."""
    try:
        config = ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; choose one of: {', '.join(sorted(ZOO))}") from None
    return config.replace(**overrides) if overrides else config
