"""Stop, don't skip, when training has gone bad.

The skip-step rule discards an update whose loss or grad norm spikes, which rides out a bad
batch. It cannot rescue a run that has diverged: then every step is skipped (or, before the
rule has its history, the first non-finite update is *applied*), and the run used to end
"completed" with NaN weights. `DivergenceGuard` watches the metrics the loop fetches anyway
and says when to stop; `all_finite` is checked before every save, so a checkpoint never holds
a non-finite state.
"""

import math
from dataclasses import dataclass
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, PyTree

LIKELY_CAUSES = (
    "likely causes: a learning rate too high for this model (optim.lr, schedule.warmup_steps), "
    "or bad data (token ids out of range, a corrupt token file)"
)


@eqx.filter_jit
def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """True when every floating-point leaf of `tree` is finite (one reduction on the devices)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@dataclass
class DivergenceGuard:
    """Host-side watch over the per-step metrics.

    history: finite steps already in the state's skip-step window (`state.history_count`).
    min_history: steps the skip-step rule needs before it acts; None when it is disabled
    (optim.skip_step_std = 0), so a non-finite step is applied and always stops the run.
    max_consecutive_skips: more skipped steps in a row than this stops the run.
    """

    history: int
    min_history: Optional[int]
    max_consecutive_skips: int
    consecutive_skips: int = 0

    def observe(self, step: int, loss: float, grad_norm: float, skipped: bool) -> Optional[str]:
        """Why training must stop after `step`'s metrics, or None to go on."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and (self.min_history is None or self.history < self.min_history):
            when = (
                "with the skip-step rule disabled"
                if self.min_history is None
                else f"before the skip-step rule has its {self.min_history} steps of history"
            )
            return f"loss {loss} and grad norm {grad_norm} at step {step}, {when}"
        self.history += finite
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips > self.max_consecutive_skips:
            return (
                f"{self.consecutive_skips} consecutive steps skipped up to step {step} "
                f"(trainer.max_consecutive_skips={self.max_consecutive_skips}; last loss {loss}, grad norm {grad_norm})"
            )
        return None
