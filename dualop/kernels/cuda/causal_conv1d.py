"""Depthwise causal conv1d over packed sequences as Triton kernels: the ``causal_conv1d`` op's
CUDA/ROCm path (contract: ``dualop/ops/causal_conv1d.py``; math: ``ssm_math.causal_conv1d_reference``).

``_conv_kernel``, one program per (block of tokens, block of channels): each token's window tap k
reads token ``t - (K - 1) + k`` when that is still in the token's sequence, else column
``K - 1 + (that offset)`` of the sequence's cached state (zero unless ``has_initial_state`` and a
real slot), so prefill and decode (T == B: every window's head from the cache) are the same kernel.
``_final_state_kernel``, one program per (sequence, block of channels), then writes each sequence's
last K - 1 inputs into its slot (reading, in the same program, the old state columns a sequence
shorter than K - 1 keeps); launched after the first, it never overwrites a state still to be read.
The cache is updated in place; slots are the op's validated, distinct ones.

Strides: the kernels take x's, the weight's, the bias's and the cache's strides (a strided cache is
written in place where it lies); ``y`` is allocated contiguous; the ``[B]`` metadata is made
contiguous here. Every index read from the metadata is clamped in the kernels (a token past
``cu_seqlens[B]`` belongs to no sequence and gives zeros; a slot outside the cache is padding), so
bad traced metadata never reads or writes out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16

__all__ = ["causal_conv1d"]

BLOCK_T = 64


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, seq_ptr, y_ptr,
    num_tokens, dim, num_seqs, num_slots, x_stride_t, x_stride_d, y_stride_t, w_stride_d, w_stride_k, b_stride,
    state_stride_s, state_stride_d, state_stride_k,
    KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, EXACT_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < num_tokens
    d_ok = d < dim
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0)
    owned = t_ok & (seq >= 0) & (seq < num_seqs)  # past cu_seqlens[B]: no sequence
    seq = tl.minimum(tl.maximum(seq, 0), num_seqs - 1)
    start = tl.load(cu_ptr + seq, mask=t_ok, other=0)
    slot = tl.load(slot_ptr + seq, mask=t_ok, other=-1)
    real = owned & (slot >= 0) & (slot < num_slots)  # a slot outside the cache is padding
    from_cache = real & (tl.load(init_ptr + seq, mask=t_ok, other=0) != 0)
    slot = tl.where(real, slot, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d * b_stride, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(KERNEL):
        rel = t - (KERNEL - 1) + k - start  # the tap's offset from the sequence start
        src = (t - (KERNEL - 1) + k).to(tl.int64)
        in_seq = (rel >= 0) & (src >= 0)
        xv = tl.load(x_ptr + src[:, None] * x_stride_t + d[None, :].to(tl.int64) * x_stride_d,
                     mask=(t_ok & in_seq)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        col = tl.minimum(tl.maximum(KERNEL - 1 + rel, 0), KERNEL - 2)
        sv = tl.load(state_ptr + slot[:, None] * state_stride_s + d[None, :] * state_stride_d
                     + col[:, None] * state_stride_k,
                     mask=(from_cache & (rel < 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        wk = tl.load(w_ptr + d * w_stride_d + k * w_stride_k, mask=d_ok, other=0.0).to(tl.float32)
        acc += wk[None, :] * (xv + sv)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(real[:, None], acc, 0.0)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * y_stride_t + d[None, :], cast_out(acc, y_ptr, EXACT_BF16),
             mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _final_state_kernel(
    x_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr,
    num_tokens, dim, num_slots, x_stride_t, x_stride_d, state_stride_s, state_stride_d, state_stride_k,
    HIST: tl.constexpr, EXACT_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    start = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), start), num_tokens)
    slot = tl.load(slot_ptr + b)
    # Columns written (none for padding) and old columns kept (only from a real initial state),
    # as counts: single comparisons keep the interpreter's masks boolean.
    real = (slot >= 0) & (slot < num_slots)
    written = tl.where(real, HIST, 0)
    kept = tl.where(real & (tl.load(init_ptr + b) != 0), HIST, 0)
    slot = tl.where(real, slot, 0).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    rel = end - HIST + j - start  # offset of column j's input from the sequence start
    in_seq = rel >= 0
    src = (end - HIST + j).to(tl.int64)
    xv = tl.load(x_ptr + src[:, None] * x_stride_t + d[None, :].to(tl.int64) * x_stride_d,
                 mask=((j < written) & in_seq)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    row = state_ptr + slot * state_stride_s + d[None, :] * state_stride_d
    old = tl.load(row + tl.minimum(tl.maximum(HIST + rel, 0), HIST - 1)[:, None] * state_stride_k,
                  mask=((j < kept) & (rel < 0))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    tl.debug_barrier()  # every thread has read the old columns before any is overwritten
    tl.store(row + j[:, None] * state_stride_k, cast_out(xv + old, state_ptr, EXACT_BF16),
             mask=(j < written)[:, None] & d_ok[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  cu_seqlens: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor, *,
                  activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [T, D], conv_state)``, the cache ``[S, D, K - 1]`` updated in place; metadata validated
    by the op (int32 ``cu_seqlens`` / ``state_indices``, bool ``has_initial_state``)."""
    num_tokens, dim = x.shape
    kernel_size = weight.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    y = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y, conv_state
    cu = cu_seqlens.to(torch.int32).contiguous()
    slots = state_indices.to(torch.int32).contiguous()
    init = has_initial_state.to(torch.int8).contiguous()
    positions = torch.arange(num_tokens, device=x.device, dtype=torch.int32)
    seq = torch.searchsorted(cu[1:], positions, right=True).to(torch.int32)
    block_d = min(256, triton.next_power_of_2(dim))
    block_t = min(BLOCK_T, triton.next_power_of_2(num_tokens))
    s_stride = conv_state.stride()
    num_slots = conv_state.shape[0]
    exact = needs_exact_bf16(x.dtype)
    _conv_kernel[(triton.cdiv(num_tokens, block_t), triton.cdiv(dim, block_d))](
        x, weight, bias if bias is not None else weight, conv_state, cu, slots, init, seq, y,
        num_tokens, dim, num_seqs, num_slots, *x.stride(), y.stride(0), *weight.stride(),
        bias.stride(0) if bias is not None else 0, *s_stride,
        KERNEL=kernel_size, HAS_BIAS=bias is not None, SILU=activation == "silu", EXACT_BF16=exact,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )
    _final_state_kernel[(num_seqs, triton.cdiv(dim, block_d))](
        x, conv_state, cu, slots, init,
        num_tokens, dim, num_slots, *x.stride(), *s_stride,
        HIST=kernel_size - 1, EXACT_BF16=needs_exact_bf16(conv_state.dtype),
        BLOCK_H=triton.next_power_of_2(kernel_size - 1), BLOCK_D=block_d, num_warps=4,
    )
    return y, conv_state
