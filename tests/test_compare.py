"""The compare stage: KL of a model with itself is 0, of two different models > 0, ours against
its own HF export agrees exactly, and `+stage=compare` writes the four-surface report."""

import importlib.util
import json

import jax
import pytest

from olmo_eqx.checkpoint import export_hf
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.evaluation import Scorer, evaluate_heldout, evaluate_kl, load_model, resolve_model_source
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.olmo3 import OLMo
from olmo_eqx.sharding import MeshConfig, make_mesh, model_shardings

from clihelp import olmo_eqx
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
    hf_dir = export_hf(run / "checkpoints", tmp_path / "hf", step=12)
    ours = load_model(resolve_model_source(str(run)), mesh)
    theirs = load_model(resolve_model_source(str(hf_dir)), mesh)
    result = evaluate_kl(Scorer(mesh), ours, theirs, embedded_corpus().heldout_set(64), batch_size=8, max_batches=1)
    assert result["kl"] < 1e-6 and result["loss_a"] == pytest.approx(result["loss_b"], rel=1e-6)


def test_compare_stage_writes_the_four_surface_report(tmp_path_factory, tmp_path):
    run = tiny_run(tmp_path_factory)
    hf_dir = export_hf(run / "checkpoints", tmp_path / "hf", step=12)
    tasks = write_toy_tasks(tmp_path / "tasks")
    out = tmp_path / "compare"
    result = olmo_eqx("+stage=compare", f"checkpoint.load={run}/checkpoints/6", f"stage.against={hf_dir}",
                      "stage.name_a=step6", "stage.name_b=step12-hf", f"stage.tasks_dir={tasks}",
                      f"stage.tasks={TOY_TASKS}", "stage.heldout_batches=1", "stage.batch_size=8",
                      "data.sequence_length=64", f"hydra.run.dir={out}")
    assert result.returncode == 0, result.stdout + result.stderr
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
    if importlib.util.find_spec("matplotlib") is None:
        assert "Plot: skipped: matplotlib is not installed" in markdown and not (out / "compare_domains.png").exists()
    else:
        assert (out / "compare_domains.png").stat().st_size > 0


def test_compare_needs_a_second_model(tmp_path_factory, tmp_path):
    run = tiny_run(tmp_path_factory)
    result = olmo_eqx("+stage=compare", f"checkpoint.load={run}", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and "stage.against=" in result.stderr
