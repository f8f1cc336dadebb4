"""Rotary embedding of query and key (one launch) as a Triton kernel.

Same contract as ``kernels/rope_math.rotate``: per token, the first ``rotary_dim`` channels of each
head rotate in pairs (neox: i with i + rotary_dim/2; GPT-J: 2i with 2i+1) by that token's cos/sin,
in float32, cast once; the rest are copied. Grid: (token, head block), the head blocks of the query
first, then the key's, so one launch serves both. Any head size: channel ranges are masked
(power-of-two blocks over ``rotary_dim/2`` pairs and the pass-through tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16

__all__ = ["rotary"]

_BLOCK_ELEMENTS = 4096  # pairs one program handles at most (heads x rotary_dim/2)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    cos_rows, cos_stride, q_heads, k_heads, head_size,
    HALF: tl.constexpr, IS_NEOX: tl.constexpr, PASS: tl.constexpr, Q_BLOCKS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    row = t % cos_rows
    c = tl.load(cos_ptr + row * cos_stride + j, mask=jm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * cos_stride + j, mask=jm, other=0.0).to(tl.float32)
    if hb < Q_BLOCKS:
        x_ptr = q_ptr
        o_ptr = qo_ptr
        heads = q_heads
        h0 = hb * BLOCK_H
    else:
        x_ptr = k_ptr
        o_ptr = ko_ptr
        heads = k_heads
        h0 = (hb - Q_BLOCKS) * BLOCK_H
    h = h0 + tl.arange(0, BLOCK_H)
    hm = h < heads
    offs = t * heads * head_size + h.to(tl.int64)[:, None] * head_size
    if IS_NEOX:
        i1 = j
        i2 = j + HALF
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    m = hm[:, None] & jm[None, :]
    x1 = tl.load(x_ptr + offs + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + i2[None, :], mask=m, other=0.0).to(tl.float32)
    cb = c[None, :]
    sb = s[None, :]
    tl.store(o_ptr + offs + i1[None, :], cast_out(x1 * cb - x2 * sb, o_ptr, EXACT_BF16), mask=m)
    tl.store(o_ptr + offs + i2[None, :], cast_out(x2 * cb + x1 * sb, o_ptr, EXACT_BF16), mask=m)
    if PASS > 0:
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        pm = hm[:, None] & (p < 2 * HALF + PASS)[None, :]
        tl.store(o_ptr + offs + p[None, :], tl.load(x_ptr + offs + p[None, :], mask=pm), mask=pm)


def rotary(query: torch.Tensor, key: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
           rotary_dim: int, is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate ``query`` ``[T, Hq, D]`` (and ``key`` ``[T, Hk, D]`` or None) by ``cos``/``sin``
    ``[Tc, rotary_dim // 2]`` (token t takes row t % Tc); returns new ``(query, key)``."""
    tokens, q_heads, head_size = query.shape
    query = query.contiguous()
    q_out = torch.empty_like(query)
    k_out = None if key is None else torch.empty_like(key.contiguous())
    if key is not None:
        key = key.contiguous()
    k_heads = 0 if key is None else key.shape[1]
    if tokens == 0 or (q_heads + k_heads) * head_size == 0:  # no query heads still rotates the key
        return q_out, k_out
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(q_heads, k_heads, 1)), max(1, _BLOCK_ELEMENTS // block_half))
    q_blocks = triton.cdiv(q_heads, block_h)
    k_blocks = triton.cdiv(k_heads, block_h)
    pass_width = head_size - rotary_dim
    _rotary_kernel[(tokens, q_blocks + k_blocks)](
        query, key if key is not None else query, cos, sin, q_out, k_out if k_out is not None else q_out,
        cos.shape[0], cos.stride(0) if cos.shape[0] > 1 else half, q_heads, k_heads, head_size,
        HALF=half, IS_NEOX=bool(is_neox_style), PASS=pass_width, Q_BLOCKS=q_blocks,
        BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_PASS=triton.next_power_of_2(max(pass_width, 1)),
        EXACT_BF16=needs_exact_bf16(query.dtype), num_warps=4 if block_h * block_half >= 1024 else 1,
    )
    return q_out, k_out
