"""int8 training matmuls (`model.quantization=int8`), through Google's Qwix.

The blocks' projections (q, k, v, o, gate, up, down) run as int8 x int8 -> int32 matmuls in
the forward pass and in both matmuls of the backward pass: each operand is scaled per row or
column by its absolute maximum over the contraction (Qwix's `absmax`, channel-wise), rounded
to int8, multiplied on the MXU's integer path (a v5e's int8 peak is twice its bf16 one) and
scaled back. The weights, the optimiser's moments and every update stay float32 (the master
copy is never quantized), and the embedding, the head's loss, the norms and attention itself
keep the model's compute dtype. This is what MaxText's `quantization=int8
use_qwix_quantization=true` asks of Qwix for its decoder layers (int8 weights, activations and
gradients), built from the same Qwix function, `dot_general_qt`, without Flax's module
interception that MaxText uses to reach it.

Qwix is optional (`pip install -c constraints.txt -e '.[int8]'` in the checkout): importing
this module never imports it; the first quantized matmul does, and a missing Qwix is one
`QuantizationUnavailable` naming the fix.

Sources: Qwix, https://github.com/google/qwix (`qwix/_src/core/dot_general_qt.py`); MaxText's
`src/maxtext/layers/quantizations.py` (`get_quantization_rule`).
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

# The values `model.quantization` takes besides null (bf16/float32 matmuls as the compute dtype says).
QUANTIZATIONS = ("int8",)


class QuantizationUnavailable(ImportError):
    """`model.quantization` was set but the library it runs on is not installed."""


@functools.cache
def _qwix_int8():
    try:
        from qwix._src.core import dot_general_qt as qt
    except ImportError as e:
        raise QuantizationUnavailable(
            f"model.quantization=int8 runs on Google's Qwix, which is not installed here ({e}): "
            "pip install -c constraints.txt -e '.[int8]' in the olmo_eqx checkout (qwix and flax), or set model.quantization=null"
        ) from None
    int8 = jnp.int8
    config = qt.DotGeneralQtConfig(
        lhs_qtype=int8, rhs_qtype=int8,  # forward: activations and weights
        dlhs_grad_qtype=int8, drhs_grad_qtype=int8,  # backward: the incoming gradient of both matmuls
    )
    return functools.partial(qt.dot_general_qt, config=config)


def check_available(quantization: Optional[str]) -> None:
    """Raise `QuantizationUnavailable` now (before anything compiles) when `quantization` needs
    a library that is missing."""
    if quantization == "int8":
        _qwix_int8()


def quantized_matmul(
    x: Float[Array, "*tokens d_in"], weight: Float[Array, "d_in d_out"], quantization: str, *, out_dtype=None
) -> Float[Array, "*tokens d_out"]:
    """x @ weight with both operands (and, in the backward pass, the incoming gradient) in
    `quantization`'s integer type, x scaled per token; the result in `out_dtype` (default x's)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: use one of {list(QUANTIZATIONS)} or null")
    contract_last_with_first = (((x.ndim - 1,), (0,)), ((), ()))
    out = _qwix_int8()(x, weight.astype(x.dtype), contract_last_with_first)
    return out.astype(out_dtype or x.dtype)
