"""The end-of-sweep table and plot: one row (and one curve) per job.

Registered as a Hydra callback in `conf/config.yaml` (`hydra.callbacks.sweep_summary`); it
reads what each job left in its own directory (`.hydra/overrides.yaml`, `summary.json`,
`metrics.jsonl`), so it works whatever launched the jobs. It writes `sweep_summary.json` and
`sweep.png` (each job's train and held-out loss curves) into the sweep dir through a `RunDir`.
"""

import json
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from olmo_eqx.run.run_dir import SUMMARY_FILE, RunDir
from olmo_eqx.run.sinks import METRICS_FILE

PLOT_FILE = "sweep.png"
# A sweep job that failed leaves its one-line error here instead.
ERROR_FILE = "error.txt"


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def _read_summary(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(summary, None), (None, None) when the job wrote none, or (None, why) when it is unreadable."""
    if not path.exists():
        return None, None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path} is unreadable ({type(e).__name__}: {e})"
    return (summary, None) if isinstance(summary, dict) else (None, f"{path} is not a JSON object")


def collect(sweep_dir: Path) -> list[dict]:
    """One row per job directory under `sweep_dir` (those holding Hydra's `.hydra/`)."""
    rows = []
    job_dirs = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    for job_dir in sorted(job_dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else p.name)):
        overrides = OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
        summary, error = _read_summary(job_dir / SUMMARY_FILE)
        error_path = job_dir / ERROR_FILE
        error = error_path.read_text().strip() if error_path.exists() else error
        rows.append(
            {
                "job": job_dir.name,
                "dir": str(job_dir),
                "overrides": " ".join(o for o in overrides if not str(o).startswith("+stage=")),
                "status": "ok" if summary is not None and error is None else "failed",
                "error": error,
                # Mean of the last trainer.log_every steps; summaries written before it had its
                # name called it final_train_loss.
                "train_loss": None if summary is None else summary.get("train_loss_mean_last_n", summary.get("final_train_loss")),
                "train_loss_steps": None if summary is None else summary.get("train_loss_mean_steps"),
                "heldout_loss": None if summary is None else summary.get("final_heldout_loss"),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    # The train loss is a mean over each job's last trainer.log_every steps: the header names
    # their count when the jobs agree, else each row does.
    counts = {r.get("train_loss_steps") for r in rows if r["train_loss"] is not None}
    same = len(counts) == 1 and None not in counts
    if same:
        title = f"train loss (mean of last {counts.pop()} steps)"
    else:
        title = "train loss (mean of last steps)"

    def train(r: dict) -> str:
        loss = _loss(r["train_loss"])
        return loss if same or r["train_loss"] is None or not r.get("train_loss_steps") else f"{loss} ({r['train_loss_steps']} steps)"

    header = ("job", "overrides", title, "held-out loss", "status")
    body = [(r["job"], r["overrides"] or "(none)", train(r), _loss(r["heldout_loss"]), r["status"]) for r in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(header, *body)]
    lines = [" | ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in (header, *body)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Optional[Path]:
    """sweep.png: every job's curves from its metrics.jsonl, labelled by its overrides."""
    from olmo_eqx.run.plots import read_metrics, sweep_plot

    jobs = []
    for row in rows:
        metrics = Path(row["dir"]) / METRICS_FILE
        if metrics.exists():
            jobs.append({"label": f"{row['job']}: {row['overrides'] or '(none)'}", "records": read_metrics(metrics)})
    return sweep_plot(jobs, path, title=f"sweep {path.parent}")


class SweepSummary(Callback):
    """Print (and save as sweep_summary.json) the table of a finished sweep; draw sweep.png."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        out = RunDir(Path(config.hydra.sweep.dir))
        try:
            rows = collect(out.path)
            if not rows:
                return
            out.write_json("sweep_summary.json", rows)
            drawn = plot(rows, out.file(PLOT_FILE))
        except Exception as e:  # a sweep without its table must not look like a success
            print(f"error: the sweep table of {out.path} could not be built: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        out.print(f"\nSweep summary ({out.path}):\n{format_table(rows)}")
        if drawn is not None:
            out.print(f"plot: {drawn}")
        failed = [r for r in rows if r["status"] != "ok"]
        if failed:
            for row in failed:
                print(f"job {row['job']} failed: {row['error'] or 'see ' + row['dir']}", file=sys.stderr)
            # After the table, so every job's result is shown before the sweep reports failure.
            sys.exit(1)
