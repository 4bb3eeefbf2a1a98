"""A PyTorch reference training loop for the OLMo 3 recipe (tests and scripts only).

It trains HF transformers' `Olmo3ForCausalLM` / `Olmo2ForCausalLM` the way OLMo-core does,
written independently of olmo_eqx's training code so that agreement means something:
cross-entropy + z-loss over target tokens divided by their count, `torch.nn.utils.clip_grad_norm_`,
`torch.optim.AdamW` with the embedding in a no-decay group, and the learning-rate schedule
computed here from its definition. The package never imports this file.
"""

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import transformers


@dataclass(frozen=True)
class TorchRecipe:
    peak_lr: float
    schedule: str  # "cosine" (warmup then cosine to final_ratio * peak) or "linear" (to 0)
    total_steps: int
    warmup_steps: int = 0
    final_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_embedding: bool = False
    clip_grad_norm: float = 1.0
    z_loss_weight: float = 1e-5

    def lr(self, update: int) -> float:
        """OLMo-core's schedules (CosWithWarmup / LinearWithWarmup) at update number `update`
        (1 .. total_steps): its trainer counts steps from 1 and schedules by that count."""
        if update < self.warmup_steps:
            return self.peak_lr * update / self.warmup_steps
        final = self.peak_lr * (self.final_ratio if self.schedule == "cosine" else 0.0)
        progress = min(1.0, (update - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1.0 - progress
        return final + (self.peak_lr - final) * shape


@dataclass
class TorchTrajectory:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    state_dict: Optional[dict[str, np.ndarray]] = None


def recipe_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, z_weight: float):
    """(objective, mean cross-entropy) over target tokens; position t predicts token t + 1."""
    logits = logits[:, :-1].float()
    labels = input_ids[:, 1:]
    weights = loss_mask[:, 1:].float()
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - torch.gather(logits, -1, labels[..., None])[..., 0]
    count = weights.sum().clamp(min=1.0)
    ce_sum = (ce * weights).sum()
    objective = (ce_sum + z_weight * (lse * lse * weights).sum()) / count
    return objective, ce_sum / count


def train_torch(
    model_dir,
    stages: Sequence[tuple[TorchRecipe, Sequence[tuple[np.ndarray, np.ndarray]]]],
) -> list[TorchTrajectory]:
    """Train the HF checkpoint in `model_dir` through `stages` of (recipe, batches).

    The AdamW state carries from one stage to the next (as when stage 2 resumes a stage-1
    checkpoint with its optimiser state); each trajectory's `state_dict` is the weights at
    the end of its stage.
    """
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    embedding = model.get_input_embeddings().weight
    others = [p for p in model.parameters() if p is not embedding]
    first = stages[0][0]
    groups = [{"params": others, "weight_decay": first.weight_decay},
              {"params": [embedding], "weight_decay": first.weight_decay if first.decay_embedding else 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=first.peak_lr, betas=first.betas, eps=first.eps)
    trajectories = []
    for recipe, batches in stages:
        trajectories.append(_train_stage(model, optimizer, recipe, batches))
        trajectories[-1].state_dict = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()}
    return trajectories


def _train_stage(model, optimizer, recipe: TorchRecipe, batches) -> TorchTrajectory:
    out = TorchTrajectory()
    for step, (input_ids, loss_mask) in enumerate(batches):
        lr = recipe.lr(step + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))
        objective, ce = recipe_loss(model(ids).logits, ids, torch.as_tensor(np.asarray(loss_mask)), recipe.z_loss_weight)
        objective.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad_norm)
        optimizer.step()
        out.losses.append(ce.item())
        out.grad_norms.append(grad_norm.item())
        out.lrs.append(lr)
    return out
