"""The `Checkpointer`: save a train state as one step directory and restore it on any mesh,
through Orbax's CheckpointManager (the format: `olmo_eqx/checkpoint/__init__.py`). Its local
upkeep is `local_steps.LocalSteps`, its object-store side `object_store.ObjectStoreSteps`."""


import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from olmo_eqx.checkpoint.remote import RemoteSteps, StagedRecord, is_object_store
from olmo_eqx.checkpoint.storage import os_reason
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.run.processes import agree
from olmo_eqx.train.state import TrainState
from olmo_eqx.checkpoint.format import (
    _ITEMS, _OPTIONAL_ITEMS, CheckpointCorruptError, Restored, _jsonable, _listed,
    _quiet_read_only_notices, _train_part, check_model_config, model_config_from_dict, model_config_to_dict,
)
from olmo_eqx.checkpoint.local_steps import LocalSteps
from olmo_eqx.checkpoint.object_store import ObjectStoreSteps


def _own_files_handlers() -> dict:
    """Orbax's handlers for a multi-process run on an object store, where no process can read
    another's staging dir: arrays without OCDBT, and without the per-process array metadata.

    Both assume one file system: the first process's finalize merges the processes'
    `ocdbt.process_<i>/` dirs by globbing them on its own disk, and validates every process's
    `array_metadatas/process_<i>` there (with separate dirs, Orbax 0.12.8's default save never
    completed). Without them every shard is one zarr chunk file that its process alone writes
    (the first process writes the metadata and the JSON items), nothing is merged, and the
    files of all processes together are the step; Orbax restores it on any process count and
    mesh, as it does OCDBT ones (`remote.py`)."""
    array = ocp.type_handlers.ArrayHandler(array_metadata_store=None)
    registry = ocp.type_handlers.create_type_handler_registry(
        (int, ocp.type_handlers.ScalarHandler()), (float, ocp.type_handlers.ScalarHandler()),
        (np.number, ocp.type_handlers.ScalarHandler()), (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, array), (str, ocp.type_handlers.StringHandler()),
    )
    arrays = {name: ocp.PyTreeCheckpointHandler(use_ocdbt=False, type_handler_registry=registry) for name in ("model", "train")}
    return {**arrays, **{name: ocp.JsonCheckpointHandler() for name in _ITEMS if name not in arrays}}


def _no_ocdbt_merge_notice(record: logging.LogRecord) -> bool:
    """Orbax's finalize tries its OCDBT merge whatever the format, and without OCDBT (every
    save of a spread run) warns that it found nothing to merge: noise at every save."""
    return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


