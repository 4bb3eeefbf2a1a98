"""The pictures a run leaves: `loss.png` and `goodput.png` of a training stage and `sweep.png` of a sweep.

All read plain records (those of metrics.jsonl, summary.json), so they can be redrawn from a
finished run dir: `python -c "from olmo_eqx.run.plots import *; loss_plot(read_metrics('RUN/metrics.jsonl'), 'RUN/loss.png')"`.
"""

import math
import warnings
from pathlib import Path
from typing import Optional

from olmo_eqx.run.sinks import read_jsonl


def _figure(**kwargs):
    """A figure drawn by Agg straight to a file: no pyplot, so no display backend, no global
    figure registry to close, and 0.26 s less import at the end of every run."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return Path(path)


def _train_records(records: list[dict]) -> list[dict]:
    return sorted((r for r in records if "loss" in r), key=lambda r: r["step"])


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl in order, a step's later train record replacing the earlier
    one (after a hard kill the steps since the last checkpoint were written twice). A malformed
    line is skipped with a warning (`read_jsonl`)."""
    records: list[dict] = []
    seen: dict[tuple, int] = {}
    for record in read_jsonl(path):
        if not isinstance(record.get("step"), int):
            warnings.warn(f"{path}: skipped a record without an integer step: {str(record)[:80]}", stacklevel=2)
            continue
        key = (record.get("step"), tuple(sorted(k for k in record if k != "step")))
        if key in seen:
            records[seen[key]] = record
        else:
            seen[key] = len(records)
            records.append(record)
    return records


