"""Evaluation: held-out loss / perplexity / bits per byte per domain, OLMES downstream tasks
(ranked classification and multiple choice), and the parity report between two models.

The `eval` and `compare` stages (`plugins/eval.py`, `plugins/compare.py`) are thin wrappers of
`run_eval` and `run_compare`; see docs/evaluation.md. The model under evaluation is located and
loaded by `olmo_eqx.warm_start` (`locate`, `load_model`, re-exported here).
"""

from olmo_eqx.errors import EvalError
from olmo_eqx.evaluation.downstream import METRICS, evaluate_task, score_requests, task_metrics
from olmo_eqx.evaluation.heldout import build_heldout_sets, evaluate_heldout, evaluate_kl
from olmo_eqx.evaluation.requests import Request, Task, default_tasks_dir, encode_requests, read_task, score_batches
from olmo_eqx.evaluation.run import run_compare, run_eval
from olmo_eqx.evaluation.scoring import Scorer
from olmo_eqx.evaluation.settings import CompareSettings, EvalSettings
from olmo_eqx.evaluation.tokens import TextTokenizer
from olmo_eqx.warm_start import load_model, locate

__all__ = [
    "METRICS", "CompareSettings", "EvalError", "EvalSettings", "Request", "Scorer", "Task", "TextTokenizer",
    "build_heldout_sets", "default_tasks_dir", "encode_requests", "evaluate_heldout", "evaluate_kl",
    "evaluate_task", "load_model", "locate", "read_task", "run_compare", "run_eval",
    "score_batches", "score_requests", "task_metrics",
]
