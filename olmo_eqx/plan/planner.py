"""The plan of one config: compile its train step for a target and read its figures."""

import math
import re
import time
from typing import Optional

from olmo_eqx.plan.compile import (
    CompileRefused, _batch_shards, _per_device_bytes, _with, compile_train_step, memory_bytes, target_devices,
)
from olmo_eqx.plan.estimate import _experts, add_estimate
from olmo_eqx.plan.hlo import _BYTES, collective_traffic, cross_slice_collectives, cross_slice_summary
from olmo_eqx.plan.targets import Target, parse_target
from olmo_eqx.train.memory import Budget

GIB = 1024**3
_WHILE = re.compile(r"\bwhile\(")
# What fits where, for XLA:CPU plans (an accelerator target compares with its own chip).
ACCELERATORS = (("TPU v6e", 32), ("H100", 80), ("TPU v5p", 95), ("H200", 141))


def target_budget(target: Target) -> Optional[Budget]:
    """What one of `target`'s devices holds, for trainer.micro_batches=auto (None for a cpu
    target: the host's memory, as a run there would see it)."""
    chip = target.per_device
    return Budget(int(chip.hbm_bytes), f"the HBM of a {target.spec} device") if chip else None


def plan_config(config, target: Target, devices, *, estimate: bool, hlo_path: str = "") -> dict:
    """Compile `config`'s train step for `target` and return its figures (see the module doc)."""
    import jax.numpy as jnp

    from olmo_eqx.models.flops import flops_per_token
    from olmo_eqx.models.attention import resolve_implementation
    from olmo_eqx.models.registry import count_params
    from olmo_eqx.train.state import TrainState

    model, data = config.model, config.data
    chip = target.per_device
    auto_note = None
    if config.trainer.micro_batches == "auto" and chip is None and config.trainer.device_memory_gib is None:
        # Fake CPU devices stand for some accelerator: the host's memory says nothing of it.
        config = _with(config, micro_batches=1)
        auto_note = ("trainer.micro_batches=auto planned with 1 micro-batch: a cpu target has no device memory to fit "
                     "(set trainer.device_memory_gib, or plan for a tpu:/gpu: target)")
    kernel = resolve_implementation(model.attention_impl, jnp.dtype(model.compute_dtype), target.platform)
    tokens = data.global_batch_size * data.sequence_length
    result = {
        "target": target.spec,
        "target_description": target.describe(),
        "model": model.name,
        "parameters": count_params(model),
        "devices": len(devices),
        "global_batch": data.global_batch_size,
        "sequence_length": data.sequence_length,
        "micro_batches": config.trainer.micro_batches,
        "compute_dtype": model.compute_dtype,
        "param_dtype": model.param_dtype,
        "remat": model.remat,
        "remat_sliding": model.remat_sliding,
        "attention_impl": model.attention_impl,
        "attention_kernel": kernel,
        "attention_block_size": model.attention_block_size,
        "loss_chunk_size": model.loss_chunk_size,
        "hbm_per_device": chip.hbm_bytes if chip else None,
        "model_flops_per_device": flops_per_token(model, data.sequence_length) * tokens / len(devices),
        "warnings": [],
    }
    if auto_note:
        result["micro_batches_note"] = auto_note
    started = time.perf_counter()
    try:
        step = compile_train_step(config, devices, budget=target_budget(target))
    except CompileRefused as refusal:
        result.update(fits=False, refused=str(refusal), compile_seconds=time.perf_counter() - started)
        return result
    result["compile_seconds"] = time.perf_counter() - started
    if step.attempts:  # trainer.micro_batches=auto: the count chosen, and what each tried needed
        config = step.config
        result["micro_batches"] = config.trainer.micro_batches
        result["micro_batches_auto"] = [
            {"micro_batches": a.micro_batches, "fits": a.fits, "needed": a.needed, "refused": a.refused} for a in step.attempts
        ]
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(step.hlo)
    mesh, rules, state = step.mesh, step.rules, step.state
    assert isinstance(state, TrainState)
    params, optimizer = _per_device_bytes(state.model), _per_device_bytes(state.opt_state)
    memory = memory_bytes(step.memory)
    # What the target's compiler holds against the chip's HBM. XLA:TPU compares its temporaries
    # alone ("the total memory required for HLO temporaries (X) exceeds available HBM") and
    # refuses above; a v5e chip ran programs whose arguments + temporaries exceeded its HBM
    # (18.0 GiB on 15.75: docs/planning.md, "Checked on a chip"), so for TPU that sum overstates
    # the need. Elsewhere arguments + outputs + temporaries is the bound.
    memory["needed"] = memory["temporaries"] if target.platform == "tpu" else memory["total"]
    needed = memory["needed"]
    traffic, gathered, unknown_trip = collective_traffic(step.hlo)
    batch_shards = _batch_shards(mesh, rules)
    result.update(
        mesh=dict(mesh.shape),
        per_device_batch=data.global_batch_size / batch_shards,
        bytes={
            "parameters": params,
            "optimizer_state": optimizer,
            "other_state": _per_device_bytes(state) - params - optimizer,
            **memory,
        },
        collectives=traffic,
        collectives_lower_bound=unknown_trip,
        experts=_experts(config, mesh, batch_shards),
        xla_flops_per_device_loops_once=step.cost.get("flops"),
        # With no while loop left (one micro-batch, layers unrolled, the loss in one chunk)
        # XLA's count is the step's own: the estimate needs no more compiles.
        xla_cost_loop_free=None if _WHILE.search(step.hlo) else step.cost,
    )
    if mesh.shape["slice"] > 1:
        result["cross_slice"] = cross_slice_traffic(step.hlo, mesh, state)
        if chip and chip.dcn_bandwidth:
            result["cross_slice"]["dcn_bandwidth"] = chip.dcn_bandwidth
    # An accelerator's compiler refuses what does not fit (XLA:TPU) or only logs it (XLA:GPU):
    # compare with the chip either way; XLA:CPU's figures are compared with the usual chips.
    if chip:
        result["fits"] = needed <= chip.hbm_bytes
    else:
        result["fits_accelerators"] = {name: needed <= gib * GIB for name, gib in ACCELERATORS}
    warnings = result["warnings"]
    if data.global_batch_size % batch_shards:
        warnings.append(
            f"the global batch {data.global_batch_size} is not divisible by the {batch_shards} batch shards "
            f"({' x '.join(rules.batch)}): every device computes the whole batch; choose a multiple of {batch_shards}"
        )
    elif batch_shards < len(devices):
        warnings.append(
            f"each sequence is computed on {len(devices) // batch_shards} devices (the batch is split {batch_shards} ways "
            "over data x fsdp; context splits each sequence, tensor its heads and MLP)"
        )
    # Float tensors only: the embedding lookup all-gathers the int32 token ids (4 bytes a
    # token) so each device can gather its slice of d_model for them, which is cheap.
    shape = (data.global_batch_size, data.sequence_length)
    batch_gathers = [g for g in gathered if g[0] in ("bf16", "f16", "f32") and g[1][:2] == shape]
    result["batch_sized_all_gathers"] = len(batch_gathers)
    if batch_gathers:
        dtype, dims, op = batch_gathers[0]
        warnings.append(
            f"{len(batch_gathers)} all-gather(s) of batch-sized float tensors, e.g. {dtype}{list(dims)} "
            f"({math.prod(dims) * _BYTES[dtype] / GIB:.2f} GiB) from `{op}`: "
            "every device holds that tensor for the whole global batch"
        )
    if estimate and chip:
        add_estimate(result, config, devices, chip)
    return result


