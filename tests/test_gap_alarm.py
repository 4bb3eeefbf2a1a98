"""The generalisation-gap alarm: fires when training loss keeps falling while held-out loss
does not (data repeating), stays quiet when both fall or both plateau; and, end to end, fires in
the loop on a planted repeating data stream."""

import io
import json
import math

import numpy as np
import pytest

from olmo_eqx.config import compose_config
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.train.gap_alarm import GapAlarm, GapAlarmConfig, message, warn
from olmo_eqx.train.loop import train

from evalhelp import write_toy_tasks


def feed(alarm: GapAlarm, train_losses, heldout_losses, steps_per_eval=10):
    """Feed `steps_per_eval` training losses per evaluation; the steps at which it fired."""
    fired = []
    rng = np.random.default_rng(0)
    for i, (train_loss, heldout_loss) in enumerate(zip(train_losses, heldout_losses)):
        for _ in range(steps_per_eval):
            alarm.train_loss(train_loss + 0.02 * rng.standard_normal())
        record = alarm.heldout((i + 1) * steps_per_eval, heldout_loss)
        if record is not None:
            fired.append(record)
    return fired


def test_fires_when_training_falls_and_heldout_is_flat():
    n = 12
    train = np.linspace(6.0, 5.0, n)  # memorising: keeps falling
    heldout = 6.2 + 0.01 * np.sin(np.arange(n))  # flat
    fired = feed(GapAlarm(), train, heldout)
    assert fired, "the alarm stayed quiet on a repeating stream"
    first = fired[0]
    assert first["step"] == 40  # the first full window (4 evaluations)
    gap = first["gap_alarm"]
    assert gap["train_drop"] > 0.2 and abs(gap["heldout_drop"]) < 0.05
    assert gap["steps"] == [10, 20, 30, 40] and len(gap["train"]) == len(gap["heldout"]) == 4
    # After firing it needs a fresh window: at most every (window - 1) evaluations.
    assert np.all(np.diff([r["step"] for r in fired]) >= 30)


def test_fires_when_heldout_rises():
    fired = feed(GapAlarm(), np.linspace(4.0, 3.0, 6), np.linspace(5.0, 5.3, 6))
    assert fired and fired[0]["gap_alarm"]["heldout_drop"] < 0


@pytest.mark.parametrize(
    "train, heldout",
    [
        # healthy training: both fall (held-out a bit above and a bit slower)
        (5.0 + 3.0 * np.exp(-np.arange(40) / 8), 5.3 + 2.8 * np.exp(-np.arange(40) / 8)),
        # late training: both nearly flat
        (np.linspace(3.10, 3.08, 40), np.linspace(3.20, 3.19, 40)),
        # training loss rising (e.g. a new mix) while held-out is flat: not the repeating shape
        (np.linspace(3.0, 3.5, 40), np.full(40, 3.2)),
    ],
)
def test_quiet_on_normal_runs(train, heldout):
    assert feed(GapAlarm(), train, heldout) == []


def noisy_small_batch(seed, train_fall_per_step, heldout_fall_per_eval, steps_per_eval=50, evals=6):
    """Step losses spread as with 2 sequences a step (standard deviation 0.1 around the trend)."""
    alarm, rng, fired = GapAlarm(), np.random.default_rng(seed), []
    for i in range(evals):
        for j in range(steps_per_eval):
            alarm.train_loss(3.0 - train_fall_per_step * (i * steps_per_eval + j) + 0.1 * rng.standard_normal())
        record = alarm.heldout((i + 1) * steps_per_eval, 3.3 - heldout_fall_per_eval * i)
        fired += [record] if record else []
    return fired


@pytest.mark.parametrize("seed", range(8))
def test_small_batch_noise_alone_does_not_fire_but_memorising_through_it_does(seed):
    # Both curves fall 0.04 a window (the README's long-context stage): quiet, whatever the draw.
    assert noisy_small_batch(seed, train_fall_per_step=0.04 / 150, heldout_fall_per_eval=0.04 / 3) == []
    # Training falls 0.5 a window through the same noise while held-out stays flat: fires.
    fired = noisy_small_batch(seed, train_fall_per_step=0.5 / 150, heldout_fall_per_eval=0.0)
    assert fired and fired[0]["gap_alarm"]["train_drop_se"] > 0


