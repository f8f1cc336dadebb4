"""The linear ops' GEMM for XLA (jax arrays, and torch_xla / torchax tensors through the Pallas
bridge's ``call_jax``): XLA's dot is the TPU's (and GPU's) GEMM, so this is no kernel of its own,
only the dot asked for the right way.

``linear(x, weight, bias=None, interpret=False)`` is ``x @ weight.T (+ bias)``: ``dot_general`` on
the operands' own dtype with float32 accumulation (``preferred_element_type``; one pass of the
matrix unit for 16-bit operands), the bias added in float32 (XLA fuses it into the dot's output
fusion), one cast to ``x``'s dtype. Float32 operands ask for full precision (XLA:TPU would
otherwise multiply them in one bfloat16 pass, outside the tolerance table).

``interpret`` (the bridge's "no TPU here", or a jax CPU backend standing in for a GPU): XLA:CPU
has no bfloat16 x bfloat16 -> float32 dot (jax 0.7.1: "Unsupported element type for DotThunk"),
so the operands are upcast first; products of 16-bit values are exact in float32, so the sums are
the same ones.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["linear"]


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, interpret: Any = False) -> jax.Array:
    f32 = jnp.float32
    a, w = (x.astype(f32), weight.astype(f32)) if interpret else (x, weight)
    precision = jax.lax.Precision.HIGHEST if a.dtype == f32 else None
    y = jax.lax.dot_general(a, w, (((a.ndim - 1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)
    if bias is not None:
        y = y + bias.astype(f32)
    return y.astype(x.dtype)