def cross_slice_traffic(hlo: str, mesh, state) -> dict:
    """What a multi-slice step sends between slices (over DCN), per device per step: the
    collectives whose device groups span slices, summed (`plan.hlo.cross_slice_collectives`),
    beside the model's parameters, whole and as one device's share inside a slice (the
    gradients' reduction across slices moves one of the two per parameter)."""
    import jax

    from olmo_eqx.sharding import slice_of_devices

    crossing = cross_slice_collectives(hlo, slice_of_devices(mesh))
    summary = cross_slice_summary(crossing)
    params = [leaf for leaf in jax.tree.leaves(state.model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
              if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None]
    summary["tensor_elements"] = sum(c["runs"] * math.prod(dims) for c in crossing for _, dims in c["tensors"] if dims)
    summary["parameters"] = sum(math.prod(p.shape) for p in params)
    summary["parameters_per_device"] = sum(math.prod(p.sharding.shard_shape(p.shape)) for p in params)
    summary["collectives"] = [
        {**c, "tensors": [[dtype, list(dims)] for dtype, dims in c["tensors"]]} for c in crossing
    ]
    return summary


def plan(overrides: list[str], target: Target | str | int = "cpu:8", *, estimate: Optional[bool] = None) -> dict:
    """Compile the run's train step for `target` (see `olmo_eqx.plan.targets`; an int N is `cpu:N`)."""
    from olmo_eqx.config import compose_config

    target = parse_target(f"cpu:{target}" if isinstance(target, int) else target) if not isinstance(target, Target) else target
    config = compose_config(overrides)
    devices = target_devices(target)
    return plan_config(config, target, devices, estimate=target.platform != "cpu" if estimate is None else estimate)
