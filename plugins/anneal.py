"""Stage 2, mid-training / anneal: `python -m olmo_eqx +stage=anneal checkpoint.load=PATH`.

Starts from stage-1 weights and trains on a new mix with its own recipe (OLMo 3 7B: LR
2.0712e-4, no warmup, linear decay to exactly 0 at the last step, its own batch and seed;
olmo3-spec section 3). `conf/stage/anneal.yaml` sets those as the defaults of the ordinary
keys (`optim.lr`, `schedule`, `data.seed`), so every one of them is overridden the usual way.

    checkpoint.load   what to start from: a run dir of ours, its checkpoints dir, one step dir,
                      or a HF OLMo model dir (read with `olmo_eqx.load_hf`)
    stage.optimizer   keep: continue the checkpoint's Adam moments; reset: a fresh optimiser;
                      auto (default): keep when the checkpoint has them (ours), reset for HF

The model's architecture comes from the checkpoint (`model.attention_impl`, `remat` and
`compute_dtype` still apply). The anneal counts its own steps from 0, with a fresh data
position and fresh skip-step statistics. It writes the same checkpoints as pretraining and
resumes the same way: once its own checkpoint dir holds a checkpoint, that wins over
`checkpoint.load`.
"""

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from olmo_eqx.config import Config, build


@dataclass(frozen=True)
class AnnealSettings:
    """`stage.*` of the anneal stage."""

    # keep | reset | auto (keep for our checkpoints, reset for HF weights, which have none).
    optimizer: Literal["auto", "keep", "reset"] = "auto"


class Anneal:
    """Stage 2: anneal (mid-train) from stage-1 weights on a new mix, LR linearly to 0."""

    description = (
        "Stage 2: anneal / mid-train from a checkpoint (checkpoint.load=...) on a new mix, "
        "LR 2.0712e-4 linearly to 0 (resumes by itself)"
    )
    config_class = AnnealSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.train.loop import train  # jax is imported only when a stage runs

        settings = config.stage if isinstance(config.stage, AnnealSettings) else build(AnnealSettings, config.stage or {}, "stage")
        run_dir = Path(run_dir).resolve()
        config = dataclasses.replace(config, stage=settings)
        own = _own_checkpoint(config, run_dir)
        if own is not None:
            # A resume: this run's own checkpoint decides the model; checkpoint.load is not read.
            model = _with_runtime_fields(_stored_model_config(own), config)
            return train(dataclasses.replace(config, model=model), run_dir)
        source = _source(config, settings)
        model = _with_runtime_fields(source.model_config, config)
        notes = _model_notes(model, config.model)
        config = dataclasses.replace(config, model=model)
        return train(config, run_dir, init_state=source.init_state, notes=notes)


# ---------------------------------------------------------------------------------------------
# Where to start


def _print(text: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


def _own_checkpoint(config: Config, run_dir: Path):
    """This run's latest complete checkpoint (a CheckpointLocation), or None."""
    from olmo_eqx.checkpoint_paths import CheckpointLocation, _complete_steps

    if config.checkpoint.dir is not None and "://" in config.checkpoint.dir:
        return None  # remote: let the loop's own resume logic handle it
    directory = Path(config.checkpoint.dir).expanduser().resolve() if config.checkpoint.dir else run_dir / "checkpoints"
    steps = _complete_steps(directory)
    return CheckpointLocation("olmo_eqx", directory, steps[-1]) if steps else None


def _stored_model_config(location):
    from olmo_eqx.checkpoint import Checkpointer

    with Checkpointer(location.directory, keep_last=None, read_only=True) as checkpointer:
        return checkpointer.stored_model_config(location.step)


def _with_runtime_fields(model, config: Config):
    """The checkpoint's architecture with the configured runtime settings (they don't touch weights)."""
    from olmo_eqx.checkpoint import RUNTIME_FIELDS

    return dataclasses.replace(model, **{name: getattr(config.model, name) for name in RUNTIME_FIELDS})


def _model_notes(model, configured) -> tuple[str, ...]:
    """A line for the run's log when the configured model is not the one used."""
    from olmo_eqx.checkpoint import RUNTIME_FIELDS

    differing = [
        f.name
        for f in dataclasses.fields(model)
        if f.name not in RUNTIME_FIELDS and getattr(model, f.name) != getattr(configured, f.name)
    ]
    if not differing:
        return ()
    return (
        f"anneal: the model is the checkpoint's ({model.name}); the configured model "
        f"({configured.name}) differs in {', '.join(differing)} and is not used",
    )


@dataclass(frozen=True)
class _Source:
    model_config: object
    init_state: object  # (config, mesh, rules) -> TrainState


def _source(config: Config, settings: AnnealSettings) -> _Source:
    from olmo_eqx.checkpoint_paths import CheckpointNotFoundError, resolve_checkpoint
    from olmo_eqx.stages import StageError

    if not config.checkpoint.load:
        raise StageError(
            "anneal starts from stage-1 weights: set checkpoint.load=PATH (a pretrain run dir, its "
            "checkpoints dir, one step dir, or a HF model dir)"
        )
    try:
        location = resolve_checkpoint(config.checkpoint.load)
    except CheckpointNotFoundError as e:
        raise StageError(f"checkpoint.load: {e}") from e
    if location.kind == "hf":
        if settings.optimizer == "keep":
            raise StageError(
                f"stage.optimizer=keep, but {location} holds HF weights, which carry no optimiser state; "
                "use stage.optimizer=reset (or auto)"
            )
        return _Source(_hf_model_config(location, config), lambda c, m, r: _init_from_hf(location, c, m, r))
    keep = settings.optimizer in ("auto", "keep")
    return _Source(_stored_model_config(location), lambda c, m, r: _init_from_checkpoint(location, keep, c, m, r))


def _hf_model_config(location, config: Config):
    import json

    from olmo_eqx.hf import model_config_from_hf

    hf = json.loads((location.directory / "config.json").read_text())
    return model_config_from_hf(hf, param_dtype=config.model.param_dtype)


# ---------------------------------------------------------------------------------------------
# Initial states (called by the loop only when the run has no checkpoint of its own)


def _init_from_checkpoint(location, keep_optimizer: bool, config: Config, mesh, rules):
    """Stage-1 weights (and Adam state when kept), laid out on *this* run's mesh."""
    from olmo_eqx.checkpoint import CheckpointMismatchError, Checkpointer
    from olmo_eqx.sharding import sharded_abstract_model
    from olmo_eqx.stages import StageError
    from olmo_eqx.train.state import sharded_abstract_train_state

    what = "weights and optimiser state" if keep_optimizer else "weights (fresh optimiser)"
    _print(f"anneal: starting from {location} ({what})")
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


def _init_from_hf(location, config: Config, mesh, rules):
    import jax

    from olmo_eqx.checkpoint import RUNTIME_FIELDS
    from olmo_eqx.hf import load_hf
    from olmo_eqx.sharding import model_shardings

    _print(f"anneal: starting from HF weights {location} (fresh optimiser)")
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
