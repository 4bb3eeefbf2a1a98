"""The local checkpoint tier in a training run (`olmo_eqx.checkpoint.local_tier`): whether and
where it is, which of its steps every process can resume from, its saves in the loop, and the
"checkpoint step N is safe" lines of both tiers (docs/checkpointing.md)."""

from pathlib import Path
from collections.abc import Callable
from typing import Optional

import jax
from jax.sharding import Mesh

from olmo_eqx.checkpoint import CheckpointCorruptError, Checkpointer
from olmo_eqx.checkpoint.local_tier import LocalTier, resolve_local_dir, share_bytes
from olmo_eqx.config import Config
from olmo_eqx.run.processes import gather
from olmo_eqx.sharding import ShardingRules
from olmo_eqx.train.state import TrainState, sharded_abstract_train_state


def open_local_tier(config: Config, run_dir: Path, mesh: Mesh, rules: ShardingRules,
                    notes: list[str]) -> Optional[LocalTier]:
    """This process's local tier (`checkpoint.local_every` > 0), or None; `notes` gets the
    line saying why there is none when `local_dir=auto` finds no RAM disk with room."""
    c = config.checkpoint
    if not c.local_every:
        return None
    need = share_bytes(sharded_abstract_train_state(config.model, config.optim, mesh, rules))
    root, why = resolve_local_dir(c.local_dir, run_dir, need, c.local_keep)
    if why is not None:
        notes.append(why)
    return LocalTier(root, keep=c.local_keep) if root is not None else None


def never_completed(checkpointer: Checkpointer, local: Optional[LocalTier], start_step: int) -> list[str]:
    """One line per save that a previous session began and never completed (its Orbax tmp dir,
    or a local step without its manifest, left by a kill mid-save), naming where the run
    resumes instead; the leftovers are removed (Orbax's tmp-dir cleanup, the tier's own)."""
    resuming = f"resuming from step {start_step}" if start_step else "starting from step 0"
    lines = [f"checkpoint step {step} in {checkpointer.directory} never completed (a save cut off mid-write; its "
             f"leftovers are removed): {resuming}" for step in checkpointer.incomplete if step > start_step]
    if local is not None:
        lines += [f"local checkpoint step {step} in {local.directory} never completed (no commit or manifest; "
                  f"removed): {resuming}" for step in local.incomplete if step > start_step]
    return lines


def local_steps_held(local: Optional[LocalTier], target: Optional[TrainState], notes: list[str],
                     persistent: Optional[int]) -> list[int]:
    """The local steps every process holds and can restore, newest first (a collective: every
    process calls it, with or without a tier); a line per process that lacks a step another
    has, and per step of this process saved on another layout."""
    mine, lines = local.usable_steps(target) if local is not None else ([], [])
    notes.extend(lines)
    held = gather("local_steps", {"steps": mine, "dir": str(local.directory) if local is not None else None})
    if not any(h["steps"] for h in held):
        return []
    common = sorted(set.intersection(*(set(h["steps"]) for h in held)), reverse=True)
    every = sorted(set().union(*(set(h["steps"]) for h in held)), reverse=True)
    if every[0] not in common:
        newest = max([*common[:1], *([persistent] if persistent is not None else [])], default=None)
        tier = "the local tier" if common and newest == common[0] else "the persistent tier"
        then = (f"every process resumes from step {newest} ({tier}), the newest that every process can restore"
                if newest is not None else "no step is common to every process: the run starts from step 0")
        for index, h in enumerate(held):
            if every[0] not in h["steps"]:
                where = h["dir"] or "no local tier"
                notes.append(f"process {index}'s local tier ({where}) has no step {every[0]} (it holds {h['steps']}: "
                             f"host replaced, or its RAM disk cleared?): {then}")
    return common


def restore_local(local: LocalTier, step: int, target: TrainState):
    """Local step `step` on every process, or `CheckpointCorruptError` on every process when any
    process's copy fails (each removes its copy: the step is no longer common)."""
    try:
        restored, failure = local.restore(step, target=target), None
    except CheckpointCorruptError as e:
        restored, failure = None, [str(e.path), e.file, e.reason, jax.process_index()]
    failures = [f for f in gather(f"local_restore_{step}", failure) if f is not None]
    if failures:
        local.remove(step)
        path, file, reason, index = failures[0]
        raise CheckpointCorruptError(path, step, file, f"{reason} (process {index}'s copy)")
    return restored


class SaveWatch:
    """The loop's side of the tiers: when a local save is due, and when a save of either tier
    has completed (a line and a `metrics.jsonl` record: `{"step", "checkpoint_safe", "tier",
    "save_s"}`). With several processes it polls only at agreed steps (a collective), and a
    local step is safe once every process's copy is."""

    def __init__(self, checkpointer: Checkpointer, local: Optional[LocalTier], every: int):
        self.checkpointer, self.local = checkpointer, local
        # Due on every process alike when any has a tier (`auto` may find no RAM disk on some
        # hosts): the state's finiteness check before a save is a collective.
        self.every = every if every and any(gather("local_tier", local is not None)) else 0
        self.pending: dict[int, dict[int, float]] = {}  # local step -> {process: seconds}, until all have it
        self.failure_said = False

    def local_due(self, step: int, end_step: int) -> bool:
        """At multiples of checkpoint.local_every, but not the run's last step (the persistent tier saves it)."""
        return bool(self.every) and step % self.every == 0 and step != end_step

    def drop_local_after(self, step: Optional[int]) -> None:
        if self.local is not None:
            self.local.remove_after(step)

    def poll(self, step: int, agreed: bool, write: Callable[[dict], None], say: Callable[[str], None],
             wait: bool = False) -> None:
        """Say which saves have completed since the last poll; `wait`: for the local tier's in
        flight first (the run's end)."""
        if jax.process_count() > 1:
            if not agreed:
                return
            self.checkpointer.finish_if_done()
        done = [(s, took, "persistent") for s, took in self.checkpointer.completed]
        self.checkpointer.completed.clear()
        mine = []
        if self.local is not None:
            self.local.poll(wait=wait)
            mine, self.local.completed = self.local.completed, []
            if self.local.failed is not None and not self.failure_said:
                say(self.local.failed)  # the tier saves no more; the persistent one goes on
                self.failure_said = True
        if jax.process_count() > 1:
            for index, finished in enumerate(gather("local_safe", mine)):
                for s, took in finished:
                    self.pending.setdefault(s, {})[index] = took
            for s in sorted(self.pending):
                if len(self.pending[s]) == jax.process_count():
                    done.append((s, max(self.pending.pop(s).values()), "local"))
        else:
            done += [(s, took, "local") for s, took in mine]
        for s, took, tier in done:
            where = self.checkpointer.directory if tier == "persistent" else self.local.root
            # The record first: once the line is seen (a drill's kill), the record is there too.
            write({"step": step, "checkpoint_safe": s, "tier": tier, "save_s": took})
            say(f"checkpoint step {s} is safe: {tier} tier {where}, {took:.1f} s after it began")
