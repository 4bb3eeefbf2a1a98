"""The official OLMo 3 recipes as presets (`+recipe=NAME`, conf/recipe/): each composes, and each
number is held to docs/olmo3.md (the paper's and OLMo-core's figures)."""

from olmo_eqx.config import compose_config
from olmo_eqx.data.mixes import read_mix

from clihelp import olmo_eqx


def test_olmo3_7b_stage1_is_the_official_recipe():
    config = compose_config(["+stage=pretrain", "+recipe=olmo3_7b_stage1"])
    model, optim, schedule, data = config.model, config.optim, config.schedule, config.data
    assert model.name == "olmo3_7b" and model.vocab_size == 100278
    # Section 3: AdamW (0.9, 0.95, 1e-8), wd 0.1 not on the embedding, clipping 1.0, z-loss 1e-5,
    # skip-step at mean + 6 std over 128 steps.
    assert (optim.b1, optim.b2, optim.eps, optim.weight_decay) == (0.9, 0.95, 1e-8, 0.1)
    assert not optim.decay_embedding and optim.clip_grad_norm == 1.0 and optim.z_loss_weight == 1e-5
    assert (optim.skip_step_window, optim.skip_step_std) == (128, 6.0)
    # Peak lr 3e-4, 2000 warmup steps, cosine to 0.1x peak over the run.
    assert optim.lr == 3e-4
    assert (schedule.name, schedule.warmup_steps, schedule.final_lr_ratio, schedule.total_steps) == ("cosine", 2000, 0.1, None)
    # Batch 512 x 8192 = 4,194,304 tokens; 1,413,814 steps (about 5.93T tokens); data seed 34521.
    assert (data.global_batch_size, data.sequence_length) == (512, 8192)
    assert data.global_batch_size * data.sequence_length == 4_194_304
    assert config.trainer.steps == 1_413_814
    assert round(config.trainer.steps * 4_194_304 / 1e12, 2) == 5.93
    assert data.seed == 34521
    # Plain causal attention across documents in stage 1; the official 950-file mix at its root.
    assert not data.document_masking and not data.filter_repeated_ngrams
    assert data.source == "olmo_core:OLMo-mix-0925-official.txt" and data.tokenizer == "allenai/dolma2-tokenizer"
    assert data.data_root == "https://olmo-data.org"
    files = [p for s in read_mix(data.source, data.data_root, data.tokenizer) for p in s.paths]
    assert len(files) == 950
    assert data.heldout == {"v3_small": "olmo_core:v3-small-ppl-validation.txt"}


def test_a_recipes_values_can_still_be_overridden_and_shown():
    config = compose_config(["+stage=pretrain", "+recipe=olmo3_7b_stage1", "data.data_root=s3://ai2-llm"])
    assert config.data.data_root == "s3://ai2-llm" and config.trainer.steps == 1_413_814
    # The planner composes the run's overrides without a stage: the preset is one of them.
    assert compose_config(["+recipe=olmo3_7b_stage1"]).data.global_batch_size == 512
    shown = olmo_eqx("+stage=pretrain", "+recipe=olmo3_7b_stage1", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr
    assert "steps: 1413814" in shown.stdout and "source: olmo_core:OLMo-mix-0925-official.txt" in shown.stdout
