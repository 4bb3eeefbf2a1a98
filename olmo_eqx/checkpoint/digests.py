"""A digest of every file of a checkpoint step, written into the step before it commits.

Orbax's commit marker says a save *finished*; it cannot say the bytes are still the ones that
were written. A bit flip, a half-copied file or a truncated weights file used to restore
silently (and train on NaN) or fail deep inside TensorStore. So the writer records, for each
file of the step, its size and SHA-256 in `digests.json`, inside the step directory before
Orbax renames it into place: a committed step either has its manifest or was written by an
older olmo_eqx. Restoring verifies every listed file first and names the first one that
differs. SHA-256 runs at about 1 GB/s on one core, roughly the speed of reading the files, so
files are hashed `HASH_THREADS` at a time (hashlib releases the GIL), and on restore each of
P processes verifies a P-th of the bytes (`part`), so every file is read once, not P times.
"""

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

DIGEST_FILE = "digests.json"
_ALGORITHM = "sha256"
_CHUNK = 1 << 22
# Files hashed at once: a checkpoint has one or more files per array and per process.
HASH_THREADS = min(16, os.cpu_count() or 1)


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


_PROCESS_DIR = re.compile(r"(?:^|/)ocdbt\.process_(\d+)/")


def writer_of(name: str) -> int:
    """The process that wrote the step file `name`: TensorStore's OCDBT puts each process's
    array data under `ocdbt.process_<i>/`; everything else (metadata, JSON items) is process 0's."""
    found = _PROCESS_DIR.search(name)
    return int(found.group(1)) if found else 0


def digest_paths(files: dict[str, Path]) -> dict[str, dict]:
    """Size and digest of each file (`{name in the step: its path}`), `HASH_THREADS` at a time."""
    names = sorted(files)
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(lambda name: _digest(files[name]), names))
    return {name: {"size": files[name].stat().st_size, _ALGORITHM: digest} for name, digest in zip(names, digests)}


def digest_files(step_dir: str | os.PathLike, process: Optional[int] = None) -> dict[str, dict]:
    """Size and digest of the files under `step_dir` (only those `process` wrote, when given),
    `HASH_THREADS` at a time."""
    step_dir = Path(step_dir)
    return digest_paths({
        p.relative_to(step_dir).as_posix(): p for p in _files(step_dir)
        if process is None or writer_of(p.relative_to(step_dir).as_posix()) == process
    })


_TMP_SUFFIX = re.compile(r"\.orbax-checkpoint-tmp[^/]*$")


def part_files(tmp_dir: str | os.PathLike) -> dict[str, Path]:
    """The files another process than the first wrote for one step into its own (never
    renamed) copy of Orbax's tmp dir, by the name each has in the committed step: Orbax names
    the item dirs `<item>.orbax-checkpoint-tmp...` until the first process's commit renames them."""
    tmp_dir = Path(tmp_dir)
    return {
        "/".join(_TMP_SUFFIX.sub("", part) for part in p.relative_to(tmp_dir).parts): p
        for p in _files(tmp_dir)
    }


def write_digests(step_dir: str | os.PathLike, files: Optional[dict[str, dict]] = None) -> Path:
    """Record size and digest of every file under `step_dir` in its `digests.json` (`files`:
    the entries, when the processes that wrote them hashed them already)."""
    step_dir = Path(step_dir)
    files = digest_files(step_dir) if files is None else files
    target = step_dir / DIGEST_FILE
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"algorithm": _ALGORITHM, "files": files}, indent=1) + "\n")
    os.replace(tmp, target)
    return target


def has_digests(step_dir: str | os.PathLike) -> bool:
    return (Path(step_dir) / DIGEST_FILE).is_file()


def _share(sizes: dict[str, int], count: int) -> list[list[str]]:
    """The files split into `count` shares of about equal bytes (largest first, each to the
    lightest share so far); the same on every process, as the manifest is."""
    shares: list[list[str]] = [[] for _ in range(count)]
    load = [0] * count
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = min(range(count), key=lambda i: (load[i], i))
        shares[lightest].append(name)
        load[lightest] += sizes[name]
    return shares


def verify_digests(
    step_dir: str | os.PathLike, part: tuple[int, int] = (0, 1), present_only: bool = False
) -> Optional[int]:
    """Check the files `digests.json` lists; the number checked, or None without a manifest.

    part: (index, count): check only share `index` of `count` shares of about equal bytes,
    so `count` processes share the work, each file checked by exactly one of them.
    present_only: check only the listed files that `step_dir` holds (one process's part of a
    step whose other files are on other hosts; the caller checks that the parts cover it).
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
    index, count = part
    mine = _share({name: int(entry["size"]) for name, entry in files.items()}, count)[index]
    if present_only:
        mine = [name for name in mine if (step_dir / name).is_file()]
    for name in mine:  # sizes first: cheap, and a truncated file is named as such
        try:
            size = (step_dir / name).stat().st_size
        except OSError as e:
            raise DigestMismatch(name, f"missing ({e.strerror})") from e
        if size != files[name]["size"]:
            kind = "truncated" if size < files[name]["size"] else "longer than saved"
            raise DigestMismatch(name, f"{kind}: {size} bytes, saved with {files[name]['size']}")

    def check(name: str) -> Optional[DigestMismatch]:
        try:
            actual = _digest(step_dir / name)
        except OSError as e:
            return DigestMismatch(name, f"unreadable ({e.strerror})")
        if actual != files[name].get(algorithm):
            return DigestMismatch(name, f"contents changed since the save ({algorithm} differs, same size)")
        return None

    with ThreadPoolExecutor(HASH_THREADS) as pool:
        for mismatch in pool.map(check, mine):
            if mismatch is not None:
                raise mismatch
    return len(mine)
