"""The one checkpoint format every stage reads and writes (Orbax).

One step directory per checkpoint, written atomically (Orbax writes `<step>.orbax-checkpoint-
tmp-*` and renames it on commit, so a run killed mid-save leaves only an ignored tmp dir):

    <dir>/<step>/model/         the model's arrays (sharded, restorable on any mesh)
    <dir>/<step>/train/         optimiser state, step, skip-step statistics
    <dir>/<step>/loader/        the data position (`LoaderState.to_dict()`), JSON
    <dir>/<step>/config/        the run's resolved config, JSON
    <dir>/<step>/model_config/  the `ModelConfig`, JSON (checked on every restore)
    <dir>/<step>/health/        what the run knew of its health when it saved, JSON
                                (`{"last_good": step}`, `train/divergence.py`)

Restoring onto another mesh or device count (8 -> 4 -> 1) goes through an abstract target
whose leaves carry the *new* shardings: `sharded_abstract_train_state(...)`.

Every step also holds `digests.json` (size and SHA-256 of each file, written before the
commit; `checkpoint_digests.py`); restores verify it and raise `CheckpointCorruptError`
(step, file, reason) when a file differs. Retention is ours, not Orbax's: it counts only
steps with a manifest, so a newer damaged or unverifiable step never pushes out the last good
one, and it never removes the `protected` step (the last one known good while a run is in
trouble; `checkpoint_retention.py`). A step directory that is in the way of a save (no commit marker, or failed verification)
is moved into `<dir>/set_aside/`, never deleted.

On an object store (`s3://`, `gs://`), which has no rename, Orbax saves into a local staging
dir with all of the above, and the committed step is uploaded with a `committed.json` (its
digests) written last; set-aside is a `set_aside.json` marker (`checkpoint_remote.py`).

This module is the Orbax side (save, restore, set-aside); each other concern has its own:

    checkpoint_digests.py    the manifest: who hashes which file, verification
    checkpoint_retention.py  which steps retention deletes (a pure decision, process 0's)
    checkpoint_pins.py       readers of a live run keep their step from retention
    checkpoint_storage.py    the pre-flight storage check, a failed write's OS cause
    checkpoint_paths.py      what a user's path names (run dir, checkpoints dir, step, HF dir)
    checkpoint_remote.py     checkpoints on object stores: upload, commit object, markers
    processes.py             what several processes agree on (listings, verdicts, failures)
"""

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from .checkpoint_digests import DIGEST_FILE, DigestMismatch, digest_files, has_digests, verify_digests, write_digests
from .checkpoint_pins import pinned_steps, pins_locked
from .checkpoint_remote import COMMITTED as COMMITTED_OBJECT, SET_ASIDE_MARKER as SET_ASIDE_OBJECT, ObjectStoreError, RemoteSteps
from .checkpoint_remote import StagedRecord, default_staging, is_object_store
from .checkpoint_retention import steps_to_delete
from .checkpoint_storage import CheckpointSaveError, os_reason
from .models.config import ModelConfig, YarnConfig
from .processes import agree, fetch, gather, post
from .errors import RunError
from .train.state import TrainState

