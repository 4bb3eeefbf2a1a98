"""Cross-entropy + z-loss in float32, returned as *sums* so any reduction stays exact.

Targets: `labels[:, t] = input_ids[:, t + 1]`, so position t predicts token t + 1 and the
last position predicts nothing. `loss_mask[b, t]` says whether token t counts as a target
(OLMo-core's label mask convention); `loss_mask[:, 0]` is therefore never used.

The recipe's reduction is sum over the non-ignored tokens of the *global* batch divided by
their global count. With gradient accumulation each micro-batch contributes
`sums / global_count`, and the micro-batch gradients add up to exactly the full-batch one.
"""

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..models.base import Constrain, unconstrained
from ..models.olmo3 import dense


# Whether `fused_head_loss` unrolls its loop over chunks when traced. Training never does
# (the loop holds one chunk's logits at a time); the planner's counts-only programs do,
# because XLA's cost analysis counts a loop body once (`olmo_eqx.plan.estimate`).
_UNROLL_CHUNKS = contextvars.ContextVar("unroll_loss_chunks", default=False)


@contextlib.contextmanager
def unrolled_loss_chunks():
    """Within: training losses traced here run their chunks unrolled (same values, no loop)."""
    token = _UNROLL_CHUNKS.set(True)
    try:
        yield
    finally:
        _UNROLL_CHUNKS.reset(token)


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


def _shifted_targets(
    input_ids: Int[Array, "batch seq"], loss_mask: Float[Array, "batch seq"]
) -> tuple[Int[Array, "batch seq"], Float[Array, "batch seq"]]:
    """Labels and weights aligned with the predictions: position t predicts token t + 1."""
    # Shift the labels rather than slice the logits: the logits are the biggest activation
    # of the step ([B, L, vocab]) and must not be copied; the last position gets weight 0.
    labels = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))
    weights = jnp.pad(target_mask(loss_mask), ((0, 0), (0, 1)))
    return labels, weights


def _sums_and_lse(
    logits: Float[Array, "batch seq vocab"], labels: Int[Array, "batch seq"], weights: Float[Array, "batch seq"]
) -> tuple[LossSums, Float[Array, "batch seq"]]:
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    # where, not a product: an ignored position's inf/nan must not leak into the sums.
    counted = weights > 0
    ce = jnp.where(counted, (lse - label_logit) * weights, 0.0)
    z = jnp.where(counted, lse * lse * weights, 0.0)
    return LossSums(ce=jnp.sum(ce), z=jnp.sum(z), count=jnp.sum(weights)), lse


def _sums(logits: Float[Array, "batch seq vocab"], labels: Int[Array, "batch seq"], weights: Float[Array, "batch seq"]) -> LossSums:
    return _sums_and_lse(logits, labels, weights)[0]


def _head_logits(h: Array, head: Array, vocab_size: int, constrain: Constrain, logits_dtype: str) -> Array:
    """Logits of `h @ head` (float32, or h's dtype for `logits_dtype="compute"`), the padded
    vocabulary's columns at -inf."""
    out_dtype = jnp.float32 if logits_dtype == "float32" else h.dtype
    logits = constrain(dense(h, head, constrain, out_dtype=out_dtype), ("batch", "sequence", "act_vocab"))
    if vocab_size < logits.shape[-1]:  # padding columns never enter a prediction
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    return logits


def _chunks(x: Array, n_chunks: int, size: int) -> Array:
    """[batch, seq, ...] -> [n_chunks, batch, size, ...], zero-padded at the end."""
    batch, length = x.shape[:2]
    pad = [(0, 0), (0, n_chunks * size - length)] + [(0, 0)] * (x.ndim - 2)
    return jnp.moveaxis(jnp.pad(x, pad).reshape(batch, n_chunks, size, *x.shape[2:]), 1, 0)


def loss_sums(
    logits: Float[Array, "batch seq vocab"],
    input_ids: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
) -> LossSums:
    """Sums of cross-entropy and logsumexp^2 over target tokens, in float32, from whole logits."""
    return _sums(logits, *_shifted_targets(input_ids, loss_mask))


