"""The run configuration: one frozen dataclass per Hydra group, checked before any work starts.

Every group of `conf/` (model, data, optim, schedule, mesh, checkpoint, trainer) is backed by the *real* dataclass of
the room that owns it (`ModelConfig`, `OptimConfig`, `MeshConfig`, ...); nothing here repeats their fields. Hydra
needs mutable dataclasses of types OmegaConf knows, while the library's configs are frozen and use `Literal`s and
tuples, so `schema_of` derives a mirror of each one automatically (Literal -> str, tuple -> list) and registers it in
Hydra's ConfigStore. Hydra then rejects an unknown key (`trainer.stepz=3`) or a wrong type (`trainer.steps=abc`) while
composing, naming the key. `build` turns the composed config back into the real frozen dataclasses, checking each
Literal and running each `__post_init__`, and names the key of anything it rejects.

The model group is filled from the model zoo (`olmo_eqx.models.zoo`): `model=olmo3_190m` selects that entry and
`model.n_layers=8` edits one field of it.
"""

import dataclasses
import importlib.util
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from olmo_eqx.data.config import DataConfig
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.zoo import ZOO
from olmo_eqx.run.run_dir import default_run_dir
from olmo_eqx.run.secrets import (  # noqa: F401  (hide_secrets: also imported from here)
    credentials_refusal, has_credentials, hide_secrets, leaves, remember_environment, with_interpolations,
)
from olmo_eqx.sharding import MeshConfig
from olmo_eqx.stages import stage_config_class, stage_entry_points
from olmo_eqx.train.downstream import DownstreamConfig
from olmo_eqx.train.gap_alarm import GapAlarmConfig
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.schedules import ScheduleConfig


def _conf_dir() -> Path:
    """`conf/`: installed as the data-only package `olmo_eqx_conf` (see pyproject.toml), which
    an editable install maps to the source tree's `conf/`; else next to the source package."""
    spec = importlib.util.find_spec("olmo_eqx_conf")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "config.yaml").is_file():
                return Path(location).resolve()
    return Path(__file__).resolve().parent.parent / "conf"


# Where `python -m olmo_eqx` finds its YAML.
CONF_DIR = _conf_dir()


class ConfigError(ValueError):
    """A composed config that cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often checkpoints are written, and which one to start from."""

    # Absolute directory; None means `<run dir>/checkpoints`.
    dir: Optional[str] = None
    # Save every this many steps (and always at the end and on SIGTERM/SIGINT); 0: only those.
    every: int = 100
    keep_last: int = 2
    # Also keep every step that is a multiple of this (None: none extra).
    keep_every: Optional[int] = None
    # Resume from the latest complete checkpoint in `dir` when there is one.
    resume: bool = True
    # A checkpoint to start from (later stages: anneal, eval); a step directory or a run's dir.
    load: Optional[str] = None
    # Settings a resume may change from the checkpoint's (`resume_changes`), each by its key,
    # e.g. [optim.lr,trainer.steps]; any other change is printed and refused.
    accept_changes: tuple[str, ...] = ()
    local_dir: Optional[str] = "auto"  # the local tier (docs/checkpointing.md): auto (a RAM disk), off, or a path
    local_every: int = 0  # a local save every this many steps; 0: no local tier
    local_keep: int = 2  # the newest local steps kept (each process its own)


