"""The official OLMo 3 recipes as presets (`+recipe=NAME`, conf/recipe/): each composes, and each
number is held to OLMo-core's official script for its stage, transcribed in
tests/olmo_core_recipes.py (OLMo-core file and commit cited there)."""

import math

import pytest

from olmo_eqx.config import compose_config
from olmo_eqx.data.mixes import read_mix
from olmo_eqx.train.memory import micro_batch_candidates

from clihelp import olmo_eqx
from olmo_core_recipes import COMMON, OFFICIAL

STAGE = {"olmo3_7b_stage1": "pretrain", "olmo3_7b_stage2": "anneal", "olmo3_7b_stage3": "long_context",
         "olmo3_32b_stage1": "pretrain"}
# OLMo-core's activation checkpointing -> the nearest remat policy here (the presets' comments
# say why): none; the feed-forward blocks recomputed; half the activation memory kept.
REMAT = {None: "none", "feed_forward": "save_attention", "budget 0.5": "save_projections"}
# OLMo-core's DataMix names -> its manifest files.
MIX_FILES = {"OLMo_mix_0625_official": 1016, "OLMo_midtraining_mix_0625_100B": 11933,
             "OLMo_longmino_mix_0625": 998, "OLMo_mix_0925_official": 950}


def _manifest(mix: str) -> str:
    """OLMo-core's manifest file of a DataMix member (its value with dashes: `DataMix.build`)."""
    return "olmo_core:" + mix.replace("_", "-") + ".txt"


