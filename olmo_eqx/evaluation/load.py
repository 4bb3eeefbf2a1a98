"""Find and load the model an evaluation reads: a checkpoint of ours or a local HF directory.

`checkpoint.load` may name a run directory, its checkpoints directory (both: the latest
complete step), one step directory, or a HF checkpoint directory (config.json + safetensors);
`olmo_eqx.checkpoint_paths.resolve_checkpoint` decides, as for every later stage.

Our checkpoints are read through a read-only `Checkpointer` (which never touches a save in
flight of a run still writing into the same directory, and refuses incomplete steps). The
model's architecture comes from the checkpoint (`model_config`); the run's
`model.attention_impl` and `model.compute_dtype` choose how it runs here, since they don't
change the weights.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import jax
from jax.sharding import Mesh

from olmo_eqx.checkpoint_paths import CheckpointNotFoundError, resolve_checkpoint
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.olmo3 import OLMo
from olmo_eqx.sharding import ShardingRules, model_shardings, sharded_abstract_model


class EvalError(ValueError):
    """Input an evaluation cannot use; the message names it and the fix."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `kind` is "checkpoint" (ours; `path` is a step dir) or "hf"."""

    path: Path
    kind: str
    step: Optional[int] = None

    @property
    def label(self) -> str:
        if self.kind == "hf":
            return f"hf:{self.path}"
        return f"{self.path.parent.parent.name or self.path.parent}@{self.step}"


def resolve_model_source(path: str) -> ModelSource:
    """The checkpoint `path` names (`olmo_eqx.checkpoint_paths.resolve_checkpoint`: a run dir,
    checkpoints dir, step dir or HF dir), or EvalError saying what would do."""
    try:
        location = resolve_checkpoint(path)
    except CheckpointNotFoundError as e:
        raise EvalError(f"checkpoint.load={path}: {e}") from e
    if location.kind == "hf":
        return ModelSource(location.directory, "hf")
    return ModelSource(location.directory / str(location.step), "checkpoint", location.step)


def _checkpointer(source: ModelSource):
    from olmo_eqx.checkpoint import Checkpointer

    return Checkpointer(source.path.parent, keep_last=None, read_only=True)


def stored_run_config(source: ModelSource) -> Optional[dict]:
    """The run config saved with one of our checkpoints (None for HF or when absent)."""
    if source.kind != "checkpoint":
        return None
    with _checkpointer(source) as checkpointer:
        return checkpointer.stored_config(source.step)


def source_model_config(source: ModelSource, **runtime) -> ModelConfig:
    """The ModelConfig of `source`, with runtime-only fields (`attention_impl`, ...) replaced."""
    if source.kind == "hf":
        from olmo_eqx.hf import model_config_from_hf

        hf = json.loads((source.path / "config.json").read_text())
        return model_config_from_hf(hf, **runtime)
    with _checkpointer(source) as checkpointer:
        return checkpointer.stored_model_config(source.step).replace(**runtime)


def load_model(
    source: ModelSource,
    mesh: Mesh,
    rules: ShardingRules = ShardingRules(),
    *,
    attention_impl: str = "auto",
    compute_dtype: str = "float32",
) -> OLMo:
    """The weights of `source`, laid out on `mesh` like training lays them out (FSDP by default)."""
    runtime = dict(attention_impl=attention_impl, compute_dtype=compute_dtype, remat="none")
    if source.kind == "hf":
        from olmo_eqx.hf import load_hf

        model = load_hf(source.path, **runtime)
        return jax.device_put(model, model_shardings(model, mesh, rules))
    config = source_model_config(source, **runtime)
    with _checkpointer(source) as checkpointer:
        return checkpointer.restore_model(source.step, target=sharded_abstract_model(config, mesh, rules))
