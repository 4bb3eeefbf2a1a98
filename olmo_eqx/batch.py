"""The batch a step consumes: token ids, a loss mask, and optional document layout.

One small pytree used by the loader, the train and eval steps, micro-batching and sharding
alike, so that packing, document masking and long context add fields, not code paths:

    TokenBatch(input_ids, loss_mask)                           stages 1-2: plain causal attention
    TokenBatch(input_ids, loss_mask, segment_ids)              documents masked from each other
    TokenBatch(input_ids, loss_mask, segment_ids, positions)   ... with RoPE positions restarting per document

`segment_ids` come from the EOS tokens (`document_layout`): a document ends with its EOS, as
OLMo-core's `get_document_lengths` splits them. The 2025 OLMo 3 runs kept RoPE positions
running across documents (OLMo-core restarts them since May 2026), so positions are only
shipped when they restart.

The two-key dict `{"input_ids": ..., "loss_mask": ...}` the steps took before stays accepted.
"""

from typing import Optional, Union

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float, Int


class TokenBatch(eqx.Module):
    input_ids: Int[Array, "batch seq"]
    loss_mask: Float[Array, "batch seq"]  # 1.0 where token t counts as a target
    segment_ids: Optional[Int[Array, "batch seq"]] = None  # document of each token, non-decreasing per row
    positions: Optional[Int[Array, "batch seq"]] = None  # RoPE positions; None: 0 .. seq-1

    def __getitem__(self, key: str):
        # Reads like the two-key dict it replaced: batch["input_ids"].
        return getattr(self, key)


def as_token_batch(batch: Union[TokenBatch, dict]) -> TokenBatch:
    """A `TokenBatch` from itself or from the dict form, with its shapes checked."""
    if isinstance(batch, dict):
        missing = {"input_ids", "loss_mask"} - set(batch)
        unknown = set(batch) - {"input_ids", "loss_mask", "segment_ids", "positions"}
        if missing or unknown:
            raise ValueError(
                f"batch keys {sorted(batch)}: expected input_ids [B, L] int32 and loss_mask [B, L], "
                "optionally segment_ids and positions [B, L] int32 (or pass an olmo_eqx.batch.TokenBatch)"
            )
        batch = TokenBatch(**batch)
    shape = batch.input_ids.shape
    for name in ("loss_mask", "segment_ids", "positions"):
        value = getattr(batch, name)
        if value is not None and value.shape != shape:
            raise ValueError(f"batch {name} {value.shape} must have the shape of input_ids {shape} ([batch, seq])")
    if len(shape) != 2:
        raise ValueError(f"batch input_ids {shape} must be [batch, seq]")
    return batch


def document_layout(
    input_ids: Int[np.ndarray, "batch seq"], eos_id: int, *, reset_positions: bool = False
) -> tuple[Int[np.ndarray, "batch seq"], Optional[Int[np.ndarray, "batch seq"]]]:
    """(segment_ids, positions) of rows of packed documents, each ending with `eos_id`.

    A token's segment is the number of EOS tokens before it, so an EOS belongs to the document
    it ends. `positions` restart at 0 with each document when `reset_positions`, else None.
    """
    is_eos = (input_ids == eos_id).astype(np.int32)
    segment_ids = (np.cumsum(is_eos, axis=1) - is_eos).astype(np.int32)
    if not reset_positions:
        return segment_ids, None
    index = np.broadcast_to(np.arange(input_ids.shape[1]), input_ids.shape)
    starts = np.where(np.diff(segment_ids, axis=1, prepend=-1) != 0, index, 0)
    return segment_ids, (index - np.maximum.accumulate(starts, axis=1)).astype(np.int32)
