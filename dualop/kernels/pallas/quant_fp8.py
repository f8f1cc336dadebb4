"""FP8 (float8_e4m3fn) input quantisation as Pallas TPU kernels: the ``quant_fp8`` op's fast path.

Contract (``ops/quantization.py``): ``scale = max(amax / 448, 1/(448*512))`` per tensor / row /
group of ``g`` columns (``amax`` optionally capped by ``scale_ub`` for per-token), or a given
static scale; ``x_q = fp8(clip(x * (1 / scale), -448, 448))`` in float32, rounded to nearest even.
``amax / 448`` is the correctly rounded quotient (``div_by_fp8_max``; XLA would otherwise multiply
by a rounded reciprocal), so results equal the other backends' bit for bit.
``quant_fp8_reference`` beside the kernels is the plain-jnp statement of it.

Layout: ``x`` is viewed as (rows, hidden) and tiled as (row block, column group), where a column
group is the whole row (per tensor, per token) or ``g`` columns (a multiple of 128 lanes). Each grid
step is independent ("parallel" on both axes):

- dynamic per token / per group: one pass per block; the block's row maxima (a lane reduction), then
  the scales, then the quantised block. Scales come out as a (groups, rows, 1) array, one
  (row block, 1) column per step, so every step owns its output block; the wrapper transposes that
  small array to (rows, groups).
- per tensor, dynamic: two phases. Phase 1 is ``jnp.max(|x|)``, a plain XLA reduction (it fuses the
  abs and reads x once); phase 2 is the static kernel with that scale.
- static: the scale goes in as a (1, 1) SMEM scalar (per tensor) or as (row block, 1) columns of
  the same (groups, rows, 1) layout (per token, per group).

The float32 -> float8 cast is preceded by an explicit round-to-nearest-even onto the e4m3 grid
(integer ops on the float32 bits), so the cast itself is exact whatever conversion the backend
emits (XLA in jax 0.7 rounds through float16 first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels import cost as cost_model
from dualop.kernels.pallas.common import compiler_params, cost_estimate, row_blocks, rowwise_batching, to_rows

__all__ = ["quant_fp8", "quant_fp8_reference", "quant_fp8_cost", "round_to_e4m3", "div_by_fp8_max", "FP8_MAX", "MIN_SCALE"]

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
FP8 = jnp.float8_e4m3fn
_SMEM = pltpu.SMEM if hasattr(pltpu, "SMEM") else pltpu.TPUMemorySpace.SMEM


def round_to_e4m3(y: jax.Array) -> jax.Array:
    """float32 ``y`` rounded to the nearest float8_e4m3fn value (ties to even), kept in float32.

    Normal range (|y| >= 2**-6): keep 3 of the 23 mantissa bits, rounding on the bit pattern (as for
    bfloat16). Subnormal range: ``(|y| + big) - big`` with ``big`` = 2**14 rounds to a multiple of
    2**-9 (the float32 ulp at 2**14); ``big`` is computed from the data because XLA (interpret
    mode) folds ``(a + C) - C`` to ``a`` for a constant ``C``. The sign bit is carried over, so -0.0
    stays -0.0 and NaN stays NaN. Assumes |y| <= 448 (callers clip first).
    """
    bits = jax.lax.bitcast_convert_type(y, jnp.int32)
    sign = bits & jnp.int32(-(2**31))
    mag = bits & jnp.int32(0x7FFFFFFF)
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & jnp.int32(-(1 << 20))
    a = jax.lax.bitcast_convert_type(mag, jnp.float32)
    big = jnp.maximum(a * 2.0**20, 16384.0)  # 2**14 wherever the subnormal branch is taken
    sub = jax.lax.bitcast_convert_type((a + big) - big, jnp.int32)
    r = jnp.where(a >= 2.0**-6, normal, sub) | sign
    return jax.lax.bitcast_convert_type(r, jnp.float32)


def div_by_fp8_max(amax: jax.Array) -> jax.Array:
    """``amax / 448`` correctly rounded, with multiplies and exact residuals (no division by a
    constant, which XLA compiles as a multiply by its rounded reciprocal). The derivation is in
    ``ops/quantization.py::_div_by_fp8_max``."""
    q0 = amax * (1.0 / FP8_MAX)
    res = (amax * (1.0 / 64.0) - q0 * 8.0) + q0
    return jnp.where(res == res, q0 + res * (1.0 / 7.0), q0)


def _dynamic_scale(amax: jax.Array) -> jax.Array:
    return jnp.maximum(div_by_fp8_max(amax), MIN_SCALE)


def _quantise(x: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 ``x`` times ``1 / scale`` (one division per scale), clipped, rounded, cast to e4m3."""
    return round_to_e4m3(jnp.clip(x * (1.0 / scale), -FP8_MAX, FP8_MAX)).astype(FP8)


