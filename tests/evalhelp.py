"""Shared pieces of the evaluation tests: OLMES-format request files with synthetic content
(the real schema, see olmo_eqx/evaluation/requests.py) and one tiny pretrained run per session."""

import gzip
import json
import os
from pathlib import Path

from clihelp import TINY

QUESTIONS = [
    ("Question: Which one is a loop keyword in Python?\nAnswer:", ["while", "lambda", "import", "class"], 0),
    ("Question: What does len() return for an empty list?\nAnswer:", ["one", "zero", "None", "an error"], 1),
    ("Question: Which module reads JSON?\nAnswer:", ["os", "sys", "json", "re"], 2),
]
FEWSHOT = "Question: Which statement defines a function?\n A. def\n B. for\n C. with\n D. try\nAnswer: A\n\n"


def _write(path: Path, rows: list[dict], task_name: str, primary_metric: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with gzip.open(path / "requests.jsonl.gz", "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    config = {"task_name": task_name, "task_config": {"primary_metric": primary_metric}, "num_instances": 0}
    (path / "config.json").write_text(json.dumps(config))


def _row(task: str, doc: dict, doc_id: int, idx: int, label: int, context: str, continuation: str) -> dict:
    return {"request_type": "loglikelihood", "doc": doc, "request": {"context": context, "continuation": continuation},
            "idx": idx, "task_name": task, "doc_id": doc_id, "native_id": doc_id, "label": label}


def write_toy_tasks(root: Path) -> Path:
    """toy_qa/rc_0shot (with OLMES's unconditional twins), toy_qa/mc_5shot and toy_wino/rc_0shot
    (Winogrande-style: the context varies per choice, the doc has no "gold", only "label")."""
    rc, mc = [], []
    for doc_id, (query, choices, gold) in enumerate(QUESTIONS):
        doc = {"id": f"q{doc_id}", "query": query, "choices": choices, "gold": gold}
        rc += [_row("toy_qa", doc, doc_id, i, gold, query, " " + c) for i, c in enumerate(choices)]
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        listed = query.replace("\nAnswer:", "") + "".join(f"\n {l}. {c}" for l, c in zip(letters, choices)) + "\nAnswer:"
        mc_doc = {"id": f"q{doc_id}", "query": listed, "choices": letters, "gold": gold}
        mc += [_row("toy_qa:mc", mc_doc, doc_id, i, gold, FEWSHOT + listed, " " + l) for i, l in enumerate(letters)]
    unconditional = [dict(r, doc_id=r["doc_id"] + 1_000_000, request={"context": "Answer:",
                                                                      "continuation": r["request"]["continuation"]})
                     for r in rc]
    _write(root / "toy_qa" / "rc_0shot", rc + unconditional, "toy_qa", "acc_per_char")
    _write(root / "toy_qa" / "mc_5shot", mc, "toy_qa:mc", "acc_raw")
    wino = []
    for doc_id, (sentence, options, answer) in enumerate([
        ("The list was longer than the tuple so _ took more memory.", ("the list", "the tuple"), 0),
        ("Alice called Bob because _ needed help with the parser.", ("Alice", "Bob"), 0),
    ]):
        doc = {"sentence": sentence, "option1": options[0], "option2": options[1], "answer": str(answer + 1)}
        before, after = sentence.split("_")
        wino += [_row("toy_wino", doc, doc_id, i, answer, before + option, " " + after.strip())
                 for i, option in enumerate(options)]
    _write(root / "toy_wino" / "rc_0shot", wino, "toy_wino", "acc_raw")
    return root


TOY_TASKS = "[toy_qa/rc_0shot,toy_qa/mc_5shot,toy_wino/rc_0shot]"


def tiny_run(tmp_path_factory) -> Path:
    """A 12-step pretrain of the nano model (checkpoints at steps 6 and 12), made once per session
    and shared by its xdist workers (in the session's directory, above each worker's own): the
    first to need it trains it while another waits on the lock. Every user only reads it."""
    from filelock import FileLock

    from olmo_eqx.config import compose_config
    from olmo_eqx.train.loop import train

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    run_dir = root / "eval_tiny_run"
    with FileLock(str(root / "eval_tiny_run.lock")):
        if not (run_dir / "summary.json").exists():
            train(compose_config(TINY), run_dir)
    return run_dir
