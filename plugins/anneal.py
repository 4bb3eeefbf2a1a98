"""Stage 2, mid-training / anneal: `python -m olmo_eqx +stage=anneal checkpoint.load=PATH`.

Starts from stage-1 weights and trains on a new mix with its own recipe (OLMo 3 7B: LR
2.0712e-4, no warmup, linear decay to exactly 0 at the last step, its own batch and seed;
docs/olmo3.md section 3). `conf/stage/anneal.yaml` sets those as the defaults of the ordinary
keys (`optim.lr`, `schedule`, `data.seed`), so every one of them is overridden the usual way.

    checkpoint.load   what to start from: a run dir of ours, its checkpoints dir, one step dir,
                      or a HF OLMo model dir (read with `olmo_eqx.load_hf`)
    stage.optimizer   keep: continue the checkpoint's Adam moments; reset: a fresh optimiser;
                      auto (default): keep when the checkpoint has them (ours), reset for HF

The model's architecture comes from the checkpoint (`model.attention_impl`, `remat` and
`compute_dtype` still apply). The anneal counts its own steps from 0, with a fresh data
position and fresh skip-step statistics. It writes the same checkpoints as pretraining and
resumes the same way: once its own checkpoint dir holds a checkpoint, that wins over
`checkpoint.load`.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config
from olmo_eqx.warm_start import Optimizer


@dataclass(frozen=True)
class AnnealSettings:
    """`stage.*` of the anneal stage."""

    # keep | reset | auto (keep for our checkpoints, reset for HF weights, which have none).
    optimizer: Optimizer = "auto"


class Anneal:
    """Stage 2: anneal (mid-train) from stage-1 weights on a new mix, LR linearly to 0."""

    description = (
        "Stage 2: anneal / mid-train from a checkpoint (checkpoint.load=...) on a new mix, "
        "LR 2.0712e-4 linearly to 0 (resumes by itself)"
    )
    config_class = AnnealSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.config import stage_settings
        from olmo_eqx.train.loop import train  # jax is imported only when a stage runs
        from olmo_eqx.warm_start import note_model, resume_config, source, with_runtime_fields

        settings = stage_settings(self, "anneal", config.stage or {})
        run_dir = Path(run_dir).resolve()
        config = dataclasses.replace(config, stage=settings)
        if (resumed := resume_config(config, run_dir)) is not None:
            return train(resumed, run_dir)
        start = source("anneal", config, settings.optimizer)
        model = with_runtime_fields(start.model_config, config)
        note_model("anneal", model, config.model)
        config = dataclasses.replace(config, model=model)
        return train(config, run_dir, init_state=start.init_state)
