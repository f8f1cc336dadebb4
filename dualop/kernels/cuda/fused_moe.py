"""The MoE experts as Triton kernels: the ``unquantized_fused_moe`` (and ``fused_moe``) CUDA/ROCm path.

Conventions (layouts, activations, float32 intermediate) are ``kernels/moe_math.py``'s. Three steps,
none reading a value back to the host (CUDA-graph safe; ``dualop compile`` runs them on meta tensors):

1. Align (torch ops, ``align_block_size``): the ``T * k`` (token, slot) pairs sorted by local expert
   (stable; pairs routed elsewhere, local id -1, dropped), each expert's run padded to a multiple
   of ``BLOCK_M``. ``sorted_pairs[row]`` is a pair index (``token = pair // k``) or the sentinel
   ``T * k`` for padding; ``block_expert[b]`` the local expert of rows ``b*BLOCK_M ..``, -1 for blocks
   past the last expert's run. The block count ``T*k // BLOCK_M + min(E_local, T*k)`` bounds
   ``sum_e cdiv(count_e, BLOCK_M)`` from the shapes alone, so grids never depend on values.
2. Up (``_experts_up_kernel``), grid (blocks, intermediate column blocks): a block's token rows of
   x times its expert's gate and up tiles of ``w13`` (gate-first ``[E, 2, I, H]`` or interleaved
   ``[E, I, 2H]`` views, addressed with row offsets; ``relu2`` one tile), float32 accumulation, the
   router weight when it scales the input (``w * (x @ w13^T)``, before the bias), bias, activation;
   writes the float32 intermediate ``[rows, I]``.
3. Down (``_experts_down_kernel``), grid (blocks, hidden column blocks): intermediate ``@ w2[e]^T``
   plus bias, times the router weight, float32, stored per pair into ``[T, k, H]`` float32 (pairs
   for other devices stay 0); the wrapper sums the k slots in float32 and casts once to x's dtype
   (or returns the float32 sum, ``float32_output``).
   With 16-bit weights the float32 intermediate enters the tensor cores as two 16-bit halves
   (``hi = round(a)``, ``lo = round(a - hi)``; two products), never rounded once to 16 bits.

Only when interpreting: 16-bit dot operands are upcast to float32 (the interpreter misreads
bfloat16 ``tl.dot``; exact) and bfloat16 casts round to nearest even, as a GPU does. Loops run to
constexpr bounds (the hidden and intermediate sizes), which Triton 3.5's interpreter needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.backends import array_namespace
from dualop.kernels import moe_math
from dualop.kernels.cuda import interpreting
from dualop.kernels.cuda.common import _cast, _dot, needs_exact_bf16
from dualop.kernels.cuda.gated_activation import ACTIVATION_IDS, _gate

__all__ = ["fused_experts", "align_block_size", "block_sizes"]

_RELU2 = -1  # activation id of relu2 (no gate); the gated ids are gated_activation's


@triton.jit
def _block_rows(sorted_pairs_ptr, num_pairs, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """This block's rows: (row indices, pair index per row, row holds a pair, the pair's token)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    row_ok = pair < num_pairs
    pair = tl.where(row_ok, pair, 0)
    return rows.to(tl.int64), pair, row_ok, (pair // TOP_K).to(tl.int64)


@triton.jit
def _experts_up_kernel(
    x_ptr, w13_ptr, b13_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, inter_ptr,
    num_pairs, x_stride_t, w13_stride_e, w13_stride_r, b13_stride_e, inter_stride, alpha, limit,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= 0:
        rows, pair, row_ok, token = _block_rows(sorted_pairs_ptr, num_pairs, TOP_K, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < INTER
        # w13 rows of each intermediate column: the gate's (or relu2's only) and the up's.
        if INTERLEAVED:
            gate_rows = 2 * cols
            up_rows = gate_rows + 1
        else:
            gate_rows = cols
            up_rows = cols + INTER  # unused for relu2 (no gate)
        w_expert = w13_ptr + expert.to(tl.int64) * w13_stride_e
        gate_ptrs = w_expert + gate_rows.to(tl.int64)[None, :] * w13_stride_r
        up_ptrs = w_expert + up_rows.to(tl.int64)[None, :] * w13_stride_r
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            a = tl.load(x_ptr + token[:, None] * x_stride_t + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc_gate += _dot(a, tl.load(gate_ptrs + ks[:, None], mask=w_mask, other=0.0), DOT_PRECISION, DOT_UPCAST)
            if ACT != -1:
                acc_up += _dot(a, tl.load(up_ptrs + ks[:, None], mask=w_mask, other=0.0), DOT_PRECISION, DOT_UPCAST)
        if WEIGHT_ON_INPUT:  # (x * w) @ w13^T, as w * (x @ w13^T) in float32; the bias is not weighted
            w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
            acc_gate = acc_gate * w[:, None]
            acc_up = acc_up * w[:, None]
        if HAS_BIAS:
            b_expert = b13_ptr + expert.to(tl.int64) * b13_stride_e
            acc_gate += tl.load(b_expert + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if ACT != -1:
                acc_up += tl.load(b_expert + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACT == -1:
            h = tl.maximum(acc_gate, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as the native body
            h = h * h
        else:
            h = _gate(acc_gate, acc_up, ACT, 0.0, alpha, limit, 0.0, 0.0)
        tl.store(inter_ptr + rows[:, None] * inter_stride + cols[None, :], h,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _experts_down_kernel(
    inter_ptr, w2_ptr, b2_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, out_ptr,
    num_pairs, inter_stride, w2_stride_e, w2_stride_h, b2_stride_e, out_stride,
    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    WEIGHT_ON_INPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, SPLIT_A: tl.constexpr, EXACT_BF16: tl.constexpr,
    SCALE_A: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= 0:
        rows, pair, row_ok, token = _block_rows(sorted_pairs_ptr, num_pairs, TOP_K, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < HIDDEN
        w_ptrs = w2_ptr + expert.to(tl.int64) * w2_stride_e + cols.to(tl.int64)[None, :] * w2_stride_h
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < INTER
            a = tl.load(inter_ptr + rows[:, None] * inter_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptrs + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if SPLIT_A:  # float32 a as two 16-bit halves: about 16 significant bits reach the product
                if SCALE_A:  # float16 halves overflow past 65504: scale such rows by a power of two first
                    peak = tl.max(tl.abs(a), axis=1)
                    shift = tl.where((peak > 16384.0) & (peak < float("inf")), tl.ceil(tl.log2(peak / 16384.0)), 0.0)
                    a = a * tl.exp2(-shift)[:, None]
                a_hi = _cast(a, b.dtype, EXACT_BF16)
                a_lo = _cast(a - a_hi.to(tl.float32), b.dtype, EXACT_BF16)
                part = _dot(a_hi, b, DOT_PRECISION, DOT_UPCAST) + _dot(a_lo, b, DOT_PRECISION, DOT_UPCAST)
                if SCALE_A:
                    part = part * tl.exp2(shift)[:, None]  # exact: powers of two
                acc += part
            else:
                acc += _dot(a, b, DOT_PRECISION, DOT_UPCAST)
        if HAS_BIAS:
            acc += tl.load(b2_ptr + expert.to(tl.int64) * b2_stride_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if not WEIGHT_ON_INPUT:
            acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        tl.store(out_ptr + pair.to(tl.int64)[:, None] * out_stride + cols[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :])


def block_sizes(num_pairs: int, num_local: int, itemsize: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``. Rows per block follow the expected rows per expert
    (16 for decode-sized batches, where a bigger block is mostly padding; up to 64); 64 output
    columns; reduction steps of 64 for 16-bit weights, 32 for float32 (twice the bytes per
    element). Eight warps for 64-row blocks: with four, the up kernel's two float32 64 x 64
    accumulators spilled (255 registers, sm_90, float32, per ``dualop compile``)."""
    per_expert = num_pairs / max(num_local, 1)
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)
    return block_m, 64, 64 if itemsize <= 2 else 32, 8 if block_m == 64 else 4


def align_block_size(local_ids: torch.Tensor, num_local: int, block_m: int):
    """``(sorted_pairs int32 [blocks * block_m], block_expert int32 [blocks])`` (module docstring,
    step 1) for ``local_ids`` ``[T, k]`` from ``moe_math.local_expert_ids``. Torch ops on the
    device; no value is read back, so it runs under CUDA graphs and on meta tensors."""
    flat = local_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = num_pairs // block_m + min(num_local, num_pairs)
    max_rows = num_blocks * block_m
    key = torch.where(flat < 0, num_local, flat).to(torch.int64)  # experts elsewhere sort last, as key E
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_local] = 0
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts  # first sorted position of each key
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_key]
    dest = torch.where(sorted_key < num_local, padded_end[sorted_key] - padded[sorted_key] + rank, max_rows)
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs = sorted_pairs.scatter(0, dest, order.to(torch.int32))[:max_rows]  # slot max_rows: dropped pairs
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end[:num_local].contiguous(), block_starts, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def fused_experts(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map, *, activation,
                  apply_router_weight_on_input, float32_output=False):
    """The experts' output ``[T, H]`` in x's dtype, float32 with ``float32_output`` (module
    docstring). Input is assumed validated by the op; ids outside ``[0, E_global)`` and map
    entries outside ``[0, E_local)`` add nothing."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local, _, _ = w13.shape
    inter = w2.shape[2]
    out_dtype = torch.float32 if float32_output else x.dtype
    if num_tokens == 0:
        return torch.empty((0, hidden), dtype=out_dtype, device=x.device)
    num_pairs = num_tokens * top_k
    local_ids = moe_math.local_expert_ids(array_namespace(topk_ids), topk_ids, expert_map, num_local)
    block_m, block_n, block_k, num_warps = block_sizes(num_pairs, num_local, w13.element_size())
    sorted_pairs, block_expert = align_block_size(local_ids, num_local, block_m)
    num_blocks = block_expert.shape[0]

    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    weights = topk_weights.to(torch.float32).reshape(-1).contiguous()
    b13 = None if w13_bias is None else w13_bias.contiguous()
    b2 = None if w2_bias is None else w2_bias.contiguous()
    spec = moe_math.gate_spec(activation)
    upcast = interpreting() and w13.dtype != torch.float32
    precision = "ieee" if w13.dtype == torch.float32 else "tf32"
    inter_rows = torch.empty((num_blocks * block_m, inter), dtype=torch.float32, device=x.device)
    _experts_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, w13 if b13 is None else b13, weights, sorted_pairs, block_expert, inter_rows,
        num_pairs, x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0),
        inter_rows.stride(0), float(spec.alpha if spec else 0.0), float(spec.limit if spec else 0.0),
        TOP_K=top_k, HIDDEN=hidden, INTER=inter, ACT=_RELU2 if spec is None else ACTIVATION_IDS[spec.activation],
        INTERLEAVED=bool(spec and spec.interleaved), HAS_BIAS=b13 is not None,
        WEIGHT_ON_INPUT=bool(apply_router_weight_on_input),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, DOT_UPCAST=upcast,
        num_warps=num_warps,
    )
    out_pairs = torch.zeros((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _experts_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        inter_rows, w2, w2 if b2 is None else b2, weights, sorted_pairs, block_expert, out_pairs,
        num_pairs, inter_rows.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0),
        out_pairs.stride(0),
        TOP_K=top_k, HIDDEN=hidden, INTER=inter, HAS_BIAS=b2 is not None,
        WEIGHT_ON_INPUT=bool(apply_router_weight_on_input),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, DOT_UPCAST=upcast,
        SPLIT_A=w2.dtype != torch.float32, EXACT_BF16=needs_exact_bf16(w2.dtype), SCALE_A=w2.dtype == torch.float16,
        num_warps=num_warps,
    )
    return out_pairs.reshape(num_tokens, top_k, hidden).sum(dim=1).to(out_dtype)
