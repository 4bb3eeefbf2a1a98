"""The local checkpoint tier: frequent, cheap saves of each process's own shards to a disk on
its host (a RAM disk by default), beside the persistent tier (`Checkpointer`, `checkpoint.dir`).

A kill loses the steps since the newest save that *completed*; the persistent tier saves every
`checkpoint.every` steps (1,000 in the 7B recipe), this one every `checkpoint.local_every`.
It is a cache: lost with its host, never the only copy a run relies on for long, and its
retention touches only its own directory.

Each process saves, through Orbax, only what it holds: a host copy of each of its addressable
shards (one per distinct shard index; replicas are saved once), with the data position, the
run config, the model config, the health record and a layout record (process index and count,
device ids, mesh, each leaf's global shape, dtype and the index of each shard saved). No
process waits on another (Orbax's `MultiprocessingOptions(primary_host=None,
active_processes={this process})`: its barriers are skipped for one process). Every step holds
`digests.json` written at the commit (`digests.py`), checked before a restore.

Restore rebuilds each global array from this process's shards on the *current* sharding
(`jax.make_array_from_single_device_arrays`); a step saved on another layout (device count,
mesh, process count) is not usable and is skipped. Which step a run resumes from (this tier's
or the persistent one's, agreed by every process) is `olmo_eqx.train.setup`'s choice.

Orbax's own emergency checkpoint manager (`orbax.checkpoint.experimental.emergency`) does the
same with a restore from a peer replica's copy, but refuses a mesh with fewer than two
data-parallel replicas (every preset's mesh but `hsdp_slices`); this tier works with one.

    <local_dir>/process_<i>/<step>/shards/       this process's shards (numpy arrays, zarr)
    <local_dir>/process_<i>/<step>/layout/       the layout record, JSON
    <local_dir>/process_<i>/<step>/{loader,config,model_config,health}/   as in the persistent tier
    <local_dir>/process_<i>/<step>/digests.json
"""

import getpass
import logging
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from olmo_eqx.checkpoint.digests import DigestMismatch, has_digests, verify_digests, write_digests
from olmo_eqx.checkpoint.format import (
    COMMIT_MARKER, CheckpointCorruptError, Restored, _jsonable, check_model_config, model_config_from_dict,
    model_config_to_dict,
)
from olmo_eqx.checkpoint.storage import CheckpointSaveError, os_reason
from olmo_eqx.train.state import TrainState


def _no_merge_notice(record: logging.LogRecord) -> bool:
    """Orbax's finalize looks for OCDBT databases to merge whatever the format, and warns at
    every local save (written without OCDBT) that it found none."""
    return "Skipping merge of OCDBT checkpoints" not in record.getMessage()

# Where `checkpoint.local_dir=auto` looks for a RAM disk.
RAM_DISK = Path("/dev/shm")
_OFF = ("off", "none", "null", "false", "")
_ITEMS = ("shards", "layout", "loader", "config", "model_config", "health")


