"""A run directory's one writer: every stage writes its config, summary, printed log, metrics
and other files through a `RunDir`, never by opening files of its own.

    run = RunDir(path, log_name="train.log", loggers=("jsonl", "tensorboard"))
    run.print("step 1 | loss 8.3")          # stdout and the log file
    run.metrics({"step": 1, "loss": 8.3})   # fanned out to the sinks (olmo_eqx/run/sinks.py)
    run.write_config(config)                # config.json
    run.write_summary(summary)              # summary.json (what a sweep's table reads)
    run.close()

In multi-process runs only process 0 writes (`enabled=False` elsewhere: every call is a no-op,
so callers need no `if main_process`). Files are created on first write, so a run that is
refused before it writes anything leaves none of them behind.

A write that fails (a full or read-only disk) raises `SinkError`, one line naming the file,
which stops the run (exit status 2; the checkpoints are untouched). From then on nothing more
is written to that file and `close` stays quiet about it, so the error is said once.
"""

import dataclasses
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback

from olmo_eqx.run.secrets import hide_secrets
from olmo_eqx.run.sinks import MetricSink, make_sinks, sink_error

CONFIG_FILE = "config.json"
# Every stage's summary (a JSON object) lands here, in its run directory.
SUMMARY_FILE = "summary.json"


def _jsonable(data: Any) -> Any:
    return dataclasses.asdict(data) if dataclasses.is_dataclass(data) and not isinstance(data, type) else data


class RunDir:
    """Process 0's outputs in one run directory (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        enabled: bool = True,
        log_name: Optional[str] = None,
        loggers: tuple[str, ...] = (),
        sink_config: Optional[dict] = None,
    ):
        """log_name: the file `print` appends to (None: print only); loggers: metric sinks,
        opened on the first `metrics` call (sink_config: the run config W&B records)."""
        self.path = Path(path).resolve()
        self.enabled = enabled
        self._log_name, self._log = log_name, None
        self._loggers, self._sink_config = tuple(loggers), sink_config
        self._sinks: Optional[list[MetricSink]] = None
        self._lines: list[tuple[str, bool]] = []  # to print, in order (see `print`)
        self._printing = False
        self._failed = False  # a write failed: the run is stopping, its error already raised

    def _writing(self, path: Path | str, write) -> Any:
        """`write()`, its OSError raised as the run's one-line `SinkError` naming `path`."""
        try:
            return write()
        except OSError as e:
            self._failed = True
            raise sink_error(path, e) from None

    def _ensure(self) -> None:
        self._writing(self.path, lambda: self.path.mkdir(parents=True, exist_ok=True))

    def file(self, name: str) -> Path:
        """Where `name` lives in this run dir (for writers of their own format: checkpoints, plots)."""
        return self.path / name

    def print(self, text: str, *, error: bool = False, echo: bool = True) -> None:
        """Print (stdout, or stderr with error=True) and append to the log file (echo=False: the
        log file alone, for a line the process printed before the run dir could be written).

        A signal handler that prints (`ignore_signals_after_completion`) runs between two
        bytecodes of this thread, possibly inside this method's own write or flush, where a
        second write to the same buffered file raises "reentrant call". Its line is queued
        instead and printed by the call in progress, right after that call's line.
        """
        if not self.enabled:
            return
        self._lines.append((text, error, echo))
        while self._lines and not self._printing:
            self._printing = True
            try:
                while self._lines:
                    self._emit(*self._lines.pop(0))
            finally:
                self._printing = False

    def _emit(self, text: str, error: bool, echo: bool) -> None:
        text = hide_secrets(text)
        if echo:
            print(text, flush=True, file=sys.stderr if error else sys.stdout)
        if self._log_name is not None and not self._failed:
            if self._log is None:
                self._ensure()
                self._log = self._writing(self.path / self._log_name, lambda: open(self.path / self._log_name, "a"))

            def append():
                self._log.write(text + "\n")
                self._log.flush()

            self._writing(self.path / self._log_name, append)

    def metrics(self, record: dict) -> None:
        """One record (with an integer "step") to every sink."""
        if not self.enabled or not self._loggers or self._failed:
            return
        if self._sinks is None:
            self._ensure()
            self._sinks = self._writing(self.path, lambda: make_sinks(self._loggers, self.path, self._sink_config))
        for sink in self._sinks:
            self._writing(getattr(sink, "path", self.path), lambda: sink.write(record))

    def write_json(self, name: str, data: Any) -> Path:
        path = self.path / name
        if self.enabled and not self._failed:
            self._ensure()
            self._writing(path, lambda: path.write_text(hide_secrets(json.dumps(_jsonable(data), indent=2)) + "\n"))
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.path / name
        if self.enabled and not self._failed:
            self._ensure()
            self._writing(path, lambda: path.write_text(hide_secrets(text)))
        return path

    def replace_text(self, name: str, text: str) -> Path:
        """Write `name` (subdirectories made as needed) whole or not at all: a kill mid-write
        leaves the previous version (a temporary file renamed over it)."""
        path = self.path / name
        if self.enabled and not self._failed:
            self._ensure()

            def replace():
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f".{path.name}.partial")
                partial.write_text(hide_secrets(text))
                os.replace(partial, path)

            self._writing(path, replace)
        return path

    def write_config(self, config: Any) -> Path:
        return self.write_json(CONFIG_FILE, config)

    def write_summary(self, summary: dict) -> Path:
        return self.write_json(SUMMARY_FILE, summary)

    def close(self) -> None:
        """Close the sinks and the log; a failure is raised as `SinkError` unless a write
        already failed (then that error is the one in flight, and buffered lines are dropped)."""
        sinks, self._sinks = self._sinks or [], None
        # Taken out of reach before closing: a signal handler that prints while the file closes
        # (ignore_signals_after_completion) then appends to a fresh handle, not a closed one.
        log, self._log = self._log, None
        closing = [(getattr(sink, "path", self.path), sink.close) for sink in sinks]
        if log is not None:
            closing.append((self.path / self._log_name, log.close))
        first = None
        for path, close in closing:
            try:
                close()
            except OSError as e:
                first = first or sink_error(path, e)
        if first is not None and not self._failed:
            self._failed = True
            raise first

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Files Hydra itself puts into a run dir before the stage runs.
_HYDRA_FILES = {".hydra", "olmo_eqx.log"}
# run dir -> the outermost directory this invocation created for it (outputs/<date>/ on a new day).
_new_run_dirs: dict[Path, Path] = {}


