"""The pure train step and the held-out eval step.

`train_step(state, batch) -> (state, metrics)` is one `eqx.filter_jit` with the state donated:
forward + backward over `micro_batches` slices of the global batch (lax.scan, gradients
accumulated in float32, every slice normalised by the *global* target count), clipping,
AdamW, and the skip-step decision, all on the device with no host sync. Metrics come back as
device scalars; the loop should fetch them one step late so the host never stalls the device.
"""

import functools
from collections.abc import Callable
from typing import Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from ..batch import TokenBatch, as_token_batch
from ..models.base import AUX_OBJECTIVE, CausalLM, compute_weights
from ..sharding import ShardingRules, activation_sharding, model_shardings, train_state_shardings
from .loss import LossSums, chunked_loss_sums, fused_head_loss, target_count
from .optim import OptimConfig, apply_updates, make_optimizer
from .schedules import Schedule
from .state import TrainState

# A `TokenBatch`, or the dict {"input_ids": [B, L] int32, "loss_mask": [B, L]} it replaced.
Batch = Union[TokenBatch, dict]
Metrics = dict[str, Float[Array, ""]]


def _check_batch(batch: Batch) -> TokenBatch:
    batch = as_token_batch(batch)
    return eqx.tree_at(lambda b: b.loss_mask, batch, batch.loss_mask.astype(jnp.float32))


