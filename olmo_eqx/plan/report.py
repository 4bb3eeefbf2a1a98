"""Printing a plan, a search's rows and an estimate."""

import math

from olmo_eqx.plan.estimate import step_seconds
from olmo_eqx.plan.planner import ACCELERATORS, GIB
from olmo_eqx.train.memory import size


def seconds(value: float) -> str:
    """A duration in plain notation: three decimals, more below 0.1 s to keep three significant
    figures (a tiny model's step, microseconds on a TPU, read `0.000 s` at three decimals)."""
    if not value or not math.isfinite(value) or abs(value) >= 0.1:
        return f"{value:.3f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"

# Published MFU figures (MaxText's OLMo 3 reproduction), shown beside the estimates of a plan of
# the same model only: (model name, figure).
PUBLISHED_MFU: tuple[tuple[str, str], ...] = (
    ("olmo3_7b", "MaxText's OLMo 3 7B reproduction 57.4% on v5p (stage 2), 44-50% on TPU7x (stage 1)"),
)



def _gib(n: float) -> str:
    return f"{n / GIB:9.2f} GiB"


def remat_label(row: dict) -> str:
    """A layout's remat, with the sliding-window layers' own policy where it has one."""
    return row["remat"] + (f", sliding {row['remat_sliding']}" if row.get("remat_sliding") else "")


def format_row(row: dict, header: bool = False) -> str:
    """One line per layout of a search."""
    lines = []
    if header:
        lines.append(
            f"{'remat':<26} {'micro':>5} {'block':>5} {'GiB/dev':>8} {'fits':>4} {'compile':>8} "
            f"{'step (XLA)':>10} {'MFU':>6} {'step (roofline)':>15} {'MFU':>6}"
        )
    est = row.get("estimate") or {}
    used = row["bytes"]["needed"] / GIB if "bytes" in row else float("nan")
    step = lambda key: f"{seconds(est[key]):>9}s" if est.get(key) else "        -"  # noqa: E731
    mfu = lambda key: f"{100 * est[key]:5.1f}%" if est.get(key) else "     -"  # noqa: E731
    lines.append(
        f"{remat_label(row):<26} {row['micro_batches']:>5} {row['attention_block_size'] or 'auto':>5} {used:8.2f} "
        f"{'yes' if row['fits'] else 'NO':>4} {row['compile_seconds']:7.0f}s {step('xla_seconds'):>10} {mfu('xla_mfu')} "
        f"{step('roofline_seconds'):>15} {mfu('roofline_mfu')}"
        + (f"   +{row['bytes']['host'] / GIB:.2f} GiB host (transfers not estimated)" if row.get("bytes", {}).get("host") else "")
        + (f"   refused: {row['refused'][:160]}" if row.get("refused") else "")
    )
    return "\n".join(lines)


def format_ranked(ranked: list[dict], top: int = 3) -> str:
    """The search's fastest layouts by the estimate, to measure on a chip before choosing."""
    lines = [
        f"\nthe {min(top, len(ranked))} fastest by the estimate, to measure on the chip before choosing "
        "(`scripts/measure_step.py` with the same overrides): on a v5e the estimate missed single layouts by -7% "
        "to +10%, more than some gaps between them (docs/performance.md)"
    ]
    for i, row in enumerate(ranked[:top], 1):
        lines.append(
            f"  {i}. model.remat={row['remat']}"
            + (f" model.remat_sliding={row['remat_sliding']}" if row.get("remat_sliding") else "")
            + f" trainer.micro_batches={row['micro_batches']}"
            + (f" model.attention_block_size={row['attention_block_size']}" if row["attention_block_size"] else "")
            + f"   {seconds(step_seconds(row))} s ({'XLA' if row['estimate']['xla_seconds'] else 'roofline'})"
        )
    return "\n".join(lines)


