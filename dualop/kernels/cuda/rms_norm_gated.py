"""Gated group RMSNorm (RMSNormGated) as a Triton kernel: one program per (row, group).

Same contract as ``kernels/pallas/rms_norm_gated.py``: in float32, x*silu(z) first unless
``norm_before_gate``; each group of ``group_size`` features scaled by rsqrt(mean(x**2) + eps);
times weight; times silu(z) last if ``norm_before_gate``; one cast, through ``cast_out``. With
``CAST_BEFORE_WEIGHT`` (the Mamba-2 mixers' ``weight * x.to(dtype)``) the normalised value is cast
to the output type before the weight multiplies it.

Groups up to ``MAX_SINGLE_PASS`` features are held in registers in one pass; wider groups take two
passes over memory (sum of squares, then normalise), recomputing the gated input from x and z so
the statistic is the float32 value, never a rounded copy. The chunk count is a compile-time
constant (Triton 3.5's interpreter cannot loop to a runtime bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16, rows_view

__all__ = ["rms_norm_gated", "MAX_SINGLE_PASS", "CHUNK"]

MAX_SINGLE_PASS = 8192  # widest group normalised from registers in one pass
CHUNK = 4096  # columns per step of the two-pass loop


@triton.jit
def _gated_input(x_base, z_base, cols, mask, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """x (times silu(z) when the gate comes before the norm) and the gate, in float32."""
    x = tl.load(x_base + cols, mask=mask, other=0.0).to(tl.float32)
    gate = x  # placeholder when there is no gate; never used then
    if HAS_Z:
        z = tl.load(z_base + cols, mask=mask, other=0.0).to(tl.float32)
        gate = z * tl.sigmoid(z)
        if not NORM_BEFORE_GATE:
            x = x * gate
    return x, gate


@triton.jit
def _weighted(y, w, out_ptr, CAST_BEFORE_WEIGHT: tl.constexpr, EXACT_BF16: tl.constexpr):
    """``y * w`` in float32, with ``y`` first rounded to the output type when asked."""
    if CAST_BEFORE_WEIGHT:
        y = cast_out(y, out_ptr, EXACT_BF16).to(tl.float32)
    return y * w


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, w_ptr, z_ptr, out_ptr,
    x_row_stride, z_row_stride, out_row_stride,
    group_size, eps,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr,
    EXACT_BF16: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * group_size
    x_base = x_ptr + row * x_row_stride + start
    z_base = z_ptr + row * z_row_stride + start
    o_base = out_ptr + row * out_row_stride + start
    w_base = w_ptr + start
    if N_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < group_size
        x, gate = _gated_input(x_base, z_base, cols, mask, HAS_Z, NORM_BEFORE_GATE)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / group_size + eps)
        w = tl.load(w_base + cols, mask=mask, other=0.0).to(tl.float32)
        y = _weighted(x * inv_rms, w, out_ptr, CAST_BEFORE_WEIGHT, EXACT_BF16)
        if HAS_Z and NORM_BEFORE_GATE:
            y = y * gate
        tl.store(o_base + cols, cast_out(y, out_ptr, EXACT_BF16), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(N_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < group_size
            x, gate = _gated_input(x_base, z_base, cols, mask, HAS_Z, NORM_BEFORE_GATE)
            acc += x * x
        inv_rms = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / group_size + eps)
        for chunk in range(N_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < group_size
            x, gate = _gated_input(x_base, z_base, cols, mask, HAS_Z, NORM_BEFORE_GATE)
            w = tl.load(w_base + cols, mask=mask, other=0.0).to(tl.float32)
            y = _weighted(x * inv_rms, w, out_ptr, CAST_BEFORE_WEIGHT, EXACT_BF16)
            if HAS_Z and NORM_BEFORE_GATE:
                y = y * gate
            tl.store(o_base + cols, cast_out(y, out_ptr, EXACT_BF16), mask=mask)


def rms_norm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    cast_before_weight: bool = False,
) -> torch.Tensor:
    """Gated group RMSNorm over the last dim of ``x``; returns a new tensor shaped like ``x``."""
    shape, hidden = x.shape, x.shape[-1]
    group = hidden if group_size is None else int(group_size)
    if group <= 0 or hidden % group:
        raise ValueError(f"rms_norm_gated: group_size={group_size} must divide the last dim {hidden}")
    x2 = rows_view(x)
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows > 0 and hidden > 0:
        z2 = rows_view(z) if z is not None else x2
        w = weight.contiguous()
        single = group <= MAX_SINGLE_PASS
        block = triton.next_power_of_2(group) if single else CHUNK
        _rms_norm_gated_kernel[(rows, hidden // group)](
            x2, w, z2, out,
            x2.stride(0), z2.stride(0), out.stride(0),
            group, float(eps),
            HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
            BLOCK=block, N_CHUNKS=triton.cdiv(group, block), EXACT_BF16=needs_exact_bf16(x.dtype),
            CAST_BEFORE_WEIGHT=bool(cast_before_weight),
            num_warps=min(max(block // 256, 1), 16),
        )
    return out.reshape(shape)
