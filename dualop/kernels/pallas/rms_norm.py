"""RMSNorm (optionally fused with a residual add) as a row-wise Pallas TPU kernel.

out = cast(x * rsqrt(mean(x**2) + eps), dtype) * weight, computed in float32, with the variants of
a ``NormSpec`` (statistic over the first ``var_size`` features, Gemma's ``(1 + weight)`` applied in
float32); with a residual, x is first replaced by x + residual (in float32) and that sum, cast to
x's dtype, is returned as the new residual. The formula is ``kernels/norm_math.rms_normalize``,
shared with the native bodies; ``rms_norm_reference`` states the whole kernel in plain jnp.

Each grid step normalises ``block_rows`` full rows held in VMEM; the row dimension is
``parallel`` so megacore chips split it. The hidden dimension is never tiled (a row's statistic
needs all of it), which also makes any hidden size legal: a block that spans the whole last dim is
exempt from the 128-lane rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualop.backends.xla import array_api as xp
from dualop.kernels.norm_math import NormSpec, rms_normalize
from dualop.kernels import cost as cost_model
from dualop.kernels.pallas.common import (
    block_vmem_bytes,
    compiler_params,
    cost_estimate,
    resident_spec,
    row_blocks,
    rowwise_batching,
    single_buffered,
    streamed_spec,
    to_rows,
    tpu_jit,
)

__all__ = ["rms_norm", "rms_norm_reference", "rms_norm_cost"]


def rms_norm_reference(x, weight=None, residual=None, *, spec: NormSpec = NormSpec()):
    """The plain jax.numpy statement of the kernel (used by tests and docs)."""
    xf = x.astype(jnp.float32)
    new_residual = None
    if residual is not None:
        xf = xf + residual.astype(jnp.float32)
        new_residual = xf.astype(x.dtype)
    y = rms_normalize(xp, xf, weight, spec, x.dtype)
    return y if residual is None else (y, new_residual)


def rms_norm_cost(rows: int, hidden: int, itemsize: int, has_weight: bool, has_residual: bool) -> pl.CostEstimate:
    """Bytes and flops one call must move and do (``kernels/cost.py``), as a ``pl.CostEstimate``."""
    return cost_estimate(cost_model.rms_norm_cost(rows, hidden, itemsize, has_weight, has_residual))


def _kernel(*refs, spec: NormSpec, has_weight: bool, has_residual: bool):
    it = iter(refs)
    x_ref = next(it)
    w_ref = next(it) if has_weight else None
    r_ref = next(it) if has_residual else None
    o_ref = next(it)
    ro_ref = next(it) if has_residual else None

    x = x_ref[...].astype(jnp.float32)
    if has_residual:
        x = x + r_ref[...].astype(jnp.float32)
        ro_ref[...] = x.astype(ro_ref.dtype)
    o_ref[...] = rms_normalize(xp, x, w_ref[...] if has_weight else None, spec, o_ref.dtype)


@tpu_jit(static_argnames=("spec", "interpret", "block_rows"))
def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    residual: jax.Array | None = None,
    *,
    spec: NormSpec = NormSpec(),
    interpret=False,
    block_rows: int | None = None,
):
    """RMSNorm over the last dim of ``x`` (any leading shape). Returns ``out`` or ``(out, new_residual)``.

    ``block_rows`` overrides the VMEM-budget choice of rows per grid step (a multiple of the
    sublane tile); tests use it to force several blocks and a ragged last one.
    """
    call = _build(spec, interpret, block_rows, weight is not None, residual is not None)
    rowwise = (x,) if residual is None else (x, residual)
    params = () if weight is None else (weight,)
    return call(*rowwise, *params)


@functools.lru_cache(maxsize=None)
def _build(spec: NormSpec, interpret, block_rows: int | None, has_weight: bool, has_residual: bool):
    kernel = functools.partial(_kernel, spec=spec, has_weight=has_weight, has_residual=has_residual)

    def call(x, *rest):
        residual = rest[0] if has_residual else None
        weight = rest[-1] if has_weight else None
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            out = jnp.zeros(shape, dtype)
            return (out, jnp.zeros(shape, dtype)) if has_residual else out
        n_io = 2 + (2 if has_residual else 0)  # row arrays: x, out (+ residual in and out)
        per_elem = 2 * n_io * dtype.itemsize + 8
        blocks = row_blocks(rows, hidden, dtype, bytes_per_elem=per_elem)
        br = blocks.block_rows if block_rows is None else min(block_rows, rows)
        vmem = block_vmem_bytes(br, hidden, dtype, per_elem)
        row_spec = pl.BlockSpec((br, hidden), lambda i: (i, 0))
        in_spec = streamed_spec((br, hidden), lambda i: (i, 0), single=single_buffered(vmem))
        in_specs, operands = [in_spec], [x2]
        if has_weight:
            in_specs.append(resident_spec((1, hidden)))
            operands.append(weight.reshape(1, hidden))
        if has_residual:
            in_specs.append(in_spec)
            operands.append(to_rows(residual))
        n_out = 2 if has_residual else 1
        outs = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(rows, br),),
            in_specs=in_specs,
            out_specs=[row_spec] * n_out,
            out_shape=[jax.ShapeDtypeStruct((rows, hidden), dtype)] * n_out,
            compiler_params=compiler_params(1, vmem_bytes=vmem),
            cost_estimate=rms_norm_cost(rows, hidden, dtype.itemsize, has_weight, has_residual),
            interpret=interpret,
            name="dualop_rms_norm",
        )(*operands)
        out = outs[0].reshape(shape)
        return (out, outs[1].reshape(shape)) if has_residual else out

    return rowwise_batching(call, n_rowwise=1 + has_residual)
