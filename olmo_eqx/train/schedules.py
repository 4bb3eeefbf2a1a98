"""Learning-rate schedules: cosine, linear, constant and warmup-stable-decay (WSD), as OLMo-core's.

Step convention (OLMo-core's): updates are numbered k = 1, 2, ..., total_steps, and `lr(k)` is
the learning rate of the k-th update. OLMo-core's trainer increments its `global_step` before
each update and hands that number to its scheduler; our train step passes `state.step + 1`
(the step the state will have after the update) for the same reason. With warmup W and
T = total_steps, for the same-named settings each schedule equals OLMo-core's
(`olmo_core/optim/scheduler.py`):

- cosine (`CosWithWarmup(warmup=W, alpha_f=final_lr_ratio)`): peak * k / W for k < W, so the
  W-th update is the first at the peak; then final + (peak - final) * (1 + cos(pi (k - W) /
  (T - W))) / 2, reaching final at k = T;
- linear (`LinearWithWarmup(warmup=W, alpha_f=final_lr_ratio)`): the same warmup, then peak -
  (peak - final) (k - W) / (T - W): with W = 0 the first update is already below the peak and
  the T-th is at exactly final (0.0 for OLMo 3's anneal);
- constant (`ConstantWithWarmup(warmup=W)`, `ConstantScheduler` when W = 0): warmup, then peak;
- wsd (`WSD(warmup=W, decay_fraction=f, decay_min_lr=final)`): warmup for k <= W, peak, then
  over the last D = round(f * T) updates final + (peak - final) * (T - k) / D.

Beyond T (a schedule shorter than the run) every schedule holds its final value; OLMo-core's
trainer never asks for k > T.
"""

from dataclasses import dataclass
from typing import Literal, Optional, get_args

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Real

ScheduleName = Literal["cosine", "linear", "constant", "wsd"]
# A schedule's `kind` in the compiled step: its index here.
SCHEDULE_NAMES: tuple[ScheduleName, ...] = get_args(ScheduleName)
COSINE, LINEAR, CONSTANT, WSD = range(len(SCHEDULE_NAMES))

# final_lr_ratio when the config leaves it None: cosine to 0.1x peak (OLMo 3 stage 1), the
# others to zero (OLMo 3 stages 2-3 decay linearly to 0); constant never decays.
_DEFAULT_FINAL_RATIO = {"cosine": 0.1, "linear": 0.0, "constant": 1.0, "wsd": 0.0}


@dataclass(frozen=True)
class ScheduleConfig:
    """Shape of the learning-rate schedule; the peak comes from `OptimConfig.lr`."""

    name: ScheduleName = "cosine"
    # The first `warmup_steps` updates ramp linearly; update number `warmup_steps` is at peak.
    warmup_steps: int = 0
    # None: the trainer's number of steps.
    total_steps: Optional[int] = None
    # Final lr as a fraction of peak; None picks the schedule's default (cosine 0.1, else 0).
    final_lr_ratio: Optional[float] = None
    # wsd only: the fraction of total_steps spent decaying at the end.
    decay_fraction: float = 0.2


def final_lr_ratio(config: ScheduleConfig) -> float:
    """The final learning rate as a fraction of peak: the setting, else the schedule's default."""
    return float(config.final_lr_ratio if config.final_lr_ratio is not None else _DEFAULT_FINAL_RATIO[config.name])


