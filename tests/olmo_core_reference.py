"""OLMo-core's own training code as the reference (tests and scripts only; the package never
imports torch or olmo_core).

AI2's `ai2-olmo-core` (pinned in the test extras) supplies the scheduler, the skip-step AdamW,
the OLMo 3 transformer, the train module and the trainer; this file only translates our
settings into OLMo-core's same-named ones and feeds both sides the same weights and batches.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import equinox as eqx
import jax
import numpy as np
import safetensors.torch
import torch
import transformers
from olmo_core.data.data_loader import DataLoaderBase
from olmo_core.nn.attention import SlidingWindowAttentionConfig
from olmo_core.nn.attention.backend import AttentionBackendName
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.hf.config import get_hf_config
from olmo_core.nn.hf.convert import convert_state_from_hf, convert_state_to_hf
from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig
from olmo_core.optim import AdamWConfig, OptimGroupOverride, SkipStepAdamWConfig
from olmo_core.optim.scheduler import (
    WSD,
    ConstantScheduler,
    ConstantWithWarmup,
    CosWithWarmup,
    LinearWithWarmup,
    Scheduler,
)

from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.common import TRAIN_CE_LOSS_METRIC
from olmo_core.train.train_module import TransformerTrainModule

from olmo_eqx import OLMo, get_model_config, save_hf
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.train.optim import OptimConfig, make_optimizer
from olmo_eqx.train.schedules import ScheduleConfig, final_lr_ratio
from olmo_eqx.train.state import new_train_state
from trajectory_harness import Comparison, Side, Stage, stage_batches, train_ours


def olmo_core_scheduler(config: ScheduleConfig, peak_lr: float) -> Scheduler:
    """OLMo-core's scheduler for the same-named settings of `config`."""
    ratio = final_lr_ratio(config)
    warmup = config.warmup_steps
    if config.name == "cosine":
        return CosWithWarmup(warmup=warmup, alpha_f=ratio)
    if config.name == "linear":
        return LinearWithWarmup(warmup=warmup, alpha_f=ratio)
    if config.name == "constant":
        return ConstantWithWarmup(warmup=warmup) if warmup else ConstantScheduler()
    return WSD(warmup=warmup, decay_fraction=config.decay_fraction, decay_min_lr=ratio * peak_lr)


# --- training: OLMo-core's Trainer, train module and optimizer on our weights and batches -----


def olmo_core_transformer_config(config: ModelConfig) -> TransformerConfig:
    """OLMo-core's OLMo 3 transformer (`TransformerConfig.olmo3_7B`'s choices) at `config`'s sizes."""
    pattern = [config.sliding_window] * (config.full_attention_every - 1) + [-1]
    return TransformerConfig.llama_like(
        d_model=config.d_model, vocab_size=config.padded_vocab_size, n_layers=config.n_layers,
        n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
        qk_norm=True, layer_norm_eps=config.rms_norm_eps, rope_theta=int(config.rope_theta),
        block_name=TransformerBlockType.reordered_norm,
        sliding_window=SlidingWindowAttentionConfig(pattern=pattern, force_full_attention_on_first_layer=False,
                                                    force_full_attention_on_last_layer=True),
        attn_backend=AttentionBackendName.torch,
        feed_forward=FeedForwardConfig(hidden_size=config.mlp_hidden, bias=False),
    )


class FixedBatches(DataLoaderBase):
    """OLMo-core data-loader interface over a list of (input_ids [B, L], loss_mask [B, L]) batches."""

    def __init__(self, batches, work_dir):
        ids = np.asarray(batches[0][0])
        super().__init__(work_dir=work_dir, global_batch_size=ids.size)
        self.batches = batches

    @property
    def total_batches(self) -> int:
        return len(self.batches)

    def state_dict(self):
        return {"batches_processed": self.batches_processed}

    def load_state_dict(self, state_dict):
        self.batches_processed = state_dict["batches_processed"]

    def reshuffle(self, epoch=None, **kwargs):
        self._epoch = epoch if epoch is not None else (self._epoch or 0) + 1

    def _iter_batches(self):
        for ids, mask in self.batches[self.batches_processed:]:
            # label_mask[b, t]: token t may be a target, our loss_mask's meaning.
            yield {"input_ids": torch.as_tensor(np.asarray(ids, np.int64)),
                   "label_mask": torch.as_tensor(np.asarray(mask) > 0)}

    def get_mock_batch(self):
        return next(iter(self._iter_batches()))

    def global_num_tokens_in_batch(self, batch):
        return batch["input_ids"].numel()