# Fields that change how a model runs but not its weights; a checkpoint may be restored
# under different values (same list as `registry.with_config` allows).
RUNTIME_FIELDS = (
    "attention_impl", "attention_block_size", "remat", "compute_dtype", "loss_chunk_size", "scan_layers", "moe_exchange"
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
    Orbax reports as FileNotFoundError. The pins keep the step a reader reads; any other step
    may go, and a fresh listing no longer has it."""
    for attempt in range(attempts):
        try:
            return list_steps()
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


class Checkpointer:
    """Save and restore train states in `directory` (made absolute; created if missing).

    keep_last: newest checkpoints kept; keep_every: also keep steps divisible by it.
    read_only: open someone else's checkpoints (eval, export) without touching the directory.
    staged_record: on an object store, a file (in the run dir) recording the steps committed
    in the staging dir and not yet uploaded (`checkpoint_remote.StagedRecord`).
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
        # digests and a commit object written last (`checkpoint_remote.py`); every local
        # guarantee then holds there. Other URLs go straight to Orbax, unverified.
        self.remote: Optional[RemoteSteps] = None
        self.staged_record: Optional[StagedRecord] = None
        orbax_dir = self.directory
        if is_object_store(text):
            if jax.process_count() > 1:
                raise CheckpointSaveError(
                    f"checkpoint.dir={text}: checkpoints on object stores are written by one process only so far "
                    f"(this run has {jax.process_count()}); use a shared filesystem (e.g. a gcsfuse or s3 mount) as checkpoint.dir"
                )
            self.remote = RemoteSteps(text)
            self.staged_record = StagedRecord(staged_record) if staged_record is not None and not read_only else None
            # A reader gets a staging dir of its own: it must not touch a live writer's.
            staged = Path(staging).expanduser().resolve() if staging is not None else default_staging(text)
            if read_only:  # shared by this process's readers, removed at its exit
                staged = staged.with_name(f"{staged.name}-read-{os.getpid()}")
                if staged not in _READER_STAGING:
                    _READER_STAGING.add(staged)
                    atexit.register(shutil.rmtree, staged, ignore_errors=True)
            staged.mkdir(parents=True, exist_ok=True)
            orbax_dir = epath.Path(staged)
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
            self._manager = _listed(lambda: ocp.CheckpointManager(orbax_dir, options=options, item_names=_ITEMS))
        if self.remote is not None and not read_only:
            self._upload_pending()

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

    def _list_steps(self) -> list[int]:
        """This process's own listing (process 0's, or a reader's)."""
        if self.remote is not None:  # committed.json written last, no set-aside marker
            return self.remote.committed_steps()
        _listed(self._manager.reload)
        # Orbax commits by renaming its tmp dir on POSIX and lists any step-named dir; also
        # demand the commit marker it writes last, so a step dir copied or synced without
        # finishing (or written by a non-atomic filesystem) is never taken for complete.
        return sorted(
            step for step in self._manager.all_steps() if (self._orbax_dir / str(step) / COMMIT_MARKER).exists()
        )

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
        elif self.remote is not None and self.remote.occupied(step):
            in_the_way = "uncommitted or set aside"  # objects of a killed upload, or a marked step
        elif (self._orbax_dir / str(step)).exists():
            # No commit marker: Orbax would refuse the step forever (StepAlreadyExistsError).
            in_the_way = "no commit marker"
        if in_the_way is not None:
            self.set_aside(step, in_the_way)
            if self.remote is not None:  # no rename there: the objects are copied aside, then removed
                self.remote.relocate(step)
            if jax.process_count() > 1:  # every process must see it gone before Orbax saves
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"olmo_eqx_set_aside_{step}")
                _listed(self._manager.reload)
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(state.model),
            train=ocp.args.StandardSave(_train_part(state)),
            loader=ocp.args.JsonSave(_jsonable(loader_state)),
            config=ocp.args.JsonSave(_jsonable(config)),
            model_config=ocp.args.JsonSave(model_config_to_dict(state.model.config)),
            health=ocp.args.JsonSave(health or {}),
        )
        self._saving = step
        self._saves += 1
        self._save_key = f"olmo_eqx/hash/{self.directory}/{self._saves}"
        if jax.process_count() > 1 and jax.process_index() != 0 and self._local is not None:
            threading.Thread(target=self._hash_own_files, args=(self._save_key,), daemon=True,
                             name=f"olmo_eqx-hash-{step}").start()
        try:
            started = self._manager.save(step, args=args, force=force)
        except Exception as e:
            self._failed(step, e)
        if not self.async_save:
            self.wait_until_finished()
        return started

    def _write_manifest(self) -> None:
        """Orbax's hook after every process wrote its files, before the rename (primary host
        only; it runs in Orbax's finalising thread, not the training thread). With several
        processes each hashes the files it wrote (`_hash_own_files`) and this assembles them."""
        if self._local is None:
            return
        tmp_dirs = sorted(self._local.glob(f"{self._saving}.orbax-checkpoint-tmp*"), key=lambda p: p.stat().st_mtime)
        if not tmp_dirs:
            return
        if jax.process_count() == 1:
            write_digests(tmp_dirs[-1])
            if self.staged_record is not None:  # the last moment before the local commit
                self.staged_record.staged(self._saving, self._local / str(self._saving))
            return
        post(f"{self._save_key}/request", str(tmp_dirs[-1]))
        files = digest_files(tmp_dirs[-1], process=0)
        for other in range(1, jax.process_count()):
            share = fetch(f"{self._save_key}/{other}")
            if "error" in share:
                raise OSError(f"process {other} could not hash its checkpoint files: {share['error']}")
            files.update(share["files"])
        write_digests(tmp_dirs[-1], files)

    def _hash_own_files(self, key: str) -> None:
        """Process i > 0, in a thread of its own: once process 0 says the step's files are all
        written (its tmp dir), hash those this process wrote and hand them over."""
        try:
            tmp_dir = fetch(f"{key}/request")
            share = {"files": digest_files(tmp_dir, process=jax.process_index())}
        except Exception as e:  # process 0 reports it; a save that never finalised just ends here
            share = {"error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(Exception):
            post(f"{key}/{jax.process_index()}", share)

    def _failed(self, step: int, error: BaseException):
        """Remove what a failed save left and raise one line naming the path and the OS error."""
        self._remove_leftovers(step)
        # Writes of the same save still in flight (other arrays, Orbax's and TensorStore's
        # threads) may recreate part of the tmp dir after this; close() removes it again once
        # those threads are done.
        self._failed_step = step
        self._saving = None
        if self.staged_record is not None:  # its staged copy is removed with the leftovers
            self.staged_record.dropped(step)
        with contextlib.suppress(Exception):
            _listed(self._manager.reload)
        raise CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory / str(step)} failed: {os_reason(error)}. "
            "Nothing partial was kept; the previous checkpoints are intact. Free space or fix the "
            "permissions of checkpoint.dir, then rerun to resume"
        ) from error

    def _remove_leftovers(self, step: int) -> None:
        """Delete a failed save's tmp dir and any uncommitted step dir (process 0)."""
        if self._local is None or jax.process_index() != 0:
            return
        leftovers = [*self._local.glob(f"{step}.orbax-checkpoint-tmp*")]
        if (self._local / str(step)).exists() and not (self._local / str(step) / COMMIT_MARKER).exists():
            leftovers.append(self._local / str(step))
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)

    def set_aside(self, step: int, reason: str) -> Optional[Path | str]:
        """Move step `step`'s directory into `<dir>/set_aside/` (process 0); where it went.
        On an object store: write the step's `set_aside.json` marker (no move); the marker's URL."""
        if self.remote is not None:
            self._set_aside_local(step, reason)  # a staged or downloaded copy, if any
            self._verified.discard(step)
            if step in self.remote.committed_steps():
                return self.remote.mark_set_aside(step, reason)
            return None
        return self._set_aside_local(step, reason)

    def _set_aside_local(self, step: int, reason: str) -> Optional[Path]:
        if self._local is None or jax.process_index() != 0 or not (self._local / str(step)).exists():
            return None
        slug = "-".join("".join(c if c.isalnum() else " " for c in reason.lower()).split())[:40]
        target = self._local / SET_ASIDE_DIR / f"{step}-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
        target.parent.mkdir(parents=True, exist_ok=True)
        (self._local / str(step)).rename(target)
        self._verified.discard(step)
        _listed(self._manager.reload)
        return target

    def protect(self, *steps: Optional[int]) -> None:
        """Retention keeps `steps` (None entries ignored) from now on, in place of those
        protected before."""
        self.protected = frozenset(int(s) for s in steps if s is not None)

    def _prune(self) -> None:
        """Apply retention (`checkpoint_retention.steps_to_delete`) on process 0."""
        if self.read_only or self.keep_last is None or self._local is None or jax.process_index() != 0:
            return
        if self.remote is not None:
            self._prune_remote()
            return
        steps = self._list_steps()
        sealed = {s for s in steps if has_digests(self._local / str(s))}
        if not steps_to_delete(steps, sealed, self.keep_last, self.keep_every, self.protected):
            _listed(self._manager.reload)
            return  # nothing to delete, whatever readers pin: no lock (a run never pruned keeps no pins/)
        doomed = []
        # Under the pins' lock, created if no reader has yet: a reader's pin is seen here, or
        # written once its step is gone (and the reader, finding it gone, falls back).
        with pins_locked(self._local):
            protected = self.protected | pinned_steps(self._local)  # and what readers are reading
            for step in steps_to_delete(steps, sealed, self.keep_last, self.keep_every, protected):
                # Renamed first, so a kill mid-delete never leaves a step that looks complete.
                path = self._local / f".deleting-{step}"
                (self._local / str(step)).rename(path)
                # Only where the filesystem has no flock (the lock is then a no-op) can a pin
                # appear meanwhile: the step goes back, and a reader of it may have seen it
                # missing for the moment between the two renames.
                if step in pinned_steps(self._local):
                    path.rename(self._local / str(step))
                    continue
                doomed.append(path)
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        _listed(self._manager.reload)

    def _prune_remote(self) -> None:
        """Retention on an object store: every committed step has its manifest; the newest step
        this process verified (uploaded or checked on restore) is never deleted, nor a marked one
        (listings skip those). Pins are local-only (`checkpoint_pins.py`)."""
        steps = self.remote.committed_steps()
        verified = [s for s in self._verified if s in steps]
        protected = set(self.protected) | ({max(verified)} if verified else set())
        for step in steps_to_delete(steps, set(steps), self.keep_last, self.keep_every, protected):
            self.remote.delete(step)
            self._verified.discard(step)

    def _upload(self, step: int) -> None:
        """Upload the committed staged step (`checkpoint_remote.RemoteSteps.upload`), then drop
        the staged copies of steps the store holds."""
        staged = self._local / str(step)
        try:
            self.remote.upload(step, staged)
        except (ObjectStoreError, OSError, ValueError) as e:
            raise CheckpointSaveError(
                f"uploading checkpoint step {step} to {self.directory / str(step)} failed: {e}. It was not committed "
                f"there (no {COMMITTED_OBJECT}); the staged copy is kept at {staged}. Fix the store or its "
                "credentials, then rerun to resume from the last committed step"
            ) from e
        self._verified.add(step)
        if self.staged_record is not None:
            self.staged_record.uploaded(step)
        held = set(self.remote.committed_steps())
        for path in self._local.iterdir():
            if path.name.isdigit() and int(path.name) in held:
                shutil.rmtree(path, ignore_errors=True)
        _listed(self._manager.reload)

    def _copy_verifies(self, step: int, target: Path) -> bool:
        """Whether the staging dir already holds a copy of committed step `step` (an earlier
        download in this process) whose every file matches the committed digests."""
        try:
            committed = self.remote.committed(step)
            held = json.loads((target / DIGEST_FILE).read_text())
            if held.get("files") != committed["files"]:
                return False
            verify_digests(target)
        except (DigestMismatch, ObjectStoreError, OSError, ValueError, KeyError, TypeError):
            return False
        self._verified.add(step)
        return True

    def _upload_pending(self) -> None:
        """Upload the staged steps a killed run committed locally but never uploaded (the upload
        runs at the next save or the close), once they still verify: nothing saved is lost."""
        held = set(self.remote.committed_steps())
        for path in sorted((p for p in self._local.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
            step = int(path.name)
            if step in held:
                shutil.rmtree(path, ignore_errors=True)  # the store has it; this is a spare copy
                continue
            if not (path / COMMIT_MARKER).exists() or not has_digests(path) or SET_ASIDE_OBJECT in self.remote.occupied(step):
                continue
            try:
                verify_digests(path)
            except DigestMismatch:
                continue  # in the way of a save of this step, it is set aside then
            logging.getLogger(__name__).warning("uploading checkpoint step %d, staged at %s but never uploaded", step, path)
            self._upload(step)

    def _verify_remote(self, step: int) -> bool:
        """Download committed step `step` into the staging dir and check it (a fresh copy each
        time: the store's bytes are what is verified, not an older download)."""
        target, tmp = self._local / str(step), self._local / f".download-{step}"
        if self._copy_verifies(step, target):
            return True
        for path in (target, tmp):
            shutil.rmtree(path, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            self.remote.download(step, tmp)
            verify_digests(tmp)
        except DigestMismatch as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointCorruptError(self.directory / str(step), step, e.file, e.reason) from e
        except (ObjectStoreError, OSError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointCorruptError(self.directory / str(step), step, "its objects", f"unreadable ({e})") from e
        tmp.rename(target)
        _listed(self._manager.reload)
        self._verified.add(step)
        return True

    # -- restore -----------------------------------------------------------------------------

    def verify(self, step: int) -> bool:
        """Check step `step`'s files against its manifest: True when verified, False when it
        has none (saved by an older olmo_eqx). Raises `CheckpointCorruptError` otherwise.

        With several processes each checks every P-th file and all share the verdicts (a
        collective): each file is read once, not once per process."""
        if self._local is None:
            return step in self._verified
        if self.remote is not None:
            # Verified, but its staged copy is gone once uploaded (a killed run's step that the
            # next writer uploads): restoring it needs the download, or Orbax finds no step.
            if step in self._verified and (self._local / str(step)).is_dir():
                return True
            return self._verify_remote(step)
        if step in self._verified:
            return True
        try:
            checked = verify_digests(self._local / str(step), (jax.process_index(), jax.process_count()))
            verdict = {"manifest": checked is not None, "mismatch": None}
        except DigestMismatch as e:
            verdict = {"manifest": True, "mismatch": [e.file, e.reason]}
        verdicts = gather(f"verify_{step}", verdict)
        for other in verdicts:
            if other["mismatch"] is not None:
                file, reason = other["mismatch"]
                raise CheckpointCorruptError(self.directory / str(step), step, file, reason)
        if not all(v["manifest"] for v in verdicts):
            return False
        self._verified.add(step)
        return True

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
            model=ocp.args.StandardRestore(target.model),
            train=ocp.args.StandardRestore(_train_part(target)),
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
        return self._read(step, model=ocp.args.StandardRestore(target))["model"]

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
            self._prune()

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