def format_plan(p: dict) -> str:
    lines = [
        f"{p['model']} ({p['parameters']:,} parameters) on {p['target_description']}: {p['devices']} devices"
        + (f", mesh {p['mesh']}" if "mesh" in p else ""),
        f"batch {p['global_batch']} x {p['sequence_length']} ("
        + (f"{p['per_device_batch']:g} per device, " if "per_device_batch" in p else "")
        + f"{p['micro_batches']} micro-batch(es)) | compute {p['compute_dtype']}, params {p['param_dtype']} "
        f"| remat {remat_label(p)} | attention {p['attention_impl']} -> {p['attention_kernel']} kernel"
        + (f" (block {p['attention_block_size']})" if p["attention_block_size"] else "")
        + f" | loss chunk {p['loss_chunk_size']}",
        f"{'refused' if p.get('refused') else 'compiled'} in {p['compile_seconds']:.0f} s",
        "",
    ]
    if tried := p.get("micro_batches_auto"):
        said = ", ".join(f"{a['micro_batches']} " + ("fits" if a["fits"] else "refused" if a["needed"] is None else "does not fit")
                         + (f" ({size(a['needed'])})" if a["needed"] is not None else "")
                         for a in sorted(tried, key=lambda a: a["micro_batches"]))
        lines.insert(-1, f"trainer.micro_batches=auto: {p['micro_batches']} ({said})")
    elif p.get("micro_batches_note"):
        lines.insert(-1, p["micro_batches_note"])
    hbm = p.get("hbm_per_device")
    if p.get("refused"):
        lines.append(f"does NOT fit: the compiler refused it: {p['refused']}")
        return "\n".join(lines)
    b = p["bytes"]
    lines += [
        "per device:",
        f"  parameters        {_gib(b['parameters'])}",
        f"  optimiser state   {_gib(b['optimizer_state'])}",
        f"  other state       {_gib(b['other_state'])}",
        f"  arguments         {_gib(b['arguments'])}   (state + batch)",
        f"  temporaries       {_gib(b['temporaries'])}   (activations, gathered weights, gradients)",
        f"  outputs - aliased {_gib(b['outputs'] - b['aliased'])}   (the donated state is updated in place)",
        f"  total             {_gib(b['total'])}   (arguments + outputs - aliased + temporaries)",
    ]
    if hbm:
        counted = "temporaries, as XLA:TPU counts against HBM" if p["target"].startswith("tpu") else "total"
        lines.append(f"  needed            {_gib(b['needed'])}   ({counted}) of {_gib(hbm).strip()} HBM: "
                     + ("fits" if p["fits"] else "does NOT fit"))
    if b.get("host"):
        lines.append(f"  host memory       {_gib(b['host'])}   (offloaded activations)")
    if not hbm:
        lines.append("  fits (XLA:CPU's figure): " + ", ".join(
            f"{name} ({g} GiB) {'yes' if p['fits_accelerators'][name] else 'NO'}" for name, g in ACCELERATORS
        ))
    if e := p.get("experts"):
        lines += ["", f"experts: {e['n_experts']} per layer ({e['active']} active per token), {e['experts_per_device']} per device "
                  f"(expert parallelism {e['expert_parallel']})"
                  + (f"; all-to-all slots per peer per layer {e['all_to_all_slots_per_peer']:,} "
                     f"({e['tokens_per_device_per_micro_batch']:,} tokens x min(k, experts per device): dropless worst case)"
                     if e["expert_parallel"] > 1 else "")]
    lines += ["", "collectives per step (per device; bytes of the full tensors)"
              + (" (lower bound: a loop's trip count is unknown)" if p["collectives_lower_bound"] else "") + ":"]
    for kind, t in p["collectives"].items():
        if t["count"]:
            lines.append(f"  {kind:<18} {t['count']:>6} ops  {t['bytes'] / GIB:10.2f} GiB")
    if x := p.get("cross_slice"):
        lines += ["", format_cross_slice(x, p["mesh"]["slice"])]
        if p["micro_batches"] > 1:
            lines.append(f"  with {p['micro_batches']} micro-batches the gradients are reduced across slices once per "
                         "micro-batch (the accumulator is laid out like the parameters): that many times the traffic")
    lines.append(f"model FLOPs per device per step: {p['model_flops_per_device']:.3e}")
    lines += [f"warning: {w}" for w in p["warnings"]] or ["the batch is split over every device; no batch-sized all-gathers"]
    if p.get("estimate"):
        lines += ["", format_estimate(p)]
    return "\n".join(lines)


