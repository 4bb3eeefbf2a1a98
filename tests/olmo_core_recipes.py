"""OLMo-core's official OLMo 3 training scripts, transcribed: what tests/test_recipes.py holds the
presets of conf/recipe/ to.

Source: https://github.com/allenai/OLMo-core at commit fa6c5014c9f6e9ee789da2d9c20d5126fee8df0d,
`src/scripts/official/OLMo3/<script>`; the GPU counts from that folder's README.md, the last
checkpoints from its OLMo-3-1025-7B.csv and OLMo-3-1025-32B.csv; a default the script leaves
to the library from the file named beside it. Each entry says what the script says, in the
script's own units (tokens, not steps); the test derives our settings from it.
"""

COMMIT = "fa6c5014c9f6e9ee789da2d9c20d5126fee8df0d"

# What every script below shares: `SkipStepAdamWConfig(lr=LR, weight_decay=0.1, betas=(0.9,
# 0.95), group_overrides=[embeddings.weight: weight_decay 0.0])`, `z_loss_multiplier=1e-5`,
# `max_grad_norm=1.0`, `TokenizerConfig.dolma2()`, HSDP with `param_dtype=bfloat16,
# reduce_dtype=float32`.
COMMON = {
    "betas": (0.9, 0.95),
    "eps": 1e-8,  # SkipStepAdamWConfig's default (olmo_core/optim/adamw.py)
    "weight_decay": 0.1,
    "decay_embedding": False,
    "max_grad_norm": 1.0,
    "z_loss_multiplier": 1e-5,
    # SkipStepOptimizer's defaults (olmo_core/optim/skip_step_optimizer.py).
    "skip_step_rolling_interval": 128,
    "skip_step_sigma_factor": 6,
    "param_dtype": "bfloat16",
    "reduce_dtype": "float32",
    # TokenizerConfig.dolma2() (olmo_core/data/tokenizer.py); padded to a multiple of 128.
    "vocab_size": 100278,
    "eos_token_id": 100257,
    "gpus_per_node": 8,  # H100 nodes: HSDP's default shard degree is the GPUs of a node
}

# The in-loop downstream evaluator's "fast" task set (OLMo-core's task names), the same in the 7B
# stage-1 and the 32B scripts (`trainer.downstream.tasks` of those presets).
FAST_TASKS = (
    "arc_challenge_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast", "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast", "hellaswag_bpb_5shot", "mmlu_humanities_test_bpb_5shot",
    "mmlu_humanities_test_mc_5shot_fast", "mmlu_other_test_bpb_5shot", "mmlu_other_test_mc_5shot_fast",
    "mmlu_social_sciences_test_bpb_5shot", "mmlu_social_sciences_test_mc_5shot_fast", "mmlu_stem_test_bpb_5shot",
    "mmlu_stem_test_mc_5shot_fast", "basic_skills_arithmetic_rc_5shot", "basic_skills_coding_rc_5shot",
    "basic_skills_common_knowledge_rc_5shot", "basic_skills_logical_reasoning_rc_5shot", "basic_skills_pattern_rc_5shot",
    "basic_skills_string_operations_rc_5shot", "codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot",
    "minerva_math_500_gold_bpb_0shot", "mt_mbpp_cpp_gold_bpb_3shot", "mt_mbpp_java_gold_bpb_3shot",
    "mt_mbpp_rust_gold_bpb_3shot", "copycolors_10way_fast",
)

