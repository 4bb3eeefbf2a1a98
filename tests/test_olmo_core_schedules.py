"""Every schedule's learning rate, update by update, against OLMo-core's own scheduler.

OLMo-core's trainer increments `global_step` before each update and asks its scheduler for
`get_lr(peak, global_step, max_steps)`: the k-th update (k = 1 .. T) runs at `get_lr(peak, k,
T)`. Ours runs at `make_schedule(...)(k)` (the train step passes state.step + 1). That the
trainer really passes k is checked on OLMo-core's own `Trainer` in test_olmo_core_trajectory.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from olmo_core_reference import olmo_core_scheduler
from olmo_eqx.config import compose_config
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule

RTOL = 2e-6  # float32 against OLMo-core's float64 Python arithmetic


def compare(config: ScheduleConfig, peak: float, total: int, updates=None) -> np.ndarray:
    """Our lr and OLMo-core's for updates 1..total (or `updates`); asserts equality, returns ours."""
    updates = np.arange(1, total + 1) if updates is None else np.asarray(updates)
    ours = np.asarray(make_schedule(config, peak, total)(jnp.asarray(updates, jnp.int32)))
    scheduler = olmo_core_scheduler(config, peak)
    reference = np.array([scheduler.get_lr(peak, int(k), total) for k in updates])
    np.testing.assert_allclose(ours, reference, rtol=RTOL, atol=0, err_msg=str(config))
    return ours


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_every_update_equals_olmo_core(name):
    # A constant schedule has no final ratio (make_schedule refuses one); OLMo-core's WSD divides
    # by its decay length, so a decay_fraction of 0 is no schedule there.
    ratios = (None,) if name == "constant" else (None, 0.05)
    fractions = (0.2, 0.5, 0.9) if name == "wsd" else (0.2,)
    for total in (41, 97):
        for warmup in (0, 1, 5, 40):
            for final_lr_ratio in ratios:
                for decay_fraction in fractions:
                    config = ScheduleConfig(name=name, warmup_steps=warmup, final_lr_ratio=final_lr_ratio,
                                            decay_fraction=decay_fraction)
                    compare(config, 3e-4, total)


def test_warmup_and_decay_land_where_olmo_core_puts_them():
    # The case: warmup 5 reaches the peak at the 5th update, not the 6th.
    lr = compare(ScheduleConfig(name="cosine", warmup_steps=5, final_lr_ratio=0.1), 1e-3, 40)
    np.testing.assert_allclose(lr[:5], 1e-3 * np.arange(1, 6) / 5, rtol=1e-6)
    assert lr[-1] == pytest.approx(1e-4, rel=1e-6)
    # Anneal: no warmup, linear to exactly 0: the first update is already below the peak.
    lr = compare(ScheduleConfig(name="linear", warmup_steps=0, final_lr_ratio=0.0), 2.0712e-4, 50)
    assert lr[0] == pytest.approx(2.0712e-4 * 49 / 50, rel=1e-6) and lr[-1] == 0.0 and lr[-2] > 0.0


@pytest.mark.parametrize("overrides", [
    [],  # stage 1 on the CPU defaults: cosine, 20 warmup steps
    ["schedule=linear"], ["schedule=constant"], ["schedule=wsd"],
    ["+stage=anneal"], ["+stage=long_context"],
    ["+stage=anneal", "trainer.steps=47684"],  # OLMo 3 7B stage 2's length
], ids=lambda o: " ".join(o) or "default")
def test_presets_equal_olmo_core(overrides):
    config = compose_config(overrides)
    compare(config.schedule, config.optim.lr, config.schedule.total_steps or config.trainer.steps)


def test_olmo3_7b_stage1_schedule():
    """2000 warmup steps and a cosine to 0.1x over 1,413,814 steps: the spec's numbers, sampled."""
    config = compose_config(["optim=olmo3_7b", "schedule.warmup_steps=2000", "trainer.steps=1413814"])
    total = config.trainer.steps
    updates = np.unique(np.concatenate([np.arange(1, 4001), np.arange(1, total + 1, 4999), np.arange(total - 2000, total + 1)]))
    lr = compare(config.schedule, config.optim.lr, total, updates)
    assert lr[1999] == pytest.approx(3e-4, rel=1e-6) and lr[1998] < 3e-4  # update 2000 is the first at peak