def test_evaluations_without_training_between_are_ignored():
    alarm = GapAlarm(GapAlarmConfig(window=2))
    assert alarm.heldout(0, 7.0) is None  # e.g. a resume that has nothing left to train
    for step, (train_loss, heldout_loss) in enumerate([(6.0, 7.0), (5.0, 7.0)], start=1):
        alarm.train_loss(train_loss)
        record = alarm.heldout(step, heldout_loss)
    assert record is not None and record["gap_alarm"]["steps"] == [1, 2]
    alarm.train_loss(math.nan)  # non-finite losses (skipped steps) don't count
    assert alarm.heldout(3, 7.0) is None


def test_config_is_checked():
    with pytest.raises(ValueError, match="window"):
        GapAlarmConfig(window=1)
    with pytest.raises(ValueError, match="heldout_fraction"):
        GapAlarmConfig(heldout_fraction=1.5)


def test_warning_is_loud_and_says_what_to_check():
    record = feed(GapAlarm(), np.linspace(6.0, 5.0, 4), np.full(4, 6.2))[0]
    out = io.StringIO()
    warn(record, file=out)
    text = out.getvalue()
    assert text == message(record) + "\n"
    assert "GENERALISATION-GAP ALARM at step 40" in text and "repeat" in text and "!!!!" in text


def test_loop_alarms_on_a_planted_repeating_stream(tmp_path, capsys):
    """8 instances of 64 tokens, batch 8: every step sees the same data (the seed's failure).
    The nano model memorises them (training loss falls fast) while the embedded held-out loss
    flattens, and the in-loop downstream tasks, scored at the same steps, get no better: the
    two signals a user reads together (docs/evaluation.md, "In the training loop")."""
    corpus = embedded_corpus()
    tasks = write_toy_tasks(tmp_path / "tasks")
    repeating = tmp_path / "repeating.npy"  # headerless token file, like OLMo-core's
    np.fromfile(corpus.train_files[0], dtype=np.uint16)[: 8 * 64].tofile(repeating)
    config = compose_config(
        [
            "+stage=pretrain",
            "model=olmo3_nano",
            f"data.source={repeating}",
            f"+data.heldout.stdlib={corpus.heldout_files[0]}",
            "data.sequence_length=64",
            "data.global_batch_size=8",
            "trainer.steps=12",
            "trainer.log_every=6",
            "trainer.eval_every=3",
            "trainer.eval_batches=1",
            "schedule.warmup_steps=1",
            "optim.lr=1e-2",
            "checkpoint.every=0",
            "trainer.downstream_every=3",
            "trainer.downstream.tasks=[toy_qa/rc_0shot,toy_wino/rc_0shot]",  # short: one small batch each
            f"trainer.downstream.tasks_dir={tasks}",
            "trainer.downstream.batch_size=8",
            f"trainer.downstream.tokenizer={corpus.tokenizer_path}",
        ]
    )
    run_dir = tmp_path / "run"
    train(config, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    alarms = [r for r in records if "gap_alarm" in r]
    assert alarms, [(r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r]
    assert alarms[0]["gap_alarm"]["train_drop"] > 0.5
    assert "GENERALISATION-GAP ALARM" in capsys.readouterr().err
    # Over the alarm's window the downstream curve is flat or worse: no task's gold answers got
    # likelier by more than a tenth of what training loss fell (in nats per token, bpb x ln 2).
    window = alarms[0]["gap_alarm"]
    downstream = {r["step"]: r["downstream"] for r in records if "downstream" in r}
    assert sorted(downstream) == [3, 6, 9, 12]
    first, last = downstream[window["from_step"]], downstream[window["to_step"]]
    gains = {task: (first[task]["bpb"] - last[task]["bpb"]) * math.log(2) for task in first}
    assert max(gains.values()) < 0.1 * window["train_drop"], (gains, window["train_drop"])
    assert all(last[t][m] <= first[t][m] for t in first for m in first[t] if m != "bpb"), (first, last)  # accuracy


def test_thresholds_are_config_keys():
    from olmo_eqx.config import compose_config

    config = compose_config(["trainer.gap_alarm.window=6", "trainer.gap_alarm.min_train_drop=0.1"])
    assert (config.trainer.gap_alarm.window, config.trainer.gap_alarm.min_train_drop) == (6, 0.1)
    with pytest.raises(Exception, match="window=1 must be >= 2"):
        compose_config(["trainer.gap_alarm.window=1"])
