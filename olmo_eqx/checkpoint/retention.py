"""Which checkpoint steps retention deletes: one pure decision, taken by process 0 alone.

    keep the newest `keep_last` steps that carry a manifest (a step without one, damaged or
    from an older olmo_eqx, never pushes out a good one), every multiple of `keep_every`, and
    the `protected` steps: the last step known good while a run is in trouble
    (`train/divergence.py`), so a run that saves through a divergence never loses it.
"""

from collections.abc import Collection, Sequence
from typing import Optional


def steps_to_delete(
    steps: Sequence[int],
    sealed: Collection[int],
    keep_last: Optional[int],
    keep_every: Optional[int] = None,
    protected: Collection[int] = (),
) -> list[int]:
    """The steps of `steps` (complete checkpoints, any order) that retention removes.

    sealed: those of `steps` with a manifest; keep_last None keeps everything.
    """
    if keep_last is None:
        return []
    counted = sorted(s for s in steps if s in sealed)
    if len(counted) <= keep_last:
        return []
    oldest_kept = counted[-keep_last]
    return sorted(
        s for s in steps
        if s < oldest_kept and not (keep_every and s % keep_every == 0) and s not in protected
    )
