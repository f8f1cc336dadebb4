"""FP8 (float8_e4m3fn) input quantisation as Pallas TPU kernels: the ``quant_fp8`` op's fast path.

Contract (``ops/quantization.py``): ``scale = max(amax / 448, 1/(448*512))`` per tensor / row /
group of ``g`` columns (``amax`` optionally capped by ``scale_ub`` for per-token), or a given
static scale; ``x_q = fp8(clip(x * (1 / scale), -448, 448))`` in float32, rounded to nearest even.
``amax / 448`` is the correctly rounded quotient (``div_by_fp8_max``; XLA would otherwise multiply
by a rounded reciprocal), so results equal the other backends' bit for bit.
``quant_fp8_reference`` beside the kernels is the plain-jnp statement of it. Every amax is
``abs_max``: NaN when a NaN is among its elements, as torch's amax (XLA's max reduction may skip it).

Layout: ``x`` is viewed as (rows, hidden) and tiled as (row block, column block), sized from the
TPU generation's VMEM (``common.block_budget``); no block needs to span a row:

- per tensor: two phases. Phase 1 (dynamic only) is ``abs_max(x)``, plain XLA reductions (max |x|
  and a NaN flag, fused: x is read once); phase 2 quantises elementwise with that (1, 1) SMEM scalar, in
  column blocks of 128-lane multiples when a row is wide (Pallas masks the ragged edge block).
- per group: each block holds ``k`` whole groups (lane-aligned static slices, ``k`` up to 16), so
  narrow groups still make wide blocks; per step the groups' row maxima, scales and quantised
  values. Scales move as a (groups, rows, 1) array, one (k, row block, 1) block per step, so every
  step owns its output block; the wrapper transposes that small array to (rows, groups).
- per token: one pass over whole-row blocks (the group kernel with one group per row) when a
  sublane tile of rows fits the default scoped VMEM; wider rows take two passes over column blocks:
  a running per-row amax (the column axis sequential, the (row block, 1) maxima resident), then the
  static per-row quantisation.
- static: the given scale as the SMEM scalar, (row block, 1) columns, or the group layout above.

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
from dualop.kernels.pallas.common import (
    block_budget,
    block_vmem_bytes,
    compiler_params,
    cost_estimate,
    row_blocks,
    rowwise_batching,
    sublane_tile,
    to_rows,
    tpu_jit,
    vmem_spec,
)

__all__ = ["quant_fp8", "quant_fp8_reference", "quant_fp8_cost", "round_to_e4m3", "div_by_fp8_max", "abs_max", "FP8_MAX",
           "MIN_SCALE"]

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


def abs_max(x: jax.Array, axis=None, keepdims: bool = False, **initial) -> jax.Array:
    """``max(|x|)`` over ``axis``, NaN if any element there is NaN, as torch's ``amax`` (and so the
    native body and the Triton kernel) gives. XLA's own max reduction may skip a NaN (its CPU
    backend does for vectorised float32 reductions): a NaN count, reduced separately, decides."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims, **initial)
    seen = jnp.max((x != x).astype(jnp.float32), axis=axis, keepdims=keepdims, **initial)
    return jnp.where(seen > 0, jnp.float32(jnp.nan), amax)


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
            amax = abs_max(xg, initial=0.0).reshape(1)
        else:
            amax = abs_max(xg, axis=-1)
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


def _dynamic_kernel(*refs, has_ub: bool, group: int, groups_per_block: int):
    """One (row block, column block) of whole groups (one group per token): each group's per-row
    amax, scale and quantised values. Groups are lane-aligned static slices of the block."""
    if has_ub:
        x_ref, ub_ref, q_ref, s_ref = refs
    else:
        x_ref, q_ref, s_ref = refs
    for k in range(groups_per_block):
        cols = slice(k * group, (k + 1) * group)
        x = x_ref[:, cols].astype(jnp.float32)
        amax = abs_max(x, axis=-1, keepdims=True)  # (block rows, 1)
        if has_ub:
            amax = jnp.minimum(amax, ub_ref[0, 0])
        scale = _dynamic_scale(amax)
        q_ref[:, cols] = _quantise(x, scale)
        s_ref[k] = scale


