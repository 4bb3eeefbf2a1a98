"""The `Checkpointer`'s side on an object store (s3://, gs://): upload of a committed staged
step, uploads a killed run left pending, verified downloads, and retention there. A base
class of `Checkpointer`; it uses the attributes `Checkpointer.__init__` sets."""

import atexit
import json
import logging
import os
import shutil
from pathlib import Path

import jax
from etils import epath

from olmo_eqx.checkpoint.digests import DIGEST_FILE, DigestMismatch, has_digests, verify_digests
from olmo_eqx.checkpoint.format import _READER_STAGING, COMMIT_MARKER, CheckpointCorruptError, _listed
from olmo_eqx.checkpoint.remote import COMMITTED as COMMITTED_OBJECT, SET_ASIDE_MARKER as SET_ASIDE_OBJECT, ObjectStoreError
from olmo_eqx.checkpoint.remote import RemoteSteps, StagedRecord, default_staging
from olmo_eqx.checkpoint.retention import steps_to_delete
from olmo_eqx.checkpoint.storage import CheckpointSaveError


class ObjectStoreSteps:
    """Object-store upkeep of a `Checkpointer`."""

    def _open_object_store(self, text: str, staging, staged_record) -> epath.Path:
        """Set up `self.remote` for the store at `text`; the local staging dir Orbax saves into."""
        read_only = self.read_only
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
        return epath.Path(staged)

    def _prune_remote(self) -> None:
        """Retention on an object store: every committed step has its manifest; the newest step
        this process verified (uploaded or checked on restore) is never deleted, nor a marked one
        (listings skip those). Pins are local-only (`pins.py`)."""
        steps = self.remote.committed_steps()
        verified = [s for s in self._verified if s in steps]
        protected = set(self.protected) | ({max(verified)} if verified else set())
        for step in steps_to_delete(steps, set(steps), self.keep_last, self.keep_every, protected):
            self.remote.delete(step)
            self._verified.discard(step)

    def _upload(self, step: int) -> None:
        """Upload the committed staged step (`remote.RemoteSteps.upload`), then drop
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