@pytest.mark.parametrize("recipe", sorted(OFFICIAL))
def test_each_preset_is_its_official_script_setting_for_setting(recipe):
    script = OFFICIAL[recipe]
    config = compose_config([f"+stage={STAGE[recipe]}", f"+recipe={recipe}"])
    model, optim, schedule, data, trainer, mesh, ckpt = (config.model, config.optim, config.schedule,
                                                        config.data, config.trainer, config.mesh, config.checkpoint)
    assert model.name == script["model"].lower()
    assert model.vocab_size == COMMON["vocab_size"] and model.padded_vocab_size % 128 == 0
    # The optimiser every script shares.
    assert (optim.b1, optim.b2) == COMMON["betas"] and optim.eps == COMMON["eps"]
    assert optim.weight_decay == COMMON["weight_decay"] and optim.decay_embedding == COMMON["decay_embedding"]
    assert optim.clip_grad_norm == COMMON["max_grad_norm"] and optim.z_loss_weight == COMMON["z_loss_multiplier"]
    assert (optim.skip_step_window, optim.skip_step_std) == (COMMON["skip_step_rolling_interval"], COMMON["skip_step_sigma_factor"])
    assert optim.lr == script["lr"]
    assert (schedule.name, schedule.warmup_steps, schedule.final_lr_ratio) == script["scheduler"]
    assert schedule.total_steps is None  # the schedule spans trainer.steps
    # Data: batch, sequence, seed, mix, filter, masking.
    assert data.sequence_length == script["sequence_length"]
    assert data.global_batch_size * data.sequence_length == script["global_batch_tokens"]
    assert data.seed == script["data_seed"]
    assert data.source == _manifest(script["mix"])
    assert data.data_root == "https://olmo-data.org" and data.tokenizer == "allenai/dolma2-tokenizer"
    files = [p for s in read_mix(data.source, data.data_root, data.tokenizer) for p in s.paths]
    assert len(files) == MIX_FILES[script["mix"]]
    assert data.heldout == {"v3_small": "olmo_core:v3-small-ppl-validation.txt"}
    assert data.filter_repeated_ngrams == (script["instance_filter"] is not None)
    if script["instance_filter"]:
        from olmo_eqx.data.instances import NGRAM_MAX_COUNT, NGRAM_MAX_PERIOD, NGRAM_MIN_PERIOD

        assert (NGRAM_MAX_PERIOD, NGRAM_MIN_PERIOD, NGRAM_MAX_COUNT) == script["instance_filter"]
    assert data.document_masking == script.get("document_masking", False)
    # Duration: OLMo-core counts steps as ceil(tokens / tokens per step); a hard stop is stop_at.
    if script["max_duration_tokens"] is not None:
        assert trainer.steps == math.ceil(script["max_duration_tokens"] / script["global_batch_tokens"])
    assert trainer.stop_at == script["hard_stop_step"]
    # Cadences: progress = metrics interval; held-out evaluation = the LM evaluator's (0: none);
    # checkpoints: the ephemeral interval with the newest kept, every permanent one kept.
    assert trainer.log_every == script["metrics_collect_interval"]
    # (Stage 3 evaluates once, at its last step: the stage compares held-out loss before and after.)
    without_evaluator = trainer.steps if STAGE[recipe] == "long_context" else 0
    assert trainer.eval_every == (script["lm_evaluator"][1] if script["lm_evaluator"] else without_evaluator)
    # In-loop downstream evaluation: the script's cadence and its "fast" tasks (those with OLMES
    # request files: not its 8 MMLU tasks), whole tasks, with the dolma2 tokenizer.
    assert trainer.downstream_every == (script["downstream_eval_interval"] or 0)
    if script["downstream_eval_interval"] is not None:
        assert sorted(trainer.downstream.tasks) == sorted(t for t in script["downstream_tasks"] if not t.startswith("mmlu_"))
        assert trainer.downstream.limit is None and "dolma2-tokenizer" in trainer.downstream.tokenizer
    assert ckpt.every == (script["ephemeral_save_interval"] or script["save_interval"])
    assert ckpt.keep_every == script["save_interval"] and ckpt.keep_last == 1
    # Layout on the script's GPUs: bf16 compute over float32 weights (reductions in float32),
    # HSDP's shard degree, the rank's micro-batch, the nearest remat policy.
    assert (model.compute_dtype, model.param_dtype) == (COMMON["param_dtype"], COMMON["reduce_dtype"])
    cp = script.get("context_parallel_degree", 1)
    assert mesh.context == cp
    if cp == 1:
        assert (mesh.data, mesh.fsdp) == (-1, script["hsdp_shard_degree"] or COMMON["gpus_per_node"])
    per_rank_tokens = script["global_batch_tokens"] // (script["gpus"] // cp)
    # The recipe takes the fewest micro-batches that fit on the devices at hand; on the script's
    # own GPUs its count is one of those auto may choose.
    assert trainer.micro_batches == "auto"
    script_micro_batches = max(1, per_rank_tokens // script["rank_microbatch_tokens"])
    assert script_micro_batches in micro_batch_candidates(data.global_batch_size, script["gpus"] // cp)
    assert model.remat == REMAT[script["activation_checkpointing"]]
    # Stages after the first keep the optimiser state they load.
    if script["load_optim_state"]:
        assert config.stage["optimizer"] == "keep"
    if "yarn" in script:
        assert tuple(config.stage[k] for k in ("yarn_factor", "yarn_beta_fast", "yarn_beta_slow", "original_context")) == script["yarn"]
        assert data.eos_token_id == COMMON["eos_token_id"] and not data.reset_positions_per_document


def test_a_recipes_values_can_still_be_overridden_and_shown():
    config = compose_config(["+stage=pretrain", "+recipe=olmo3_7b_stage1", "data.data_root=s3://ai2-llm"])
    assert config.data.data_root == "s3://ai2-llm" and config.trainer.steps == 1_192_093
    # The planner composes the run's overrides without a stage: the preset is one of them.
    assert compose_config(["+recipe=olmo3_7b_stage3"]).mesh.context == 8
    shown = olmo_eqx("+stage=pretrain", "+recipe=olmo3_7b_stage1", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr
    assert "steps: 1192093" in shown.stdout and "source: olmo_core:OLMo-mix-0625-official.txt" in shown.stdout
    assert "compute_dtype: bfloat16" in shown.stdout
    # A plain OLMo 3 shows no settings of other architectures (hybrid, mixture of experts).
    assert "layer_pattern" not in shown.stdout and "gdn_" not in shown.stdout and "n_experts" not in shown.stdout
