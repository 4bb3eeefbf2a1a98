"""What every model of the zoo is: the interface the trainer, evaluation and sharding rely on.

A zoo model is an Equinox module that maps token ids to the final-normed hidden states and
those to float32 logits, declares the logical axes of every array field (`axes(...)`) so the
sharding rules can place it, and carries its `ModelConfig` as a static field. Training calls
`hidden_states` and runs the (chunked) loss on the head itself; evaluation calls the model.
Architectures register in `olmo_eqx.models.registry`.
"""

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from .config import ModelConfig

# Pins an activation to its layout: constrain(x, logical axis names of x's dimensions) -> x.
Constrain = Callable[[Array, tuple[str, ...]], Array]


# The key of `CausalLM.hidden_states_and_aux`'s weighted term that joins the training objective.
AUX_OBJECTIVE = "aux_objective"


def unconstrained(x: Array, axes: tuple[str, ...]) -> Array:
    """The `Constrain` of a single device or no mesh: leave layout to the compiler."""
    return x


def embed_tokens(
    table: Float[Array, "vocab d_model"], tokens: Int[Array, "batch seq"], dtype, constrain: Constrain
) -> Float[Array, "batch seq d_model"]:
    """The embedding lookup, laid out in two pinned steps (`constrain`).

    Each device first gathers its own columns of the table (d_model split like the table) for
    every row of its `lookup_batch` share, then one all-to-all hands each device its rows of
    the whole width (the block layout). Left to itself GSPMD took the first step on its own
    with one slice, but with several it gathered activations across slices, forward and in the
    gradient's scatter; pinned, the lookup and its gradient stay inside a slice.
    """
    x = constrain(jnp.take(table, tokens, axis=0), ("lookup_batch", "sequence", "embed"))
    return constrain(x.astype(dtype), ("batch", "sequence", "act_embed"))


def over_layers(body: Callable, x: PyTree, stacked: PyTree, *, scanned: bool) -> tuple[PyTree, PyTree]:
    """`jax.lax.scan(body, x, stacked)` over a stack of layers (or cycles of layers): a scan when
    `scanned` (`ModelConfig.scanned`), else the same steps as a Python loop.

    A model too small to scan is unrolled. An unrolled scan still pays for the scan machinery
    every time it is traced: its own body jaxpr, its JVP and partial evaluation, the transposed
    scan of the backward pass, and a one-trip while loop for a single cycle. A plain loop gives
    the same operations without that machinery: the suite's and the command's few-layer models
    trace and compile faster.
    """
    if scanned:
        return jax.lax.scan(body, x, stacked)
    outputs = []
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x, out = body(x, jax.tree.map(lambda a: a[i], stacked))
        outputs.append(out)
    return x, jax.tree.map(lambda *outs: jnp.stack(outs), *outputs)


def axes(*names: str, matmul: bool = False):
    """A module field holding an array whose dimensions have these logical names.

    `matmul=True` marks a weight the model only ever uses cast to its compute dtype (as a
    matmul operand): the train step casts such weights once per step, not once per use
    (`compute_weights`).
    """
    return eqx.field(metadata={"axes": names, "matmul": matmul})


class LogicalAxes(tuple):
    """Names of an array's dimensions (a pytree leaf, like `PartitionSpec`)."""


class CausalLM(eqx.Module):
    """A causal language model of the zoo: token ids in, float32 logits over the vocabulary out."""

    config: eqx.AbstractVar[ModelConfig]

    @abc.abstractmethod
    def hidden_states(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        """The final-normed hidden states, which `logits` turns into logits."""

    def hidden_states_and_aux(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> tuple[Float[Array, "batch seq d_model"], dict[str, Float[Array, ""]]]:
        """`hidden_states` plus the model's auxiliary training terms, float32 scalars by name.

        Training adds `aux[AUX_OBJECTIVE]` (already weighted) to the objective and reports
        every entry as a metric. Dense models have none; mixture-of-experts models return
        their router losses and expert load (`olmoe.py`).
        """
        return self.hidden_states(tokens, positions, segment_ids=segment_ids, constrain=constrain), {}

    @abc.abstractmethod
    def logits(
        self, hidden: Float[Array, "*batch d_model"], *, constrain: Constrain = unconstrained
    ) -> Float[Array, "*batch vocab"]:
        """Float32 logits over the real vocabulary (padding rows of the head never predict)."""

    def __call__(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq vocab"]:
        """Logits over the real vocabulary (float32). Training uses `hidden_states` + a chunked loss.

        `positions` (RoPE) default to 0 .. seq-1 on every row; `segment_ids` (packed
        documents) restrict the model to tokens of the same document.
        """
        hidden = self.hidden_states(tokens, positions, segment_ids=segment_ids, constrain=constrain)
        return self.logits(hidden, constrain=constrain)


def _field_metadata(model: eqx.Module, path) -> tuple[Mapping, bool]:
    """The metadata of the field at `path` and whether a field on the way is `stacked`."""
    node, stacked, metadata = model, False, {}
    for entry in path:
        if isinstance(entry, jax.tree_util.SequenceKey):  # a tuple of sub-modules
            node = node[entry.idx]
            continue
        field = next(f for f in dataclasses.fields(node) if f.name == entry.name)
        metadata = field.metadata
        stacked = stacked or metadata.get("stacked", False)
        node = getattr(node, entry.name)
    return metadata, stacked


def compute_weights(params: PyTree, model: eqx.Module) -> PyTree:
    """`params` (the model's arrays, as `eqx.partition` gives them) with the weights marked
    `axes(..., matmul=True)` cast to the compute dtype.

    Why: with float32 master weights each use casts again, so a step of M micro-batches reads
    every float32 weight M times forward, again when remat recomputes, and again backward.
    Cast once per step, the micro-batches read bf16 copies. The numerics are the same: such a
    weight is only ever used cast, and the cast's gradient is the same conversion either way.
    """
    dtype = jnp.dtype(model.config.compute_dtype)

    def cast(path, leaf):
        if leaf is None or not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.dtype == dtype:
            return leaf
        return leaf.astype(dtype) if _field_metadata(model, path)[0].get("matmul", False) else leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def logical_axes(model: eqx.Module) -> eqx.Module:
    """A pytree shaped like `model` whose leaves are the `LogicalAxes` of each array.

    Fields marked `stacked` (a leading layer axis) get a leading "layers" axis. Works on
    abstract models too.
    """

    def axes_of(path, _leaf) -> LogicalAxes:
        metadata, stacked = _field_metadata(model, path)
        return LogicalAxes((("layers",) if stacked else ()) + tuple(metadata["axes"]))

    return jax.tree_util.tree_map_with_path(axes_of, model)
