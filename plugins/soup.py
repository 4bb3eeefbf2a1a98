"""Checkpoint soup: `python -m olmo_eqx +stage=soup stage.checkpoints=[A,B,...]`.

Averages the weights of N checkpoints of the same model (OLMo 3 32B averaged two stage-2
runs) into a new checkpoint of the usual format, in `<run dir>/checkpoints/0` (or
`checkpoint.dir`). Each of A, B, ... is a run dir, its checkpoints dir or one step dir (the
latest complete step of a dir). `stage.weights=[w1,w2,...]` weighs them (normalised to sum
to 1); the default is the plain mean.

Memory: the checkpoints are restored one at a time, directly into their shards on this run's
mesh (any mesh: the one of `mesh.*`), and added into a float32 running sum, so each device
holds its shard of the sum plus at most one restored model. The result is written with a fresh
optimiser state (zero Adam moments, step 0): an anneal from it starts its optimiser anew.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config

SOUP_STEP = 0


@dataclass(frozen=True)
class SoupSettings:
    """`stage.*` of the soup stage."""

    # Checkpoints to average: run dirs, checkpoints dirs or step dirs (at least one).
    checkpoints: tuple[str, ...] = ()
    # One weight per checkpoint, >= 0, normalised to sum 1; None: uniform.
    weights: Optional[tuple[float, ...]] = None

    def __post_init__(self):
        if self.weights is not None:
            if len(self.weights) != len(self.checkpoints):
                raise ValueError(
                    f"weights has {len(self.weights)} entries but checkpoints has {len(self.checkpoints)}; give one weight each"
                )
            if not all(math.isfinite(w) for w in self.weights):
                raise ValueError(f"weights={list(self.weights)} must be finite numbers (inf or nan averages to nan)")
            if any(not (w >= 0) for w in self.weights) or not sum(self.weights) > 0:
                raise ValueError(f"weights={list(self.weights)} must be >= 0 and sum to more than 0")
            # 1e308 + 1e308 is inf in float64: every normalised weight would be 0 or nan.
            if not math.isfinite(sum(self.weights)):
                raise ValueError(f"weights={list(self.weights)} sum past the largest float; give them on a smaller scale "
                                 "(only their ratios matter: [1, 1] for [1e308, 1e308])")

    def normalised_weights(self) -> tuple[float, ...]:
        """The weights divided by their sum (in float64: the averaging's float32 would overflow on
        weights past 3.4e38); uniform when none were given."""
        if self.weights is None:
            return (1.0 / len(self.checkpoints),) * len(self.checkpoints)
        total = sum(self.weights)
        return tuple(w / total for w in self.weights)


class Soup:
    """Average the weights of N checkpoints (uniform or weighted) into a new checkpoint."""

    description = "Average the weights of N checkpoints (stage.checkpoints=[...], stage.weights=[...]) into a new checkpoint"
    config_class = SoupSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        import jax

        from olmo_eqx.checkpoint import Checkpointer
        from olmo_eqx.config import config_to_dict, stage_settings
        from olmo_eqx.run.run_dir import RunDir
        from olmo_eqx.infra.cluster import cluster_line, start_cluster
        from olmo_eqx.sharding import ShardingRules, make_mesh
        from olmo_eqx.stages import StageError
        from olmo_eqx.warm_start import fresh_state, locate, own_checkpoint

        cluster = start_cluster()
        settings = stage_settings(self, "soup", config.stage or {})
        if not settings.checkpoints:
            raise StageError("soup needs the checkpoints to average: stage.checkpoints=[PATH,PATH,...]")
        run_dir = Path(run_dir).resolve()
        # The soup averages checkpoints of ours (HF weights have no step to name the result by).
        locations = [locate(path, f"stage.checkpoints[{i}]", allow_hf=False) for i, path in enumerate(settings.checkpoints)]
        model_config = _common_model_config(locations)
        weights = settings.normalised_weights()

        if (existing := own_checkpoint(config, run_dir)) is not None:
            raise StageError(f"{existing.directory} already holds a checkpoint; give the soup a new run dir (hydra.run.dir=...)")
        out_dir = Path(config.checkpoint.dir).expanduser().resolve() if config.checkpoint.dir else run_dir / "checkpoints"
        try:
            mesh = make_mesh(config.mesh)
        except ValueError as e:
            raise StageError(str(e)) from e
        rules = ShardingRules()
        # Everything above refuses bad input before the run dir gets a file (soup.log included).
        out = RunDir(run_dir, enabled=jax.process_index() == 0, log_name="soup.log")
        out.print(cluster_line(cluster, mesh))
        out.print(f"soup of {len(locations)} checkpoint(s) of {model_config.name} on mesh {dict(mesh.shape)}:")
        for location, weight in zip(locations, weights):
            out.print(f"  {weight:.4f} x {location}")

        model = average_checkpoints(locations, weights, model_config, mesh, rules)
        if (where := first_non_finite(model)) is not None:
            out.close()
            raise StageError(f"soup: the average is not finite (nan or inf) in {where}, so nothing was written: one of "
                             f"stage.checkpoints={list(settings.checkpoints)} holds non-finite weights there; leave it out")
        config = dataclasses.replace(config, model=model_config, stage=settings)
        state = fresh_state(model, config.optim, mesh, rules)
        del model
        with Checkpointer(out_dir, keep_last=None) as checkpointer:
            checkpointer.save(SOUP_STEP, state, loader_state=None, config=config_to_dict(config))
        summary = {
            "stage_completed": True,
            "model": model_config.name,
            "inputs": [str(location) for location in locations],
            "weights": list(weights),
            "checkpoint": str(out_dir / str(SOUP_STEP)),
            "devices": jax.device_count(),
            "run_dir": str(run_dir),
        }
        out.write_config(config_to_dict(config))
        out.write_summary(summary)
        out.print(f"soup written to {summary['checkpoint']}")
        out.close()
        return summary


def _common_model_config(locations):
    """The model config every checkpoint shares; a clear error naming the odd one out otherwise."""
    from olmo_eqx.checkpoint import CheckpointMismatchError, check_model_config
    from olmo_eqx.stages import StageError
    from olmo_eqx.warm_start import stored_model_config

    configs = [stored_model_config(location) for location in locations]
    for location, config in zip(locations[1:], configs[1:]):
        try:
            check_model_config(config, configs[0], f"checkpoint {location}")
        except CheckpointMismatchError as e:
            raise StageError(
                f"soup: checkpoints of different models cannot be averaged: {e} (the first checkpoint, {locations[0]}, "
                "sets the model)"
            ) from e
    return configs[0]


def first_non_finite(model) -> Optional[str]:
    """The path of the first parameter holding a nan or inf (one reduction each, read back
    together), or None when all are finite."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_inexact_array))[0]
    finite = jax.device_get([jnp.isfinite(leaf).all() for _, leaf in leaves])
    for (path, _), ok in zip(leaves, finite):
        if not ok:
            return "model" + jax.tree_util.keystr(path)
    return None


