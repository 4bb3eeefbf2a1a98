"""The train state: everything a bitwise-exact resume needs, on the devices.

The data position is host-side (`olmo_eqx.data.LoaderState`); the checkpoint stores it beside
this state in the same step directory.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from ..models.config import ModelConfig
from ..models.base import CausalLM
from ..models.registry import abstract_model, build_model
from ..sharding import ShardingRules, train_state_shardings, with_shardings
from .optim import OptimConfig, make_optimizer


class TrainState(eqx.Module):
    """Model, optimiser state, step and the skip-step statistics.

    `loss_history` / `grad_norm_history` are ring buffers of the last `window` steps' loss
    and grad norm; slot `i % window` holds step i's values and `history_count` says how many
    slots are filled (at most `window`).
    """

    model: CausalLM
    opt_state: PyTree
    step: Int[Array, ""]
    loss_history: Float[Array, " window"]
    grad_norm_history: Float[Array, " window"]
    history_count: Int[Array, ""]

    def replace(self, **changes) -> "TrainState":
        return eqx.tree_at(lambda s: [getattr(s, k) for k in changes], self, list(changes.values()))


def new_train_state(model: CausalLM, optimizer: optax.GradientTransformation, window: int) -> TrainState:
    """A fresh state around `model` (step 0, empty statistics)."""
    window = max(int(window), 1)
    return TrainState(
        model=model,
        opt_state=optimizer.init(eqx.filter(model, eqx.is_array)),
        step=jnp.zeros((), jnp.int32),
        loss_history=jnp.zeros((window,), jnp.float32),
        grad_norm_history=jnp.zeros((window,), jnp.float32),
        history_count=jnp.zeros((), jnp.int32),
    )


def abstract_train_state(model_config: ModelConfig, optim_config: OptimConfig) -> TrainState:
    """The state's structure with `jax.ShapeDtypeStruct` leaves (no shardings); allocates nothing."""
    optimizer = make_optimizer(optim_config)
    return eqx.filter_eval_shape(
        lambda: new_train_state(build_model(model_config, key=jax.random.key(0)), optimizer, optim_config.skip_step_window)
    )


def sharded_abstract_train_state(
    model_config: ModelConfig, optim_config: OptimConfig, mesh: Mesh, rules: ShardingRules = ShardingRules()
) -> TrainState:
    """Abstract state whose leaves carry their shardings on `mesh`: the restore target."""
    abstract = abstract_train_state(model_config, optim_config)
    return with_shardings(abstract, train_state_shardings(abstract, mesh, rules))


def init_train_state(
    model_config: ModelConfig,
    optim_config: OptimConfig,
    mesh: Mesh,
    rules: ShardingRules,
    key: PRNGKeyArray,
) -> TrainState:
    """Initialise model and optimiser directly in their shards (a 7B never sits on one device).

    eval_shape -> shardings -> one jit with out_shardings. The learning rate is not part of the
    state: the train step takes the schedule.
    """
    return _jitted_init(model_config, optim_config.without_peak_lr(), mesh, rules)(key)


@functools.lru_cache(maxsize=8)
def _jitted_init(model_config: ModelConfig, optim_config: OptimConfig, mesh: Mesh, rules: ShardingRules):
    # Cached so that re-initialising (tests, sweeps in one process) doesn't recompile.
    optimizer = make_optimizer(optim_config)
    shardings = train_state_shardings(abstract_train_state(model_config, optim_config), mesh, rules)

    def init(key):
        return new_train_state(build_model(model_config, key=key), optimizer, optim_config.skip_step_window)

    return jax.jit(init, out_shardings=shardings)


__all__ = [
    "TrainState",
    "abstract_model",
    "abstract_train_state",
    "init_train_state",
    "new_train_state",
    "sharded_abstract_train_state",
]