@dataclass(frozen=True)
class TrainerConfig:
    """The loop around the train step: how long, how often to log and evaluate."""

    # Optimiser steps of the whole run (the schedule's horizon).
    steps: int = 200
    # Print a progress line every this many steps (metrics.jsonl gets every step).
    log_every: int = 10
    # Held-out loss every this many steps (and at the last step); 0 disables it.
    eval_every: int = 50
    # Held-out batches per evaluation (each of the global batch size).
    eval_batches: int = 8
    # Downstream tasks (`downstream`) on the live model every this many steps and at the last
    # step, as OLMo-core's recipe does (every 10,000 steps); 0 disables them.
    downstream_every: int = 0
    downstream: DownstreamConfig = DownstreamConfig()
    # Gradient accumulation: the global batch is split into this many sequential slices, so
    # the batch (and the recipe) stays fixed when fewer devices hold less at a time. auto: the
    # fewest that fit on the devices the run has now, from XLA's compiled memory of the step
    # against device_memory_gib (olmo_eqx/train/micro_batches.py; docs/training.md).
    micro_batches: Union[int, Literal["auto"]] = "auto"
    # The memory one device offers the train step, in GiB, for micro_batches=auto. null: the
    # device's own limit (memory_stats()["bytes_limit"] on TPU and GPU); on CPU, which keeps
    # none, the host's physical memory over its local devices.
    device_memory_gib: Optional[float] = None
    # Seed of the model's initialisation (the data order has its own seed in `data`).
    seed: int = 0
    # Stop after this step with a checkpoint, as a preemption would; the schedule still
    # spans `steps`, so a later run without it continues exactly where this one stopped.
    stop_at: Optional[int] = None
    # When the generalisation-gap alarm fires (training loss falling, held-out loss not).
    gap_alarm: GapAlarmConfig = GapAlarmConfig()
    # Stop the run as diverged after more than this many skip-step skips in a row (a spike
    # is skipped; a run that skips every step has diverged and must not end "completed").
    max_consecutive_skips: int = 5
    # Stop the run as diverged when a *finite* loss runs away: above ln(vocab_size) (what
    # guessing uniformly scores, and about where a fresh model starts) plus this many nats for
    # runaway_loss_steps steps in a row. A healthy run's spikes stay far below its starting loss;
    # null: off. Such steps are not healthy either, so no checkpoint is called good because of them.
    runaway_loss_margin: Optional[float] = 1.0
    runaway_loss_steps: int = 3
    # Where metrics go (olmo_eqx/run/sinks.py): jsonl (metrics.jsonl), tensorboard (event files in
    # <run dir>/tensorboard), wandb (a W&B run in <run dir>/wandb, offline without an API key).
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl", "tensorboard")
    # [start, stop]: record a jax.profiler trace of steps start..stop (inclusive) into
    # <run dir>/profile (open with TensorBoard's profile plugin or Perfetto; README.md); null: none.
    profile_steps: Optional[tuple[int, int]] = None
    # loss.png at the end of each session. false skips it: drawing imports matplotlib and reads
    # all of metrics.jsonl, about 1 s on a small run (the test suite's runs skip it) and more on
    # a long one; the plot can be drawn later from the run dir (olmo_eqx/run/plots.py).
    plot: bool = True

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        if self.micro_batches != "auto" and self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches} must be >= 1, or auto (the fewest that fit)")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise ValueError(f"device_memory_gib={self.device_memory_gib} must be > 0 (null: the device's own limit)")
        if self.log_every < 1:
            raise ValueError(f"log_every={self.log_every} must be >= 1")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError("eval_every must be >= 0 and eval_batches >= 1")
        if self.downstream_every < 0:
            raise ValueError(f"downstream_every={self.downstream_every} must be >= 0 (0: no downstream tasks)")
        if self.max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips={self.max_consecutive_skips} must be >= 0")
        if self.stop_at is not None and not 0 < self.stop_at <= self.steps:
            raise ValueError(f"stop_at={self.stop_at} must lie in 1..steps={self.steps}")
        if self.profile_steps is not None and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(
                f"profile_steps={list(self.profile_steps)} must be [start, stop] with 1 <= start <= stop "
                "(e.g. [5,7]: skip the first step, which compiles)"
            )
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"loggers={list(self.loggers)} names a logger twice")


