"""Learning-rate schedules: cosine, linear, constant and warmup-stable-decay (WSD).

Step convention: `lr(s)` is the learning rate of the update that turns the model at step `s`
(after `s` updates) into step `s + 1`; a run of `total_steps` updates uses s = 0 ..
total_steps - 1. So:

- warmup: lr(s) = peak * (s + 1) / (warmup_steps + 1) for s < warmup_steps, reaching peak at
  s = warmup_steps (the first update is never wasted at lr 0);
- decay: from peak at s = warmup_steps (wsd: at the start of its decay phase) to exactly
  `final_lr_ratio * peak` at the last update s = total_steps - 1 (linear reaches exactly 0.0);
  beyond the end the schedule stays at the final value.
"""

from dataclasses import dataclass
from typing import Literal, Optional

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Real

ScheduleName = Literal["cosine", "linear", "constant", "wsd"]

# final_lr_ratio when the config leaves it None: cosine to 0.1x peak (OLMo 3 stage 1), the
# others to zero (OLMo 3 stages 2-3 decay linearly to 0).
_DEFAULT_FINAL_RATIO = {"cosine": 0.1, "linear": 0.0, "constant": 1.0, "wsd": 0.0}


@dataclass(frozen=True)
class ScheduleConfig:
    """Shape of the learning-rate schedule; the peak comes from `OptimConfig.lr`."""

    name: ScheduleName = "cosine"
    warmup_steps: int = 0
    # None: the trainer's number of steps.
    total_steps: Optional[int] = None
    # Final lr as a fraction of peak; None picks the schedule's default (cosine 0.1, else 0).
    final_lr_ratio: Optional[float] = None
    # wsd only: the fraction of total_steps spent decaying at the end.
    decay_fraction: float = 0.2


def make_schedule(config: ScheduleConfig, peak_lr: float, trainer_steps: Optional[int] = None) -> optax.Schedule:
    """An optax schedule (step -> float32 lr) following the module's step convention."""
    if config.name not in _DEFAULT_FINAL_RATIO:
        raise ValueError(f"schedule.name={config.name!r}; choose one of {sorted(_DEFAULT_FINAL_RATIO)}")
    total = config.total_steps if config.total_steps is not None else trainer_steps
    if total is None or total < 1:
        raise ValueError("schedule needs total_steps >= 1 (set schedule.total_steps or trainer.steps)")
    warmup = config.warmup_steps
    if not 0 <= warmup < total:
        raise ValueError(f"schedule.warmup_steps={warmup} must be in [0, total_steps={total})")
    ratio = config.final_lr_ratio if config.final_lr_ratio is not None else _DEFAULT_FINAL_RATIO[config.name]
    peak, final = float(peak_lr), float(peak_lr) * float(ratio)
    decay_start = warmup
    if config.name == "wsd":
        if not 0.0 <= config.decay_fraction <= 1.0:
            raise ValueError(f"schedule.decay_fraction={config.decay_fraction} must be in [0, 1]")
        decay_start = max(warmup, total - round(config.decay_fraction * total))
    decay_len = max(1, total - 1 - decay_start)

    def schedule(step: Real[Array, ""] | int | float) -> Float[Array, ""]:
        s = jnp.asarray(step, jnp.float32)
        warm = peak * (s + 1.0) / (warmup + 1.0)
        progress = jnp.clip((s - decay_start) / decay_len, 0.0, 1.0)
        if config.name == "cosine":
            shape = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        elif config.name in ("linear", "wsd"):
            shape = 1.0 - progress
        else:
            shape = jnp.ones_like(progress)
        decayed = jnp.where(progress >= 1.0, final, final + (peak - final) * shape)
        return jnp.where(s < warmup, warm, decayed).astype(jnp.float32)

    return schedule
