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


def _files(data):
    return [p for s in read_mix(data.source, data.data_root, data.tokenizer) for p in s.paths]


def _same_optimizer_as_stage1(optim):
    # OLMo-core's skip-step AdamW and z-loss in every stage (docs/olmo3.md section 3).
    assert (optim.b1, optim.b2, optim.eps, optim.weight_decay) == (0.9, 0.95, 1e-8, 0.1)
    assert not optim.decay_embedding and optim.clip_grad_norm == 1.0 and optim.z_loss_weight == 1e-5
    assert (optim.skip_step_window, optim.skip_step_std) == (128, 6.0)


def test_olmo3_7b_stage2_is_the_official_recipe():
    config = compose_config(["+stage=anneal", "+recipe=olmo3_7b_stage2"])
    optim, schedule, data = config.optim, config.schedule, config.data
    assert config.model.name == "olmo3_7b"
    _same_optimizer_as_stage1(optim)
    # LR 2.0712e-4, no warmup, linear to 0; 256 x 8192 = 2,097,152 tokens a step for 47,684 steps
    # (100B tokens); seed 1337; from the stage-1 weights (the anneal stage's checkpoint.load).
    assert optim.lr == 2.0712e-4
    assert (schedule.name, schedule.warmup_steps, schedule.final_lr_ratio, schedule.total_steps) == ("linear", 0, 0.0, None)
    assert (data.global_batch_size, data.sequence_length) == (256, 8192)
    assert config.trainer.steps == 47_684 and round(47_684 * 256 * 8192 / 1e9) == 100
    assert data.seed == 1337 and not data.document_masking
    assert config.stage == {"optimizer": "auto"}
    assert data.source == "olmo_core:OLMo-midtraining-mix-0925-ingredient1-100B.txt"
    files = _files(data)
    assert len(files) == 12252 and all(f.startswith("https://olmo-data.org/preprocessed/dolma3_dolmino_0925/") for f in files)
    assert "/allenai/dolma3-tokenizer/" in files[0]  # OLMo-core's directory for its OLMo 3 mixes
    assert data.heldout == {"v3_small": "olmo_core:v3-small-ppl-validation.txt"}


def test_olmo3_7b_stage3_is_the_official_recipe():
    config = compose_config(["+stage=long_context", "+recipe=olmo3_7b_stage3"])
    optim, schedule, data = config.optim, config.schedule, config.data
    assert config.model.name == "olmo3_7b"
    _same_optimizer_as_stage1(optim)
    # Sequence 65,536, batch 64 (4,194,304 tokens a step), 50B tokens: 11,921 steps.
    assert (data.global_batch_size, data.sequence_length) == (64, 65_536)
    assert config.trainer.steps == 11_921 == -(-50_000_000_000 // (64 * 65_536))
    # LR 2.07e-4, 200 warmup steps then linear to 0.
    assert optim.lr == 2.07e-4
    assert (schedule.name, schedule.warmup_steps, schedule.final_lr_ratio) == ("linear", 200, 0.0)
    # Document masking at EOS, positions continuing across documents (the 2025 runs).
    assert data.document_masking and not data.reset_positions_per_document and data.eos_token_id == 100257
    # From the stage-2 checkpoint with its optimiser state; YaRN factor 8 over 8192, betas 32 / 1.
    assert config.stage == {"optimizer": "keep", "yarn_factor": 8.0, "yarn_beta_fast": 32.0,
                            "yarn_beta_slow": 1.0, "original_context": 8192}
    # Context parallelism of degree 8.
    assert config.mesh.context == 8
    assert data.source == "olmo_core:OLMo-longmino-mix-0625.txt"
    files = _files(data)
    assert len(files) == 998 and "/preprocessed/dolma3_longmino_0625/allenai/dolma3-tokenizer/" in files[0]


def test_the_stage_presets_show_with_cfg_job():
    # The planner composes the run's overrides without a stage: each preset is one of them.
    assert compose_config(["+recipe=olmo3_7b_stage2"]).data.global_batch_size == 256
    assert compose_config(["+recipe=olmo3_7b_stage3"]).mesh.context == 8
    for stage, recipe, line in (("anneal", "olmo3_7b_stage2", "steps: 47684"),
                                ("long_context", "olmo3_7b_stage3", "sequence_length: 65536")):
        shown = olmo_eqx(f"+stage={stage}", f"+recipe={recipe}", "--cfg", "job")
        assert shown.returncode == 0, shown.stderr
        assert line in shown.stdout


def test_olmo3_32b_stage1_is_the_official_recipe():
    from olmo_eqx.data.instances import NGRAM_MAX_COUNT, NGRAM_MAX_PERIOD, NGRAM_MIN_PERIOD

    config = compose_config(["+stage=pretrain", "+recipe=olmo3_32b_stage1"])
    model, optim, schedule, data = config.model, config.optim, config.schedule, config.data
    # OLMo-core's olmo3_32B: vocab 100278 padded to a multiple of 128.
    assert model.name == "olmo3_32b" and (model.vocab_size, model.padded_vocab_size) == (100278, 100352)
    assert model.padded_vocab_size % 128 == 0
    _same_optimizer_as_stage1(optim)
    # Peak lr 6e-4; CosWithWarmup(warmup=2000) with OLMo-core 3.0.0's default alpha_f 0.1.
    assert optim.lr == 6e-4
    assert (schedule.name, schedule.warmup_steps, schedule.final_lr_ratio, schedule.total_steps) == ("cosine", 2000, 0.1, None)
    # 8 * 1024 * 1024 tokens a step = 1024 x 8192; data seed 34521 (as the 7B).
    assert (data.global_batch_size, data.sequence_length) == (1024, 8192)
    assert data.global_batch_size * data.sequence_length == 8 * 1024 * 1024
    assert data.seed == 34521 and not data.document_masking
    # One epoch of the mix: the 7B's 1,413,814 steps of 512 instances halved (N // 1024 ==
    # (N // 512) // 2), the same tokens.
    assert config.trainer.steps == 706_907 == 1_413_814 // 2
    assert config.trainer.steps * 8 * 1024 * 1024 == 1_413_814 * 4_194_304
    # The repeated n-gram filter with OLMo-core's InstanceFilterConfig values (13, 1, 32).
    assert data.filter_repeated_ngrams and (NGRAM_MAX_PERIOD, NGRAM_MIN_PERIOD, NGRAM_MAX_COUNT) == (13, 1, 32)
    # The same 950-file mix and held-out sets as the 7B; eval and checkpoints every 1000 steps.
    assert data.source == "olmo_core:OLMo-mix-0925-official.txt" and data.data_root == "https://olmo-data.org"
    assert len(_files(data)) == 950
    assert data.heldout == {"v3_small": "olmo_core:v3-small-ppl-validation.txt"}
    assert config.trainer.eval_every == 1000 and config.checkpoint.every == 1000
    assert compose_config(["+recipe=olmo3_32b_stage1"]).data.global_batch_size == 1024
    shown = olmo_eqx("+stage=pretrain", "+recipe=olmo3_32b_stage1", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr
    assert "steps: 706907" in shown.stdout and "global_batch_size: 1024" in shown.stdout
