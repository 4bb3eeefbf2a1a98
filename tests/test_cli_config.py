"""The command line and the structured config: listing stages, and bad configs failing early."""

import dataclasses
import subprocess
import sys

import pytest

from olmo_eqx.config import CONF_DIR, Config, ConfigError, build, compose_config, schema_of
from olmo_eqx.models.zoo import ZOO, get_model_config
from olmo_eqx.train.optim import OptimConfig

from clihelp import TINY, olmo_eqx


def test_no_stage_lists_installed_stages():
    result = olmo_eqx()
    assert result.returncode == 0, result.stderr
    assert "pretrain" in result.stdout
    assert "+stage=NAME" in result.stdout


@pytest.mark.parametrize(
    "args",
    [(), ("+stage=pretrain", "trainer.stepz=3"), ("+stage=anneal", "model=olmo3_nano", "--cfg", "job")],
    ids=["listing", "refusal", "shown config"],
)
def test_a_forked_command_says_what_a_cold_one_says(tmp_path, args):
    """The suite forks its `python -m olmo_eqx` runs from a warm interpreter
    (tests/forked_command.py): same status, stdout and stderr as the command started cold."""
    forked, cold = (olmo_eqx(*args, cwd=tmp_path, cold=cold) for cold in (False, True))
    assert forked.returncode == cold.returncode and forked.stderr == cold.stderr, forked.stderr
    assert forked.stdout == cold.stdout, forked.stdout
    assert list(tmp_path.iterdir()) == []  # neither made a run dir (Hydra's would be under cwd)


def test_the_command_skips_only_pythons_teardown(tmp_path):
    """`exit_without_teardown` (the end of every `python -m olmo_eqx`) keeps what Python's exit
    does: a thread pool's idle worker does not hang it, a non-daemon thread finishes its write,
    atexit handlers run after it, buffered output is flushed, and the status is kept."""
    script = f"""
import atexit, concurrent.futures, pathlib, sys, threading, time
from olmo_eqx.__main__ import exit_without_teardown
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(print, "pool ran", end="; ").result()
late = pathlib.Path({str(tmp_path / "late")!r})
threading.Thread(target=lambda: (time.sleep(0.3), late.write_text("written"))).start()
atexit.register(lambda: print("atexit saw", late.read_text(), end=""))
sys.stdout.write("buffered; ")
exit_without_teardown(sys.argv[1] if sys.argv[1] == "message" else int(sys.argv[1]))
"""
    for status, code in (("0", 0), ("3", 3), ("message", 1)):
        result = subprocess.run([sys.executable, "-c", script, status], capture_output=True, text=True, timeout=60)
        assert result.returncode == code, result.stderr
        assert result.stdout == "pool ran; buffered; atexit saw written", result.stdout
        assert result.stderr == ("message\n" if status == "message" else ""), result.stderr


