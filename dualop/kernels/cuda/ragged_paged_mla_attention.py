"""Absorbed multi-head latent attention over a paged latent cache as one Triton kernel: the
``ragged_paged_mla_attention`` op's CUDA/ROCm path.

Contract (``ops/mla.py``): ``q_latent`` ``[T, H, L + R]``, ``latent_pages`` ``[num_pages,
page_size, L + R]`` (one latent row per token, shared by every head), the ragged metadata of
``ragged_paged_attention``; score = ``q_latent . row * sm_scale`` in float32, causal, softmax in
float32, out ``[T, H, L] = probs . row[:L]`` cast once; rows no sequence owns are zeros.

One launch, grid ``(query blocks across sequences, head blocks)``: the query-block layout and its
binary search are ``ragged_paged_attention``'s (``query_block``; the grid depends only on shapes, so
``dualop compile`` captures launches on meta tensors). A program holds ``BLOCK_Q`` query rows x
``BLOCK_H`` heads as one tile of M rows (all heads read the same latent rows: MQA) and walks its
sequence's KV positions in tiles of ``BLOCK_N`` up to the block's causal limit, each position's page
from ``page_indices``. The row is loaded as its L channels (``k_nope``, also V) and its R rope
channels (each padded to a power of two, at least 16 for ``tl.dot``); scores are the sum of the two
products; ``p . k_nope`` accumulates the output. For 16-bit caches p enters that product as two
16-bit halves (float32 accuracy, as ``ragged_paged_attention``'s kernels). Metadata is clamped
(``num_seqs`` to ``[0, S]``, ``cu_q_lens`` to ``[0, T]`` and non-decreasing, ``kv_lens`` to the page
table's span, page ids to ``[0, num_pages)``): no integer value reads out of bounds.

A float8 cache (float8_e4m3fn, float8_e5m2) is read through its uint8 view and each element decoded
to its exact float32 value (``ragged_paged_attention``'s ``fp8_value``), then cast to q's dtype
(exact); ``k_scale`` scales the float32 scores (folded into ``sm_scale``) and the output, exactly
the products with the rows ``code * k_scale``.

Interpreted (no GPU): the KV loop runs a constexpr tile count and skips unreachable tiles, dot
operands are upcast to float32, bfloat16 casts round to nearest even (``kernels/cuda/common``), as
in ``ragged_paged_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import interpreting
from dualop.kernels.cuda.common import _dot, cast_out, needs_exact_bf16
from dualop.kernels.cuda.ragged_paged_attention import (
    fp8_value, online_softmax_step, ordered_cu_q_lens, query_block, runtime_kv_loop)
from dualop.kernels.kv_cache_math import fp8_kv_format

__all__ = ["ragged_paged_mla_attention", "block_shape"]


@triton.jit
def _kv_tile(tile, q_nope, q_rope, acc, m_i, l_i, q_pos, cache_ptr, page_row_ptr, kv_len, num_pages, pages_per_seq,
             c_stride_page, c_stride_slot, sm_scale,
             PAGE_SIZE: tl.constexpr, LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr,
             ROPE_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
             EXACT_BF16: tl.constexpr, SPLIT_P: tl.constexpr, FP8: tl.constexpr, MANTISSA: tl.constexpr,
             BIAS: tl.constexpr, HAS_INF: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """Fold KV positions ``tile * BLOCK_N ..`` into the online softmax of the query tile."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seq = pos < kv_len
    slot = tl.minimum(pos // PAGE_SIZE, pages_per_seq - 1)
    page = tl.load(page_row_ptr + slot, mask=in_seq, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
    row = cache_ptr + page * c_stride_page + (pos % PAGE_SIZE).to(tl.int64) * c_stride_slot
    c = tl.arange(0, LATENT_PAD)
    r = tl.arange(0, ROPE_PAD)
    k_nope = tl.load(row[:, None] + c[None, :], mask=in_seq[:, None] & (c < LATENT)[None, :], other=0)
    k_rope = tl.load(row[:, None] + LATENT + r[None, :], mask=in_seq[:, None] & (r < ROPE)[None, :], other=0)
    if FP8:  # the cache's uint8 view
        k_nope = fp8_value(k_nope, MANTISSA, BIAS, HAS_INF, SUBNORMAL_STEP)
        k_rope = fp8_value(k_rope, MANTISSA, BIAS, HAS_INF, SUBNORMAL_STEP)
    k_nope = k_nope.to(q_nope.dtype)
    k_rope = k_rope.to(q_nope.dtype)
    s = _dot(q_nope, tl.trans(k_nope), DOT_PRECISION, DOT_UPCAST) + _dot(q_rope, tl.trans(k_rope), DOT_PRECISION,
                                                                        DOT_UPCAST)
    s = s * sm_scale
    allowed = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
    s = tl.where(allowed, s, float("-inf"))
    return online_softmax_step(acc, m_i, l_i, s, k_nope, DOT_PRECISION, DOT_UPCAST, EXACT_BF16, SPLIT_P)  # V = k_nope


@triton.jit
def _mla_kernel(
    q_ptr, cache_ptr, kv_lens_ptr, page_indices_ptr, cu_q_lens_ptr, num_seqs_ptr, out_ptr,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, c_stride_page, c_stride_slot, pt_stride_seq,
    num_tokens, num_heads, max_seqs, num_pages, pages_per_seq, sm_scale, out_scale,
    PAGE_SIZE: tl.constexpr, LATENT: tl.constexpr, LATENT_PAD: tl.constexpr, ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, NUM_KV_TILES: tl.constexpr, RUNTIME_LOOP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr, SPLIT_P: tl.constexpr,
    FP8: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr,
    SUBNORMAL_STEP: tl.constexpr,
):
    block_id = tl.program_id(0)
    head_block = tl.program_id(1)
    seq, q_start, q_end, kv_len, block_start, block_last = query_block(
        block_id, cu_q_lens_ptr, kv_lens_ptr, num_seqs_ptr, num_tokens, max_seqs, pages_per_seq * PAGE_SIZE,
        BLOCK_Q, SEARCH_STEPS)
    q_len = q_end - q_start
    owned = block_start < q_end

    m = tl.arange(0, BLOCK_Q * BLOCK_H)
    token = block_start + m // BLOCK_H
    head = head_block * BLOCK_H + m % BLOCK_H
    row_ok = (token < q_end) & (head < num_heads)
    q_pos = kv_len - q_len + (token - q_start)  # the KV position of each query row
    token64 = tl.where(row_ok, token, 0).to(tl.int64)
    head64 = tl.where(row_ok, head, 0).to(tl.int64)
    c = tl.arange(0, LATENT_PAD)
    r = tl.arange(0, ROPE_PAD)
    q_row = q_ptr + token64 * q_stride_t + head64 * q_stride_h
    q_nope = tl.load(q_row[:, None] + c[None, :], mask=row_ok[:, None] & (c < LATENT)[None, :], other=0.0)
    q_rope = tl.load(q_row[:, None] + LATENT + r[None, :], mask=row_ok[:, None] & (r < ROPE)[None, :], other=0.0)

    # Reachable KV tiles: up to the block's last row's causal limit.
    hi_pos = tl.minimum(kv_len, kv_len - q_len + (block_last - q_start) + 1)
    tile_hi = tl.where(owned, (hi_pos + BLOCK_N - 1) // BLOCK_N, 0)
    page_row_ptr = page_indices_ptr + seq.to(tl.int64) * pt_stride_seq
    acc = tl.zeros([BLOCK_Q * BLOCK_H, LATENT_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
    if RUNTIME_LOOP:
        for tile in range(0, tile_hi):
            acc, m_i, l_i = _kv_tile(
                tile, q_nope, q_rope, acc, m_i, l_i, q_pos, cache_ptr, page_row_ptr, kv_len, num_pages,
                pages_per_seq, c_stride_page, c_stride_slot, sm_scale, PAGE_SIZE, LATENT, LATENT_PAD, ROPE,
                ROPE_PAD, BLOCK_N, DOT_PRECISION, DOT_UPCAST, EXACT_BF16, SPLIT_P, FP8, MANTISSA, BIAS, HAS_INF,
                SUBNORMAL_STEP)
    else:
        for tile in range(NUM_KV_TILES):
            if tile < tile_hi:
                acc, m_i, l_i = _kv_tile(
                    tile, q_nope, q_rope, acc, m_i, l_i, q_pos, cache_ptr, page_row_ptr, kv_len, num_pages,
                    pages_per_seq, c_stride_page, c_stride_slot, sm_scale, PAGE_SIZE, LATENT, LATENT_PAD, ROPE,
                    ROPE_PAD, BLOCK_N, DOT_PRECISION, DOT_UPCAST, EXACT_BF16, SPLIT_P, FP8, MANTISSA, BIAS,
                    HAS_INF, SUBNORMAL_STEP)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * out_scale
    o_row = out_ptr + token64 * o_stride_t + head64 * o_stride_h
    tl.store(o_row[:, None] + c[None, :], cast_out(out, out_ptr, EXACT_BF16),
             mask=row_ok[:, None] & (c < LATENT)[None, :])


def block_shape(num_tokens: int, max_seqs: int, heads: int, latent: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(BLOCK_Q, BLOCK_H, BLOCK_N, num_warps)``. A tile has M = BLOCK_Q * BLOCK_H rows: 16 when
    the batch looks decode-heavy (no more tokens than sequences), else 64, or 32 once the float32
    accumulator ``[M, L]`` is wider than 128 lanes (DeepSeek's L = 512: registers measured with
    ``dualop compile``). Heads fill the tile first (up to M). KV tiles of 64 positions, 32 for wide
    latents or float32. Eight warps once the accumulator reaches 64 x 128."""
    latent_pad = max(triton.next_power_of_2(latent), 16)
    rows = 16 if num_tokens <= max_seqs else (64 if latent_pad <= 128 else 32)
    block_h = min(triton.next_power_of_2(heads), rows)
    block_q = max(rows // block_h, 1)
    block_n = 32 if latent_pad > 128 or itemsize >= 4 else 64
    num_warps = 8 if block_q * block_h * latent_pad >= 64 * 128 else 4
    return block_q, block_h, block_n, num_warps


def ragged_paged_mla_attention(q_latent, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, kv_lora_rank,
                               sm_scale=1.0, k_scale=None):
    """``[T, H, L]`` in q's dtype (see the module docstring); input validated by the op."""
    num_tokens, heads, width = q_latent.shape
    num_pages, page_size, _ = latent_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    latent, rope = kv_lora_rank, width - kv_lora_rank
    out = torch.zeros((num_tokens, heads, latent), dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or max_seqs == 0 or pages_per_seq == 0:
        return out
    if latent_pages.stride(-1) != 1 or latent_pages.stride(1) != width:
        latent_pages = latent_pages.contiguous()
    fmt = fp8_kv_format(latent_pages.dtype)
    if fmt is not None:
        latent_pages = latent_pages.view(torch.uint8)
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    kv_lens, num_seqs = (a.to(torch.int32).contiguous() for a in (kv_lens, num_seqs))
    cu_q_lens = ordered_cu_q_lens(cu_q_lens, num_tokens)
    page_indices = page_indices.to(torch.int32).contiguous()
    block_q, block_h, block_n, num_warps = block_shape(num_tokens, max_seqs, heads, latent, q_latent.element_size())
    grid = (num_tokens // block_q + max_seqs, triton.cdiv(heads, block_h))
    _mla_kernel[grid](
        q_latent, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, out,
        q_latent.stride(0), q_latent.stride(1), out.stride(0), out.stride(1),
        latent_pages.stride(0), latent_pages.stride(1), page_indices.stride(0),
        num_tokens, heads, max_seqs, num_pages, pages_per_seq, float(sm_scale) * (1.0 if k_scale is None else k_scale),
        1.0 if k_scale is None else float(k_scale),
        PAGE_SIZE=page_size, LATENT=latent, LATENT_PAD=max(triton.next_power_of_2(latent), 16), ROPE=rope,
        ROPE_PAD=max(triton.next_power_of_2(rope), 16), BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=block_n,
        SEARCH_STEPS=(max_seqs + 1).bit_length(), NUM_KV_TILES=triton.cdiv(pages_per_seq * page_size, block_n),
        RUNTIME_LOOP=runtime_kv_loop(),
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpreting() and q_latent.dtype != torch.float32,
        EXACT_BF16=needs_exact_bf16(q_latent.dtype),
        SPLIT_P=q_latent.dtype != torch.float32,
        FP8=fmt is not None, MANTISSA=fmt.mantissa_bits if fmt else 0, BIAS=fmt.exponent_bias if fmt else 0,
        HAS_INF=fmt is not None and fmt.dtype == "float8_e5m2", SUBNORMAL_STEP=fmt.subnormal_step if fmt else 0.0,
        num_warps=num_warps,
    )
    return out
