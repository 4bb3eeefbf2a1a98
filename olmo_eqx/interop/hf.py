"""HuggingFace OLMo 1 / OLMo 2 / OLMo 3 / OLMoE / FlexOlmo / OLMo-Hybrid checkpoints <-> olmo_eqx models, without torch.

A HF checkpoint directory holds `config.json` and the weights in one `model.safetensors` or in
shards listed by `model.safetensors.index.json`. HF stores linear weights [out, in] and the
vocabulary unpadded; we store [in, out], stack layers on a leading axis, and pad the vocabulary
to `padded_vocab_size` (padding rows are zero and never reach a prediction). The config.json
mapping is `hf_config.py`.
"""

import json
import math
import os
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.base import CausalLM
from olmo_eqx.models.registry import abstract_model
from olmo_eqx.interop.hf_config import (  # noqa: F401  (the config mapping: also imported from here)
    MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, HFCheckpointError, hf_config_dict, model_config_from_hf, read_hf_config,
)

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


def check_finite(value: Float[np.ndarray, "..."], name: str, directory: Path) -> None:
    """Refuse a tensor holding nan or inf (a broken conversion or download), naming it: every
    stage would otherwise run on and print nan losses or empty text. One float64 sum per tensor
    (no copy; nan and inf carry through it, and float32 values cannot overflow it)."""
    if math.isfinite(value.sum(dtype=np.float64)):
        return
    bad = int(value.size - np.count_nonzero(np.isfinite(value)))
    raise HFCheckpointError(f"{directory}: tensor {name!r} holds {bad} nan/inf value(s) of {value.size}: these weights "
                            "are broken (a failed conversion, training or download); convert or download them again")


def load_hf(path: str | os.PathLike, *, padded_vocab_size: Optional[int] = None,
            param_dtype: str = "float32", **config_overrides) -> CausalLM:
    """Read a local HF OLMo 1 / OLMo 2 / OLMo 3 / OLMoE / FlexOlmo checkpoint directory into a zoo model.

    `padded_vocab_size` defaults to the vocabulary rounded up to a multiple of 128;
    `config_overrides` set numerics such as `compute_dtype` or `attention_impl`.
    """
    directory = Path(path)
    config = model_config_from_hf(read_hf_config(directory), padded_vocab_size=padded_vocab_size, param_dtype=param_dtype,
                                  source=str(directory / "config.json"), **config_overrides)
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
        value = np.asarray(tensor.astype(jnp.float32))
        check_finite(value, name, directory)
        return value

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