def _index(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (a tuple of slices) as (start, stop) per dimension, Nones resolved."""
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape))


def _own_indices(shape: tuple[int, ...], sharding) -> dict:
    """device -> the index of the shard this process holds on it."""
    return {device: _index(index, shape) for device, index in sharding.addressable_devices_indices_map(shape).items()}


def share_bytes(abstract_state: Any) -> int:
    """Bytes of one local save of this process: its distinct shards of `abstract_state`
    (leaves `jax.ShapeDtypeStruct`s carrying shardings)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        if not hasattr(leaf, "sharding") or leaf.sharding is None:
            continue
        for index in set(_own_indices(tuple(leaf.shape), leaf.sharding).values()):
            total += int(np.prod([stop - start for start, stop in index], dtype=np.int64)) * leaf.dtype.itemsize
    return total


def resolve_local_dir(setting: Optional[str], run_dir: Path, need: int, keep: int) -> tuple[Optional[Path], Optional[str]]:
    """(the local tier's root, or None when off; a line saying why it is off, or None).

    setting: `checkpoint.local_dir` (`auto`, off, or an absolute path). auto: a RAM disk
    (`/dev/shm/olmo_eqx-<user>/<a short id of the run dir>`) when one is writable and has room
    for `keep` + 1 saves of `need` bytes (the kept ones and the one being written)."""
    if setting is None or str(setting).strip().lower() in _OFF:
        return None, None
    fix = "set checkpoint.local_dir to a node-local directory with room, or checkpoint.local_every=0"
    room = need * (keep + 1)
    if str(setting) == "auto":
        if not RAM_DISK.is_dir() or not os.access(RAM_DISK, os.W_OK):
            return None, f"no local checkpoint tier: {RAM_DISK} is missing or not writable here; {fix}"
        free = shutil.disk_usage(RAM_DISK).free
        if free < room:
            return None, (f"no local checkpoint tier: {RAM_DISK} has {free / 2**30:.2f} GiB free, the tier needs "
                          f"{room / 2**30:.2f} GiB ({keep} kept + 1 in flight of {need / 2**30:.2f} GiB); {fix}")
        run_id = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
        return RAM_DISK / f"olmo_eqx-{getpass.getuser()}" / run_id, None
    path = Path(setting).expanduser()
    if not path.is_absolute():
        raise CheckpointSaveError(f"checkpoint.local_dir={setting} must be auto, off or an absolute path (a node-local "
                                  "disk, e.g. /dev/shm/olmo_eqx or /local/ckpt)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"\0")
        probe.unlink()
    except OSError as e:
        raise CheckpointSaveError(f"checkpoint.local_dir {path} is not writable: {e.strerror}; {fix}") from e
    if (free := shutil.disk_usage(path).free) < room:
        raise CheckpointSaveError(
            f"checkpoint.local_dir {path} has {free / 2**30:.2f} GiB free, the local tier needs {room / 2**30:.2f} "
            f"GiB ({keep} kept + 1 in flight); {fix}")
    return path, None


class _OwnNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler, writing on every process: Orbax's writes numpy arrays only on
    process 0 (they are replicated values to it), and each process's local step holds its own."""

    async def _background_serialize(self, values, infos, args=None):
        import asyncio

        from orbax.checkpoint._src.serialization import tensorstore_utils

        writes = []
        for value, info, arg in zip(values, infos, args or [ocp.SaveArgs()] * len(values)):
            await info.await_path_creation()
            spec = tensorstore_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                use_ocdbt=False, process_index=None, metadata_key=self._metadata_key,
            )
            writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio.gather(*writes)


def _shards_handler(mp) -> ocp.PyTreeCheckpointHandler:
    registry = ocp.type_handlers.create_type_handler_registry((np.ndarray, _OwnNumpyHandler()))
    # Without OCDBT: its finalize merges per-process databases that only the first process
    # of a run merges (process 1's copy of a step restored nothing, Orbax 0.12.8); one zarr
    # array per shard on a RAM disk costs little.
    return ocp.PyTreeCheckpointHandler(multiprocessing_options=mp, use_ocdbt=False, type_handler_registry=registry)


class LocalTier:
    """This process's local tier under `root/process_<i>`: save, poll for completion, list
    the usable steps, restore, retention (`keep` newest complete steps)."""

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root = Path(root)
        self.keep = keep
        self.directory = self.root / f"process_{jax.process_index()}"
        # Saves that never completed (a kill mid-save), found before Orbax removes their tmp dirs.
        self.incomplete = self._incomplete()
        for step in self.incomplete:  # tmp dirs go with Orbax's cleanup below; a step dir without its manifest here
            shutil.rmtree(self.directory / str(step), ignore_errors=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        me = jax.process_index()
        mp = ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes={me}, barrier_sync_key_prefix=f"olmo_eqx_local_{me}")
        handlers = {
            "shards": _shards_handler(mp),
            **{name: ocp.JsonCheckpointHandler(multiprocessing_options=mp) for name in _ITEMS[1:]},
        }
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # retention is `_prune`'s: it counts only sealed steps
            enable_async_checkpointing=True,
            # Directories made before `save` returns: Orbax's asynchronous creation signals "made"
            # under a key the processes share (its operation id), so process 1 took process 0's
            # signal for its own and wrote into dirs not yet there (Orbax 0.12.8). A few mkdirs
            # on a RAM disk.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal, create_directories_asynchronously=False),
            create=False,  # Orbax refuses create with active_processes; made above
            cleanup_tmp_directories=True,
            multiprocessing_options=mp,
        )
        logging.getLogger("absl").addFilter(_no_merge_notice)  # the same function: added once
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._saving: Optional[tuple[int, float]] = None  # (step, when it began)
        # (step, seconds from its start) of each save completed since the caller last took them.
        self.completed: list[tuple[int, float]] = []
        self.failed: Optional[str] = None  # a save failed: the tier is off for the rest of the session

    def _incomplete(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        steps = set()
        for path in self.directory.iterdir():
            name = path.name
            if ".orbax-checkpoint-tmp" in name and name.split(".")[0].isdigit():
                steps.add(int(name.split(".")[0]))
            elif name.isdigit() and not ((path / COMMIT_MARKER).exists() and has_digests(path)):
                steps.add(int(name))
        return sorted(steps)

    # -- save --------------------------------------------------------------------------------

    def save(self, step: int, state: TrainState, *, loader_state: Any = None, config: Any = None,
             health: Optional[dict] = None) -> None:
        """Start saving this process's shards of `state` as local step `step`; returns once
        they are copied to host memory (the writes go on in Orbax's threads)."""
        if self.failed is not None:
            return
        self.poll(wait=True)
        if (self.directory / str(step)).exists():  # a step of a session that did not resume from it
            self.remove(step)
        arrays, _ = eqx.partition(state, eqx.is_array)
        flat, _ = jax.tree_util.tree_flatten_with_path(arrays)
        shards, leaves = {}, []
        for i, (path, leaf) in enumerate(flat):
            saved: list = []
            for shard in leaf.addressable_shards:
                index = _index(shard.index, leaf.shape)
                if index in saved:
                    continue
                # A copy: the device buffer is donated to the next step.
                shards[f"l{i:05d}_s{len(saved)}"] = np.array(shard.data, copy=True)
                saved.append(index)
            leaves.append({"path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "dtype": str(leaf.dtype),
                           "shards": [list(map(list, index)) for index in saved]})
        layout = {**self.layout_key(flat[0][1].sharding), "leaves": leaves}
        args = ocp.args.Composite(
            shards=ocp.args.PyTreeSave(shards),
            layout=ocp.args.JsonSave(layout),
            loader=ocp.args.JsonSave(_jsonable(loader_state)),
            config=ocp.args.JsonSave(_jsonable(config)),
            model_config=ocp.args.JsonSave(model_config_to_dict(state.model.config)),
            health=ocp.args.JsonSave(health or {}),
        )
        self._saving = (int(step), time.perf_counter())
        try:
            self._manager.save(int(step), args=args, force=True)
        except Exception as e:
            self._fail(e)

    @staticmethod
    def layout_key(sharding) -> dict:
        """What a step must share with the current run to be restored by this process."""
        mesh = getattr(sharding, "mesh", None)
        return {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "devices": sorted(d.id for d in jax.local_devices()),
            "mesh": {str(k): int(v) for k, v in dict(mesh.shape).items()} if mesh is not None else None,
        }

    def _seal(self) -> None:
        """Orbax's hook after the files are written, before the rename: the manifest."""
        if self._saving is None:
            return
        tmp_dirs = sorted(self.directory.glob(f"{self._saving[0]}.orbax-checkpoint-tmp*"), key=lambda p: p.stat().st_mtime)
        if tmp_dirs:
            write_digests(tmp_dirs[-1])

    def _fail(self, error: BaseException) -> None:
        step = self._saving[0] if self._saving else "?"
        self._saving = None
        self.failed = f"local checkpoint step {step} in {self.directory} failed ({os_reason(error)}): the local tier is off for this session"
        for path in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(path, ignore_errors=True)

    def poll(self, wait: bool = False) -> None:
        """Finish the save in flight if its writes are over (committed, manifest written: it
        goes into `completed`); `wait`: block until they are."""
        if self._saving is None:
            return
        try:
            if not wait and self._manager.is_saving_in_progress():
                self._manager.check_for_errors()
                return
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            self._fail(e)
            return
        (step, began), self._saving = self._saving, None
        self.completed.append((step, time.perf_counter() - began))
        self._prune()

    def _prune(self) -> None:
        steps = self.complete_steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            self.remove(step)

    def remove(self, step: int) -> None:
        """Delete local step `step` (renamed first: a kill mid-delete never leaves a step that
        looks complete)."""
        path = self.directory / str(step)
        if path.exists():
            doomed = self.directory / f".deleting-{step}"
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
        self._manager.reload()

    def remove_after(self, step: Optional[int]) -> list[int]:
        """Delete the local steps newer than `step` (None: all); the steps removed."""
        self.poll(wait=True)
        gone = [s for s in self.complete_steps() if step is None or s > step]
        for s in gone:
            self.remove(s)
        return gone

    # -- restore -----------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Committed steps with a manifest, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir()
                      if p.name.isdigit() and (p / COMMIT_MARKER).exists() and has_digests(p))

    def _read_json(self, step: int, item: str) -> Any:
        import json

        return json.loads((self.directory / str(step) / item / "metadata").read_text())

    def usable_steps(self, target: TrainState) -> tuple[list[int], list[str]]:
        """(the complete steps whose layout is the current run's, newest last; one line per
        complete step that is not)."""
        usable, lines = [], []
        _, flat = self._target_leaves(target)
        current = self.layout_key(flat[0][1].sharding)
        for step in self.complete_steps():
            try:
                layout = self._read_json(step, "layout")
            except (OSError, ValueError) as e:
                lines.append(f"local step {step} in {self.directory} has no readable layout record ({e})")
                continue
            if why := self._layout_differs(layout, current, flat):
                lines.append(f"local step {step} in {self.directory} was saved on another layout ({why}): not usable")
                continue
            usable.append(step)
        return usable, lines

    @staticmethod
    def _target_leaves(target: TrainState):
        arrays, static = eqx.partition(target, lambda x: isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x))
        return (arrays, static), jax.tree_util.tree_flatten_with_path(arrays)[0]

    @staticmethod
    def _layout_differs(layout: dict, current: dict, flat: list) -> Optional[str]:
        for key in ("process_count", "process_index", "devices", "mesh"):
            if layout.get(key) != current[key]:
                return f"{key} {layout.get(key)} there, {current[key]} now"
        leaves = layout.get("leaves", [])
        if len(leaves) != len(flat):
            return f"{len(leaves)} arrays there, {len(flat)} now"
        for saved, (path, leaf) in zip(leaves, flat):
            if saved["path"] != jax.tree_util.keystr(path) or saved["shape"] != list(leaf.shape) or saved["dtype"] != str(leaf.dtype):
                return f"array {saved['path']} {saved['dtype']}{saved['shape']} there, {leaf.dtype}{list(leaf.shape)} now"
            have = {tuple(map(tuple, index)) for index in saved["shards"]}
            if not set(_own_indices(tuple(leaf.shape), leaf.sharding).values()) <= have:
                return f"array {saved['path']} is split otherwise"
        return None

    def restore(self, step: int, *, target: TrainState) -> Restored:
        """Local step `step` on `target`'s shardings (an abstract state, as the persistent
        tier's restore takes). Raises `CheckpointCorruptError` when a file differs from its
        manifest or cannot be read."""
        self.poll(wait=True)
        where = self.directory / str(step)
        try:
            if verify_digests(where) is None:
                raise DigestMismatch("digests.json", "missing (the save never completed)")
        except DigestMismatch as e:
            raise CheckpointCorruptError(where, step, e.file, e.reason) from e
        stored = model_config_from_dict(self._read_json(step, "model_config"))
        check_model_config(stored, target.model.config, f"local checkpoint {where}")
        try:
            layout = self._read_json(step, "layout")
            data = self._manager.restore(step, args=ocp.args.Composite(
                shards=ocp.args.PyTreeRestore(), **{name: ocp.args.JsonRestore() for name in _ITEMS[2:]}))
        except Exception as e:
            raise CheckpointCorruptError(where, step, "its items", f"not readable ({type(e).__name__}: {os_reason(e)})") from e
        (arrays, static), flat = self._target_leaves(target)
        treedef = jax.tree_util.tree_structure(arrays)
        built = []
        for i, ((path, leaf), saved) in enumerate(zip(flat, layout["leaves"])):
            by_index = {tuple(map(tuple, index)): k for k, index in enumerate(saved["shards"])}
            pieces = [jax.device_put(np.asarray(data["shards"][f"l{i:05d}_s{by_index[index]}"]), device)
                      for device, index in _own_indices(tuple(leaf.shape), leaf.sharding).items()]
            built.append(jax.make_array_from_single_device_arrays(tuple(leaf.shape), leaf.sharding, pieces))
        state = eqx.combine(jax.tree_util.tree_unflatten(treedef, built), static)
        return Restored(step=step, state=state, loader_state=data["loader"] or None, config=data["config"] or None,
                        model_config=stored, health=data["health"])

    def close(self) -> None:
        try:
            self.poll(wait=True)
        finally:
            self._manager.close()