def average_checkpoints(locations, weights, model_config, mesh, rules):
    """sum_i w_i * model_i / sum_i w_i, restoring one checkpoint at a time into its shards and
    accumulating in float32; the result has the model's parameter dtype and shardings."""
    import jax.numpy as jnp

    from olmo_eqx.warm_start import load_model

    first, add, finish = _averaging_functions(model_config, mesh, rules)
    total = None
    for location, weight in zip(locations, weights):
        model = load_model(location, mesh, rules, model_config=model_config)
        w = jnp.float32(weight)
        total = first(model, w) if total is None else add(total, model, w)
        del model  # freed before the next restore
    return finish(total, jnp.float32(sum(weights)))


@functools.lru_cache(maxsize=4)
def _averaging_functions(model_config, mesh, rules):
    """(first, add, finish), compiled once per model config and mesh."""
    import jax
    import jax.numpy as jnp

    from olmo_eqx.sharding import model_shardings, sharded_abstract_model

    target = sharded_abstract_model(model_config, mesh, rules)
    shardings = model_shardings(target, mesh, rules)
    first = jax.jit(
        lambda model, w: jax.tree.map(lambda x: w * x.astype(jnp.float32), model),
        donate_argnums=0,
        out_shardings=shardings,
    )
    # The sum is donated (updated in place); each restored copy is dropped right after its add.
    add = jax.jit(
        lambda total, model, w: jax.tree.map(lambda t, x: t + w * x.astype(jnp.float32), total, model),
        donate_argnums=0,
        out_shardings=shardings,
    )
    finish = jax.jit(
        lambda total, norm: jax.tree.map(lambda t, a: (t / norm).astype(a.dtype), total, target),
        donate_argnums=0,
        out_shardings=shardings,
    )
    return first, add, finish
