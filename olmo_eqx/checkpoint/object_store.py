"""The `Checkpointer`'s side on an object store (s3://, gs://): upload of a committed staged
step, uploads a killed run left pending, verified downloads, and retention there. A base
class of `Checkpointer`; it uses the attributes `Checkpointer.__init__` sets."""

import atexit
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import jax
from etils import epath

from olmo_eqx.checkpoint.digests import DIGEST_FILE, DigestMismatch, digest_paths, has_digests, verify_digests
from olmo_eqx.checkpoint.format import _READER_STAGING, COMMIT_MARKER, CheckpointCorruptError, _listed
from olmo_eqx.checkpoint.remote import COMMITTED as COMMITTED_OBJECT, SET_ASIDE_MARKER as SET_ASIDE_OBJECT, ObjectStoreError
from olmo_eqx.checkpoint.remote import RemoteSteps, StagedRecord, default_staging
from olmo_eqx.checkpoint.retention import steps_to_delete
from olmo_eqx.checkpoint.storage import CheckpointSaveError
from olmo_eqx.run.processes import agree, gather


class ObjectStoreSteps:
    """Object-store upkeep of a `Checkpointer`."""

    def _open_object_store(self, text: str, staging, staged_record) -> epath.Path:
        """Set up `self.remote` for the store at `text`; the local staging dir Orbax saves into."""
        read_only = self.read_only
        self.remote = RemoteSteps(text)
        self.staged_record = StagedRecord(staged_record) if staged_record is not None and not read_only else None
        # A reader gets a staging dir of its own: it must not touch a live writer's.
        staged = Path(staging).expanduser().resolve() if staging is not None else default_staging(text)
        if jax.process_count() > 1:
            # Each process stages its own files, also where several share a disk (one machine).
            staged = staged.with_name(f"{staged.name}-process{jax.process_index()}")
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
        if self.spread and jax.process_index() != 0:
            staged = self._local  # this process's part: a tmp dir there
        try:
            if self.spread:
                self._upload_parts(step)
            else:
                self.remote.upload(step, staged)
        except (ObjectStoreError, OSError, ValueError) as e:
            raise CheckpointSaveError(
                f"uploading checkpoint step {step} to {self.directory / str(step)} failed: {e}. It was not committed "
                f"there (no {COMMITTED_OBJECT}); the staged copy is kept in {staged}. Fix the store or its "
                "credentials, then rerun to resume from the last committed step"
            ) from e
        self._verified.add(step)
        if self.spread and jax.process_index() != 0:
            self._clear_part(step)
        if self.staged_record is not None:
            self.staged_record.uploaded(step)
        held = set(self.remote.committed_steps())
        for path in self._local.iterdir():
            if path.name.isdigit() and int(path.name) in held:
                shutil.rmtree(path, ignore_errors=True)
        _listed(self._manager.reload)

    def _upload_parts(self, step: int) -> None:
        """Every process of a spread run (a collective): upload the files this process wrote,
        then process 0 writes the one `committed.json`, only once every process says its part
        landed and the store lists every file of the step's manifest at its size. A process
        killed meanwhile leaves objects under `<url>/<step>/` that no listing counts."""
        first = jax.process_index() == 0
        try:
            if first:
                self.remote.check_owner()
            staged = self._local / str(step)
            part = {p.relative_to(staged).as_posix(): p for p in staged.rglob("*") if p.is_file()} if first else self._part(step)
            self.remote.put_part(step, part)
            landed = None
        except (ObjectStoreError, OSError, ValueError) as e:
            landed = f"{type(e).__name__}: {e}" if not isinstance(e, ObjectStoreError) else str(e)
        for index, error in enumerate(gather(f"uploaded_{step}", landed)):
            if error is not None:
                raise ObjectStoreError(f"process {index} of {jax.process_count()}: {error}")

        def commit() -> Optional[str]:
            try:
                manifest = json.loads((staged / DIGEST_FILE).read_text())
                self.remote.commit(step, manifest, [name for name in part if name not in manifest["files"]])
            except (ObjectStoreError, OSError, ValueError, KeyError) as e:
                return str(e)
            return None

        if (error := agree(f"committed_{step}", commit)) is not None:
            raise ObjectStoreError(error)

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

    def _upload_pending(self) -> bool:
        """Upload the staged steps a killed run committed locally but never uploaded (the upload
        runs at the next save or the close), once they still verify: nothing saved is lost.
        Whether any was uploaded."""
        if self.spread:
            return self._upload_pending_parts()
        held, uploaded = set(self.remote.committed_steps()), False
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
            uploaded = True
        return uploaded

    def _staged_manifests(self) -> dict[str, dict]:
        """Process 0: {step: the files of its digests.json} of each staged step committed there,
        verified, neither in the store nor marked set aside there (a spare copy is removed)."""
        held, found = set(self.remote.committed_steps()), {}
        for path in sorted((p for p in self._local.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
            step = int(path.name)
            if step in held:
                shutil.rmtree(path, ignore_errors=True)
                continue
            if not (path / COMMIT_MARKER).exists() or not has_digests(path) or SET_ASIDE_OBJECT in self.remote.occupied(step):
                continue
            try:
                verify_digests(path, present_only=True)  # the other processes' files are on their hosts
            except DigestMismatch:
                continue
            found[str(step)] = json.loads((path / DIGEST_FILE).read_text())["files"]
        return found

    def _upload_pending_parts(self) -> bool:
        """`_upload_pending` for a spread run (a collective): a step process 0 committed in its
        staging dir is uploaded once the processes' parts, each matching the step's manifest,
        hold every file of it (the same processes on the same hosts, with their staging dirs);
        the parts of other steps, which no commit will ever count, are removed."""
        pending = {int(step): files for step, files in agree("pending_uploads", self._staged_manifests).items()}
        first, uploaded = jax.process_index() == 0, False
        if not first:
            for path in self._local.glob("*.orbax-checkpoint-tmp*"):
                if not path.name.split(".")[0].isdigit() or int(path.name.split(".")[0]) not in pending:
                    shutil.rmtree(path, ignore_errors=True)
        for step, files in sorted(pending.items()):
            if first:
                mine = [name for name in files if (self._local / str(step) / name).is_file()]
            else:
                part = self._part(step)
                try:
                    held = digest_paths(part)
                except OSError:
                    held = {}
                mine = sorted(held) if held and all(files.get(n) == d for n, d in held.items()) else []
            parts = gather(f"pending_{step}", mine)
            if set().union(*parts) != set(files):
                if first:
                    logging.getLogger(__name__).warning(
                        "checkpoint step %d, committed in the staging dirs, is not uploaded: its processes' staged "
                        "parts lack %d of its %d files", step, len(set(files) - set().union(*parts)), len(files))
                continue
            if first:
                logging.getLogger(__name__).warning("uploading checkpoint step %d, staged but never uploaded", step)
            self._upload(step)
            uploaded = True
        return uploaded

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
