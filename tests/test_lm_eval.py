"""lm-evaluation-harness over our checkpoints, for real and offline: tasks defined by local YAML
files over local JSONL datasets, run through `lm_eval.simple_evaluate` and its command line.

Per request, lm-eval's log-likelihoods equal the eval stage's on the same questions (read from
OLMES request files by the eval stage's own reader); `loglikelihood_rolling` on a held-out
document gives the eval stage's held-out loss on that document; `generate_until` gives what
`olmo_eqx.generate` gives, cut at the stop string.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from evalhelp import QUESTIONS, tiny_run, write_toy_tasks

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

lm_eval = pytest.importorskip("lm_eval")


def _write_tasks(root: Path, heldout_text: str) -> Path:
    """toy_mc (multiple choice), toy_rolling (perplexity) and toy_gen (generate_until)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "qa.jsonl", "w") as f:
        for query, choices, gold in QUESTIONS:
            f.write(json.dumps({"query": query, "choices": choices, "gold": gold}) + "\n")
    (root / "text.jsonl").write_text(json.dumps({"text": heldout_text}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (root / "toy_mc.yaml").write_text(
        f"task: toy_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'qa.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{query}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
    (root / "toy_rolling.yaml").write_text(
        f"task: toy_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'text.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    (root / "toy_gen.yaml").write_text(
        f"task: toy_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'qa.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{query}}'\ndoc_to_target: '{{choices[gold]}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(run dir, the lm-eval model, a held-out document's ids, the tasks dir)."""
    import olmo_eqx.interop.harness
    from olmo_eqx.data.embedded import embedded_corpus
    from olmo_eqx.data.heldout import document_bounds
    from olmo_eqx.data.token_files import TokenFile

    run = tiny_run(tmp_path_factory)
    lm = olmo_eqx.interop.harness.OLMoEqxLM(checkpoint=str(run), batch_size=8, max_length=256)
    corpus = embedded_corpus()
    tokens = np.asarray(TokenFile(corpus.heldout_files[0], corpus.vocab_size).tokens)
    # A short whole held-out document (no EOS inside), whose text encodes back to the same ids.
    documents = [tokens[a:b].tolist() for a, b in document_bounds(tokens, corpus.eos_id)]
    documents = [d[:-1] if d and d[-1] == corpus.eos_id else d for d in documents]
    document = next(d for d in documents if 40 <= len(d) <= 200 and lm.tok_encode(lm.tok_decode(d)) == d)
    tasks = _write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"), lm.tok_decode(document))
    return run, lm, document, tasks


@pytest.fixture(scope="module")
def samples(setup) -> dict:
    """lm-eval's logged requests and responses of the three toy tasks, from one evaluation.

    The task manager indexes only the toy tasks' directory, not the ~14,000 task files lm-eval
    ships (about 6 s of YAML parsing; no shipped task is run here). The README's command, which
    indexes them all as a user's run does, is test_the_readmes_offline_command_runs_the_shipped_task."""
    from lm_eval.tasks import TaskManager

    _, lm, _, tasks = setup
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=["toy_mc", "toy_rolling", "toy_gen"], log_samples=True,
                                   task_manager=manager, bootstrap_iters=0)["samples"]


def test_loglikelihoods_equal_the_eval_stage_per_request(setup, samples, tmp_path):
    from olmo_eqx.evaluation import read_task, score_requests
    from olmo_eqx.evaluation.scoring import Scorer

    _, lm, _, _ = setup
    task_samples = samples["toy_mc"]
    ours_requests = read_task(write_toy_tasks(tmp_path / "olmes"), "toy_qa/rc_0shot").requests
    ours, _ = score_requests(Scorer(lm.mesh), lm.model, lm.tokenizer, list(ours_requests), 8, 256)
    expected = {(r.doc_id, r.choice): float(lp) for r, lp in zip(ours_requests, ours.logprob)}
    got = {}
    for sample in task_samples:
        for choice, (arguments, response) in enumerate(zip(sample["arguments"], sample["resps"])):
            context, continuation = arguments[0], arguments[1]
            assert (context, continuation) == (QUESTIONS[sample["doc_id"]][0], " " + QUESTIONS[sample["doc_id"]][1][choice])
            got[(sample["doc_id"], choice)] = float(response[0][0])
    assert got.keys() == expected.keys() and len(got) == 12
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-5), key


def test_loglikelihood_rolling_gives_the_heldout_loss(setup, samples, tmp_path):
    from olmo_eqx.data.heldout import HeldOutSet
    from olmo_eqx.data.instances import InstanceDataset
    from olmo_eqx.data.mixes import source_from_paths
    from olmo_eqx.data.token_files import write_token_file
    from olmo_eqx.evaluation.heldout import evaluate_heldout
    from olmo_eqx.evaluation.scoring import Scorer

    _, lm, document, _ = setup
    task_samples = samples["toy_rolling"]
    rolling = float(task_samples[0]["resps"][0][0])
    # The eval stage's held-out loss on one instance [EOS] + document: every document token is
    # a target, conditioned on EOS and what precedes it, as in lm-eval's first rolling window.
    path = write_token_file(tmp_path / "doc.npy", np.asarray([lm.eot_token_id] + document), lm.model.config.vocab_size)
    heldout = HeldOutSet("doc", InstanceDataset([source_from_paths("doc", [str(path)])], len(document) + 1,
                                                lm.model.config.vocab_size))
    row = evaluate_heldout(Scorer(lm.mesh), lm.model, heldout, batch_size=8)
    assert row["tokens"] == len(document)
    assert -rolling / len(document) == pytest.approx(row["loss"], rel=1e-6)
    # Windows shorter than the text: every token is still predicted once, with less context.
    short = lm.loglikelihood_rolling([SimpleNamespace(args=(lm.tok_decode(document),))])
    assert short[0] == pytest.approx(rolling, rel=1e-6)  # max_length 256 > document: one window
    lm.max_length, saved = 16, lm.max_length
    try:
        windowed = lm.loglikelihood_rolling([SimpleNamespace(args=(lm.tok_decode(document),))])[0]
    finally:
        lm.max_length = saved
    assert windowed < 0 and windowed != pytest.approx(rolling, rel=1e-6)


def test_generate_until_is_olmo_eqx_generate_cut_at_the_stop(setup, samples):
    import olmo_eqx

    _, lm, _, _ = setup
    task_samples = samples["toy_gen"]
    assert len(task_samples) == len(QUESTIONS)
    for sample in task_samples:
        prompt = QUESTIONS[sample["doc_id"]][0]
        new = olmo_eqx.generate(lm.model, [lm.tok_encode(prompt)], 12, stop_ids=[lm.eot_token_id])[0]
        assert sample["resps"][0][0] == lm.tok_decode(new).split("\n\n")[0]


def test_the_readmes_offline_command_runs_the_shipped_task(setup, tmp_path):
    run, *_ = setup
    out = tmp_path / "out"
    root = Path(__file__).resolve().parent.parent  # the README's command runs in the repository's root
    result = subprocess.run(
        [sys.executable, "-m", "olmo_eqx.interop.harness", "--model", "olmo_eqx", "--model_args",
         f"checkpoint={run},max_length=128", "--batch_size", "8", "--tasks", "python_qa",
         "--include_path", "docs/lm_eval_tasks", "--output_path", str(out)],
        capture_output=True, text=True, timeout=300, cwd=root,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "python_qa" in result.stdout and "acc" in result.stdout
    # The shipped task says how its metric aggregates: lm-eval has no default to warn about.
    assert "but aggregation is not" not in result.stderr and "but higher_is_better is not" not in result.stderr
    [written] = list(out.rglob("results_*.json"))
    results = json.loads(written.read_text())
    assert results["n-samples"]["python_qa"]["effective"] == 8
    assert 0.0 <= results["results"]["python_qa"]["acc,none"] <= 1.0


def test_the_command_line_refuses_a_bad_checkpoint_in_one_line(setup, tmp_path):
    *_, tasks = setup
    result = subprocess.run(
        [sys.executable, "-m", "olmo_eqx.interop.harness", "--model", "olmo_eqx", "--model_args",
         f"checkpoint={tmp_path / 'nope'}", "--tasks", "toy_mc", "--include_path", str(tasks)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    # The harness' own argument named, not the stages' checkpoint.load.
    assert last.startswith(f"error: --model_args checkpoint={tmp_path / 'nope'}: ") and "does not exist" in last, last
