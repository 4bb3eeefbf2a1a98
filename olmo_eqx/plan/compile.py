"""Compiling the train step for a target's devices, for abstract inputs (nothing allocated)."""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

from olmo_eqx.plan.targets import Target, gpu_devices, tpu_devices
from olmo_eqx.train.memory import (  # noqa: F401  (CompileRefused and memory_bytes: the planner's names too)
    Attempt, Budget, CompileRefused, compile_lowered, device_budget, fewest_that_fit, memory_bytes, micro_batch_candidates,
    needed_bytes, size,
)

# Where compile_train_step says what it compiles and how long it took (main() prints it; a
# plan from Python stays quiet).
_progress: Optional[Callable[[str], None]] = None
_compiles = 0


@dataclass
class CompiledStep:
    memory: object  # CompiledMemoryStats
    cost: dict
    hlo: str
    state: object  # the abstract, sharded TrainState
    mesh: object
    rules: object
    # The executable itself: `executable(batch, arrays)` runs it where the devices are real
    # (scripts/measure_step.py), `arrays` being the state's arrays (`eqx.filter(state, eqx.is_array)`).
    executable: object = None
    # The config compiled: trainer.micro_batches=auto resolved to the count chosen.
    config: object = None
    # trainer.micro_batches=auto: every count compiled, fewest first (`olmo_eqx.train.memory.Attempt`).
    attempts: list = dataclasses.field(default_factory=list)


def target_devices(target: Target) -> list:
    """The devices a plan compiles for: fake CPU devices, or a TPU/GPU target's abstract ones."""
    import jax

    if target.platform == "tpu":
        return tpu_devices(target)
    if target.platform == "gpu":
        return gpu_devices(target)
    if jax.device_count() < target.n_devices:
        raise SystemExit(
            f"the planner needs {target.n_devices} fake devices but JAX has {jax.device_count()}: run it as "
            "`python -m olmo_eqx.plan ...` in a fresh process (XLA_FLAGS is set before JAX starts)"
        )
    return jax.devices()[: target.n_devices]


def _cost_analysis(compiled) -> dict:
    import jax

    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if not cost:
        # XLA:GPU's executables answer UNIMPLEMENTED; XLA's HLO cost analysis of the same
        # optimised module, run by the CPU client, counts its FLOPs and bytes (no time).
        from jax._src.lib import _jax

        module = compiled.runtime_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return {key: float(value) for key, value in (cost or {}).items() if "{" not in key}


# The estimate's compiles ask XLA for its counts only, never for the program the chip runs:
# at the lowest execution-time effort XLA:TPU skips its costly scheduling and tuning passes.
# A 190m one-layer program on v5e:2x2 then compiles in 12-21 s instead of 69-76 s, with the
# same FLOPs (to 0.01%) and 12% fewer bytes accessed (docs/planning.md, "How long a plan takes").
COUNTS_ONLY_EFFORT = -1.0


def compile_train_step(config, devices, *, effort: Optional[float] = None, budget: Optional[Budget] = None) -> CompiledStep:
    """Lower and compile `config`'s train step for abstract inputs on `devices` (nothing allocated).

    `effort`: XLA's execution-time optimisation effort, -1 to 1; None keeps the compiler's
    default, which is what the chip runs and what the memory plan must read.

    trainer.micro_batches=auto compiles the fewest micro-batches that fit as a run on `devices`
    would choose them (`olmo_eqx.train.micro_batches`), against `budget` (default: what the
    devices offer, `olmo_eqx.train.memory.device_budget`); `CompileRefused` when none fits."""
    if config.trainer.micro_batches == "auto":
        return _fewest_micro_batches(config, devices, effort=effort, budget=budget)
    import equinox as eqx
    import jax

    mesh, rules, state, batch, train_step = _abstract_step(config, devices)
    step = train_step.step

    # eqx.filter_jit would treat ShapeDtypeStruct leaves as static: jit the array part instead.
    arrays, static = eqx.partition(state, _is_abstract)

    def array_step(batch, arrays):
        new_state, metrics = step(batch, eqx.combine(arrays, static))
        return eqx.filter(new_state, eqx.is_array), metrics

    model = config.model
    what = (f"{model.n_layers} layers, remat {model.remat}, {config.trainer.micro_batches} micro-batch(es) of "
            f"{config.data.global_batch_size // config.trainer.micro_batches} x {config.data.sequence_length}")
    compiled = _compile(jax.jit(array_step, donate_argnums=1).lower(batch, arrays), what, effort)
    return CompiledStep(compiled.memory_analysis(), _cost_analysis(compiled), compiled.as_text(), state, mesh, rules,
                        compiled, config)


