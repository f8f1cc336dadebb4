"""The LM head's logits with the soft cap and scale fused after the matmul, as a Triton kernel.

The same computation as ``kernels/pallas/logits_processor.py``: each program owns a
``[BLOCK_T, BLOCK_V]`` tile of the logits, accumulates ``hidden @ weightᵀ`` over the hidden dim in
``BLOCK_H`` steps with ``tl.dot`` (float32 accumulation), then adds the bias, soft-caps
(``tanh(l / c) * c``, tanh from one exp of a non-positive argument) and scales in registers, and
stores the tile once in the input dtype. The grid is (vocab tiles, token tiles) with the vocab
tiles on the fastest-launched axis, so a decode batch (one token tile) reads each weight row once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import interpreting
from dualop.kernels.cuda.common import _dot, cast_out, needs_exact_bf16
from dualop.kernels.logits_math import LogitsSpec

__all__ = ["logits_processor", "block_sizes"]


@triton.jit
def _logits_kernel(
    h_ptr, w_ptr, b_ptr, out_ptr, tokens, rows, h_stride, w_stride, out_stride, soft_cap, scale,
    HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_t = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    t_ok, v_ok = t < tokens, v < rows
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, HIDDEN, BLOCK_H):
        ks = h0 + tl.arange(0, BLOCK_H)
        k_ok = ks < HIDDEN
        a = tl.load(h_ptr + t.to(tl.int64)[:, None] * h_stride + ks[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + v.to(tl.int64)[None, :] * w_stride + ks[:, None], mask=k_ok[:, None] & v_ok[None, :],
                    other=0.0)
        acc += _dot(a, b, DOT_PRECISION, DOT_UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + v, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_CAP:
        x = acc / soft_cap
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        acc = tl.where(x < 0.0, -th, th) * soft_cap
    acc = acc * scale
    tl.store(out_ptr + t.to(tl.int64)[:, None] * out_stride + v[None, :], cast_out(acc, out_ptr, EXACT_BF16),
             mask=t_ok[:, None] & v_ok[None, :])


def block_sizes(tokens: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_V, BLOCK_H, num_warps)``: 16 token rows for decode batches (tl.dot's
    minimum), up to 64 for prefill; 128 vocab columns; hidden steps of 64 (32 for float32)."""
    block_t = 16 if tokens <= 16 else (32 if tokens <= 32 else 64)
    return block_t, 128, 64 if itemsize <= 2 else 32, 4 if block_t <= 32 else 8


def logits_processor(weight: torch.Tensor, hidden: torch.Tensor, bias: torch.Tensor | None = None, *,
                     spec: LogitsSpec = LogitsSpec(), rows: int | None = None) -> torch.Tensor:
    """``[..., rows]`` logits of ``hidden`` ``[..., H]`` against the first ``rows`` rows of
    ``weight`` ``[R, H]`` (default all), plus ``bias[:rows]``, with ``spec``'s epilogue."""
    rows = weight.shape[0] if rows is None else rows
    lead, hidden_size = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(-1, hidden_size)
    h2 = h2 if h2.stride(-1) == 1 else h2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    tokens = h2.shape[0]
    out = torch.empty((tokens, rows), dtype=hidden.dtype, device=hidden.device)
    if tokens == 0:
        return out.reshape(*lead, rows)
    block_t, block_v, block_h, num_warps = block_sizes(tokens, hidden.element_size())
    grid = (triton.cdiv(rows, block_v), triton.cdiv(tokens, block_t))
    _logits_kernel[grid](
        h2, w, w if bias is None else bias.contiguous(), out, tokens, rows, h2.stride(0), w.stride(0),
        out.stride(0), float(spec.soft_cap or 1.0), float(spec.scale), HIDDEN=hidden_size,
        HAS_BIAS=bias is not None, HAS_CAP=spec.soft_cap is not None, BLOCK_T=block_t, BLOCK_V=block_v,
        BLOCK_H=block_h, DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpreting() and hidden.dtype != torch.float32, EXACT_BF16=needs_exact_bf16(hidden.dtype),
        num_warps=num_warps,
    )
    return out.reshape(*lead, rows)
