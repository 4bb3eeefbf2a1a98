"""The stage protocol and registry: every stage is a plugin found through an entry point.

A stage is any object (or class with a no-argument constructor) exposing

    description: str                      one line, shown by `python -m olmo_eqx`
    config_class: type | None             optional dataclass of its own settings (`stage.*`)
    run(config, run_dir) -> dict | None   does the work; the dict is the run's summary

registered under the entry-point group `olmo_eqx.stages`, e.g. in a `pyproject.toml`:

    [project.entry-points."olmo_eqx.stages"]
    my_stage = "my_package.stages:MyStage"

The built-in stages (`plugins/`, installed as `olmo_eqx_plugins`) register exactly this way.
`python -m olmo_eqx +stage=my_stage` then composes the config and calls `run`. A stage's
module is imported only when the stage is listed or run, so keep heavy imports (jax) inside
`run` and listing stays fast.

This module imports nothing of the library but `errors`: the config (`olmo_eqx.config`) reads
the registry to give each stage its `stage.*` keys, and checks them (`stage_settings`).
"""

import dataclasses
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from olmo_eqx.errors import RunError

ENTRY_POINT_GROUP = "olmo_eqx.stages"


class StageError(RunError):
    """A stage that cannot be found or loaded, or refuses its input (the CLI prints it in one line)."""


@runtime_checkable
class Stage(Protocol):
    description: str

    def run(self, config: Any, run_dir: Path) -> Optional[dict]: ...  # config: olmo_eqx.config.Config


def stage_entry_points() -> dict[str, metadata.EntryPoint]:
    """Installed stages by name (the entry point's name), without importing any of them."""
    points = {}
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        # Two distributions registering one name: the first found wins, like Python's imports.
        points.setdefault(point.name, point)
    return dict(sorted(points.items()))


def load_stage(name: str) -> Stage:
    """The stage registered as `name`, instantiated if the entry point names a class."""
    points = stage_entry_points()
    if name not in points:
        known = ", ".join(points) or "none"
        raise StageError(
            f"no stage named {name!r} is installed (installed: {known}); a stage registers under the "
            f"entry-point group {ENTRY_POINT_GROUP!r} (see README.md, 'Writing a stage')"
        )
    try:
        obj = points[name].load()
    except Exception as e:
        raise StageError(f"stage {name!r} ({points[name].value}) failed to import: {e}") from e
    stage = obj() if isinstance(obj, type) else obj
    if not callable(getattr(stage, "run", None)):
        raise StageError(f"stage {name!r} ({points[name].value}) has no run(config, run_dir) method")
    return stage


def stage_config_class(name: str) -> Optional[type]:
    """The stage's settings dataclass, or None (also when the stage cannot be loaded: the
    error then surfaces, with its cause, when the stage is listed or run)."""
    try:
        config_class = getattr(load_stage(name), "config_class", None)
    except StageError:
        return None
    return config_class if dataclasses.is_dataclass(config_class) else None


def describe(stage: Any) -> str:
    """The stage's one-line description (its `description`, else its docstring's first line)."""
    text = getattr(stage, "description", None) or (type(stage).__doc__ or "").strip()
    return text.splitlines()[0] if text else ""