def chunked_loss_sums(
    hidden: Float[Array, "batch seq d_model"],
    head: Float[Array, "d_model padded_vocab"],
    input_ids: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
    *,
    vocab_size: int,
    chunk_size: int,
    logits_dtype: str = "compute",
    constrain: Constrain = unconstrained,
) -> LossSums:
    """`loss_sums` of `hidden @ head` without ever holding the whole [batch, seq, vocab] logits.

    The sequence is cut into chunks of `chunk_size` positions; each chunk's logits are
    computed, reduced to sums and dropped, and recomputed in the backward pass (remat), so the
    loss holds one chunk's logits at a time. Columns of the padded vocabulary are masked out.
    """
    labels, weights = _shifted_targets(input_ids, loss_mask)
    # Gather the head whole on d_model (FSDP gathers weights, never activations); left to
    # itself GSPMD may instead split the hidden states on d_model and compute every row's
    # partial logits on every device: a batch-sized [batch, chunk, vocab] per device.
    head = constrain(head.astype(hidden.dtype), ("act_embed", "act_vocab"))

    def chunk_sums(h, labels, weights) -> LossSums:
        return _sums(_head_logits(h, head, vocab_size, constrain, logits_dtype), labels, weights)

    length = input_ids.shape[1]
    if length <= chunk_size:  # one chunk: nothing to save by recomputing
        return chunk_sums(hidden, labels, weights)
    n_chunks = -(-length // chunk_size)

    def add_chunk(total: LossSums, xs) -> tuple[LossSums, None]:
        return LossSums(*(a + b for a, b in zip(total, jax.checkpoint(chunk_sums)(*xs)))), None

    zero = LossSums(*(jnp.zeros((), jnp.float32),) * 3)
    total, _ = jax.lax.scan(add_chunk, zero, tuple(_chunks(x, n_chunks, chunk_size) for x in (hidden, labels, weights)))
    return total


def objective(sums: LossSums, z_loss_weight: float, normaliser: Float[Array, ""]) -> Float[Array, ""]:
    """What gets differentiated: (ce + z_loss_weight * z) / normaliser (the global count)."""
    return (sums.ce + z_loss_weight * sums.z) / jnp.maximum(normaliser, 1.0)


def fused_head_loss(
    hidden: Float[Array, "batch seq d_model"],
    head: Float[Array, "d_model padded_vocab"],
    input_ids: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
    head_grad: Float[Array, "d_model padded_vocab"],
    *,
    vocab_size: int,
    chunk_size: int,
    z_loss_weight: float,
    logits_dtype: str = "compute",
    constrain: Constrain = unconstrained,
) -> tuple[Float[Array, ""], LossSums, Float[Array, "d_model padded_vocab"]]:
    """(ce + z_loss_weight * z, the `LossSums`, `head_grad` plus d(ce + z_w * z)/d(head)) of
    `hidden @ head`, for training. The first is differentiable with respect to `hidden`; the
    sums are metrics (no gradient flows through them); the head's gradient is the third result,
    not autodiff's (which gives the head none from here), unscaled and in float32.

    Same values as `chunked_loss_sums`; a cheaper gradient. Each chunk's logits are computed
    once, and in the same pass their gradient, `w * (softmax * (1 + 2 z_w lse) -
    onehot(label))`, is formed and multiplied into the gradients of the hidden states and of
    the head. The backward pass only scales the hidden states' by the incoming cotangent.
    Autodiff of the chunked loss instead computes every chunk's logits twice (forward, then
    again under remat in the backward pass) and reads them in more passes; at the OLMo 3
    vocabulary that is a large part of a small model's step on a TPU (docs/performance.md,
    "Speed on TPU").

    The head's gradient adds into the caller's float32 `head_grad`: gradient accumulation
    passes its running sum and scales it by the objective's factor once. Through autodiff each
    micro-batch would start its own sum from zero, scale it, round it to the head's dtype and
    add it into the accumulator: four more passes over a [d_model, vocab] float32 array per
    micro-batch (olmo3_600m: 514 MB each).
    """
    labels, weights = _shifted_targets(input_ids, loss_mask)
    head = constrain(head.astype(hidden.dtype), ("act_embed", "act_vocab"))
    batch, length, d_model = hidden.shape
    n_chunks = -(-length // chunk_size)
    size = min(chunk_size, length)

    def chunk_pass(head, carry, xs):  # head: run's argument (a closure would leak its tracer)
        ce, z, d_head = carry
        h, labels, weights = xs
        logits = _head_logits(h, head, vocab_size, constrain, logits_dtype)
        sums, lse = _sums_and_lse(logits, labels, weights)
        # d(ce + z_w * z)/d(logits), in the compute dtype (as autodiff's cotangent would be
        # when it enters the bf16 matmuls).
        # (where, not only the weight: an ignored position's inf/nan must not leak in.)
        counted = (weights > 0)[..., None]
        w = jnp.where(counted, weights[..., None], 0.0)
        onehot = jnp.arange(logits.shape[-1]) == labels[..., None]
        d_logits = jnp.exp(logits - lse[..., None]) * (w * (1.0 + 2.0 * z_loss_weight * lse[..., None]))
        d_logits = jnp.where(counted, d_logits - jnp.where(onehot, w, 0.0), 0.0).astype(h.dtype)
        d_logits = constrain(d_logits, ("batch", "sequence", "act_vocab"))
        d_h = jnp.einsum("bcv,dv->bcd", d_logits, head)
        d_head = d_head + jnp.einsum("bcd,bcv->dv", h, d_logits, preferred_element_type=jnp.float32)
        return (ce + sums.ce, z + sums.z, d_head), d_h

    def run(hidden, head, d_head):
        zero = jnp.zeros((), jnp.float32)
        init = (zero, zero, d_head)
        if n_chunks == 1:
            (ce, z, d_head), d_hidden = chunk_pass(head, init, (hidden, labels, weights))
        else:
            xs = tuple(_chunks(x, n_chunks, size) for x in (hidden, labels, weights))
            (ce, z, d_head), d_chunks = jax.lax.scan(
                functools.partial(chunk_pass, head), init, xs, unroll=_UNROLL_CHUNKS.get() or 1
            )
            d_hidden = jnp.moveaxis(d_chunks, 0, 1).reshape(batch, n_chunks * size, d_model)[:, :length]
        return (ce + z_loss_weight * z, ce, z, d_head), d_hidden

    @jax.custom_vjp
    def loss_and_sums(hidden, head, d_head):
        return run(hidden, head, d_head)[0]

    def backward(d_hidden, cotangents):
        # Only the weighted sum is differentiated; ce and z leave as metrics and the head's
        # gradient as a result (all stopped below).
        return (cotangents[0] * d_hidden).astype(hidden.dtype), jnp.zeros_like(head), jnp.zeros(head.shape, jnp.float32)

    loss_and_sums.defvjp(run, backward)
    value, ce, z, d_head = loss_and_sums(hidden, head, head_grad.astype(jnp.float32))
    stop = jax.lax.stop_gradient
    return value, LossSums(ce=stop(ce), z=stop(z), count=jnp.sum(weights)), stop(d_head)
