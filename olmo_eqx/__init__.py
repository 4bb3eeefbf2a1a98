"""olmo_eqx: train the OLMo family of language models in JAX with Equinox."""

import sys as _sys

# Before anything below imports JAX: on a machine without an accelerator, JAX runs on the CPU
# and never loads an installed accelerator plugin (libtpu's error block; olmo_eqx.run.accelerators).
# With JAX imported first (`import jax, olmo_eqx`), the same through JAX's setting, which still
# decides until JAX's first call.
if "jax" not in _sys.modules:
    from .run.accelerators import run_on_cpu_without_an_accelerator

    run_on_cpu_without_an_accelerator()
else:
    from .run.accelerators import run_on_cpu_with_jax_imported_first

    run_on_cpu_with_jax_imported_first()

# `python -m olmo_eqx` on a CPU re-executes itself with huge pages for XLA:CPU's buffers before
# anything below imports JAX (olmo_eqx.run.huge_pages).
from .run.huge_pages import reexec_with_huge_pages, started_as_olmo_eqx_command

if started_as_olmo_eqx_command():
    reexec_with_huge_pages()

from .interop.export import export_hf
from .models.flops import flops_per_token
from .interop.generate import generate
from .interop.hf import load_hf, save_hf
from .models.config import ModelConfig, YarnConfig
from .models.base import CausalLM
from .models.olmo3 import OLMo
from .models.registry import build_model, count_params, with_config
from .models.zoo import ZOO, get_model_config

__all__ = [
    "CausalLM",
    "OLMo",
    "ModelConfig",
    "YarnConfig",
    "ZOO",
    "build_model",
    "count_params",
    "export_hf",
    "flops_per_token",
    "generate",
    "get_model_config",
    "load_hf",
    "save_hf",
    "with_config",
]
