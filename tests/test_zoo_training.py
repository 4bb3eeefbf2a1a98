"""OLMo-Hybrid and OLMo 1 train on the embedded corpus through the pretrain stage's loop:
the loss falls, a checkpoint is written, restored and resumed from, and the resumed steps are
the uninterrupted run's. Nano shapes and 64-token sequences keep each model to seconds."""

import json
import shutil

import pytest

from olmo_eqx.config import compose_config
from olmo_eqx.train.loop import train

# A nano width for each (olmo_hybrid_tiny / olmo1_tiny at a quarter of the width); the hybrid
# keeps its [gdn, gdn, gdn, attention] cycle, and a 16-token chunk puts 4 chunks in a sequence.
MODELS = {
    "olmo_hybrid_tiny": ["model.gdn_key_dim=16", "model.gdn_value_dim=16", "model.gdn_chunk_size=16"],
    "olmo1_tiny": [],
}
NANO = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=16", "model.mlp_hidden=128"]
RUN = [
    "+stage=pretrain",
    "data.sequence_length=64",
    "data.global_batch_size=8",
    "trainer.steps=10",
    "trainer.log_every=5",
    "trainer.eval_every=10",
    "trainer.eval_batches=1",
    "schedule.warmup_steps=2",
    "checkpoint.every=5",
    "trainer.loggers=[jsonl]",
    "optim.lr=3e-3",
]


def losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("name", MODELS)
def test_trains_checkpoints_and_resumes(name, tmp_path):
    overrides = RUN + [f"model={name}"] + NANO + MODELS[name]
    run_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    summary = train(compose_config(overrides), run_dir)
    reference = losses(run_dir)
    assert summary["stage_completed"] and sorted(reference) == list(range(1, 11))
    assert reference[10] < reference[1] - 0.5, reference  # it learns
    assert summary["final_heldout_loss"] < reference[1]

    # Resume from the step-5 checkpoint of the same run (its later one removed): steps 6-10 again.
    shutil.copytree(run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "10")
    (resumed_dir / "metrics.jsonl").write_text("")
    resumed = train(compose_config(overrides), resumed_dir)
    assert resumed["start_step"] == 5 and resumed["stage_completed"]
    again = losses(resumed_dir)
    assert sorted(again) == list(range(6, 11))
    for step in again:
        assert again[step] == pytest.approx(reference[step], rel=1e-6, abs=0), (step, again, reference)
