"""Estimating the step time and MFU of a plan that compiled: XLA's cost analysis of the model
with one and two layers (or attention cycles) unrolled, extrapolated, and a roofline of the chip's peaks."""

import time
from typing import Optional

from olmo_eqx.plan.compile import COUNTS_ONLY_EFFORT, CompileRefused, _with, compile_train_step, once_per_step_cost
from olmo_eqx.plan.targets import Chip


def _experts(config, mesh, batch_shards: int) -> Optional[dict]:
    """A mixture of experts' layout: experts per device, and the all-to-all slots of expert
    parallelism (olmoe.py: each device gives each peer T * min(k, E/P) rows per layer, T its
    tokens of one micro-batch), or None for a dense model."""
    model, data = config.model, config.data
    if model.n_experts is None:
        return None
    ep = mesh.shape.get("expert", 1)
    per_device = model.n_experts // ep if model.n_experts % ep == 0 else model.n_experts
    tokens = data.global_batch_size * data.sequence_length // (batch_shards * mesh.shape["context"] * config.trainer.micro_batches)
    slots = tokens * min(model.n_experts_per_token, per_device) if ep > 1 else 0
    return {
        "n_experts": model.n_experts,
        "active": model.n_experts_per_token,
        "expert_parallel": ep,
        "experts_per_device": per_device,
        "tokens_per_device_per_micro_batch": tokens,
        "all_to_all_slots_per_peer": slots,
    }


# ---------------------------------------------------------------------------------------------
# Estimating the step time


def _attention_recomputed(remat: str) -> bool:
    """Whether a remat policy runs attention's forward again in the backward pass."""
    kept = ("none", "save_projections", "save_attention", "save_context", "save_outputs", "offload_projections", "offload_context")
    return remat not in kept


def kernel_mxu_fill(model, chip: Chip) -> float:
    """The share of a TPU's matrix units an attention kernel's matmuls can fill: both of them
    (q k^T over head_dim, p v into head_dim) hold head_dim on one side of the MXU's square
    array, so a narrower head leaves the rest idle. On a v5e (128 x 128) splash's traced time
    matched it: head_dim 80 ran at 62% of the peak (0.625 filled), 64 at 48% (0.5;
    docs/performance.md). 1 where the chip's array is not known (GPUs, TPU7x)."""
    width = chip.mxu_width
    return min(1.0, model.head_dim / width) if width else 1.0


