"""Ragged paged attention as one Triton kernel: the ``ragged_paged_attention`` op's CUDA/ROCm path.

Layout and semantics are the op's (``ops/attention.py``; JAX's ``ragged_paged_attention``): q
``[T, Hq, D]``, kv_pages ``[num_pages, page_size, 2*Hkv, D]`` with K head h at combined head 2h and V
head h at 2h+1, sequence i owning query rows ``cu_q_lens[i]:cu_q_lens[i+1]`` (its last q_len
positions) and KV positions ``0..kv_lens[i]-1`` through its row of ``page_indices``.

One launch. Grid ``(query blocks, Hkv)``. Query blocks run across all sequences: sequence i owns
blocks ``start(i) .. start(i+1)-1`` with ``start(i) = cu_q_lens[i] // BLOCK_Q + i``, at least
``cdiv(q_len, BLOCK_Q)`` of them, and ``T // BLOCK_Q + S`` bounds the total from the shapes alone, so
the grid never depends on values (launches on meta tensors are captured by ``dualop compile``). A
program finds its sequence by binary search over ``start`` (a constexpr step count); programs past
the last block of their sequence, or of ``num_seqs``, store nothing.

A program holds ``BLOCK_Q`` query rows times all ``Hq // Hkv`` query heads of its KV head (GQA: one
``[BLOCK_Q * group, D]`` tile), so each K/V page is read once per head group. It walks KV in tiles
of ``BLOCK_N`` positions: each position's page id comes from ``page_indices`` (any page size, any page
order), only over the tiles the block's causal / sliding-window span can reach. Scores are float32
``(q . k) * sm_scale``, soft-capped (``c * tanh(s / c)``), masked to ``mask_value``, folded into an
online softmax in float32, the output cast once to q's dtype: the op's float32 semantics, so the
kernel matches its native body in every dtype. For 16-bit caches the ``p . v`` product keeps ``p``
in float32 as two 16-bit halves (``p_hi = round(p)``, ``p_lo = round(p - p_hi)``; two tensor-core
products, about 16 significant bits of ``p``) rather than one rounding of ``p`` to 16 bits, which
loses outputs near zero by cancellation. ``k_scale`` / ``v_scale`` scale the scores / the output in
float32 (exactly the products with scaled K / V, without rounding scaled values to 16 bits).
A float8 cache (float8_e4m3fn, float8_e5m2) is read through its uint8 view and each element
decoded to its exact float32 value by integer arithmetic on its bits (``fp8_value``; Triton's
float8 casts need sm_89 for e4m3 and misread some codes in its interpreter), then cast to q's
dtype (exact: every float8 value is a bfloat16 and float16 value), so the products are those of a
cache holding the decoded values. Positions at or past ``kv_len`` never count; causally masked positions below it score
``mask_value``, and when that can matter (``masked_positions_vanish``) every tile up to ``kv_len``
is visited. Attention sinks (``sinks``, one logit per query head, clipped as ``sink_logits``)
start each row's online softmax at ``(max, sum) = (sink, 1)``: they join the denominator only.

Output rows no sequence owns (padding past ``cu_q_lens[num_seqs[0]]``) are zeros: the output starts
zeroed and only owned rows are stored. The kernel assumes validated input (the op's check_inputs)
but never reads out of bounds for any integer values: ``num_seqs`` is clamped to ``[0, S]``,
``cu_q_lens`` to ``[0, T]`` and non-decreasing (``ordered_cu_q_lens``), ``kv_lens`` to ``[0, pages_per_seq *
page_size]``, page ids to ``[0, num_pages - 1]``.

KV loop: compiled, it runs over exactly the reachable tiles (runtime bounds). Triton 3.5's
interpreter cannot loop to a runtime bound under numpy 2.4, so interpreted it loops over all
``cdiv(pages_per_seq * page_size, BLOCK_N)`` tiles (a constexpr) and skips the unreachable ones.
Also only when interpreting: 16-bit dot operands are upcast to float32 first (the interpreter
misreads bfloat16 ``tl.dot`` operands; the upcast is exact) and bfloat16 casts round to nearest
even (the interpreter truncates), so the interpreter computes what a GPU does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import interpreting
from dualop.kernels.cuda.common import _cast, _dot, cast_out, needs_exact_bf16
from dualop.kernels.kv_cache_math import fp8_kv_format
from dualop.kernels.paged_attention_math import DEFAULT_MASK_VALUE, FLOAT32_MAX, masked_positions_vanish

__all__ = ["ragged_paged_attention", "DEFAULT_MASK_VALUE", "block_shape"]



@triton.jit
def _soft_cap(s, cap):
    """``cap * tanh(s / cap)``, tanh from one exp of a non-positive argument (no overflow)."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0.0, -t, t)


