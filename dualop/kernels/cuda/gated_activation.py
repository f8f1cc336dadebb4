"""Gated activations ``act(x[..., :d]) * x[..., d:]`` as one Triton kernel family.

Twin of ``kernels/pallas/gated_activation.py``: the activation is a compile-time constant, math in
float32, result cast to x's dtype. Grid: (row, column block); each program reads a block of the
gate half and the matching block of the up half of one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16, rows_view

__all__ = ["gated_activation", "ACTIVATION_IDS"]

ACTIVATION_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_BLOCK = 1024


@triton.jit
def _erf_gelu(g):
    return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))


@triton.jit
def _tanh_gelu(g):
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    # tanh(z) = 2*sigmoid(2z) - 1, exact in float32 and available on every Triton backend
    return 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))


@triton.jit
def _gated_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, d, ACT: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = _erf_gelu(g)
    else:
        a = _tanh_gelu(g)
    tl.store(out_ptr + row * out_row_stride + cols, cast_out(a * u, out_ptr, EXACT_BF16), mask=mask)


def gated_activation(x: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """``act(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``."""
    d = x.shape[-1] // 2
    x2 = rows_view(x)
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows > 0 and d > 0:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _gated_kernel[(rows, triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d,
            ACT=ACTIVATION_IDS[activation], BLOCK=block, EXACT_BF16=needs_exact_bf16(x.dtype), num_warps=4,
        )
    return out.reshape(*x.shape[:-1], d)
