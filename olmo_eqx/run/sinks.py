"""Where a run's metrics go: a small protocol and three sinks, chosen with `trainer.loggers`.

    jsonl        metrics.jsonl, one JSON object per record, exactly as written (the reference)
    tensorboard  event files under tensorboard/ (tensorboardX), every number as a scalar
    wandb        a W&B run under wandb/ (pip install wandb, or the `wandb` extra); offline
                 (synced later with `wandb sync`) unless WANDB_API_KEY or WANDB_MODE says otherwise

A record is a flat-or-nested dict with an integer "step". TensorBoard and W&B get its numbers
flattened with "/" (`{"heldout": {"c4": 3.1}}` -> `heldout/c4`), so a tag is the path of the
value in metrics.jsonl. Booleans and strings are left to metrics.jsonl.

metrics.jsonl survives a kill: a run killed mid-write leaves a partial last line, which the
next run moves into `metrics.jsonl.partial-<time>` (kept, not deleted) before it appends, and
`read_jsonl`, the one reader of the project's JSONL files, skips a malformed line with a warning.

A sink that cannot write (a full or read-only disk) raises `OSError` in the training thread,
never in a thread of its own: TensorBoard's events are written here, synchronously, because
tensorboardX's writer thread dies on ENOSPC and its queue then blocks the loop for good (no
signal gets it out). `RunDir` turns that error into a `SinkError`, one line naming the file.
"""

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from olmo_eqx.errors import RunError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
LOGGERS = ("jsonl", "tensorboard", "wandb")


class SinkError(RunError):
    """A file of the run dir (metrics, log, summary) that cannot be written; names the file."""


def sink_error(path: Path | str, error: OSError) -> SinkError:
    """The one line a failed write of `path` stops the run with."""
    return SinkError(
        f"cannot write {path}: {error.strerror or error}: free space on its disk (or make the run dir writable), "
        "then rerun to resume; the checkpoints are intact"
    )


@runtime_checkable
class MetricSink(Protocol):
    path: Path  # what it writes, named when that fails

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of `record` (except "step"), flattened with "/"."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            out[name] = float(value)
    return out


def set_aside_partial_line(path: Path) -> Optional[Path]:
    """Move a partial last line of the JSONL file `path` (no closing newline: the writer was
    killed mid-line) into `<path>.partial-<time>` and cut it from `path`, so appending starts on
    a line of its own. Where the fragment went, or None when the file ends cleanly."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return None
        # Scan back for the last newline in blocks: metrics.jsonl can be large.
        end, cut = size, 0
        while end > 0 and not cut:
            start = max(0, end - (1 << 16))
            f.seek(start)
            block = f.read(end - start)
            if (i := block.rfind(b"\n")) >= 0:
                cut = start + i + 1
            end = start
        f.seek(cut)
        fragment = f.read()
        aside = path.with_name(f"{path.name}.partial-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.write_bytes(fragment)
        f.truncate(cut)
    warnings.warn(f"{path}: its last line was cut off (a killed writer); set aside in {aside}", stacklevel=2)
    return aside


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file, one per line; a malformed line (the fragment a kill
    left, a hand edit) is skipped with a warning naming the file and line."""
    records = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            warnings.warn(f"{path}:{number}: skipped a malformed line ({e})", stacklevel=2)
            continue
        if not isinstance(record, dict):
            warnings.warn(f"{path}:{number}: skipped a line that is not a JSON object", stacklevel=2)
            continue
        records.append(record)
    return records


def last_recorded_step(path: Path) -> Optional[int]:
    """The step of the last complete record of the JSONL file `path` (None: no file, or no such
    record near its end). Reads only the file's last 64 KiB: metrics.jsonl can be large."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return None


class JsonlSink:
    """metrics.jsonl: appended, so a resumed run continues it (the later record of a step wins).
    A partial last line left by a killed run is set aside first (`set_aside_partial_line`)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE
        set_aside_partial_line(self.path)
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a killed run keeps every step it reported

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Event files in `<run dir>/tensorboard/` (`tensorboard --logdir <run dir>`); a resumed run
    adds a new event file next to the old ones, which TensorBoard reads as one run. Written in
    the calling thread with tensorboardX's event file writer and flushed every `FLUSH_S`
    seconds, as its `SummaryWriter(flush_secs=10)` would (see the module docstring for why)."""

    FLUSH_S = 10.0

    def __init__(self, run_dir: Path):
        from tensorboardX.event_file_writer import EventsWriter

        directory = run_dir / TENSORBOARD_DIR
        self.path = directory  # named if it cannot be made
        directory.mkdir(parents=True, exist_ok=True)
        self._events = EventsWriter(str(directory / "events"))
        self.path = Path(getattr(self._events, "_file_name", directory))  # the event file, when known
        self._flushed = time.monotonic()

    def write(self, record: dict) -> None:
        # The protos themselves, as tensorboardX.summary.scalar builds them: that module imports
        # torch when it is installed (1.5 s), these do not.
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        step, now = int(record["step"]), time.time()
        for tag, value in scalars(record).items():
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            self._events.write_event(Event(wall_time=now, step=step, summary=summary))
        if time.monotonic() - self._flushed >= self.FLUSH_S:
            self._events.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._events.close()


class WandbSink:
    """A W&B run in `<run dir>/wandb/`. Offline unless the user set WANDB_MODE or an API key,
    so a run never blocks on a login prompt or the network; `wandb sync <run dir>/wandb/offline-run-*`
    uploads it later."""

    def __init__(self, run_dir: Path, config: Optional[dict], name: str):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "trainer.loggers includes wandb but wandb is not installed: pip install wandb "
                "(or pip install -e '.[wandb]'), or drop wandb from trainer.loggers"
            ) from e
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "olmo_eqx"),
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=config,
            reinit="create_new",  # several runs in one process (tests, notebooks) each get their own
            settings=wandb.Settings(console="off", silent=True),
        )
        self._last_step = -1
        self.path = run_dir / WANDB_DIR

    def write(self, record: dict) -> None:
        step = int(record["step"])
        if step < self._last_step:
            return  # W&B refuses steps going backwards (a replay after a hard kill); metrics.jsonl keeps them
        self._last_step = step
        self._run.log(scalars(record), step=step)

    def close(self) -> None:
        self._run.finish()


def check_loggers(names: tuple[str, ...]) -> None:
    """Refuse, before any work, a logger whose package is missing (raises ImportError saying
    what to install)."""
    import importlib.util

    needs = {"tensorboard": ("tensorboardX", "pip install tensorboardX"), "wandb": ("wandb", "pip install wandb")}
    for name in names:
        if name in needs and importlib.util.find_spec(needs[name][0]) is None:
            raise ImportError(
                f"trainer.loggers includes {name} but {needs[name][0]} is not installed: {needs[name][1]}, "
                f"or drop {name} from trainer.loggers (e.g. trainer.loggers=[jsonl])"
            )


def make_sinks(names: tuple[str, ...], run_dir: Path, config: Optional[dict] = None) -> list[MetricSink]:
    """The sinks `names` (values of trainer.loggers) writing into `run_dir`."""
    sinks: list[Any] = []
    for name in names:
        if name == "jsonl":
            sinks.append(JsonlSink(run_dir))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir))
        elif name == "wandb":
            sinks.append(WandbSink(run_dir, config, name=run_dir.name))
        else:
            raise ValueError(f"unknown logger {name!r} in trainer.loggers; choose from {list(LOGGERS)}")
    return sinks
