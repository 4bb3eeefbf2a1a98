"""The device side of evaluation: per-row log-likelihood sums and the KL divergence between
two models, on batches laid out like training batches (rows over the mesh's batch axes).

Every process builds the same global batch on the host and contributes its own rows
(`make_array_from_callback`); results come back replicated, so every process reads them.
"""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from olmo_eqx.sharding import ShardingRules, batch_sharding


class RowScores(NamedTuple):
    """Per row: sum of log p(target) over masked positions, how many, and whether each was the argmax."""

    logprob: Float[Array, " batch"]
    count: Float[Array, " batch"]
    greedy: Bool[Array, " batch"]


def _target_logprobs(logits, targets):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse


def _row_scores(logits, targets, mask) -> RowScores:
    """Per row: summed log p of the masked targets, their count, and whether all are the argmax."""
    logprobs = _target_logprobs(logits, targets)
    greedy = jnp.argmax(logits, axis=-1) == targets
    return RowScores(
        logprob=jnp.sum(jnp.where(mask, logprobs, 0.0), axis=-1),
        count=jnp.sum(mask, axis=-1).astype(jnp.float32),
        greedy=jnp.all(greedy | ~mask, axis=-1),
    )


@eqx.filter_jit
def _score(model, input_ids, targets, mask, out_sharding):
    scores = _row_scores(model(input_ids), targets, mask)
    return jax.lax.with_sharding_constraint(scores, out_sharding)


class ChoiceScores(NamedTuple):
    """Per row: the shared prefix's (`RowScores`) and, per candidate last token, its log p and argmax flag."""

    prefix: RowScores
    last_logprob: Float[Array, "batch k"]
    last_greedy: Bool[Array, "batch k"]


@eqx.filter_jit
def _score_choices(model, input_ids, targets, mask, last_pos, last_targets, out_sharding):
    logits = model(input_ids)
    prefix = _row_scores(logits, targets, mask)
    last = jnp.take_along_axis(logits, last_pos[:, None, None], axis=1)[:, 0, :].astype(jnp.float32)  # [B, V]
    last_logprob = jnp.take_along_axis(last, last_targets, axis=-1) - jax.nn.logsumexp(last, axis=-1, keepdims=True)
    last_greedy = jnp.argmax(last, axis=-1)[:, None] == last_targets
    scores = ChoiceScores(prefix, last_logprob, last_greedy)
    return jax.lax.with_sharding_constraint(scores, out_sharding)


class KLSums(NamedTuple):
    """Per row: sum over masked positions of KL(p_a || p_b), of each model's cross-entropy, and the count."""

    kl: Float[Array, " batch"]
    ce_a: Float[Array, " batch"]
    ce_b: Float[Array, " batch"]
    count: Float[Array, " batch"]


@eqx.filter_jit
def _kl(model_a, model_b, input_ids, targets, mask, out_sharding):
    log_a = jax.nn.log_softmax(model_a(input_ids).astype(jnp.float32), axis=-1)
    log_b = jax.nn.log_softmax(model_b(input_ids).astype(jnp.float32), axis=-1)
    # Exactly 0 where the two distributions are equal; clamp float noise below 0.
    kl = jnp.maximum(jnp.sum(jnp.exp(log_a) * (log_a - log_b), axis=-1), 0.0)
    ce_a = -jnp.take_along_axis(log_a, targets[..., None], axis=-1)[..., 0]
    ce_b = -jnp.take_along_axis(log_b, targets[..., None], axis=-1)[..., 0]
    sums = KLSums(
        kl=jnp.sum(jnp.where(mask, kl, 0.0), axis=-1),
        ce_a=jnp.sum(jnp.where(mask, ce_a, 0.0), axis=-1),
        ce_b=jnp.sum(jnp.where(mask, ce_b, 0.0), axis=-1),
        count=jnp.sum(mask, axis=-1).astype(jnp.float32),
    )
    return jax.lax.with_sharding_constraint(sums, out_sharding)


def batch_multiple(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> int:
    """Rows of a global batch must be a multiple of this (the size of the mesh's batch axes)."""
    axes = rules.mesh_axes("batch")
    axes = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for axis in axes:
        if axis is not None:
            size *= mesh.shape[axis]
    return size


def round_batch_size(batch_size: int, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> int:
    multiple = batch_multiple(mesh, rules)
    return -(-max(batch_size, 1) // multiple) * multiple


def to_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array every process holds in full, as a global array laid out by `sharding`."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class Scorer:
    """Run the jitted scoring functions on a mesh: inputs batch-sharded, outputs replicated."""

    def __init__(self, mesh: Mesh, rules: ShardingRules = ShardingRules()):
        self.mesh = mesh
        self.rules = rules
        self._batch = batch_sharding(mesh, rules)
        self._out = NamedSharding(mesh, P())

    def _inputs(self, input_ids, targets, mask):
        return (
            to_global(np.asarray(input_ids, np.int32), self._batch),
            to_global(np.asarray(targets, np.int32), self._batch),
            to_global(np.asarray(mask, bool), self._batch),
        )

    def score(
        self,
        model: eqx.Module,
        input_ids: Int[np.ndarray, "batch seq"],
        targets: Int[np.ndarray, "batch seq"],
        mask: Bool[np.ndarray, "batch seq"],
    ) -> RowScores:
        """Host arrays of per-row log-likelihood sums (float32), counts and greedy flags."""
        out = _score(model, *self._inputs(input_ids, targets, mask), self._out)
        return RowScores(*(np.asarray(a.addressable_data(0)) for a in out))

    def score_choices(
        self,
        model: eqx.Module,
        input_ids: Int[np.ndarray, "batch seq"],
        targets: Int[np.ndarray, "batch seq"],
        mask: Bool[np.ndarray, "batch seq"],
        last_pos: Int[np.ndarray, " batch"],
        last_targets: Int[np.ndarray, "batch k"],
    ) -> ChoiceScores:
        """Host arrays of `ChoiceScores` (see `olmo_eqx.evaluation.requests.ScoreBatch`)."""
        inputs = self._inputs(input_ids, targets, mask) + (
            to_global(np.asarray(last_pos, np.int32), NamedSharding(self.mesh, P(self._batch.spec[0]))),
            to_global(np.asarray(last_targets, np.int32), self._batch),
        )
        out = _score_choices(model, *inputs, self._out)
        host = [np.asarray(a.addressable_data(0)) for a in jax.tree.leaves(out)]
        return ChoiceScores(RowScores(*host[:3]), host[3], host[4])

    def kl(
        self,
        model_a: eqx.Module,
        model_b: eqx.Module,
        input_ids: Int[np.ndarray, "batch seq"],
        targets: Int[np.ndarray, "batch seq"],
        mask: Bool[np.ndarray, "batch seq"],
    ) -> KLSums:
        out = _kl(model_a, model_b, *self._inputs(input_ids, targets, mask), self._out)
        return KLSums(*(np.asarray(a.addressable_data(0)) for a in out))
