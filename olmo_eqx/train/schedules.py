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
from typing import Literal, Optional

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Real

ScheduleName = Literal["cosine", "linear", "constant", "wsd"]

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


def make_schedule(config: ScheduleConfig, peak_lr: float, trainer_steps: Optional[int] = None) -> optax.Schedule:
    """An optax schedule (update number k >= 1 -> float32 lr) following the module's convention."""
    if config.name not in _DEFAULT_FINAL_RATIO:
        raise ValueError(f"schedule.name={config.name!r}; choose one of {sorted(_DEFAULT_FINAL_RATIO)}")
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
    decay = round(config.decay_fraction * total)  # wsd only; Python's round, as OLMo-core's

    # Elementwise: a scalar update number, or an array of them (a whole schedule at once).
    def schedule(update: Real[Array, "*shape"] | int | float) -> Float[Array, "*shape"]:
        k = jnp.asarray(update, jnp.float32)
        if config.name == "wsd":
            if decay:
                tail = final + (peak - final) * jnp.clip(total - k, 0.0, decay) / decay
                after = jnp.where(k >= total - decay, tail, peak)
            else:
                after = jnp.full_like(k, peak)
            # OLMo-core's WSD tests `k <= W` before its decay: warmup wins where they overlap.
            in_warmup = k <= warmup
        else:
            # The fraction of the decay still ahead, (T - k) / (T - W), from integers: exact
            # enough that the last updates of a decay to 0 keep float32's *relative* precision.
            remaining = jnp.clip((total - k) / (total - warmup), 0.0, 1.0)
            if config.name == "cosine":
                shape = jnp.square(jnp.sin(0.5 * jnp.pi * remaining))  # = (1 + cos(pi (1 - remaining))) / 2
            elif config.name == "linear":
                shape = remaining
            else:
                shape = jnp.ones_like(remaining)
            after = final + (peak - final) * shape
            in_warmup = k < warmup
        warm = peak * k / max(warmup, 1)
        return jnp.where(in_warmup, warm, after).astype(jnp.float32)

    return schedule
