"""Gated activations ``act(gate) * up`` as one Triton kernel family.

Twin of ``kernels/pallas/gated_activation.py``, driven by the same ``GateSpec``: the activation,
the half it applies to and the layout are compile-time constants, the numeric parameters runtime
arguments; math in float32, the result cast to x's dtype. Grid: (row, column block). A gate that
needs row statistics (GeluAndMulSparse) runs one program per row: mean, then variance, then the
output, each a loop over column blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16, rows_view
from dualop.kernels.gate_math import GateSpec

__all__ = ["gated_activation", "ACTIVATION_IDS"]

ACTIVATION_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "fatrelu": 3, "swigluoai": 4, "silu_clamp": 5, "swiglustep": 6,
                  "situ": 7}
_BLOCK = 1024


@triton.jit
def _min_nan(a, b):
    # NaN propagates as in the native body (torch.clamp / jnp.minimum); Triton's default keeps the other operand
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _clip_nan(a, limit):
    return _min_nan(tl.maximum(a, -limit, propagate_nan=tl.PropagateNan.ALL), limit)


@triton.jit
def _tanh(z):
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0  # available on every Triton backend


@triton.jit
def _gate(g, u, ACT: tl.constexpr, threshold, alpha, limit, beta, linear_beta):
    """act(g) * u in float32 for the activation id ACT (gate_math.apply_gate)."""
    if ACT == 0:
        out = g * tl.sigmoid(g) * u
    elif ACT == 1:
        out = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * u
    elif ACT == 2:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # tanh(z) = 2*sigmoid(2z) - 1: available on every Triton backend
        out = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0)) * u
    elif ACT == 3:
        out = tl.where(g > threshold, g, 0.0) * u
    elif ACT == 4:  # swigluoai
        g = _min_nan(g, limit)
        u = _clip_nan(u, limit)
        out = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    elif ACT == 5:  # silu_clamp
        g = _min_nan(g, limit)
        out = g * tl.sigmoid(alpha * g) * (_clip_nan(u, limit) + beta)
    elif ACT == 6:  # swiglustep
        out = _min_nan(g * tl.sigmoid(g), limit) * _clip_nan(u, limit)
    else:  # situ
        if linear_beta > 0.0:
            u = linear_beta * _tanh(u / linear_beta)
        out = beta * _tanh(g / beta) * tl.sigmoid(g) * u
    return out


@triton.jit
def _load_pair(x_row, cols, mask, d, ACT_ON_SECOND: tl.constexpr, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        first = tl.load(x_row + 2 * cols, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(x_row + 2 * cols + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        first = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT_ON_SECOND:
        return second, first
    return first, second


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, x_row_stride, out_row_stride, d, threshold, alpha, limit, beta, linear_beta,
    ACT: tl.constexpr, ACT_ON_SECOND: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g, u = _load_pair(x_ptr + row * x_row_stride, cols, mask, d, ACT_ON_SECOND, INTERLEAVED)
    y = _gate(g, u, ACT, threshold, alpha, limit, beta, linear_beta)
    tl.store(out_ptr + row * out_row_stride + cols, cast_out(y, out_ptr, EXACT_BF16), mask=mask)


@triton.jit
def _gated_sparse_kernel(
    x_ptr, out_ptr, x_row_stride, out_row_stride, d, threshold, alpha, limit, beta, linear_beta, std_multiplier,
    ACT: tl.constexpr, ACT_ON_SECOND: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(N_CHUNKS):
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        g, u = _load_pair(x_row, cols, cols < d, d, ACT_ON_SECOND, INTERLEAVED)
        total += g
    mean = tl.sum(total, axis=0) / d
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(N_CHUNKS):
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        g, u = _load_pair(x_row, cols, mask, d, ACT_ON_SECOND, INTERLEAVED)
        centred = tl.where(mask, g - mean, 0.0)
        sq += centred * centred
    cutoff = mean + tl.sqrt(tl.sum(sq, axis=0) / d) * std_multiplier
    for chunk in range(N_CHUNKS):
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        g, u = _load_pair(x_row, cols, mask, d, ACT_ON_SECOND, INTERLEAVED)
        y = _gate(tl.maximum(g - cutoff, 0.0, propagate_nan=tl.PropagateNan.ALL), u, ACT, threshold, alpha, limit, beta,
                  linear_beta)
        tl.store(out_ptr + row * out_row_stride + cols, cast_out(y, out_ptr, EXACT_BF16), mask=mask)


def gated_activation(x: torch.Tensor, *, spec: GateSpec = GateSpec()) -> torch.Tensor:
    """The spec's gated activation over the last dim of ``x`` (even length ``2*d``)."""
    d = x.shape[-1] // 2
    x2 = rows_view(x)
    rows = x2.shape[0]
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows > 0 and d > 0:
        block = min(_BLOCK, triton.next_power_of_2(d))
        common = dict(
            ACT=ACTIVATION_IDS[spec.activation], ACT_ON_SECOND=spec.act_on == "second",
            INTERLEAVED=spec.interleaved, BLOCK=block, EXACT_BF16=needs_exact_bf16(x.dtype),
        )
        scalars = (float(spec.threshold), float(spec.alpha), float(spec.limit), float(spec.beta),
                   float(spec.linear_beta))
        if spec.needs_row_statistics:
            _gated_sparse_kernel[(rows,)](
                x2, out, x2.stride(0), out.stride(0), d, *scalars, float(spec.std_multiplier),
                N_CHUNKS=triton.cdiv(d, block), num_warps=4, **common,
            )
        else:
            _gated_kernel[(rows, triton.cdiv(d, block))](
                x2, out, x2.stride(0), out.stride(0), d, *scalars, num_warps=4, **common,
            )
    return out.reshape(*x.shape[:-1], d)
