"""The train loop every training stage shares (pretrain now, anneal later), top to bottom:

    data -> mesh -> restore the latest checkpoint in the run's checkpoint dir, or initialise
    -> loop: batch -> train_step -> metrics of the *previous* step fetched (so the host never
       stalls the device) -> log / held-out eval / checkpoint on schedule
    -> final checkpoint and summary.

Resume is automatic: a checkpoint holds the weights, optimiser state, step and data position
together, so a rerun with the same output directory continues bit for bit. SIGTERM/SIGINT
finish the step in flight (or, while the loop waits on a slow data server, cut the reads and
stop at the last step trained), save a checkpoint and return normally (exit status 0).

What goes wrong stops the run with one line (a `TrainError`) and nothing lost: a second run
on the same run dir (`olmo_eqx.run.lock`), an unwritable or too small checkpoint dir (before
compiling), a refused resume (before anything in the run dir changes), a checkpoint that
fails verification (set aside; the previous one is used), a failed save, token ids out of
range, and divergence (`divergence.py`: never saved, summary says `diverged`; the steps
saved since the last good one are set aside, so a rerun resumes from the good one).

In multi-process runs every process runs this loop; only process 0 prints and writes the
run directory's files, all through one `RunDir` (config.json, train.log, summary.json,
loss.png, and the metric sinks of `trainer.loggers`: metrics.jsonl, TensorBoard, W&B). Orbax
coordinates the checkpoint writes itself.

Read top to bottom: `train` (setup: data, mesh, lock, checkpointer, resume, run dir), then
`_Loop.run` (step, evaluate, save, stop) and the methods it calls. The wiring before the first
step (checkpoint dir, lock, resume or fresh start) is `setup.py`; data sources come from
`olmo_eqx.data.sources`, signals from `olmo_eqx.run.signals`, tokens/s from `throughput.py`,
the optional trace from `profile.py`.
"""

import contextlib
import dataclasses
import json
import math
import time
from itertools import islice
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh

from olmo_eqx.run import goodput, huge_pages
from olmo_eqx.batch import TokenBatch
from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.checkpoint.local_tier import LocalTier
from olmo_eqx.train.tiers import SaveWatch, never_completed, open_local_tier
from olmo_eqx.checkpoint.remote import STAGED_RECORD
from olmo_eqx.checkpoint.storage import check_storage
from olmo_eqx.checkpoint.paths import CheckpointDirOwnedError, claim_checkpoint_dir
from olmo_eqx.config import Config, config_to_dict
from olmo_eqx.data.loader import Interrupted, Prefetcher, global_batch_arrays
from olmo_eqx.data.remote import SizeCache
from olmo_eqx.data.sources import build_datasets, check_against_model, document_options, remote_sizes  # noqa: F401  (also imported from here)
from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.errors import TrainError
from olmo_eqx.models.flops import flops_per_token
from olmo_eqx.models.quantization import check_available as check_quantization
from olmo_eqx.models.registry import count_params
from olmo_eqx.run.plots import goodput_plot, loss_plot, read_metrics
from olmo_eqx.run.processes import FailureWatch
from olmo_eqx.run.run_dir import SUMMARY_FILE, RunDir, previous_training_figures
from olmo_eqx.run.secrets import hide_secrets
from olmo_eqx.infra.cluster import cluster_line, start_cluster
from olmo_eqx.sharding import ShardingRules, batch_sharding, make_mesh
from olmo_eqx.run.sinks import METRICS_FILE, check_loggers, last_recorded_step
from olmo_eqx.train.divergence import LIKELY_CAUSES, DivergenceGuard, SaveHealth, all_finite, runaway_loss_limit
from olmo_eqx.train.gap_alarm import GapAlarm, warn as warn_gap
from olmo_eqx.train.mfu import cpu_peak_source, mfu, peak_flops_per_device
from olmo_eqx.train.profile import StepProfiler
from olmo_eqx.train.schedules import make_schedule
from olmo_eqx.run.signals import any_process, ignore_signals_after_completion, stop_on_signals, while_interruptible
from olmo_eqx.train.state import TrainState, abstract_train_state, init_train_state
from olmo_eqx.train.memory import compiler_refusal
from olmo_eqx.train.micro_batches import MicroBatchChoice, choose_micro_batches
from olmo_eqx.train.setup import (
    InitState, _checkpoint_dir, _never_uploaded, _one_writer, _restore_or_init, previous_session,
)
from olmo_eqx.train.step import evaluate, make_eval_step, make_train_step
from olmo_eqx.train.throughput import Throughput

