"""Stage 1: pretraining, `python -m olmo_eqx +stage=pretrain`.

Trains `model` on `data` with the OLMo 3 recipe (`optim`, `schedule`) for `trainer.steps`
steps, resuming by itself from the latest checkpoint in the run directory. Registered in
pyproject.toml under `olmo_eqx.stages`, exactly as a third-party stage would be.
"""

from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config


class Pretrain:
    """Stage 1: pretrain (or resume) a model with the OLMo 3 recipe."""

    description = "Stage 1: pretrain a model from scratch with the OLMo 3 recipe (resumes by itself)"
    config_class = None  # no settings of its own: it reads the top-level groups

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.stages import StageError
        from olmo_eqx.train.loop import train  # jax is imported only when a stage runs

        if config.checkpoint.load:
            raise StageError(
                "pretrain starts from scratch or resumes its own checkpoints (checkpoint.dir); "
                "checkpoint.load is for later stages (anneal, eval): drop it or run one of those"
            )
        return train(config, run_dir)
