"""The compare stage: KL of a model with itself is 0, of two different models > 0, ours against
its own HF export agrees exactly, and `+stage=compare` writes the four-surface report."""

import json
from pathlib import Path

import jax
import pytest

from olmo_eqx.interop.export import export_hf
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.evaluation import Scorer, evaluate_heldout, evaluate_kl, load_model, locate
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.olmo3 import OLMo
from olmo_eqx.sharding import MeshConfig, make_mesh, model_shardings

from clihelp import olmo_eqx, xla_flags
from evalhelp import TOY_TASKS, tiny_run, write_toy_tasks

CONFIG = ModelConfig(name="kl", d_model=32, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64, init_std=0.1)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig())


def _random(seed: int, mesh):
    model = OLMo(CONFIG, key=jax.random.key(seed))
    return jax.device_put(model, model_shardings(model, mesh))


def test_kl_of_a_model_with_itself_is_zero_and_of_two_models_positive(mesh):
    heldout = embedded_corpus().heldout_set(32)
    scorer = Scorer(mesh)
    a, b = _random(0, mesh), _random(1, mesh)
    same = evaluate_kl(scorer, a, a, heldout, batch_size=8, max_batches=2)
    assert same["tokens"] == 2 * 8 * 31 and same["kl"] == 0.0 and same["loss_a"] == same["loss_b"]
    different = evaluate_kl(scorer, a, b, heldout, batch_size=8, max_batches=2)
    assert different["kl"] > 1e-3
    # The losses the KL pass reports are the held-out losses of each model.
    assert different["loss_b"] == pytest.approx(evaluate_heldout(scorer, b, heldout, 8, 2)["loss"], rel=1e-6)


def test_our_checkpoint_and_its_hf_export_agree(tmp_path_factory, tmp_path, mesh):
    run = tiny_run(tmp_path_factory)
    hf_dir = Path(export_hf(run / "checkpoints" / "12", tmp_path / "hf")["out"])
    ours = load_model(locate(str(run)), mesh)
    theirs = load_model(locate(str(hf_dir)), mesh)
    result = evaluate_kl(Scorer(mesh), ours, theirs, embedded_corpus().heldout_set(64), batch_size=8, max_batches=1)
    assert result["kl"] < 1e-6 and result["loss_a"] == pytest.approx(result["loss_b"], rel=1e-6)


COMPARE_SETTINGS = ["stage.heldout_batches=1", "stage.batch_size=8", "data.sequence_length=64"]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    """`+stage=compare` of the run's step-6 checkpoint (A) against its step-12 weights as HF (B)."""
    run = tiny_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("compare")
    hf_dir = Path(export_hf(run / "checkpoints" / "12", root / "hf")["out"])
    tasks = write_toy_tasks(root / "tasks")
    out = root / "compare"
    result = olmo_eqx("+stage=compare", f"checkpoint.load={run}/checkpoints/6", f"stage.against={hf_dir}",
                      "stage.name_a=step6", "stage.name_b=step12-hf", f"stage.tasks_dir={tasks}",
                      f"stage.tasks={TOY_TASKS}", *COMPARE_SETTINGS, f"hydra.run.dir={out}",
                      # The devices of this test process: its eval must give the same bits.
                      env={"XLA_FLAGS": xla_flags(8)})
    assert result.returncode == 0, result.stdout + result.stderr
    return run, tasks, out, result


