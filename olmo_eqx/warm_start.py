"""Starting a stage from earlier weights: one of our checkpoints or a HF model directory.

A later stage (anneal, long context) calls `source(...)` for the architecture stored at
`checkpoint.load` and an `init_state(config, mesh, rules)` that restores the weights, with or
without the Adam state, onto *this* run's mesh; the loop calls it only when the run has no
checkpoint of its own (a resume always wins). Which model fields may differ between the
checkpoint and the config that continues it is `olmo_eqx.checkpoint.CONTINUABLE_FIELDS`.
"""

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from olmo_eqx.config import Config

# keep: continue the checkpoint's Adam moments; reset: a fresh optimiser; auto: keep when
# the checkpoint has them (ours), reset for HF weights (which have none).
Optimizer = Literal["auto", "keep", "reset"]


def _print(text: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


def own_checkpoint(config: Config, run_dir: Path):
    """This run's latest complete checkpoint (a CheckpointLocation), or None."""
    from olmo_eqx.checkpoint_paths import CheckpointLocation, _complete_steps

    if config.checkpoint.dir is not None and "://" in config.checkpoint.dir:
        return None  # remote: let the loop's own resume logic handle it
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


def stored_model_config(location):
    from olmo_eqx.checkpoint import Checkpointer

    with Checkpointer(location.directory, keep_last=None, read_only=True) as checkpointer:
        return checkpointer.stored_model_config(location.step)


def with_runtime_fields(model, config: Config):
    """The checkpoint's architecture with the configured runtime settings (they don't touch weights)."""
    from olmo_eqx.checkpoint import RUNTIME_FIELDS

    return dataclasses.replace(model, **{name: getattr(config.model, name) for name in RUNTIME_FIELDS})


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
    from olmo_eqx.checkpoint_paths import CheckpointNotFoundError, resolve_checkpoint
    from olmo_eqx.stages import StageError

    if not config.checkpoint.load:
        raise StageError(
            f"{stage} starts from earlier weights: set checkpoint.load=PATH (a run dir of ours, its "
            "checkpoints dir, one step dir, or a HF model dir)"
        )
    try:
        location = resolve_checkpoint(config.checkpoint.load)
    except CheckpointNotFoundError as e:
        raise StageError(f"checkpoint.load: {e}") from e
    if location.kind == "hf":
        if optimizer == "keep":
            raise StageError(
                f"stage.optimizer=keep, but {location} holds HF weights, which carry no optimiser state; "
                "use stage.optimizer=reset (or auto)"
            )
        init = lambda c, m, r: _init_from_hf(stage, location, c, m, r)  # noqa: E731
        return Source(_hf_model_config(location, config), init, location)
    keep = optimizer in ("auto", "keep")
    init = lambda c, m, r: _init_from_checkpoint(stage, location, keep, c, m, r)  # noqa: E731
    return Source(stored_model_config(location), init, location)


def _hf_model_config(location, config: Config):
    import json

    from olmo_eqx.hf import model_config_from_hf

    hf = json.loads((location.directory / "config.json").read_text())
    return model_config_from_hf(hf, param_dtype=config.model.param_dtype)


# ---------------------------------------------------------------------------------------------
# Initial states (called by the loop only when the run has no checkpoint of its own)


def _init_from_checkpoint(stage: str, location, keep_optimizer: bool, config: Config, mesh, rules):
    """Stage-1 weights (and Adam state when kept), laid out on *this* run's mesh."""
    from olmo_eqx.checkpoint import CheckpointMismatchError, Checkpointer
    from olmo_eqx.sharding import sharded_abstract_model
    from olmo_eqx.stages import StageError
    from olmo_eqx.train.state import sharded_abstract_train_state

    what = "weights and optimiser state" if keep_optimizer else "weights (fresh optimiser)"
    _print(f"{stage}: starting from {location} ({what})")
    with Checkpointer(location.directory, keep_last=None, read_only=True) as checkpointer:
        try:
            if keep_optimizer:
                # The skip-step ring buffers are restored at their stored length (then reset).
                window = _stored_window(checkpointer, location.step, config.optim)
                stored = dataclasses.replace(config.optim, skip_step_window=window)
                target = sharded_abstract_train_state(config.model, stored, mesh, rules)
                try:
                    state = checkpointer.restore(location.step, target=target).state
                except CheckpointMismatchError:
                    raise
                except Exception as e:  # an optimiser config whose state has another structure
                    raise StageError(
                        f"cannot restore the optimiser state of {location} under this optim config ({e}); "
                        "use stage.optimizer=reset to start a fresh one"
                    ) from e
                return _restart(state, config.optim.skip_step_window, mesh)
            target = sharded_abstract_model(config.model, mesh, rules)
            model = checkpointer.restore_model(location.step, target=target)
        except CheckpointMismatchError as e:
            raise StageError(f"checkpoint.load: {e}") from e
    return fresh_state(model, config.optim, mesh, rules)


def _init_from_hf(stage: str, location, config: Config, mesh, rules):
    import jax

    from olmo_eqx.checkpoint import RUNTIME_FIELDS
    from olmo_eqx.hf import load_hf
    from olmo_eqx.sharding import model_shardings

    _print(f"{stage}: starting from HF weights {location} (fresh optimiser)")
    runtime = {name: getattr(config.model, name) for name in RUNTIME_FIELDS}
    model = load_hf(location.directory, param_dtype=config.model.param_dtype, **runtime)
    model = jax.device_put(model, model_shardings(model, mesh, rules))
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


def _stored_window(checkpointer, step: int, optim_config) -> int:
    """The skip-step window of the run that wrote the checkpoint (its saved run config); the
    configured one when the checkpoint doesn't say."""
    try:
        return int((checkpointer.stored_config(step) or {})["optim"]["skip_step_window"])
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