def _split_micro_batches(x: Array, micro_batches: int, mesh: Optional[Mesh], rules: ShardingRules) -> Array:
    """[B, ...] -> [M, B/M, ...] with micro-batch m = rows m, m+M, m+2M, ...

    Strided rather than contiguous so that each micro-batch keeps the batch sharding of the
    global array (its rows stay spread over every data shard; nothing moves between devices).
    """
    b = x.shape[0]
    if b % micro_batches:
        raise ValueError(f"global batch {b} is not divisible by micro_batches={micro_batches}")
    x = jnp.swapaxes(x.reshape(b // micro_batches, micro_batches, *x.shape[1:]), 0, 1)
    if mesh is not None:
        batch_axes = rules.mesh_axes("batch")
        n_shards = 1
        for name in batch_axes if isinstance(batch_axes, tuple) else (batch_axes,):
            n_shards *= mesh.shape[name]
        if (b // micro_batches) % n_shards == 0:
            spec = P(None, batch_axes, *([None] * (x.ndim - 2)))
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return x


def _skip_decision(
    value: Float[Array, ""], history: Float[Array, " window"], count: Int[Array, ""], std_factor: float, min_history: int
) -> jax.Array:
    """True when `value` - mean > std_factor * std (Bessel) of the filled history slots.

    OLMo-core's test (SkipStepOptimizer.get_step_factor), written the same way so that the
    float32 comparison rounds alike.
    """
    window = history.shape[0]
    n = jnp.minimum(count, window).astype(jnp.float32)
    valid = (jnp.arange(window) < n).astype(jnp.float32)
    mean = jnp.sum(history * valid) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.square(history - mean) * valid) / jnp.maximum(n - 1.0, 1.0)
    return (n >= min_history) & (value - mean > std_factor * jnp.sqrt(var))


def skip_step(
    loss: Float[Array, ""],
    grad_norm: Float[Array, ""],
    loss_history: Float[Array, " window"],
    grad_norm_history: Float[Array, " window"],
    history_count: Int[Array, ""],
    config: OptimConfig,
) -> tuple[Bool[Array, ""], dict[str, Array]]:
    """(skip this update?, the new statistics as TrainState fields): OLMo-core's SkipStepAdamW rule.

    The statistics are the train state's ring buffers (`TrainState.loss_history` ...).

    Skip when the loss (cross-entropy, no z-loss) or the grad norm before clipping exceeds
    mean + skip_step_std * std (Bessel) of the previous `skip_step_window` steps, once the
    window holds `config.skip_history_needed` of them. Every finite step enters the window,
    skipped or not. Only the grad norm's part differs when clipping is off: OLMo-core's train
    module records the norm only when it clips, so then the loss alone decides, here too.

    Where it differs, on purpose: a non-finite loss or grad norm is always skipped and kept out
    of the window (OLMo-core records it, and a NaN mean then skips every step until it leaves
    the window; before the window is full enough it applies the non-finite update); the window
    is part of the train state, so a resumed run keeps it (OLMo-core's lives outside its
    optimizer's state dict and starts empty after a restart).
    """
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    skipped = ~finite
    if config.skip_step_std:
        watched = [(loss, loss_history)]
        if config.clip_grad_norm:
            watched.append((grad_norm, grad_norm_history))
        for value, history in watched:
            skipped |= _skip_decision(value, history, history_count, config.skip_step_std, config.skip_history_needed)
    else:
        skipped = jnp.zeros((), bool)
    slot = history_count % loss_history.shape[0]
    record = lambda h, v: jnp.where(finite, h.at[slot].set(v), h)  # noqa: E731
    return skipped, {
        "loss_history": record(loss_history, loss),
        "grad_norm_history": record(grad_norm_history, grad_norm),
        "history_count": history_count + finite.astype(jnp.int32),
    }


def model_loss_sums(model: CausalLM, batch: TokenBatch, constrain) -> LossSums:
    """The training loss of `model` on a batch: hidden states, then the chunked head + loss."""
    return model_loss_sums_and_aux(model, batch, constrain)[0]


def model_loss_sums_and_aux(model: CausalLM, batch: TokenBatch, constrain) -> tuple[LossSums, dict[str, Array]]:
    """`model_loss_sums` and the model's auxiliary terms (router losses of a MoE; dense: {})."""
    hidden, aux = model.hidden_states_and_aux(
        batch.input_ids, batch.positions, segment_ids=batch.segment_ids, constrain=constrain
    )
    config = model.config
    sums = chunked_loss_sums(
        hidden, model.lm_head, batch.input_ids, batch.loss_mask,
        vocab_size=config.vocab_size, chunk_size=config.loss_chunk_size, logits_dtype=config.logits_dtype,
        constrain=constrain,
    )
    return sums, aux


def training_loss(
    model: CausalLM, batch: TokenBatch, constrain, z_loss_weight: float, head_grad: Float[Array, "d_model padded_vocab"]
) -> tuple[Float[Array, ""], LossSums, dict[str, Array], Float[Array, "d_model padded_vocab"]]:
    """(ce + z_loss_weight * z summed over the batch's targets, differentiable; the `LossSums`
    as metrics; the model's auxiliary terms; `head_grad` plus the batch's unscaled gradient of
    that sum with respect to the head): `model_loss_sums_and_aux` with the head's gradient
    formed in the same pass as its logits, outside autodiff (`loss.fused_head_loss`)."""
    hidden, aux = model.hidden_states_and_aux(
        batch.input_ids, batch.positions, segment_ids=batch.segment_ids, constrain=constrain
    )
    config = model.config
    weighted, sums, head_grad = fused_head_loss(
        hidden, model.lm_head, batch.input_ids, batch.loss_mask, head_grad, vocab_size=config.vocab_size,
        chunk_size=config.loss_chunk_size, z_loss_weight=z_loss_weight, logits_dtype=config.logits_dtype,
        constrain=constrain,
    )
    return weighted, sums, aux, head_grad


def make_train_step(
    optim_config: OptimConfig,
    schedule: Schedule,
    *,
    mesh: Optional[Mesh] = None,
    rules: ShardingRules = ShardingRules(),
    micro_batches: int = 1,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build `train_step(state, batch) -> (state, metrics)`; `state` is donated (don't reuse it).

    `train_step.step` is the same step unjitted, as `step(batch, state)`: what the memory
    planner lowers for abstract shapes. `train_step.lower(state, batch)` lowers the jitted step
    for those arguments (what `trainer.micro_batches=auto` compiles and measures). `train_step.once_per_step(grads, state)` is the part
    of it that runs once whatever the micro-batches (the weights' cast, the update), unjitted,
    for the planner's estimate to count apart.

    The schedule is an input of the compiled step, not constants in it: steps that differ only
    in their schedule (an LR sweep's jobs, a longer run, an anneal) compile once, and within a process
    `make_train_step` hands out the same compiled step for the same optimizer, mesh, rules and
    micro-batching.

    batch: a `TokenBatch` (or {"input_ids": int32 [B, L], "loss_mask": float32 [B, L]}), global arrays (ideally
    laid out with `batch_sharding(mesh)`). With `mesh`, the output state is pinned to the
    layout of `train_state_shardings(state, mesh, rules)`.

    metrics (float32 device scalars): loss (mean cross-entropy over target tokens), z_loss
    (its weighted z-loss term), grad_norm (before clipping), lr, tokens (target count),
    skipped (1.0 when the skip-step rule discarded the update). A model with auxiliary terms
    (`CausalLM.hidden_states_and_aux`: a MoE's router losses) adds its weighted term to the
    objective (its mean over micro-batches) and reports every term, averaged likewise.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")
    jitted, step, once_per_step = _compiled_train_step(optim_config.without_peak_lr(), mesh, rules, micro_batches)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        # filter_jit donates every argument but the first: the batch and the schedule go first,
        # so only the state is donated (callers may legitimately reuse a batch).
        return jitted((batch, schedule), state)

    train_step.step = lambda batch, state: step((batch, schedule), state)
    # Lowered for these very arguments (`.compile()` then reads XLA's memory analysis): the
    # program a later `train_step(state, batch)` of the same shapes and layouts runs, compiled once.
    train_step.lower = lambda state, batch: jitted.lower((batch, schedule), state)
    train_step.once_per_step = lambda grads, state: once_per_step(grads, state, schedule)
    return train_step


@functools.lru_cache(maxsize=16)
def _compiled_train_step(optim_config: OptimConfig, mesh: Optional[Mesh], rules: ShardingRules, micro_batches: int):
    """The jitted step `(batch, schedule), state -> (state, metrics)`, its unjitted body, and
    the body's once-per-step part (`once_per_step`, for the planner)."""
    optimizer = make_optimizer(optim_config)
    z_weight = float(optim_config.z_loss_weight)

    def step(inputs: tuple[Batch, Schedule], state: TrainState) -> tuple[TrainState, Metrics]:
        batch, schedule = inputs
        # Built when traced (once per program), not when memoized: every program this step
        # makes, the jitted one or the planner's own lowering of `step`, pins what the layout
        # rules say when it is traced.
        constrain = activation_sharding(mesh, rules)
        batch = _check_batch(batch)
        count = target_count(batch.loss_mask)
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        # Differentiated where the micro-batches read them: matmul weights in the compute dtype,
        # cast once per step (`compute_weights`); their gradients come back float32 below.
        weights = compute_weights(params, state.model)

        def micro_objective(params, batch: TokenBatch, head_grad):
            weighted, sums, aux, head_grad = training_loss(eqx.combine(params, static), batch, constrain, z_weight, head_grad)
            aux = {name: value / micro_batches for name, value in aux.items()}
            # The recipe's reduction: over the *global* batch's target count (loss.objective).
            return weighted / jnp.maximum(count, 1.0) + aux.get(AUX_OBJECTIVE, 0.0), (sums, aux, head_grad)

        grad_fn = jax.grad(micro_objective, has_aux=True)

        def to_f32(grads):
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            if mesh is None:
                return grads
            # Gradients laid out like their parameters: the batch reduction becomes a
            # reduce-scatter into the FSDP shards instead of a full all-reduce.
            shardings = model_shardings(state.model, mesh, rules)
            return jax.tree.map(jax.lax.with_sharding_constraint, grads, shardings)

        # The loss's head gradient, summed over every micro-batch's chunks in one float32
        # array and scaled once (`loss.fused_head_loss`); laid out like the head's gradient.
        head_zeros = jnp.zeros(params.lm_head.shape, jnp.float32)
        if mesh is not None:
            head_zeros = jax.lax.with_sharding_constraint(head_zeros, model_shardings(state.model, mesh, rules).lm_head)
        if micro_batches == 1:
            grads, (sums, aux, head_grad) = grad_fn(weights, batch, head_zeros)
            grads = to_f32(grads)
        else:

            def accumulate(carry, xs):
                grads, metrics, head_grad = carry
                g, (sums, aux, head_grad) = grad_fn(weights, xs, head_grad)
                grads, metrics = jax.tree.map(jnp.add, (grads, metrics), (to_f32(g), (sums, aux)))
                return (grads, metrics, head_grad), None

            xs = jax.tree.map(lambda x: _split_micro_batches(x, micro_batches, mesh, rules), batch)
            aux_shapes = jax.eval_shape(grad_fn, weights, jax.tree.map(lambda x: x[0], xs), head_zeros)[1][1]
            zeros = (
                to_f32(jax.tree.map(jnp.zeros_like, params)),
                (LossSums(*(jnp.zeros((), jnp.float32),) * 3), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes)),
                head_zeros,
            )
            (grads, (sums, aux), head_grad), _ = jax.lax.scan(accumulate, zeros, xs)
        # Autodiff gave the head only what reaches it outside the loss (nothing, for untied heads).
        # (times the cotangent autodiff gives `weighted` above: 1 / count)
        grads = eqx.tree_at(lambda g: g.lm_head, grads, grads.lm_head + head_grad * (1.0 / jnp.maximum(count, 1.0)))

        return finish(state, grads, sums, aux, count, schedule)

    def finish(state: TrainState, grads, sums: LossSums, aux: dict, count, schedule: Schedule) -> tuple[TrainState, Metrics]:
        """What a step does once, whatever its micro-batches: the norm, AdamW's update, the
        skip-step decision and the new state, from the float32 gradients of the whole batch."""
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
        # The update that takes the state to step s + 1 is update number s + 1: OLMo-core's
        # trainer counts steps from 1 and schedules by that count (train/schedules.py).
        lr = schedule(state.step + 1)
        new_params = apply_updates(params, updates, lr)

        loss = sums.ce / jnp.maximum(count, 1.0)
        skipped, statistics = skip_step(
            loss, grad_norm, state.loss_history, state.grad_norm_history, state.history_count, optim_config
        )
        keep = lambda old, new: jax.tree.map(lambda o, n: jnp.where(skipped, o, n), old, new)  # noqa: E731
        new_params = keep(params, new_params)
        new_opt_state = keep(state.opt_state, new_opt_state)

        new_state = TrainState(
            model=eqx.combine(new_params, static),
            opt_state=new_opt_state,
            step=state.step + 1,
            **statistics,
        )
        if mesh is not None:
            new_state = eqx.filter_shard(new_state, train_state_shardings(new_state, mesh, rules))
        metrics = {
            "loss": loss,
            "z_loss": z_weight * sums.z / jnp.maximum(count, 1.0),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": count,
            "skipped": skipped.astype(jnp.float32),
            **aux,
        }
        return new_state, metrics

    def once_per_step(grads, state: TrainState, schedule: Schedule):
        """The step's work that does not repeat per micro-batch (the weights' cast included),
        for the planner to count apart (`olmo_eqx.plan.estimate`): the scalars are zeros."""
        params, _ = eqx.partition(state.model, eqx.is_inexact_array)
        zero = jnp.zeros((), jnp.float32)
        return compute_weights(params, state.model), finish(state, grads, LossSums(zero, zero, zero), {}, zero, schedule)

    return eqx.filter_jit(step, donate="all-except-first"), step, once_per_step


@functools.lru_cache(maxsize=16)
def make_eval_step(mesh: Optional[Mesh] = None, rules: ShardingRules = ShardingRules()) -> Callable[[eqx.Module, Batch], LossSums]:
    """Build `eval_step(model, batch) -> LossSums` (ce sum, z sum, target count) for held-out loss.

    Sum the results over the held-out batches and divide ce by count for the mean loss. Like
    training, it never holds the whole logits, and with `mesh` pins activations by `rules`.
    The same mesh and rules get the same jitted step (traced once per model and batch shape).
    """
    constrain = activation_sharding(mesh, rules)

    @eqx.filter_jit
    def eval_step(model: eqx.Module, batch: Batch) -> LossSums:
        return model_loss_sums(model, _check_batch(batch), constrain)

    return eval_step


def evaluate(eval_step, model, sets: dict[str, list[TokenBatch]]) -> dict[str, tuple[float, float]]:
    """Per held-out set: (mean cross-entropy over its batches, number of target tokens), with
    `eval_step` from `make_eval_step`."""
    results = {}
    for name, batches in sets.items():
        ce = count = 0.0
        for batch in batches:
            sums = jax.device_get(eval_step(model, batch))
            ce, count = ce + float(sums.ce), count + float(sums.count)
        results[name] = (ce / max(count, 1.0), count)
    return results
