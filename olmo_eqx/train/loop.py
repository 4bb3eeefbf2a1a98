"""The train loop every training stage shares (pretrain now, anneal later), top to bottom:

    data -> mesh -> restore the latest checkpoint in the run's checkpoint dir, or initialise
    -> loop: batch -> train_step -> metrics of the *previous* step fetched (so the host never
       stalls the device) -> log / held-out eval / checkpoint on schedule
    -> final checkpoint and summary.

Resume is automatic: a checkpoint holds the weights, optimiser state, step and data position
together, so a rerun with the same output directory continues bit for bit. SIGTERM/SIGINT
finish the step in flight, save a checkpoint and return normally (exit status 0).

What goes wrong stops the run with one line (a `StageError`) and nothing lost: a second run
on the same run dir (`run_lock`), an unwritable or too small checkpoint dir (before
compiling), a refused resume (before anything in the run dir changes), a checkpoint that
fails verification (set aside; the previous one is used), a failed save, token ids out of
range, and divergence (`divergence.py`: never saved, summary says `diverged`).

In multi-process runs every process runs this loop; only process 0 prints and writes the
run directory's files (config.json, metrics.jsonl, train.log, summary.json). Orbax
coordinates the checkpoint writes itself.
"""

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh

from olmo_eqx.batch import TokenBatch
from olmo_eqx.checkpoint import CheckpointCorruptError, CheckpointMismatchError, Checkpointer, check_storage
from olmo_eqx.config import Config, DataConfig, config_to_dict
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.data.heldout import HeldOutSet, heldout_sets
from olmo_eqx.data.instances import InstanceDataset
from olmo_eqx.data.loader import DataLoader, Prefetcher, global_batch_arrays
from olmo_eqx.data.mixes import read_mix, source_from_paths
from olmo_eqx.data.sampler import LoaderState
from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.flops import flops_per_token
from olmo_eqx.models.olmo3 import count_params
from olmo_eqx.run_lock import RunLock, RunLockedError
from olmo_eqx.sharding import ShardingRules, batch_sharding, make_mesh, maybe_initialize_distributed
from olmo_eqx.stages import StageError
from olmo_eqx.sweep import SUMMARY_FILE
from olmo_eqx.train.divergence import LIKELY_CAUSES, DivergenceGuard, all_finite
from olmo_eqx.train.gap_alarm import GapAlarm, warn as warn_gap
from olmo_eqx.train.mfu import mfu, peak_flops_per_device
from olmo_eqx.train.schedules import make_schedule
from olmo_eqx.train.state import TrainState, abstract_train_state, init_train_state, sharded_abstract_train_state
from olmo_eqx.train.step import make_eval_step, make_train_step

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"


# ---------------------------------------------------------------------------------------------
# Data


def build_datasets(data: DataConfig, vocab_size: int) -> tuple[InstanceDataset, list[HeldOutSet]]:
    """The training instances and the named held-out sets of `data`."""
    seq = data.sequence_length
    heldout = []
    if data.source == "embedded":
        corpus = embedded_corpus()
        if corpus.vocab_size > vocab_size:
            raise DataFileError(
                f"the embedded corpus has {corpus.vocab_size} token ids but model.vocab_size is {vocab_size}; "
                f"use a model with vocab_size >= {corpus.vocab_size} (e.g. model=olmo3_tiny)"
            )
        train = corpus.train_dataset(seq, filter_repeated_ngrams=data.filter_repeated_ngrams)
        if not data.heldout:
            heldout = [corpus.heldout_set(seq)]
    else:
        if data.source.endswith(".txt"):
            if not (data.data_root and data.tokenizer):
                raise DataFileError(f"data.source={data.source!r} is a mix manifest: set data.data_root and data.tokenizer")
            sources = read_mix(data.source, data.data_root, data.tokenizer)
        else:
            sources = [source_from_paths("train", data.source)]
        train = InstanceDataset(sources, seq, vocab_size, filter_repeated_ngrams=data.filter_repeated_ngrams)
    if data.heldout:
        heldout = heldout_sets([source_from_paths(name, paths) for name, paths in data.heldout.items()], seq, vocab_size)
    return train, heldout


DOLMA2_EOS = 100257  # OLMo 3's tokenizer (allenai/dolma2-tokenizer)


def document_options(data: DataConfig) -> dict:
    """How batches mark documents (`global_batch_arrays` keywords): nothing unless document masking."""
    if not data.document_masking:
        return {}
    eos = data.eos_token_id
    if eos is None:
        eos = embedded_corpus().eos_id if data.source == "embedded" else DOLMA2_EOS
    return {"eos_id": eos, "reset_positions": data.reset_positions_per_document}


