"""Issue 50, "signals and secrets": what the environment gives a run is used, never recorded or
printed in the clear, and a URL with a password in it is refused without repeating it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from clihelp import TINY, olmo_eqx, xla_flags

from olmo_eqx.config import ConfigError, compose_config, config_to_dict, hide_secrets
from olmo_eqx.data.remote import RemoteFileError, RemoteReader
from olmo_eqx.data.stores import RetryPolicy

SECRET = "s3cr3t-Ab9Zk2Lq"


def test_a_setting_from_the_environment_is_recorded_as_its_interpolation(tmp_path, monkeypatch):
    from olmo_eqx.checkpoint import Checkpointer  # noqa: F401  (the same module the loop saves with)
    from olmo_eqx.train.loop import train

    checkpoints = tmp_path / f"ckpt-{SECRET}"
    monkeypatch.setenv("OLMO_EQX_TEST_SECRET_DIR", str(checkpoints))
    overrides = TINY + ["trainer.steps=2", "checkpoint.every=2", "trainer.eval_every=0", "schedule.warmup_steps=1",
                        "checkpoint.dir=${oc.env:OLMO_EQX_TEST_SECRET_DIR}"]
    config = compose_config(overrides)
    assert config.checkpoint.dir == str(checkpoints)  # the run uses the value
    assert config_to_dict(config)["checkpoint"]["dir"] == "${oc.env:OLMO_EQX_TEST_SECRET_DIR}"
    run_dir = tmp_path / "run"
    train(config, run_dir)
    written = {p: p.read_text(errors="replace") for p in [*run_dir.rglob("*"), *checkpoints.rglob("*")]
               if p.is_file() and p.suffix in (".json", ".log", ".jsonl", "") and p.stat().st_size < 1 << 20}
    assert json.loads((run_dir / "config.json").read_text())["checkpoint"]["dir"] == "${oc.env:OLMO_EQX_TEST_SECRET_DIR}"
    stored = [p for p in written if p.parent.name == "config"]
    assert stored, "the checkpoint's own config was not found"
    assert all("${oc.env:OLMO_EQX_TEST_SECRET_DIR}" in written[p] for p in stored)
    leaked = [str(p) for p, text in written.items() if SECRET in text]
    assert not leaked, f"the secret is written in the clear in {leaked}"
    # A resume compares what the checkpoint recorded with this run's config: the same interpolation.
    summary = train(compose_config(overrides), run_dir)
    assert summary["start_step"] == 2


def test_secret_values_are_hidden_in_messages(monkeypatch):
    monkeypatch.setenv("OLMO_EQX_TEST_SECRET", SECRET)
    compose_config(["+stage=pretrain", "checkpoint.load=${oc.env:OLMO_EQX_TEST_SECRET}"])
    assert hide_secrets(f"checkpoint.load={SECRET} does not exist") == "checkpoint.load=*** does not exist"


def test_a_url_with_a_password_is_refused_without_repeating_it():
    with pytest.raises(ConfigError) as refused:
        compose_config(["data.source=http://alice:hunter22@127.0.0.1:9/tokens.npy"])
    assert "hunter22" not in str(refused.value) and "alice" not in str(refused.value)
    assert "data.source=http://***@127.0.0.1:9/tokens.npy" in str(refused.value)
    # A URL that reaches the reader another way (a mix manifest's root) is refused before any
    # request: never retried as an unreachable server.
    reader = RemoteReader(RetryPolicy(attempts=8))
    with pytest.raises(RemoteFileError) as refused:
        reader.size("https://alice:hunter22@127.0.0.1:9/tokens.npy")
    assert "hunter22" not in str(refused.value) and "unreachable" not in str(refused.value)
    assert reader.stats["data_requests"] == 0 and reader.stats["data_retries"] == 0


def test_a_stage_without_its_plus_gets_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"^stage=pretrain: .*\(did you mean \+stage=pretrain\?\)$"):
        compose_config(["stage=pretrain"])
    result = olmo_eqx("stage=pretrain", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("error: stage=pretrain: stage is not in the defaults list, so it is selected "
                                     "with a + (did you mean +stage=pretrain?)")
    assert not (tmp_path / "run").exists()


def _start(tmp_path, *overrides: str) -> subprocess.Popen:
    # An empty compilation cache: the suite's may hold this very step, and the signal must
    # land during a compilation.
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "empty-compilation-cache")}
    args = [*TINY, "trainer.steps=100000", "trainer.log_every=1", "checkpoint.every=0", *overrides,
            f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.Popen([sys.executable, "-m", "olmo_eqx", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _signal_after(process: subprocess.Popen, marker: str, *signals: int) -> tuple[str, float]:
    """Send `signals` (0.1 s apart) once a line holding `marker` is printed; (all the output,
    seconds from the first signal to the process's end)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            break
    else:
        raise AssertionError(f"never printed {marker!r}:\n{''.join(lines)}")
    time.sleep(0.3)
    sent = time.perf_counter()
    for s in signals:
        process.send_signal(s)
        time.sleep(0.1)
    rest, _ = process.communicate(timeout=120)
    return "".join(lines) + rest, time.perf_counter() - sent


# The default model's train step: several seconds to compile on these cores, a signal comes 0.3 s in.
@pytest.mark.parametrize("micro_batches", ["auto", "1"])
def test_sigterm_during_the_first_compile_stops_within_seconds(tmp_path, micro_batches):
    marker = "trainer.micro_batches=auto: the train step" if micro_batches == "auto" else "compiling the train step"
    process = _start(tmp_path, "model=olmo3_tiny", f"trainer.micro_batches={micro_batches}")
    output, took = _signal_after(process, marker, signal.SIGTERM)
    assert process.returncode == 128 + signal.SIGTERM, output
    assert took < 5, f"{took:.1f}s after the signal:\n{output}"
    assert "SIGTERM received before this session's first step finished: nothing new to save, stopping now; " \
           "rerun to resume" in output
    assert "Traceback" not in output and "step      1/" not in output
    assert not (tmp_path / "run" / "summary.json").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("*")) if (tmp_path / "run" / "checkpoints").exists() else True


