"""`python -m olmo_eqx +stage=NAME [overrides]`: compose the config, find the stage, run it.

Without a stage it lists the installed stages and exits 0. A config that does not check out
stops before any stage code runs, in one line naming the key and what it takes (exit status
2): Hydra refuses unknown keys, wrong types and unknown group options or stages (said here
through `olmo_eqx.config.hydra_refusal`), the library's dataclasses invalid values, and the
stage its own bad input.

In a sweep (`-m`), Hydra's default launcher would run every job in this one process, carrying
JAX's state and device memory from job to job. So each job re-runs this command, with its own
overrides and run directory, in a fresh Python process; this process only waits for it and
reads the summary it wrote (see `olmo_eqx.run.sweep` for the table printed at the end). This parent
composes the jobs without the schema's types, so that a value of the wrong type fails its own
job (refused by `to_config`) and not the whole sweep.
"""

import atexit
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import NoReturn, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from olmo_eqx.config import (
    CONF_DIR, ConfigError, hide_secrets, hydra_refusal, register_configs, stage_settings, to_config,
)
from olmo_eqx.errors import RunError, storage_refusal
from olmo_eqx.run.run_dir import (SUMMARY_FILE, remove_if_new_and_empty, remove_new_sweep_dirs_left_unused,
                                  restore_hydra_files)
from olmo_eqx.stages import ENTRY_POINT_GROUP, StageError, describe, load_stage, stage_entry_points
from olmo_eqx.run.sweep import ERROR_FILE


def list_stages() -> None:
    points = stage_entry_points()
    if not points:
        print(f"No stages are installed (entry-point group {ENTRY_POINT_GROUP!r}). Did you `pip install -e .`?")
        return
    print(f"Installed stages (entry-point group {ENTRY_POINT_GROUP!r}):")
    width = max(len(n) for n in points)
    for name, point in points.items():
        try:
            text = describe(load_stage(name))
        except StageError as e:
            text = f"(cannot load: {e})"
        print(f"  {name:<{width}}  {text}  [{point.value}]")
    print("\nRun one with: python -m olmo_eqx +stage=NAME [group=option ...] [key=value ...]")


def run_job_in_subprocess(hydra_config, run_dir: Path) -> Optional[dict]:
    """Run this sweep job as a single run in a fresh process; return its summary.

    The child gets its own session, so a Ctrl-C at the terminal reaches only this process,
    which forwards it once: the child saves a checkpoint and exits, then the sweep stops.
    Rerunning the sweep with the same `hydra.sweep.dir` resumes every job.
    """
    command = [sys.executable, "-m", "olmo_eqx", *hydra_config.overrides.task, f"hydra.run.dir={run_dir}"]
    print(f"[sweep] job {hydra_config.job.num}: {' '.join(hydra_config.overrides.task)} -> {run_dir}", flush=True)
    # Not main()'s HYDRA_FULL_ERROR: the job's own main() says Hydra's refusals in one line too.
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR" or _USER_WANTS_TRACEBACK}
    child = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum, _frame):
        if not received:
            child.send_signal(signum)
        received.append(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        returncode = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        print(
            f"[sweep] interrupted during job {hydra_config.job.num} (exit status {returncode}); "
            f"rerun with hydra.sweep.dir={Path(hydra_config.sweep.dir).resolve()} to resume",
            file=sys.stderr,
        )
        sys.exit(128 + received[0])  # stop the whole sweep: no further jobs start
    if returncode != 0:
        raise StageError(f"sweep job {hydra_config.job.num} exited with status {returncode}; see {run_dir}")
    summary = run_dir / SUMMARY_FILE
    return json.loads(summary.read_text()) if summary.exists() else None


def keep_returned_summary(run_dir: Path, summary: object) -> None:
    """A stage's returned summary (a dict) that it did not write itself: printed, and saved as
    the run dir's summary.json, which sweeps read (the built-in stages write and print theirs)."""
    if not isinstance(summary, dict) or (run_dir / SUMMARY_FILE).exists():
        return
    if "jax" in sys.modules and sys.modules["jax"].process_index() != 0:
        return  # one writer per run dir, as for the built-in stages
    text = json.dumps(summary, indent=2, default=str)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / SUMMARY_FILE).write_text(text + "\n")
    print(f"summary: {run_dir / SUMMARY_FILE}\n{text}", flush=True)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> Optional[dict]:
    hydra_config = HydraConfig.get()
    name = hydra_config.runtime.choices.get("stage")
    if name is None:
        list_stages()
        return None
    run_dir = Path(hydra_config.runtime.output_dir).resolve()
    multirun = hydra_config.mode == RunMode.MULTIRUN
    try:
        config = to_config(cfg)
        stage = load_stage(name)
        config = dataclasses.replace(config, stage=stage_settings(stage, name, config.stage))
        if multirun:
            return run_job_in_subprocess(hydra_config, run_dir)
        summary = stage.run(config, run_dir)
        keep_returned_summary(run_dir, summary)
        return summary
    except (ConfigError, RunError) as e:
        # Bad input: one line naming it, not a traceback. In a sweep, fail only this job: the
        # other jobs still run and the summary table marks this one (its error file).
        print(f"error: {hide_secrets(str(e))}", file=sys.stderr)
        if multirun:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / ERROR_FILE).write_text(f"{hide_secrets(str(e))}\n")
            return None
        # A refused run leaves no directory behind that it created (Hydra made it, with only
        # its own .hydra/ inside, before the config could be checked); one that existed gets
        # back the .hydra/ files Hydra rewrote with the refused overrides.
        restore_hydra_files(run_dir)
        remove_if_new_and_empty(run_dir)
        sys.exit(2)


