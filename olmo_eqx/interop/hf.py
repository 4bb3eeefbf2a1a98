"""HuggingFace OLMo 1 / OLMo 2 / OLMo 3 / OLMoE / FlexOlmo / OLMo-Hybrid checkpoints <-> olmo_eqx models, without torch.

A HF checkpoint directory holds `config.json` and the weights in one `model.safetensors` or in
shards listed by `model.safetensors.index.json`. HF stores linear weights [out, in] and the
vocabulary unpadded; we store [in, out], stack layers on a leading axis, and pad the vocabulary
to `padded_vocab_size` (padding rows are zero and never reach a prediction).
"""

import json
import math
import os
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from olmo_eqx.errors import RunError
from olmo_eqx.models.config import ModelConfig, YarnConfig
from olmo_eqx.models.base import CausalLM
from olmo_eqx.models.registry import abstract_model

SUPPORTED_MODEL_TYPES = ("olmo", "olmo2", "olmo3", "olmoe", "flex_olmo", "olmo_hybrid")
MOE_MODEL_TYPES = ("olmoe", "flex_olmo")  # their architecture names are HF's model types

# Our path inside a stacked Block -> (HF name inside `model.layers.{i}.`, stored transposed?)
_LAYER_TENSORS = {
    ("attention", "q_proj"): ("self_attn.q_proj.weight", True),
    ("attention", "k_proj"): ("self_attn.k_proj.weight", True),
    ("attention", "v_proj"): ("self_attn.v_proj.weight", True),
    ("attention", "o_proj"): ("self_attn.o_proj.weight", True),
    ("attention", "q_norm", "weight"): ("self_attn.q_norm.weight", False),
    ("attention", "k_norm", "weight"): ("self_attn.k_norm.weight", False),
    ("attention_norm", "weight"): ("post_attention_layernorm.weight", False),
    ("mlp", "gate_proj"): ("mlp.gate_proj.weight", True),
    ("mlp", "up_proj"): ("mlp.up_proj.weight", True),
    ("mlp", "down_proj"): ("mlp.down_proj.weight", True),
    ("mlp_norm", "weight"): ("post_feedforward_layernorm.weight", False),
}
# The same for a MoEBlock (olmoe.py). Experts are one tensor per expert on the HF side, named
# with `{expert}`; we stack them [expert, in, out].
_MOE_LAYER_TENSORS = {
    ("attention", "projections", "q_proj"): ("self_attn.q_proj.weight", True),
    ("attention", "projections", "k_proj"): ("self_attn.k_proj.weight", True),
    ("attention", "projections", "v_proj"): ("self_attn.v_proj.weight", True),
    ("attention", "projections", "o_proj"): ("self_attn.o_proj.weight", True),
    ("attention", "projections", "q_norm", "weight"): ("self_attn.q_norm.weight", False),
    ("attention", "projections", "k_norm", "weight"): ("self_attn.k_norm.weight", False),
    ("attention", "input_norm", "weight"): ("input_layernorm.weight", False),  # OLMoE
    ("attention_norm", "weight"): ("post_attention_layernorm.weight", False),  # FlexOlmo
    ("mlp_input_norm", "weight"): ("post_attention_layernorm.weight", False),  # OLMoE
    ("moe", "router"): ("mlp.gate.weight", True),
    ("moe", "experts", "gate_proj"): ("mlp.experts.{expert}.gate_proj.weight", True),
    ("moe", "experts", "up_proj"): ("mlp.experts.{expert}.up_proj.weight", True),
    ("moe", "experts", "down_proj"): ("mlp.experts.{expert}.down_proj.weight", True),
    ("mlp_norm", "weight"): ("post_feedforward_layernorm.weight", False),  # FlexOlmo
}


