"""Downstream scoring: every choice's log-likelihood, then OLMES's metrics per task.

For each question (doc) the model scores each choice's continuation given its context; the
prediction is the choice with the highest

    acc            log-likelihood (OLMES `acc_raw`)
    acc_per_token  log-likelihood / continuation tokens (OLMES `acc_per_token`)
    acc_per_char   log-likelihood / continuation characters (OLMES `acc_per_char`)

(ties go to the lowest choice index, as numpy's argmax). `bpb` is the gold continuation's
bits per byte, -log2 p(gold) / UTF-8 bytes, averaged over questions. Ranked classification
(RC) and multiple choice (MC, continuations " A", " B", ...) are scored the same way; they
differ in what the requests ask. Tasks with one request per doc (OLMES's `gold_bpb_*` and
`bpb_*` regimes: the gold answer only) get bits per byte and no accuracy (format "bpb").
"""

import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from olmo_eqx.evaluation.requests import Encoded, Request, Task, encode_requests, score_batches
from olmo_eqx.evaluation.scoring import Scorer
from olmo_eqx.evaluation.tokens import TextTokenizer

METRICS = ("acc", "acc_per_token", "acc_per_char", "bpb")


@dataclass(frozen=True)
class RequestScores:
    """Per request, in the task's request order."""

    logprob: np.ndarray  # float64 sum of log p over the continuation's tokens
    n_tokens: np.ndarray  # int64 continuation tokens scored
    greedy: np.ndarray  # bool: every continuation token was the model's argmax


def score_requests(
    scorer: Scorer, model, tokenizer: TextTokenizer, requests: list[Request], batch_size: int, max_length: int
) -> tuple[RequestScores, int]:
    """Log-likelihood of every request's continuation; also the number of truncated requests."""
    return score_encoded(scorer, model, encode_requests(tokenizer, requests), batch_size, max_length)


def score_encoded(
    scorer: Scorer, model, encoded: list[Encoded], batch_size: int, max_length: int
) -> tuple[RequestScores, int]:
    """`score_requests` of requests already tokenised (lm-eval's rolling windows come as ids)."""
    batches, truncated = score_batches(encoded, batch_size, max_length)
    logprob = np.zeros(len(encoded), np.float64)
    n_tokens = np.zeros(len(encoded), np.int64)
    greedy = np.zeros(len(encoded), bool)
    for batch in batches:
        scores = scorer.score_choices(model, batch.input_ids, batch.targets, batch.mask, batch.last_pos,
                                      batch.last_targets)
        for r, k in zip(*np.nonzero(batch.index != -1)):
            i = batch.index[r, k]
            if i < 0:  # an empty continuation: log p = 0 over 0 tokens
                greedy[-2 - i] = True
                continue
            logprob[i] = float(scores.prefix.logprob[r]) + float(scores.last_logprob[r, k])
            n_tokens[i] = int(scores.prefix.count[r]) + 1
            greedy[i] = bool(scores.prefix.greedy[r]) and bool(scores.last_greedy[r, k])
    return RequestScores(logprob, n_tokens, greedy), truncated


