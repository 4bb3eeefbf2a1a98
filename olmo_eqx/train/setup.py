"""The wiring of a training run, before its first step (`loop.train` calls these in order):
where its checkpoints go, the run dir's lock, the resume (or a fresh start) with every refusal
before anything is written, and the steps an object store never received."""

import json
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import jax
from jax.sharding import Mesh

from olmo_eqx.checkpoint import CheckpointCorruptError, CheckpointMismatchError, Checkpointer
from olmo_eqx.checkpoint.local_tier import LocalTier
from olmo_eqx.config import Config, resume_changes
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import DataLoader
from olmo_eqx.data.sampler import LoaderState
from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.errors import TrainError
from olmo_eqx.run import goodput
from olmo_eqx.run.lock import RunLock, RunLockedError
from olmo_eqx.run.run_dir import CONFIG_FILE
from olmo_eqx.sharding import ShardingRules
from olmo_eqx.train.divergence import SaveHealth
from olmo_eqx.train.state import TrainState, sharded_abstract_train_state
from olmo_eqx.train.tiers import local_steps_held, restore_local

# Builds a fresh state when there is no checkpoint to resume: (config, mesh, rules) -> TrainState.
InitState = Callable[[Config, Mesh, ShardingRules], TrainState]


def _checkpoint_dir(config: Config, run_dir: Path) -> str:
    """The run's checkpoint dir, absolute. A relative `checkpoint.dir` resolves against the
    current directory once and is recorded absolute in config.json; rerun from elsewhere it
    would name another directory and silently start over, so that is refused."""
    directory = config.checkpoint.dir
    if directory is None:
        return str(run_dir / "checkpoints")
    if "://" in directory:
        return directory
    resolved = str(Path(directory).expanduser().resolve())
    if not Path(directory).expanduser().is_absolute():
        try:
            recorded = json.loads((run_dir / CONFIG_FILE).read_text())["checkpoint"]["dir"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = None
        if recorded and recorded != resolved:
            raise TrainError(
                f"checkpoint.dir={directory} is relative: from {Path.cwd()} it names {resolved}, but this run dir's "
                f"checkpoints are in {recorded}. Give checkpoint.dir={recorded} (absolute) to continue the run"
            )
    return resolved


def _restore_or_init(
    config: Config, checkpointer: Checkpointer, dataset: InstanceDataset, mesh: Mesh, rules: ShardingRules,
    init_state: InitState, notes: list[str], local: Optional[LocalTier] = None,
) -> tuple[TrainState, DataLoader, int, SaveHealth, Optional[dict]]:
    """(state, loader, step, health, the run config saved with the checkpoint resumed or None):
    from the newest checkpoint that verifies in either tier (the persistent one, or the local
    one when every process holds that step), else fresh.

    Raises `TrainError` for every refusal (other model, data, seed, batch, sequence length)
    before the caller writes anything into the run dir. A checkpoint that fails verification
    is set aside (a local one removed: it is a cache) and the one before it used; `notes` gets
    one line per such step, and one saying which tier the run resumes from and why.
    """
    steps = checkpointer.all_steps()
    if steps and not config.checkpoint.resume:
        raise TrainError(
            f"{checkpointer.directory} already holds checkpoints (latest step {steps[-1]}) and "
            "checkpoint.resume=false: set it to true to continue that run, or choose another checkpoint.dir / run dir"
        )
    target = sharded_abstract_train_state(config.model, config.optim, mesh, rules) if steps or local else None
    local_steps = local_steps_held(local, target, notes, steps[-1] if steps else None) if config.checkpoint.resume else []
    if local is not None and not config.checkpoint.resume:
        local.remove_after(None)  # a fresh start: the previous run's local steps are not this run's
    state, loader_state, start_step, health, stored_config = None, None, 0, SaveHealth(), None
    candidates = sorted([(s, "persistent") for s in steps] + [(s, "local") for s in local_steps], reverse=True)
    if candidates:
        unusable = []
        for step, tier in candidates:
            try:
                with goodput.bucket("restore"):
                    if tier == "local":
                        restored = restore_local(local, step, target)
                    else:
                        restored = checkpointer.restore(step, target=target)
            except CheckpointMismatchError as e:
                raise TrainError(f"cannot resume: {e}") from e
            except CheckpointCorruptError as e:
                if tier == "local":
                    unusable.append(f"{e}; removed from every process's local tier (a cache)")
                else:
                    unusable.append(f"{e}; set aside: {checkpointer.set_aside(step, e.reason)}")
                continue
            state, loader_state, start_step = restored.state, LoaderState.from_dict(restored.loader_state), step
            stored_config = restored.config
            health = SaveHealth.resumed(step, restored.health)
            break
        fallback = f"falling back to step {start_step}" if state is not None else "no usable checkpoint is left"
        notes.extend(f"{line}; {fallback}" for line in unusable)
        if state is None:
            raise TrainError(
                f"{'; '.join(unusable)}. No checkpoint in {checkpointer.directory} verifies; rerunning will "
                "start from step 0 (the damaged steps are kept under set_aside/)"
            )
        persistent = [s for s in checkpointer.all_steps() if s <= start_step] if unusable else steps
        newest = f"step {persistent[-1]}" if persistent else "none"
        if tier == "local":
            notes.append(f"Resuming from the local tier {local.root} (step {start_step}; the persistent tier's newest "
                         f"is {newest}: {checkpointer.directory})")
        else:
            why = (f"; the local tier's newest step every process holds is {local_steps[0]}" if local_steps
                   else "; the local tier holds no newer step every process has" if local is not None else "")
            notes.append(f"Resuming from {checkpointer.directory / str(start_step)} (step {start_step}{why})")
    if local is not None:
        # Steps past the one resumed (not held by every process, or on another layout) would be
        # trained again and saved anew; never mixed with this session's.
        local.remove_after(start_step)
    try:
        loader = DataLoader(
            dataset,
            config.data.global_batch_size,
            config.data.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            state=loader_state,
        )
    except DataFileError as e:  # e.g. another dataset, seed or batch size than the checkpoint's
        raise TrainError(str(e)) from e
    if loader.step != start_step:
        raise TrainError(f"checkpoint step {start_step} and its data position (step {loader.step}) disagree")
    if stored_config is not None and (changed := resume_changes(stored_config, config)):
        checkpoint = str(checkpointer.directory / str(start_step))
        notes.append(_resume_changes_note(changed, config.checkpoint.accept_changes, checkpoint))
    if state is None:
        state = init_state(config, mesh, rules)
    return state, loader, start_step, health, stored_config


def previous_session(stored_config: Optional[dict]) -> Optional[dict]:
    """What the session that saved a checkpoint recorded of itself (`MicroBatchChoice.record`:
    devices, micro-batches), from the run config saved with it; an older olmo_eqx recorded only
    its `trainer.micro_batches`. None for a fresh start."""
    if not stored_config:
        return None
    if isinstance(stored_config.get("session"), dict):
        return stored_config["session"]
    micro = (stored_config.get("trainer") or {}).get("micro_batches")
    return {"micro_batches": micro} if isinstance(micro, int) else None


def _resume_changes_note(changed: dict, accepted: tuple[str, ...], checkpoint: str) -> str:
    """The line a resume with changed settings prints; raises `TrainError` (before anything in
    the run dir changes) unless checkpoint.accept_changes names every changed key."""
    said = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
    refused = [key for key in changed if key not in accepted]
    if refused:
        raise TrainError(
            f"cannot resume from {checkpoint} with changed settings: {said}. Give the checkpoint's values to "
            f"continue that run, or add checkpoint.accept_changes=[{','.join(changed)}] to resume with the new ones"
        )
    return f"Resuming with changed settings (checkpoint.accept_changes): {said}"


@contextmanager
def _one_writer(run_dir: Path, main_process: bool):
    """Hold the run dir's lock (process 0 only) for the duration."""
    if not main_process:
        yield
        return
    try:
        lock = RunLock(run_dir).acquire()
    except RunLockedError as e:
        raise TrainError(str(e)) from e
    try:
        yield
    finally:
        lock.release()


def _never_uploaded(checkpointer: Checkpointer, start_step: int) -> list[str]:
    """One line per step newer than `start_step` that a run committed in its staging dir and
    never uploaded to the object store (`olmo_eqx.checkpoint.remote.StagedRecord`; a host lost, or a
    rerun with another staging dir): the store cannot have it, so this rerun starts older."""
    record = checkpointer.staged_record
    if record is None:
        return []
    resuming = f"resuming from step {start_step}" if start_step else "starting from step 0"
    lines = []
    for step, where in sorted(record.entries().items()):
        if step <= start_step:
            continue
        path, host = Path(where.get("path", "?")), where.get("host", "?")
        url = f"{checkpointer.directory}/{step}"
        if host == socket.gethostname() and path.parent == checkpointer.staging_dir:
            # This staging dir: the Checkpointer would have uploaded it had it been complete.
            lines.append(f"checkpoint step {step}, staged at {path}, never reached {url} and cannot be uploaded (it "
                         f"is gone, lacks its commit marker or fails its digests): {resuming}")
        elif (processes := int(where.get("processes", 1))) > 1:
            # Every process staged its own part: the same processes, each with its staging dir.
            lines.append(f"checkpoint step {step} was saved by {processes} processes in their staging dirs (process "
                         f"0's: {path} on host {host}) but never uploaded to {url} (the run stopped, or an upload "
                         f"failed): {resuming}. To resume from step {step} instead, stop this run and rerun its "
                         f"{processes} processes on the same hosts, each with its OLMO_EQX_CHECKPOINT_STAGING (process "
                         f"0's: {path.parent.parent}), which uploads it first")
        else:
            lines.append(f"checkpoint step {step} was saved in the staging dir {path} on host {host} but never "
                         f"uploaded to {url} (the run stopped, or its upload failed): {resuming}. To resume from "
                         f"step {step} instead, stop this run and rerun on {host} with "
                         f"OLMO_EQX_CHECKPOINT_STAGING={path.parent.parent}, which uploads it first")
    return lines
