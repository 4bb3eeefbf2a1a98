"""Training trajectories: olmo_eqx's train step against the PyTorch reference loop, in float32.

30 steps of stage 1 (warmup + cosine), then 10 of stage 2 (linear decay to exactly 0) from the
stage-1 weights and optimiser state; same initial weights (exported with `save_hf`), same
batches from our sampler on the embedded corpus, the same recipe written twice.

Bounds: per-step loss and grad norm within 1e-4 relative at every step of both stages; final
weights within FINAL_WEIGHTS_RTOL per tensor. Measured on olmo3_tiny (MHA and GQA): loss <= 4e-7,
grad norm <= 6e-5, weights <= 2.4e-4 (the embedding of the GQA model: Adam turns the float32
rounding of an embedding row's near-zero gradients into whole steps of the learning rate).
Both sides count steps from 1 for the schedule, as OLMo-core's trainer does; the comparison
with OLMo-core's own code is tests/test_olmo_core_trajectory.py. Peak learning rates are 1e-3 / 6e-4: at
3e-3 this tiny model trains at the edge of stability, where even two of *our own* attention
implementations (XLA vs the plain reference) drift apart by 2e-4 in grad norm through float32
rounding alone, so no bound on a reference comparison would mean anything there.
"""

import numpy as np
import pytest

from trajectory_harness import STAGE1, STAGE2, run_both

STEP_RTOL = 1e-4
FINAL_WEIGHTS_RTOL = 4e-4  # measured worst 2.34e-4


# One model: the trajectory checks the train step (loss, clipping, AdamW, schedules, stage
# hand-over), which is the same for every attention layout; GQA's forward and gradients are held
# to HF's at 1e-5 in tests/test_model_parity.py. (olmo3_tiny_gqa passes too, with the bounds
# above: add it here to see; it costs 33 s of the suite.)
@pytest.fixture(scope="module", params=["olmo3_tiny"])
def comparison(request, tmp_path_factory):
    return request.param, run_both(tmp_path_factory.mktemp(request.param), model_name=request.param)


def _relative(ours, reference) -> np.ndarray:
    ours, reference = np.asarray(ours), np.asarray(reference)
    return np.abs(ours - reference) / np.abs(reference)


def test_both_sides_learn_and_follow_the_same_schedule(comparison):
    _, result = comparison
    for stage in (STAGE1, STAGE2):
        ours, ref = result.ours[stage.name], result.torch[stage.name]
        assert len(ours.losses) == len(ref.losses) == stage.steps
        np.testing.assert_allclose(ours.lrs, ref.lrs, rtol=1e-6, atol=1e-12)
    assert result.ours[STAGE2.name].lrs[-1] == 0.0
    assert result.ours[STAGE1.name].losses[-1] < result.ours[STAGE1.name].losses[0] - 1.0


@pytest.mark.parametrize("stage", [STAGE1, STAGE2], ids=lambda s: s.name)
@pytest.mark.parametrize("metric", ["losses", "grad_norms"])
def test_every_step_matches_reference(comparison, stage, metric):
    name, result = comparison
    diff = _relative(getattr(result.ours[stage.name], metric), getattr(result.torch[stage.name], metric))
    print(f"{name} {stage.name}: max relative {metric} difference {diff.max():.2e} (step {diff.argmax()})")
    assert diff.max() <= STEP_RTOL


def test_final_weights_match_reference(comparison):
    name, result = comparison
    differences = result.weight_differences(STAGE2.name)
    worst = max(differences, key=differences.get)
    print(f"{name}: worst final weight difference {differences[worst]:.2e} ({worst})")
    assert differences[worst] <= FINAL_WEIGHTS_RTOL


# The bounds' power to fail: a recipe change on one side only.
def test_a_one_sided_recipe_change_breaks_parity(comparison, tmp_path):
    """Decaying the embedding on the reference side only must fail the bounds above."""
    name, result = comparison
    broken = run_both(tmp_path, model_name=name, stages=(STAGE1,), torch_decays_embedding=True,
                      our_result={STAGE1.name: result.ours[STAGE1.name]})
    loss_diff = _relative(result.ours[STAGE1.name].losses, broken.torch[STAGE1.name].losses).max()
    embedding_diff = broken.weight_differences(STAGE1.name)["model.embed_tokens.weight"]
    print(f"{name}, embedding decayed on one side: loss {loss_diff:.2e}, embedding weights {embedding_diff:.2e}")
    assert embedding_diff > 3 * FINAL_WEIGHTS_RTOL  # decay over stage 1: about 0.1 * sum(lr) = 1.6e-3