def task_metrics(requests: list[Request], scores: RequestScores) -> dict:
    """OLMES metrics of one task from its requests' scores (see the module docstring)."""
    docs: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        docs.setdefault(r.doc_id, []).append(i)
    correct = {"acc": [], "acc_per_token": [], "acc_per_char": []}
    bpb = []
    for doc_id, rows in docs.items():
        rows = sorted(rows, key=lambda i: requests[i].choice)
        choices = [requests[i].choice for i in rows]
        if choices != list(range(len(rows))):
            raise ValueError(f"doc {doc_id}: choices {choices} are not 0..{len(rows) - 1}")
        # A one-request doc (OLMES's gold_bpb / bpb tasks) is its own gold, whatever its label says.
        gold = requests[rows[0]].gold if len(rows) > 1 else 0
        if not 0 <= gold < len(rows):
            raise ValueError(f"doc {doc_id}: gold choice {gold} is not one of its {len(rows)} choices")
        ll = scores.logprob[rows]
        per_token = ll / np.maximum(scores.n_tokens[rows], 1)
        per_char = ll / np.array([max(len(requests[i].continuation), 1) for i in rows])
        for key, values in (("acc", ll), ("acc_per_token", per_token), ("acc_per_char", per_char)):
            correct[key].append(float(int(np.argmax(values)) == gold))
        gold_bytes = len(requests[rows[gold]].continuation.encode("utf-8"))
        bpb.append(-ll[gold] / math.log(2) / max(gold_bytes, 1))
    multiple_choice = any(len(rows) > 1 for rows in docs.values())
    metrics = {key: (float(np.mean(v)) if multiple_choice else None) for key, v in correct.items()}
    # Accuracy of guessing uniformly: the mean of 1 / choices over the questions.
    metrics["chance"] = float(np.mean([1.0 / len(rows) for rows in docs.values()])) if multiple_choice else None
    metrics["bpb"] = float(np.mean(bpb))
    # Standard error of the mean over questions (40 questions at 50% accuracy: +-0.079).
    n = len(docs)
    for key, v in correct.items():
        metrics[f"{key}_stderr"] = float(np.std(v, ddof=1) / math.sqrt(n)) if multiple_choice and n > 1 else None
    metrics["bpb_stderr"] = float(np.std(bpb, ddof=1) / math.sqrt(n)) if n > 1 else None
    metrics["docs"] = len(docs)
    metrics["requests"] = len(requests)
    return metrics


def evaluate_task(
    scorer: Scorer, model, tokenizer: TextTokenizer, task: Task, batch_size: int, max_length: int,
    encoded: Optional[list[Encoded]] = None,
) -> tuple[dict, RequestScores]:
    """One task's metrics row (plus the raw per-request scores). `encoded`: the task's requests
    already tokenised (`encode_requests`), which the training loop keeps between evaluations."""
    started = time.perf_counter()
    requests = list(task.requests)
    if encoded is None:
        encoded = encode_requests(tokenizer, requests)
    scores, truncated = score_encoded(scorer, model, encoded, batch_size, max_length)
    seconds = time.perf_counter() - started
    metrics = task_metrics(requests, scores)
    row = {"task": task.name, "format": task.format if metrics["acc"] is not None else "bpb", **metrics,
           "truncated": truncated, "seconds": seconds, "requests_per_s": len(requests) / seconds,
           "primary_metric": task.primary_metric}
    return row, scores


# OLMES's metric names -> the keys of a task's row; "bpb" is ours, for OLMo-core's bits-per-byte
# tasks over multiple-choice files (arc_easy_test_bpb_5shot reads arc_easy/test_rc_5shot).
_OLMES = {"acc_raw": "acc", "acc_per_token": "acc_per_token", "acc_per_char": "acc_per_char", "bpb": "bpb"}


def primary_key(row: dict) -> str:
    """The key of the task's one primary metric in its row: OLMES's primary metric (its task
    config names it) when we compute it, else raw accuracy; bits per byte for tasks without
    choices. Every table (eval, summary, compare) shows this one."""
    if row.get("acc") is None:
        return "bpb"
    return _OLMES.get(row.get("primary_metric") or "", "acc")


def primary_score(row: dict) -> dict:
    """{"metric", "value", "stderr", "chance"} of the task's primary metric (chance: None for bpb)."""
    key = primary_key(row)
    return {"metric": key, "value": row.get(key), "stderr": row.get(f"{key}_stderr"),
            "chance": row.get("chance") if key != "bpb" else None}


def gold_accuracy(row: dict, metric: Optional[str] = None) -> Optional[float]:
    """The accuracy a table shows for a task: OLMES's primary metric when it is one of ours."""
    key = _OLMES.get(metric, "acc") if metric else primary_key(row)
    return row.get(key)