@dataclass(frozen=True)
class Config:
    """Everything one run reads. `stage` holds the running stage's own settings, if any."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # The running stage's settings: composed as a mapping, then checked against (and turned
    # into) the stage's `config_class` by `stage_settings` below.
    stage: Any = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Frozen library dataclasses <-> mutable Hydra schemas.

_SCHEMAS: dict[type, type] = {}


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _schema_type(tp):
    """The OmegaConf-compatible annotation standing in for `tp`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        kinds = {type(a) for a in typing.get_args(tp)}
        if len(kinds) != 1:
            raise TypeError(f"mixed-type Literal {tp} cannot be a config field")
        return kinds.pop()
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return Optional[_schema_type(args[0])]
        return Any  # OmegaConf has no general unions; `build` still checks the value
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return List[_schema_type(args[0])] if len(set(args)) == 1 else List[Any]
    if origin is dict:
        args = typing.get_args(tp)
        return Dict[str, _schema_type(args[1]) if args else Any]
    if dataclasses.is_dataclass(tp):
        return schema_of(tp)
    return tp


def _schema_default(value):
    if dataclasses.is_dataclass(value):
        return schema_of(type(value))(**{f.name: _schema_default(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, tuple):
        return [_schema_default(v) for v in value]
    return value


def _schema_field(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        default = _schema_default(f.default)
    elif f.default_factory is not dataclasses.MISSING:
        default = _schema_default(f.default_factory())
    else:
        return field()
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda d=default: _copy(d))
    return field(default=default)


def _copy(value):
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value)
    return value


def schema_of(cls: type) -> type:
    """A mutable, OmegaConf-typed mirror of the dataclass `cls` (same fields and defaults)."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        fields = [
            (f.name, _schema_type(hints[f.name]), _schema_field(f)) for f in dataclasses.fields(cls) if f.init
        ]
        _SCHEMAS[cls] = dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)
        _SCHEMAS[cls].__doc__ = f"Hydra schema mirroring {cls.__module__}.{cls.__qualname__}."
    return _SCHEMAS[cls]


def schema_node(value) -> Any:
    """A schema instance holding the values of the library dataclass instance `value`."""
    return _schema_default(value)


def _check(value, tp, key: str):
    """Convert a plain (OmegaConf container) value to annotation `tp`, or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            import difflib

            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {key}={close[0]}?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not allowed{hint}; choose one of {list(choices)}")
        return value
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        arms = [f"one of {list(typing.get_args(a))}" if typing.get_origin(a) is Literal else f"of type {_type_name(a)}"
                for a in args if a is not type(None)]
        raise ConfigError(f"{key}={value!r} must be {' or '.join(arms)}")
    if value is None:
        raise ConfigError(f"{key} must not be null (expected {getattr(tp, '__name__', tp)})")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        args = typing.get_args(tp)
        if origin is tuple and args and Ellipsis not in args:
            if len(args) != len(value):
                raise ConfigError(f"{key} must have {len(args)} entries, got {len(value)}")
            items = [_check(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_check(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping")
        args = typing.get_args(tp)
        return {k: _check(v, args[1], f"{key}.{k}") if args else v for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} must be of type {tp.__name__}")
    return value


def build(cls: type, values: Any, key: str = "") -> Any:
    """The frozen dataclass `cls` from a mapping of plain values (a composed config section).

    Unknown keys, Literal values outside their choices and `__post_init__` errors all raise
    `ConfigError` naming the dotted key.
    """
    if isinstance(values, DictConfig):
        values = OmegaConf.to_container(values, resolve=True)
    if dataclasses.is_dataclass(values):
        values = dataclasses.asdict(values)
    if not isinstance(values, dict):
        raise ConfigError(f"{key or 'config'} must be a mapping of {cls.__name__} fields, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(names))
    if unknown:
        where = f"{key}." if key else ""
        raise ConfigError(f"unknown key {where}{unknown[0]}: {cls.__name__} has {', '.join(names)}")
    kwargs = {n: _check(values[n], hints[n], f"{key}.{n}" if key else n) for n in names if n in values}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key or cls.__name__}: {e}") from e


def _numbers_out_of_range(config: Config) -> list[str]:
    """`key=value: the range it must lie in` for every numeric setting outside it. A negative
    learning rate is gradient *ascent*: finite for a hundred steps (loss 1,120 at step 10) until
    it overflows, so it is refused here rather than left to the divergence guard."""
    import math

    o, s, d, c = config.optim, config.schedule, config.data, config.checkpoint
    rules = [
        ("optim.lr", o.lr, math.isfinite(o.lr) and o.lr > 0, "> 0"),
        ("optim.b1", o.b1, 0 <= o.b1 < 1, "in [0, 1)"),
        ("optim.b2", o.b2, 0 <= o.b2 < 1, "in [0, 1)"),
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.clip_grad_norm", o.clip_grad_norm, o.clip_grad_norm is None or o.clip_grad_norm >= 0, ">= 0 (0 or null: no clipping)"),
        ("optim.z_loss_weight", o.z_loss_weight, o.z_loss_weight >= 0, ">= 0"),
        ("optim.skip_step_window", o.skip_step_window, o.skip_step_window >= 2, ">= 2"),
        ("optim.skip_step_std", o.skip_step_std, o.skip_step_std is None or o.skip_step_std >= 0, ">= 0 (0 or null: off)"),
        ("schedule.warmup_steps", s.warmup_steps, s.warmup_steps >= 0, ">= 0"),
        ("schedule.total_steps", s.total_steps, s.total_steps is None or s.total_steps >= 1, ">= 1 (null: trainer.steps)"),
        ("schedule.final_lr_ratio", s.final_lr_ratio, s.final_lr_ratio is None or 0 <= s.final_lr_ratio <= 1, "in [0, 1]"),
        ("schedule.decay_fraction", s.decay_fraction, 0 <= s.decay_fraction <= 1, "in [0, 1]"),
        ("data.remote_timeout_s", d.remote_timeout_s, d.remote_timeout_s > 0, "> 0"),
        ("data.remote_backoff_s", d.remote_backoff_s, d.remote_backoff_s >= 0, ">= 0"),
        ("checkpoint.every", c.every, c.every >= 0, ">= 0 (0: only at the end and on a signal)"),
        ("checkpoint.keep_last", c.keep_last, c.keep_last >= 1, ">= 1"),
        ("checkpoint.keep_every", c.keep_every, c.keep_every is None or c.keep_every >= 1, ">= 1 (null: none extra)"),
        ("checkpoint.local_every", c.local_every, c.local_every >= 0, ">= 0 (0: no local tier)"),
        ("checkpoint.local_keep", c.local_keep, c.local_keep >= 1, ">= 1"),
        ("trainer.runaway_loss_steps", config.trainer.runaway_loss_steps, config.trainer.runaway_loss_steps >= 1, ">= 1"),
    ]
    # NaN fails every comparison above, so it is refused too.
    return [f"{key}={value} must be {bound}" for key, value, ok, bound in rules if not ok]


def check_across_groups(config: Config) -> None:
    """Constraints that span groups (each group checks its own fields in `__post_init__`), and
    every numeric setting's range, all checked before any work starts."""
    if bad := _numbers_out_of_range(config):
        raise ConfigError("; ".join(bad))
    batch, micro = config.data.global_batch_size, config.trainer.micro_batches
    if micro != "auto" and batch % micro:
        choices = [m for m in range(1, batch + 1) if batch % m == 0]
        raise ConfigError(
            f"data.global_batch_size={batch} is not divisible by trainer.micro_batches={micro}: "
            f"choose trainer.micro_batches from {choices}, or trainer.micro_batches=auto (the fewest that fit "
            f"on the devices at hand), or a global batch that {micro} divides"
        )
    horizon = config.schedule.total_steps or config.trainer.steps
    if config.schedule.warmup_steps >= horizon:
        raise ConfigError(
            f"schedule.warmup_steps={config.schedule.warmup_steps} must be below the schedule's length "
            f"{horizon} (schedule.total_steps, else trainer.steps)"
        )


# What a resume compares with the checkpoint's config: whole groups, or single keys. Left out: how the data is reached
# (source, data_root, tokenizer: the same files under another root or mounted locally are the same data, and the
# dataset's fingerprint refuses other content), the remote and prefetch settings, held-out sets, logging, checkpoint
# (a restart elsewhere may change the local tier), and trainer.micro_batches, to fit the same batch on fewer devices.
RESUME_COMPARED = ("optim", "schedule", "data.sequence_length", "data.global_batch_size", "data.seed",
                   "data.filter_repeated_ngrams", "data.document_masking", "data.reset_positions_per_document",
                   "data.eos_token_id", "trainer.steps")


def _flat(values: Any, prefix: str) -> dict[str, Any]:
    if isinstance(values, dict):
        return {k: v for key, value in values.items() for k, v in _flat(value, f"{prefix}.{key}").items()}
    return {prefix: values}


def resume_changes(stored: dict, config: Config) -> dict[str, tuple[Any, Any]]:
    """key -> (the checkpoint's value, this run's) for every setting of `RESUME_COMPARED` that a
    resume would change. Keys the checkpoint did not record (an older olmo_eqx) are not compared."""
    import json

    current = json.loads(json.dumps(config_to_dict(config)))  # tuples as lists, as stored
    changes = {}
    for compared in RESUME_COMPARED:
        group, _, key = compared.partition(".")
        old = _flat(stored.get(group, {}) if not key else {key: stored.get(group, {}).get(key, _MISSING)}, group)
        new = _flat(current[group] if not key else {key: current[group][key]}, group)
        changes.update({k: (old[k], v) for k, v in new.items() if k in old and old[k] != _MISSING and old[k] != v})
    return changes


_MISSING = "<not recorded>"


def to_config(cfg: Any) -> Config:
    """The composed Hydra config (a `DictConfig`) as a checked `Config` (raises `ConfigError`).
    Settings from the environment are noted (`olmo_eqx.run.secrets`); a URL with a password is refused."""
    values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    values.pop("hydra", None)
    remember_environment({k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}, values)
    for path, value in leaves(values):
        if isinstance(value, str) and has_credentials(value):
            raise ConfigError(credentials_refusal(value, ".".join(map(str, path)), sep="="))
    config = build(Config, values)
    check_across_groups(config)
    return config


def config_to_dict(config: Config) -> dict:
    """Plain data (JSON/YAML-ready) of a config, e.g. for checkpoints and summaries. A setting
    read from the environment (`${oc.env:NAME}`) is recorded as that interpolation, not its
    value: config.json and checkpoints are shared and copied, the secret in them must not be."""
    return with_interpolations(dataclasses.asdict(config))


def register_configs(typed: bool = True) -> None:
    """Fill Hydra's ConfigStore: the schema, the model zoo, and every installed stage.

    A stage needs an option in the `stage` group for `+stage=NAME` to compose. Installed
    stages without a `conf/stage/NAME.yaml` get one here, holding the defaults of their
    `config_class` (typed, so Hydra checks `stage.KEY=VALUE` like any other key), so a
    third-party stage needs no YAML file. (Registering both a file and an entry would make
    Hydra validate one against the other, a deprecated behaviour that warns.)

    typed=False registers the same keys and defaults without their types, for a sweep's parent
    process: Hydra composes every job there before any runs, so one value of a wrong type
    would stop the whole sweep; untyped, that job's config reaches `to_config`, which refuses
    it in that job alone (unknown keys are still refused at once: the config stays closed).
    """
    global _last_registration

    def node(value):
        return value if typed else OmegaConf.to_container(OmegaConf.structured(value))

    # What the store would be filled from: registering the same again (every `compose_config`
    # does) would only repeat 0.2 s of building the same nodes. A model added to the zoo, or a
    # stage installed, since the last call is registered.
    points = stage_entry_points()
    filled_from = (typed, dict(ZOO), [(name, point.value) for name, point in points.items()])
    store = ConfigStore.instance()
    if _last_registration == (store, filled_from):
        return
    # hydra.run.dir's default (conf/config.yaml): eval/compare/export output next to the model.
    OmegaConf.register_new_resolver("olmo_eqx_run_dir", default_run_dir, replace=True)
    store.store(name="olmo_eqx_schema", node=node(schema_of(Config)))
    for name, model in ZOO.items():
        store.store(group="model", name=name, node=node(schema_node(model)))
    for name in points:
        if not (CONF_DIR / "stage" / f"{name}.yaml").exists():
            config_class = stage_config_class(name)
            store.store(group="stage", name=name, node=node(schema_node(config_class())) if config_class else {})
    _last_registration = (store, filled_from)


# The store `register_configs` last filled, and what from.
_last_registration: Optional[tuple] = None


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """The checked `Config` that `python -m olmo_eqx OVERRIDES...` would run (no run dir).

    For notebooks, tests and stages that start other runs. `hydra.*` overrides do not apply.
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            composed = compose(config_name="config", overrides=list(overrides))
        except Exception as e:
            refusal = hydra_refusal(e)
            if refusal is None:
                raise
            raise ConfigError(refusal) from e
    return to_config(composed)


# ---------------------------------------------------------------------------------------------
# Hydra's own refusals, in one line


def _library_class(schema: Any, section: str = "") -> Optional[type]:
    """The library dataclass behind a config node: its typed schema's, or for an untyped node
    (a sweep's parent composes without types) the one its dotted `section` names in `Config`."""
    cls = next((cls for cls, mirror in _SCHEMAS.items() if mirror is schema), None)
    if cls is not None or not section:
        return cls
    cls = Config
    for part in section.split("."):
        hint = typing.get_type_hints(cls).get(part)
        if hint is None or not dataclasses.is_dataclass(hint):
            return None
        cls = hint
    return cls


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def hydra_refusal(error: BaseException) -> Optional[str]:
    """Hydra's (or OmegaConf's) refusal of the command line as one line naming the key and what
    it takes: an unknown key, a wrong type, an unknown option of a group or an unknown stage.
    None for anything else (a bug to see in full).

    Hydra says these in 7 to 40 lines and advises `+key=value` for a typo, which would only move
    the refusal to the dataclass check.
    """
    import difflib
    import re

    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(error, MissingConfigException) and error.options and "/" in (error.missing_cfg_file or ""):
        group, _, option = error.missing_cfg_file.rpartition("/")
        what = "no stage of that name is installed" if group == "stage" else f"{group} has no option {option!r}"
        close = difflib.get_close_matches(option, error.options, n=1)
        group = "+stage" if group == "stage" else group  # selected with a +: not in the defaults
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        return f"{group}={option}: {what}{hint}; choose one of {', '.join(error.options)}"
    cause = error.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        section, _, name = cause.full_key.rpartition(".")
        cls = _library_class(cause.object_type, section)
        if cls is None:
            return f"unknown key {cause.full_key}: {section or 'the config'} has no key {name!r}"
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""
        return f"unknown key {cause.full_key}{hint}: {section or 'the config'} ({cls.__name__}) has {', '.join(names)}"
    if isinstance(cause, ValidationError) and cause.full_key:
        name = cause.full_key.rpartition(".")[2]
        cls = _library_class(cause.object_type)
        hints = typing.get_type_hints(cls) if cls is not None else {}
        expected = f"; {cause.full_key} takes {_type_name(hints[name])}" if name in hints else ""
        return f"{cause.full_key}: {str(cause).splitlines()[0]}{expected}"
    if isinstance(error, HydraException) and (
            appended := re.search(r"Could not override '([^']+)'\. No match in the defaults list\.\s*"
                                  r"To append to your default list use \+(\S+)", str(error))):
        # A group selected with a + (`+stage=NAME`), given without it.
        group, override = appended.groups()
        return (f"{override}: {group} is not in the defaults list, so it is selected with a + "
                f"(did you mean +{override}?)")
    if isinstance(error, OverrideParseException):
        return f"cannot read the command line's overrides: {str(error).splitlines()[0]} (see `--help`)"
    if isinstance(error, (HydraException, OmegaConfBaseException)):
        return str(error).strip().splitlines()[0]
    return None


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
        raise ConfigError(f"stage {name!r}: config_class must be a dataclass, got {config_class!r}")
    return build(config_class, values, "stage")
