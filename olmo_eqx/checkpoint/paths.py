"""Find the checkpoint a user points at: a run directory, a checkpoints directory, a step
directory of ours, or a HF model directory.

Later stages take one path (`checkpoint.load=...`, the soup's list) and should not make the
user remember which level of the tree to name:

    outputs/2026-01-01/12-00-00                    a run dir: its checkpoints/ (or the
                                                   checkpoint.dir its config.json names)
    outputs/2026-01-01/12-00-00/checkpoints        a checkpoints dir: its latest complete step
    outputs/2026-01-01/12-00-00/checkpoints/200    one step
    /models/Olmo-3-7B                              a HF checkpoint (config.json + *.safetensors)

Anything else stops with a message saying what was found and what is expected.

A checkpoint dir set apart from its run dir (`checkpoint.dir`) belongs to the first run dir
that trains into it (`OWNER_FILE`, `claim_checkpoint_dir`): two run dirs sharing one would
resume from each other's steps and delete each other's checkpoints.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from olmo_eqx.checkpoint.format import COMMIT_MARKER


OWNER_FILE = "owner.json"


class CheckpointDirOwnedError(RuntimeError):
    """checkpoint.dir already belongs to another run dir."""


def claim_checkpoint_dir(directory: Path | str, run_dir: Path) -> Optional[str]:
    """Record `run_dir` as the owner of the checkpoint dir `directory` (process 0, before
    training). Raises `CheckpointDirOwnedError` naming the owner when another run dir that
    still exists holds it; returns a note when it takes over from one that no longer exists.
    An `s3://` or `gs://` prefix is claimed the same way (`claim_checkpoint_url`)."""
    if isinstance(directory, str) and "://" in directory:
        from olmo_eqx.checkpoint.remote import claim_checkpoint_url

        return claim_checkpoint_url(directory, Path(run_dir).resolve())
    directory, run_dir = Path(directory), Path(run_dir).resolve()
    owner_file = directory / OWNER_FILE
    note = None
    try:
        owner = Path(json.loads(owner_file.read_text())["run_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        owner = None
    if owner is not None and owner != run_dir:
        if owner.is_dir():
            raise CheckpointDirOwnedError(
                f"checkpoint.dir={directory} belongs to the run dir {owner}: two run dirs on one checkpoint "
                f"dir would resume from and delete each other's steps. Continue that run in {owner}, or give "
                f"this run another checkpoint.dir (delete {owner_file} only if {owner} is yours and done)"
            )
        note = f"checkpoint dir {directory}: its run dir {owner} no longer exists; {run_dir} takes it over"
    if owner != run_dir:
        tmp = owner_file.with_name(OWNER_FILE + ".tmp")
        tmp.write_text(json.dumps({"run_dir": str(run_dir)}) + "\n")
        os.replace(tmp, owner_file)
    return note


class CheckpointNotFoundError(FileNotFoundError):
    """A path that names no usable checkpoint; the message says what would."""


@dataclass(frozen=True)
class CheckpointLocation:
    """Where a checkpoint lives. kind "olmo_eqx": `directory` is a checkpoints dir (the one
    `Checkpointer` opens) and `step` its step; kind "hf": `directory` is the HF model dir."""

    kind: Literal["olmo_eqx", "hf"]
    directory: Path | str  # a str: a checkpoints dir on an object store (s3://, gs://)
    step: Optional[int] = None

    @property
    def remote(self) -> bool:
        return isinstance(self.directory, str)

    def __str__(self) -> str:
        if self.kind == "hf":
            return str(self.directory)
        return f"{self.directory}/{self.step}" if self.remote else str(self.directory / str(self.step))

    @property
    def label(self) -> str:
        """A short name for tables and logs: `<run dir name>@<step>` for ours, `hf:<dir>` for HF."""
        if self.kind == "hf":
            return f"hf:{self.directory}"
        if self.remote:
            return f"{self.directory.rsplit('/', 1)[-1]}@{self.step}"
        return f"{self.directory.parent.name or self.directory}@{self.step}"


def _complete_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / COMMIT_MARKER).exists()
    )


def _is_hf_dir(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def _resolve_remote(url: str) -> CheckpointLocation:
    """The committed step a `s3://` / `gs://` URL names: `<checkpoints url>/<step>`, or the
    newest committed step of `<checkpoints url>` (`remote.py`)."""
    from olmo_eqx.checkpoint.remote import COMMITTED, RemoteSteps

    url = url.rstrip("/")
    head, _, tail = url.rpartition("/")
    if tail.isdigit() and "/" in head.split("://", 1)[1]:
        steps = RemoteSteps(head).committed_steps()
        if int(tail) in steps:
            return CheckpointLocation("olmo_eqx", head, int(tail))
        if steps:
            raise CheckpointNotFoundError(f"{url}: no committed checkpoint of step {tail} there; committed steps: {steps}")
    steps = RemoteSteps(url).committed_steps()
    if not steps:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {url} (a step counts once its {COMMITTED} exists, and not when it is "
            "set aside); give the checkpoint.dir of a run, or <that>/<step>"
        )
    return CheckpointLocation("olmo_eqx", url, steps[-1])


def _configured_checkpoint_dir(run_dir: Path) -> Optional[Path | str]:
    """The `checkpoint.dir` a run's config.json names (None when it used <run dir>/checkpoints)."""
    try:
        config = json.loads((run_dir / "config.json").read_text())
        directory = config["checkpoint"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if directory and directory.startswith(("s3://", "gs://")):
        return directory
    return Path(directory) if directory and "://" not in directory else None


def resolve_checkpoint(path: str | os.PathLike, *, allow_hf: bool = True) -> CheckpointLocation:
    """The checkpoint `path` names (see the module docstring); the latest complete step when
    it names a directory of several. Raises `CheckpointNotFoundError` with the fix otherwise."""
    text = os.fspath(path)
    if text.startswith(("s3://", "gs://")):
        return _resolve_remote(text)
    if "://" in text:
        raise CheckpointNotFoundError(f"{text}: the checkpoint URLs read are s3:// and gs://; here give one or a local path")
    given = Path(text).expanduser().resolve()
    if not given.exists():
        raise CheckpointNotFoundError(f"checkpoint path {given} does not exist")
    if not given.is_dir():
        raise CheckpointNotFoundError(f"checkpoint path {given} is a file; give a run dir, its checkpoints dir or a step dir")
    # A step directory: <checkpoints>/<step>/ holding Orbax's commit marker.
    if given.name.isdigit() and (given / "model").is_dir():
        if not (given / COMMIT_MARKER).exists():
            raise CheckpointNotFoundError(
                f"{given} is an incomplete checkpoint (no {COMMIT_MARKER}: its save never finished); "
                f"complete steps beside it: {_complete_steps(given.parent) or 'none'}"
            )
        return CheckpointLocation("olmo_eqx", given.parent, int(given.name))
    candidates = [given, given / "checkpoints"]
    configured = _configured_checkpoint_dir(given)
    if isinstance(configured, str):  # a run that checkpointed to an object store
        return _resolve_remote(configured)
    if configured is not None:
        candidates.append(configured)
    for directory in candidates:
        steps = _complete_steps(directory)
        if steps:
            return CheckpointLocation("olmo_eqx", directory, steps[-1])
    if allow_hf and _is_hf_dir(given):
        return CheckpointLocation("hf", given)
    looked = ", ".join(str(c) for c in candidates)
    hf = " or a HF model dir (config.json + *.safetensors)" if allow_hf else ""
    raise CheckpointNotFoundError(
        f"no complete checkpoint at {given} (looked in {looked}); give a run dir, its checkpoints dir "
        f"or one step dir (<run dir>/checkpoints/<step>){hf}"
    )