def _finite(xs, ys):
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _downstream_curves(records: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{"accuracy" | "bits per byte": {"<group>/<metric>": [(step, mean score)]}} of the in-loop
    downstream records (`downstream_groups`, olmo_eqx.evaluation.inloop)."""
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in records:
        for name, value in (r.get("downstream_groups") or {}).items():
            panel = "bits per byte" if name.endswith("/bpb") else "accuracy"
            panels.setdefault(panel, {}).setdefault(name, []).append((r["step"], value))
    return panels


def loss_plot(records: list[dict], path: Path, title: str = "") -> Optional[Path]:
    """Train loss per step, held-out loss per set at each evaluation, LR on a second axis and
    gap-alarm events as vertical lines; below it, when the loop scored downstream tasks, one
    curve per task group (accuracy and bits per byte apart). None when there is nothing to draw."""
    train = _train_records(records)
    if not train:
        return None
    downstream = _downstream_curves(records)
    if downstream:
        figure = _figure(figsize=(9, 8))
        panels = sorted(downstream)  # accuracy, then bits per byte
        grid = figure.subplot_mosaic([["loss"] * len(panels), panels], height_ratios=[1.2, 1])
        axis, lower = grid["loss"], [grid[panel] for panel in panels]
        for panel in panels:
            for i, (name, points) in enumerate(sorted(downstream[panel].items())):
                grid[panel].plot(*_finite(*zip(*sorted(points))), marker="o", markersize=3, linewidth=1.2,
                                 color=f"C{i % 10}", label=name)
            grid[panel].set_title(f"downstream {panel} (mean primary metric per task group)", fontsize=9)
            grid[panel].set_xlabel("step")
            grid[panel].grid(alpha=0.3)
            grid[panel].legend(fontsize=7)
    else:
        figure = _figure(figsize=(8, 4.5))
        axis, lower = figure.subplots(), []
    steps, losses = _finite([r["step"] for r in train], [r["loss"] for r in train])
    axis.plot(steps, losses, color="tab:blue", linewidth=1.0, label="train loss (per step)")
    sets: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for name, loss in (r.get("heldout") or {}).items():
            sets.setdefault(name, []).append((r["step"], loss))
    for i, (name, points) in enumerate(sorted(sets.items())):
        xs, ys = _finite(*zip(*sorted(points)))
        axis.plot(xs, ys, marker="o", markersize=4, linewidth=1.5, color=f"C{(i + 1) % 10}", label=f"held-out: {name}")
    alarms = [r for r in records if "gap_alarm" in r]
    for j, r in enumerate(alarms):
        axis.axvline(r["step"], color="red", linestyle="--", linewidth=1.0,
                     label="generalisation-gap alarm" if j == 0 else None)
    axis.set_xlabel("step")
    axis.set_ylabel("loss (nats per target token)")
    lr_axis = axis.twinx()
    lr_steps, lrs = _finite([r["step"] for r in train], [r.get("lr") for r in train])
    lr_axis.plot(lr_steps, lrs, color="gray", linestyle=":", linewidth=1.2, label="learning rate (right axis)")
    lr_axis.set_ylabel("learning rate")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    lines = axis.get_legend_handles_labels()
    lr_lines = lr_axis.get_legend_handles_labels()
    axis.legend(lines[0] + lr_lines[0], lines[1] + lr_lines[1], fontsize=8, loc="upper right")
    axis.grid(alpha=0.3)
    axis.set_title(title or "loss", fontsize=10)
    for below in lower:  # the same steps as the loss panel, and the alarms where they fired
        below.set_xlim(axis.get_xlim())
        for r in alarms:
            below.axvline(r["step"], color="red", linestyle="--", linewidth=1.0)
    return _save(figure, path)


def sweep_plot(jobs: list[dict], path: Path, title: str = "") -> Optional[Path]:
    """Each job's train-loss curve (left) and held-out evaluations (right), one colour per job,
    labelled with its overrides. jobs: {"label": str, "records": metrics records}."""
    jobs = [j for j in jobs if any("loss" in r for r in j["records"])]
    if not jobs:
        return None
    figure = _figure(figsize=(11, 4.5))
    left, right = figure.subplots(1, 2, sharey=True)
    for i, job in enumerate(jobs):
        colour = f"C{i % 10}"
        train = _train_records(job["records"])
        left.plot(*_finite([r["step"] for r in train], [r["loss"] for r in train]), color=colour, linewidth=1.0,
                  label=job["label"])
        evals = sorted((r for r in job["records"] if "heldout_loss" in r), key=lambda r: r["step"])
        right.plot(*_finite([r["step"] for r in evals], [r["heldout_loss"] for r in evals]), color=colour,
                   marker="o", markersize=4, label=job["label"])
    left.set_title("train loss per step", fontsize=10)
    right.set_title("held-out loss (token-weighted mean over sets)", fontsize=10)
    for axis in (left, right):
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    left.set_ylabel("loss (nats per target token)")
    left.legend(fontsize=8)
    figure.suptitle(title or "sweep", fontsize=10)
    return _save(figure, path)


# The goodput figure's colours: the steps that counted green, the lost ones red, the rest apart.
_BUCKET_COLOURS = {
    "steps": "tab:green", "lost": "tab:red", "compile": "tab:purple", "startup": "tab:gray",
    "restore": "tab:brown", "data": "tab:orange", "checkpoint": "tab:blue", "eval": "tab:cyan", "other": "tab:olive",
}


def goodput_plot(goodput: Optional[dict], path: Path, title: str = "") -> Optional[Path]:
    """One stacked bar per session of the run's goodput report (`olmo_eqx.run.goodput.report`):
    its seconds per bucket, the steps trained again by a later session in red. None when there
    is nothing to draw."""
    sessions = (goodput or {}).get("per_session") or []
    if not sessions:
        return None
    figure = _figure(figsize=(max(5.0, 1.0 + 0.6 * len(sessions)), 4.5))
    axis = figure.subplots()
    xs = list(range(len(sessions)))
    bottoms = [0.0] * len(sessions)
    for name, colour in _BUCKET_COLOURS.items():
        heights = [float(s["buckets"].get(name, 0.0)) for s in sessions]
        if any(h > 0 for h in heights):
            axis.bar(xs, heights, bottom=bottoms, color=colour, width=0.7, label=name)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    axis.set_xticks(xs, [str(s["session"]) for s in sessions])
    axis.set_xlabel("session")
    axis.set_ylabel("seconds")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axis.grid(alpha=0.3, axis="y")
    share = "n/a" if goodput["goodput"] is None else f"{100 * goodput['goodput']:.1f}%"
    axis.set_title(f"{title + ' | ' if title else ''}goodput {share} of {goodput['wall_s']:.1f} s", fontsize=10)
    return _save(figure, path)
