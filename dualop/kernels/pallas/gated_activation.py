"""Gated activations ``act(gate) * up`` as one Pallas TPU kernel family.

SiluAndMul, MulAndSilu, GeluAndMul, GeluAndMulSparse, FatreluAndMul and SwigluOAIAndMul share this
kernel; a ``GateSpec`` (static) says which, and the formulas are the same ones the native bodies
use (``kernels/gate_math.py``). Computation is in float32, the result cast to x's dtype.

Layouts:
- halves with ``d`` a multiple of 128 lanes: the two halves are read as two lane-aligned column
  blocks of the same input (no copy of the halves is made), and columns are tiled too so very wide
  MLPs stay inside VMEM; a gate that needs row statistics (sparsity) keeps whole half-rows.
- halves otherwise: one block spans the full ``2*d`` row (legal for any width); the halves are
  static slices inside the kernel.
- interleaved (gate, up alternate): XLA de-interleaves first (one extra pass over x), then the
  two-input kernel runs on full-width blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualop.backends.xla import array_api as xp
from dualop.kernels.gate_math import GateSpec, apply_gate, gate_and_up
from dualop.kernels import cost as cost_model
from dualop.kernels.pallas.common import (
    block_vmem_bytes,
    compiler_params,
    cost_estimate,
    row_blocks,
    rowwise_batching,
    to_rows,
    tpu_jit,
)

__all__ = ["gated_activation", "gated_activation_reference", "gated_activation_cost", "GateSpec"]

_LANE_BLOCK_MAX = 2048


def gated_activation_reference(x, *, spec: GateSpec = GateSpec()):
    """The plain jax.numpy statement of the kernel."""
    d = x.shape[-1] // 2
    gate, up = gate_and_up(x.astype(jnp.float32), d, spec)
    return apply_gate(xp, gate, up, spec).astype(x.dtype)


def gated_activation_cost(rows: int, d: int, itemsize: int, spec: GateSpec = GateSpec()) -> pl.CostEstimate:
    """Bytes and flops one call must move and do (``kernels/cost.py``), as a ``pl.CostEstimate``."""
    return cost_estimate(cost_model.gated_activation_cost(rows, d, itemsize, spec))


def _two_input_kernel(g_ref, u_ref, o_ref, *, spec: GateSpec):
    g = g_ref[...].astype(jnp.float32)
    u = u_ref[...].astype(jnp.float32)
    o_ref[...] = apply_gate(xp, g, u, spec).astype(o_ref.dtype)


def _full_row_kernel(x_ref, o_ref, *, spec: GateSpec, d: int):
    gate, up = gate_and_up(x_ref[...].astype(jnp.float32), d, spec)
    o_ref[...] = apply_gate(xp, gate, up, spec).astype(o_ref.dtype)


def _lane_block(d: int) -> int:
    """Largest multiple of 128 that divides ``d`` and is at most ``_LANE_BLOCK_MAX``."""
    best = 128
    for cand in range(128, min(d, _LANE_BLOCK_MAX) + 1, 128):
        if d % cand == 0:
            best = cand
    return best


@tpu_jit(static_argnames=("spec", "interpret", "block_rows"))
def gated_activation(x: jax.Array, *, spec: GateSpec = GateSpec(), interpret=False, block_rows: int | None = None):
    """The spec's gated activation over the last dim of ``x`` (even), any leading shape."""
    return _build(spec, interpret, block_rows)(x)


@functools.lru_cache(maxsize=None)
def _build(spec: GateSpec, interpret, block_rows: int | None):
    name = f"dualop_gated_{spec.activation}"

    def call(x):
        shape, dtype = x.shape, x.dtype
        d = shape[-1] // 2
        out_shape = (*shape[:-1], d)
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0 or d == 0:
            return jnp.zeros(out_shape, dtype)
        cost = gated_activation_cost(rows, d, dtype.itemsize, spec)
        # bytes per output element in VMEM: two inputs + one output, double-buffered, + f32 temps
        per_elem = 2 * 3 * dtype.itemsize + 8

        def two_input_call(g_arr, u_arr, g_col0: int, u_col0: int, bd: int):
            blocks = row_blocks(rows, d, dtype, per_elem, block_cols=bd)
            br = blocks.block_rows if block_rows is None else min(block_rows, rows)
            vmem = block_vmem_bytes(br, bd, dtype, per_elem)
            return pl.pallas_call(
                functools.partial(_two_input_kernel, spec=spec),
                grid=(pl.cdiv(rows, br), d // bd),
                in_specs=[
                    pl.BlockSpec((br, bd), lambda i, j: (i, j + g_col0)),
                    pl.BlockSpec((br, bd), lambda i, j: (i, j + u_col0)),
                ],
                out_specs=pl.BlockSpec((br, bd), lambda i, j: (i, j)),
                out_shape=jax.ShapeDtypeStruct((rows, d), dtype),
                compiler_params=compiler_params(2, vmem_bytes=vmem),
                cost_estimate=cost,
                interpret=interpret,
                name=name,
            )(g_arr, u_arr)

        if spec.interleaved:
            pairs = x2.reshape(rows, d, 2)
            first, second = pairs[..., 0], pairs[..., 1]
            gate, up = (first, second) if spec.act_on == "first" else (second, first)
            bd = d if (spec.needs_row_statistics or d % 128) else _lane_block(d)
            out = two_input_call(gate, up, 0, 0, bd)
        elif d % 128 == 0:
            bd = d if spec.needs_row_statistics else _lane_block(d)
            n_col = d // bd
            g0, u0 = (0, n_col) if spec.act_on == "first" else (n_col, 0)
            out = two_input_call(x2, x2, g0, u0, bd)
        else:
            blocks = row_blocks(rows, 2 * d, dtype, per_elem)
            br = blocks.block_rows if block_rows is None else min(block_rows, rows)
            vmem = block_vmem_bytes(br, 2 * d, dtype, per_elem)
            out = pl.pallas_call(
                functools.partial(_full_row_kernel, spec=spec, d=d),
                grid=(pl.cdiv(rows, br),),
                in_specs=[pl.BlockSpec((br, 2 * d), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((br, d), lambda i: (i, 0)),
                out_shape=jax.ShapeDtypeStruct((rows, d), dtype),
                compiler_params=compiler_params(1, vmem_bytes=vmem),
                cost_estimate=cost,
                interpret=interpret,
                name=name,
            )(x2)
        return out.reshape(out_shape)

    return rowwise_batching(call, n_rowwise=1)
