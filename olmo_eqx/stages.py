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
"""

import dataclasses
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

from olmo_eqx.config import Config, ConfigError, build

ENTRY_POINT_GROUP = "olmo_eqx.stages"


class StageError(RuntimeError):
    """A stage that cannot be found or loaded."""


@runtime_checkable
class Stage(Protocol):
    description: str

    def run(self, config: Config, run_dir: Path) -> Optional[dict]: ...


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


def stage_settings(stage: Any, name: str, values: dict) -> Any:
    """The stage's own settings: `values` (config key `stage`) checked against its config_class.

    A stage without a config_class accepts no settings, so a typo under `stage.` still fails.
    """
    config_class = getattr(stage, "config_class", None)
    if config_class is None:
        if values:
            raise ConfigError(f"unknown key stage.{sorted(values)[0]}: stage {name!r} takes no settings")
        return {}
    if not dataclasses.is_dataclass(config_class):
        raise StageError(f"stage {name!r}: config_class must be a dataclass, got {config_class!r}")
    return build(config_class, values, "stage")
