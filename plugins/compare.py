"""`python -m olmo_eqx +stage=compare checkpoint.load=A stage.against=B`.

The four-surface parity report between two models (ours or HF): held-out loss, downstream
accuracy per task, per-domain perplexity and token-level KL divergence, side by side with
differences, as `compare.md`, `compare.json` and `compare_domains.png`, in `<A's run>.compare/`
unless hydra.run.dir says otherwise. See docs/evaluation.md.
"""

from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config
from olmo_eqx.evaluation.settings import CompareSettings


class Compare:
    """Parity report of two models: held-out loss, downstream accuracy, per-domain perplexity, KL."""

    description = "Parity report of checkpoint.load vs stage.against: held-out loss, tasks, per-domain ppl, KL"
    config_class = CompareSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.evaluation.run import run_compare  # an EvalError is a RunError: the CLI says it in one line

        return run_compare(config, run_dir)
