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
"""

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
LOGGERS = ("jsonl", "tensorboard", "wandb")


@runtime_checkable
class MetricSink(Protocol):
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


class JsonlSink:
    """metrics.jsonl: appended, so a resumed run continues it (the later record of a step wins).
    A partial last line left by a killed run is set aside first (`set_aside_partial_line`)."""

    def __init__(self, run_dir: Path):
        set_aside_partial_line(run_dir / METRICS_FILE)
        self._file = open(run_dir / METRICS_FILE, "a")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a killed run keeps every step it reported

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Event files in `<run dir>/tensorboard/` (`tensorboard --logdir <run dir>`); a resumed run
    adds a new event file next to the old ones, which TensorBoard reads as one run."""

    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(run_dir / TENSORBOARD_DIR), flush_secs=10)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=int(record["step"]))

    def close(self) -> None:
        self._writer.close()


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
