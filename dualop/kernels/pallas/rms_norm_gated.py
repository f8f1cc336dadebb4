"""Gated group RMSNorm (RMSNormGated) as a row-wise Pallas TPU kernel.

In float32, cast once at the end: with a gate ``z`` and not ``norm_before_gate``, x = x*silu(z);
then every group of ``group_size`` consecutive features is scaled by rsqrt(mean(x**2) + eps);
then times weight; with a gate and ``norm_before_gate``, times silu(z).
``rms_norm_gated_reference`` beside the kernel is the plain-jnp statement of it.

Each grid step holds ``block_rows`` whole rows in VMEM (the hidden dim is never tiled, so any
hidden size is legal: a block spanning the whole last dim is exempt from the 128-lane rule); the
row dimension is ``parallel``. Groups are resolved inside the kernel, from static shapes:

- one group: a plain lane reduction per row;
- groups on the 128-lane grid: a static loop over lane-aligned slices, one reduction each;
- other groups (e.g. 40 or 100 features): a static loop over the groups with iota masks over
  the full row, so no lane slice is ever unaligned (ngroups cheap VPU passes over VMEM data).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualop.kernels import cost as cost_model
from dualop.kernels.pallas.common import compiler_params, cost_estimate, row_blocks, rowwise_batching, to_rows

__all__ = ["rms_norm_gated", "rms_norm_gated_reference", "rms_norm_gated_cost"]

_LANES = 128


def rms_norm_gated_reference(x, weight, z=None, *, eps: float = 1e-5, group_size: int | None = None,
                             norm_before_gate: bool = False):
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
    h = h.reshape(shape) * weight.astype(jnp.float32)
    if gate is not None and norm_before_gate:
        h = h * gate
    return h.astype(x.dtype)


def rms_norm_gated_cost(rows: int, hidden: int, group_size: int, itemsize: int, weight_itemsize: int,
                        has_z: bool) -> pl.CostEstimate:
    """Bytes and flops one call must move and do (``kernels/cost.py``), as a ``pl.CostEstimate``."""
    return cost_estimate(cost_model.rms_norm_gated_cost(rows, hidden, group_size, itemsize, weight_itemsize, has_z))


def _inv_rms(h, *, eps: float, group: int):
    """Per-element rsqrt(mean(h**2 over its group) + eps) for a (rows, hidden) float32 block,
    or a (rows, 1) column when there is one group."""
    hidden = h.shape[-1]
    sq = h * h
    if group == hidden:
        return jax.lax.rsqrt(jnp.mean(sq, axis=-1, keepdims=True) + eps)
    ngroups = hidden // group
    if group % _LANES == 0:
        parts = [
            jnp.broadcast_to(
                jax.lax.rsqrt(jnp.mean(sq[:, k * group:(k + 1) * group], axis=-1, keepdims=True) + eps),
                (h.shape[0], group),
            )
            for k in range(ngroups)
        ]
        return jnp.concatenate(parts, axis=-1)
    col = jax.lax.broadcasted_iota(jnp.int32, h.shape, 1)
    inv = jnp.zeros_like(h)
    for k in range(ngroups):
        in_group = (col >= k * group) & (col < (k + 1) * group)
        ss = jnp.sum(jnp.where(in_group, sq, 0.0), axis=-1, keepdims=True)
        inv = jnp.where(in_group, jax.lax.rsqrt(ss / group + eps), inv)
    return inv


def _kernel(*refs, eps: float, group: int, has_z: bool, norm_before_gate: bool):
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
    y = h * _inv_rms(h, eps=eps, group=group) * w_ref[...].astype(jnp.float32)
    if has_z and norm_before_gate:
        y = y * gate
    o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("eps", "group_size", "norm_before_gate", "interpret", "block_rows")
)
def rms_norm_gated(
    x: jax.Array,
    weight: jax.Array,
    z: jax.Array | None = None,
    *,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
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
    call = _build(float(eps), group, bool(norm_before_gate), interpret, block_rows, z is not None)
    return call(x, z, weight) if z is not None else call(x, weight)


@functools.lru_cache(maxsize=None)
def _build(eps: float, group: int, norm_before_gate: bool, interpret, block_rows: int | None, has_z: bool):
    kernel = functools.partial(_kernel, eps=eps, group=group, has_z=has_z, norm_before_gate=norm_before_gate)

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
        blocks = row_blocks(rows, hidden, dtype, bytes_per_elem=2 * n_io * dtype.itemsize + 16)
        br = blocks.block_rows if block_rows is None else min(block_rows, rows)
        row_spec = pl.BlockSpec((br, hidden), lambda i: (i, 0))
        in_specs, operands = [row_spec], [x2]
        if has_z:
            in_specs.append(row_spec)
            operands.append(to_rows(z))
        in_specs.append(pl.BlockSpec((1, hidden), lambda i: (0, 0)))
        operands.append(weight.reshape(1, hidden))
        out = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(rows, br),),
            in_specs=in_specs,
            out_specs=row_spec,
            out_shape=jax.ShapeDtypeStruct((rows, hidden), dtype),
            compiler_params=compiler_params(1),
            cost_estimate=rms_norm_gated_cost(rows, hidden, group, dtype.itemsize, weight.dtype.itemsize, has_z),
            interpret=interpret,
            name="dualop_rms_norm_gated",
        )(*operands)
        return out.reshape(shape)

    return rowwise_batching(call, n_rowwise=2 if has_z else 1)
