"""The zoo's architectures by name (`ModelConfig.architecture`), and what is computed from a config
alone: the model's abstract structure, its parameter count, a copy under changed runtime settings.

Adding an architecture: write its module (a `CausalLM`, in one file beside `olmo3.py`) and
add it to `ARCHITECTURES`.
"""

import dataclasses
import math

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from .base import CausalLM
from .config import ModelConfig
from .olmo1 import OLMo1
from .olmo3 import OLMo
from .olmo_hybrid import OLMoHybrid
from .olmoe import MoELM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "olmo3": OLMo,  # OLMo 2 and OLMo 3 (OLMo 2: sliding_window=None)
    "olmoe": MoELM,  # OLMoE: pre-norm mixture of experts
    "flex_olmo": MoELM,  # FlexOlmo: mixture of experts on OLMo 2's reordered-norm block
    "olmo": OLMo1,  # OLMo 1: pre-norm, non-parametric LayerNorm, optional clip_qkv
    "olmo_hybrid": OLMoHybrid,  # OLMo-Hybrid: Gated DeltaNet layers between OLMo 3 attention layers
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"model {config.name!r}: unknown architecture {config.architecture!r}; "
            f"choose one of: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def build_model(config: ModelConfig, *, key: PRNGKeyArray) -> CausalLM:
    """A freshly initialised model of `config`'s architecture."""
    return model_class(config)(config, key=key)


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model's structure with `jax.ShapeDtypeStruct` leaves; allocates nothing."""
    return eqx.filter_eval_shape(model_class(config), config, key=jax.random.key(0))


def count_params(config: ModelConfig) -> int:
    leaves = jax.tree.leaves(abstract_model(config))
    return sum(math.prod(leaf.shape) for leaf in leaves)


def with_config(model: CausalLM, **changes) -> CausalLM:
    """The same weights under a config with `changes` (e.g. attention_impl, compute_dtype, remat).

    Only settings that leave every parameter's shape unchanged are allowed.
    """
    config = dataclasses.replace(model.config, **changes)
    target = abstract_model(config)
    old_shapes = [leaf.shape for leaf in jax.tree.leaves(model)]
    new_shapes = [leaf.shape for leaf in jax.tree.leaves(target)]
    if old_shapes != new_shapes:
        raise ValueError(f"with_config({changes}) changes parameter shapes; build a new model instead")
    return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(model))