# HYDRA_FULL_ERROR=1 set by the user: Hydra's refusals keep their whole traceback.
_USER_WANTS_TRACEBACK = os.environ.get("HYDRA_FULL_ERROR") == "1"


def _is_multirun(args: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in args)


def spare_imported_objects_from_the_collector() -> None:
    """Keep Python's cyclic garbage collector off the objects the command's imports made.

    Tracing a step makes container objects fast enough to start a collection every 700 of
    them (Python's default), and a collection of the older generations walks the 140,000
    objects that the imports of JAX, Equinox, Hydra and the project left behind, which live
    as long as the process: 7% of the CPU of compiling and running an 8-layer olmo3_tiny step
    was the collector (perf). Those objects are frozen (`gc.freeze`: never walked again;
    modules imported later, such as Orbax's, are not), and collections start after 50,000 new
    objects: tracing that step takes 0.76 s instead of 0.89 to 1.01 s, and a 12-step nano run
    4.7 CPU-s instead of 5.1 (docs/performance.md). Garbage cycles are still freed, a little
    later.
    """
    gc.freeze()
    gc.set_threshold(50_000, 50, 50)


def show_only_the_settings_that_apply() -> None:
    """Make `--cfg job` (and `--cfg all`) leave out the model settings its architecture does not
    read (`olmo_eqx.models.config.unused_fields`): a plain OLMo 3 shows no Gated DeltaNet or
    expert keys. Hydra prints the composed config itself, through `get_sanitized_cfg`, before
    any code of ours runs; the run's own config (config.json) still holds every field."""
    from hydra._internal.hydra import Hydra
    from omegaconf import OmegaConf

    from olmo_eqx.models.config import unused_fields

    sanitize = Hydra.get_sanitized_cfg

    def without_unused_fields(self, cfg, cfg_type):
        cfg = sanitize(self, cfg, cfg_type)
        if cfg_type == "hydra" or cfg.get("model") is None:
            return cfg
        # Typed nodes refuse deletion: the printed copy is plain (same keys, values, order).
        shown = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        for name in unused_fields(OmegaConf.to_container(shown.model, resolve=False)):
            del shown.model[name]
        return shown

    Hydra.get_sanitized_cfg = without_unused_fields


