"""The generalisation-gap alarm: training loss keeps falling while held-out loss does not.

OLMo 3's JAX reproduction lost weeks to a loader that sharded the index stream twice: each
host saw only every N-th record of its slice, epochs rolled over N times too often, and
records repeated. Training loss fell by up to 0.25 while held-out loss stayed flat; unit tests
(one shard) could not see it, only held-out evaluation did (docs/olmo3.md section 6). This module
watches for that shape at every held-out evaluation of the loop:

    over the last `window` evaluations, training loss fell by at least `min_train_drop` nats
    beyond its noise, while held-out loss fell by less than `heldout_fraction` of that (or rose)

and then returns a `gap_alarm` record (the loop writes it to metrics.jsonl) and `warn` prints
a loud message to stderr. After firing it needs a fresh window before it fires again.

How training loss's fall is measured: a least-squares line through every step's loss of the
window (the steps up to each of its evaluations), its slope times the steps from the first
evaluation to the last. Both choices come from false alarms on healthy runs. A mean of the
steps since the previous evaluation lags the held-out point it is compared with by half an
interval, which on a falling curve inflates training's drop. And with small batches a step's
loss swings with the documents it drew (the README's long-context walkthrough: 2 sequences a
step, step losses spread by about 0.3): its training loss "fell" 0.18 over 150 steps against
0.04 held-out, in 3 of 3 seeds, on data that never repeated. So the drop that counts is the
line's drop less `noise_sigmas` standard errors of it (from the residuals around the line);
a memorising run's drop (0.25 nats and more at real batch sizes; 3.0 on the planted
repeating stream of the tests, standard error 0.4) stands far above that.
"""

import io
import math
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class GapAlarmConfig:
    # Evaluations compared: the first and last of the most recent `window` ones (>= 2).
    window: int = 4
    # Training loss must fall at least this much (nats) over the window ...
    min_train_drop: float = 0.05
    # ... while held-out loss falls by less than this fraction of the training drop.
    heldout_fraction: float = 0.25
    # The training drop that counts is the fitted drop less this many of its standard errors.
    noise_sigmas: float = 2.0

    def __post_init__(self):
        if self.window < 2:
            raise ValueError(f"window={self.window} must be >= 2 evaluations")
        if self.min_train_drop <= 0 or not 0 <= self.heldout_fraction < 1:
            raise ValueError("min_train_drop must be > 0 and heldout_fraction in [0, 1)")
        if self.noise_sigmas < 0:
            raise ValueError(f"noise_sigmas={self.noise_sigmas} must be >= 0")


class GapAlarm:
    """Feed it every training loss (`train_loss`) and every held-out loss (`heldout`)."""

    def __init__(self, config: GapAlarmConfig = GapAlarmConfig()):
        self.config = config
        self._since_eval: list[float] = []
        # Per evaluation of the window: (step, training losses of the steps up to it, held-out loss)
        self._points: list[tuple[int, list[float], float]] = []

    def train_loss(self, loss: float) -> None:
        if math.isfinite(loss):
            self._since_eval.append(float(loss))

    def heldout(self, step: int, loss: Optional[float]) -> Optional[dict]:
        """Record the held-out loss at `step`; a `gap_alarm` record when the alarm fires, else None."""
        if not self._since_eval or loss is None or not math.isfinite(loss):
            return None  # no training since the last evaluation (e.g. a resume at the end)
        self._points = (self._points + [(int(step), self._since_eval, float(loss))])[-self.config.window :]
        self._since_eval = []
        if len(self._points) < self.config.window:
            return None
        (first_step, _, heldout_first), (last_step, _, heldout_last) = self._points[0], self._points[-1]
        train_drop, train_drop_se = _fitted_drop(self._points, first_step, last_step)
        heldout_drop = heldout_first - heldout_last
        counted = train_drop - self.config.noise_sigmas * train_drop_se
        if counted < self.config.min_train_drop or heldout_drop >= self.config.heldout_fraction * counted:
            return None
        points, self._points = self._points, self._points[-1:]  # a fresh window before the next alarm
        return {
            "step": int(step),
            "gap_alarm": {
                "from_step": first_step,
                "to_step": last_step,
                # (keys avoid the substring "heldout_loss", which marks evaluation records)
                "train_drop": train_drop,
                "train_drop_se": train_drop_se,
                "heldout_drop": heldout_drop,
                "steps": [p[0] for p in points],
                "train": [sum(p[1]) / len(p[1]) for p in points],  # mean training loss up to each
                "heldout": [p[2] for p in points],
            },
        }


def _fitted_drop(points, first_step: int, last_step: int) -> tuple[float, float]:
    """(drop, its standard error) of a least-squares line through the window's step losses,
    over first_step .. last_step. The losses up to an evaluation at step s are taken as those
    of the steps just before s (a resumed run may have fewer than the interval)."""
    xs, ys = [], []
    for step, losses, _ in points:
        xs += [step - len(losses) + 1 + i for i in range(len(losses))]
        ys += losses
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    centred = x - x.mean()
    spread = float(np.sum(centred**2))
    if spread == 0:
        return 0.0, 0.0
    slope = float(np.sum(centred * (y - y.mean())) / spread)
    span = last_step - first_step
    if len(x) <= 2:
        return -slope * span, 0.0  # a line through two points: no noise to estimate
    residuals = y - y.mean() - slope * centred
    slope_se = math.sqrt(float(np.sum(residuals**2)) / (len(x) - 2) / spread)
    return -slope * span, slope_se * span


def message(record: dict) -> str:
    """The warning text of a `gap_alarm` record."""
    a = record["gap_alarm"]
    bar = "!" * 100
    return (
        f"{bar}\n"
        f"GENERALISATION-GAP ALARM at step {record['step']}: over steps {a['from_step']}-{a['to_step']} training loss "
        f"fell {a['train_drop']:.4f} (+- {a.get('train_drop_se', 0.0):.4f}; {a['train'][0]:.4f} -> {a['train'][-1]:.4f}) while held-out loss "
        f"{'fell only' if a['heldout_drop'] > 0 else 'rose'} {abs(a['heldout_drop']):.4f} "
        f"({a['heldout'][0]:.4f} -> {a['heldout'][-1]:.4f}).\n"
        "The model may be memorising repeated data: check that the training data does not repeat (a loader that\n"
        "re-shards an already sharded index stream, a mix far smaller than the run, a resume replaying seen data).\n"
        f"{bar}"
    )


def warn(record: dict, file: Optional[io.TextIOBase] = None) -> None:
    """Print the alarm loudly (to stderr unless `file` is given)."""
    print(message(record), file=sys.stderr if file is None else file, flush=True)