def quant_fp8_reference(x, scale=None, scale_ub=None, *, granularity: str = "tensor", group_size: int = 0):
    """Plain jax.numpy statement of the kernels (same arguments, same outputs)."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    g = {"tensor": hidden, "token": hidden, "group": group_size}[granularity]
    xg = x.astype(jnp.float32).reshape(*lead, hidden // g, g)
    if scale is None:
        if granularity == "tensor":
            amax = jnp.max(jnp.abs(xg), initial=0.0).reshape(1)
        else:
            amax = jnp.max(jnp.abs(xg), axis=-1)
            if scale_ub is not None:
                amax = jnp.minimum(amax, scale_ub.reshape(()).astype(jnp.float32))
        scale = _dynamic_scale(amax)
    scale = scale.astype(jnp.float32).reshape((1,) if granularity == "tensor" else (*lead, hidden // g))
    s = scale.reshape(1, 1) if granularity == "tensor" else scale[..., None]
    return _quantise(xg, s).reshape(x.shape), scale


def quant_fp8_cost(rows: int, hidden: int, itemsize: int, n_scales: int) -> pl.CostEstimate:
    """Read x once, write x_q and the scales once (``kernels/cost.py``), as a ``pl.CostEstimate``."""
    return cost_estimate(cost_model.quant_fp8_cost(rows, hidden, itemsize, n_scales))


# ---------------------------------------------------------------------------------- kernels


def _dynamic_kernel(*refs, has_ub: bool):
    """One (row block, column group): its per-row amax, scale and quantised values."""
    if has_ub:
        x_ref, ub_ref, q_ref, s_ref = refs
    else:
        x_ref, q_ref, s_ref = refs
    x = x_ref[...].astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # (block rows, 1)
    if has_ub:
        amax = jnp.minimum(amax, ub_ref[0, 0])
    scale = _dynamic_scale(amax)
    q_ref[...] = _quantise(x, scale)
    s_ref[...] = scale


def _static_kernel(x_ref, s_ref, q_ref, *, scalar: bool):
    """Quantise one block with a given scale: an SMEM scalar, or one value per row of the block."""
    scale = s_ref[0, 0] if scalar else s_ref[...]
    q_ref[...] = _quantise(x_ref[...].astype(jnp.float32), scale)


# ---------------------------------------------------------------------------------- entry


@functools.partial(jax.jit, static_argnames=("granularity", "group_size", "interpret", "block_rows"))
def quant_fp8(
    x: jax.Array,
    scale: jax.Array | None = None,
    scale_ub: jax.Array | None = None,
    *,
    granularity: str = "tensor",
    group_size: int = 0,
    interpret=False,
    block_rows: int | None = None,
):
    """Quantise ``x`` (any leading shape) to float8_e4m3fn; returns ``(x_q, scale)``.

    ``granularity``: ``"tensor"``, ``"token"`` or ``"group"`` (``group_size`` columns, a multiple of
    128 dividing the last dim). ``scale`` given: static; else dynamic (``scale_ub`` per token only).
    Scale shapes as in ``ops/quantization.py``. ``block_rows`` overrides the rows per grid step (a
    multiple of 32, the float8 sublane tile); tests use it to force several blocks and a ragged one.
    """
    if granularity not in ("tensor", "token", "group"):
        raise ValueError(f"quant_fp8: granularity {granularity!r} is not 'tensor', 'token' or 'group'")
    lead, hidden = x.shape[:-1], x.shape[-1]
    if granularity == "tensor":
        if scale is None:
            amax = jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)  # phase 1 (0 for no tokens)
            scale = _dynamic_scale(amax)
        scale = scale.astype(jnp.float32).reshape(1, 1)
        x_q = _build_static(True, hidden, interpret, block_rows)(x, scale)  # phase 2
        return x_q, scale.reshape(1)
    width = hidden if granularity == "token" else group_size
    if scale is None:
        call = _build_dynamic(width, scale_ub is not None, interpret, block_rows)
        return call(x) if scale_ub is None else call(x, scale_ub.astype(jnp.float32).reshape(1, 1))
    scale = scale.astype(jnp.float32).reshape(*lead, hidden // width)
    return _build_static(False, width, interpret, block_rows)(x, scale), scale


def _blocking(rows: int, width: int, dtype, block_rows: int | None) -> int:
    """Rows per grid step: x, x_q double-buffered plus float32 temporaries, in float8 tiles of 32."""
    per_elem = 2 * (dtype.itemsize + 1) + 12
    br = row_blocks(rows, width, FP8, bytes_per_elem=per_elem).block_rows
    return br if block_rows is None else min(block_rows, rows)


@functools.lru_cache(maxsize=None)
def _build_dynamic(width: int, has_ub: bool, interpret, block_rows: int | None):
    """Dynamic per-token (width = hidden) / per-group (width = g) quantisation, batched as rows."""
    kernel = functools.partial(_dynamic_kernel, has_ub=has_ub)

    def call(x, *ub):
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        n_groups = hidden // width
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            return jnp.zeros(shape, FP8), jnp.zeros((*shape[:-1], n_groups), jnp.float32)
        br = _blocking(rows, width, dtype, block_rows)
        in_specs = [pl.BlockSpec((br, width), lambda i, j: (i, j))]
        if has_ub:
            in_specs.append(pl.BlockSpec(memory_space=_SMEM))
        q, s = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(rows, br), n_groups),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((br, width), lambda i, j: (i, j)),
                pl.BlockSpec((None, br, 1), lambda i, j: (j, i, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((rows, hidden), FP8),
                jax.ShapeDtypeStruct((n_groups, rows, 1), jnp.float32),
            ],
            compiler_params=compiler_params(2),
            cost_estimate=quant_fp8_cost(rows, hidden, dtype.itemsize, rows * n_groups),
            interpret=interpret,
            name="dualop_quant_fp8_dynamic",
        )(x2, *ub)
        scale = s.reshape(n_groups, rows).T.reshape(*shape[:-1], n_groups)
        return q.reshape(shape), scale

    # x is row-wise; scale_ub is a per-call parameter
    return rowwise_batching(call, n_rowwise=1)


@functools.lru_cache(maxsize=None)
def _build_static(scalar: bool, width: int, interpret, block_rows: int | None):
    """Quantise with a given scale: ``scalar`` (1, 1) per tensor, else one per (row, group)."""
    kernel = functools.partial(_static_kernel, scalar=scalar)

    def call(x, scale):
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        n_groups = hidden // width
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            return jnp.zeros(shape, FP8)
        br = _blocking(rows, width, dtype, block_rows)
        if scalar:
            s_spec, s_in = pl.BlockSpec(memory_space=_SMEM), scale
        else:  # (rows, groups) -> (groups, rows, 1): each step reads its own (block rows, 1) column
            s_spec = pl.BlockSpec((None, br, 1), lambda i, j: (j, i, 0))
            s_in = scale.reshape(rows, n_groups).T.reshape(n_groups, rows, 1)
        q = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(rows, br), n_groups),
            in_specs=[pl.BlockSpec((br, width), lambda i, j: (i, j)), s_spec],
            out_specs=pl.BlockSpec((br, width), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((rows, hidden), FP8),
            compiler_params=compiler_params(2),
            cost_estimate=quant_fp8_cost(rows, hidden, dtype.itemsize, 1 if scalar else rows * n_groups),
            interpret=interpret,
            name="dualop_quant_fp8_static",
        )(x2, s_in)
        return q.reshape(shape)

    # per tensor: the (1, 1) scale is a parameter (a batched one is mapped); else it is row-wise
    return rowwise_batching(call, n_rowwise=1 if scalar else 2)
