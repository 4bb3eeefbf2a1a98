"""`python -m olmo_eqx +stage=eval checkpoint.load=<run dir | checkpoints dir | step dir | HF dir>`.

Held-out loss, perplexity and bits per byte per set, and OLMES downstream tasks (RC and MC),
printed as tables (each task's primary metric named, with its standard error and chance) and
written to `eval.json` and `summary.json` in the run directory: `<run>.eval/` next to a run of
ours unless hydra.run.dir says otherwise. See docs/evaluation.md.
"""

from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config
from olmo_eqx.evaluation.settings import EvalSettings


class Eval:
    """Evaluate a checkpoint (ours or HF): held-out loss/perplexity/bpb per set, downstream tasks."""

    description = "Evaluate checkpoint.load (ours or HF): held-out loss/ppl/bpb per set, OLMES tasks (RC/MC)"
    config_class = EvalSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.evaluation.run import run_eval  # an EvalError is a RunError: the CLI says it in one line

        return run_eval(config, run_dir)