def _row_amax_kernel(x_ref, amax_ref, *, hidden: int, block_cols: int):
    """Running per-row amax over the column blocks of wide rows (the column axis is sequential:
    the (block rows, 1) output stays resident while the steps fold their block maxima into it).
    The ragged last column block's padding is masked to 0 (|x| >= 0, so it never wins)."""
    j = pl.program_id(1)
    a = x_ref[...].astype(jnp.float32)
    if hidden % block_cols:
        col = j * block_cols + jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
        a = jnp.where(col < hidden, a, 0.0)
    m = abs_max(a, axis=-1, keepdims=True)

    @pl.when(j == 0)
    def _first():
        amax_ref[...] = m

    @pl.when(j > 0)
    def _fold():
        amax_ref[...] = jnp.maximum(amax_ref[...], m)


def _static_kernel(x_ref, s_ref, q_ref, *, mode: str, group: int, groups_per_block: int):
    """Quantise one block with given scales: an SMEM scalar (``tensor``), one per row of the
    block (``row``), or one per row of each of the block's groups (``group``)."""
    if mode == "tensor":
        q_ref[...] = _quantise(x_ref[...].astype(jnp.float32), s_ref[0, 0])
    elif mode == "row":
        q_ref[...] = _quantise(x_ref[...].astype(jnp.float32), s_ref[...])
    else:
        for k in range(groups_per_block):
            cols = slice(k * group, (k + 1) * group)
            q_ref[:, cols] = _quantise(x_ref[:, cols].astype(jnp.float32), s_ref[k])


# ---------------------------------------------------------------------------------- tiling

# VMEM bytes per element of a block beyond its I/O: the float32 value, |x| or the scaled value,
# and the rounding's integer temporaries.
_TEMP_BYTES = 12
# Groups one grid step quantises at most (a static loop over lane-aligned slices).
_MAX_GROUPS_PER_BLOCK = 16


def _per_elem(dtype) -> int:
    """x and x_q double-buffered plus the float32 temporaries."""
    return 2 * (jnp.dtype(dtype).itemsize + 1) + _TEMP_BYTES


def _row_block(rows: int, cols: int, dtype, block_rows: int | None) -> int:
    """Rows per grid step for blocks ``cols`` wide, in float8 sublane tiles (32 rows)."""
    br = row_blocks(rows, cols, FP8, bytes_per_elem=_per_elem(dtype)).block_rows
    return br if block_rows is None else min(block_rows, rows)


def _whole_rows_fit(hidden: int, dtype) -> bool:
    """Whether one sublane tile of whole rows fits the default scoped VMEM with its margin (then
    per-token quantisation is one pass; wider rows are tiled in columns)."""
    return 2 * block_vmem_bytes(sublane_tile(FP8), hidden, FP8, _per_elem(dtype)) <= vmem_spec().scoped_default


