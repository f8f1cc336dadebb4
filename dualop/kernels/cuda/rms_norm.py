"""RMSNorm (optionally fused with a residual add) as a Triton kernel: one program per row.

Same contract as ``kernels/pallas/rms_norm.py`` (a ``NormSpec`` picks the variant): float32
statistics, ``cast(x*rsqrt(mean(x²)+eps))`` then times weight; with a residual, normalises
x + residual and returns that sum (cast) too. Rows
up to ``MAX_SINGLE_PASS`` wide are held in registers in one pass; wider rows take two passes over
memory (sum of squares, then normalise), recomputing x + residual from the inputs so the statistic
is the float32 sum, never a rounded copy. The chunk count is a compile-time constant (one hidden
size per model); Triton 3.5's interpreter cannot loop to a runtime bound under numpy 2.4.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16, rows_view
from dualop.kernels.norm_math import NormSpec

__all__ = ["rms_norm", "MAX_SINGLE_PASS"]

MAX_SINGLE_PASS = 8192


@triton.jit
def _normalise_store(x, inv_rms, w_row, o_row, cols, mask, out_ptr,
                     HAS_WEIGHT: tl.constexpr, WEIGHT_IN_F32: tl.constexpr, weight_offset,
                     EXACT_BF16: tl.constexpr):
    y = x * inv_rms
    if HAS_WEIGHT:
        w = tl.load(w_row + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
        if WEIGHT_IN_F32:
            y = y * w
        else:
            y = cast_out(y, out_ptr, EXACT_BF16).to(tl.float32) * w
    tl.store(o_row + cols, cast_out(y, out_ptr, EXACT_BF16), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, r_ptr, out_ptr, res_out_ptr,
    x_row_stride, r_row_stride, out_row_stride,
    hidden, var_size, eps, weight_offset,
    HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WEIGHT_IN_F32: tl.constexpr,
    BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    r_row = r_ptr + row * r_row_stride
    o_row = out_ptr + row * out_row_stride
    ro_row = res_out_ptr + row * out_row_stride
    if N_CHUNKS == 1:  # the whole row in registers: one pass
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(ro_row + cols, cast_out(x, res_out_ptr, EXACT_BF16), mask=mask)
        xv = tl.where(cols < var_size, x, 0.0)
        inv_rms = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / var_size + eps)
        _normalise_store(x, inv_rms, w_ptr, o_row, cols, mask, out_ptr,
                         HAS_WEIGHT, WEIGHT_IN_F32, weight_offset, EXACT_BF16)
    else:  # two passes over memory, recomputing x + residual from the inputs
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(N_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(ro_row + cols, cast_out(x, res_out_ptr, EXACT_BF16), mask=mask)
            xv = tl.where(cols < var_size, x, 0.0)
            acc += xv * xv
        inv_rms = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / var_size + eps)
        for chunk in range(N_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            _normalise_store(x, inv_rms, w_ptr, o_row, cols, mask, out_ptr,
                             HAS_WEIGHT, WEIGHT_IN_F32, weight_offset, EXACT_BF16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
             spec: NormSpec = NormSpec()):
    """RMSNorm over the last dim; returns ``out`` or ``(out, new_residual)`` (new tensors)."""
    shape, hidden = x.shape, x.shape[-1]
    x2 = rows_view(x)
    rows = x2.shape[0]
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows > 0 and hidden > 0:
        r2 = rows_view(residual) if residual is not None else x2
        w = weight.contiguous() if weight is not None else x2
        block = triton.next_power_of_2(hidden) if hidden <= MAX_SINGLE_PASS else 4096
        _rms_norm_kernel[(rows,)](
            x2, w, r2, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0),
            hidden, spec.var_size or hidden, float(spec.eps), float(spec.weight_offset),
            HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None, WEIGHT_IN_F32=spec.weight_in_f32,
            BLOCK=block, N_CHUNKS=triton.cdiv(hidden, block), EXACT_BF16=needs_exact_bf16(x.dtype),
            num_warps=min(max(block // 256, 1), 16),
        )
    out = out.reshape(shape)
    return (out, res_out.reshape(shape)) if residual is not None else out
