"""Stop, don't skip, when training has gone bad.

The skip-step rule discards an update whose loss or grad norm spikes, which rides out a bad
batch. It cannot rescue a run that has diverged: then every step is skipped (or, before the
rule has its history, the first non-finite update is *applied*), and the run used to end
"completed" with NaN weights. `DivergenceGuard` watches the metrics the loop fetches anyway
and says when to stop; `all_finite` is checked before every save, so a checkpoint never holds
a non-finite state.

Finite is not good. A loss can run away and stay finite for a hundred steps (gradient ascent:
1,120 at step 10, 7e9 at step 100), so `DivergenceGuard` also stops a loss that stays above
ln(vocab) + trainer.runaway_loss_margin for trainer.runaway_loss_steps steps in a row. And an
update with a learning rate of 1e30 leaves finite weights (1e29) whose every later step is
skipped. `SaveHealth` decides which saved steps are *good*, so retention
keeps the last good one through the trouble and a divergence stop can name it:

    a step is healthy when its loss and grad norm are finite, its loss has not run away (is
    not above ln(vocab) + trainer.runaway_loss_margin), and the skip-step rule kept it (it
    judges them against their recent range); a step's loss is measured on the weights the
    step before it left, so a checkpoint of step s is good once a healthy step follows it.
    Skipped steps in between leave the weights as saved, so they neither confirm nor condemn.
"""

import math
from dataclasses import dataclass, field
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


def runaway_loss_limit(vocab_size: int, margin: Optional[float]) -> float:
    """The loss above which a step counts as run away: ln(vocab_size) + margin nats (inf: off).

    ln(vocab) is the cross-entropy of a uniform guess, about where a freshly initialised model
    starts; a run that scores worse than that by `margin` has stopped learning, whatever its
    grad norm says (the skip-step rule cannot see a loss that climbs steadily: its window climbs
    with it)."""
    return math.inf if margin is None else math.log(vocab_size) + margin


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
    # A finite loss above loss_limit for runaway_steps steps in a row stops the run too.
    loss_limit: float = math.inf
    runaway_steps: int = 3
    runaway: int = 0

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
        self.runaway = self.runaway + 1 if finite and loss > self.loss_limit else 0
        if self.runaway >= self.runaway_steps:
            return (
                f"the loss ran away: above {self.loss_limit:.2f} (ln(vocab size) + trainer.runaway_loss_margin) "
                f"for {self.runaway} steps in a row up to step {step} (loss {loss:.4g}, grad norm {grad_norm:.4g})"
            )
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips > self.max_consecutive_skips:
            return (
                f"{self.consecutive_skips} consecutive steps skipped up to step {step} "
                f"(trainer.max_consecutive_skips={self.max_consecutive_skips}; last loss {loss}, grad norm {grad_norm})"
            )
        return None


@dataclass
class SaveHealth:
    """Which saved steps are known good (see the module docstring).

    last_good: the newest saved step a healthy step has confirmed (None: none yet).
    unconfirmed: steps saved since, oldest first, awaiting a healthy step after them.
    """

    last_good: Optional[int] = None
    unconfirmed: list[int] = field(default_factory=list)
    # A loss above this (`runaway_loss_limit`) is finite but not healthy.
    loss_limit: float = math.inf

    @classmethod
    def resumed(cls, step: int, stored: Optional[dict]) -> "SaveHealth":
        """The health of a run resumed from checkpoint `step`, given what that checkpoint
        recorded (`saved_record`; None from an olmo_eqx that recorded nothing: taken as good)."""
        if not step:
            return cls()
        if stored is None:
            return cls(last_good=step)
        last_good = stored.get("last_good")
        return cls(last_good=None if last_good is None else int(last_good), unconfirmed=[step])

    def saved_record(self) -> dict:
        """What a checkpoint saved now records, for `resumed`."""
        return {"last_good": self.last_good}

    def saved(self, step: int) -> None:
        self.unconfirmed.append(step)

    def observe(self, step: int, loss: float, grad_norm: float, skipped: bool) -> None:
        """Step `step`'s metrics: a healthy step confirms every step saved before it."""
        if skipped or not (math.isfinite(loss) and math.isfinite(grad_norm)) or loss > self.loss_limit:
            return
        confirmed = [s for s in self.unconfirmed if s < step]
        if confirmed:
            self.last_good = confirmed[-1]
            self.unconfirmed = [s for s in self.unconfirmed if s >= step]