def test_compare_stage_writes_the_four_surface_report(compare_run):
    run, _, out, result = compare_run
    report = json.loads((out / "compare.json").read_text())
    surfaces = report["surfaces"]
    assert set(surfaces) == {"heldout_loss", "downstream_accuracy", "domain_perplexity", "kl"}
    # B is the step-12 weights through the HF path: its held-out loss is what training logged.
    trained = json.loads((run / "summary.json").read_text())["final_heldout_loss"]
    assert surfaces["heldout_loss"]["b"] == pytest.approx(trained, rel=1e-5)
    assert surfaces["heldout_loss"]["diff"] == pytest.approx(surfaces["heldout_loss"]["a"] - trained, rel=1e-4)
    assert surfaces["heldout_loss"]["a"] > surfaces["heldout_loss"]["b"]  # 6 steps of training fewer
    assert len(report["domains"]) == 3 and all(d["kl"] > 0 for d in report["domains"])
    assert [t["task"] for t in report["tasks"]] == ["toy_qa/rc_0shot", "toy_qa/mc_5shot", "toy_wino/rc_0shot"]
    assert all(t["acc_diff"] == pytest.approx(t["acc_a"] - t["acc_b"]) for t in report["tasks"])
    markdown = (out / "compare.md").read_text()
    assert "## Four surfaces" in markdown and "| step6" not in markdown and "KL(A‖B)" in markdown
    assert markdown in result.stdout
    assert (out / "compare_domains.png").stat().st_size > 0  # matplotlib is a dependency
    # Progress while it works, not 55 silent seconds.
    assert "compare: KL(A||B) on set 3/3" in result.stdout and "step12-hf: task 3/3" in result.stdout


def _table_row(text: str, first_cell: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {first_cell} ")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_eval_summary_and_compare_tables_agree_on_every_metric(compare_run, tmp_path, capsys):
    """Eval of compare's model A: eval.json, summary.json, eval's printed tables and compare's
    report and tables show the same number for every held-out set and task."""
    from olmo_eqx.config import compose_config
    from olmo_eqx.evaluation.report import fmt
    from olmo_eqx.evaluation.run import run_eval
    from olmo_eqx.evaluation.settings import EvalSettings

    run, tasks, out, _ = compare_run
    config = compose_config(["+stage=eval", f"checkpoint.load={run}/checkpoints/6", *COMPARE_SETTINGS[2:]])
    settings = EvalSettings(tasks=tuple(TOY_TASKS.strip("[]").split(",")), tasks_dir=str(tasks), heldout_batches=1,
                            batch_size=8)
    summary = run_eval(config, tmp_path, settings)
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "eval.json").read_text())
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    report = json.loads((out / "compare.json").read_text())
    compare_md = (out / "compare.md").read_text()

    # Held-out sets: eval = compare's A, in the JSON and in both tables (4 decimals).
    compared = {d["set"]: d for d in report["domains"]}
    for row in results["heldout"]:
        name, a = row["set"], compared[row["set"]]
        assert (row["loss"], row["perplexity"], row["bpb"], row["tokens"]) == (
            a["loss_a"], a["perplexity_a"], a["bpb_a"], a["tokens"])
        assert summary["heldout"][name] == {"loss": row["loss"], "tokens": row["tokens"],
                                            "perplexity": row["perplexity"], "bpb": row["bpb"]}
        eval_cells = _table_row(printed, name)
        compare_cells = _table_row(compare_md, name)
        for value in (row["loss"], row["perplexity"], row["bpb"]):
            assert fmt(value) in eval_cells and fmt(value) in compare_cells, (name, value)

    # Tasks: one primary metric, named, with its value, standard error and chance everywhere.
    compared_tasks = {t["task"]: t for t in report["tasks"]}
    for row in results["downstream"]:
        task, score, a = row["task"], summary["downstream"][row["task"]], compared_tasks[row["task"]]
        assert (a["metric"], a["acc_a"], a["stderr_a"], a["chance"]) == (
            score["metric"], score["value"], score["stderr"], score["chance"])
        assert score["value"] == row[score["metric"]]
        expected = [score["metric"], fmt(score["value"]), fmt(score["stderr"]), fmt(score["chance"])]
        eval_cells, compare_cells = _table_row(printed, task), _table_row(compare_md, task)
        assert eval_cells[3:7] == expected  # primary metric | score | ± s.e. | chance
        assert [compare_cells[3], compare_cells[5], compare_cells[6], compare_cells[4]] == expected


def test_compare_needs_a_second_model(tmp_path_factory, tmp_path):
    run = tiny_run(tmp_path_factory)
    result = olmo_eqx("+stage=compare", f"checkpoint.load={run}", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and "stage.against=" in result.stderr
