"""Mamba-2's SSD scan (``ssd_chunk_scan``) as Triton kernels: the chunked prefill and the decode step.

Same algorithm as the Pallas kernel (``kernels/pallas/ssd.py``, whose docstring states it): one
program per (head, block of ``BLOCK_P`` head channels) walks the chunks in order with its slice of
the carried state ``[BLOCK_P, N]`` in registers. Per chunk: ``tl.dot`` of C and Bᵀ masked by the
segment decay (a sequence boundary inside the chunk resets the state), times Δ x; then per sequence
touching the chunk, its entering state's output term and its state at its last token in the
chunk (stored as its final state when it ends there, else carried). Chunks are ``min(chunk_size,
64)`` tokens: the tile is a register block here, and results do not depend on it.

Products are float32 ``tl.dot``s: TF32 when x is bfloat16/float16 (the operands came from 8- or
11-bit mantissas, and the tolerance is the low-precision one), IEEE float32 for float32 x.

The decode step (T == B) is elementwise: one program per (sequence, head, channel block).

x, B and C are made contiguous here and the cache is gathered and scattered by torch (any strides).
A non-finite input reaches only its own sequence: a non-finite ``Δ x`` or B enters the chunk's
matmuls as 0 and makes its sequence's later rows (and its state) NaN, a superset of the recurrence's
non-finite outputs within that sequence; other sequences' Δ·A and entering-state terms are selected
away. Tokens past ``cu_seqlens[B]`` (traced metadata) belong to no sequence and give zeros.
The interpreter cannot loop to a runtime bound (Triton 3.5), so interpreted launches loop over a
constexpr bound with masks; compiled ones use the runtime bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.backends import array_namespace
from dualop.kernels import ssm_math
from dualop.kernels.cpu.ssd import finish, token_sequence
from dualop.kernels.cuda import interpreting

__all__ = ["ssd_chunk_scan", "MAX_CHUNK"]

MAX_CHUNK = 64  # tokens per chunk tile (an [L, L] float32 block in registers)


@triton.jit
def _sequence_terms(step, hi, y, carry, c0, da, lanes, seq, cm, bm, xd, bad, cu_ptr, init_ptr, fin_ptr,
                    head, p_offs, n_offs, pn_mask, s_stride_b, s_stride_h, s_stride_p,
                    L: tl.constexpr, PRECISION: tl.constexpr):
    """Sequence ``step``'s share of one chunk: its entering state's output rows and its state at its
    last token here (final state stored, or carried). A step past the chunk's last sequence ``hi``
    (the interpreter's padded loop) changes nothing. Masks are built from comparisons only: the
    interpreter turns ``scalar & tensor`` of booleans into int32. ``bm`` and ``xd`` are finite
    (``bad`` flags the rows that were not): the state of a sequence with such a row is NaN."""
    j = tl.minimum(step, hi)  # a padded step reads the last sequence's metadata; its effects are masked
    start = tl.load(cu_ptr + j)
    end = tl.load(cu_ptr + j + 1)
    first = tl.maximum(start - c0, 0)
    last = tl.minimum(end - c0, L) - 1
    # rows t: Δ·A over [first, t]; rows s: Δ·A over (s, last]; all of it: over [first, last]
    r = lanes[None, :]
    from_first = tl.sum(tl.where((r >= first) & (r <= lanes[:, None]), da[None, :], 0.0), axis=1)
    to_last = tl.sum(tl.where((r > lanes[:, None]) & (r <= last), da[None, :], 0.0), axis=1)
    total = tl.sum(tl.where((lanes >= first) & (lanes <= last), da, 0.0), axis=0)
    active = (n_offs[None, :] * 0 + step) <= hi  # [1, N_PAD]
    state_off = j.to(tl.int64) * s_stride_b + head * s_stride_h + p_offs[:, None] * s_stride_p + n_offs[None, :]
    init = tl.load(init_ptr + state_off, mask=pn_mask & active, other=0.0)
    h_in = tl.where(start < c0, carry, init)  # [BLOCK_P, N_PAD]
    mine = (seq == j) & ((seq * 0 + step) <= hi)
    # the other rows' terms are selected away, not multiplied by 0 (0 x NaN: a NaN state or C row)
    enter = tl.exp(tl.where(mine, from_first, float("-inf")))
    y += tl.where(mine[:, None], enter[:, None] * tl.dot(cm, tl.trans(h_in), input_precision=PRECISION), 0.0)
    weight = tl.exp(tl.where(mine, to_last, float("-inf")))
    h_out = tl.exp(total) * h_in + tl.dot(tl.trans(xd * weight[:, None]), bm, input_precision=PRECISION)
    h_out = tl.where(tl.max(tl.where(mine, bad, 0.0), axis=0) > 0.0, float("nan"), h_out)
    ends = (n_offs[None, :] * 0 + end) <= c0 + L
    tl.store(fin_ptr + state_off, h_out, mask=pn_mask & active & ends)
    carry = tl.where(active & ((n_offs[None, :] * 0 + end) > c0 + L), h_out, carry)
    return y, carry


@triton.jit
def _chunk_step(c, carry, x_ptr, delta_ptr, da_ptr, b_ptr, c_ptr, seq_ptr, lo_ptr, hi_ptr, cu_ptr, init_ptr,
                y_ptr, fin_ptr,
                num_tokens, head, group, p_offs, n_offs, lanes, p_mask, n_mask, pn_mask,
                x_stride_t, x_stride_h, bc_stride_t, bc_stride_g, d_stride_t, s_stride_b, s_stride_h, s_stride_p,
                L: tl.constexpr, MAX_SEQS: tl.constexpr, RUNTIME_LOOP: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk: its outputs, the final states of the sequences ending in it; returns the carry."""
    c0 = c * L
    t = c0 + lanes
    t_mask = t < num_tokens
    t64 = t.to(tl.int64)
    seq = tl.load(seq_ptr + t, mask=t_mask, other=-1)
    dlt = tl.load(delta_ptr + t64 * d_stride_t + head, mask=t_mask, other=0.0)
    da = tl.load(da_ptr + t64 * d_stride_t + head, mask=t_mask, other=0.0)
    x = tl.load(x_ptr + t64[:, None] * x_stride_t + head * x_stride_h + p_offs[None, :],
                mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
    bc_off = t64[:, None] * bc_stride_t + group * bc_stride_g + n_offs[None, :]
    bc_mask = t_mask[:, None] & n_mask[None, :]
    bm = tl.load(b_ptr + bc_off, mask=bc_mask, other=0.0).to(tl.float32)
    cm = tl.load(c_ptr + bc_off, mask=bc_mask, other=0.0).to(tl.float32)
    xd = x * dlt[:, None]
    # A non-finite input reaches only its sequence: Δ x and B enter the matmuls finite (a NaN row
    # times another sequence's zero weights would be NaN), and the rows of a sequence at or after
    # such a token (``bad``) are set to NaN; Δ·A of other sequences is selected away.
    bad = tl.maximum(tl.max(tl.where((xd == xd) & (tl.abs(xd) < float("inf")), 0.0, 1.0), axis=1),
                     tl.max(tl.where((bm == bm) & (tl.abs(bm) < float("inf")), 0.0, 1.0), axis=1))  # [L]
    xd = tl.where((xd == xd) & (tl.abs(xd) < float("inf")), xd, 0.0)
    bm = tl.where((bm == bm) & (tl.abs(bm) < float("inf")), bm, 0.0)
    # seg[t, s]: Δ·A summed over (s, t] directly (a float32 product with a 0/1 matrix), not a
    # difference of running sums, whose rounding grows with the chunk's whole decay
    same = (seq[:, None] == seq[None, :]) & (lanes[:, None] >= lanes[None, :])
    da_upto = tl.where(same, da[None, :], 0.0)
    strict = tl.where(lanes[None, :] < lanes[:, None], 1.0, 0.0)
    seg = tl.dot(da_upto, strict, input_precision="ieee")
    decay = tl.exp(tl.where(same, seg, float("-inf")))
    cb = tl.dot(cm, tl.trans(bm), input_precision=PRECISION)  # non-finite only in a row of a non-finite C
    y = tl.dot(cb * decay, xd, input_precision=PRECISION)
    hits = tl.max(tl.where(same, bad[None, :], 0.0), axis=1)
    y = tl.where(hits[:, None] > 0.0, float("nan"), y)
    lo = tl.load(lo_ptr + c)
    hi = tl.load(hi_ptr + c)
    if RUNTIME_LOOP:
        for j in range(lo, hi + 1):
            y, carry = _sequence_terms(j, hi, y, carry, c0, da, lanes, seq, cm, bm, xd, bad, cu_ptr, init_ptr,
                                       fin_ptr, head, p_offs, n_offs, pn_mask, s_stride_b, s_stride_h,
                                       s_stride_p, L, PRECISION)
    else:
        for k in range(MAX_SEQS):
            y, carry = _sequence_terms(lo + k, hi, y, carry, c0, da, lanes, seq, cm, bm, xd, bad,
                                       cu_ptr, init_ptr, fin_ptr, head, p_offs, n_offs, pn_mask, s_stride_b,
                                       s_stride_h, s_stride_p, L, PRECISION)
    tl.store(y_ptr + t64[:, None] * x_stride_t + head * x_stride_h + p_offs[None, :], y,
             mask=t_mask[:, None] & p_mask[None, :])
    return carry


@triton.jit
def _chunk_scan_kernel(
    x_ptr, delta_ptr, da_ptr, b_ptr, c_ptr, seq_ptr, lo_ptr, hi_ptr, cu_ptr, init_ptr, y_ptr, fin_ptr,
    num_tokens, heads_per_group, num_chunks,
    x_stride_t, x_stride_h, bc_stride_t, bc_stride_g, d_stride_t, s_stride_b, s_stride_h, s_stride_p,
    P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr, L: tl.constexpr,
    NUM_CHUNKS: tl.constexpr, MAX_SEQS: tl.constexpr, RUNTIME_LOOP: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    p_offs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n_offs = tl.arange(0, N_PAD)
    lanes = tl.arange(0, L)
    p_mask = p_offs < P
    n_mask = n_offs < N
    pn_mask = p_mask[:, None] & n_mask[None, :]
    group = head // heads_per_group
    carry = tl.zeros([BLOCK_P, N_PAD], dtype=tl.float32)
    if RUNTIME_LOOP:
        for c in range(num_chunks):
            carry = _chunk_step(c, carry, x_ptr, delta_ptr, da_ptr, b_ptr, c_ptr, seq_ptr, lo_ptr, hi_ptr, cu_ptr, init_ptr, y_ptr, fin_ptr,
                                   num_tokens, head, group, p_offs, n_offs, lanes, p_mask, n_mask, pn_mask,
                                   x_stride_t, x_stride_h, bc_stride_t, bc_stride_g, d_stride_t, s_stride_b, s_stride_h, s_stride_p,
                                   L, MAX_SEQS, RUNTIME_LOOP, PRECISION)
    else:
        for c in range(NUM_CHUNKS):
            carry = _chunk_step(c, carry, x_ptr, delta_ptr, da_ptr, b_ptr, c_ptr, seq_ptr, lo_ptr, hi_ptr, cu_ptr, init_ptr, y_ptr, fin_ptr,
                                   num_tokens, head, group, p_offs, n_offs, lanes, p_mask, n_mask, pn_mask,
                                   x_stride_t, x_stride_h, bc_stride_t, bc_stride_g, d_stride_t, s_stride_b, s_stride_h, s_stride_p,
                                   L, MAX_SEQS, RUNTIME_LOOP, PRECISION)


@triton.jit
def _decode_kernel(x_ptr, delta_ptr, da_ptr, b_ptr, c_ptr, init_ptr, y_ptr, fin_ptr, heads_per_group,
                   x_stride_t, x_stride_h, bc_stride_t, bc_stride_g, d_stride_t, s_stride_b, s_stride_h, s_stride_p,
                   P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr, N_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p_offs = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n_offs = tl.arange(0, N_PAD)
    p_mask = p_offs < P
    n_mask = n_offs < N
    pn_mask = p_mask[:, None] & n_mask[None, :]
    group = head // heads_per_group
    dlt = tl.load(delta_ptr + b * d_stride_t + head)
    decay = tl.exp(tl.load(da_ptr + b * d_stride_t + head))
    x = tl.load(x_ptr + b * x_stride_t + head * x_stride_h + p_offs, mask=p_mask, other=0.0).to(tl.float32)
    bc_off = b * bc_stride_t + group * bc_stride_g + n_offs
    bv = tl.load(b_ptr + bc_off, mask=n_mask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + bc_off, mask=n_mask, other=0.0).to(tl.float32)
    state_off = b * s_stride_b + head * s_stride_h + p_offs[:, None] * s_stride_p + n_offs[None, :]
    h = decay * tl.load(init_ptr + state_off, mask=pn_mask, other=0.0) + (dlt * x)[:, None] * bv[None, :]
    tl.store(fin_ptr + state_off, h, mask=pn_mask)
    tl.store(y_ptr + b * x_stride_t + head * x_stride_h + p_offs, tl.sum(h * cv[None, :], axis=1), mask=p_mask)


def ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
                   chunk_size: int = 256, delta_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, float("inf"))):
    """``(y [T, H, P] in x's dtype, ssm_state)`` of ``ssm_math.ssd_reference`` for validated,
    complete serving metadata; the cache is updated in place."""
    xp = array_namespace(x)
    tokens, heads, head_dim = x.shape
    num_seqs = state_indices.shape[0]
    groups, state = B.shape[1], B.shape[2]
    dev = x.device
    delta = ssm_math.process_dt(xp, dt, dt_bias, delta_softplus, dt_limit).contiguous()  # [T, H] float32
    d_a = (delta * A.to(torch.float32)).contiguous()
    init = ssm_math.initial_states(xp, ssm_state, state_indices, has_initial_state).contiguous()
    xc, bc, cc = x.contiguous(), B.contiguous(), C.contiguous()
    y = torch.empty((tokens, heads, head_dim), dtype=torch.float32, device=dev)
    finals = init.clone()  # a sequence the kernel writes no state for (an empty one) keeps its starting state
    block_p = max(16, min(triton.next_power_of_2(head_dim), 32))
    n_pad = max(16, triton.next_power_of_2(state))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = (heads // groups, xc.stride(0), xc.stride(1), bc.stride(0), bc.stride(1), delta.stride(0),
              init.stride(0), init.stride(1), init.stride(2))
    if tokens == num_seqs:
        seq = torch.arange(tokens, device=dev)
        _decode_kernel[(tokens, heads, triton.cdiv(head_dim, block_p))](
            xc, delta, d_a, bc, cc, init, y, finals, *common,
            P=head_dim, N=state, BLOCK_P=block_p, N_PAD=n_pad, num_warps=4)
    else:
        chunk = min(MAX_CHUNK, max(16, triton.next_power_of_2(int(chunk_size))))
        num_chunks = triton.cdiv(tokens, chunk)
        cu = cu_seqlens.to(torch.int32).contiguous()
        seq = token_sequence(cu, tokens)  # B: no sequence
        starts = torch.arange(num_chunks, device=dev) * chunk
        lo = seq[starts].contiguous()  # B for a chunk past cu_seqlens[B]: no step runs
        hi = torch.clamp(seq[torch.clamp(starts + chunk, max=tokens) - 1], max=num_seqs - 1).contiguous()
        runtime = not interpreting()
        _chunk_scan_kernel[(heads, triton.cdiv(head_dim, block_p))](
            xc, delta, d_a, bc, cc, seq, lo, hi, cu, init, y, finals,
            tokens, heads // groups, num_chunks, *common[1:],
            P=head_dim, N=state, BLOCK_P=block_p, N_PAD=n_pad, L=chunk,
            NUM_CHUNKS=1 if runtime else num_chunks, MAX_SEQS=1 if runtime else num_seqs,
            RUNTIME_LOOP=runtime, PRECISION=precision, num_warps=4)
    return finish(x, y, D, z, ssm_state, state_indices, seq, finals)