class RecordSteps(Callback):
    """Per-step metrics as OLMo-core's train module records them, and the exact grad norm.

    OLMo-core's "total grad norm" is torch's float32 `get_total_norm`, whose accumulation
    rounds: on CPU it reads 3.6e-6 (relative) below the float64 norm of the very gradients it
    was computed from. `exact_grad_norms` is that float64 norm, taken just before the clip.
    """

    def __init__(self):
        self.losses, self.grad_norms, self.lrs, self.skipped = [], [], [], []
        self.exact_grad_norms = []

    def pre_optim_step(self):
        grads = [p.grad for p in self.trainer.train_module.model.parameters() if p.grad is not None]
        self.exact_grad_norms.append(float(torch.sqrt(sum(g.double().square().sum() for g in grads))))

    def post_train_batch(self):
        get = lambda name: float(self.trainer.get_metric(name))  # noqa: E731
        self.losses.append(get(TRAIN_CE_LOSS_METRIC))
        self.grad_norms.append(get("optim/total grad norm"))
        self.lrs.append(get("optim/LR (group 0)"))
        # Plain AdamW (no skip-step) records no such metric.
        skipped = self.trainer.get_metric("optim/step skipped")
        self.skipped.append(0.0 if skipped is None else float(skipped))


@dataclass(frozen=True)
class OlmoCoreRecipe:
    """OLMo-core's OLMo 3 recipe (its official scripts' choices) with our same-named settings."""

    optim: OptimConfig
    schedule: ScheduleConfig
    steps: int
    decay_embedding: bool = False  # True: drop the embedding's no-decay group override
    z_loss: bool = True
    autocast_bf16: bool = False


def train_olmo_core(hf_dir: Path, model_config: ModelConfig, recipe: OlmoCoreRecipe, batches, work_dir: Path):
    """Train our HF export in `hf_dir` with OLMo-core's Trainer; returns (RecordSteps, HF-named weights)."""
    torch.manual_seed(0)
    optim = recipe.optim
    overrides = None if recipe.decay_embedding else [
        OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))]
    skip = bool(optim.skip_step_std)
    optim_config = (SkipStepAdamWConfig if skip else AdamWConfig)(
        lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps, weight_decay=optim.weight_decay,
        group_overrides=overrides,
        **(dict(rolling_interval_length=optim.skip_step_window, sigma_factor=int(optim.skip_step_std),
                foreach=True) if skip else {}),
    )
    model = olmo_core_transformer_config(model_config).build(init_device="cpu")
    seq = np.asarray(batches[0][0]).shape[1]
    train_module = TransformerTrainModule(
        model=model, optim=optim_config, rank_microbatch_size=np.asarray(batches[0][0]).size, max_sequence_length=seq,
        z_loss_multiplier=optim.z_loss_weight if recipe.z_loss else None, max_grad_norm=optim.clip_grad_norm,
        scheduler=olmo_core_scheduler(recipe.schedule, optim.lr), device=torch.device("cpu"),
        autocast_precision=torch.bfloat16 if recipe.autocast_bf16 else None,
    )
    # After the train module (it initialises the weights), overwritten in place by OLMo-core's
    # own HF -> OLMo-core conversion of our export.
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    hf_state = safetensors.torch.load_file(str(Path(hf_dir) / "model.safetensors"))
    train_module.model.load_state_dict(convert_state_from_hf(hf_config, hf_state, model_type=hf_config.model_type))

    record = RecordSteps()
    trainer = TrainerConfig(
        save_folder=str(work_dir / "olmo_core_run"), max_duration=Duration.steps(recipe.steps),
        metrics_collect_interval=recipe.steps, no_checkpoints=True, save_overwrite=True,
        callbacks={"record": record},
    ).build(train_module, FixedBatches(batches, work_dir / "olmo_core_data"))
    trainer.fit()
    weights = convert_state_to_hf(get_hf_config(train_module.model), train_module.model.state_dict())
    return record, {name: w.detach().float().numpy().copy() for name, w in weights.items()}


# --- both sides from the same weights on the same batches --------------------------------------

