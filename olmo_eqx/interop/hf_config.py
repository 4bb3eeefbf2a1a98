"""HF's `config.json` <-> `ModelConfig`, for every architecture `olmo_eqx.interop.hf` reads and
writes (OLMo 1, 2, 3, OLMoE, FlexOlmo, OLMo-Hybrid); the weights are `hf.py`'s."""

import json
import math
from pathlib import Path
from typing import NoReturn, Optional

from olmo_eqx.errors import RunError
from olmo_eqx.models.config import ModelConfig, YarnConfig

SUPPORTED_MODEL_TYPES = ("olmo", "olmo2", "olmo3", "olmoe", "flex_olmo", "olmo_hybrid")
MOE_MODEL_TYPES = ("olmoe", "flex_olmo")  # their architecture names are HF's model types


class HFCheckpointError(RunError, ValueError):
    """A HF checkpoint directory that cannot become (or come from) an olmo_eqx model. A
    RunError, so every stage that loads weights stops with its one line; a ValueError for
    library callers."""


def read_hf_config(directory: Path) -> dict:
    """The `config.json` of the HF checkpoint `directory` (`HFCheckpointError` if absent or unreadable)."""
    config_file = Path(directory) / "config.json"
    if not config_file.exists():
        raise HFCheckpointError(f"{directory} has no config.json; point at a HF checkpoint directory")
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{config_file} is not readable JSON ({e})") from e
    if not isinstance(hf, dict):
        raise HFCheckpointError(f"{config_file} is not a JSON object")
    return hf


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _round_up(n: int, multiple: int) -> int:
    return multiple * math.ceil(n / multiple)


def _rope_of(hf: dict, layer_type: str) -> dict:
    """The RoPE parameters of one layer type, from new (`rope_parameters`) or old config styles."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        return params[layer_type] or {}
    if isinstance(params, dict) and params:
        return params
    old = dict(hf.get("rope_scaling") or {})
    old.setdefault("rope_theta", hf.get("rope_theta", 500_000.0))
    if "type" in old and "rope_type" not in old:
        old["rope_type"] = old.pop("type")
    return old


# config.json's sizes: whole numbers >= 1 (JSON's true/false are not numbers here).
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
                   "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                   "linear_conv_kernel_dim")
# Numbers > 0 where given.
_OPTIONAL_POSITIVE = ("rms_norm_eps", "initializer_range", "rope_theta")


def check_hf_config(hf: dict, source: str = "config.json") -> None:
    """Refuse (an `HFCheckpointError`, one line naming the field, its value and what it must be) a
    config.json whose sizes are not whole numbers >= 1, whose numbers are not positive, or whose
    heads do not divide; the mapping below then never meets a string or a zero."""

    def refuse(field: str, must: str) -> NoReturn:
        raise HFCheckpointError(f"{source}: \"{field}\" is {json.dumps(hf.get(field))}; it must be {must} "
                                "(is this the model's own config.json?)")

    def is_size(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    required = _SIZES + (("num_experts", "num_experts_per_tok") if hf.get("model_type") in MOE_MODEL_TYPES else ())
    for field in required:
        if field not in hf:
            raise HFCheckpointError(f"{source} has no \"{field}\"; a HF OLMo config.json gives it (a whole number >= 1)")
    for field in required + _OPTIONAL_SIZES:
        if (field in required or hf.get(field) is not None) and not is_size(hf[field]):
            refuse(field, "a whole number >= 1")
    for field in _OPTIONAL_POSITIVE:
        value = hf.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            refuse(field, "a finite number > 0")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv_heads:
        refuse("num_key_value_heads", f"a divisor of num_attention_heads ({heads})")
    if hf.get("head_dim") is None and hf["hidden_size"] % heads:
        refuse("hidden_size", f"a multiple of num_attention_heads ({heads}) when head_dim is not given")
    if "num_experts" in required and hf["num_experts_per_tok"] > hf["num_experts"]:
        refuse("num_experts_per_tok", f"at most num_experts ({hf['num_experts']})")


def model_config_from_hf(hf: dict, *, padded_vocab_size: Optional[int] = None, source: str = "config.json",
                         **overrides) -> ModelConfig:
    """Map a HF `config.json` dict (read from `source`, named in errors) onto a `ModelConfig`;
    unsupported or malformed settings raise `HFCheckpointError`."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"config.json has model_type={model_type!r}; olmo_eqx reads {' and '.join(SUPPORTED_MODEL_TYPES)} "
            "checkpoints only"
        )
    check_hf_config(hf, source)
    try:
        return _model_config_from_hf(hf, model_type, padded_vocab_size, overrides)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        if isinstance(e, HFCheckpointError):
            raise
        # What the checks above do not name (a nested RoPE field, a layer type list): still one line.
        raise HFCheckpointError(f"{source} does not describe a model olmo_eqx can build: {type(e).__name__}: {e}") from e


