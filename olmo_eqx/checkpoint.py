"""The one checkpoint format every stage reads and writes (Orbax).

One step directory per checkpoint, written atomically (Orbax writes `<step>.orbax-checkpoint-
tmp-*` and renames it on commit, so a run killed mid-save leaves only an ignored tmp dir):

    <dir>/<step>/model/         the model's arrays (sharded, restorable on any mesh)
    <dir>/<step>/train/         optimiser state, step, skip-step statistics
    <dir>/<step>/loader/        the data position (`LoaderState.to_dict()`), JSON
    <dir>/<step>/config/        the run's resolved config, JSON
    <dir>/<step>/model_config/  the `ModelConfig`, JSON (checked on every restore)

Restoring onto another mesh or device count (8 -> 4 -> 1) goes through an abstract target
whose leaves carry the *new* shardings: `sharded_abstract_train_state(...)`.
"""

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from .models.config import ModelConfig, YarnConfig
from .train.state import TrainState

# Fields that change how a model runs but not its weights; a checkpoint may be restored
# under different values (same list as `olmo3.with_config` allows).
RUNTIME_FIELDS = ("attention_impl", "remat", "compute_dtype", "loss_chunk_size")

# Written by Orbax into a step directory as the last act of a save (all storage backends).
COMMIT_MARKER = "commit_success.txt"

_ITEMS = ("model", "train", "loader", "config", "model_config")