def _column_block(hidden: int, dtype, block_cols: int | None) -> int:
    """Columns per grid step for an elementwise pass: the whole row when a sublane tile of it fits
    the block budget, else the widest multiple of 128 lanes that does."""
    if block_cols is not None:
        return min(block_cols, hidden)
    per_row_tile = sublane_tile(FP8) * _per_elem(dtype)
    if hidden * per_row_tile <= block_budget():
        return hidden
    return max(128, block_budget() // per_row_tile // 128 * 128)


def _groups_per_block(group: int, n_groups: int, dtype, block_cols: int | None) -> int:
    """Whole groups per grid step: as many as fit the block budget, at most ``_MAX_GROUPS_PER_BLOCK``."""
    if block_cols is not None:
        return max(1, min(block_cols // group, n_groups))
    fit = block_budget() // (sublane_tile(FP8) * group * _per_elem(dtype))
    return max(1, min(fit, n_groups, _MAX_GROUPS_PER_BLOCK))


# ---------------------------------------------------------------------------------- entry


@tpu_jit(static_argnames=("granularity", "group_size", "interpret", "block_rows", "block_cols"))
def quant_fp8(
    x: jax.Array,
    scale: jax.Array | None = None,
    scale_ub: jax.Array | None = None,
    *,
    granularity: str = "tensor",
    group_size: int = 0,
    interpret=False,
    block_rows: int | None = None,
    block_cols: int | None = None,
):
    """Quantise ``x`` (any leading shape) to float8_e4m3fn; returns ``(x_q, scale)``.

    ``granularity``: ``"tensor"``, ``"token"`` or ``"group"`` (``group_size`` columns, a multiple of
    128 dividing the last dim). ``scale`` given: static; else dynamic (``scale_ub`` per token only).
    Scale shapes as in ``ops/quantization.py``. ``block_rows`` (a multiple of 32, the float8 sublane
    tile) and ``block_cols`` (a multiple of 128; for groups, a multiple of the group) override the
    VMEM-budget tiling; tests use them to force several blocks, ragged ones, and the column-tiled
    per-token path.
    """
    if granularity not in ("tensor", "token", "group"):
        raise ValueError(f"quant_fp8: granularity {granularity!r} is not 'tensor', 'token' or 'group'")
    if block_cols is not None and block_cols % 128:
        raise ValueError(f"quant_fp8: block_cols must be a multiple of 128, got {block_cols}")
    lead, hidden = x.shape[:-1], x.shape[-1]
    if granularity == "tensor":
        if scale is None:
            amax = abs_max(x.astype(jnp.float32), initial=0.0)  # phase 1 (0 for no tokens)
            scale = _dynamic_scale(amax)
        scale = scale.astype(jnp.float32).reshape(1, 1)
        x_q = _build_static("tensor", 0, interpret, block_rows, block_cols)(x, scale)  # phase 2
        return x_q, scale.reshape(1)
    ub = None if scale_ub is None else scale_ub.astype(jnp.float32).reshape(1, 1)
    if granularity == "group":
        if scale is None:
            call = _build_dynamic(group_size, ub is not None, interpret, block_rows, block_cols)
            return call(x) if ub is None else call(x, ub)
        scale = scale.astype(jnp.float32).reshape(*lead, hidden // group_size)
        return _build_static("group", group_size, interpret, block_rows, block_cols)(x, scale), scale
    # per token
    if scale is None:
        if block_cols is None and _whole_rows_fit(hidden, x.dtype):
            call = _build_dynamic(hidden, ub is not None, interpret, block_rows, None)
            return call(x) if ub is None else call(x, ub)
        amax = _build_row_amax(interpret, block_rows, block_cols)(x)  # wide rows: two passes
        if ub is not None:
            amax = jnp.minimum(amax, ub.reshape(()))
        scale = _dynamic_scale(amax)
    scale = scale.astype(jnp.float32).reshape(*lead, 1)
    return _build_static("row", 0, interpret, block_rows, block_cols)(x, scale), scale


@functools.lru_cache(maxsize=None)
def _build_dynamic(group: int, has_ub: bool, interpret, block_rows: int | None, block_cols: int | None):
    """Dynamic per-token (group = hidden) / per-group quantisation in one pass, batched as rows.
    Scales come out as (groups, rows, 1), each step writing its groups' (block rows, 1) columns."""

    def call(x, *ub):
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        n_groups = hidden // group
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            return jnp.zeros(shape, FP8), jnp.zeros((*shape[:-1], n_groups), jnp.float32)
        k = _groups_per_block(group, n_groups, dtype, block_cols)
        bc = k * group
        br = _row_block(rows, bc, dtype, block_rows)
        in_specs = [pl.BlockSpec((br, bc), lambda i, j: (i, j))]
        if has_ub:
            in_specs.append(pl.BlockSpec(memory_space=_SMEM))
        q, s = pl.pallas_call(
            functools.partial(_dynamic_kernel, has_ub=has_ub, group=group, groups_per_block=k),
            grid=(pl.cdiv(rows, br), pl.cdiv(n_groups, k)),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                pl.BlockSpec((k, br, 1), lambda i, j: (j, i, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((rows, hidden), FP8),
                jax.ShapeDtypeStruct((n_groups, rows, 1), jnp.float32),
            ],
            compiler_params=compiler_params(2, vmem_bytes=block_vmem_bytes(br, bc, FP8, _per_elem(dtype))),
            cost_estimate=quant_fp8_cost(rows, hidden, dtype.itemsize, rows * n_groups),
            interpret=interpret,
            name="dualop_quant_fp8_dynamic",
        )(x2, *ub)
        scale = s.reshape(n_groups, rows).T.reshape(*shape[:-1], n_groups)
        return q.reshape(shape), scale

    # x is row-wise; scale_ub is a per-call parameter
    return rowwise_batching(call, n_rowwise=1)


@functools.lru_cache(maxsize=None)
def _build_row_amax(interpret, block_rows: int | None, block_cols: int | None):
    """Per-row amax of rows too wide for one block: column blocks folded into a running maximum."""

    def call(x):
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            return jnp.zeros((*shape[:-1], 1), jnp.float32)
        bc = _column_block(hidden, dtype, block_cols)
        br = _row_block(rows, bc, dtype, block_rows)
        amax = pl.pallas_call(
            functools.partial(_row_amax_kernel, hidden=hidden, block_cols=bc),
            grid=(pl.cdiv(rows, br), pl.cdiv(hidden, bc)),
            in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((br, 1), lambda i, j: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((rows, 1), jnp.float32),
            compiler_params=compiler_params(
                2, vmem_bytes=block_vmem_bytes(br, bc, FP8, _per_elem(dtype)), semantics=("parallel", "arbitrary")
            ),
            cost_estimate=cost_estimate(cost_model.row_amax_cost(rows, hidden, dtype.itemsize)),
            interpret=interpret,
            name="dualop_quant_fp8_row_amax",
        )(x2)
        return amax.reshape(*shape[:-1], 1)

    return rowwise_batching(call, n_rowwise=1)


@functools.lru_cache(maxsize=None)
def _build_static(mode: str, group: int, interpret, block_rows: int | None, block_cols: int | None):
    """Quantise with given scales: ``tensor`` a (1, 1) scalar, ``row`` (rows, 1) per token (its rows
    tiled in columns when wide), ``group`` (rows, groups) per group of ``group`` columns."""
    def call(x, scale):
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            return jnp.zeros(shape, FP8)
        if mode == "group":
            n_groups = hidden // group
            k = _groups_per_block(group, n_groups, dtype, block_cols)
            bc = k * group
        else:
            k, bc = 1, _column_block(hidden, dtype, block_cols)
        br = _row_block(rows, bc, dtype, block_rows)
        if mode == "tensor":
            s_spec, s_in = pl.BlockSpec(memory_space=_SMEM), scale
        elif mode == "row":
            s_spec, s_in = pl.BlockSpec((br, 1), lambda i, j: (i, 0)), scale.reshape(rows, 1)
        else:  # (rows, groups) -> (groups, rows, 1): each step reads its groups' (block rows, 1) columns
            s_spec = pl.BlockSpec((k, br, 1), lambda i, j: (j, i, 0))
            s_in = scale.reshape(rows, n_groups).T.reshape(n_groups, rows, 1)
        q = pl.pallas_call(
            functools.partial(_static_kernel, mode=mode, group=group, groups_per_block=k),
            grid=(pl.cdiv(rows, br), pl.cdiv(hidden, bc)),
            in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j)), s_spec],
            out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((rows, hidden), FP8),
            compiler_params=compiler_params(2, vmem_bytes=block_vmem_bytes(br, bc, FP8, _per_elem(dtype))),
            cost_estimate=quant_fp8_cost(rows, hidden, dtype.itemsize, 1 if mode == "tensor" else s_in.size),
            interpret=interpret,
            name="dualop_quant_fp8_static",
        )(x2, s_in)
        return q.reshape(shape)

    # per tensor: the (1, 1) scale is a parameter (a batched one is mapped); else it is row-wise
    return rowwise_batching(call, n_rowwise=1 if mode == "tensor" else 2)
