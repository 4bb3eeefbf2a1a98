"""A digest of every file of a checkpoint step, written into the step before it commits.

Orbax's commit marker says a save *finished*; it cannot say the bytes are still the ones that
were written. A bit flip, a half-copied file or a truncated weights file used to restore
silently (and train on NaN) or fail deep inside TensorStore. So the writer records, for each
file of the step, its size and SHA-256 in `digests.json`, inside the step directory before
Orbax renames it into place: a committed step either has its manifest or was written by an
older olmo_eqx. Restoring verifies every listed file first and names the first one that
differs. SHA-256 runs at about 1 GB/s on one core, roughly the speed of reading the files.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

DIGEST_FILE = "digests.json"
_ALGORITHM = "sha256"
_CHUNK = 1 << 22


class DigestMismatch(Exception):
    """One file of a step that is missing, truncated or changed since it was saved."""

    def __init__(self, file: str, reason: str):
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason


def _digest(path: Path) -> str:
    h = hashlib.new(_ALGORITHM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# Written or rewritten by Orbax after the manifest (commit marker, commit timestamp).
_UNSEALED = (DIGEST_FILE, "commit_success.txt", "_CHECKPOINT_METADATA")


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.relative_to(step_dir).as_posix() not in _UNSEALED)


def write_digests(step_dir: str | os.PathLike) -> Path:
    """Record size and digest of every file under `step_dir` in its `digests.json`."""
    step_dir = Path(step_dir)
    files = {
        p.relative_to(step_dir).as_posix(): {"size": p.stat().st_size, _ALGORITHM: _digest(p)}
        for p in _files(step_dir)
    }
    target = step_dir / DIGEST_FILE
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"algorithm": _ALGORITHM, "files": files}, indent=1) + "\n")
    os.replace(tmp, target)
    return target


def has_digests(step_dir: str | os.PathLike) -> bool:
    return (Path(step_dir) / DIGEST_FILE).is_file()


def verify_digests(step_dir: str | os.PathLike) -> Optional[int]:
    """Check every file `digests.json` lists; the number checked, or None without a manifest.

    Raises `DigestMismatch` naming the first file that is missing, has another size or
    another digest (or a manifest that cannot be read).
    """
    step_dir = Path(step_dir)
    manifest_path = step_dir / DIGEST_FILE
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        algorithm = manifest["algorithm"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DigestMismatch(DIGEST_FILE, f"the manifest itself is unreadable ({type(e).__name__}: {e})") from e
    if algorithm != _ALGORITHM:
        raise DigestMismatch(DIGEST_FILE, f"unknown digest algorithm {algorithm!r}")
    for name, expected in files.items():
        path = step_dir / name
        try:
            size = path.stat().st_size
        except OSError as e:
            raise DigestMismatch(name, f"missing ({e.strerror})") from e
        if size != expected["size"]:
            kind = "truncated" if size < expected["size"] else "longer than saved"
            raise DigestMismatch(name, f"{kind}: {size} bytes, saved with {expected['size']}")
        try:
            actual = _digest(path)
        except OSError as e:
            raise DigestMismatch(name, f"unreadable ({e.strerror})") from e
        if actual != expected.get(algorithm):
            raise DigestMismatch(name, f"contents changed since the save ({algorithm} differs, same size)")
    return len(files)
