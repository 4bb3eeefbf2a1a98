"""Pins: a reader of a live run's checkpoints (eval, compare, soup, export) keeps the step it
reads from that run's retention.

    <checkpoint dir>/pins/<step>.<host>.<pid>     one per reading process, removed at its exit

The writer's retention skips a step with a live pin: one whose process is still running on
this host, or, from another host (whose processes it cannot see), one younger than
`REMOTE_PIN_HOURS`. A reader pins before it reads and then checks the step is still complete;
if retention removed it in between, it takes the newest complete step and says so.

Writing a pin and retention's read-pins-then-remove hold one lock (`pins/.lock`, flock; retention
creates it the first time it has a step to delete, a reader the first time it pins), so a pin is
either seen by retention or written after the step is gone: a reader that found its step complete
after pinning keeps it until it unpins. What is left open:

- a filesystem without flock (the lock is then a no-op): retention renames a step away, rereads
  the pins and renames it back if one appeared, so a reader whose completeness check came just
  before that rename can find the step's files missing for the moment between the two renames;
- a pin from another host is honoured for `REMOTE_PIN_HOURS` only (its process cannot be seen);
- pins are local paths: on an object store (`s3://`, `gs://`) readers are not pinned (they
  download and verify their copy once, `remote.py`).
"""

import atexit
import contextlib
import fcntl
import json
import os
import time
import warnings
from pathlib import Path
from typing import Optional

from olmo_eqx.run.lock import _pid_alive

PIN_DIR = "pins"
REMOTE_PIN_HOURS = 6.0
_held: set[Path] = set()


def _release_all() -> None:
    for path in list(_held):
        unpin(path)


atexit.register(_release_all)


@contextlib.contextmanager
def pins_locked(directory: Path, create: bool = True):
    """Hold the pins' lock of the checkpoints dir `directory` (see the module docstring),
    creating `pins/` unless `create` is False (then without a lock where there is none)."""
    pins = Path(directory) / PIN_DIR
    try:
        if create:
            pins.mkdir(exist_ok=True)
        handle = open(pins / ".lock", "a")
    except OSError:  # read-only, or no reader yet: nobody to wait for
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass  # no flock on this filesystem
        yield


def pin(directory: Path, step: int) -> Optional[Path]:
    """Pin `step` of the checkpoints dir `directory` until `unpin` or this process's exit;
    None where the directory is not writable (a read-only copy has no retention to fear)."""
    host, pid = os.uname().nodename, os.getpid()
    path = Path(directory) / PIN_DIR / f"{step}.{host}.{pid}"
    try:
        with pins_locked(directory):
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps({"step": step, "host": host, "pid": pid}) + "\n")
    except OSError:
        return None
    _held.add(path)
    return path


def unpin(path: Optional[Path]) -> None:
    if path is not None:
        _held.discard(path)
        path.unlink(missing_ok=True)


def pinned_steps(directory: Path) -> set[int]:
    """Steps of `directory` with a live pin; stale pins (their process gone) are removed."""
    pins = Path(directory) / PIN_DIR
    if not pins.is_dir():
        return set()
    steps, host = set(), os.uname().nodename
    for path in pins.iterdir():
        if path.name.startswith("."):
            continue  # the lock
        try:
            pinned = json.loads(path.read_text())
            step, pin_host, pid = int(pinned["step"]), pinned["host"], int(pinned["pid"])
            age_h = (time.time() - path.stat().st_mtime) / 3600
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written or removed right now
        if pin_host == host and not _pid_alive(pid):
            path.unlink(missing_ok=True)
        elif pin_host == host or age_h < REMOTE_PIN_HOURS:
            steps.add(step)
    return steps


def pin_location(location, complete, newest):
    """Pin the step `location` names; `location` itself while it is still complete
    (`complete(location)`), else the newest complete one (`newest()`), saying so."""
    for _ in range(5):
        path = pin(location.directory, location.step)
        if complete(location):
            return location
        unpin(path)
        gone, location = location.step, newest()
        warnings.warn(
            f"checkpoint step {gone} in {location.directory} was removed (by the retention of the run writing "
            f"there) before it could be read; reading step {location.step}, the newest complete one",
            stacklevel=2,
        )
    return location
