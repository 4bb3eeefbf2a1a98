"""trainer.micro_batches=auto: the fewest micro-batches that fit, from XLA's compiled memory of the
run's own step on the devices at hand; a resume on a quarter of the devices trains on.

The resume runs are real `python -m olmo_eqx` processes on 8 and 2 fake CPU devices, with a
per-device budget (trainer.device_memory_gib) between what the nano model's step needs on 8
devices with one micro-batch (11.2 MiB: arguments + temporaries, XLA:CPU) and on 2 devices with
two (24.5 MiB; four need 16.6 MiB).
"""

import json
import shutil

import jax
import numpy as np
import pytest
from jax import monitoring

from clihelp import olmo_eqx, xla_flags
from olmo_eqx.config import ConfigError, compose_config
from olmo_eqx.data.sources import build_datasets
from olmo_eqx.errors import TrainError
from olmo_eqx.sharding import ShardingRules, make_mesh
from olmo_eqx.train.memory import micro_batch_candidates
from olmo_eqx.train.micro_batches import choose_micro_batches
from olmo_eqx.train.schedules import make_schedule
from olmo_eqx.train.state import init_train_state
from olmo_eqx.train.step import make_train_step

NANO = ["model=olmo3_nano", "data.sequence_length=64", "data.global_batch_size=16"]
# 17.9 MiB per device: 8 devices fit one micro-batch, 2 devices need four.
BUDGET = "trainer.device_memory_gib=0.0175"
RUN = [
    "+stage=pretrain", *NANO, BUDGET, "trainer.steps=6", "trainer.log_every=1", "trainer.eval_every=0",
    "schedule.warmup_steps=2", "checkpoint.every=2", "checkpoint.keep_last=3", "trainer.loggers=[jsonl]",
    "trainer.plot=false",
]


def losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_a_run_resumed_on_a_quarter_of_its_devices_takes_more_micro_batches_and_trains_on(tmp_path):
    """8 -> 2 -> 8 fake CPU devices with the same command: auto takes 1, then 4, then 1
    micro-batches, says so, and the losses are the uninterrupted 8-device run's within float32 noise."""
    reference = tmp_path / "reference"
    done = olmo_eqx(*RUN, f"hydra.run.dir={reference}", env={"XLA_FLAGS": xla_flags(8)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "8 devices: micro-batches 1 (trainer.micro_batches=auto: fits " in done.stdout
    assert json.loads((reference / "summary.json").read_text())["micro_batches"] == 1

    # The run as if stopped at step 2: its checkpoint of step 2, in a run dir of its own.
    resumed = tmp_path / "resumed"
    shutil.copytree(reference / "checkpoints" / "2", resumed / "checkpoints" / "2")
    quarter = olmo_eqx(*RUN, "trainer.stop_at=4", f"hydra.run.dir={resumed}", env={"XLA_FLAGS": xla_flags(2)})
    assert quarter.returncode == 0, quarter.stderr[-3000:]
    line = next(line for line in quarter.stdout.splitlines() if line.startswith("8 -> 2 devices"))
    assert line.startswith("8 -> 2 devices: micro-batches 1 -> 4 (trainer.micro_batches=auto: fits ") and "1, 2 did not fit" in line
    assert "trainer.device_memory_gib" in line
    session = json.loads((resumed / "config.json").read_text())["session"]
    assert (session["devices"], session["micro_batches"], session["micro_batches_auto"]) == (2, 4, True)
    assert session["needed_bytes"] <= session["budget_bytes"] == int(0.0175 * 2**30)

    back = olmo_eqx(*RUN, f"hydra.run.dir={resumed}", env={"XLA_FLAGS": xla_flags(8)})
    assert back.returncode == 0, back.stderr[-3000:]
    assert "2 -> 8 devices: micro-batches 4 -> 1 (trainer.micro_batches=auto: fits " in back.stdout
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["start_step"], summary["end_step"], summary["devices"], summary["micro_batches"]) == (4, 6, 8, 1)

    expected, got = losses(reference), losses(resumed)
    assert sorted(got) == [3, 4, 5, 6] and sorted(expected) == [1, 2, 3, 4, 5, 6]
    print({step: (expected[step], got[step]) for step in got})
    np.testing.assert_allclose([got[s] for s in (3, 4, 5, 6)], [expected[s] for s in (3, 4, 5, 6)], rtol=2e-5)


@pytest.fixture(scope="module")
def nano():
    """The nano model's config (auto, the budget above), state, mesh and dataset on 8 devices."""
    config = compose_config([*NANO, BUDGET])
    mesh, rules = make_mesh(config.mesh), ShardingRules()
    state = init_train_state(config.model, config.optim, mesh, rules, jax.random.key(0))
    dataset, _ = build_datasets(config.data, config.model.vocab_size)
    schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
    return config, state, mesh, rules, schedule, dataset


class CompileEvents:
    """JAX's compile and compilation-cache events while active (the persistent cache's hits too)."""

    def __init__(self):
        self.names: list[str] = []
        self.active = False
        monitoring.register_event_listener(lambda name, **kw: self._seen(name))
        monitoring.register_event_duration_secs_listener(lambda name, duration, **kw: self._seen(name))

    def _seen(self, name: str):
        if self.active and ("compil" in name or "lowering" in name):
            self.names.append(name)


def test_the_program_auto_measured_is_the_one_the_first_step_runs(nano):
    config, state, mesh, rules, schedule, dataset = nano
    from olmo_eqx.data.loader import global_batch_arrays, read_batch
    from olmo_eqx.data.sources import document_options
    from olmo_eqx.sharding import batch_sharding

    lines = []
    choice = choose_micro_batches(config, state, mesh, rules, schedule, dataset, progress=lines.append)
    assert choice.micro_batches == 1 and [a.micro_batches for a in choice.attempts] == [1]
    assert any("trainer.micro_batches=auto: the train step, 1 micro-batch(es) of 16 x 64 on 8 cpu" in line for line in lines)
    batch = global_batch_arrays(read_batch(dataset, np.arange(16), step=0, epoch=0), batch_sharding(mesh, rules),
                                **document_options(config.data))
    train_step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=choice.micro_batches)
    first = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)  # the step donates its state
    jax.block_until_ready(first)
    events = CompileEvents()
    events.active = True
    new_state, metrics = train_step(first, batch)
    float(metrics["loss"])
    events.active = False
    assert events.names == [], f"the first step compiled again: {events.names}"
    # Control: a count auto did not compile does compile (the events would show a second compile).
    events.active = True
    other = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=2)
    other(new_state, batch)
    events.active = False
    assert events.names


