"""The generalisation-gap alarm: training loss keeps falling while held-out loss does not.

OLMo 3's JAX reproduction lost weeks to a loader that sharded the index stream twice: each
host saw only every N-th record of its slice, epochs rolled over N times too often, and
records repeated. Training loss fell by up to 0.25 while held-out loss stayed flat; unit tests
(one shard) could not see it, only held-out evaluation did (docs/olmo3.md section 6). This module
watches for that shape at every held-out evaluation of the loop:

    over the last `window` evaluations, the mean training loss (of the steps between
    evaluations) fell by at least `min_train_drop` nats, while held-out loss fell by less than
    `heldout_fraction` of that (or rose)

and then returns a `gap_alarm` record (the loop writes it to metrics.jsonl) and `warn` prints
a loud message to stderr. After firing it needs a fresh window before it fires again.
"""

import io
import math
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GapAlarmConfig:
    # Evaluations compared: the first and last of the most recent `window` ones (>= 2).
    window: int = 4
    # Training loss must fall at least this much (nats) over the window ...
    min_train_drop: float = 0.05
    # ... while held-out loss falls by less than this fraction of the training drop.
    heldout_fraction: float = 0.25

    def __post_init__(self):
        if self.window < 2:
            raise ValueError(f"window={self.window} must be >= 2 evaluations")
        if self.min_train_drop <= 0 or not 0 <= self.heldout_fraction < 1:
            raise ValueError("min_train_drop must be > 0 and heldout_fraction in [0, 1)")


class GapAlarm:
    """Feed it every training loss (`train_loss`) and every held-out loss (`heldout`)."""

    def __init__(self, config: GapAlarmConfig = GapAlarmConfig()):
        self.config = config
        self._since_eval: list[float] = []
        # (step, mean training loss since the previous evaluation, held-out loss)
        self._points: list[tuple[int, float, float]] = []

    def train_loss(self, loss: float) -> None:
        if math.isfinite(loss):
            self._since_eval.append(float(loss))

    def heldout(self, step: int, loss: Optional[float]) -> Optional[dict]:
        """Record the held-out loss at `step`; a `gap_alarm` record when the alarm fires, else None."""
        if not self._since_eval or loss is None or not math.isfinite(loss):
            return None  # no training since the last evaluation (e.g. a resume at the end)
        train = sum(self._since_eval) / len(self._since_eval)
        self._since_eval = []
        self._points = (self._points + [(int(step), train, float(loss))])[-self.config.window :]
        if len(self._points) < self.config.window:
            return None
        (first_step, train_first, heldout_first), (last_step, train_last, heldout_last) = self._points[0], self._points[-1]
        train_drop, heldout_drop = train_first - train_last, heldout_first - heldout_last
        if train_drop < self.config.min_train_drop or heldout_drop >= self.config.heldout_fraction * train_drop:
            return None
        points, self._points = self._points, self._points[-1:]  # a fresh window before the next alarm
        return {
            "step": int(step),
            "gap_alarm": {
                "from_step": first_step,
                "to_step": last_step,
                # (keys avoid the substring "heldout_loss", which marks evaluation records)
                "train_drop": train_drop,
                "heldout_drop": heldout_drop,
                "steps": [p[0] for p in points],
                "train": [p[1] for p in points],
                "heldout": [p[2] for p in points],
            },
        }


def message(record: dict) -> str:
    """The warning text of a `gap_alarm` record."""
    a = record["gap_alarm"]
    bar = "!" * 100
    return (
        f"{bar}\n"
        f"GENERALISATION-GAP ALARM at step {record['step']}: over steps {a['from_step']}-{a['to_step']} training loss "
        f"fell {a['train_drop']:.4f} ({a['train'][0]:.4f} -> {a['train'][-1]:.4f}) while held-out loss "
        f"{'fell only' if a['heldout_drop'] > 0 else 'rose'} {abs(a['heldout_drop']):.4f} "
        f"({a['heldout'][0]:.4f} -> {a['heldout'][-1]:.4f}).\n"
        "The model may be memorising repeated data: check that the training data does not repeat (a loader that\n"
        "re-shards an already sharded index stream, a mix far smaller than the run, a resume replaying seen data).\n"
        f"{bar}"
    )


def warn(record: dict, file: Optional[io.TextIOBase] = None) -> None:
    """Print the alarm loudly (to stderr unless `file` is given)."""
    print(message(record), file=sys.stderr if file is None else file, flush=True)
