"""Searching layouts (remat policies, micro-batches, attention blocks) for the fastest that fits."""

import math
import time
from typing import Optional

from olmo_eqx.plan.compile import _with
from olmo_eqx.plan.estimate import add_estimate, step_seconds
from olmo_eqx.plan.planner import plan_config
from olmo_eqx.plan.report import format_row
from olmo_eqx.plan.targets import Target

def _layouts(config, target: Target, batch_shards: int):
    """The remat policies to try, most memory first, and the micro-batch counts (fewest first)."""
    policies = [dict(remat=p, remat_sliding=None) for p in ("save_projections", "save_attention", "save_outputs", "save_context", "full")]
    if target.platform in ("tpu", "gpu"):
        policies.insert(1, dict(remat="offload_projections", remat_sliding=None))  # host offload: accelerators only
    if config.model.sliding_window is not None:
        # Only the full-attention layers keep their context: at long sequences theirs is the
        # costly attention to run again (olmo3_600m at 2 x 32,768 on a v5e, where every layer's
        # does not fit).
        policies.insert(-1, dict(remat="save_context", remat_sliding="full"))
    per_device = config.data.global_batch_size // max(batch_shards, 1)
    micro = [m for m in (1, 2, 4, 8, 16) if per_device and per_device % m == 0] or [1]
    return policies, micro


def search(config, target: Target, devices, *, max_layouts: Optional[int] = None, estimate: bool = True, report=print) -> dict:
    """Try layouts for `target` and name the fastest that fits (by the estimates' step time).

    Per remat policy, the fewest micro-batches that fit, found by bisection (fitting needs
    fewer of them the more micro-batches there are): a layout the compiler refuses costs
    seconds, one that fits its compile; only the fewest that fit gets the estimate's
    compiles. Then, for the best, a larger and a smaller attention block.
    `max_layouts` bounds the layouts estimated (None: one per policy and the two blocks);
    refusals and probes are not counted.
    """
    if target.chip is None:
        raise SystemExit("+plan.search needs an accelerator target (+plan.target=tpu:... or gpu:...): a chip to fit and a peak")
    from olmo_eqx.sharding import MESH_AXES, ShardingRules

    sizes = dict(zip(MESH_AXES, config.mesh.shape(len(devices))))
    shards = math.prod(sizes[axis] for axis in ShardingRules().batch)  # slice x data x fsdp x expert: the batch shards
    rows, estimated = [], 0
    started = time.perf_counter()

    def show(row: dict) -> dict:
        rows.append(row)
        report(format_row(row, header=len(rows) == 1))
        return row

    def probe(changes: dict, micro: int) -> tuple[dict, object]:
        layout = _with(config, model=changes, micro_batches=micro)
        return plan_config(layout, target, devices, estimate=False), layout

    def estimated_row(row: dict, layout) -> dict:
        nonlocal estimated
        estimated += 1
        if estimate:
            add_estimate(row, layout, devices, target.per_device)
        return show(row)

    policies, counts = _layouts(config, target, shards)
    if max_layouts is None:
        max_layouts = len(policies) + 2
    for policy in policies:
        if estimated >= max_layouts:
            break
        lo, hi, fitting = 0, len(counts) - 1, None  # bisect for the fewest micro-batches that fit
        while lo <= hi:
            mid = (lo + hi) // 2
            row, layout = probe(policy, counts[mid])
            if row["fits"]:
                fitting, hi = (row, layout), mid - 1
            else:
                show(row)
                lo = mid + 1
        if fitting:
            estimated_row(*fitting)
    best = _best(rows)
    if best and config.data.sequence_length >= 1024:
        from olmo_eqx.models.attention import DEFAULT_BLOCK, SPLASH_BLOCK

        base = best["attention_block_size"] or (SPLASH_BLOCK if target.platform == "tpu" else DEFAULT_BLOCK)
        for block in (2 * base, base // 2):
            if estimated >= max_layouts or block < 128 or block > config.data.sequence_length:
                continue
            policy = {"remat": best["remat"], "remat_sliding": best.get("remat_sliding"), "attention_block_size": block}
            row, layout = probe(policy, best["micro_batches"])
            if row["fits"]:
                estimated_row(row, layout)
            else:
                show(row)
        best = _best(rows)
    return {"rows": rows, "best": best, "ranked": _ranked(rows), "search_seconds": time.perf_counter() - started}


def _ranked(rows: list[dict]) -> list[dict]:
    """The estimated layouts that fit, fastest first: the candidates to measure on a chip.

    The estimate missed eleven layouts measured on a v5e by -7% to +10% (docs/performance.md,
    "The estimate against the chip"), more than some of the gaps between layouts: a step
    measured with `scripts/measure_step.py` is what settles the top few."""
    return sorted((r for r in rows if step_seconds(r)), key=step_seconds)


def _best(rows: list[dict]) -> Optional[dict]:
    """The fastest layout that fits; near-ties go to the layout with fewer unknowns.

    Neither estimate sees host offload's transfers (over the host link, no published figure
    per chip) nor an opaque kernel's block size: offloading the projections ties with saving
    them in HBM, and splash's blocks all tie. Within 1% of the fastest, prefer no host memory,
    then less HBM, then the kernel's default block.
    """
    timed = [r for r in rows if step_seconds(r)]
    if not timed:
        return next((r for r in rows if r.get("fits")), None)
    fastest = min(step_seconds(r) for r in timed)
    close = [r for r in timed if step_seconds(r) <= 1.01 * fastest]
    used = lambda r, key: r.get("bytes", {}).get(key, 0)  # noqa: E731
    return min(close, key=lambda r: (used(r, "host"), used(r, "needed"), r["attention_block_size"] is not None))