# The loop's handlers, in a process of their own: a Ctrl-C, the first step done, then a second.
SECOND_CTRL_C = """
import os, signal, time
from olmo_eqx.run.signals import stop_on_signals
with stop_on_signals(print) as stop:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("still running, flag", stop.signal)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
print("not stopped")
"""


def test_a_second_ctrl_c_exits_at_once_without_a_traceback():
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], capture_output=True, text=True, timeout=60)
    assert result.returncode == 128 + signal.SIGINT, result.stdout + result.stderr
    assert result.stdout.splitlines()[-3:] == [
        "SIGINT received: finishing this step, then saving a checkpoint", "still running, flag SIGINT",
        "SIGINT again: stopping now without saving (the last checkpoint is intact)"]
    assert result.stderr == "" and time.perf_counter() - started < 5


IMPORTED_FIRST = """
import jax, olmo_eqx
print(jax.devices()[0].platform)
"""

# A machine with a TPU chip keeps JAX's own choice: the decision alone, before any backend is
# up, against a root that shows /dev/accel0, then one that shows no accelerator.
DECIDES_BEFORE_BACKENDS = """
import jax, os, sys
from olmo_eqx.run.accelerators import run_on_cpu_with_jax_imported_first
jax.config.update("jax_platforms", "")  # undo the package's own choice: no platform chosen
environ = {}
print(run_on_cpu_with_jax_imported_first(environ, sys.argv[1]), environ, repr(jax.config.jax_platforms))
print(run_on_cpu_with_jax_imported_first(environ, sys.argv[2]), environ, repr(jax.config.jax_platforms))
"""


def test_importing_jax_first_is_silent_without_an_accelerator(tmp_path):
    """`import jax, olmo_eqx` (the README's order) on a machine with libtpu installed and no TPU:
    JAX's first call stays on the CPU, without libtpu's error block."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    result = subprocess.run([sys.executable, "-c", IMPORTED_FIRST], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout == "cpu\n" and result.stderr == "", result.stderr
    (tmp_path / "tpu" / "dev").mkdir(parents=True)
    (tmp_path / "tpu" / "dev" / "accel0").touch()
    (tmp_path / "none").mkdir()
    result = subprocess.run([sys.executable, "-c", DECIDES_BEFORE_BACKENDS, str(tmp_path / "tpu"), str(tmp_path / "none")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.splitlines() == ["False {} ''", "True {'JAX_PLATFORMS': 'cpu'} 'cpu'"], result.stderr


def test_the_training_api_snippet_runs_as_written_and_export_hf_returns_what_the_doc_says(tmp_path):
    import re
    from pathlib import Path

    import olmo_eqx

    doc = (Path(__file__).parent.parent / "docs" / "training.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
    first = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    losses = [float(line.split()[1]) for line in first.stdout.splitlines()]
    assert [line.split()[0] for line in first.stdout.splitlines()] == ["1", "2", "3", "4"] and losses[-1] < losses[0]
    again = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout == "", again.stderr  # resumed at step 4: nothing to train

    documented = re.search(r"export_hf\(path, out_dir, .*?-> dict`.*?`\{(.*?)\}`", doc, re.S).group(1)
    exported = olmo_eqx.export_hf(tmp_path / "runs" / "api_demo" / "checkpoints", tmp_path / "hf")
    assert set(exported) == {k.strip().strip('"') for k in documented.split(",")}
    assert exported["step"] == 4 and (tmp_path / "hf" / "config.json").is_file()


def test_the_planners_tiny_step_times_keep_three_significant_figures():
    from olmo_eqx.plan.report import format_ranked, format_row, seconds

    assert [seconds(v) for v in (0.000123456, 0.0123, 0.5, 6.0, 0.0)] == ["0.000123", "0.0123", "0.500", "6.000", "0.000"]
    row = {"remat": "none", "micro_batches": 1, "attention_block_size": None, "fits": True, "compile_seconds": 3.0,
           "bytes": {"needed": 1 << 20}, "estimate": {"xla_seconds": 4.2e-5, "xla_mfu": 0.31, "roofline_seconds": 3.1e-5,
                                                      "roofline_mfu": 0.42}}
    table = format_row(row)
    assert "0.0000420s" in table and "0.0000310s" in table and "0.000s" not in table
    assert "0.0000420 s (XLA)" in format_ranked([row])


def test_the_cpu_peak_says_how_it_was_measured_and_sees_other_processes_at_work():
    """The 1-minute load average lags: a peak measured right after other work started was said
    to be "on idle cores". The measurement itself now counts what other processes used."""
    import olmo_eqx.train.mfu as mfu

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert mfu.measure_cpu_peak(seconds=0.5, size=256) > 0
    finally:
        spinner.kill()
        spinner.wait()
    runs, size, elapsed, others = mfu._LAST_MEASUREMENT
    assert runs > 1 and size == 256 and 0.5 <= elapsed < 1.5 and others is not None and others >= mfu._OTHERS_BUSY
    assert mfu._how_measured().startswith(f"best of {runs} float32 256x256 matmuls in ")