class CheckpointMismatchError(ValueError):
    """A checkpoint holds a different model than the one requested."""


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns."""

    step: int
    state: TrainState
    loader_state: Optional[dict]  # rebuild with `LoaderState.from_dict`
    config: Optional[dict]
    model_config: ModelConfig


def model_config_to_dict(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def model_config_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    if data.get("yarn") is not None:
        data["yarn"] = YarnConfig(**data["yarn"])
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in data.items() if k in known})


def check_model_config(stored: ModelConfig, requested: ModelConfig, where: str = "checkpoint") -> None:
    """Raise `CheckpointMismatchError` naming every differing weight-relevant field."""
    differing = [
        f"{f.name}: {where} has {getattr(stored, f.name)!r}, requested {getattr(requested, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in RUNTIME_FIELDS and getattr(stored, f.name) != getattr(requested, f.name)
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


class Checkpointer:
    """Save and restore train states in `directory` (made absolute; created if missing).

    keep_last: newest checkpoints kept; keep_every: also keep steps divisible by it.
    read_only: open someone else's checkpoints (eval, export) without touching the directory.
    Saves are asynchronous: `save` returns once the arrays are copied off the devices;
    call `wait_until_finished()` before reading a checkpoint back and `close()` at the end.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: Optional[int] = 2,
        keep_every: Optional[int] = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        # Orbax refuses relative paths: resolve local ones against the current directory;
        # URLs (gs://...) are already absolute and go through etils' epath like Orbax itself.
        self.read_only = read_only
        text = os.fspath(directory)
        self.directory = epath.Path(text if "://" in text else Path(text).expanduser().resolve())
        with _quiet_read_only_notices(read_only):
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep_last,
                keep_period=keep_every,
                enable_async_checkpointing=async_save,
                create=not read_only,
                read_only=read_only,
                # The writer removes tmp dirs left by a run killed mid-save; a reader (eval, export)
                # must not, or it would delete a live run's in-flight save.
                cleanup_tmp_directories=not read_only,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

    # -- queries -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (half-written ones never appear)."""
        self._manager.reload()
        # Orbax commits by renaming its tmp dir on POSIX and lists any step-named dir; also
        # demand the commit marker it writes last, so a step dir copied or synced without
        # finishing (or written by a non-atomic filesystem) is never taken for complete.
        return sorted(
            step for step in self._manager.all_steps() if (self.directory / str(step) / COMMIT_MARKER).exists()
        )

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def stored_model_config(self, step: Optional[int] = None) -> ModelConfig:
        """The ModelConfig saved with `step` (default: latest); reads only a small JSON file."""
        step = self._resolve_step(step)
        data = self._manager.restore(step, args=ocp.args.Composite(model_config=ocp.args.JsonRestore()))
        return model_config_from_dict(data["model_config"])

    def stored_config(self, step: Optional[int] = None) -> Optional[dict]:
        """The resolved run config saved with `step` (default: latest), or None if none was saved."""
        step = self._resolve_step(step)
        data = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        return data["config"] or None

    # -- save --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        loader_state: Any = None,
        config: Any = None,
        force: bool = True,
    ) -> bool:
        """Start saving `state` with its data position and run config as checkpoint `step`.

        loader_state: a `LoaderState` (anything with `to_dict()`), dataclass or dict.
        config: the resolved run config as a dict (or dataclass). Returns whether a save began
        (False when a complete checkpoint of this step already exists, e.g. right after a resume).
        """
        if self.read_only:
            raise PermissionError(f"checkpointer for {self.directory} was opened read_only; it cannot save")
        if int(step) in self.all_steps():
            return False
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(state.model),
            train=ocp.args.StandardSave(_train_part(state)),
            loader=ocp.args.JsonSave(_jsonable(loader_state)),
            config=ocp.args.JsonSave(_jsonable(config)),
            model_config=ocp.args.JsonSave(model_config_to_dict(state.model.config)),
        )
        return self._manager.save(int(step), args=args, force=force)

    # -- restore -----------------------------------------------------------------------------

    def _resolve_step(self, step: Optional[int]) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in self.all_steps():
            raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        return int(step)

    def restore(self, step: Optional[int] = None, *, target: TrainState) -> Restored:
        """Restore checkpoint `step` (default: the latest complete one) onto `target`'s layout.

        target: an abstract TrainState whose leaves are `jax.ShapeDtypeStruct`s carrying the
        shardings wanted *now* (`sharded_abstract_train_state(model_config, optim_config, mesh,
        rules)`); the stored model config must match `target.model.config`.
        """
        step = self._resolve_step(step)
        check_model_config(self.stored_model_config(step), target.model.config, f"checkpoint {self.directory / str(step)}")
        data = self._manager.restore(
            step,
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore(target.model),
                train=ocp.args.StandardRestore(_train_part(target)),
                loader=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(),
                model_config=ocp.args.JsonRestore(),
            ),
        )
        train = data["train"]
        state = TrainState(model=data["model"], **train)
        return Restored(
            step=step,
            state=state,
            loader_state=data["loader"] or None,
            config=data["config"] or None,
            model_config=model_config_from_dict(data["model_config"]),
        )

    def restore_model(self, step: Optional[int] = None, *, target: Any):
        """Only the model's weights (evaluation, export, a later stage with a fresh optimiser).

        target: an abstract model (`abstract_model(config)`, leaves optionally carrying shardings).
        """
        step = self._resolve_step(step)
        check_model_config(self.stored_model_config(step), target.config, f"checkpoint {self.directory / str(step)}")
        data = self._manager.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
        return data["model"]

    # -- lifecycle ---------------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Block until every started save is committed to disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release Orbax's threads."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_hf(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: Optional[int] = None, dtype: Optional[str] = None) -> Path:
    """Write a checkpoint's weights (default: latest step) as an HF model directory via `save_hf`."""
    from .hf import save_hf  # lazy: keeps safetensors/HF mapping out of training imports
    from .models.olmo3 import abstract_model

    checkpointer = Checkpointer(checkpoint_dir, keep_last=None, read_only=True)
    try:
        config = checkpointer.stored_model_config(step)
        device = jax.devices()[0]
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(device)),
            abstract_model(config),
        )
        model = checkpointer.restore_model(step, target=target)
    finally:
        checkpointer.close()
    out = Path(out_dir).expanduser().resolve()  # save_hf writes local files
    save_hf(model, out, dtype=dtype)
    return out
