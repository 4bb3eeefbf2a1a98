"""Starting from earlier weights: the one way to locate and restore a model trained before,
from one of our checkpoints or a HF model directory, onto any mesh.

    locate(path)                      run dir, checkpoints dir, step dir of ours, or HF dir
                                      -> a CheckpointLocation (its `label` names it in tables)
    stored_model_config(location)     its architecture (ours: the checkpoint's; HF: config.json)
    stored_run_config(location)       the run config saved with it (ours; None for HF)
    load_model(location, mesh)        its weights only, restored straight into their shards
    source(stage, config, optimizer)  a first train state from it, with or without its Adam state
    resume_config(config, run_dir)    a later stage resuming its own run (that wins over checkpoint.load)

Weights only: eval, compare, generate and the lm-eval harness (`olmo_eqx.evaluation.run`), the
soup. A train state: anneal and long context, whose `init_state` the loop calls only when the
run has no checkpoint of its own. Which model fields may differ between a checkpoint and the
config that continues it is `olmo_eqx.checkpoint.CONTINUABLE_FIELDS`.

Checkpoints, Orbax and the model are imported inside the functions: the stage plugins import
this module as soon as the stages are listed.
"""

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from olmo_eqx.config import Config

# keep: continue the checkpoint's Adam moments; reset: a fresh optimiser; auto: keep when
# the checkpoint has them (ours), reset for HF weights (which have none).
Optimizer = Literal["auto", "keep", "reset"]


