"""The checkpoint format: what a step directory holds (see `olmo_eqx/checkpoint/__init__.py`),
the model fields a restore may change, the errors a restore raises, and the JSON of the items."""

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

from olmo_eqx.errors import RunError
from olmo_eqx.models.config import ModelConfig, YarnConfig
from olmo_eqx.train.state import TrainState

# Fields that change how a model runs but not its weights; a checkpoint may be restored
# under different values (same list as `registry.with_config` allows).
RUNTIME_FIELDS = (
    "attention_impl", "attention_block_size", "remat", "remat_sliding", "compute_dtype", "loss_chunk_size", "scan_layers",
    "moe_exchange", "quantization", "logits_dtype",
)
# The one list of model fields that may differ between a checkpoint and the config that
# resumes or continues it: how the model runs, and what a later stage may change without
# touching a weight's shape (stage 3 turns on YaRN and raises the context length).
CONTINUABLE_FIELDS = RUNTIME_FIELDS + ("yarn", "max_sequence_length")

# Written by Orbax into a step directory as the last act of a save (all storage backends).
COMMIT_MARKER = "commit_success.txt"

_ITEMS = ("model", "train", "loader", "config", "model_config", "health")
# Items a step saved by an older olmo_eqx may lack.
_OPTIONAL_ITEMS = ("health",)

# Staging dirs of this process's read-only readers of object stores (removed at exit).
_READER_STAGING: set[Path] = set()

# Where damaged or half-written step directories go instead of being deleted.
SET_ASIDE_DIR = "set_aside"


class CheckpointMismatchError(ValueError):
    """A checkpoint holds a different model than the one requested."""


class CheckpointCorruptError(RunError):
    """A checkpoint step whose files fail verification or cannot be read."""

    def __init__(self, path, step: int, file: str, reason: str):
        super().__init__(f"checkpoint {path} (step {step}) is unusable: {file}: {reason}")
        self.path, self.step, self.file, self.reason = path, step, file, reason


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns."""

    step: int
    state: TrainState
    loader_state: Optional[dict]  # rebuild with `LoaderState.from_dict`
    config: Optional[dict]
    model_config: ModelConfig
    health: Optional[dict] = None  # None: saved by an olmo_eqx that recorded none


def model_config_to_dict(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def model_config_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    if data.get("yarn") is not None:
        data["yarn"] = YarnConfig(**data["yarn"])
    if isinstance(data.get("layer_pattern"), list):  # JSON has no tuples
        data["layer_pattern"] = tuple(data["layer_pattern"])
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in data.items() if k in known})


def check_model_config(stored: ModelConfig, requested: ModelConfig, where: str = "checkpoint") -> None:
    """Raise `CheckpointMismatchError` naming every differing weight-relevant field."""
    differing = [
        f"{f.name}: {where} has {getattr(stored, f.name)!r}, requested {getattr(requested, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in CONTINUABLE_FIELDS and getattr(stored, f.name) != getattr(requested, f.name)
    ]
    if differing:
        raise CheckpointMismatchError(
            f"{where} holds a different model than requested ({len(differing)} field(s) differ): "
            + "; ".join(differing)
            + ". Use the checkpoint's model config, or point checkpoint.dir/load elsewhere."
        )


def _jsonable(value: Any) -> Any:
    if value is None:
        return {}
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def _train_part(state: TrainState) -> dict:
    return {
        "opt_state": state.opt_state,
        "step": state.step,
        "loss_history": state.loss_history,
        "grad_norm_history": state.grad_norm_history,
        "history_count": state.history_count,
    }


@contextlib.contextmanager
def _quiet_read_only_notices(read_only: bool):
    """Drop Orbax's two warnings that merely restate `read_only=True` (noise in every eval run)."""

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("CheckpointManagerOptions.read_only=True")
                    or message.startswith("Given directory is read only"))

    absl_logger = logging.getLogger("absl")
    if read_only:
        absl_logger.addFilter(keep)
    try:
        yield
    finally:
        absl_logger.removeFilter(keep)


def _listed(list_steps, attempts: int = 5):
    """`list_steps()` (Orbax listing the step dirs), again if a step vanished while it listed.

    Orbax lists the step dirs, then reads each one's metadata; a live run's retention (another
    process: eval or export reading a run that trains) can remove a step in between, which
    Orbax reports as FileNotFoundError, or as NotADirectoryError when the step dir itself is
    gone by the time it looks for the metadata file (seen once in CI's eval-racing-retention
    test). The pins keep the step a reader reads; any other step may go, and a fresh listing
    no longer has it."""
    for attempt in range(attempts):
        try:
            return list_steps()
        except (FileNotFoundError, NotADirectoryError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def step_arrays(step_dir: Path) -> list:
    """Every array of a persistent step's model and train state, as host numpy arrays in tree
    order, whatever mesh saved them (no target needed): to compare two runs' states bitwise."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    leaves = []
    for item in ("model", "train"):
        checkpointer = ocp.PyTreeCheckpointer()
        tree = checkpointer.metadata(Path(step_dir) / item).item_metadata.tree
        restore = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        leaves += jax.tree.leaves(checkpointer.restore(Path(step_dir) / item, restore_args=restore))
    return leaves