def format_cross_slice(x: dict, slices: int) -> str:
    """The cross-slice (DCN) traffic of a multi-slice plan, and what it is."""
    kinds = ", ".join(f"{k['count']} {kind}" for kind, k in x["by_kind"].items()) or "none"
    lines = [f"cross-slice collectives per step ({slices} slices; per device, bytes of the full tensors): "
             f"{x['bytes'] / GIB:.3f} GiB in {kinds} ({'/'.join(x['dtypes']) or '-'})"]
    if x["count"]:
        kinds_only_reductions = set(x["by_kind"]) <= {"all-reduce", "reduce-scatter"}
        lines.append(
            f"  {x['tensor_elements']:,} tensor elements and {x['scalars']} scalar(s) reduced across slices; the model has "
            f"{x['parameters']:,} parameters, {x['parameters_per_device']:,} per device inside a slice"
        )
        lines.append("  " + ("only reductions cross slices: the gradients' (and the loss's sums)" if kinds_only_reductions
                             else "WARNING: more than reductions cross slices (a weight or activation collective over DCN)"))
        if bandwidth := x.get("dcn_bandwidth"):
            # A ring all-reduce over n slices sends 2 (n - 1) / n of the tensor from each device.
            sent = x["bytes"] * 2 * (slices - 1) / slices
            lines.append(f"  at the chip's published DCN bandwidth ({8 * bandwidth / 1e9:g} Gb/s): {seconds(sent / bandwidth)} s "
                         f"per step if none of it overlaps with compute (a ring all-reduce over {slices} slices sends "
                         f"{2 * (slices - 1) / slices:g} x the tensors from each device)")
    return "\n".join(lines)


def format_estimate(p: dict) -> str:
    est = p["estimate"]
    terms = est["roofline_terms"]
    lines = [
        "ESTIMATES (from the compiled program and the chip's published peaks; not measurements):",
        f"  step FLOPs per device {est['flops']:.3e} = {est['reconciled_over_model_flops']:.2f} x model FLOPs "
        f"(remat recomputation; loops counted, {est['kernel_flops']:.2e} of it attention kernel FLOPs from the formula)",
        f"  HBM bytes per device  {est['hbm_bytes'] or 0:.3e}",
        f"  roofline: compute {seconds(terms['compute'])} s, HBM {seconds(terms['hbm'])} s, interconnect {seconds(terms['interconnect'])} s"
        f" -> {seconds(est['roofline_seconds'])} s per step ({est['roofline_bound']}-bound), MFU {100 * est['roofline_mfu']:.1f}%",
    ]
    if est["xla_seconds"]:
        kernel = f" (of it the attention kernel {seconds(est['kernel_seconds'])} s)" if est.get("kernel_seconds") else ""
        lines.append(f"  XLA's cost model: {seconds(est['xla_seconds'])} s per step{kernel}, MFU {100 * est['xla_mfu']:.1f}%")
    else:
        raw = est.get("xla_optimal_seconds") or {}
        said = ", ".join(f"{k} {seconds(v)} s" for k, v in raw.items() if v is not None) or "nothing"
        lines.append(f"  XLA's cost model: no usable step time (its optimal_seconds: {said}); the roofline stands alone")
    if est.get("counted_on"):
        lines.append(f"  (XLA's counts taken on {est['counted_on']})")
    lines += [f"  (published: {figure})" for model, figure in PUBLISHED_MFU if model == p["model"]]
    return "\n".join(lines)
