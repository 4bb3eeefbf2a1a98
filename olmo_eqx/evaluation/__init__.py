"""Evaluation: held-out loss / perplexity / bits per byte per domain, OLMES downstream tasks
(ranked classification and multiple choice), and the parity report between two models.

The `eval` and `compare` stages (`plugins/eval.py`, `plugins/compare.py`) are thin wrappers of
`run_eval` and `run_compare`; see docs/evaluation.md.
"""

from olmo_eqx.evaluation.downstream import METRICS, evaluate_task, score_requests, task_metrics
from olmo_eqx.evaluation.heldout import build_heldout_sets, evaluate_heldout, evaluate_kl
from olmo_eqx.evaluation.load import EvalError, ModelSource, load_model, resolve_model_source
from olmo_eqx.evaluation.requests import Request, Task, default_tasks_dir, encode_requests, read_task, score_batches
from olmo_eqx.evaluation.run import run_compare, run_eval
from olmo_eqx.evaluation.scoring import Scorer
from olmo_eqx.evaluation.settings import CompareSettings, EvalSettings
from olmo_eqx.evaluation.tokens import TextTokenizer

__all__ = [
    "METRICS", "CompareSettings", "EvalError", "EvalSettings", "ModelSource", "Request", "Scorer", "Task",
    "TextTokenizer", "build_heldout_sets", "default_tasks_dir", "encode_requests", "evaluate_heldout",
    "evaluate_kl", "evaluate_task", "load_model", "read_task", "resolve_model_source", "run_compare", "run_eval",
    "score_batches", "score_requests", "task_metrics",
]
