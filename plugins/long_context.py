"""Stage 3, long context: `python -m olmo_eqx +stage=long_context checkpoint.load=PATH`.

OLMo 3's long-context extension (docs/olmo3.md section 3): from the stage-2 checkpoint *with*
its optimiser state, YaRN (factor 8, beta_fast 32, beta_slow 1) on the full-attention layers
only (the sliding layers keep plain RoPE), a longer sequence, intra-document masking, LR
2.07e-4 with 200 warmup steps then linear to exactly 0. `conf/stage/long_context.yaml` sets
those as defaults of the ordinary keys (`optim.lr`, `schedule.*`, `data.*`); on the embedded
default the sequence is 4x stage 2's (1024 tokens).

    checkpoint.load          a stage-2 run of ours (any of its dirs) or a HF model dir
    stage.optimizer          keep | reset | auto (keep when the checkpoint has Adam state)
    stage.yarn_factor        8.0; stage.yarn_beta_fast 32.0, stage.yarn_beta_slow 1.0
    stage.original_context   YaRN's original context; default: the source run's sequence length

YaRN and `max_sequence_length` may differ from the checkpoint because no weight changes shape
(`olmo_eqx.checkpoint.CONTINUABLE_FIELDS`). Before training, the starting model's held-out
loss at the long length is measured, so the summary shows it before and after the stage.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from olmo_eqx.config import Config
from olmo_eqx.warm_start import Optimizer


@dataclass(frozen=True)
class LongContextSettings:
    """`stage.*` of the long-context stage."""

    optimizer: Optimizer = "auto"
    yarn_factor: float = 8.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    original_context: Optional[int] = None


class LongContext:
    """Stage 3: long context from a stage-2 checkpoint: YaRN on full layers, document masking."""

    description = (
        "Stage 3: long context from a stage-2 checkpoint (checkpoint.load=...): YaRN on the full-attention "
        "layers, longer sequences, intra-document masking (resumes by itself)"
    )
    config_class = LongContextSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        from olmo_eqx.config import stage_settings
        from olmo_eqx.models.config import YarnConfig
        from olmo_eqx.train.loop import train
        from olmo_eqx.warm_start import note_model, resume_config, source, with_runtime_fields

        settings = stage_settings(self, "long_context", config.stage or {})
        run_dir = Path(run_dir).resolve()
        config = dataclasses.replace(config, stage=settings)
        if (resumed := resume_config(config, run_dir)) is not None:  # its own checkpoint holds the stage-3 model
            return train(resumed, run_dir)
        start = source("long_context", config, settings.optimizer)
        original = settings.original_context or _source_sequence_length(start) or start.model_config.max_sequence_length
        yarn = YarnConfig(
            factor=settings.yarn_factor, original_max_position_embeddings=original,
            beta_fast=settings.yarn_beta_fast, beta_slow=settings.yarn_beta_slow,
        )
        model = dataclasses.replace(
            with_runtime_fields(start.model_config, config),
            yarn=yarn,
            max_sequence_length=max(config.data.sequence_length, start.model_config.max_sequence_length),
        )
        note_model("long_context", model, config.model)
        config = dataclasses.replace(config, model=model)
        before: dict = {}

        def init_state(config, mesh, rules):
            state = start.init_state(config, mesh, rules)
            before.update(_heldout_loss(config, state.model, mesh, rules))
            return state

        summary = train(config, run_dir, init_state=init_state)
        if before and summary is not None:
            summary = _add_loss_before(config, run_dir, summary, before)
        return summary


def _source_sequence_length(start) -> Optional[int]:
    """The sequence length the source checkpoint trained at (its stored run config; None for HF)."""
    from olmo_eqx.warm_start import stored_run_config

    return ((stored_run_config(start.location) or {}).get("data") or {}).get("sequence_length")


def _add_loss_before(config: Config, run_dir: Path, summary: dict, before: dict) -> dict:
    """The summary with the held-out loss before the stage, said beside the one after (in
    train.log too) and written back to summary.json."""
    import jax

    from olmo_eqx.run.run_dir import RunDir
    from olmo_eqx.train.loop import LOG_FILE

    summary = {**summary, "heldout_loss_before": before["loss"]}
    after = summary.get("final_heldout_loss") or float("nan")
    # The same figure as a held-out record at the stage's first step, so metrics.jsonl (and
    # TensorBoard) hold it and loss.png draws it as each set's first point. Not sent to W&B:
    # the loop's W&B run is closed, and another would be a second run.
    loggers = tuple(name for name in config.trainer.loggers if name != "wandb")
    with RunDir(run_dir, enabled=jax.process_index() == 0, log_name=LOG_FILE, loggers=loggers) as out:
        out.metrics({"step": summary["start_step"], "heldout_loss": before["loss"], "heldout_tokens": before["tokens"],
                     "heldout": before["sets"], "before_stage": True})
        out.print(f"\nheld-out loss at sequence length {config.data.sequence_length} ({before['tokens']:,.0f} tokens): "
                  f"before {before['loss']:.4f} | after {after:.4f}")
        out.write_summary(summary)
    if config.trainer.plot and "jsonl" in loggers and jax.process_index() == 0:
        from olmo_eqx.run.plots import loss_plot, read_metrics
        from olmo_eqx.train.loop import METRICS_FILE, PLOT_FILE

        records = read_metrics(run_dir / METRICS_FILE)
        steps = [r["step"] for r in records]
        title = f"{config.model.name} | {Path(run_dir).name} | steps {min(steps)}-{max(steps)} of {config.trainer.steps}"
        loss_plot(records, Path(run_dir) / PLOT_FILE, title=title)
    return summary


def _heldout_loss(config: Config, model, mesh, rules) -> dict:
    """Held-out loss of `model` on the run's held-out batches (what the loop evaluates later)."""
    from itertools import islice

    import jax

    from olmo_eqx.data.loader import global_batch_arrays
    from olmo_eqx.sharding import batch_sharding
    from olmo_eqx.train.loop import build_datasets, document_options, evaluate
    from olmo_eqx.train.step import make_eval_step

    _, heldout = build_datasets(config.data, config.model.vocab_size)
    sharding, documents = batch_sharding(mesh, rules), document_options(config.data)
    sets = {}
    for heldout_set in heldout:
        batches = heldout_set.batches(config.data.global_batch_size, jax.process_index(), jax.process_count())
        sets[heldout_set.name] = [global_batch_arrays(b, sharding, **documents) for b in islice(batches, config.trainer.eval_batches)]
    results = evaluate(make_eval_step(mesh, rules), model, sets)
    tokens = sum(count for _, count in results.values())
    return {"loss": sum(loss * count for loss, count in results.values()) / max(tokens, 1.0), "tokens": tokens,
            "sets": {name: loss for name, (loss, _) in results.items()}}
