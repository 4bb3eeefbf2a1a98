"""The `Checkpointer`'s local step directories: the manifest written at the commit (with
several processes, each hashing the files it wrote), a failed save's leftovers, set-aside,
and retention under the readers' pins. A base class of `Checkpointer`, apart so that each
reads on its own; it uses the attributes `Checkpointer.__init__` sets."""

import contextlib
import shutil
import time
from pathlib import Path
from typing import Optional

import jax

from olmo_eqx.checkpoint.digests import (
    DigestMismatch, digest_files, digest_paths, has_digests, part_files, verify_digests, write_digests,
)
from olmo_eqx.checkpoint.format import COMMIT_MARKER, SET_ASIDE_DIR, CheckpointCorruptError, _listed
from olmo_eqx.checkpoint.pins import pinned_steps, pins_locked
from olmo_eqx.checkpoint.retention import steps_to_delete
from olmo_eqx.checkpoint.storage import CheckpointSaveError, os_reason
from olmo_eqx.run.processes import agree, fetch, gather, post


class LocalSteps:
    """Local step-directory upkeep of a `Checkpointer`."""

    _began = 0.0  # when the save in flight began (perf_counter; set by `save`)
    # completed: (step, seconds from its start) of each save complete since the caller took them
    # (the loop's "step N is safe" lines); incomplete: steps a save began and never committed
    # (a killed run's), found before Orbax removes their tmp dirs, which a rerun names.
    completed: list[tuple[int, float]]
    incomplete: list[int]

    def _finished(self, step: int) -> None:
        """A save is complete (committed; uploaded on an object store): record it, apply retention."""
        self.completed.append((step, time.perf_counter() - self._began))
        self._prune()

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
        # Spread over staging dirs, this one holds only this process's files: all of them.
        files = digest_files(tmp_dirs[-1], process=None if self.spread else 0)
        for other in range(1, jax.process_count()):
            share = fetch(f"{self._save_key}/{other}")
            if "error" in share:
                raise OSError(f"process {other} could not hash its checkpoint files: {share['error']}")
            if twice := sorted(set(files) & set(share["files"])):
                raise OSError(f"process {other} wrote {twice[0]} too: each file of a step must have one writer")
            files.update(share["files"])
        write_digests(tmp_dirs[-1], files)
        if self.staged_record is not None:
            self.staged_record.staged(self._saving, self._local / str(self._saving), jax.process_count())

    def _hash_own_files(self, key: str, step: int) -> None:
        """Process i > 0, in a thread of its own: once process 0 says the step's files are all
        written (its tmp dir), hash those this process wrote and hand them over. On an object
        store they are in this process's own staging dir, in a tmp dir Orbax never renames."""
        try:
            tmp_dir = fetch(f"{key}/request")
            if self.spread:
                share = {"files": digest_paths(self._part(step))}
            else:
                share = {"files": digest_files(tmp_dir, process=jax.process_index())}
        except Exception as e:  # process 0 reports it; a save that never finalised just ends here
            share = {"error": f"{type(e).__name__}: {e}"}
        with contextlib.suppress(Exception):
            post(f"{key}/{jax.process_index()}", share)

    def _incomplete(self) -> list[int]:
        """Steps a save began and never committed here (process 0; before Orbax removes their tmp dirs)."""
        if self._local is None or jax.process_index() != 0 or not self._local.is_dir():
            return []
        steps = set()
        for path in self._local.iterdir():
            head = path.name.split(".")[0]
            if ".orbax-checkpoint-tmp" in path.name and head.isdigit():
                steps.add(int(head))
            elif path.name.isdigit() and not (path / COMMIT_MARKER).exists():
                steps.add(int(path.name))
        return sorted(steps)

    def finish_if_done(self) -> None:
        """With several processes, finish the save in flight once every process's writes are
        over (a collective: every process calls it at the same points). One process needs no
        agreement: `check_for_errors` finishes its save as soon as it is done."""
        if jax.process_count() == 1:
            return
        if self._saving is not None and all(gather("save_done", not self._manager.is_saving_in_progress())):
            self.wait_until_finished()

    def _part_dirs(self, step: int) -> list[Path]:
        """This process's tmp dirs of step `step` (processes i > 0 of a spread run)."""
        return sorted(self._local.glob(f"{step}.orbax-checkpoint-tmp*"))

    def _part(self, step: int) -> dict[str, Path]:
        """The files this process (i > 0 of a spread run) wrote for step `step`, by their names
        in the step."""
        files: dict[str, Path] = {}
        for tmp_dir in self._part_dirs(step):
            files.update(part_files(tmp_dir))
        return files

    def _clear_part(self, step: int) -> None:
        for tmp_dir in self._part_dirs(step):
            shutil.rmtree(tmp_dir, ignore_errors=True)

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
        """Delete a failed save's tmp dir and any uncommitted step dir (process 0; on an object
        store every process its own)."""
        if self._local is not None and self.spread and jax.process_index() != 0:
            self._clear_part(step)
        if self._local is None or jax.process_index() != 0:
            return
        leftovers = [*self._local.glob(f"{step}.orbax-checkpoint-tmp*")]
        if (self._local / str(step)).exists() and not (self._local / str(step) / COMMIT_MARKER).exists():
            leftovers.append(self._local / str(step))
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)

    def _set_aside_local(self, step: int, reason: str) -> Optional[Path]:
        if self._local is not None and self.spread and jax.process_index() != 0:
            # A downloaded copy: the marked objects stay in the store; Orbax must not list it.
            shutil.rmtree(self._local / str(step), ignore_errors=True)
            self._verified.discard(step)
            _listed(self._manager.reload)
            return None
        if self._local is None or jax.process_index() != 0 or not (self._local / str(step)).exists():
            return None
        slug = "-".join("".join(c if c.isalnum() else " " for c in reason.lower()).split())[:40]
        target = self._local / SET_ASIDE_DIR / f"{step}-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
        target.parent.mkdir(parents=True, exist_ok=True)
        (self._local / str(step)).rename(target)
        self._verified.discard(step)
        _listed(self._manager.reload)
        return target

    def _prune(self) -> None:
        """Apply retention (`retention.steps_to_delete`) on process 0."""
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

    def set_aside(self, step: int, reason: str) -> Optional[Path | str]:
        """Move step `step`'s directory into `<dir>/set_aside/` (process 0); where it went.
        On an object store: write the step's `set_aside.json` marker (no move); the marker's URL."""
        if self.remote is not None:
            self._set_aside_local(step, reason)  # a staged or downloaded copy, if any
            self._verified.discard(step)
            # Process 0 marks it; every process learns where (a collective with several).
            return agree("set_aside", lambda: self.remote.mark_set_aside(step, reason)
                         if step in self.remote.committed_steps() else None)
        return self._set_aside_local(step, reason)

    def protect(self, *steps: Optional[int]) -> None:
        """Retention keeps `steps` (None entries ignored) from now on, in place of those
        protected before."""
        self.protected = frozenset(int(s) for s in steps if s is not None)

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
            if not self.spread:
                return (step in self._verified and (self._local / str(step)).is_dir()) or self._verify_remote(step)
            # Each process downloads and checks the copy it reads; all learn every verdict.
            try:
                (step in self._verified and (self._local / str(step)).is_dir()) or self._verify_remote(step)
                verdict = None
            except CheckpointCorruptError as e:
                verdict = [e.file, e.reason]
            for other in gather(f"verify_remote_{step}", verdict):
                if other is not None:
                    raise CheckpointCorruptError(self.directory / str(step), step, *other)
            return True
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