# ---------------------------------------------------------------------------------------------
# Interruption


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps."""

    def __init__(self):
        self.signal: Optional[str] = None

    def __bool__(self) -> bool:
        return self.signal is not None


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Turn SIGTERM/SIGINT into a flag for the duration (a second SIGINT still interrupts)."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signal handlers can only be installed from the main thread
        return

    def handler(signum, _frame):
        if flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signal = signal.Signals(signum).name
        if jax.process_index() == 0:
            print(f"\n{flag.signal} received: finishing this step, then saving a checkpoint", flush=True)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _all_agree(flag: bool) -> bool:
    """True when any process saw a stop signal (every process must stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


# ---------------------------------------------------------------------------------------------
# Logging


class MetricsLog:
    """Process 0's outputs: metrics as JSON lines in `metrics.jsonl`, and the printed progress,
    also kept in `train.log`. Both append, so a resumed run continues them (after a hard kill
    the steps since the last checkpoint appear twice; the later record of a step wins)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled = enabled
        self._metrics = open(run_dir / METRICS_FILE, "a") if enabled else None
        self._text = open(run_dir / LOG_FILE, "a") if enabled else None

    def write(self, record: dict) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def print(self, text: str) -> None:
        if self._text is not None:
            print(text, flush=True)
            self._text.write(text + "\n")
            self._text.flush()

    def close(self) -> None:
        for file in (self._metrics, self._text):
            if file is not None:
                file.close()


def evaluate(eval_step, model, sets: dict[str, list[TokenBatch]]) -> dict[str, tuple[float, float]]:
    """Per held-out set: (mean cross-entropy over its batches, number of target tokens)."""
    results = {}
    for name, batches in sets.items():
        ce = count = 0.0
        for batch in batches:
            sums = jax.device_get(eval_step(model, batch))
            ce, count = ce + float(sums.ce), count + float(sums.count)
        results[name] = (ce / max(count, 1.0), count)
    return results


class Throughput:
    """Tokens/s over windows between *boundaries*: steps whose metrics are fetched at once.

    Every step counted in a window was dispatched after the window began, so the rate is
    right whether the backend runs steps asynchronously (accelerators) or inside the
    dispatch call (often on CPU). The first boundary only opens a window (it includes
    compilation); `pause` restarts the clock (evaluation is not training throughput).
    """

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.step: Optional[int] = None
        self.time = 0.0
        self.tokens, self.seconds = 0, 0.0

    def boundary(self, step: int) -> Optional[float]:
        """Close the window at `step` (its metrics just fetched); its tokens/s, or None for the first."""
        now, rate = time.perf_counter(), None
        if self.step is not None and step > self.step:
            tokens, seconds = (step - self.step) * self.tokens_per_step, now - self.time
            self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
            rate = tokens / seconds
        self.step, self.time = step, now
        return rate

    def pause(self) -> None:
        self.time = time.perf_counter()

    @property
    def mean(self) -> Optional[float]:
        return self.tokens / self.seconds if self.seconds else None


# ---------------------------------------------------------------------------------------------
# The loop

# Builds a fresh state when there is no checkpoint to resume: (config, mesh, rules) -> TrainState.
InitState = Callable[[Config, Mesh, ShardingRules], TrainState]


def random_init(config: Config, mesh: Mesh, rules: ShardingRules) -> TrainState:
    """Stage 1's start: weights from `trainer.seed`, a fresh optimiser."""
    schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
    return init_train_state(config.model, config.optim, schedule, mesh, rules, jax.random.key(config.trainer.seed))


def _checkpoint_dir(config: Config, run_dir: Path) -> str:
    directory = config.checkpoint.dir
    if directory is None:
        return str(run_dir / "checkpoints")
    return directory if "://" in directory else str(Path(directory).expanduser().resolve())


def _restore_or_init(
    config: Config, checkpointer: Checkpointer, dataset: InstanceDataset, mesh: Mesh, rules: ShardingRules,
    init_state: InitState, notes: list[str],
) -> tuple[TrainState, DataLoader, int]:
    """(state, loader, step): from the newest checkpoint that verifies, else fresh.

    Raises `StageError` for every refusal (other model, data, seed, batch, sequence length)
    before the caller writes anything into the run dir. A checkpoint that fails verification
    is set aside and the one before it used; `notes` gets one line per such step.
    """
    steps = checkpointer.all_steps()
    if steps and not config.checkpoint.resume:
        raise StageError(
            f"{checkpointer.directory} already holds checkpoints (latest step {steps[-1]}) and "
            "checkpoint.resume=false: set it to true to continue that run, or choose another checkpoint.dir / run dir"
        )
    state, loader_state, start_step = None, None, 0
    if steps:
        target = sharded_abstract_train_state(config.model, config.optim, mesh, rules)
        unusable = []
        for step in reversed(steps):
            try:
                restored = checkpointer.restore(step, target=target)
            except CheckpointMismatchError as e:
                raise StageError(f"cannot resume: {e}") from e
            except CheckpointCorruptError as e:
                unusable.append(f"{e}; moved to {checkpointer.set_aside(step, e.reason)}")
                continue
            state, loader_state, start_step = restored.state, LoaderState.from_dict(restored.loader_state), step
            break
        fallback = f"falling back to step {start_step}" if state is not None else "no usable checkpoint is left"
        notes.extend(f"{line}; {fallback}" for line in unusable)
        if state is None:
            raise StageError(
                f"{'; '.join(unusable)}. No checkpoint in {checkpointer.directory} verifies; rerunning will "
                "start from step 0 (the damaged steps are kept under set_aside/)"
            )
        notes.append(f"Resuming from {checkpointer.directory / str(start_step)} (step {start_step})")
    try:
        loader = DataLoader(
            dataset,
            config.data.global_batch_size,
            config.data.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            state=loader_state,
        )
    except DataFileError as e:  # e.g. another dataset, seed or batch size than the checkpoint's
        raise StageError(str(e)) from e
    if loader.step != start_step:
        raise StageError(f"checkpoint step {start_step} and its data position (step {loader.step}) disagree")
    if state is None:
        state = init_state(config, mesh, rules)
    return state, loader, start_step


@contextmanager
def _one_writer(run_dir: Path, main_process: bool):
    """Hold the run dir's lock (process 0 only) for the duration."""
    if not main_process:
        yield
        return
    try:
        lock = RunLock(run_dir).acquire()
    except RunLockedError as e:
        raise StageError(str(e)) from e
    try:
        yield
    finally:
        lock.release()


def train(config: Config, run_dir: Path, init_state: InitState = random_init) -> dict:
    """Train (or resume) per `config`, writing into `run_dir`; returns the summary.

    init_state: how to start when the checkpoint dir holds nothing to resume (a later stage
    passes one that loads earlier weights); a resume always wins over it.
    """
    maybe_initialize_distributed()
    started = time.perf_counter()
    run_dir = Path(run_dir).resolve()
    main_process = jax.process_index() == 0

    # Everything that can reject the config runs before any compilation or checkpoint I/O,
    # and nothing in the run dir is written until the config (and a resume) is accepted.
    try:
        dataset, heldout = build_datasets(config.data, config.model.vocab_size)
        mesh = make_mesh(config.mesh)
        schedule = make_schedule(config.schedule, config.optim.lr, config.trainer.steps)
    except (DataFileError, ValueError) as e:
        raise StageError(str(e)) from e
    rules = ShardingRules()
    if main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    with _one_writer(run_dir, main_process):
        checkpoint_dir = _checkpoint_dir(config, run_dir)
        if main_process:
            check_storage(checkpoint_dir, abstract_train_state(config.model, config.optim))
        checkpointer = Checkpointer(
            checkpoint_dir, keep_last=config.checkpoint.keep_last, keep_every=config.checkpoint.keep_every
        )
        try:
            notes: list[str] = []
            state, loader, start_step = _restore_or_init(config, checkpointer, dataset, mesh, rules, init_state, notes)
            if main_process:
                (run_dir / "config.json").write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
            log = MetricsLog(run_dir, main_process)
            try:
                for note in notes:
                    log.print(note)
                summary = _run(
                    config, run_dir, state=state, start_step=start_step, loader=loader, heldout=heldout, mesh=mesh,
                    rules=rules, schedule=schedule, checkpointer=checkpointer, log=log, started=started,
                )
            except DataFileError as e:  # token ids out of range, found as the batch is read
                raise StageError(f"{e}. Stopped before training on it; the checkpoints are intact") from e
            finally:
                log.close()
        except BaseException:
            with contextlib.suppress(Exception):  # the error in flight is the one to report
                checkpointer.close()
            raise
        checkpointer.close()  # waits for saves in flight
        return summary


class TrainingDiverged(StageError):
    """Loss, grad norm, held-out loss or the state went non-finite, or too many steps were skipped."""


def _run(config, run_dir, *, state, start_step, loader, heldout, mesh, rules, schedule, checkpointer, log, started) -> dict:
    """The loop proper, from `start_step` to `trainer.stop_at or trainer.steps`."""
    trainer, data = config.trainer, config.data
    sharding = batch_sharding(mesh, rules)
    documents = document_options(data)
    # The first `eval_batches` batches of every held-out set, on the devices once.
    eval_batches: dict[str, list[TokenBatch]] = {}
    for heldout_set in heldout if trainer.eval_every else []:
        batches = heldout_set.batches(data.global_batch_size, jax.process_index(), jax.process_count())
        eval_batches[heldout_set.name] = [
            global_batch_arrays(b, sharding, **documents) for b in islice(batches, trainer.eval_batches)
        ]
    train_step = make_train_step(config.optim, schedule, mesh=mesh, rules=rules, micro_batches=trainer.micro_batches)
    eval_step = make_eval_step(mesh, rules)

    tokens_per_step = data.global_batch_size * data.sequence_length
    model_flops = float(flops_per_token(config.model, data.sequence_length))
    peak = peak_flops_per_device()
    n_params = count_params(config.model)
    end_step = trainer.stop_at or trainer.steps
    log.print(
        f"{config.model.name}: {n_params:,} parameters | {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"mesh {dict(mesh.shape)} | batch {data.global_batch_size} x {data.sequence_length} = {tokens_per_step:,} tokens "
        f"| steps {start_step} -> {end_step} of {trainer.steps} | run dir {run_dir}"
    )
    device = jax.devices()[0]
    if peak is None:
        log.print(f"MFU not reported: no known peak FLOP/s for device kind {device.device_kind!r}")
    else:
        source = "measured float32 matmul peak of this CPU" if device.platform == "cpu" else device.device_kind
        log.print(f"MFU = model FLOPs/s per device / {peak / 1e12:.3g} TFLOP/s ({source})")

    config_dict = config_to_dict(config)
    last_saved = start_step if start_step else None
    guard = DivergenceGuard(
        history=int(jax.device_get(state.history_count)),
        min_history=config.optim.skip_step_min_history if config.optim.skip_step_std else None,
        max_consecutive_skips=trainer.max_consecutive_skips,
    )

    def diverged(step: int, reason: str):
        """Stop without saving: the summary says `diverged`, the last good checkpoint stays."""
        kept = f"the last checkpoint is {checkpointer.directory / str(last_saved)}" if last_saved else "no checkpoint was saved"
        message = f"training diverged: {reason}. Stopped at step {step} without saving ({kept}); {LIKELY_CAUSES}"
        log.print(message)
        write_summary(summary_of(step, diverged={"step": step, "reason": reason}))
        raise TrainingDiverged(message)

    def save(step: int) -> None:
        nonlocal last_saved
        if step != last_saved:
            if not bool(all_finite(state)):
                diverged(step, f"the weights or optimiser state hold non-finite values after step {step}")
            checkpointer.save(step, state, loader_state=loader.state, config=config_dict)
            last_saved = step

    throughput = Throughput(tokens_per_step)
    recent_losses: list[float] = []
    last_heldout: Optional[float] = None
    last_heldout_sets: dict[str, float] = {}
    # Training loss falling while held-out loss doesn't: is data repeating?
    gap_alarm = GapAlarm(config.trainer.gap_alarm)

    def record(step: int, metrics: dict, boundary: bool) -> None:
        """Host side of step `step`: fetch and write its metrics; print at log steps."""
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        recent_losses.append(values["loss"])
        del recent_losses[: -trainer.log_every]
        gap_alarm.train_loss(values["loss"])
        entry = {"step": step, **values}
        if boundary:
            first = throughput.step is None
            rate = throughput.boundary(step)
            utilisation = mfu(model_flops, rate, jax.device_count(), peak) if rate else None
            if rate:
                entry.update(tokens_per_s=rate, mfu=utilisation)
            if first or step % trainer.log_every == 0 or step == end_step:
                if rate is None:
                    speed = f"first step (with compilation) {time.perf_counter() - loop_started:.1f}s"
                else:
                    speed = f"{rate:,.0f} tok/s" + (f" | MFU {100 * utilisation:.1f}%" if utilisation else "")
                log.print(
                    f"step {step:>6}/{trainer.steps} | loss {values['loss']:.4f} | lr {values['lr']:.2e} "
                    f"| grad norm {values['grad_norm']:.3f} | {speed}" + (" | SKIPPED" if values["skipped"] else "")
                )
        log.write(entry)
        if reason := guard.observe(step, values["loss"], values["grad_norm"], bool(values["skipped"])):
            diverged(step, reason)

    def run_eval(step: int) -> None:
        """Held-out loss per set; `heldout_loss` is their token-weighted mean."""
        nonlocal last_heldout, last_heldout_sets
        results = evaluate(eval_step, state.model, eval_batches)
        tokens = sum(count for _, count in results.values())
        last_heldout = sum(loss * count for loss, count in results.values()) / max(tokens, 1.0)
        last_heldout_sets = {name: loss for name, (loss, _) in results.items()}
        log.write({"step": step, "heldout_loss": last_heldout, "heldout_tokens": tokens, "heldout": last_heldout_sets})
        for name, (loss, count) in results.items():
            log.print(f"step {step:>6}/{trainer.steps} | held-out loss {loss:.4f} ({name}, {count:,.0f} tokens)")
        if not math.isfinite(last_heldout):
            diverged(step, f"held-out loss is {last_heldout} at step {step}")
        if (alarm := gap_alarm.heldout(step, last_heldout)) is not None and log.enabled:
            log.write(alarm)
            warn_gap(alarm)
        throughput.pause()

    def summary_of(end_step: int, interrupted: Optional[str] = None, diverged: Optional[dict] = None) -> dict:
        tps = throughput.mean
        summary = {
            "stage_completed": end_step == trainer.steps and diverged is None,
            "interrupted": interrupted,
            "model": config.model.name,
            "parameters": n_params,
            "start_step": start_step,
            "end_step": end_step,
            "steps": trainer.steps,
            "final_train_loss": float(np.mean(recent_losses)) if recent_losses else None,
            "last_step_loss": recent_losses[-1] if recent_losses else None,
            "final_heldout_loss": last_heldout,
            "final_heldout_losses": last_heldout_sets,
            "tokens_per_s": tps,
            "mfu": mfu(model_flops, tps, jax.device_count(), peak) if tps else None,
            "wall_time_s": time.perf_counter() - started,
            "devices": jax.device_count(),
            "checkpoint": str(checkpointer.directory / str(end_step)) if diverged is None else None,
            "run_dir": str(run_dir),
        }
        if diverged is not None:
            summary["diverged"] = diverged
        return summary

    def write_summary(summary: dict) -> None:
        if log.enabled:
            (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")

    interrupted = None
    pending: Optional[tuple[int, dict]] = None
    loop_started = time.perf_counter()
    to_global = lambda b: global_batch_arrays(b, sharding, **documents)  # noqa: E731  (runs in the prefetch thread)
    with stop_on_signals() as stop, Prefetcher(loader, depth=2, transform=to_global) as batches:
        for step in range(start_step + 1, end_step + 1):
            state, metrics = train_step(state, next(batches))
            checkpointer.check_for_errors()  # a failed save stops the run now, not at the end
            if pending is not None:  # the previous step's metrics, one step late
                record(*pending, boundary=False)
                pending = None
            evaluate_now = bool(eval_batches) and (step % trainer.eval_every == 0 or step == end_step)
            save_now = bool(config.checkpoint.every) and step % config.checkpoint.every == 0
            # A step is checked by the divergence guard before it is saved or evaluated.
            if step == start_step + 1 or step % trainer.log_every == 0 or evaluate_now or save_now or step == end_step:
                record(step, metrics, boundary=True)
            else:
                pending = (step, metrics)
            if evaluate_now:
                run_eval(step)
            if save_now:
                save(step)
            # Every process must stop at the same step: agree (a collective) at log steps.
            if (jax.process_count() == 1 or step % trainer.log_every == 0) and step < end_step:
                if _all_agree(bool(stop)):
                    interrupted, end_step = stop.signal or "signal on another process", step
                    break
        if pending is not None:
            record(*pending, boundary=False)
    if start_step >= end_step:
        log.print(f"Nothing to train: the checkpoint is at step {start_step}, the run ends at {end_step}")
        if eval_batches:
            run_eval(start_step)
    save(end_step)
    checkpointer.wait_until_finished()

    completed = end_step == trainer.steps
    summary = summary_of(end_step, interrupted=interrupted)
    if log.enabled:
        write_summary(summary)
        status = "done" if completed else f"stopped at step {end_step} ({interrupted or 'trainer.stop_at'}); rerun to resume"
        log.print(f"\n{status} in {summary['wall_time_s']:.1f}s | summary: {run_dir / SUMMARY_FILE}\n{json.dumps(summary, indent=2)}")
    return summary