def test_nothing_fits_says_so_in_one_line(nano):
    config, state, mesh, rules, schedule, dataset = nano
    tiny = compose_config([*NANO, "trainer.device_memory_gib=0.001"])
    with pytest.raises(TrainError) as refused:
        choose_micro_batches(tiny, state, mesh, rules, schedule, dataset)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("trainer.micro_batches=auto: the train step fits on none of the 8 cpu device(s): even with "
                              "2 micro-batches (1 x 64 tokens per batch shard each, the fewest the global batch allows) "
                              "it needs ")
    assert "MiB per device (arguments + temporaries), and a device offers 1.02 MiB (trainer.device_memory_gib)" in message


def test_the_candidates_keep_every_micro_batch_on_every_batch_shard():
    assert micro_batch_candidates(16, 8) == [1, 2]
    assert micro_batch_candidates(16, 2) == [1, 2, 4, 8]
    assert micro_batch_candidates(512, 128) == [1, 2, 4]
    assert micro_batch_candidates(6, 4) == [1, 2, 3, 6]  # the batch shards don't divide it: the batch's divisors


def test_the_setting_takes_auto_or_a_count_and_says_what_else():
    assert compose_config(NANO).trainer.micro_batches == "auto"
    assert compose_config([*NANO, "trainer.micro_batches=4"]).trainer.micro_batches == 4
    with pytest.raises(ConfigError, match=r"^trainer.micro_batches='atuo' must be of type int or one of \['auto'\]$"):
        compose_config([*NANO, "trainer.micro_batches=atuo"])
    with pytest.raises(ConfigError, match=r"choose trainer.micro_batches from \[1, 2, 4, 8, 16\], or trainer.micro_batches=auto"):
        compose_config([*NANO, "trainer.micro_batches=3"])
    with pytest.raises(ConfigError, match=r"device_memory_gib=0.0 must be > 0"):
        compose_config([*NANO, "trainer.device_memory_gib=0"])


def test_the_search_tries_the_fewest_first_then_bisects():
    from olmo_eqx.train.memory import Attempt, fewest_that_fit

    def search(fitting_from: int, candidates=(1, 2, 4, 8, 16)):
        best, tried = fewest_that_fit(list(candidates), lambda m: Attempt(m, m >= fitting_from, 100 // m))
        return (best.micro_batches if best else None), [a.micro_batches for a in tried]

    assert search(1) == (1, [1])  # fits as it is: one compile, the program the run uses
    assert search(8) == (8, [1, 4, 8])
    assert search(2) == (2, [1, 4, 2])
    assert search(16) == (16, [1, 4, 8, 16])
    assert search(32) == (None, [1, 4, 8, 16])


def test_a_fixed_count_says_a_line_only_when_the_devices_or_the_count_changed():
    from olmo_eqx.train.micro_batches import MicroBatchChoice

    fixed = MicroBatchChoice(4, auto=False, devices=2, processes=1, device_kind="cpu", platform="cpu")
    assert fixed.line() is None and fixed.line({"devices": 2, "micro_batches": 4}) is None
    assert fixed.line({"devices": 8, "micro_batches": 1}) == "8 -> 2 devices: micro-batches 1 -> 4 (trainer.micro_batches=4, fixed)"
    assert fixed.record() == {"devices": 2, "processes": 1, "device_kind": "cpu", "micro_batches": 4, "micro_batches_auto": False}