class Checkpointer(LocalSteps, ObjectStoreSteps):
    """Save and restore train states in `directory` (made absolute; created if missing).

    keep_last: newest checkpoints kept; keep_every: also keep steps divisible by it.
    read_only: open someone else's checkpoints (eval, export) without touching the directory.
    staged_record: on an object store, a file (in the run dir) recording the steps committed
    in the staging dir and not yet uploaded (`remote.StagedRecord`).
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
        staging: Optional[str | os.PathLike] = None,
        staged_record: Optional[str | os.PathLike] = None,
    ):
        # Orbax refuses relative paths: resolve local ones against the current directory;
        # URLs (gs://...) are already absolute and go through etils' epath like Orbax itself.
        self.read_only = read_only
        text = os.fspath(directory)
        self.directory = epath.Path(text if "://" in text else Path(text).expanduser().resolve())
        self.keep_last, self.keep_every, self.async_save = keep_last, keep_every, async_save
        # s3:// and gs://: Orbax saves into a local staging dir, which is uploaded with its
        # digests and a commit object written last (`remote.py`); every local
        # guarantee then holds there. Other URLs go straight to Orbax, unverified.
        self.remote: Optional[RemoteSteps] = None
        self.staged_record: Optional[StagedRecord] = None
        orbax_dir = self.directory
        if is_object_store(text):
            orbax_dir = self._open_object_store(text, staging, staged_record)
        # Several processes on an object store: each stages and uploads its own files (`_upload`).
        self.spread = self.remote is not None and jax.process_count() > 1
        self._orbax_dir = orbax_dir
        # Digests, set-aside and retention work on local paths (a remote store's staging dir);
        # other remote (gs:// through Orbax itself) steps would go unverified.
        self._local: Optional[Path] = None if "://" in str(orbax_dir) else Path(os.fspath(orbax_dir))
        self._saving: Optional[int] = None  # the step of the save in flight
        self._failed_step: Optional[int] = None  # a save that failed: close() sweeps its leftovers again
        self._verified: set[int] = set()
        # Steps retention must keep whatever keep_last says (`protect`).
        self.protected: frozenset[int] = frozenset()
        self._saves, self._save_key = 0, ""  # names this save's digests in the processes' store
        self.completed, self.incomplete = [], [] if read_only else self._incomplete()  # `LocalSteps` says what they are
        with _quiet_read_only_notices(read_only):
            options = ocp.CheckpointManagerOptions(
                # Retention is `_prune`'s (it must skip steps without a manifest), not Orbax's;
                # remote dirs, which get no manifests, keep Orbax's.
                max_to_keep=None if self._local is not None else keep_last,
                keep_period=None if self._local is not None else keep_every,
                # Always Orbax's async machinery: the manifest is written from its
                # post-finalization hook, the last moment before the commit. `async_save=False`
                # waits for each save instead.
                enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
                create=not read_only or self.remote is not None,
                read_only=read_only and self.remote is None,  # a staging dir is always ours
                # The writer removes tmp dirs left by a run killed mid-save; a reader (eval, export)
                # must not, or it would delete a live run's in-flight save.
                cleanup_tmp_directories=not read_only,
            )
            items = {"item_handlers": _own_files_handlers()} if self.spread else {"item_names": _ITEMS}
            if self.spread:
                logging.getLogger("absl").addFilter(_no_ocdbt_merge_notice)  # once: the same function
            self._manager = _listed(lambda: ocp.CheckpointManager(orbax_dir, options=options, **items))
        if self.remote is not None and not read_only and self._upload_pending():
            self._prune()  # retention, as after any upload

    # -- queries -----------------------------------------------------------------------------

    @property
    def staging_dir(self) -> Optional[Path]:
        """The local dir Orbax saves into before the upload (object stores only)."""
        return self._local if self.remote is not None else None

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (half-written ones never appear).

        In a multi-process run process 0 lists and every process gets its answer (`agree`): a
        process listing the directory while process 0's retention deletes in it used to crash.
        Every process must call it at the same points (it is a collective)."""
        return agree("checkpoint_steps", self._list_steps)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def stored_model_config(self, step: Optional[int] = None) -> ModelConfig:
        """The ModelConfig saved with `step` (default: latest); reads only a small JSON file."""
        step = self._resolve_step(step)
        data = self._read(step, model_config=ocp.args.JsonRestore())
        try:
            return model_config_from_dict(data["model_config"])
        except (TypeError, ValueError) as e:
            raise CheckpointCorruptError(self.directory / str(step), step, "model_config", f"not a model config ({e})") from e

    def stored_config(self, step: Optional[int] = None) -> Optional[dict]:
        """The resolved run config saved with `step` (default: latest), or None if none was saved."""
        step = self._resolve_step(step)
        return self._read(step, config=ocp.args.JsonRestore())["config"] or None

    # -- save --------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        loader_state: Any = None,
        config: Any = None,
        health: Optional[dict] = None,
        force: bool = True,
    ) -> bool:
        """Start saving `state` with its data position and run config as checkpoint `step`.

        loader_state: a `LoaderState` (anything with `to_dict()`), dataclass or dict.
        config: the resolved run config as a dict (or dataclass). health: what the run knows of
        its health (`{"last_good": step}`), read back by a resume. Returns whether a save began
        (False when a complete checkpoint of this step already exists, e.g. right after a resume).
        """
        if self.read_only:
            raise PermissionError(f"checkpointer for {self.directory} was opened read_only; it cannot save")
        step = int(step)
        self.wait_until_finished()  # Orbax would wait too; this also reports its failure first
        in_the_way = None
        if step in self.all_steps():
            try:
                self.verify(step)
                return False
            except CheckpointCorruptError as e:
                in_the_way = e.reason
        # Process 0's view, on every process: with an object store the processes' staging
        # dirs differ, and all must take the same branch (set-aside below is a collective).
        elif self.remote is not None and agree("occupied", lambda: bool(self.remote.occupied(step))):
            in_the_way = "uncommitted or set aside"  # objects of a killed upload, or a marked step
        elif agree("step_dir", lambda: (self._orbax_dir / str(step)).exists()):
            # No commit marker: Orbax would refuse the step forever (StepAlreadyExistsError).
            in_the_way = "no commit marker"
        if in_the_way is not None:
            self.set_aside(step, in_the_way)
            if self.remote is not None and jax.process_index() == 0:
                self.remote.relocate(step)  # no rename there: the objects are copied aside, then removed
            if jax.process_count() > 1:  # every process must see it gone before Orbax saves
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"olmo_eqx_set_aside_{step}")
                _listed(self._manager.reload)
        save = ocp.args.PyTreeSave if self.spread else ocp.args.StandardSave
        args = ocp.args.Composite(
            model=save(state.model),
            train=save(_train_part(state)),
            loader=ocp.args.JsonSave(_jsonable(loader_state)),
            config=ocp.args.JsonSave(_jsonable(config)),
            model_config=ocp.args.JsonSave(model_config_to_dict(state.model.config)),
            health=ocp.args.JsonSave(health or {}),
        )
        self._saving, self._began = step, time.perf_counter()
        self._saves += 1
        self._save_key = f"olmo_eqx/hash/{self.directory}/{self._saves}"
        if jax.process_count() > 1 and jax.process_index() != 0 and self._local is not None:
            if self.spread:  # a killed save's files would be uploaded with this one's
                self._clear_part(step)
            threading.Thread(target=self._hash_own_files, args=(self._save_key, step), daemon=True,
                             name=f"olmo_eqx-hash-{step}").start()
        try:
            started = self._manager.save(step, args=args, force=force)
        except Exception as e:
            self._failed(step, e)
        if not self.async_save:
            self.wait_until_finished()
        return started

    # -- restore -----------------------------------------------------------------------------

    def _read(self, step: int, **items):
        """Orbax's restore of `items`, after verification; a read failure of a step that has no
        manifest (an older save, or not ours) becomes one clear `CheckpointCorruptError`."""
        verified = self.verify(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            if verified:
                raise  # the files are the saved ones: the target or the code is at fault
            raise CheckpointCorruptError(
                self.directory / str(step), step, "/".join(items) if len(items) == 1 else "its items",
                f"not a readable olmo_eqx checkpoint ({type(e).__name__}: {os_reason(e)})",
            ) from e

    def _restore_args(self, target: Any):
        if not self.spread:
            return ocp.args.StandardRestore(target)
        return ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))

    def _resolve_step(self, step: Optional[int]) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        elif step not in (steps := self.all_steps()):
            raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; have {steps}")
        return int(step)

    def restore(self, step: Optional[int] = None, *, target: TrainState) -> Restored:
        """Restore checkpoint `step` (default: the latest complete one) onto `target`'s layout.

        target: an abstract TrainState whose leaves are `jax.ShapeDtypeStruct`s carrying the
        shardings wanted *now* (`sharded_abstract_train_state(model_config, optim_config, mesh,
        rules)`); the stored model config must match `target.model.config`.
        """
        step = self._resolve_step(step)
        check_model_config(self.stored_model_config(step), target.model.config, f"checkpoint {self.directory / str(step)}")
        optional = {name: ocp.args.JsonRestore() for name in _OPTIONAL_ITEMS if (self._orbax_dir / str(step) / name).exists()}
        data = self._read(
            step,
            model=self._restore_args(target.model),
            train=self._restore_args(_train_part(target)),
            loader=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore(),
            model_config=ocp.args.JsonRestore(),
            **optional,
        )
        train = data["train"]
        state = TrainState(model=data["model"], **train)
        return Restored(
            step=step,
            state=state,
            loader_state=data["loader"] or None,
            config=data["config"] or None,
            model_config=model_config_from_dict(data["model_config"]),
            health=data["health"] if "health" in optional else None,
        )

    def restore_model(self, step: Optional[int] = None, *, target: Any):
        """Only the model's weights (evaluation, export, a later stage with a fresh optimiser).

        target: an abstract model (`abstract_model(config)`, leaves optionally carrying shardings).
        """
        step = self._resolve_step(step)
        check_model_config(self.stored_model_config(step), target.config, f"checkpoint {self.directory / str(step)}")
        return self._read(step, model=self._restore_args(target))["model"]

    # -- lifecycle ---------------------------------------------------------------------------

    def check_for_errors(self) -> None:
        """Raise `CheckpointSaveError` now if the save in flight has already failed (cheap).

        A save whose background writes are over is finished here, not at the next save: Orbax's
        finalising thread may take (and only log) the error of a failed write, which then
        surfaced one save interval late, and a step on an object store is uploaded as soon as
        it is complete."""
        try:
            self._manager.check_for_errors()
        except Exception as e:
            if self._saving is None:
                raise
            self._failed(self._saving, e)
        # One process only: with several, retention's listing is shared, so every process must
        # finish a save at the same call (the next save or the end), not when its own writes end.
        if self._saving is not None and jax.process_count() == 1 and not self._manager.is_saving_in_progress():
            self.wait_until_finished()

    def wait_until_finished(self) -> None:
        """Block until every started save is committed to disk, then apply retention.

        Raises `CheckpointSaveError` (path, OS error) when the save failed; its leftovers are gone.
        """
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            if self._saving is None:
                raise
            self._failed(self._saving, e)
        if self._saving is not None:
            step, self._saving = self._saving, None
            if self.remote is not None:
                self._upload(step)
            self._finished(step)

    def close(self) -> None:
        """Finish pending saves and release Orbax's threads."""
        try:
            self.wait_until_finished()
        finally:
            self._manager.close()
            if self._failed_step is not None:
                self._remove_leftovers(self._failed_step)


    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