# The same for an OLMo-Hybrid GDNBlock (olmo_hybrid.py), under the names of its checkpoint files
# (OLMo-core's, which transformers renames when loading: attention_layer_norm is its
# input_layernorm, feedforward_layer_norm its post_attention_layernorm, and it concatenates the
# three convolutions into one conv1d). A convolution is stored [kernel, channels] here,
# [channels, 1, kernel] in the files ("conv").
_GDN_LAYER_TENSORS = {
    ("input_norm", "weight"): ("attention_layer_norm.weight", False),
    **{("gdn", p): (f"linear_attn.{p}.weight", True) for p in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj",
                                                              "g_proj", "o_proj")},
    **{("gdn", f"{p}_conv"): (f"linear_attn.{p}_conv1d.weight", "conv") for p in "qkv"},
    ("gdn", "A_log"): ("linear_attn.A_log", False),
    ("gdn", "dt_bias"): ("linear_attn.dt_bias", False),
    ("gdn", "o_norm", "weight"): ("linear_attn.o_norm.weight", False),
    ("mlp_input_norm", "weight"): ("feedforward_layer_norm.weight", False),
    ("mlp", "gate_proj"): ("mlp.gate_proj.weight", True),
    ("mlp", "up_proj"): ("mlp.up_proj.weight", True),
    ("mlp", "down_proj"): ("mlp.down_proj.weight", True),
}
# Its attention layers are OLMo 3 Blocks; the post-attention norm's file name is OLMo-core's.
_HYBRID_ATTENTION_LAYER_TENSORS = {**_LAYER_TENSORS, ("attention_norm", "weight"): ("feedforward_layer_norm.weight", False)}
# Fields of a model holding a stack of layers (a leading layer axis).
_STACKS = ("blocks", "gdn_blocks", "attention_blocks")
# Tensors of a released checkpoint that no olmo_eqx model holds (OLMo-Hybrid's multi-token
# prediction head, which HF's model skips as well).
_IGNORED_PREFIXES = ("mtp.",)


def _hybrid_conv(name: str, tensor, shape: tuple[int, ...], get) -> np.ndarray:
    """One of OLMo-Hybrid's q/k/v convolutions from a checkpoint. transformers (5.x) saves its
    fused conv1d split into three *equal* parts under the q/k/v names whatever their widths;
    the three concatenated are the fused q|k|v taps either way, so cut that at our widths."""
    prefix = name.removesuffix(name.split(".")[-2] + ".weight")
    parts = [get(f"{prefix}{c}_conv1d.weight") for c in "qkv"]
    if any(p is None for p in parts) or tuple(tensor.shape) == shape:
        return np.asarray(tensor)
    fused = np.concatenate([np.asarray(p) for p in parts], axis=0)
    which = "qkv".index(name.split(".")[-2][0])
    key_features = (fused.shape[0] - shape[0]) // 2 if which == 2 else shape[0]
    start = {0: 0, 1: key_features, 2: 2 * key_features}[which]
    return fused[start : start + shape[0]]


def _stack_layers(config: ModelConfig, stack: str) -> list[int]:
    """HF layer numbers of the layers in one of our stacks, in stack order."""
    if stack == "blocks":
        return list(range(config.n_layers))
    from olmo_eqx.models.olmo_hybrid import stack_layers

    return stack_layers(config, "gdn" if stack == "gdn_blocks" else "attention")


def _hf_shape(shape: tuple[int, ...], layout) -> tuple[int, ...]:
    if layout == "conv":
        return (shape[1], 1, shape[0])
    return tuple(shape[::-1]) if layout else tuple(shape)


def _from_hf(tensor: np.ndarray, layout) -> np.ndarray:
    if layout == "conv":
        return tensor[:, 0, :].T
    return tensor.T if layout else tensor


def _to_hf(value, layout):
    if layout == "conv":
        return value.T[:, None, :]
    return value.T if layout else value


class HFCheckpointError(RunError, ValueError):
    """A HF checkpoint directory that cannot become (or come from) an olmo_eqx model. A
    RunError, so every stage that loads weights stops with its one line; a ValueError for
    library callers."""


def _open_safetensors(file: Path):
    """safetensors' reader of `file`; a damaged file (a header claiming 2^60 bytes, a truncated
    download) becomes one `HFCheckpointError` naming it."""
    try:
        return safe_open(file, framework="flax")
    except (SafetensorError, OSError) as e:
        raise HFCheckpointError(
            f"{file} is not a readable safetensors file ({e}); re-download or re-export the checkpoint"
        ) from e


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