def launcher_refusal(error: BaseException) -> Optional[str]:
    """One line for `hydra/launcher=submitit_slurm` off a SLURM cluster (submitit raises a
    RuntimeError from deep in Hydra's launcher when `srun` is not on PATH); None otherwise."""
    if isinstance(error, RuntimeError) and 'Could not detect "srun"' in str(error):
        return ("hydra/launcher=submitit_slurm: SLURM's srun is not on PATH here; submit from a node of the "
                "cluster (its login node), or try the same jobs on this machine with hydra/launcher=submitit_local")
    return None


def path_or_yaml_refusal(error: BaseException) -> Optional[str]:
    """One line for a path the file system refuses (a name past its 255 bytes: Hydra's mkdir of
    the run dir is the first to meet it) and for a config file that is not plain YAML (a
    `!!python/...` tag, which Hydra's safe loader refuses, or a syntax error); None otherwise."""
    import errno

    import yaml

    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENAMETOOLONG:
            return (f"cannot create {str(seen.filename)[:120]}...: a name in this path is longer than the file "
                    "system allows (255 bytes a name): give a shorter one (hydra.run.dir=... or the path setting)")
        if isinstance(seen, yaml.YAMLError):
            mark = getattr(seen, "problem_mark", None)
            where = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
            problem = " ".join(str(getattr(seen, "problem", None) or seen).split())
            if isinstance(seen, yaml.constructor.ConstructorError):
                return (f"{where}: {problem}: config files hold plain YAML values only (no !!python/... tags, "
                        "which would run code); remove the tag")
            return f"{where} is not valid YAML ({problem}); fix that line"
        seen = seen.__cause__ or seen.__context__
    return None


def main() -> None:
    spare_imported_objects_from_the_collector()
    if len(sys.argv) == 1:
        register_configs()
        list_stages()  # directly: through Hydra, even a listing would create a run directory
        return
    register_configs(typed=not _is_multirun(sys.argv[1:]))
    if any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in sys.argv[1:]):
        show_only_the_settings_that_apply()
    # Hydra prints its own refusals (a typo'd key, a wrong type, an unknown option) in 7 to 40
    # lines and exits; with HYDRA_FULL_ERROR it raises them instead, and they are said here in
    # one line. Anything else still comes with its whole traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except Exception as e:
        # A run dir on a read-only or full disk fails in Hydra itself (it writes .hydra/ first).
        refusal = None if _USER_WANTS_TRACEBACK else (hydra_refusal(e) or storage_refusal(e) or launcher_refusal(e)
                                                    or path_or_yaml_refusal(e))
        if refusal is None:
            raise
        print(f"error: {hide_secrets(refusal)}", file=sys.stderr)
        remove_new_sweep_dirs_left_unused()
        sys.exit(2)


def exit_without_teardown(status: object = None) -> NoReturn:
    """End the process as `sys.exit(status)` would, minus the interpreter's final teardown.

    With JAX, Orbax and Hydra loaded, CPython's teardown (freeing every module and the XLA
    client's objects) costs 0.2 to 0.5 s of CPU after the command's work is done: a quarter of a
    refusal, a tenth of a short run, and the test suite starts about a hundred such commands. The
    exit steps that matter still run, as Python's own exit runs them and in its order:
    `threading._shutdown` (thread pools' exit hooks, then waiting for non-daemon threads), the
    atexit handlers (JAX's distributed shutdown, logging's final flush), then stdout and stderr
    flushed. (mypy ends its command the same way.)
    """
    if status is not None and not isinstance(status, int):
        print(status, file=sys.stderr)  # sys.exit("message") prints the message, exit status 1
        status = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(status or 0)


if __name__ == "__main__":
    # Only a command that finished or refused cleanly skips the teardown: an uncaught exception
    # (a bug) and Ctrl-C keep Python's own exit and traceback.
    try:
        main()
    except SystemExit as done:
        exit_without_teardown(done.code)
    exit_without_teardown(0)