@triton.jit
def fp8_value(code, MANTISSA: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr,
              SUBNORMAL_STEP: tl.constexpr):
    """float32 value of float8 codes (uint8): a normal code's exponent rebiased into float32's bits,
    a subnormal one ``mantissa * SUBNORMAL_STEP``; e5m2 (``HAS_INF``) has inf and NaN at its
    all-ones exponent, e4m3fn NaN at 0x7f and 0xff only."""
    c = code.to(tl.int32)
    mag = c & 0x7F
    e = mag >> MANTISSA
    m = mag & ((1 << MANTISSA) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MANTISSA))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * SUBNORMAL_STEP, normal)
    if HAS_INF:
        v = tl.where(e == (1 << (7 - MANTISSA)) - 1, tl.where(m == 0, float("inf"), float("nan")), v)
    else:
        v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where(c >= 0x80, -v, v)


@triton.jit
def _kv_tile(
    tile, q, acc, m_i, l_i, q_pos,
    kv_ptr, page_row_ptr, kv_head_off, kv_len, num_pages, pages_per_seq,
    kv_stride_page, kv_stride_slot, kv_stride_head,
    sm_scale, soft_cap, mask_value, k_scale, v_scale, sliding_window,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    EXACT_BF16: tl.constexpr, SPLIT_P: tl.constexpr, MASKED_COUNT: tl.constexpr, FP8: tl.constexpr,
    MANTISSA: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr, SUBNORMAL_STEP: tl.constexpr,
):
    """Fold KV positions ``tile*BLOCK_N ..`` into the online softmax of the query tile ``q``."""
    pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    in_seq = pos < kv_len
    slot = tl.minimum(pos // PAGE_SIZE, pages_per_seq - 1)
    page = tl.load(page_row_ptr + slot, mask=in_seq, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
    row_off = page * kv_stride_page + (pos % PAGE_SIZE).to(tl.int64) * kv_stride_slot + kv_head_off
    d = tl.arange(0, HEAD_DIM_PAD)
    kv_mask = in_seq[:, None] & (d < HEAD_DIM)[None, :]
    k_ptrs = kv_ptr + row_off[:, None] + d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0)
    v = tl.load(k_ptrs + kv_stride_head, mask=kv_mask, other=0)  # V head 2h+1 follows K head 2h
    if FP8:  # the cache's uint8 view
        k = fp8_value(k, MANTISSA, BIAS, HAS_INF, SUBNORMAL_STEP)
        v = fp8_value(v, MANTISSA, BIAS, HAS_INF, SUBNORMAL_STEP)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * sm_scale
    if HAS_K_SCALE:
        s = s * k_scale
    if HAS_SOFT_CAP:
        s = _soft_cap(s, soft_cap)
    allowed = in_seq[None, :] & (pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        allowed = allowed & (pos[None, :] > q_pos[:, None] - sliding_window)
    s = tl.where(allowed, s, mask_value)
    s = tl.where(in_seq[None, :], s, float("-inf"))  # past kv_len: never counts

    return online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION, DOT_UPCAST, EXACT_BF16, SPLIT_P)


@triton.jit
def online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
                        EXACT_BF16: tl.constexpr, SPLIT_P: tl.constexpr):
    """Fold float32 scores ``s`` [M, N] (-inf where a position does not count) and values ``v``
    [N, D] into the running ``(acc, max, sum)``; for 16-bit values p enters ``p . v`` as two 16-bit
    halves (float32 accuracy). Shared by the paged attention kernels (here and the MLA one)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet (mask -inf): no NaN
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SPLIT_P:
        p_hi = _cast(p, v.dtype, EXACT_BF16)
        p_lo = _cast(p - p_hi.to(tl.float32), v.dtype, EXACT_BF16)
        pv = _dot(p_hi, v, DOT_PRECISION, DOT_UPCAST) + _dot(p_lo, v, DOT_PRECISION, DOT_UPCAST)
    else:
        pv = _dot(p, v, DOT_PRECISION, DOT_UPCAST)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def query_block(block_id, cu_q_lens_ptr, kv_lens_ptr, num_seqs_ptr, num_tokens, max_seqs, max_kv,
                BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Which sequence query block ``block_id`` belongs to (the layout in the module docstring:
    sequence i owns blocks ``cu_q_lens[i] // BLOCK_Q + i ..``), found by binary search with a
    constexpr step count, and its clamped bounds: ``(seq, q_start, q_end, kv_len, block_start,
    block_last)``; a block no sequence owns gets ``block_start >= q_end``. Shared with the MLA kernel."""
    n_seqs = tl.minimum(tl.maximum(tl.load(num_seqs_ptr), 0), max_seqs)
    # The last i < n_seqs with cu_q_lens[i] // BLOCK_Q + i <= block_id (binary search for the count
    # of such i; finished searches stay put).
    lo = n_seqs * 0
    hi = n_seqs
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        start = tl.minimum(tl.maximum(tl.load(cu_q_lens_ptr + mid), 0), num_tokens) // BLOCK_Q + mid
        searching = lo < hi
        lo = tl.where(searching, tl.where(start <= block_id, mid + 1, lo), lo)
        hi = tl.where(searching, tl.where(start <= block_id, hi, mid), hi)
    seq = tl.maximum(lo - 1, 0)
    q_start = tl.minimum(tl.maximum(tl.load(cu_q_lens_ptr + seq), 0), num_tokens)
    q_end = tl.minimum(tl.maximum(tl.load(cu_q_lens_ptr + seq + 1), q_start), num_tokens)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_lens_ptr + seq), 0), max_kv)
    # Single comparisons only: the interpreter turns `scalar & tensor` of booleans into int32.
    block_start = q_start + (block_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    block_start = tl.where(lo > 0, block_start, num_tokens)  # no sequence: a block past every row
    block_last = tl.minimum(block_start + BLOCK_Q, q_end) - 1
    return seq, q_start, q_end, kv_len, block_start, block_last


@triton.jit
def _rpa_kernel(
    q_ptr, kv_ptr, kv_lens_ptr, page_indices_ptr, cu_q_lens_ptr, num_seqs_ptr, sinks_ptr, out_ptr,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    kv_stride_page, kv_stride_slot, kv_stride_head, pt_stride_seq,
    num_tokens, max_seqs, num_pages, pages_per_seq,
    sm_scale, soft_cap, mask_value, k_scale, v_scale, sliding_window,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, NUM_KV_TILES: tl.constexpr, RUNTIME_LOOP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    EXACT_BF16: tl.constexpr, SPLIT_P: tl.constexpr, MASKED_COUNT: tl.constexpr, FP8: tl.constexpr,
    MANTISSA: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr, SUBNORMAL_STEP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, q_start, q_end, kv_len, block_start, block_last = query_block(
        block_id, cu_q_lens_ptr, kv_lens_ptr, num_seqs_ptr, num_tokens, max_seqs, pages_per_seq * PAGE_SIZE,
        BLOCK_Q, SEARCH_STEPS)
    q_len = q_end - q_start
    owned = block_start < q_end

    # Rows of the query tile: BLOCK_Q tokens x GROUP_PAD heads (heads past GROUP are padding).
    m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = block_start + m // GROUP_PAD
    g = m % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (token < q_end) & (g < GROUP)
    q_pos = kv_len - q_len + (token - q_start)  # the KV position of each query row
    d = tl.arange(0, HEAD_DIM_PAD)
    io_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    token64 = tl.where(row_ok, token, 0).to(tl.int64)
    head64 = tl.where(row_ok, head, 0).to(tl.int64)
    q = tl.load(q_ptr + token64[:, None] * q_stride_t + head64[:, None] * q_stride_h + d[None, :],
                mask=io_mask, other=0.0)

    # Reachable KV tiles: causal up to the last row's position, the window from the first row's.
    hi_pos = tl.minimum(kv_len, kv_len - q_len + (block_last - q_start) + 1)
    tile_hi = tl.where(owned, (hi_pos + BLOCK_N - 1) // BLOCK_N, 0)
    tile_lo = tile_hi * 0
    if MASKED_COUNT:  # masked positions below kv_len score mask_value and count: visit them all
        tile_hi = tl.where(owned, (kv_len + BLOCK_N - 1) // BLOCK_N, 0)
    elif HAS_WINDOW:
        lo_pos = tl.maximum(kv_len - q_len + (block_start - q_start) - sliding_window + 1, 0)
        tile_lo = lo_pos // BLOCK_N

    page_row_ptr = page_indices_ptr + seq.to(tl.int64) * pt_stride_seq
    kv_head_off = (2 * kv_head).to(tl.int64) * kv_stride_head
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], mask_value, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    if HAS_SINKS:  # each row starts at (max, sum) = (its head's sink, 1): the sink weighs no V row
        m_i = tl.load(sinks_ptr + head64, mask=row_ok, other=0.0)  # float32, clipped by the wrapper
        l_i = l_i + 1.0
    if RUNTIME_LOOP:
        for tile in range(tile_lo, tile_hi):
            acc, m_i, l_i = _kv_tile(
                tile, q, acc, m_i, l_i, q_pos, kv_ptr, page_row_ptr, kv_head_off, kv_len, num_pages,
                pages_per_seq, kv_stride_page, kv_stride_slot, kv_stride_head,
                sm_scale, soft_cap, mask_value, k_scale, v_scale, sliding_window,
                PAGE_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HAS_WINDOW, HAS_SOFT_CAP, HAS_K_SCALE,
                HAS_V_SCALE, DOT_PRECISION, DOT_UPCAST, EXACT_BF16, SPLIT_P, MASKED_COUNT,
                FP8, MANTISSA, BIAS, HAS_INF, SUBNORMAL_STEP)
    else:
        for tile in range(NUM_KV_TILES):
            if (tile >= tile_lo) & (tile < tile_hi):
                acc, m_i, l_i = _kv_tile(
                    tile, q, acc, m_i, l_i, q_pos, kv_ptr, page_row_ptr, kv_head_off, kv_len, num_pages,
                    pages_per_seq, kv_stride_page, kv_stride_slot, kv_stride_head,
                    sm_scale, soft_cap, mask_value, k_scale, v_scale, sliding_window,
                    PAGE_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, HAS_WINDOW, HAS_SOFT_CAP, HAS_K_SCALE,
                    HAS_V_SCALE, DOT_PRECISION, DOT_UPCAST, EXACT_BF16, SPLIT_P, MASKED_COUNT,
                FP8, MANTISSA, BIAS, HAS_INF, SUBNORMAL_STEP)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if HAS_V_SCALE:
        out = out * v_scale
    tl.store(out_ptr + token64[:, None] * o_stride_t + head64[:, None] * o_stride_h + d[None, :],
             cast_out(out, out_ptr, EXACT_BF16), mask=io_mask)


def runtime_kv_loop() -> bool:
    """Whether the KV loop runs over runtime bounds (compiled) or a constexpr count (interpreted:
    Triton 3.5's interpreter cannot loop to a runtime bound under numpy 2.4)."""
    return not interpreting()


def block_shape(num_tokens: int, max_seqs: int, group: int, head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """``(BLOCK_Q, BLOCK_N, num_warps)``: query tokens per program, KV positions per tile, warps.

    A program's tile has ``BLOCK_Q * next_pow2(group)`` rows, at least 16 (``tl.dot``'s minimum):
    16 when the batch looks decode-heavy (no more tokens than sequences: a bigger block would be
    mostly padding rows), else 64 (32 past head dim 128, where the float32 accumulator would spill).
    KV tiles of 64 positions, 32 past head dim 128 or for float32 (no tensor-core products). Eight
    warps once the accumulator reaches 64 x 128 (registers measured with ``dualop compile``).
    """
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)
    rows = 16 if num_tokens <= max_seqs else (64 if head_dim_pad <= 128 else 32)
    block_q = max(rows // group_pad, 1)
    block_n = 32 if head_dim_pad > 128 or itemsize >= 4 else 64
    num_warps = 8 if block_q * group_pad * head_dim_pad >= 64 * 128 else 4
    return block_q, block_n, num_warps


def ordered_cu_q_lens(cu_q_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``cu_q_lens`` as int32, clipped to ``[0, T]`` and made non-decreasing (a running max), as every
    path reads it (``ops/attention.py``): each row then belongs to at most one sequence (the query
    block search needs sorted starts)."""
    return torch.cummax(cu_q_lens.to(torch.int32).clamp(0, num_tokens), 0).values.contiguous()


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *, sm_scale=1.0,
                           sliding_window=None, soft_cap=None, mask_value=None, k_scale=None, v_scale=None):
    """Ragged paged attention (see the module docstring); returns a new ``[T, Hq, D]`` tensor in q's
    dtype with zeros in rows no sequence owns. Input is assumed validated by the op."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined_heads, _ = kv_pages.shape
    num_kv_heads = combined_heads // 2
    group = num_q_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    out = torch.zeros((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or max_seqs == 0 or num_kv_heads == 0 or head_dim == 0:
        return out
    if kv_pages.stride(-1) != 1:
        kv_pages = kv_pages.contiguous()
    fmt = fp8_kv_format(kv_pages.dtype)
    if fmt is not None:
        kv_pages = kv_pages.view(torch.uint8)
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_lens, num_seqs = (a.to(torch.int32).contiguous() for a in (kv_lens, num_seqs))
    cu_q_lens = ordered_cu_q_lens(cu_q_lens, num_tokens)
    page_indices = page_indices.to(torch.int32).contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).clamp(-FLOAT32_MAX, FLOAT32_MAX).contiguous()  # as sink_logits (NaN kept)

    fill = float(DEFAULT_MASK_VALUE if mask_value is None else mask_value)
    block_q, block_n, num_warps = block_shape(num_tokens, max_seqs, group, head_dim, q.element_size())
    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)
    grid = (num_tokens // block_q + max_seqs, num_kv_heads)
    _rpa_kernel[grid](
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, kv_lens if sinks is None else sinks, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_pages.stride(0), kv_pages.stride(1), kv_pages.stride(2), page_indices.stride(0),
        num_tokens, max_seqs, num_pages, pages_per_seq,
        float(sm_scale), float(soft_cap or 0.0),
        fill,
        float(1.0 if k_scale is None else k_scale), float(1.0 if v_scale is None else v_scale),
        int(sliding_window or 0),
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        SEARCH_STEPS=(max_seqs + 1).bit_length(), NUM_KV_TILES=triton.cdiv(pages_per_seq * page_size, block_n),
        RUNTIME_LOOP=runtime_kv_loop(),
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpreting() and q.dtype != torch.float32,
        EXACT_BF16=needs_exact_bf16(q.dtype),
        SPLIT_P=q.dtype != torch.float32,
        MASKED_COUNT=not masked_positions_vanish(fill, soft_cap),
        FP8=fmt is not None, MANTISSA=fmt.mantissa_bits if fmt else 0, BIAS=fmt.exponent_bias if fmt else 0,
        HAS_INF=fmt is not None and fmt.dtype == "float8_e5m2", SUBNORMAL_STEP=fmt.subnormal_step if fmt else 0.0,
        HAS_SINKS=sinks is not None, num_warps=num_warps,
    )
    return out