def model_config_from_hf(hf: dict, *, padded_vocab_size: Optional[int] = None, **overrides) -> ModelConfig:
    """Map a HF `config.json` dict onto a `ModelConfig`; unsupported settings raise."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"config.json has model_type={model_type!r}; olmo_eqx reads {' and '.join(SUPPORTED_MODEL_TYPES)} "
            "checkpoints only"
        )
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


# ---------------------------------------------------------------------------------------------
# Tensor names


def _hf_names(path: tuple[str, ...], layer: Optional[int]) -> tuple[str, bool | str]:
    """HF tensor name and its layout (stored transposed? or "conv"), for one of our leaf paths."""
    top = {
        ("embed",): ("model.embed_tokens.weight", False),
        ("final_norm", "weight"): ("model.norm.weight", False),
        ("lm_head",): ("lm_head.weight", True),
    }
    if path in top:
        return top[path]
    if path[0] == "gdn_blocks":
        table = _GDN_LAYER_TENSORS
    elif path[0] == "attention_blocks":
        table = _HYBRID_ATTENTION_LAYER_TENSORS
    else:
        table = _LAYER_TENSORS if path[1:] in _LAYER_TENSORS else _MOE_LAYER_TENSORS
    name, layout = table[path[1:]]
    return f"model.layers.{layer}.{name}", layout


def _leaf_paths(model) -> list[tuple[str, ...]]:
    return [tuple(k.name for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]]


# ---------------------------------------------------------------------------------------------
# Loading


def _open_tensors(directory: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from e
        return {name: directory / file for name, file in weight_map.items()}
    files = [single] if single.exists() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{directory} holds no *.safetensors weights (nor model.safetensors.index.json)")
    located = {}
    for file in files:
        with _open_safetensors(file) as f:
            located.update({name: file for name in f.keys()})
    return located


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


def load_hf(path: str | os.PathLike, *, padded_vocab_size: Optional[int] = None,
            param_dtype: str = "float32", **config_overrides) -> CausalLM:
    """Read a local HF OLMo 1 / OLMo 2 / OLMo 3 / OLMoE / FlexOlmo checkpoint directory into a zoo model.

    `padded_vocab_size` defaults to the vocabulary rounded up to a multiple of 128;
    `config_overrides` set numerics such as `compute_dtype` or `attention_impl`.
    """
    directory = Path(path)
    config = model_config_from_hf(read_hf_config(directory), padded_vocab_size=padded_vocab_size, param_dtype=param_dtype,
                                  **config_overrides)
    located = _open_tensors(directory)
    target = abstract_model(config)
    expected: set[str] = set()
    handles: dict[Path, object] = {}

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in located:
            raise HFCheckpointError(f"{directory}: tensor {name!r} is missing (expected shape {shape})")
        file = located[name]
        if file not in handles:
            handles[file] = _open_safetensors(file)
        tensor = handles[file].get_tensor(name)
        if name.endswith("_conv1d.weight"):
            tensor = _hybrid_conv(name, tensor, shape, lambda n: handles.setdefault(located[n], _open_safetensors(
                located[n])).get_tensor(n) if n in located else None)
        if tuple(tensor.shape) != shape:
            raise HFCheckpointError(
                f"{directory}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} for {config.name}"
            )
        return np.asarray(tensor.astype(jnp.float32))

    arrays = []
    for path_names, leaf in zip(_leaf_paths(target), jax.tree.leaves(target)):
        if path_names[0] in _STACKS:
            per_layer = []
            for layer in _stack_layers(config, path_names[0]):
                name, transposed = _hf_names(path_names, layer)
                if "{expert}" in name:  # one HF tensor per expert, stacked here
                    names = [name.format(expert=e) for e in range(leaf.shape[1])]
                    shape = _hf_shape(leaf.shape[2:], transposed)
                else:
                    names = [name]
                    shape = _hf_shape(leaf.shape[1:], transposed)
                expected.update(names)
                tensors = [read(n, tuple(shape)) for n in names]
                tensors = [_from_hf(t, transposed) for t in tensors]
                per_layer.append(np.stack(tensors) if "{expert}" in name else tensors[0])
            value = np.stack(per_layer)
        else:
            name, transposed = _hf_names(path_names, None)
            expected.add(name)
            shape = leaf.shape[::-1] if transposed else leaf.shape
            if path_names in (("embed",), ("lm_head",)):  # stored unpadded on the HF side
                shape = (config.vocab_size, config.d_model)
            tensor = read(name, tuple(shape))
            value = tensor.T if transposed else tensor
            if path_names == ("embed",):
                value = np.pad(value, ((0, config.padded_vocab_size - config.vocab_size), (0, 0)))
            elif path_names == ("lm_head",):
                value = np.pad(value, ((0, 0), (0, config.padded_vocab_size - config.vocab_size)))
        arrays.append(jnp.asarray(value, dtype=leaf.dtype))
    extra = sorted(n for n in set(located) - expected if not n.startswith(_IGNORED_PREFIXES))
    if extra:
        raise HFCheckpointError(
            f"{directory}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} "
            f"not part of {config.name}; is this checkpoint from another architecture?"
        )
    return jax.tree.unflatten(jax.tree.structure(target), arrays)


# ---------------------------------------------------------------------------------------------
# Saving


def hf_state_dict(model: CausalLM, *, dtype: Optional[str] = None) -> dict[str, jax.Array]:
    """`model`'s arrays under HF names and layouts (unpadded vocabulary, [out, in] linears).

    Works on any pytree shaped like the model, e.g. its gradients.
    """
    config = model.config
    tensors: dict[str, jax.Array] = {}
    for path_names, leaf in zip(_leaf_paths(model), jax.tree.leaves(model)):
        value = jnp.asarray(jax.device_get(leaf), dtype=dtype)
        if path_names[0] in _STACKS:
            for index, layer in enumerate(_stack_layers(config, path_names[0])):
                name, transposed = _hf_names(path_names, layer)
                if "{expert}" in name:
                    for expert, v in enumerate(value[index]):
                        tensors[name.format(expert=expert)] = v.T if transposed else v
                    continue
                tensors[name] = _to_hf(value[index], transposed)
            continue
        name, transposed = _hf_names(path_names, None)
        if path_names == ("embed",):
            value = value[: config.vocab_size]
        elif path_names == ("lm_head",):
            value = value[:, : config.vocab_size]
        tensors[name] = value.T if transposed else value
    return {name: jnp.array(t) for name, t in tensors.items()}  # contiguous copies for safetensors


def save_hf(model: CausalLM, path: str | os.PathLike, *, dtype: Optional[str] = None,
            max_shard_bytes: int = 5 * 2**30, tokenizer: Optional[str | os.PathLike] = None,
            eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None) -> None:
    """Write `model` as a HF checkpoint directory that `transformers` loads as Olmo3/Olmo2ForCausalLM.

    Weights are cast to `dtype` (default: the model's parameter dtype); more than
    `max_shard_bytes` of weights are split into shards with an index file. With `tokenizer`
    (the model's tokenizer.json) the directory also holds it and its tokenizer_config.json,
    and the EOS and pad ids default to its tokens'. OLMo adds no BOS token.
    """
    config = model.config
    if tokenizer is not None:
        eos_token_id, pad_token_id = _special_ids(Path(tokenizer), eos_token_id, pad_token_id)
    dtype = dtype or config.param_dtype
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model, dtype=dtype)

    shards: list[dict[str, jax.Array]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        if shards[-1] and shard_bytes + tensor.nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.nbytes
    for old in directory.glob("model*.safetensors*"):
        old.unlink()  # never leave stale shards beside a new index
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = hf_config_dict(config, dtype=dtype, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    generation = {"bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if tokenizer is not None:
        _write_tokenizer(Path(tokenizer), directory, eos_token_id, pad_token_id, config.max_sequence_length)
    # safetensors creates its files private (0600); give them the mode of every other file
    # written here, the umask's, so the directory can be shared like any model directory.
    mode = 0o666 & ~_umask()
    for file in directory.glob("model*.safetensors"):
        file.chmod(mode)


def _umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


# Token strings of the pad token in the tokenizers OLMo uses (dolma2's and the embedded corpus's).
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]")


def _special_ids(tokenizer: Path, eos: Optional[int], pad: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """EOS and pad ids: the ones given, else the tokenizer's tokens of those names."""
    from tokenizers import Tokenizer

    from olmo_eqx.data.tokenize import EOS_CANDIDATES

    if not tokenizer.is_file():
        raise HFCheckpointError(f"tokenizer {tokenizer} does not exist; give the model's tokenizer.json")
    text = Tokenizer.from_file(str(tokenizer))

    def first(candidates):
        return next((i for i in (text.token_to_id(t) for t in candidates) if i is not None), None)

    return (first(EOS_CANDIDATES) if eos is None else eos), (first(PAD_CANDIDATES) if pad is None else pad)


def _write_tokenizer(tokenizer: Path, directory: Path, eos: Optional[int], pad: Optional[int], max_length: int) -> None:
    """tokenizer.json and the tokenizer_config.json that lets transformers' AutoTokenizer read it."""
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tokenizer))
    (directory / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": None if eos is None else text.id_to_token(eos),
        "pad_token": None if pad is None else text.id_to_token(pad),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
