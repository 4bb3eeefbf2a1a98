"""The one checkpoint format every stage reads and writes (Orbax).

One step directory per checkpoint, written atomically (Orbax writes `<step>.orbax-checkpoint-
tmp-*` and renames it on commit, so a run killed mid-save leaves only an ignored tmp dir):

    <dir>/<step>/model/         the model's arrays (sharded, restorable on any mesh)
    <dir>/<step>/train/         optimiser state, step, skip-step statistics
    <dir>/<step>/loader/        the data position (`LoaderState.to_dict()`), JSON
    <dir>/<step>/config/        the run's resolved config, JSON
    <dir>/<step>/model_config/  the `ModelConfig`, JSON (checked on every restore)
    <dir>/<step>/health/        what the run knew of its health when it saved, JSON
                                (`{"last_good": step}`, `train/divergence.py`)

Restoring onto another mesh or device count (8 -> 4 -> 1) goes through an abstract target
whose leaves carry the *new* shardings: `sharded_abstract_train_state(...)`.

Every step also holds `digests.json` (size and SHA-256 of each file, written before the
commit; `digests.py`); restores verify it and raise `CheckpointCorruptError`
(step, file, reason) when a file differs. Retention is ours, not Orbax's: it counts only
steps with a manifest, so a newer damaged or unverifiable step never pushes out the last good
one, and it never removes the `protected` step (the last one known good while a run is in
trouble; `retention.py`). A step directory in the way of a save (no commit marker, or failed
verification) is moved into `<dir>/set_aside/`, never deleted.

On an object store (`s3://`, `gs://`), which has no rename, Orbax saves into a local staging
dir with all of the above, and the committed step is uploaded with a `committed.json` (its
digests) written last; set-aside is a `set_aside.json` marker (`remote.py`). With several
processes each stages and uploads its own shards (saved without OCDBT, whose merge needs every
process's files on one disk), and process 0 commits once all have landed.

The package, bottom to top (each module imports only those above it in this list, and the
`Checkpointer` is the one class a caller needs):

    retention.py     which steps retention deletes (a pure decision, process 0's)
    digests.py       the manifest: who hashes which file, verification
    pins.py          readers of a live run keep their step from retention
    remote.py        checkpoints on object stores: upload, commit object, markers
    storage.py       the pre-flight storage check, a failed write's OS cause
    format.py        what a step holds: items, fields a restore may change, errors, `Restored`
    local_steps.py   a Checkpointer's local upkeep: manifest at commit, set-aside, retention
    local_tier.py    the local tier: each process's own shards, saved often to a node-local disk
    object_store.py  a Checkpointer's object-store upkeep: upload, verified download, retention
    checkpointer.py  the `Checkpointer`: save, restore, verify (Orbax's CheckpointManager)
    paths.py         what a user's path names (run dir, checkpoints dir, step, HF dir)

Beside this persistent tier, `local_tier.LocalTier` keeps frequent per-process saves on a
node-local disk (`checkpoint.local_every`); a run resumes from the newest step of either
(`olmo_eqx.train.setup`; docs/checkpointing.md).

What several processes agree on (listings, verdicts, failures) is `olmo_eqx.run.processes`.
"""

from olmo_eqx.checkpoint.format import (
    COMMIT_MARKER, CONTINUABLE_FIELDS, RUNTIME_FIELDS, SET_ASIDE_DIR, CheckpointCorruptError, CheckpointMismatchError,
    Restored, check_model_config, model_config_from_dict, model_config_to_dict,
)
from olmo_eqx.checkpoint.storage import CheckpointSaveError
from olmo_eqx.checkpoint.checkpointer import Checkpointer

__all__ = [
    "COMMIT_MARKER", "CONTINUABLE_FIELDS", "RUNTIME_FIELDS", "SET_ASIDE_DIR", "CheckpointCorruptError",
    "CheckpointMismatchError", "CheckpointSaveError", "Checkpointer", "Restored", "check_model_config",
    "model_config_from_dict", "model_config_to_dict",
]