def _print(text: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# Where a model is, and what it is


def locate(path, key: str = "checkpoint.load", *, allow_hf: bool = True, error: Optional[type] = None):
    """The checkpoint `path` names (`olmo_eqx.checkpoint.paths.resolve_checkpoint`: the latest
    complete step of a run dir or checkpoints dir, one step dir, or a HF dir unless allow_hf is
    False). Otherwise raises `error` (default `StageError`) as "<key>: <what is wrong and what
    would do>", `key` being the setting the path came from."""
    from olmo_eqx.checkpoint import COMMIT_MARKER
    from olmo_eqx.checkpoint.paths import CheckpointNotFoundError, resolve_checkpoint
    from olmo_eqx.checkpoint.pins import pin, pin_location

    try:
        location = resolve_checkpoint(path, allow_hf=allow_hf)
        if location.kind != "olmo_eqx" or location.remote:  # pins are local-only
            return location
        # Pinned, so the retention of a run still writing there cannot remove it while it is
        # read; a step named explicitly is never swapped for another.
        if Path(path).expanduser().resolve() == location.directory / str(location.step):
            pin(location.directory, location.step)
            return location
        return pin_location(location, lambda loc: (loc.directory / str(loc.step) / COMMIT_MARKER).exists(),
                            lambda: resolve_checkpoint(location.directory, allow_hf=False))
    except CheckpointNotFoundError as e:
        if error is None:
            from olmo_eqx.stages import StageError as error
        raise error(f"{key}: {e}") from e


def _reader(location):
    """A read-only Checkpointer of our checkpoint at `location` (it never touches a save in
    flight of a run still writing there, and refuses incomplete steps)."""
    from olmo_eqx.checkpoint import Checkpointer

    return Checkpointer(location.directory, keep_last=None, read_only=True)


def stored_model_config(location, **fields):
    """The architecture stored at `location` (ours: the checkpoint's ModelConfig; HF: what its
    config.json maps to), with `fields` replaced: settings that don't change the stored weights
    (runtime fields; for HF also `param_dtype`, the dtype its weights are read into)."""
    if location.kind == "hf":
        from olmo_eqx.interop.hf import model_config_from_hf, read_hf_config

        return model_config_from_hf(read_hf_config(location.directory), source=str(Path(location.directory) / "config.json"),
                                    **fields)
    with _reader(location) as checkpointer:
        return checkpointer.stored_model_config(location.step).replace(**fields)


def stored_run_config(location) -> Optional[dict]:
    """The run config saved with our checkpoint at `location` (None for HF, or when none was saved)."""
    if location.kind == "hf":
        return None
    with _reader(location) as checkpointer:
        return checkpointer.stored_config(location.step)


def with_runtime_fields(model, config: Config):
    """The checkpoint's architecture with the configured runtime settings (they don't touch weights)."""
    from olmo_eqx.checkpoint import RUNTIME_FIELDS

    return dataclasses.replace(model, **{name: getattr(config.model, name) for name in RUNTIME_FIELDS})


def load_model(location, mesh, rules=None, *, model_config=None):
    """The weights at `location` (no optimiser state) as an `OLMo`, laid out on `mesh` as
    training lays them out (FSDP by default); ours are restored straight into their shards.

    model_config: the architecture to read them as; default the stored one. It may differ from
    the stored one only in `CONTINUABLE_FIELDS` (ours: `CheckpointMismatchError` otherwise).
    """
    from olmo_eqx.sharding import ShardingRules, sharded_abstract_model

    rules = rules if rules is not None else ShardingRules()
    model_config = model_config if model_config is not None else stored_model_config(location)
    if location.kind == "hf":
        import jax

        from olmo_eqx.checkpoint import CONTINUABLE_FIELDS
        from olmo_eqx.interop.hf import load_hf
        from olmo_eqx.sharding import model_shardings

        # The architecture is config.json's; the config sets only what may differ from it.
        settings = {name: getattr(model_config, name) for name in CONTINUABLE_FIELDS + ("param_dtype",)}
        model = load_hf(location.directory, **settings)
        return jax.device_put(model, model_shardings(model, mesh, rules))
    with _reader(location) as checkpointer:
        return checkpointer.restore_model(location.step, target=sharded_abstract_model(model_config, mesh, rules))


# ---------------------------------------------------------------------------------------------
# A later stage's first train state


def own_checkpoint(config: Config, run_dir: Path):
    """This run's latest complete checkpoint (a CheckpointLocation), or None."""
    from olmo_eqx.checkpoint.paths import CheckpointLocation, _complete_steps

    if config.checkpoint.dir is not None and config.checkpoint.dir.startswith(("s3://", "gs://")):
        from olmo_eqx.checkpoint import Checkpointer

        with Checkpointer(config.checkpoint.dir, keep_last=None, read_only=True) as reader:
            steps = reader.all_steps()
        return CheckpointLocation("olmo_eqx", config.checkpoint.dir.rstrip("/"), steps[-1]) if steps else None
    if config.checkpoint.dir is not None and "://" in config.checkpoint.dir:
        return None  # another URL: let the loop's own resume logic handle it
    directory = Path(config.checkpoint.dir).expanduser().resolve() if config.checkpoint.dir else run_dir / "checkpoints"
    steps = _complete_steps(directory)
    return CheckpointLocation("olmo_eqx", directory, steps[-1]) if steps else None


def resume_config(config: Config, run_dir: Path):
    """The config a later stage resumes its own run with (the model its own latest checkpoint
    holds, with this run's runtime fields), or None when the run has no checkpoint yet:
    a resume always wins over `checkpoint.load`, which it does not read."""
    own = own_checkpoint(config, run_dir)
    if own is None:
        return None
    return dataclasses.replace(config, model=with_runtime_fields(stored_model_config(own), config))


def note_model(stage: str, model, configured) -> None:
    """Say so when the configured model (ignored) differs from the checkpoint's (used)."""
    from olmo_eqx.checkpoint import CONTINUABLE_FIELDS

    differing = [
        f.name
        for f in dataclasses.fields(model)
        if f.name not in CONTINUABLE_FIELDS and getattr(model, f.name) != getattr(configured, f.name)
    ]
    if differing:
        _print(
            f"{stage}: the model is the checkpoint's ({model.name}); the configured model "
            f"({configured.name}) differs in {', '.join(differing)} and is not used"
        )


@dataclass(frozen=True)
class Source:
    """Where a stage starts: the architecture stored there, and how to build the first state."""

    model_config: object
    init_state: object  # (config, mesh, rules) -> TrainState
    location: object  # the resolved CheckpointLocation


def source(stage: str, config: Config, optimizer: Optimizer) -> Source:
    """The checkpoint or HF weights named by `checkpoint.load`, with or without optimiser state."""
    from olmo_eqx.stages import StageError

    if not config.checkpoint.load:
        raise StageError(
            f"{stage} starts from earlier weights: set checkpoint.load=PATH (a run dir of ours, its "
            "checkpoints dir, one step dir, or a HF model dir)"
        )
    location = locate(config.checkpoint.load)
    if location.kind == "hf":
        if optimizer == "keep":
            raise StageError(
                f"stage.optimizer=keep, but {location} holds HF weights, which carry no optimiser state; "
                "use stage.optimizer=reset (or auto)"
            )
        init = lambda c, m, r: _init_weights_only(stage, location, c, m, r)  # noqa: E731
        return Source(stored_model_config(location, param_dtype=config.model.param_dtype), init, location)
    if optimizer in ("auto", "keep"):
        init = lambda c, m, r: _init_from_train_state(stage, location, c, m, r)  # noqa: E731
    else:
        init = lambda c, m, r: _init_weights_only(stage, location, c, m, r)  # noqa: E731
    return Source(stored_model_config(location), init, location)


def _init_from_train_state(stage: str, location, config: Config, mesh, rules):
    """Our checkpoint's weights and Adam state, laid out on *this* run's mesh, at step 0."""
    from olmo_eqx.checkpoint import CheckpointMismatchError
    from olmo_eqx.stages import StageError
    from olmo_eqx.train.state import sharded_abstract_train_state

    _print(f"{stage}: starting from {location} (weights and optimiser state)")
    # The skip-step ring buffers are restored at their stored length (then reset).
    stored = dataclasses.replace(config.optim, skip_step_window=_stored_window(location, config.optim))
    target = sharded_abstract_train_state(config.model, stored, mesh, rules)
    with _reader(location) as checkpointer:
        try:
            state = checkpointer.restore(location.step, target=target).state
        except CheckpointMismatchError as e:
            raise StageError(f"checkpoint.load: {e}") from e
        except Exception as e:  # an optimiser config whose state has another structure
            raise StageError(
                f"cannot restore the optimiser state of {location} under this optim config ({e}); "
                "use stage.optimizer=reset to start a fresh one"
            ) from e
    return _restart(state, config.optim.skip_step_window, mesh)


def _init_weights_only(stage: str, location, config: Config, mesh, rules):
    """The weights (ours or HF) as `config.model`, on *this* run's mesh, with a fresh optimiser."""
    from olmo_eqx.checkpoint import CheckpointMismatchError
    from olmo_eqx.stages import StageError

    what = "HF weights " if location.kind == "hf" else ""
    _print(f"{stage}: starting from {what}{location} (fresh optimiser)")
    try:
        model = load_model(location, mesh, rules, model_config=config.model)
    except CheckpointMismatchError as e:
        raise StageError(f"checkpoint.load: {e}") from e
    return fresh_state(model, config.optim, mesh, rules)


def fresh_state(model, optim_config, mesh, rules):
    """A train state around `model` (already sharded, donated): fresh optimiser, step 0, laid out on `mesh`."""
    return _fresh_state_function(model.config, optim_config, mesh, rules)(model)


@functools.lru_cache(maxsize=4)
def _fresh_state_function(model_config, optim_config, mesh, rules):
    import jax

    from olmo_eqx.sharding import train_state_shardings
    from olmo_eqx.train.optim import make_optimizer
    from olmo_eqx.train.state import abstract_train_state, new_train_state

    optimizer = make_optimizer(optim_config)
    shardings = train_state_shardings(abstract_train_state(model_config, optim_config), mesh, rules)
    return jax.jit(
        lambda m: new_train_state(m, optimizer, optim_config.skip_step_window), out_shardings=shardings, donate_argnums=0
    )


def _stored_window(location, optim_config) -> int:
    """The skip-step window of the run that wrote the checkpoint (its saved run config); the
    configured one when the checkpoint doesn't say."""
    try:
        return int((stored_run_config(location) or {})["optim"]["skip_step_window"])
    except (KeyError, TypeError, ValueError):
        return optim_config.skip_step_window


def _restart(state, window: int, mesh):
    """Step 0 and empty skip-step statistics of `window` slots (the new mix has its own loss
    level); weights and Adam state (with its bias-correction count) unchanged."""
    import jax
    import numpy as np

    from olmo_eqx.sharding import replicated

    put = lambda a: jax.device_put(a, replicated(mesh))  # noqa: E731
    window = max(int(window), 1)
    return state.replace(
        step=put(np.zeros((), np.int32)),
        loss_history=put(np.zeros((window,), np.float32)),
        grad_norm_history=put(np.zeros((window,), np.float32)),
        history_count=put(np.zeros((), np.int32)),
    )