def _model_config_from_hf(hf: dict, model_type: str, padded_vocab_size: Optional[int], overrides: dict) -> ModelConfig:
    if hf.get("tie_word_embeddings"):
        raise HFCheckpointError("config.json ties the embedding and the output head; OLMo models keep them untied")
    if hf.get("attention_bias"):
        raise HFCheckpointError("config.json enables attention biases; OLMo models have no biases")
    n_layers = hf["num_hidden_layers"]
    n_heads = hf["num_attention_heads"]
    sliding_window = None
    moe = {}
    if model_type in MOE_MODEL_TYPES:
        moe = dict(
            architecture=model_type,
            n_experts=hf["num_experts"],
            n_experts_per_token=hf["num_experts_per_tok"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
            clip_qkv=hf.get("clip_qkv"),
        )
    if model_type == "olmo":  # OLMo 1: its norms have no weights and a fixed eps (olmo1.py)
        moe = dict(architecture="olmo", clip_qkv=hf.get("clip_qkv"))
    if model_type == "olmo_hybrid":
        moe = _hybrid_fields(hf, n_layers)
    if model_type == "olmo3":
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)
        ]
        expected = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
        if all(t == "full_attention" for t in layer_types):
            sliding_window = None
        elif layer_types == expected:
            sliding_window = hf.get("sliding_window", 4096)
        else:
            raise HFCheckpointError(
                f"config.json layer_types {layer_types} is not OLMo 3's 3 sliding : 1 full pattern"
            )
    full_rope = _rope_of(hf, "full_attention")
    rope_theta = float(full_rope.get("rope_theta") or 500_000.0)
    sliding_theta = float(_rope_of(hf, "sliding_attention").get("rope_theta") or rope_theta)
    if sliding_window is not None and sliding_theta != rope_theta:
        raise HFCheckpointError(
            f"config.json gives sliding layers rope_theta={sliding_theta} and full layers {rope_theta}; "
            "olmo_eqx supports one theta for both"
        )
    yarn = None
    rope_type = full_rope.get("rope_type", "default")
    if rope_type == "yarn":
        yarn = YarnConfig(
            factor=float(full_rope["factor"]),
            original_max_position_embeddings=int(full_rope["original_max_position_embeddings"]),
            beta_fast=float(full_rope.get("beta_fast") or 32.0),
            beta_slow=float(full_rope.get("beta_slow") or 1.0),
            attention_factor=full_rope.get("attention_factor"),
        )
    elif rope_type != "default":
        raise HFCheckpointError(f"config.json uses rope_type={rope_type!r}; olmo_eqx supports 'default' and 'yarn'")
    if yarn is not None and model_type == "olmo":
        raise HFCheckpointError("config.json gives OLMo 1 YaRN RoPE scaling; olmo_eqx reads OLMo 1 with default RoPE only")
    vocab_size = hf["vocab_size"]
    fields = dict(
        name=hf.get("_name_or_path") or f"{model_type}_hf",
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size or _round_up(vocab_size, 128),
        d_model=hf["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
        mlp_hidden=hf["intermediate_size"],
        sliding_window=sliding_window,
        rope_theta=rope_theta,
        yarn=yarn,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        init_std=float(hf.get("initializer_range", 0.02)),
        **moe,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def _hybrid_fields(hf: dict, n_layers: int) -> dict:
    """OLMo-Hybrid's fields of a ModelConfig: the shortest repeating layer pattern, the Gated
    DeltaNet shapes, RoPE or NoPE (`rope_theta` null)."""
    kinds = {"linear_attention": "gdn", "full_attention": "attention"}
    layer_types = hf.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]
    unknown = sorted(set(layer_types) - set(kinds))
    if unknown:
        raise HFCheckpointError(f"config.json layer_types has {unknown}; OLMo-Hybrid layers are {sorted(kinds)}")
    layers = [kinds[t] for t in layer_types]
    period = next(p for p in range(1, n_layers + 1) if n_layers % p == 0 and layers == layers[:p] * (n_layers // p))
    n_heads = hf["num_attention_heads"]
    key_heads = hf.get("linear_num_key_heads") or n_heads
    key_dim = hf.get("linear_key_head_dim") or int(0.75 * hf["hidden_size"] / key_heads)
    rope = hf.get("rope_parameters")
    return dict(
        architecture="olmo_hybrid",
        layer_pattern=tuple(layers[:period]),
        gdn_heads=hf.get("linear_num_value_heads") or n_heads,
        gdn_key_heads=key_heads,
        gdn_key_dim=key_dim,
        gdn_value_dim=hf.get("linear_value_head_dim") or 2 * key_dim,
        gdn_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
        gdn_allow_neg_eigval=bool(hf.get("linear_allow_neg_eigval", True)),
        use_rope=not (isinstance(rope, dict) and rope.get("rope_theta") is None),
    )


def _hybrid_hf_config_dict(config: ModelConfig, rope: dict, **common) -> dict:
    """`config.json` for OlmoHybridForCausalLM."""
    if config.yarn is not None:
        raise HFCheckpointError(f"model {config.name!r}: olmo_eqx writes OLMo-Hybrid with default RoPE only; set yarn: null")
    hf = hf_config_dict(config.replace(architecture="olmo3"), **common)
    hf.update(
        architectures=["OlmoHybridForCausalLM"],
        model_type="olmo_hybrid",
        layer_types=config.layer_types,
        rope_parameters=rope if config.use_rope else {"rope_type": "default", "rope_theta": None},
        linear_num_key_heads=config.gdn_key_heads,
        linear_num_value_heads=config.gdn_heads,
        linear_key_head_dim=config.gdn_key_dim,
        linear_value_head_dim=config.gdn_value_dim,
        linear_conv_kernel_dim=config.gdn_conv_kernel,
        linear_allow_neg_eigval=config.gdn_allow_neg_eigval,
    )
    return hf


def hf_config_dict(config: ModelConfig, *, dtype: str, eos_token_id: Optional[int] = None,
                   pad_token_id: Optional[int] = None) -> dict:
    """The `config.json` transformers needs to rebuild `config` as Olmo3ForCausalLM / Olmo2ForCausalLM."""
    olmo3 = config.sliding_window is not None
    plain = {"rope_type": "default", "rope_theta": config.rope_theta}
    full = dict(plain)
    if config.yarn is not None:
        y = config.yarn
        full = {
            "rope_type": "yarn",
            "rope_theta": config.rope_theta,
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
        }
        if y.attention_factor is not None:
            full["attention_factor"] = y.attention_factor
    if config.architecture in MOE_MODEL_TYPES:
        return _moe_hf_config_dict(config, plain, dtype=dtype, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if config.architecture == "olmo_hybrid":
        return _hybrid_hf_config_dict(config, plain, dtype=dtype, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if config.architecture == "olmo":
        return _olmo1_hf_config_dict(config, plain, dtype=dtype, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if not olmo3 and config.yarn is not None:
        raise HFCheckpointError("YaRN needs OLMo 3's per-layer-type RoPE; an all-full-attention model can't carry it")
    hf = {
        "architectures": ["Olmo3ForCausalLM" if olmo3 else "Olmo2ForCausalLM"],
        "model_type": "olmo3" if olmo3 else "olmo2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.mlp_hidden,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_sequence_length,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "dtype": dtype,
    }
    if olmo3:
        hf["sliding_window"] = config.sliding_window
        hf["layer_types"] = config.layer_types
        hf["rope_parameters"] = {"sliding_attention": plain, "full_attention": full}
    else:
        hf["rope_parameters"] = plain
    return hf


def _moe_hf_config_dict(config: ModelConfig, rope: dict, **common) -> dict:
    """`config.json` for OlmoeForCausalLM / FlexOlmoForCausalLM."""
    if config.yarn is not None:
        raise HFCheckpointError(f"model {config.name!r}: HF's {config.architecture} has no YaRN; set yarn: null")
    if config.clip_qkv is not None and config.architecture == "flex_olmo":
        raise HFCheckpointError("HF's flex_olmo has no clip_qkv; set clip_qkv: null or use architecture olmoe")
    hf = hf_config_dict(config.replace(architecture="olmo3", n_experts=None, clip_qkv=None), **common)
    name = {"olmoe": "OlmoeForCausalLM", "flex_olmo": "FlexOlmoForCausalLM"}[config.architecture]
    hf.update(
        architectures=[name],
        model_type=config.architecture,
        rope_parameters=rope,
        num_experts=config.n_experts,
        num_experts_per_tok=config.n_experts_per_token,
        norm_topk_prob=config.norm_topk_prob,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=False,
    )
    if config.architecture == "olmoe":
        hf["clip_qkv"] = config.clip_qkv
    return hf


def _olmo1_hf_config_dict(config: ModelConfig, rope: dict, **common) -> dict:
    """`config.json` for OlmoForCausalLM (no norm epsilon: HF's OLMo 1 LayerNorm fixes 1e-5)."""
    if config.yarn is not None:
        raise HFCheckpointError(f"model {config.name!r}: olmo_eqx writes OLMo 1 with default RoPE only; set yarn: null")
    hf = hf_config_dict(config.replace(architecture="olmo3", clip_qkv=None), **common)
    del hf["rms_norm_eps"]
    hf.update(architectures=["OlmoForCausalLM"], model_type="olmo", rope_parameters=rope, clip_qkv=config.clip_qkv)
    return hf