LOG_FILE = "train.log"
PLOT_FILE = "loss.png"


# ---------------------------------------------------------------------------------------------
# The loop

def random_init(config: Config, mesh: Mesh, rules: ShardingRules) -> TrainState:
    """Stage 1's start: weights from `trainer.seed`, a fresh optimiser."""
    return init_train_state(config.model, config.optim, mesh, rules, jax.random.key(config.trainer.seed))


def train(config: Config, run_dir: Path, init_state: InitState = random_init, notes: tuple[str, ...] = ()) -> dict:
    """Train (or resume) per `config`, writing into `run_dir`; returns the summary.

    init_state: how to start when the checkpoint dir holds nothing to resume (a later stage
    passes one that loads earlier weights); a resume always wins over it.
    notes: lines a stage wants at the top of this session's log (printed and kept in train.log).
    """
    ledger = goodput.Ledger.for_session()  # where the session's wall time goes, from the process's start
    with ledger.active():
        start_cluster()
        # A failure in one process stops every process within seconds, with its message.
        with FailureWatch():
            return ledger.finish(_train(config, run_dir, init_state, notes, ledger))


def _train(config: Config, run_dir: Path, init_state: InitState, notes: tuple[str, ...], ledger: goodput.Ledger) -> dict:
    started = time.perf_counter()
    run_dir = Path(run_dir).resolve()
    main_process = jax.process_index() == 0

    # Everything that can reject the config runs before any compilation or checkpoint I/O,
    # and nothing in the run dir is written until the config (and a resume) is accepted.
    try:
        # Remote token files: their sizes come from the run dir's cache when a previous session left one.
        size_cache = SizeCache(run_dir / SizeCache.FILE)
        check_against_model(config.data, config.model.vocab_size, config.model.max_sequence_length)
        check_quantization(config.model.quantization)  # its library, before anything compiles
        dataset, heldout = build_datasets(config.data, config.model.vocab_size, size_cache=size_cache.path)
        mesh = make_mesh(config.mesh)
        schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
        check_loggers(config.trainer.loggers)
        downstream = None
        if config.trainer.downstream_every:  # tasks and tokenizer read (or refused) before anything runs
            from olmo_eqx.evaluation.inloop import InLoopDownstream

            downstream = InLoopDownstream.from_config(config, config.model.vocab_size)
    except (DataFileError, ValueError, ImportError) as e:
        raise TrainError(str(e)) from e
    rules = ShardingRules()
    # The first line, printed before anything compiles (trainer.micro_batches=auto's compiles
    # report as they go), and the log's first line once the run dir is written.
    first_line = cluster_line(start_cluster(), mesh)
    if main_process:
        print(hide_secrets(first_line), flush=True)
    if main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    with _one_writer(run_dir, main_process):
        checkpoint_dir = _checkpoint_dir(config, run_dir)
        own_dir = config.checkpoint.dir is not None and checkpoint_dir != str(run_dir / "checkpoints")
        if config.checkpoint.dir is not None:
            # Recorded absolute (config.json, each checkpoint), so a rerun from anywhere finds it.
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=checkpoint_dir))
        if main_process:
            check_storage(checkpoint_dir, abstract_train_state(config.model, config.optim))
            if own_dir and ("://" not in checkpoint_dir or checkpoint_dir.startswith(("s3://", "gs://"))):
                try:
                    if note := claim_checkpoint_dir(checkpoint_dir, run_dir):
                        notes = (*notes, note)
                except CheckpointDirOwnedError as e:
                    raise TrainError(str(e)) from e
        checkpointer = Checkpointer(
            checkpoint_dir, keep_last=config.checkpoint.keep_last, keep_every=config.checkpoint.keep_every,
            staged_record=run_dir / STAGED_RECORD if main_process else None,
        )
        local = None
        try:
            notes = list(notes)
            local = open_local_tier(config, run_dir, mesh, rules, notes)  # the local tier, or None
            state, loader, start_step, health, stored_config = _restore_or_init(
                config, checkpointer, dataset, mesh, rules, init_state, notes, local
            )
            notes.extend(never_completed(checkpointer, local, start_step))
            notes.extend(_never_uploaded(checkpointer, start_step))
            # Refused (nothing fits) before anything in the run dir is written.
            say = (lambda line: print(line, flush=True)) if main_process else None  # noqa: E731
            previous = previous_session(stored_config)
            trains = start_step < (config.trainer.stop_at or config.trainer.steps)
            # trainer.micro_batches=auto compiles the step here: a signal stops at once (nothing to save yet).
            with stop_on_signals(say or (lambda line: None)) as stop, ledger.bucket("compile"):
                stop.nothing_to_save = True
                choice = while_interruptible(lambda: choose_micro_batches(
                    config, state, mesh, rules, schedule, dataset, progress=say, previous=previous, trains=trains))
            if line := choice.line(previous):
                notes.append(line)
            config_dict = {**config_to_dict(config), "session": choice.record()}
            out = RunDir(run_dir, enabled=main_process, log_name=LOG_FILE, loggers=config.trainer.loggers,
                         sink_config=config_dict)
            try:
                out.write_config(config_dict)
                ledger.write_to(out, start_step)  # the session's record, rewritten as it goes (process 0)
                if main_process:
                    size_cache.save(remote_sizes(dataset, heldout))
                recorded = last_recorded_step(out.file(METRICS_FILE)) if main_process else None
                if recorded is not None and recorded > start_step:  # e.g. a host lost before its upload
                    notes.append(f"{out.file(METRICS_FILE)} records steps up to {recorded}, past the checkpoint resumed "
                                 f"(step {start_step}): steps {start_step + 1}-{recorded} are trained again")
                out.print(first_line, echo=False)
                for note in notes:
                    out.print(note)
                loop = _Loop(config, out, state=state, start_step=start_step, loader=loader, heldout=heldout,
                             mesh=mesh, rules=rules, schedule=schedule, checkpointer=checkpointer, started=started,
                             health=health, downstream=downstream, choice=choice, ledger=ledger, local=local)
                loop.banner(mesh)
                summary = loop.run()
            except DataFileError as e:  # token ids out of range, found as the batch is read
                raise TrainError(f"{e}. Stopped before training on it; the checkpoints are intact") from e
            finally:
                out.close()
        except BaseException:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                checkpointer.close()
            with contextlib.suppress(Exception):
                local and local.close()
            raise
        with ledger.bucket("checkpoint"):
            checkpointer.close()  # waits for saves in flight
            if local is not None:
                if summary.get("stage_completed"):  # the persistent tier holds the end: give the host its RAM back
                    local.remove_after(None)
                local.close()
        return summary