# A small OLMo 3 (GQA, 3 sliding : 1 full attention layers, a window shorter than the
# sequences it is trained on) that both sides train in seconds.
SMALL_OLMO3 = ModelConfig(
    name="olmo3_small_test", vocab_size=4096, padded_vocab_size=4096, d_model=64, n_layers=4, n_heads=4,
    n_kv_heads=2, head_dim=16, mlp_hidden=192, sliding_window=16, full_attention_every=4,
)
SPIKE_TOKEN = 7  # a planted spike: a batch of one token repeated, which no trained model expects


def spiked_batches(steps: int, spike_at: Optional[int], seq: int, batch: int, data_seed: int = 34521):
    """`steps` batches of the embedded corpus; batch `spike_at` (0-based) is one repeated token."""
    batches = stage_batches(Stage("olmo_core", steps, 0.0, "cosine", 0, data_seed), seq, batch)
    if spike_at is not None:
        ids, mask = batches[spike_at]
        batches[spike_at] = (np.full_like(ids, SPIKE_TOKEN), mask)
    return batches


def run_against_olmo_core(
    workdir: Path,
    optim: OptimConfig,
    schedule: ScheduleConfig,
    *,
    model: Union[str, ModelConfig] = "olmo3_tiny_gqa",
    steps: int = 24,
    spike_at: Optional[int] = 16,
    seq: int = 128,
    batch: int = 8,
    compute_dtype: str = "float32",
    olmo_core_changes: Optional[dict] = None,
    ours: Optional[Side] = None,
    noise_floor: bool = False,
) -> Comparison:
    """Train one random init of `model` (a zoo name or a config) by olmo_eqx and by OLMo-core.

    Both sides' results are under the key "run".

    `olmo_core_changes` alters OLMo-core's recipe only (OlmoCoreRecipe fields), to show that
    the comparison sees it; `ours` reuses an earlier run of our side.

    `noise_floor` also trains each side again from the initial weights moved by one float32
    ulp (`nudged`): "noise" holds OLMo-core against itself, "noise_ours" olmo_eqx against
    itself. That is how far float32 rounding alone carries two runs apart on these batches,
    the yardstick for "run".
    """
    workdir = Path(workdir)
    if isinstance(model, str):
        model = SMALL_OLMO3 if model == SMALL_OLMO3.name else get_model_config(model)
    config = model.replace(compute_dtype=compute_dtype)
    model = OLMo(config, key=jax.random.key(0))
    batches = spiked_batches(steps, spike_at, seq, batch)
    recipe = dataclasses.replace(OlmoCoreRecipe(optim, schedule, steps, autocast_bf16=compute_dtype == "bfloat16"),
                                 **(olmo_core_changes or {}))

    def olmo_core_side(model: OLMo, name: str) -> Side:
        save_hf(model, workdir / name)
        record, weights = train_olmo_core(workdir / name, config, recipe, batches, workdir / f"{name}_run")
        # Gradients are compared, not the reporting arithmetic: the float64 norm of OLMo-core's
        # own gradients (its float32 figure stays in `recorded_grad_norms`).
        return Side(record.losses, record.exact_grad_norms, record.lrs, skipped=record.skipped, weights=weights,
                    recorded_grad_norms=record.grad_norms)

    def our_side(model: OLMo) -> Side:
        state = new_train_state(model, make_optimizer(optim), optim.skip_step_window)
        return train_ours(state, schedule, optim.lr, optim, batches)[1]

    reference = olmo_core_side(model, "init")
    if not noise_floor:
        return Comparison({"run": ours or our_side(model)}, {"run": reference})
    model_nudged = nudged(model)  # before our run: the train step donates (deletes) its arrays
    reference_nudged = olmo_core_side(model_nudged, "init_nudged")
    ours = ours or our_side(model)
    return Comparison({"run": ours, "noise": reference_nudged, "noise_ours": our_side(model_nudged)},
                      {"run": reference, "noise": reference, "noise_ours": ours})


def nudged(model: OLMo, seed: int = 1) -> OLMo:
    """`model` with every float weight moved one ulp up or down at random: a rounding error."""
    rng = np.random.default_rng(seed)

    def nudge(x):
        x = np.asarray(x)
        return jax.numpy.asarray(np.nextafter(x, np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(x.dtype)))

    return jax.tree.map(lambda x: nudge(x) if eqx.is_inexact_array(x) else x, model)
