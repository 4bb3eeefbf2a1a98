"""The skip-step rule against OLMo-core's own SkipStepAdamW, decision by decision.

Both sides see the same stream of (loss, grad norm): a noisy, falling trend with planted
spikes (before the window is full enough, one after another, in the loss only and in the grad
norm only), over a small window so that it wraps several times. OLMo-core's optimizer gets
the values as its train module hands them over (`latest_loss`, then `latest_grad_norm` only
when it clips) before each `step()`; ours goes through `olmo_eqx.train.step.skip_step`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from olmo_core.optim import SkipStepAdamW

from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.step import skip_step

WINDOW, SIGMA, STEPS = 16, 6.0, 120


def stream(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    steps = np.arange(STEPS)
    loss = (8.0 * np.exp(-steps / 40) + 3.0 + 0.05 * rng.standard_normal(STEPS)).astype(np.float32)
    grad_norm = (1.0 + 0.3 * np.exp(-steps / 20) + 0.02 * rng.standard_normal(STEPS)).astype(np.float32)
    loss[[3, 30, 31, 32, 70, 100]] += np.float32(5.0)  # 3: too early; 30-32: in a row
    grad_norm[[50, 51, 90]] *= np.float32(4.0)
    return loss, grad_norm


def olmo_core_decisions(loss, grad_norm, clipping: bool) -> np.ndarray:
    param = torch.nn.Parameter(torch.ones(4))
    optim = SkipStepAdamW([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                          rolling_interval_length=WINDOW, sigma_factor=int(SIGMA))
    skipped = []
    for i, (lo, gn) in enumerate(zip(loss, grad_norm)):
        param.grad = torch.full((4,), 0.1 * (i % 3 + 1))
        before = (param.detach().clone(), {k: v.clone() for k, v in optim.state[param].items()})
        optim.latest_loss = torch.tensor(float(lo))
        if clipping:
            optim.latest_grad_norm = torch.tensor(float(gn))
        optim.step()
        skipped.append(bool(optim.step_skipped.item()))
        if skipped[-1]:
            # What "skipped" means there: weights, moments and Adam's step count untouched.
            torch.testing.assert_close(param.detach(), before[0], rtol=0, atol=0)
            for key, value in before[1].items():
                torch.testing.assert_close(optim.state[param][key], value, rtol=0, atol=0)
    return np.array(skipped)


def our_decisions(loss, grad_norm, config: OptimConfig) -> np.ndarray:
    rule = jax.jit(functools.partial(skip_step, config=config))
    window = config.skip_step_window
    stats = {"loss_history": jnp.zeros(window), "grad_norm_history": jnp.zeros(window),
             "history_count": jnp.zeros((), jnp.int32)}
    skipped = []
    for lo, gn in zip(loss, grad_norm):
        s, stats = rule(jnp.float32(lo), jnp.float32(gn), **stats)
        skipped.append(bool(s))
    return np.array(skipped)


@pytest.mark.parametrize("clipping", [True, False], ids=["clipping", "no clipping"])
def test_skip_decisions_equal_olmo_core(clipping):
    loss, grad_norm = stream()
    config = OptimConfig(skip_step_window=WINDOW, skip_step_std=SIGMA, clip_grad_norm=1.0 if clipping else None)
    assert config.skip_history_needed == WINDOW // 2 - 1  # OLMo-core's max(2, window // 2) counts this step
    ours, reference = our_decisions(loss, grad_norm, config), olmo_core_decisions(loss, grad_norm, clipping)
    np.testing.assert_array_equal(ours, reference)
    # The stream exercises what it should: the early spike passes, later ones are caught, a
    # spike that entered the window hides the next ones, and grad-norm spikes count only
    # when the train module clips (and so records the norm).
    assert not reference[3] and reference[30] and reference[70] and reference[100]
    assert not reference[31:33].all()
    assert reference[50] == clipping


def test_a_different_window_or_min_history_would_be_seen():
    loss, grad_norm = stream()
    reference = olmo_core_decisions(loss, grad_norm, clipping=True)
    for changed in (dict(skip_step_window=WINDOW * 2), dict(skip_step_min_history=2)):
        config = OptimConfig(**{"skip_step_window": WINDOW, "skip_step_std": SIGMA, **changed})
        ours = our_decisions(loss, grad_norm, config)
        assert not np.array_equal(ours, reference), changed


def test_non_finite_steps_are_skipped_and_kept_out_of_the_window():
    """Our one deliberate difference: OLMo-core would record the NaN and skip every later step."""
    config = OptimConfig(skip_step_window=WINDOW, skip_step_std=SIGMA)
    loss, grad_norm = stream()
    loss[60] = np.nan
    ours = our_decisions(loss, grad_norm, config)
    assert ours[60] and not ours[61:70].any()
