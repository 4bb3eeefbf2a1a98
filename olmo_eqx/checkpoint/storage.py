"""Storage faults of checkpoints: the pre-flight check that a checkpoint dir can take one
checkpoint (`check_storage`), and the one-line OS cause of a failed write (`os_reason`) that
`CheckpointSaveError` carries.
"""

import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax

from olmo_eqx.errors import RunError


class CheckpointSaveError(RunError):
    """A save that failed (unwritable directory, disk full, ...); nothing partial is kept."""


def os_reason(error: BaseException) -> str:
    """The OS-level cause of `error` in one line: Orbax wraps TensorStore's errors, which carry
    the errno as `[os_error_code='28']` inside a long message."""
    seen, chain = error, [error]
    while (seen := seen.__cause__ or seen.__context__) is not None and len(chain) < 20:
        chain.append(seen)
    for candidate in reversed(chain):
        if isinstance(candidate, OSError) and candidate.errno:
            where = f" at {candidate.filename}" if candidate.filename else ""
            return f"{candidate.strerror} (errno {candidate.errno}){where}"
        text = str(candidate)
        if code := re.search(r"os_error_code='(\d+)'", text):
            file = re.search(r'Failed writing: "([^"]+)"', text)
            return f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})" + (f" writing {file.group(1)}" if file else "")
    text = str(chain[-1]) or type(chain[-1]).__name__
    return text.strip().splitlines()[0][:300]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def check_storage(directory: str | os.PathLike, abstract_state: Any) -> None:
    """Stop now, not after hours of training, if `directory` cannot take one checkpoint.

    Creates the directory, writes and removes a probe file, and compares the free space with
    the size of `abstract_state` (a tree of `jax.ShapeDtypeStruct`s: what a save writes).
    Raises `CheckpointSaveError` naming the path, the OS error or both sizes. On an object
    store (s3://, gs://) it lists the store and checks the local staging dir the saves go
    through (`remote.py`); other URLs are left to the first save.
    """
    text = os.fspath(directory)
    fix = "choose another checkpoint.dir or fix its permissions"
    if text.startswith(("s3://", "gs://")):
        # The store must answer a listing, and the local staging dir take one checkpoint.
        from olmo_eqx.checkpoint.remote import ObjectStoreError, RemoteSteps, default_staging

        try:
            RemoteSteps(text).committed_steps()
        except ObjectStoreError as e:
            raise CheckpointSaveError(str(e)) from e
        path, fix = default_staging(text), "set OLMO_EQX_CHECKPOINT_STAGING to a local dir with room for one checkpoint"
    elif "://" in text:
        return
    else:
        path = Path(text)
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_state) if hasattr(leaf, "dtype"))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise CheckpointSaveError(
            f"checkpoint dir {path} is not writable: {e.strerror} ({e.filename or path}); {fix}"
        ) from e
    free = shutil.disk_usage(path).free
    if free < need:
        raise CheckpointSaveError(
            f"checkpoint dir {path} has {_gib(free)} free but one checkpoint of this state needs about "
            f"{_gib(need)}; free space there or {fix}"
        )
