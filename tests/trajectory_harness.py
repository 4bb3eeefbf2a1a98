"""Run olmo_eqx's training and the PyTorch reference side by side on the same batches.

Stage 1 (warmup + cosine) starts from one random initialisation exported with `save_hf`;
stage 2 (anneal: no warmup, linear decay to 0) continues from each side's own stage-1 weights
and AdamW state, so any drift in stage 1 carries into stage 2 as it would in a real run.
Used by tests/test_trajectory_parity.py and scripts/trajectory_parity.py.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from olmo_eqx import OLMo, get_model_config, save_hf
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.data.loader import DataLoader
from olmo_eqx.interop.hf import hf_state_dict
from olmo_eqx.train.optim import OptimConfig, make_optimizer
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
from olmo_eqx.train.state import TrainState, new_train_state
from olmo_eqx.train.step import make_train_step
from torch_reference import TorchRecipe, train_torch


@dataclass(frozen=True)
class Stage:
    name: str
    steps: int
    peak_lr: float
    schedule: str  # "cosine" or "linear"
    warmup_steps: int
    data_seed: int


STAGE1 = Stage("pretrain", steps=30, peak_lr=1e-3, schedule="cosine", warmup_steps=5, data_seed=34521)
STAGE2 = Stage("anneal", steps=10, peak_lr=6e-4, schedule="linear", warmup_steps=0, data_seed=1337)


@dataclass
class Side:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    skipped: list[float] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # HF names, at the end of the stage
    recorded_grad_norms: list[float] = field(default_factory=list)  # a reference's own float32 figure


@dataclass
class Comparison:
    ours: dict[str, Side]
    torch: dict[str, Side]

    def max_relative(self, stage: str, metric: str) -> float:
        a = np.asarray(getattr(self.ours[stage], metric))
        b = np.asarray(getattr(self.torch[stage], metric))
        return float(np.max(np.abs(a - b) / np.abs(b)))

    def weight_differences(self, stage: str) -> dict[str, float]:
        """Per tensor ||w_ours - w_torch|| / ||w_torch|| at the end of `stage`."""
        ours = self.ours[stage].weights
        return {
            name: float(np.linalg.norm(ours[name] - w) / np.linalg.norm(w))
            for name, w in self.torch[stage].weights.items()
        }


def stage_batches(stage: Stage, seq: int, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    corpus = embedded_corpus()
    loader = DataLoader(corpus.train_dataset(seq), global_batch_size=batch, seed=stage.data_seed)
    return [(b.input_ids, b.loss_mask.astype(np.float32)) for b in (loader.next_batch() for _ in range(stage.steps))]


def _recipe(stage: Stage, optim: OptimConfig, decay_embedding: bool) -> TorchRecipe:
    return TorchRecipe(peak_lr=stage.peak_lr, schedule=stage.schedule, total_steps=stage.steps,
                       warmup_steps=stage.warmup_steps, final_ratio=0.1, betas=(optim.b1, optim.b2),
                       eps=optim.eps, weight_decay=optim.weight_decay, decay_embedding=decay_embedding,
                       clip_grad_norm=optim.clip_grad_norm, z_loss_weight=optim.z_loss_weight)


def train_ours(state: TrainState, schedule: ScheduleConfig, peak_lr: float, optim: OptimConfig, batches
               ) -> tuple[TrainState, Side]:
    """One stage of olmo_eqx's train step over `batches`; the schedule spans them."""
    # The schedule counts from the stage's first step, as the reference's does.
    state = state.replace(step=jnp.zeros((), jnp.int32))
    train_step = make_train_step(optim, make_schedule(schedule, peak_lr, len(batches)))
    side = Side()
    for input_ids, loss_mask in batches:
        state, metrics = train_step(state, {"input_ids": jnp.asarray(input_ids), "loss_mask": jnp.asarray(loss_mask)})
        for name, values in (("loss", side.losses), ("grad_norm", side.grad_norms), ("lr", side.lrs),
                             ("skipped", side.skipped)):
            values.append(float(metrics[name]))
    side.weights = {name: np.asarray(w) for name, w in hf_state_dict(state.model).items()}
    return state, side


def run_both(
    workdir: Path,
    model_name: str = "olmo3_tiny",
    seq: int = 128,
    batch: int = 8,
    stages: tuple[Stage, ...] = (STAGE1, STAGE2),
    torch_decays_embedding: bool = False,
    seed: int = 0,
    our_result: Optional[dict[str, Side]] = None,
) -> Comparison:
    """Train both sides through `stages`; `our_result` reuses an earlier run of our side."""
    # Skip-step is off on both sides: the reference has none, and it must not fire on one only.
    optim = OptimConfig(skip_step_std=None)
    model = OLMo(get_model_config(model_name), key=jax.random.key(seed))
    batches = {stage.name: stage_batches(stage, seq, batch) for stage in stages}

    model_dir = Path(workdir) / "init"
    save_hf(model, model_dir)
    results = train_torch(
        model_dir, [(_recipe(stage, optim, torch_decays_embedding), batches[stage.name]) for stage in stages]
    )
    torch_sides = {stage.name: Side(r.losses, r.grad_norms, r.lrs, weights=r.state_dict)
                   for stage, r in zip(stages, results)}

    if our_result is None:
        our_sides = {}
        state = new_train_state(model, make_optimizer(optim), optim.skip_step_window)
        for stage in stages:
            schedule = ScheduleConfig(name=stage.schedule, warmup_steps=stage.warmup_steps)
            state, our_sides[stage.name] = train_ours(state, schedule, stage.peak_lr, optim, batches[stage.name])
    else:
        our_sides = our_result
    return Comparison(our_sides, torch_sides)
