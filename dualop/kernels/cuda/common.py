"""Pieces every dualop Triton kernel shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import interpreting

__all__ = ["cast_out", "needs_exact_bf16", "rows_view"]


@triton.jit
def _round_to_bf16(y):
    """Round float32 ``y`` to the nearest bfloat16 (ties to even), kept in float32."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def cast_out(y, ptr, EXACT_BF16: tl.constexpr):
    """Cast float32 ``y`` to ``ptr``'s element type for a store.

    GPUs round float32 -> bfloat16 to nearest even; Triton's CPU interpreter truncates. With
    ``EXACT_BF16`` (set only when interpreting into a bfloat16 output) the rounding is done here
    first, so the interpreter produces the bits a GPU would.
    """
    if EXACT_BF16:
        y = _round_to_bf16(y)
    return y.to(ptr.dtype.element_ty)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32. ``UPCAST`` (interpreting only) multiplies float32 copies:
    Triton's interpreter reads bfloat16 dot operands as raw integers (seen in 3.5 and 3.9); the
    upcast is exact, so products and sums are the ones a GPU's float32 accumulation makes."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _cast(x, dtype: tl.constexpr, EXACT_BF16: tl.constexpr):
    """float32 ``x`` to ``dtype``, rounding to nearest even in the interpreter too (``cast_out``)."""
    if EXACT_BF16:
        x = _round_to_bf16(x)
    return x.to(dtype)


def needs_exact_bf16(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreting()


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as 2-D (rows, last dim) with a unit last stride (a copy only if it had none)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()
