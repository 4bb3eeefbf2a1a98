"""Cross-entropy + z-loss in float32, returned as *sums* so any reduction stays exact.

Targets: `labels[:, t] = input_ids[:, t + 1]`, so position t predicts token t + 1 and the
last position predicts nothing. `loss_mask[b, t]` says whether token t counts as a target
(OLMo-core's label mask convention); `loss_mask[:, 0]` is therefore never used.

The recipe's reduction is sum over the non-ignored tokens of the *global* batch divided by
their global count. With gradient accumulation each micro-batch contributes
`sums / global_count`, and the micro-batch gradients add up to exactly the full-batch one.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class LossSums(NamedTuple):
    """Sums over target tokens: cross-entropy, logsumexp^2 (unweighted z-loss), token count."""

    ce: Float[Array, ""]
    z: Float[Array, ""]
    count: Float[Array, ""]


def target_mask(loss_mask: Float[Array, "batch seq"]) -> Float[Array, "batch seq_minus_1"]:
    """Weights of the predictions at positions 0 .. seq-2 (the mask of their target tokens)."""
    return loss_mask[:, 1:].astype(jnp.float32)


def target_count(loss_mask: Float[Array, "batch seq"]) -> Float[Array, ""]:
    """Number of target tokens in a batch: the denominator of the loss."""
    return jnp.sum(target_mask(loss_mask))


def loss_sums(
    logits: Float[Array, "batch seq vocab"],
    input_ids: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
) -> LossSums:
    """Sums of cross-entropy and logsumexp^2 over target tokens, in float32."""
    # Shift the labels rather than slice the logits: the logits are the biggest activation
    # of the step ([B, L, vocab]) and must not be copied; the last position gets weight 0.
    labels = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))
    weights = jnp.pad(target_mask(loss_mask), ((0, 0), (0, 1)))
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    # where, not a product: an ignored position's inf/nan must not leak into the sums.
    counted = weights > 0
    ce = jnp.where(counted, (lse - label_logit) * weights, 0.0)
    z = jnp.where(counted, lse * lse * weights, 0.0)
    return LossSums(ce=jnp.sum(ce), z=jnp.sum(z), count=jnp.sum(weights))


def objective(sums: LossSums, z_loss_weight: float, normaliser: Float[Array, ""]) -> Float[Array, ""]:
    """What gets differentiated: (ce + z_loss_weight * z) / normaliser (the global count)."""
    return (sums.ce + z_loss_weight * sums.z) / jnp.maximum(normaliser, 1.0)