class TrainingDiverged(TrainError):
    """Loss, grad norm, held-out loss or the state went non-finite, or too many steps were skipped."""


class _Loop:
    """The loop proper, from `start_step` to `trainer.stop_at or trainer.steps`: the state it
    carries between steps lives on this object, each piece of host-side work is one method."""

    def __init__(self, config: Config, out: RunDir, *, state, start_step, loader, heldout, mesh, rules, schedule, ledger,
                 checkpointer, started, health: SaveHealth, downstream=None, choice: Optional[MicroBatchChoice] = None,
                 local: Optional[LocalTier] = None):
        self.config, self.out, self.state, self.loader, self.checkpointer = config, out, state, loader, checkpointer
        self.saves = SaveWatch(checkpointer, local, config.checkpoint.local_every)  # the local tier, "step N is safe"
        self.start_step, self.started, self.ledger = start_step, started, ledger  # ledger: olmo_eqx.run.goodput
        trainer, data = config.trainer, config.data
        self.trainer = trainer
        self.sharding = batch_sharding(mesh, rules)
        self.documents = document_options(data)
        # The first `eval_batches` batches of every held-out set, on the devices once.
        self.eval_batches: dict[str, list[TokenBatch]] = {}
        for heldout_set in heldout if trainer.eval_every else []:
            batches = heldout_set.batches(data.global_batch_size, jax.process_index(), jax.process_count())
            self.eval_batches[heldout_set.name] = [
                global_batch_arrays(b, self.sharding, **self.documents) for b in islice(batches, trainer.eval_batches)
            ]
        if choice is None:
            choice = MicroBatchChoice(trainer.micro_batches, auto=False, devices=jax.device_count(),
                                      processes=jax.process_count(), device_kind=jax.devices()[0].device_kind,
                                      platform=jax.devices()[0].platform)
        self.choice = choice
        self.train_step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=choice.micro_batches)
        self.eval_step = make_eval_step(mesh, rules)
        # Downstream tasks on the live model (olmo_eqx.evaluation.inloop), or None.
        self.downstream = downstream
        if downstream is not None:
            downstream.attach(mesh, rules)

        self.model_flops = float(flops_per_token(config.model, data.sequence_length))
        self.peak = peak_flops_per_device()
        self.n_params = count_params(config.model)
        # A checkpoint already past the end (trainer.stop_at below it) is where the run stays:
        # nothing is trained, and the summary names that checkpoint.
        self.end_step = max(trainer.stop_at or trainer.steps, start_step)
        self.config_dict = {**config_to_dict(config), "session": choice.record()}
        self.last_saved = start_step if start_step else None
        self.guard = DivergenceGuard(
            history=int(jax.device_get(state.history_count)),
            min_history=config.optim.skip_history_needed if config.optim.skip_step_std else None,
            max_consecutive_skips=trainer.max_consecutive_skips,
            loss_limit=runaway_loss_limit(config.model.vocab_size, trainer.runaway_loss_margin),
            runaway_steps=trainer.runaway_loss_steps,
        )
        # Which saves are known good: retention keeps the last of them through any trouble.
        self.health = health
        health.loss_limit = self.guard.loss_limit
        checkpointer.protect(health.last_good)
        self.throughput = Throughput(data.global_batch_size * data.sequence_length)
        self.recent_losses: list[float] = []
        self.last_heldout: Optional[float] = None
        self.last_heldout_tokens: Optional[float] = None
        self.last_heldout_sets: dict[str, float] = {}
        # Training loss falling while held-out loss doesn't: is data repeating?
        self.gap_alarm = GapAlarm(trainer.gap_alarm)
        # This session's records, for loss.png when metrics.jsonl is not among the loggers.
        self.history: list[dict] = []
        self.loop_started = time.perf_counter()

    def run(self) -> dict:
        trainer, checkpointer = self.trainer, self.checkpointer
        interrupted = None
        pending: Optional[tuple[int, dict]] = None
        profiler = StepProfiler(trainer.profile_steps, self.out.path, self.out.enabled, self.out.print)
        sharding, documents = self.sharding, self.documents
        to_global = lambda b: global_batch_arrays(b, sharding, **documents)  # noqa: E731  (runs in the prefetch thread)
        self.loop_started = time.perf_counter()
        depth = self.config.data.prefetch_batches
        # Remote token files: `depth` batches read at once, so round trips overlap across batches too.
        workers = depth if self.loader.dataset.reader is not None else 1
        prefetcher = Prefetcher(self.loader, depth=depth, transform=to_global, workers=workers)
        # The stop signals stay handled until the summary is written: a second Ctrl-C during the
        # final save stops at once too, not with a traceback.
        with stop_on_signals(self.out.print) as stop:
            with prefetcher as batches:
                if jax.process_count() == 1:  # several processes must agree on their last step: at log steps
                    prefetcher.interrupted = lambda: bool(stop)
                # Until the first step has run, a signal stops at once (olmo_eqx.run.signals): that step
                # compiles, for minutes on a large model, and before it there is nothing new to save.
                stop.nothing_to_save = True
                self.ledger.phase("steps")
                try:
                    for step in range(self.start_step + 1, self.end_step + 1):
                        profiler.before_step(step)
                        try:
                            with self.ledger.waiting_for_data(pending and pending[1]):  # the step in flight
                                batch = next(batches)
                        except Interrupted:  # a signal while a slow server held the batch: stop at the last step
                            interrupted, self.end_step = stop.signal, step - 1
                            break
                        if stop.nothing_to_save:
                            self.state, metrics = while_interruptible(self.step, self.state, batch)
                            stop.nothing_to_save = False
                        else:
                            self.state, metrics = self.step(self.state, batch)
                        profiler.after_step(step, metrics)
                        checkpointer.check_for_errors()  # a failed save stops the run now, not at the end
                        if pending is not None:  # the previous step's metrics, one step late
                            self.record(*pending, boundary=False)
                            pending = None
                        evaluate_now = bool(self.eval_batches) and (step % trainer.eval_every == 0 or step == self.end_step)
                        save_now = bool(self.config.checkpoint.every) and step % self.config.checkpoint.every == 0
                        # A step is checked by the divergence guard before it is saved or evaluated.
                        log_now = step == self.start_step + 1 or step % trainer.log_every == 0 or step == self.end_step
                        downstream_now = self.downstream is not None and self.downstream.due(step, self.end_step)
                        if log_now or evaluate_now or save_now or downstream_now:
                            self.record(step, metrics, boundary=True)
                        else:
                            pending = (step, metrics)
                        if evaluate_now:
                            self.run_eval(step)
                        if downstream_now:
                            with self.ledger.bucket("eval"):
                                self.downstream.run(step, self.state.model, self.write, self.out.print)
                            self.throughput.pause()
                        local_now = not save_now and self.saves.local_due(step, self.end_step)
                        if save_now or local_now:
                            self.save(step, local=local_now)
                        self.saves.poll(step, jax.process_count() == 1 or step % trainer.log_every == 0, self.write, self.out.print)
                        self.ledger.step_done(step, logged=log_now, saved=save_now or local_now)
                        # Every process must stop at the same step: agree (a collective) at log steps.
                        if (jax.process_count() == 1 or step % trainer.log_every == 0) and step < self.end_step:
                            if any_process(bool(stop)):
                                interrupted, self.end_step = stop.signal or "signal on another process", step
                                break
                    if pending is not None:
                        self.record(*pending, boundary=False)
                finally:
                    profiler.stop()  # a run stopped inside the profiled range still leaves its trace
                    self.ledger.phase("other")
            if self.start_step >= self.end_step and interrupted is None:
                self.out.print(f"Nothing to train: the checkpoint is at step {self.start_step}, the run ends at "
                               f"{trainer.stop_at or trainer.steps}")
                if self.eval_batches:
                    self.run_eval(self.start_step)
            self.save(self.end_step)
            with self.ledger.bucket("checkpoint"):
                checkpointer.wait_until_finished()
                self.saves.poll(self.end_step, True, self.write, self.out.print, wait=True)

            end_step = self.end_step
            summary = self.summary(end_step, interrupted=interrupted)
            summary_path = self.out.write_summary(summary)
        ignore_signals_after_completion(self.out.print)  # saved and summarised: the exit status stays 0
        self.plot()
        if summary["goodput"] is not None:  # again, with the plot's seconds
            summary["goodput"] = goodput.run_report(self.out.path, self.ledger, ended=goodput.outcome(summary))
            self.out.write_summary(summary)
        took = f"{summary['wall_time_s']:.1f}s"
        if end_step == trainer.steps:
            status = f"done in {took}"
        else:
            status = f"stopped at step {end_step} ({interrupted or 'trainer.stop_at'}) after {took}; rerun to resume"
        plot = f" | plot: {self.out.file(PLOT_FILE)}" if self.trainer.plot else ""
        self.out.print(
            f"\n{status} | summary: {summary_path}{plot}"
            # summary.json holds the goodput report whole; here its one line.
            f"\n{json.dumps({k: v for k, v in summary.items() if k != 'goodput'}, indent=2)}"
            + (f"\n{goodput.report_line(summary['goodput'])}" if summary["goodput"] else "")
        )
        return summary

    def banner(self, mesh: Mesh) -> None:
        data, trainer = self.config.data, self.trainer
        tokens = data.global_batch_size * data.sequence_length
        self.out.print(
            f"{self.config.model.name}: {self.n_params:,} parameters | {jax.device_count()} {jax.devices()[0].platform} "
            f"device(s), mesh {dict(mesh.shape)} | batch {data.global_batch_size} x {data.sequence_length} = "
            f"{tokens:,} tokens ({data.global_batch_size * (data.sequence_length - 1):,} of them targets: a sequence's "
            f"first token is never predicted) | steps {self.start_step} -> {self.end_step} of {trainer.steps} "
            f"| run dir {self.out.path}"
        )
        device = jax.devices()[0]
        if self.peak is None:
            self.out.print(f"MFU not reported: no known peak FLOP/s for device kind {device.device_kind!r}")
        else:
            source = f"float32 matmul peak of this CPU, {cpu_peak_source()}" if device.platform == "cpu" else device.device_kind
            self.out.print(f"MFU = model FLOPs/s per device / {self.peak / 1e12:.3g} TFLOP/s ({source})")
        if device.platform == "cpu":
            self.out.print(f"host memory: {huge_pages.describe()}")
        # Else the first step's silence (seconds to minutes) looks like a hang.
        if self.start_step < self.end_step:
            when = ("compiled above (trainer.micro_batches=auto): step {}'s line comes once it has run" if self.choice.auto
                    else "compiling the train step: step {}'s line comes once it has compiled and run")
            self.out.print(when.format(self.start_step + 1))

    def step(self, state, batch):
        """One train step; a device that runs out of memory stops the run with one line."""
        try:
            return self.train_step(state, batch)
        except Exception as e:
            if (refusal := compiler_refusal(e)) is None:
                raise
            choice = self.choice
            fix = ("XLA's memory analysis said it fits: set trainer.device_memory_gib below the device's memory to "
                   "leave room" if choice.auto else
                   "set trainer.micro_batches=auto to take the fewest micro-batches that fit")
            raise TrainError(
                f"the train step does not fit on {choice.devices} {choice.platform} device(s) with "
                f"{choice.micro_batches} micro-batch(es) (trainer.micro_batches={'auto' if choice.auto else choice.micro_batches}): "
                f"{refusal}. {fix}, or run on more devices, or lower model.remat (full keeps least); the checkpoints are intact"
            ) from None

    def write(self, record: dict) -> None:
        self.history.append(record)
        self.out.metrics(record)

    def diverged(self, step: int, reason: str):
        """Stop without saving: the summary says `diverged`; the steps saved since the last
        good one are set aside (kept), so a rerun resumes from the good one."""
        checkpointer, good = self.checkpointer, self.health.last_good
        checkpointer.wait_until_finished()
        self.saves.drop_local_after(good)  # a cache: the steps saved since the trouble began go
        steps = checkpointer.all_steps()
        if not steps:
            kept = "no checkpoint was saved"
        elif good in steps:
            suspect = [s for s in steps if s > good]
            for s in suspect:
                checkpointer.set_aside(s, "saved during divergence")
            kept = f"the last good checkpoint is {checkpointer.directory / str(good)} (step {good}); a rerun resumes from it"
            if suspect:
                where = ("marked with set_aside.json in the store" if checkpointer.remote is not None
                         else f"moved to {checkpointer.directory / 'set_aside'}")
                kept += f"; step(s) {suspect}, saved after the trouble began, were {where}"
        else:
            kept = (f"no checkpoint is known good (none was followed by a healthy step); the newest, step "
                    f"{steps[-1]}, is where a rerun resumes")
        message = f"training diverged: {reason}. Stopped at step {step} without saving ({kept}); {LIKELY_CAUSES}"
        self.out.print(message)
        self.out.write_summary(self.summary(step, diverged={"step": step, "reason": reason, "last_good_step": good}))
        self.plot()
        raise TrainingDiverged(message)

    @goodput.counted("checkpoint")  # the blocking part; Orbax writes on in the background
    def save(self, step: int, local: bool = False) -> None:
        """Save `step` to the persistent tier, or (`local`) to the local tier."""
        if step != self.last_saved:
            if not bool(all_finite(self.state)):
                self.diverged(step, f"the weights or optimiser state hold non-finite values after step {step}")
            saved = dict(loader_state=self.loader.state, config=self.config_dict, health=self.health.saved_record())
            if local:  # a cache beside the persistent tier: the health record and last_saved stay the persistent tier's
                if self.saves.local is not None:  # None: this host found no room for a tier that another host has
                    self.saves.local.save(step, self.state, **saved)
                return
            self.checkpointer.save(step, self.state, **saved)
            self.health.saved(step)
            self.last_saved = step

    def record(self, step: int, metrics: dict, boundary: bool) -> None:
        """Host side of step `step`: fetch and write its metrics; print at log steps."""
        trainer = self.trainer
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.recent_losses.append(values["loss"])
        del self.recent_losses[: -trainer.log_every]
        self.gap_alarm.train_loss(values["loss"])
        entry = {"step": step, **values}
        if boundary:
            first = self.throughput.step is None
            rate = self.throughput.boundary(step)
            utilisation = mfu(self.model_flops, rate, jax.device_count(), self.peak) if rate else None
            if rate:
                entry.update(tokens_per_s=rate, mfu=utilisation)
            reader = self.loader.dataset.reader
            if reader is not None:  # remote token files: requests and retried failures so far
                entry.update(reader.stats)
            if first or step % trainer.log_every == 0 or step == self.end_step:
                if rate is None:
                    compiled = "compiled before it, trainer.micro_batches=auto" if self.choice.auto else "with compilation"
                    speed = f"first step ({compiled}) {time.perf_counter() - self.loop_started:.1f}s"
                else:
                    speed = f"{rate:,.0f} tok/s" + (f" | MFU {100 * utilisation:.1f}%" if utilisation else "")
                self.out.print(
                    f"step {step:>6}/{trainer.steps} | loss {values['loss']:.4f} | lr {values['lr']:.2e} "
                    f"| grad norm {values['grad_norm']:.3f} | {speed}" + (" | SKIPPED" if values["skipped"] else "")
                    + (f" | data retries {entry['data_retries']}" if entry.get("data_retries") else "")
                )
        self.write(entry)
        if reason := self.guard.observe(step, values["loss"], values["grad_norm"], bool(values["skipped"])):
            self.diverged(step, reason)
        self.health.observe(step, values["loss"], values["grad_norm"], bool(values["skipped"]))
        self.checkpointer.protect(self.health.last_good)

    @goodput.counted("eval")
    def run_eval(self, step: int) -> None:
        """Held-out loss per set; `heldout_loss` is their token-weighted mean."""
        results = evaluate(self.eval_step, self.state.model, self.eval_batches)
        tokens = sum(count for _, count in results.values())
        heldout = sum(loss * count for loss, count in results.values()) / max(tokens, 1.0)
        self.last_heldout, self.last_heldout_tokens = heldout, tokens
        self.last_heldout_sets = {name: loss for name, (loss, _) in results.items()}
        self.write({"step": step, "heldout_loss": heldout, "heldout_tokens": tokens, "heldout": self.last_heldout_sets})
        for name, (loss, count) in results.items():
            self.out.print(
                f"step {step:>6}/{self.trainer.steps} | held-out loss {loss:.4f} ({name}, first "
                f"{self.trainer.eval_batches} batches = {count:,.0f} target tokens)"
            )
        if not math.isfinite(heldout):
            self.diverged(step, f"held-out loss is {heldout} at step {step}")
        if (alarm := self.gap_alarm.heldout(step, heldout)) is not None and self.out.enabled:
            self.write(alarm)
            warn_gap(alarm)
        self.throughput.pause()

    def summary(self, end_step: int, interrupted: Optional[str] = None, diverged: Optional[dict] = None) -> dict:
        tps = self.throughput.mean
        losses = self.recent_losses
        wall = time.perf_counter() - self.started
        summary = {
            "stage_completed": end_step == self.trainer.steps and diverged is None,
            "interrupted": interrupted,
            "model": self.config.model.name,
            "parameters": self.n_params,
            "start_step": self.start_step,
            "end_step": end_step,
            "steps": self.trainer.steps,
            # The mean over the last `train_loss_mean_steps` steps (trainer.log_every): one
            # step's loss is noisy; `last_step_loss` is the last one alone.
            "train_loss_mean_last_n": float(np.mean(losses)) if losses else None,
            "train_loss_mean_steps": len(losses),
            "last_step_loss": losses[-1] if losses else None,
            # Token-weighted mean over the held-out sets of the last in-loop evaluation: the
            # first trainer.eval_batches batches of each set (`final_heldout_tokens` target
            # tokens). `+stage=eval` reports the same number given stage.heldout_batches equal
            # to trainer.eval_batches.
            "final_heldout_loss": self.last_heldout,
            "final_heldout_tokens": self.last_heldout_tokens,
            "final_heldout_losses": self.last_heldout_sets,
            "eval_batches": self.trainer.eval_batches,
            # The training rate, as the progress lines show it: the steps after the first logged
            # one, without compilation, held-out evaluation and checkpoint saves (and MFU from
            # it). `tokens_per_s_wall` is the session's tokens over its whole wall time.
            "tokens_per_s": tps,
            "tokens_per_s_excludes": "compilation, held-out evaluation, checkpoint saves",
            "mfu": mfu(self.model_flops, tps, jax.device_count(), self.peak) if tps else None,
            "tokens_per_s_wall": (end_step - self.start_step) * self.throughput.tokens_per_step / wall if wall else None,
            "wall_time_s": wall,
            "devices": jax.device_count(),
            # This session's count: trainer.micro_batches, or what auto chose (and why).
            "micro_batches": self.choice.micro_batches,
            "micro_batches_auto": self.choice.line() if self.choice.auto else None,
            "checkpoint": str(self.checkpointer.directory / str(end_step)) if diverged is None else None,
            "run_dir": str(self.out.path),
        }
        if end_step == self.start_step and not losses and diverged is None:
            summary.update(previous_training_figures(self.out.file(SUMMARY_FILE), end_step))
        if self.downstream is not None:
            summary.update(self.downstream.summary())
        if diverged is not None:
            summary["diverged"] = diverged
        summary["goodput"] = goodput.run_report(self.out.path, self.ledger) if self.out.enabled else None
        return summary

    def plot(self) -> None:
        """loss.png from the whole run (metrics.jsonl when kept, else this session's records)."""
        if not self.out.enabled or not self.trainer.plot:
            return
        metrics_file = self.out.file(METRICS_FILE)
        records = read_metrics(metrics_file) if "jsonl" in self.trainer.loggers and metrics_file.exists() else self.history
        # The plotted steps (a resumed run draws its earlier sessions' records too), not this session's.
        steps = [r["step"] for r in records if "step" in r]
        span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps"
        title = f"{self.config.model.name} | {self.out.path.name} | {span} of {self.trainer.steps}"
        loss_plot(records, self.out.file(PLOT_FILE), title=title)
        goodput_plot(goodput.run_report(self.out.path, self.ledger), self.out.file(goodput.PLOT_FILE), title=title)