def estimate_step(
    config, devices, chip: Chip, collective_bytes: float, kernel: str, loop_free_cost: Optional[dict] = None
) -> dict:
    """Step FLOPs, HBM bytes and time per device, reconciled for the loops XLA counts once.

    XLA's cost analysis counts a while loop's body once, whatever its trip count: the layer
    scan, the loss chunks and the micro-batch loop. Two more compiles give what it cannot:
    the model with one repeating unit and with two, unrolled, on one micro-batch, with the
    loss's chunks unrolled too (`unrolled_loss_chunks`: no loop is left but attention's own).
    Their difference is one unit; the step is micro_batches x (one-unit program + (units - 1)
    x unit). Both are compiled for XLA's counts only (`COUNTS_ONLY_EFFORT`): a few seconds
    each where the compiler's default effort takes a minute, with the same FLOPs. (The loss
    in one chunk instead, as before, held a micro-batch's whole float32 logits: 13 GB for
    the 190m's 8 x 4096 tokens, which XLA:TPU refused on a v5e, and which it priced as
    rematerialised where the chunked step is not.)

    The unit is one layer when attention runs in a kernel XLA cannot see into (splash, cuDNN):
    a sliding-window layer then differs from a full one only inside the kernel, whose FLOPs
    are added from the formula, so to XLA every layer is alike. Otherwise it is one attention
    cycle (OLMo 3: 3 sliding + 1 full; OLMo-Hybrid: its layer pattern). One and two layers
    compile in about a quarter of the time of one and two 4-layer cycles.

    What a step does once (the weights' cast, the norm, AdamW's update) each of those programs
    holds too, so the extrapolation counts it once per micro-batch: one more compile of that
    part alone (`once_per_step_cost`, elementwise, seconds) takes the extra copies off. What
    only the micro-batch loop does, adding each micro-batch's gradients into the float32 sum,
    none of them holds: it is counted as its bytes (the sum read and written per micro-batch)
    at the chip's HBM bandwidth.

    An opaque attention kernel's FLOPs come from the formula; on a TPU they run at the share
    of the MXU a head fills (`kernel_mxu_fill`: head_dim 64 on v5e's 128 x 128 arrays, half).

    `loop_free_cost`: the cost analysis of the plan's own program when it holds no while loop
    (one micro-batch, layers unrolled, the loss in one chunk: XLA counted everything once, as
    it runs), which is then the step's, and no more compiles are needed.
    """
    from olmo_eqx.models.flops import attention_context_flops, attention_layers

    model, data = config.model, config.data
    counted_on = None  # how the counts were taken, where not the usual way
    if loop_free_cost is not None:  # XLA counted the whole program as it runs: it is the step
        name, totals = "step", loop_free_cost
        said = {"the program": loop_free_cost.get("optimal_seconds")}
    else:
        micro = config.trainer.micro_batches
        if kernel in ("splash", "cudnn") and model.architecture != "olmo_hybrid":
            # Every layer alike to XLA: plain full-attention layers stand in for each, under
            # `remat` (a sliding layer's own `remat_sliding` is counted in its kernel's FLOPs
            # below; outside the kernel, save_context and full recompute the same XLA ops).
            name, unit_layers, units, unit = "layer", 1, model.n_layers, dict(sliding_window=None, remat_sliding=None)
        else:
            name, unit_layers, units, unit = "cycle", model.cycle_length, model.n_layers // model.cycle_length, {}
        from olmo_eqx.train.loss import unrolled_loss_chunks

        one, two, parts, counted_on = _unit_costs(config, devices, micro, unit, unit_layers)
        totals = {key: parts * (one[key] + (units - 1) * (two[key] - one[key])) for key in one.keys() & two.keys()}
        said = {f"one {name}": one.get("optimal_seconds"), f"two {name}s": two.get("optimal_seconds")}
        if parts > 1:
            once = once_per_step_cost(config, devices)
            for key in totals.keys() & once.keys():
                totals[key] -= (parts - 1) * once[key]
            summed = 2 * once["gradient bytes"] * micro  # the float32 sum, read and written
            totals["bytes accessed"] = totals.get("bytes accessed", 0.0) + summed
            if totals.get("optimal_seconds", 0.0) > 0:
                totals["optimal_seconds"] += summed / chip.hbm_bandwidth
            said["once per step"] = once.get("optimal_seconds")

    flops, hbm_bytes, xla_seconds = (totals.get(key) for key in ("flops", "bytes accessed", "optimal_seconds"))
    # A Pallas or cuDNN attention kernel is opaque to XLA's cost analysis: add its FLOPs
    # (forward 4 of the formula's 12 per context token, again when remat recomputes it).
    kernel_flops = 0.0
    if kernel in ("splash", "cudnn"):
        from olmo_eqx.models.attention import SPLASH_BLOCK
        from olmo_eqx.models.splash import fused_backward, head_groups

        tokens = data.global_batch_size * data.sequence_length / len(devices)
        block, seq = model.attention_block_size or SPLASH_BLOCK, data.sequence_length
        for context, window in attention_layers(model, seq):  # each layer its own policy (remat_sliding)
            recomputed = _attention_recomputed(model.remat_of(sliding=window is not None))
            layer = tokens * attention_context_flops(model, context) * (16 / 12 if recomputed else 1.0)
            # The formula's count stands for the fused backward, where the kernel's MXU share
            # was checked on the chip: 5 matmuls (q k^T again, p^T dO, dO v^T, dk, dq). The
            # separate dq kernel (long sequences; at those, sliding-window layers) computes
            # q k^T and dO v^T once more: 7.
            forward = 2 * (2 if recomputed else 1)  # q k^T and p v, once or twice
            shape = dict(head_dim=model.head_dim, sliding_window=window)
            groups = head_groups(seq, block, model.n_heads, model.n_kv_heads, **shape)
            if kernel == "splash" and not fused_backward(seq, block, heads=model.n_heads // groups, **shape):
                layer *= 1 + 2 / (forward + 5)
            kernel_flops += layer
    kernel_s = kernel_flops / (chip.peak_bf16_flops * kernel_mxu_fill(model, chip))
    compute_s = (flops or 0.0) / chip.peak_bf16_flops + kernel_s
    flops = (flops or 0.0) + kernel_flops
    memory_s = (hbm_bytes or 0.0) / chip.hbm_bandwidth
    network_s = collective_bytes / chip.ici_bandwidth
    roofline = max(compute_s, memory_s, network_s)
    bound = ("compute", "HBM", "interconnect")[[compute_s, memory_s, network_s].index(roofline)]
    return {
        "flops": flops,
        "kernel_flops": kernel_flops,
        "hbm_bytes": hbm_bytes,
        "roofline_seconds": roofline,
        "roofline_bound": bound,
        "roofline_terms": {"compute": compute_s, "hbm": memory_s, "interconnect": network_s},
        # XLA's own cost model, plus the kernel's time (it does not see it either).
        # (XLA:GPU has no time model: the CPU client's analysis gives none worth the name.)
        "xla_seconds": None if not xla_seconds or xla_seconds < 0 else xla_seconds + kernel_s,
        "kernel_seconds": kernel_s,
        # What the compiler said, kept when it is unusable: at its default effort XLA:TPU has
        # answered a negative `optimal_seconds` (the 7B on 512 v5p chips: -1.77 s and -1.61 s).
        "xla_optimal_seconds": said,
        "estimate_unit": name,
        "counted_on": counted_on,
    }


def _unit_costs(config, devices, micro: int, unit: dict, unit_layers: int) -> tuple[dict, dict, int, Optional[str]]:
    """XLA's cost analysis of the one- and two-unit programs, how many of their batches make
    the step, and how they were counted where not the usual way: first on one micro-batch.
    At long sequences the compiler can refuse those counts-only programs for memory (their
    loss chunks unrolled: 29.8 GiB for the 190m's 2 x 32,768 tokens on a v5e, whose step
    needs 9.0): they are then compiled on half the
    micro-batch, a quarter, ..., while each device keeps a sequence: every count but the
    once-per-step part (taken off by the caller) is linear in a program's sequences. Where one
    sequence is refused too, the loss chunks are counted in their loop (`_loss_loop_counted`)."""
    from olmo_eqx.plan.compile import _batch_shards
    from olmo_eqx.sharding import ShardingRules, make_mesh
    from olmo_eqx.train.loss import unrolled_loss_chunks

    def one_and_two(small) -> tuple[dict, dict]:
        with unrolled_loss_chunks():
            return tuple(
                compile_train_step(_with(small, model=dict(unit, scan_layers=False, n_layers=n * unit_layers)),
                                   devices, effort=COUNTS_ONLY_EFFORT).cost
                for n in (1, 2)
            )

    global_batch, parts = config.data.global_batch_size, micro
    while True:
        small = _with(config, micro_batches=1, global_batch=global_batch // parts)
        split = None if parts == micro else f"each micro-batch in {parts // micro} parts (a whole one was refused)"
        try:
            return (*one_and_two(small), parts, split)
        except CompileRefused:
            smaller = global_batch // (2 * parts)
            if global_batch % (2 * parts) or not smaller or smaller % _batch_shards(make_mesh(config.mesh, devices),
                                                                                    ShardingRules()):
                looped = "the loss chunks in their loop (one sequence with them unrolled was refused)"
                return (*_loss_loop_counted(small, devices, unit, unit_layers), parts,
                        "; ".join(filter(None, [split, looped])))
        parts *= 2


def _loss_loop_counted(small, devices, unit: dict, unit_layers: int) -> tuple[dict, dict]:
    """The one- and two-unit programs' counts with the loss chunks left in their loop, which
    XLA counts once: a third compile with chunks twice as long gives one chunk's cost (the
    difference: a chunk's work is linear in its length), added for the other n - 1 chunks.
    The last resort where even one sequence with its chunks unrolled is refused (the 600m at
    32,768 tokens on a v5e: 20.6 GiB); `CompileRefused` if the looped programs are too."""
    chunk = small.model.loss_chunk_size
    chunks = -(-(small.data.sequence_length - 1) // chunk)
    if chunks < 2:
        raise CompileRefused("the loss is one chunk: nothing to count in a loop")

    def cost(n: int, chunk_size: int) -> dict:
        model = dict(unit, scan_layers=False, n_layers=n * unit_layers, loss_chunk_size=chunk_size)
        return compile_train_step(_with(small, model=model), devices, effort=COUNTS_ONLY_EFFORT).cost

    one, longer, two = cost(1, chunk), cost(1, 2 * chunk), cost(2, chunk)
    keys = one.keys() & longer.keys() & two.keys()
    others = {key: (chunks - 1) * (longer[key] - one[key]) for key in keys}
    return {key: one[key] + others[key] for key in keys}, {key: two[key] + others[key] for key in keys}


def step_seconds(row: dict) -> Optional[float]:
    """A plan's estimated step time, as the search ranks it: XLA's cost model where it answered,
    else the roofline; None for a plan that does not fit or has no estimate."""
    est = row.get("estimate")
    if not row.get("fits") or not est:
        return None
    return est["xla_seconds"] or est["roofline_seconds"]


def add_estimate(result: dict, config, devices, chip: Chip) -> dict:
    """Add the step-time and MFU estimates (`estimate_step`) to a plan that compiled."""
    started = time.perf_counter()
    collective_bytes = float(sum(t["bytes"] for t in result["collectives"].values()))
    try:
        result["estimate"] = est = estimate_step(
            config, devices, chip, collective_bytes, result["attention_kernel"], result.get("xla_cost_loop_free")
        )
    except CompileRefused as refusal:
        # The layout fits, but a one- or two-unit program of one micro-batch at the lowest
        # effort did not (XLA:TPU plans it with less care): no estimate rather than no search.
        result["estimate"] = None
        result["warnings"].append(f"no step-time estimate: the compiler refused its counts-only program ({refusal})")
        result["estimate_seconds"] = time.perf_counter() - started
        return result
    for name in ("xla_seconds", "roofline_seconds"):
        seconds = est[name]
        est[name.replace("seconds", "mfu")] = (
            result["model_flops_per_device"] / (seconds * chip.peak_bf16_flops) if seconds else None
        )
    est["reconciled_over_model_flops"] = est["flops"] / result["model_flops_per_device"]
    result["estimate_seconds"] = time.perf_counter() - started
    return result
