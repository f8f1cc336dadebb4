"""Gated group RMSNorm (RMSNormGated) as a row-wise Pallas TPU kernel.

In float32, cast once at the end: with a gate ``z`` and not ``norm_before_gate``, x = x*silu(z);
then every group of ``group_size`` consecutive features is scaled by rsqrt(mean(x**2) + eps);
then times weight; with a gate and ``norm_before_gate``, times silu(z). With
``cast_before_weight`` (the Mamba-2 mixers' norm: ``weight * x.to(dtype)``) the normalised value is
rounded to the output dtype before the weight multiplies it (then rounded again).
``rms_norm_gated_reference`` beside the kernel is the plain-jnp statement of it.

Layout: ``x`` (and ``z``) viewed as (rows, hidden), tiled as (row block, column block) from the TPU
generation's VMEM (``common.block_budget``). A column block holds whole groups and starts on the
128-lane grid, so every block is independent (rows and columns ``parallel``) and work and program
size are linear in hidden:

- one group: whole-row blocks, a plain lane reduction per row;
- groups on the 128-lane grid: blocks of up to 16 groups, a static loop over their lane-aligned
  slices, one reduction each;
- other groups (e.g. 40 or 100 features): blocks of ``lcm(group, 128) * t`` columns (or the whole
  row when narrower); the per-group sums of squares are one matmul of the squares with the block's
  (columns, groups) 0/1 membership matrix on the MXU, and one more matmul spreads each group's
  scale back over its columns (both at float32 precision; a 0/1 matrix makes the spread exact).
  A third, single-pass matmul counts each group's infs and NaNs, so a non-finite value only
  reaches its own group, as in the reference.
  A ragged last column block has its padding masked out of the sums.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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

__all__ = ["rms_norm_gated", "rms_norm_gated_reference", "rms_norm_gated_cost"]

_LANES = 128


def rms_norm_gated_reference(x, weight, z=None, *, eps: float = 1e-5, group_size: int | None = None,
                             norm_before_gate: bool = False, cast_before_weight: bool = False):
    """The plain jax.numpy statement of the kernel (used by tests and docs)."""
    shape = x.shape
    hidden = shape[-1]
    group = hidden if group_size is None else group_size
    h = x.astype(jnp.float32)
    gate = None
    if z is not None:
        gate = jax.nn.silu(z.astype(jnp.float32))
        if not norm_before_gate:
            h = h * gate
    h = h.reshape(*shape[:-1], hidden // group, group)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = h.reshape(shape)
    if cast_before_weight:
        h = h.astype(x.dtype).astype(jnp.float32)
    h = h * weight.astype(jnp.float32)
    if gate is not None and norm_before_gate:
        h = h * gate
    return h.astype(x.dtype)


def rms_norm_gated_cost(rows: int, hidden: int, group_size: int, itemsize: int, weight_itemsize: int,
                        has_z: bool) -> pl.CostEstimate:
    """Bytes and flops one call must move and do (``kernels/cost.py``), as a ``pl.CostEstimate``."""
    return cost_estimate(cost_model.rms_norm_gated_cost(rows, hidden, group_size, itemsize, weight_itemsize, has_z))


# Column blocks aim at this many lanes, and hold at most this many lane-aligned groups (a static
# loop) or this many unaligned groups (the membership matrix's width; one MXU pass).
_TARGET_COLS = 2048
_MAX_ALIGNED_GROUPS = 16
_MAX_MATMUL_GROUPS = 128
_NAN_MARK = float(2 ** 24)


def column_block(hidden: int, group: int) -> int:
    """Columns per grid step: whole groups starting on the 128-lane grid (a multiple of
    ``lcm(group, 128)``), or the whole row."""
    if group == hidden:
        return hidden
    unit = math.lcm(group, _LANES)
    max_groups = _MAX_ALIGNED_GROUPS if group % _LANES == 0 else _MAX_MATMUL_GROUPS
    t = max(1, min(_TARGET_COLS // unit, max_groups * group // unit))
    return hidden if unit * t >= hidden else unit * t


def _inv_rms(h, *, eps: float, group: int, hidden: int, col0):
    """rsqrt(mean(h**2 over its group) + eps) for a (rows, block cols) float32 block of whole
    groups starting at column ``col0``: a (rows, 1) column for one group, else per element."""
    rows, cols = h.shape
    sq = h * h
    if group == hidden:
        return jax.lax.rsqrt(jnp.mean(sq, axis=-1, keepdims=True) + eps)
    if group % _LANES == 0:
        parts = [
            jnp.broadcast_to(
                jax.lax.rsqrt(jnp.mean(sq[:, k * group:(k + 1) * group], axis=-1, keepdims=True) + eps),
                (rows, group),
            )
            for k in range(cols // group)
        ]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    n = cols // group
    if hidden % cols:  # a ragged last column block: its padding must not reach any group's sum
        col = col0 + jax.lax.broadcasted_iota(jnp.int32, sq.shape, 1)
        sq = jnp.where(col < hidden, sq, 0.0)
    # column c is in group k when k*group <= c < (k+1)*group (comparisons: an integer division
    # would lower through sign, which Mosaic resolves by asking the default device's TPU kind)
    c = jax.lax.broadcasted_iota(jnp.int32, (cols, n), 0)
    start = jax.lax.broadcasted_iota(jnp.int32, (cols, n), 1) * group
    member = ((c >= start) & (c < start + group)).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    # A matmul would carry one group's inf or NaN into every group (inf * 0 = NaN), so the sums
    # take the finite squares only, and a second matmul counts each group's non-finite squares:
    # an inf adds 1, a NaN adds 2**24 (both exact in bfloat16, so one default-precision pass; a
    # group has fewer than 2**24 columns, so the count of infs never reaches the NaN mark).
    finite = jnp.isfinite(sq)
    sums = jnp.dot(jnp.where(finite, sq, 0.0), member, precision=hi,
                   preferred_element_type=jnp.float32)  # (rows, groups)
    marks = jnp.where(finite, 0.0, jnp.where(jnp.isnan(sq), _NAN_MARK, 1.0))
    bad = jnp.dot(marks, member, preferred_element_type=jnp.float32)
    # as rsqrt(mean + eps) itself: a NaN in the group gives NaN, an inf (or an overflowing sum)
    # gives 0; NaN travels through the spread as -1 (every real scale is >= 0). A NaN sum of
    # finite squares can only be an overflow inside the MXU's split of float32: also 0.
    inv = jax.lax.rsqrt(sums * (1.0 / group) + eps)
    inv = jnp.where(bad >= _NAN_MARK, -1.0, jnp.where((bad > 0.0) | jnp.isnan(inv), 0.0, inv))
    spread = jax.lax.dot_general(inv, member, (((1,), (1,)), ((), ())), precision=hi,
                                 preferred_element_type=jnp.float32)
    return jnp.where(spread < 0.0, jnp.nan, spread)


def _kernel(*refs, eps: float, group: int, hidden: int, has_z: bool, norm_before_gate: bool,
            cast_before_weight: bool):
    if has_z:
        x_ref, z_ref, w_ref, o_ref = refs
    else:
        (x_ref, w_ref, o_ref), z_ref = refs, None
    h = x_ref[...].astype(jnp.float32)
    gate = None
    if has_z:
        zf = z_ref[...].astype(jnp.float32)
        gate = zf * jax.nn.sigmoid(zf)
        if not norm_before_gate:
            h = h * gate
    col0 = pl.program_id(1) * h.shape[-1]
    y = h * _inv_rms(h, eps=eps, group=group, hidden=hidden, col0=col0)
    if cast_before_weight:
        y = y.astype(o_ref.dtype).astype(jnp.float32)
    y = y * w_ref[...].astype(jnp.float32)
    if has_z and norm_before_gate:
        y = y * gate
    o_ref[...] = y.astype(o_ref.dtype)


@tpu_jit(static_argnames=("eps", "group_size", "norm_before_gate", "cast_before_weight", "interpret", "block_rows"))
def rms_norm_gated(
    x: jax.Array,
    weight: jax.Array,
    z: jax.Array | None = None,
    *,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    cast_before_weight: bool = False,
    interpret=False,
    block_rows: int | None = None,
):
    """Gated group RMSNorm over the last dim of ``x`` (any leading shape); ``z`` like ``x``.

    ``block_rows`` overrides the VMEM-budget choice of rows per grid step (a multiple of the
    sublane tile); tests use it to force several blocks and a ragged last one.
    """
    hidden = x.shape[-1]
    group = hidden if group_size is None else int(group_size)
    if group <= 0 or hidden % group:
        raise ValueError(f"rms_norm_gated: group_size={group_size} must divide the last dim {hidden}")
    call = _build(float(eps), group, bool(norm_before_gate), bool(cast_before_weight), interpret, block_rows,
                  z is not None)
    return call(x, z, weight) if z is not None else call(x, weight)


@functools.lru_cache(maxsize=None)
def _build(eps: float, group: int, norm_before_gate: bool, cast_before_weight: bool, interpret,
           block_rows: int | None, has_z: bool):
    def call(x, *rest):
        z = rest[0] if has_z else None
        weight = rest[-1]
        shape, dtype = x.shape, x.dtype
        hidden = shape[-1]
        x2 = to_rows(x)
        rows = x2.shape[0]
        if rows == 0:
            return jnp.zeros(shape, dtype)
        n_io = 3 if has_z else 2  # row arrays in VMEM: x, out (+ z)
        # double-buffered I/O plus float32 temporaries (x, gate, squares, scale)
        per_elem = 2 * n_io * dtype.itemsize + 16
        bc = column_block(hidden, group)
        blocks = row_blocks(rows, bc, dtype, bytes_per_elem=per_elem)
        br = blocks.block_rows if block_rows is None else min(block_rows, rows)
        vmem = block_vmem_bytes(br, bc, dtype, per_elem)
        if group != hidden and group % _LANES:
            vmem += 4 * bc * (bc // group)  # the membership matrix
        row_spec = pl.BlockSpec((br, bc), lambda i, j: (i, j))
        in_specs, operands = [row_spec], [x2]
        if has_z:
            in_specs.append(row_spec)
            operands.append(to_rows(z))
        in_specs.append(pl.BlockSpec((1, bc), lambda i, j: (0, j)))
        operands.append(weight.reshape(1, hidden))
        kernel = functools.partial(
            _kernel, eps=eps, group=group, hidden=hidden, has_z=has_z, norm_before_gate=norm_before_gate,
            cast_before_weight=cast_before_weight,
        )
        out = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(rows, br), pl.cdiv(hidden, bc)),
            in_specs=in_specs,
            out_specs=row_spec,
            out_shape=jax.ShapeDtypeStruct((rows, hidden), dtype),
            compiler_params=compiler_params(2, vmem_bytes=vmem),
            cost_estimate=rms_norm_gated_cost(rows, hidden, group, dtype.itemsize, weight.dtype.itemsize, has_z),
            interpret=interpret,
            name="dualop_rms_norm_gated",
        )(*operands)
        return out.reshape(shape)

    return rowwise_batching(call, n_rowwise=2 if has_z else 1)