@pytest.mark.parametrize(
    "override, key, choices",
    [
        ("trainer.stepz=3", "trainer.stepz", "did you mean trainer.steps?"),  # a typo (Hydra's refusal)
        ("trainer.steps=abc", "trainer.steps", "takes int"),  # a wrong type (Hydra's)
        ("model=olmo3_8b", "model=olmo3_8b", "olmo3_7b, olmo3_nano"),  # no such group option (Hydra's)
        ("+stage=pretrian", "+stage=pretrian", "generate, long_context, pretrain"),  # no such stage (Hydra's)
        ("model.param_dtype=float16", "model.param_dtype", "'bfloat16'"),  # outside a Literal's choices
        ("trainer.loggers=[jsonl,csv]", "trainer.loggers", "'tensorboard'"),  # no such metric sink
    ],
)
def test_bad_config_fails_before_work_in_one_line_naming_the_key(tmp_path, override, key, choices):
    run_dir = tmp_path / "outputs" / "run"
    result = olmo_eqx(*[a for a in TINY if not (override.startswith("+stage") and a.startswith("+stage"))], override,
                      f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    output = result.stdout + result.stderr
    # One line that names the key and what it takes; never Hydra's advice to force a typo in with +.
    assert output.startswith("error: ") and output.count("\n") == 1, output
    assert key in output and choices in output, output
    assert "+trainer.stepz" not in output and "Traceback" not in output
    # Nothing ran, and the refused invocation leaves no directory behind (not even the one
    # Hydra made for it).
    assert "parameters" not in output
    assert not (tmp_path / "outputs").exists()


def test_a_sweep_refused_before_any_job_leaves_no_sweep_dir(tmp_path):
    sweep_dir = tmp_path / "multirun" / "sweep"
    result = olmo_eqx("-m", *TINY, "trainer.stepz=3,4", f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 2
    assert "trainer.stepz" in result.stderr and "Traceback" not in result.stderr
    assert "(did you mean trainer.steps?)" in result.stderr  # as a single run's refusal says
    # Hydra had written multirun.yaml there before composing the first job.
    assert not (tmp_path / "multirun").exists()


def test_default_config_is_the_zoo_tiny_model_and_the_recipe():
    config = compose_config(["+stage=pretrain"])
    assert config.model == get_model_config("olmo3_tiny")
    assert config.data.source == "embedded" and config.data.sequence_length == 256
    assert config.optim.b1 == 0.9 and config.optim.b2 == 0.95 and config.optim.weight_decay == 0.1
    assert config.checkpoint.dir is None  # -> <run dir>/checkpoints
    assert config.stage == {}


def test_model_group_is_the_zoo_and_fields_override():
    assert compose_config(["model=olmo3_7b"]).model == get_model_config("olmo3_7b")
    config = compose_config(["model=olmo2_1b", "model.n_layers=8"])
    assert config.model == dataclasses.replace(get_model_config("olmo2_1b"), n_layers=8)


def test_a_model_added_to_the_zoo_composes_after_earlier_composes(monkeypatch):
    """`compose_config` registers the zoo once per process, and again when the zoo changed."""
    compose_config(["model=olmo3_7b"])
    mine = dataclasses.replace(get_model_config("olmo3_7b"), name="my_olmo3", n_layers=4)
    monkeypatch.setitem(ZOO, "my_olmo3", mine)
    assert compose_config(["model=my_olmo3"]).model == mine


def test_post_init_and_cross_group_errors_name_the_keys():
    with pytest.raises(ConfigError, match="model"):
        compose_config(["model.n_heads=3"])  # n_heads not a multiple of n_kv_heads
    with pytest.raises(ConfigError, match="remat_sliding='full' is the sliding-window layers' policy and this model has none"):
        compose_config(["model=olmo2_1b", "model.remat_sliding=full"])
    with pytest.raises(ConfigError, match=r"data.global_batch_size=8 .* trainer.micro_batches=3: choose trainer.micro_batches from \[1, 2, 4, 8\]"):
        compose_config(["trainer.micro_batches=3"])
    with pytest.raises(ConfigError, match="schedule.warmup_steps=20"):
        compose_config(["trainer.steps=20"])


def test_schema_mirrors_library_dataclasses():
    # Tuples and Literals become list/str for OmegaConf and come back typed.
    schema = schema_of(OptimConfig)
    assert [f.name for f in dataclasses.fields(schema)] == [f.name for f in dataclasses.fields(OptimConfig)]
    assert build(OptimConfig, dataclasses.asdict(OptimConfig())) == OptimConfig()
    with pytest.raises(ConfigError, match="unknown key optim.lrr"):
        build(OptimConfig, {"lrr": 1.0}, "optim")
    with pytest.raises(ConfigError, match="optim.lr"):
        build(OptimConfig, {"lr": "fast"}, "optim")
    assert isinstance(build(Config, {}), Config)


@pytest.mark.parametrize(
    "group", ["data", "optim", "schedule", "mesh", "checkpoint", "trainer", "model"]
)
def test_every_shipped_option_composes_with_the_defaults(group):
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    assert options or group == "model"
    for option in options:
        compose_config(["+stage=pretrain", f"{group}={option}"])


def test_eval_compare_export_and_generate_of_a_run_write_beside_it(tmp_path):
    from olmo_eqx.run.run_dir import default_run_dir

    run = tmp_path / "runs" / "tiny"
    (run / "checkpoints" / "200").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for stage in ("eval", "compare", "export", "generate"):
        assert default_run_dir(stage, str(run), "outputs/x") == str(run.parent / f"tiny.{stage}")
    assert default_run_dir("generate", str(run / "checkpoints" / "200"), "outputs/x") == str(run.parent / "tiny.generate-step200")
    # A training stage, or a model dir that is not one of our runs, gets Hydra's default.
    assert default_run_dir("anneal", str(run), "outputs/x") == "outputs/x"
    assert default_run_dir("generate", str(tmp_path), "outputs/x") == "outputs/x"


def test_a_value_typo_gets_a_suggestion():
    with pytest.raises(ConfigError, match=r"model.compute_dtype='bfloat' is not allowed \(did you mean model.compute_dtype=bfloat16\?\)"):
        build(type(get_model_config("olmo3_tiny")), {"compute_dtype": "bfloat"}, "model")


def test_the_sweep_table_names_how_many_steps_its_train_loss_averages():
    from olmo_eqx.run.sweep import format_table

    def row(job, loss, steps):
        return {"job": job, "overrides": f"x={job}", "train_loss": loss, "train_loss_steps": steps, "heldout_loss": None,
                "status": "ok" if loss else "failed"}

    assert "train loss (mean of last 10 steps)" in format_table([row("0", 3.2, 10), row("1", None, None)])
    mixed = format_table([row("0", 3.2, 10), row("1", 3.1, 5)])
    assert "mean of last N" not in mixed and "3.2000 (10 steps)" in mixed and "3.1000 (5 steps)" in mixed