def _fewest_micro_batches(config, devices, *, effort: Optional[float], budget: Optional[Budget]) -> CompiledStep:
    """`compile_train_step` for trainer.micro_batches=auto: the fewest candidates that fit."""
    import jax

    from olmo_eqx.sharding import MESH_AXES, ShardingRules

    platform = devices[0].platform
    if budget is None:
        local = sum(1 for d in devices if getattr(d, "process_index", 0) == jax.process_index())
        budget = device_budget(devices[0], config.trainer.device_memory_gib, local)
    sizes = dict(zip(MESH_AXES, config.mesh.shape(len(devices))))
    shards = math.prod(sizes[axis] for axis in ShardingRules().batch)

    def attempt(m: int) -> Attempt:
        try:
            step = compile_train_step(_with(config, micro_batches=m), devices, effort=effort)
        except CompileRefused as refusal:
            return Attempt(m, False, None, refused=str(refusal))
        needed = needed_bytes(memory_bytes(step.memory), platform)
        return Attempt(m, needed <= budget.bytes, needed, payload=step)

    best, attempts = fewest_that_fit(micro_batch_candidates(config.data.global_batch_size, shards), attempt)
    if best is None:
        last = max(attempts, key=lambda a: a.micro_batches)
        need = f"needs {size(last.needed)} per device" if last.needed is not None else f"is refused ({last.refused})"
        raise CompileRefused(
            f"trainer.micro_batches=auto: nothing fits: {last.micro_batches} micro-batches, the most the batch allows, "
            f"{need}, against {size(budget.bytes)} ({budget.source})"
        )
    step = best.payload
    for a in attempts:
        a.payload = None  # the executables of the other counts are not kept
    step.attempts = attempts
    return step


def _compile(lowered, what: str, effort: Optional[float]):
    """Compile `lowered`, saying what and how long (`_progress`), numbered; the compiler's
    out-of-memory refusal becomes `CompileRefused`. `effort`: as for `compile_train_step`."""
    global _compiles
    _compiles += 1
    return compile_lowered(lowered, what, effort=effort, progress=_progress, label=f"compile {_compiles}")


def _abstract_step(config, devices):
    """The mesh, rules, abstract sharded state and batch of `config` on `devices`, and its train step."""
    import jax
    import jax.numpy as jnp

    from olmo_eqx.sharding import ShardingRules, batch_sharding, make_mesh
    from olmo_eqx.train.schedules import make_schedule
    from olmo_eqx.train.state import sharded_abstract_train_state
    from olmo_eqx.train.step import make_train_step

    mesh = make_mesh(config.mesh, devices)
    rules = ShardingRules()
    state = sharded_abstract_train_state(config.model, config.optim, mesh, rules)
    layout = batch_sharding(mesh, rules)
    shape = (config.data.global_batch_size, config.data.sequence_length)
    batch = {
        "input_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=layout),
    }
    # Document masking (stage 3) hands the model segment ids, and positions when they restart.
    if config.data.document_masking:
        batch["segment_ids"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout)
    if config.data.reset_positions_per_document:
        batch["positions"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=layout)
    schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
    train_step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=config.trainer.micro_batches)
    return mesh, rules, state, batch, train_step


def once_per_step_cost(config, devices, *, effort: Optional[float] = COUNTS_ONLY_EFFORT) -> dict:
    """XLA's cost analysis of the work `config`'s step does once whatever its micro-batches
    (the weights' cast, the gradient norm, AdamW's update, the new state: the train step's
    `once_per_step`), compiled on its own for abstract float32 gradients (nothing allocated),
    and the per-device bytes of those gradients ("gradient bytes")."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    _, _, state, _, train_step = _abstract_step(config, devices)
    arrays, static = eqx.partition(state, _is_abstract)
    params = eqx.filter(state.model, _is_abstract)
    grads = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding)
        if jnp.issubdtype(p.dtype, jnp.floating) else None,
        params, is_leaf=_is_abstract,
    )

    def once(grads, arrays):
        weights, (new_state, metrics) = train_step.once_per_step(grads, eqx.combine(arrays, static))
        return weights, eqx.filter(new_state, eqx.is_array), metrics

    lowered = jax.jit(once, donate_argnums=(0, 1)).lower(grads, arrays)
    cost = _cost_analysis(_compile(lowered, f"the once-per-step update of {config.model.n_layers} layers", effort))
    return {**cost, "gradient bytes": float(_per_device_bytes(grads))}


def _is_abstract(x) -> bool:
    import jax

    return isinstance(x, jax.ShapeDtypeStruct)


def _per_device_bytes(tree) -> int:
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(tree, is_leaf=_is_abstract)
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)


def _batch_shards(mesh, rules) -> int:
    return math.prod(mesh.shape[axis] for axis in rules.batch)


def _with(config, *, model=None, micro_batches=None, global_batch=None):
    """`config` with some model fields, the micro-batch count or the global batch changed."""
    changes = {}
    if model:
        changes["model"] = config.model.replace(**model)
    if micro_batches is not None:
        changes["trainer"] = dataclasses.replace(config.trainer, micro_batches=micro_batches)
    if global_batch is not None:
        changes["data"] = dataclasses.replace(config.data, global_batch_size=global_batch)
    return dataclasses.replace(config, **changes)
