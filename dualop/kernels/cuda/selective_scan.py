"""Mamba-1's selective scan as Triton kernels: the ``selective_scan`` op's CUDA/ROCm path.

Contract: ``ssm_math.selective_scan_reference`` over a validated serving batch (``ops/ssm_batch.py``),
``(y [T, I] in x's dtype, cache)`` with the cache ``[S, I, N]`` updated IN PLACE.

Prefill (``_scan_kernel``): one program per (block of channels, sequence); the block's state
``[BLOCK_I, N]`` stays in registers while the program walks its sequence's tokens, starting from
the cached state (``has_initial_state``) or zeros, and is stored into the sequence's slot after
its last token. Programs of one sequence own disjoint channels and sequences own distinct slots,
so the cache is read and written in place with no gather or scatter. Padding sequences (slot -1)
write zero outputs and no state.

Decode (``DECODE``, T == B; a specialisation of the same kernel): one program per (block of
channels, sequence) and its one token, no sequence loop: the engine's ``selective_state_update``.

Strides: the kernel takes the row and channel strides of x, dt, z, B and C and the cache's strides
(a strided cache is written in place where it lies); ``y`` is allocated contiguous; A, D, dt_bias
and the ``[B]`` metadata are made contiguous here (small). Every index read from the metadata is
clamped (a sequence's tokens into ``[0, T]``, a slot outside the cache is padding), and one more
program row zeroes the tokens past ``cu_seqlens[B]`` (no sequence owns them), so bad traced
metadata never reads or writes out of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16

__all__ = ["selective_scan", "BLOCK_I"]

BLOCK_I = 64  # channels per program


@triton.jit
def _token(h, t, i, n, i_mask, n_mask, x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, y_ptr, a, d_skip, bias, keep,
           stride_x, stride_dt, stride_z, stride_b, stride_c, stride_y,
           cstride_x, cstride_dt, cstride_z, cstride_b, cstride_c,
           HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr, EXACT_BF16: tl.constexpr):
    """One token of a channel block: update ``h [BLOCK_I, BLOCK_N]``, store ``y[t, i]``."""
    xv = tl.load(x_ptr + t * stride_x + i * cstride_x, mask=i_mask, other=0.0).to(tl.float32)
    d = tl.load(dt_ptr + t * stride_dt + i * cstride_dt, mask=i_mask, other=0.0).to(tl.float32) + bias
    if SOFTPLUS:
        d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(d)))
    bv = tl.load(b_ptr + t * stride_b + n * cstride_b, mask=n_mask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + t * stride_c + n * cstride_c, mask=n_mask, other=0.0).to(tl.float32)
    h = tl.exp(d[:, None] * a) * h + (d * xv)[:, None] * bv[None, :]
    y = tl.sum(h * cv[None, :], axis=1) + d_skip * xv
    if HAS_Z:
        zv = tl.load(z_ptr + t * stride_z + i * cstride_z, mask=i_mask, other=0.0).to(tl.float32)
        y = y * (zv * tl.sigmoid(zv))
    y = tl.where(keep, y, 0.0)
    tl.store(y_ptr + t * stride_y + i, cast_out(y, y_ptr, EXACT_BF16), mask=i_mask)
    return h


@triton.jit
def _scan_kernel(x_ptr, dt_ptr, z_ptr, a_ptr, b_ptr, c_ptr, d_ptr, bias_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr,
                 y_ptr, dim, n_state, num_tokens, num_seqs, num_slots,
                 stride_x, stride_dt, stride_z, stride_b, stride_c, stride_y, stride_s0, stride_s1, stride_s2,
                 cstride_x, cstride_dt, cstride_z, cstride_b, cstride_c,
                 HAS_Z: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                 DECODE: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr, EXACT_BF16: tl.constexpr,
                 EXACT_BF16_STATE: tl.constexpr):
    seq = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    n = tl.arange(0, BLOCK_N)
    i_mask, n_mask = i < dim, n < n_state
    if seq == num_seqs:  # the extra row of programs: zeros for the tokens no sequence owns
        t = tl.minimum(tl.maximum(tl.load(cu_ptr + num_seqs), 0), num_tokens).to(tl.int64)
        while t < num_tokens:
            tl.store(y_ptr + t * stride_y + i, tl.zeros([BLOCK_I], tl.float32).to(y_ptr.dtype.element_ty),
                     mask=i_mask)
            t += 1
    else:
        hn_mask = i_mask[:, None] & n_mask[None, :]
        a = tl.load(a_ptr + i[:, None] * n_state + n[None, :], mask=hn_mask, other=0.0).to(tl.float32)
        no = tl.zeros([BLOCK_I], tl.float32)
        d_skip = tl.load(d_ptr + i, mask=i_mask, other=0.0).to(tl.float32) if HAS_D else no
        bias = tl.load(bias_ptr + i, mask=i_mask, other=0.0).to(tl.float32) if HAS_BIAS else no
        slot = tl.load(slot_ptr + seq)
        keep = (slot >= 0) & (slot < num_slots)  # a slot outside the cache is padding
        use_init = keep & (tl.load(init_ptr + seq) != 0)
        safe = tl.where(keep, slot, 0).to(tl.int64)
        s_off = safe * stride_s0 + i[:, None] * stride_s1 + n[None, :] * stride_s2
        zeros = tl.zeros([BLOCK_I, BLOCK_N], tl.int32)  # scalar flags broadcast to masks
        h = tl.load(state_ptr + s_off, mask=hn_mask & ((zeros + use_init.to(tl.int32)) > 0), other=0.0).to(tl.float32)
        if DECODE:
            h = _token(h, seq.to(tl.int64), i, n, i_mask, n_mask, x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, y_ptr, a, d_skip,
                       bias, keep, stride_x, stride_dt, stride_z, stride_b, stride_c, stride_y,
                       cstride_x, cstride_dt, cstride_z, cstride_b, cstride_c, HAS_Z, SOFTPLUS, EXACT_BF16)
        else:
            start = tl.minimum(tl.maximum(tl.load(cu_ptr + seq), 0), num_tokens).to(tl.int64)
            end = tl.minimum(tl.load(cu_ptr + seq + 1), num_tokens).to(tl.int64)
            t = start
            while t < end:  # a while loop: Triton 3.5's interpreter cannot range() over loaded bounds
                h = _token(h, t, i, n, i_mask, n_mask, x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, y_ptr, a, d_skip, bias,
                           keep, stride_x, stride_dt, stride_z, stride_b, stride_c, stride_y,
                           cstride_x, cstride_dt, cstride_z, cstride_b, cstride_c, HAS_Z, SOFTPLUS, EXACT_BF16)
                t += 1
        tl.store(state_ptr + s_off, cast_out(h, state_ptr, EXACT_BF16_STATE),
                 mask=hn_mask & ((zeros + keep.to(tl.int32)) > 0))


def selective_scan(x, dt, A, B, C, D, z, dt_bias, state, cu_seqlens, state_indices, has_initial_state, *,
                   delta_softplus: bool = True, decode: bool = False):
    """``(y [T, I], state)``; the arguments of ``SelectiveScan.forward_native`` after ``ssm_batch``.
    ``decode`` (T == B) launches the step kernel (one token per program, no sequence loop)."""
    tokens, dim = x.shape
    n_state = A.shape[1]
    seqs = state_indices.shape[0]
    y = torch.empty((tokens, dim), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y, state
    a = A.to(torch.float32).contiguous()
    d_skip = a if D is None else D.contiguous()
    bias = a if dt_bias is None else dt_bias.contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    slots = state_indices.to(torch.int32).contiguous()
    init = has_initial_state.to(torch.int32).contiguous()
    zz = x if z is None else z
    # one more row of programs (prefill) zeroes the tokens past cu_seqlens[B]
    grid = (triton.cdiv(dim, BLOCK_I), seqs + (0 if decode else 1))
    _scan_kernel[grid](
        x, dt, zz, a, B, C, d_skip, bias, state, cu, slots, init, y, dim, n_state, tokens, seqs, state.shape[0],
        x.stride(0), dt.stride(0), zz.stride(0), B.stride(0), C.stride(0), y.stride(0),
        state.stride(0), state.stride(1), state.stride(2),
        x.stride(1), dt.stride(1), zz.stride(1), B.stride(1), C.stride(1),
        HAS_Z=z is not None, HAS_D=D is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(delta_softplus),
        DECODE=bool(decode), BLOCK_I=BLOCK_I, BLOCK_N=triton.next_power_of_2(n_state),
        EXACT_BF16=needs_exact_bf16(x.dtype),
        EXACT_BF16_STATE=needs_exact_bf16(state.dtype), num_warps=4,
    )
    return y, state