OFFICIAL = {
    "olmo3_7b_stage1": {
        "script": "OLMo-3-1025-7B-pretrain-1.py",
        "gpus": 512,
        "model": "olmo3_7B",
        "mix": "OLMo_mix_0625_official",
        "sequence_length": 8192,
        "global_batch_tokens": 8192 * 512,
        "data_seed": 34521,
        "lr": 3e-4,
        # CosWithWarmup(warmup_steps=2000): alpha_f defaults to 0.1 (olmo_core/optim/scheduler.py).
        "scheduler": ("cosine", 2000, 0.1),
        "max_duration_tokens": int(5e12),  # "Originally scheduled for 5T"
        "hard_stop_step": 597046,  # then OLMo-3-1025-7B-pretrain-2.py extended it to 7T
        "rank_microbatch_tokens": 2 * 8192,
        "hsdp_shard_degree": None,  # the default: one node
        "activation_checkpointing": None,
        "save_interval": 1000,
        "ephemeral_save_interval": None,
        "metrics_collect_interval": 10,
        "lm_evaluator": ("v3_small_ppl_validation", 10_000),
        "downstream_eval_interval": 10_000,
        "downstream_tasks": FAST_TASKS,
        "instance_filter": None,
        "load_optim_state": None,  # from scratch
    },
    "olmo3_7b_stage2": {
        "script": "OLMo-3-1025-7B-midtrain.py",
        "gpus": 128,
        "model": "olmo3_7B",
        "mix": "OLMo_midtraining_mix_0625_100B",
        "sequence_length": 8192,
        "global_batch_tokens": 2**21,
        "data_seed": 1337,
        "lr": 0.00020712352850360292,
        "scheduler": ("linear", 0, 0.0),  # LinearWithWarmup(warmup=0, alpha_f=0.0)
        "max_duration_tokens": 100_000_000_000,
        "hard_stop_step": None,
        "rank_microbatch_tokens": 2 * 8192,
        "hsdp_shard_degree": None,
        # TransformerActivationCheckpointingConfig(mode=selected_modules, modules=["blocks.*.feed_forward"])
        "activation_checkpointing": "feed_forward",
        "save_interval": 1000,
        "ephemeral_save_interval": 100,
        "metrics_collect_interval": 5,  # TrainerConfig's default (olmo_core/train/config.py)
        "lm_evaluator": None,
        "downstream_eval_interval": None,
        "instance_filter": None,
        "load_optim_state": True,  # from stage 1's step 1413814
    },
    "olmo3_7b_stage3": {
        "script": "OLMo-3-1025-7B-long-context.py",
        "gpus": 256,
        "model": "olmo3_7B",
        "mix": "OLMo_longmino_mix_0625",
        "sequence_length": 65536,
        "global_batch_tokens": 65536 * 64,
        "data_seed": 34521,
        "lr": 0.00020712352850360292,
        "scheduler": ("linear", 200, 0.0),  # LinearWithWarmup(warmup=200, alpha_f=0.0)
        # The script's max_duration (5e12 tokens) and hard_stop (597046) are stage 1's, copied;
        # the run trained 50B tokens (the folder's README) and its last checkpoint is step 11921
        # (OLMo-3-1025-7B.csv), so 50B is the duration taken here.
        "max_duration_tokens": 50_000_000_000,
        "hard_stop_step": None,
        "rank_microbatch_tokens": 65536,  # "for CP we want only 1 instance per rank"
        "hsdp_shard_degree": 1,
        "context_parallel_degree": 8,
        "activation_checkpointing": None,
        # YaRNRoPEScalingConfig(factor=8, beta_fast=32, beta_slow=1, old_context_len=8192)
        "yarn": (8.0, 32.0, 1.0, 8192),
        "document_masking": True,  # generate_doc_lengths=True
        "save_interval": 1000,
        "ephemeral_save_interval": None,
        "metrics_collect_interval": 10,
        "lm_evaluator": None,
        "downstream_eval_interval": None,
        "instance_filter": None,
        "load_optim_state": True,  # from stage 2's step 47684
        # Not carried over (no counterpart here): Float8Config(enabled=True), the packed
        # dataset (NumpyPackedFSLDatasetConfig, source_group_size=8, source_permutation_seed=123).
    },
    "olmo3_32b_stage1": {
        "script": "OLMo-3-1025-32B-pretrain.py",
        "gpus": 1024,
        "model": "olmo3_32B",
        "mix": "OLMo_mix_0925_official",
        "sequence_length": 8192,
        "global_batch_tokens": 8 * 1024 * 1024,
        "data_seed": 34521,
        "lr": 6e-4,
        "scheduler": ("cosine", 2000, 0.1),
        # Duration.epochs(1): one epoch of the mix, whose size is the sum of 950 remote files'.
        "max_duration_tokens": None,
        # Stage 2 started from step 656000 (load_path of OLMo-3-1025-32B-midtrain-ingredient-1.py).
        "hard_stop_step": 656000,
        "rank_microbatch_tokens": 8192,
        "hsdp_shard_degree": 64,
        # TransformerActivationCheckpointingConfig(mode=budget, activation_memory_budget=0.5)
        "activation_checkpointing": "budget 0.5",
        "save_interval": 1000,
        "ephemeral_save_interval": None,
        "metrics_collect_interval": 50,
        "lm_evaluator": ("v3_small_ppl_validation", 1000),
        "downstream_eval_interval": 1000,
        "downstream_tasks": FAST_TASKS,
        # InstanceFilterConfig(repetition_max_period=13, repetition_min_period=1, repetition_max_count=32)
        "instance_filter": (13, 1, 32),
        "load_optim_state": None,
    },
}