class NoteNewRunDir(Callback):
    """Hydra callback (conf/config.yaml): remember whether this invocation's run dir is new, so
    a refused invocation can remove the directory Hydra made for it."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        try:
            _note_if_new(Path(str(config.hydra.run.dir)))
            _note_what_was_there(Path(str(config.hydra.run.dir)))
        except OSError:
            pass  # a path the system refuses (a name too long): Hydra's mkdir then fails, said in one line

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        _note_if_new(Path(str(config.hydra.sweep.dir)), sweep=True)


# Sweep dirs this invocation created (Hydra writes multirun.yaml there before any job runs).
_new_sweep_dirs: set[Path] = set()


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system: nothing can be there
        return False


def _note_if_new(path: Path, sweep: bool = False) -> None:
    path = top = path.resolve()
    if _exists(path):
        return
    while not _exists(top.parent):
        top = top.parent
    _new_run_dirs[path] = top
    if sweep:
        _new_sweep_dirs.add(path)


# run dir -> the names it held, and the bytes of its .hydra/ files, before Hydra wrote into it
# (this callback runs before Hydra saves .hydra/config.yaml, hydra.yaml and overrides.yaml).
_before_hydra: dict[Path, tuple[frozenset[str], dict[str, bytes]]] = {}


def _note_what_was_there(path: Path) -> None:
    path = path.resolve()
    if not path.is_dir():
        return
    hydra = path / ".hydra"
    saved = {p.name: p.read_bytes() for p in hydra.iterdir() if p.is_file()} if hydra.is_dir() else {}
    _before_hydra[path] = (frozenset(p.name for p in path.iterdir()), saved)


def restore_hydra_files(path: Path) -> bool:
    """After a refusal: put back the .hydra/ files a run dir that existed before held (Hydra
    rewrote them with the refused overrides before any check could run), and remove those it
    added there; True when something was restored. A new run dir is left to
    `remove_if_new_and_empty`."""
    path = Path(path).resolve()
    if path not in _before_hydra:
        return False
    names, saved = _before_hydra[path]
    hydra = path / ".hydra"
    if ".hydra" not in names:
        if hydra.is_dir():
            shutil.rmtree(hydra)
        return True
    for file in list(hydra.iterdir()) if hydra.is_dir() else []:
        if file.is_file() and file.name not in saved:
            file.unlink()
    hydra.mkdir(exist_ok=True)
    for name, data in saved.items():
        (hydra / name).write_bytes(data)
    return True


def remove_new_sweep_dirs_left_unused() -> None:
    """After a sweep refused before any job ran (a typo'd key): remove the sweep dir this
    invocation created if it holds only Hydra's multirun.yaml; after a run dir Hydra could not
    create (a name too long), the parents it made for it."""
    for path in list(_new_run_dirs):
        if path not in _new_sweep_dirs and not _exists(path):
            _remove_with_new_parents(path)
    for path in list(_new_sweep_dirs):
        if path.is_dir() and {p.name for p in path.iterdir()} <= {"multirun.yaml"}:
            (path / "multirun.yaml").unlink(missing_ok=True)
            _remove_with_new_parents(path)


def remove_if_new_and_empty(path: Path) -> bool:
    """Remove `path` if this invocation created it and it holds only Hydra's own files (an
    empty olmo_eqx.log at most); True when removed. A directory that existed before, or that
    holds anything a stage wrote, is never touched."""
    path = Path(path).resolve()
    if path not in _new_run_dirs or not path.is_dir():
        return False
    # The processes of one run share its run dir, and each refuses a bad config on its own: they
    # may remove it at the same time. Whatever another removed first is gone, as wanted (a
    # FileNotFoundError here once made process 0 exit 1 where its peer exited 2). A peer may
    # also be writing its own Hydra files into it meanwhile (ENOTEMPTY, seen once in CI's Ray
    # step): then the dir is left to that peer's own removal.
    try:
        entries = list(path.iterdir())
        if any(p.name not in _HYDRA_FILES for p in entries) or any(p.is_file() and p.stat().st_size for p in entries):
            return False
        shutil.rmtree(path)
        _remove_with_new_parents(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno != errno.ENOTEMPTY:
            raise
        return False
    return True


def _remove_with_new_parents(path: Path) -> None:
    """Remove `path` (gone or empty) and the parents this invocation made for it, if nothing
    else has landed there since."""
    top = _new_run_dirs[path]
    if _exists(path) and path.is_dir():
        path.rmdir()
    while path != top:
        path = path.parent
        if not _exists(path):
            continue  # never made (Hydra's mkdir failed on a name above it)
        if any(path.iterdir()):
            break
        path.rmdir()


# Stages whose output belongs to the model they read (checkpoint.load), not to a new run.
_BESIDE_THE_MODEL = ("eval", "compare", "export", "generate")


def default_run_dir(stage: Optional[str], load: Optional[str], fallback: str) -> str:
    """The run dir when none is given (`hydra.run.dir` in conf/config.yaml, the resolver
    `olmo_eqx_run_dir`): eval, compare, export and generate of one of our runs write next to it, as
    `<run>.<stage>` (`<run>.<stage>-step<N>` for one step dir), so the results sit beside the
    model (a rerun of export is refused there unless stage.overwrite=true); everything else
    (and an HF model dir, often shared or read-only) gets `fallback`, Hydra's
    `outputs/<date>/<time>`."""
    if stage not in _BESIDE_THE_MODEL or not load or "://" in load:
        return fallback
    path, suffix = Path(load).expanduser().resolve(), ""
    if path.name.isdigit() and path.parent.name == "checkpoints":
        path, suffix = path.parent.parent, f"-step{path.name}"
    elif path.name == "checkpoints":
        path = path.parent
    if not (path / CONFIG_FILE).is_file() or not (path / "checkpoints").is_dir():
        return fallback  # not a run dir of ours
    return str(path.parent / f"{path.name}.{stage}{suffix}")


# What the session that trained up to a step measured; a rerun of a finished run (a sweep
# resumed over its finished jobs, say) trains nothing and keeps them instead of nulls.
TRAINING_FIGURES = ("train_loss_mean_last_n", "train_loss_mean_steps", "last_step_loss", "tokens_per_s", "mfu")


def previous_training_figures(summary_path: Path, end_step: int) -> dict:
    """The training figures of a run dir's summary.json when it ends at `end_step`."""
    try:
        previous = json.loads(Path(summary_path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(previous, dict) or previous.get("end_step") != end_step:
        return {}
    kept = {k: previous[k] for k in TRAINING_FIGURES if previous.get(k) is not None}
    if kept:
        kept["training_figures_from"] = f"the session that trained to step {end_step} (this one trained no step)"
    return kept