class Schedule(eqx.Module):
    """A learning-rate schedule as data: update number k >= 1 -> float32 lr (the module's convention).

    Every field is an array, not a constant of the compiled step: the train step takes the
    schedule as an argument, so runs that differ only in their schedule (an LR sweep, a longer
    run, an anneal's linear decay after a cosine pretrain) share one compiled step. Each of the
    four shapes is computed and the one `kind` names is selected: the same float32 operations as
    computing that shape alone, so the same bits.
    """

    kind: Int[np.ndarray | Array, ""]  # index into SCHEDULE_NAMES
    peak: Float[np.ndarray | Array, ""]
    final: Float[np.ndarray | Array, ""]
    # peak - final, rounded to float32 once from the float64 difference.
    span: Float[np.ndarray | Array, ""]
    warmup: Float[np.ndarray | Array, ""]
    total: Float[np.ndarray | Array, ""]
    # wsd only: the number of decaying updates at the end (0 for the other schedules).
    decay: Float[np.ndarray | Array, ""]

    # Elementwise: a scalar update number, or an array of them (a whole schedule at once).
    def __call__(self, update: Real[Array, "*shape"] | int | float) -> Float[Array, "*shape"]:
        k = jnp.asarray(update, jnp.float32)
        kind = jnp.asarray(self.kind, jnp.int32)
        peak, final, span = (jnp.asarray(x, jnp.float32) for x in (self.peak, self.final, self.span))
        warmup, total, decay = (jnp.asarray(x, jnp.float32) for x in (self.warmup, self.total, self.decay))
        # cosine, linear, constant: warmup, then final + span * (the fraction of the decay
        # still ahead, (T - k) / (T - W), from integers: exact enough that the last updates of a
        # decay to 0 keep float32's *relative* precision, shaped by the schedule).
        remaining = jnp.clip((total - k) / (total - warmup), 0.0, 1.0)
        cosine = jnp.square(jnp.sin(0.5 * jnp.pi * remaining))  # = (1 + cos(pi (1 - remaining))) / 2
        shape = jnp.where(kind == COSINE, cosine, jnp.where(kind == LINEAR, remaining, jnp.ones_like(remaining)))
        after = final + span * shape
        # wsd: peak, then linear to final over the last `decay` updates (with none, the tail is
        # 0 / 0, which jnp.where drops). OLMo-core's WSD tests `k <= W` before its decay: warmup
        # wins where they overlap.
        tail = final + span * jnp.clip(total - k, 0.0, decay) / decay
        wsd = jnp.where((decay > 0) & (k >= total - decay), tail, peak)
        is_wsd = kind == WSD
        after = jnp.where(is_wsd, wsd, after)
        in_warmup = jnp.where(is_wsd, k <= warmup, k < warmup)
        warm = peak * k / jnp.maximum(warmup, 1.0)
        return jnp.where(in_warmup, warm, after).astype(jnp.float32)


def make_schedule(config: ScheduleConfig, peak_lr: float, trainer_steps: Optional[int] = None) -> Schedule:
    """The `Schedule` of `config` peaking at `peak_lr`; refuses settings that make no schedule."""
    if config.name not in SCHEDULE_NAMES:
        raise ValueError(f"schedule.name={config.name!r}; choose one of {sorted(SCHEDULE_NAMES)}")
    total = config.total_steps if config.total_steps is not None else trainer_steps
    if total is None or total < 1:
        raise ValueError("schedule needs total_steps >= 1 (set schedule.total_steps or trainer.steps)")
    warmup = config.warmup_steps
    if not 0 <= warmup < total:
        raise ValueError(f"schedule.warmup_steps={warmup} must be in [0, total_steps={total})")
    if config.name == "constant" and config.final_lr_ratio not in (None, 1.0):
        raise ValueError(f"schedule.final_lr_ratio={config.final_lr_ratio}: a constant schedule does not decay; "
                         "leave it unset or choose schedule=linear / cosine / wsd")
    if config.name == "wsd" and not 0.0 <= config.decay_fraction <= 1.0:
        raise ValueError(f"schedule.decay_fraction={config.decay_fraction} must be in [0, 1]")
    peak, final = float(peak_lr), float(peak_lr) * final_lr_ratio(config)
    decay = round(config.decay_fraction * total) if config.name == "wsd" else 0  # Python's round, as OLMo-core's
    # Host numbers (numpy), so that every process of a multi-process run passes the same values.
    number = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return Schedule(np.asarray(SCHEDULE_NAMES.index(config.name), np.int32), number(peak), number(final),
                    number(peak - final), number(warmup), number(total), number(decay))
