"""Gated activations ``act(x[..., :d]) * x[..., d:]`` as one Pallas TPU kernel family.

SiluAndMul, GeluAndMul (and later MulAndSilu, FatreluAndMul, ...) share this kernel; the
activation is a static parameter. Computation is in float32, the result cast to x's dtype.

Tiling: rows are blocked along sublanes. When ``d`` is a multiple of 128 lanes, the two halves are
read as two lane-aligned column blocks of the same input (no copy of the halves is ever made) and
columns are tiled too, so very wide MLPs stay inside VMEM. Otherwise one block spans the full
``2*d`` row (legal for any width) and the halves are static slices inside the kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualop.kernels.pallas.common import compiler_params, row_blocks, rowwise_batching, to_rows

__all__ = ["gated_activation", "gated_activation_reference", "gated_activation_cost", "ACTIVATIONS"]

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu(g):
    return g * jax.nn.sigmoid(g)


def _gelu(g):
    return 0.5 * g * (1.0 + jax.lax.erf(g * _SQRT_HALF))


def _gelu_tanh(g):
    return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


# name -> (float32 activation, transcendentals per element)
ACTIVATIONS = {"silu": (_silu, 1), "gelu": (_gelu, 1), "gelu_tanh": (_gelu_tanh, 1)}
_LANE_BLOCK_MAX = 2048


def gated_activation_reference(x, *, activation: str = "silu"):
    d = x.shape[-1] // 2
    act = ACTIVATIONS[activation][0]
    xf = x.astype(jnp.float32)
    return (act(xf[..., :d]) * xf[..., d:]).astype(x.dtype)


def gated_activation_cost(rows: int, d: int, itemsize: int, activation: str) -> pl.CostEstimate:
    n = rows * d
    return pl.CostEstimate(
        flops=n * 6, transcendentals=n * ACTIVATIONS[activation][1], bytes_accessed=3 * n * itemsize
    )


def _split_kernel(g_ref, u_ref, o_ref, *, act):
    g = g_ref[...].astype(jnp.float32)
    o_ref[...] = (act(g) * u_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _full_row_kernel(x_ref, o_ref, *, act, d: int):
    x = x_ref[...].astype(jnp.float32)
    o_ref[...] = (act(x[:, :d]) * x[:, d:]).astype(o_ref.dtype)


def _lane_block(d: int) -> int:
    """Largest multiple of 128 that divides ``d`` and is at most ``_LANE_BLOCK_MAX``."""
    best = 128
    for cand in range(128, min(d, _LANE_BLOCK_MAX) + 1, 128):
        if d % cand == 0:
            best = cand
    return best


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "block_rows"))
def gated_activation(x: jax.Array, *, activation: str = "silu", interpret=False, block_rows: int | None = None):
    """``act(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (the last dim must be even)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_activation: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    return _build(activation, interpret, block_rows)(x)


@functools.lru_cache(maxsize=None)
def _build(activation: str, interpret, block_rows: int | None):
    act = ACTIVATIONS[activation][0]

    def call(x):
        shape, dtype = x.shape, x.dtype
        d = shape[-1] // 2
        out_shape = (*shape[:-1], d)
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0 or d == 0:
            return jnp.zeros(out_shape, dtype)
        cost = gated_activation_cost(rows, d, dtype.itemsize, activation)
        # bytes per output element in VMEM: two inputs + one output, double-buffered, + f32 temps
        per_elem = 2 * 3 * dtype.itemsize + 8
        if d % 128 == 0:
            bd = _lane_block(d)
            blocks = row_blocks(rows, d, dtype, per_elem, block_cols=bd)
            br = blocks.block_rows if block_rows is None else min(block_rows, rows)
            n_col = d // bd
            out = pl.pallas_call(
                functools.partial(_split_kernel, act=act),
                grid=(pl.cdiv(rows, br), n_col),
                in_specs=[
                    pl.BlockSpec((br, bd), lambda i, j: (i, j)),
                    pl.BlockSpec((br, bd), lambda i, j: (i, j + n_col)),
                ],
                out_specs=pl.BlockSpec((br, bd), lambda i, j: (i, j)),
                out_shape=jax.ShapeDtypeStruct((rows, d), dtype),
                compiler_params=compiler_params(2),
                cost_estimate=cost,
                interpret=interpret,
                name=f"dualop_{activation}_and_mul",
            )(x2, x2)
        else:
            blocks = row_blocks(rows, 2 * d, dtype, per_elem)
            br = blocks.block_rows if block_rows is None else min(block_rows, rows)
            out = pl.pallas_call(
                functools.partial(_full_row_kernel, act=act, d=d),
                grid=(pl.cdiv(rows, br),),
                in_specs=[pl.BlockSpec((br, 2 * d), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((br, d), lambda i: (i, 0)),
                out_shape=jax.ShapeDtypeStruct((rows, d), dtype),
                compiler_params=compiler_params(1),
                cost_estimate=cost,
                interpret=interpret,
                name=f"dualop_{activation}_and_mul",
            )(x2)
        return out.reshape(out_shape)

    return rowwise_batching(call, n_rowwise=1)
