"""One writer per run directory: `<run dir>/run.lock`, holding the holder's host and pid.

Two processes training into one run directory both write its checkpoints and metrics, and
each deletes the other's in-flight checkpoint saves at start-up. The lock stops the second
at once. It is an `flock` on the file (released by the kernel however the holder dies) plus
the holder's identity written into it, for the message and for the case flock cannot see:
a lock file left on shared storage by another host, which is refused rather than guessed
about. A lock file naming a dead process on this host is stale and is taken over with a
warning. Multi-process jobs take it once, on process 0.
"""

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

LOCK_FILE = "run.lock"


class RunLockedError(RuntimeError):
    """Another process holds the run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since', '?')})"


class RunLock:
    """`with RunLock(run_dir): ...` holds `run_dir/run.lock` for the duration.

    Raises `RunLockedError` naming the holder when another live process has it.
    """

    def __init__(self, run_dir: str | os.PathLike, warn=None):
        self.path = Path(run_dir) / LOCK_FILE
        self._file = None
        self._warn = warn or (lambda text: print(f"warning: {text}", file=sys.stderr, flush=True))

    def _read_holder(self) -> Optional[dict]:
        try:
            text = self.path.read_text()
            return json.loads(text) if text.strip() else None
        except (OSError, ValueError):
            return None

    def acquire(self) -> "RunLock":
        host = socket.gethostname()
        while True:
            file = open(self.path, "a+")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                holder = self._read_holder() or {}
                raise RunLockedError(
                    f"run dir {self.path.parent} is in use by {_describe(holder)} (lock {self.path}): "
                    "two runs writing one run dir corrupt each other's checkpoints and metrics. Wait for "
                    "it to finish, stop it, or give this run another hydra.run.dir"
                ) from None
            # The holder may have released and removed the file between our open and flock:
            # then we locked an orphan inode and must retry on the new file.
            try:
                same = os.fstat(file.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            file.close()
        holder = self._read_holder()
        if holder and holder.get("pid") != os.getpid():
            if holder.get("host") != host:
                fcntl.flock(file, fcntl.LOCK_UN)
                file.close()
                raise RunLockedError(
                    f"run dir {self.path.parent} has a lock left by {_describe(holder)}, another host: this "
                    f"host cannot tell whether that run is alive. If it is not, delete {self.path} and rerun"
                )
            state = "is no longer running" if not _pid_alive(int(holder.get("pid", -1))) else "does not hold it"
            self._warn(f"taking over the stale lock {self.path} of {_describe(holder)}, which {state}")
        file.seek(0)
        file.truncate()
        file.write(json.dumps({"host": host, "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        if self._file is None:
            return
        # Removed while still locked, so nobody can lock this file's inode and believe it current.
        self.path.unlink(missing_ok=True)
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
