"""Mamba-2's SSD scan (``ssd_chunk_scan``) on the torch CPU: the chunked state-space-duality form as
batched matmuls (ATen's GEMMs do the work), the same algorithm as the Pallas kernel
(``kernels/pallas/ssd.py``: segment-masked ``C Bᵀ`` within a chunk, each sequence's entering state
and its state at its last token in the chunk, the carried state between chunks), and for decode
(T == B) the selective scan's C++ loop, one step per sequence over the heads' rows. float32
compute; y in x's dtype; the cache updated in place.

The sequence boundaries are host values here (the CPU reads ``cu_seqlens``), so each sequence's
entering/leaving terms touch only its own rows of the chunk; within a chunk other sequences'
operands are selected away, so a non-finite input stays in its sequence.
"""

from __future__ import annotations

import torch

from dualop.backends import array_namespace
from dualop.kernels import ssm_math
from dualop.kernels.cpu.selective_scan import scan_channels

__all__ = ["ssd_chunk_scan", "finish", "token_sequence"]


def token_sequence(cu_seqlens, num_tokens: int):
    """Each token's sequence ``[T]`` int32, B for a token outside ``[cu[0], cu[B])`` (no sequence),
    as ``ssm_math.sequence_layout`` says, by a binary search (no ``[T, B]`` comparison)."""
    num_seqs = cu_seqlens.shape[0] - 1
    t = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), t, right=True).to(torch.int32)
    return torch.where(t < cu_seqlens[0], num_seqs, seq)


def _decode(x, delta, A, B, C, D, z, ssm_state, cu_seqlens, state_indices, has_initial_state):
    """One token per sequence (T == B), on selective_scan's C++ loop (``csrc/selective_scan.cc``)
    with the heads' ``H * P`` rows as its channels: each head's decay ``exp(Δ A)`` and step
    repeated over its P rows, B and C read per group. The state is the large operand (``[B, H, P,
    N]``, memory-bound): the loop reads each slot and writes it back in place, once, in the cache's
    dtype. Returns ``(y [T, H, P] in x's dtype, ssm_state)``."""
    tokens, heads, head_dim = x.shape
    channels, n = heads * head_dim, B.shape[2]
    cache = ssm_state.contiguous()  # the cache itself unless strided; then written back below
    per_row = torch.repeat_interleave
    d = None if D is None else (per_row(D.to(torch.float32), head_dim) if D.ndim == 1 else D.reshape(channels))
    y, _ = scan_channels(
        "ssd_chunk_scan", x.reshape(tokens, channels), per_row(delta, head_dim, dim=1),
        per_row(A.to(torch.float32), head_dim)[:, None].expand(channels, n), B, C, d,
        None if z is None else z.reshape(tokens, channels), cache.view(cache.shape[0], channels, n),
        cu_seqlens, state_indices, has_initial_state)
    if cache is not ssm_state:
        ssm_state.copy_(cache)
    return y.view(tokens, heads, head_dim), ssm_state


def _prefill(x, delta, a, bmat, cmat, init, cu: list[int], chunk: int):
    """y ``[T, H, P]`` and final states ``[B, H, P, N]`` (float32) of the chunked scan."""
    tokens, heads, head_dim = x.shape
    groups = bmat.shape[1]
    per_group = heads // groups
    finals = init.clone()  # an empty sequence (traced metadata) keeps its starting state
    y = torch.empty_like(x)
    xd = x * delta[:, :, None]  # Δ_s x_s
    dA = delta * a
    seq_of = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    carry = None
    seq = 0
    for c0 in range(0, tokens, chunk):
        c1 = min(c0 + chunk, tokens)
        length = c1 - c0
        da = dA[c0:c1].T.contiguous()  # [H, L]
        s_ids = seq_of[c0:c1]
        same = (s_ids[:, None] == s_ids[None, :]).tril()
        # seg[t, s]: Δ·A summed over (s, t] as partial sums from s (a cumsum down each column), not
        # a difference of running sums, whose rounding grows with the chunk's whole decay
        seg = torch.cumsum(da[:, :, None].expand(heads, length, length).tril(-1), dim=1)
        seg = torch.where(same, seg, float("-inf")).exp_()  # [H, L, L]
        cb = torch.einsum("tgn,sgn->gts", cmat[c0:c1], bmat[c0:c1])  # [G, L, L]
        # other sequences' operands are selected away (0 x NaN would reach every sequence here);
        # a non-finite Δ x enters the matmul as 0 and makes its sequence's later rows NaN
        w = torch.where(same, seg.view(groups, per_group, length, length) * cb[:, None], 0.0)
        xd_c = xd[c0:c1].transpose(0, 1)  # [H, L, P]
        finite = torch.isfinite(xd_c)
        y_c = torch.matmul(w.view(heads, length, length), torch.where(finite, xd_c, 0.0))  # [H, L, P]
        hits = (same[None] & ~finite.all(-1)[:, None, :]).any(-1)  # [H, L]
        y_c = torch.where(hits[:, :, None], float("nan"), y_c)
        c_g = cmat[c0:c1].transpose(0, 1)  # [G, L, N]
        b_g = bmat[c0:c1].transpose(0, 1)
        while seq < len(cu) - 1 and cu[seq] < c1:
            start, end = cu[seq], cu[seq + 1]
            if start == end:  # empty: its final state stays its starting one
                seq += 1
                continue
            first, last = max(start - c0, 0), min(end, c1) - c0 - 1
            h_in = carry if start < c0 else init[seq]  # [H, P, N]
            rows = slice(first, last + 1)
            from_first = torch.cumsum(da[:, rows], dim=1)  # Δ·A over [first, t]
            enter = torch.exp(from_first)  # [H, l]
            h_g = h_in.view(groups, per_group, head_dim, -1)
            y_c[:, rows] += (torch.einsum("gln,gkpn->gklp", c_g[:, rows], h_g).reshape(heads, -1, head_dim)
                             * enter[:, :, None])
            to_last = torch.exp(torch.cumsum(da[:, rows].flip(1), dim=1).flip(1) - da[:, rows])  # over (s, last]
            xw = (xd[c0:c1][rows].transpose(0, 1) * to_last[:, :, None]).view(groups, per_group, -1, head_dim)
            h_out = (torch.exp(from_first[:, -1])[:, None, None] * h_in
                     + torch.einsum("gklp,gln->gkpn", xw, b_g[:, rows]).reshape(heads, head_dim, -1))
            if end <= c1:
                finals[seq] = h_out
                seq += 1
            else:
                carry = h_out
                break
        y[c0:c1] = y_c.transpose(0, 1)
    return y, finals


def ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
                   chunk_size: int = 256, delta_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, float("inf"))):
    """``(y [T, H, P] in x's dtype, ssm_state)`` of ``ssm_math.ssd_reference`` for validated,
    complete serving metadata; the cache is updated in place."""
    xp = array_namespace(x)
    tokens = x.shape[0]
    num_seqs = state_indices.shape[0]
    f32 = torch.float32
    # bad metadata (traced, or a direct call) read as the native body reads it: indices in bounds
    cu_seqlens, state_indices = ssm_math.sanitize_metadata(xp, cu_seqlens, state_indices, tokens,
                                                           ssm_state.shape[0])
    delta = ssm_math.process_dt(xp, dt, dt_bias, delta_softplus, dt_limit)
    if tokens == num_seqs:
        return _decode(x, delta, A, B, C, D, z, ssm_state, cu_seqlens, state_indices, has_initial_state)
    init = ssm_math.initial_states(xp, ssm_state, state_indices, has_initial_state)
    cu = cu_seqlens.tolist()
    owned = cu[-1]  # tokens past it belong to no sequence: zeros
    y, finals = _prefill(x[:owned].to(f32), delta[:owned], A.to(f32), B[:owned].to(f32), C[:owned].to(f32), init,
                         cu, max(1, int(chunk_size)))
    if owned < tokens:
        y = torch.cat([y, y.new_zeros((tokens - owned, *y.shape[1:]))])
    seq = token_sequence(cu_seqlens, tokens)
    return finish(x, y, D, z, ssm_state, state_indices, seq, finals)


def finish(x, y, D, z, ssm_state, state_indices, seq, finals):
    """The elementwise tail every torch path shares (here and the Triton kernels): ``y + D x``,
    times ``silu(z)``, the rows of padding sequences and of no sequence (``seq``: each token's
    sequence, B for none) zeroed by a select, cast to x's dtype; the final states written into the
    cache (in place)."""
    f32 = torch.float32
    if D is not None:
        d = D.to(f32)
        y.addcmul_(d[:, None] if d.ndim == 1 else d, x.to(f32))
    if z is not None:
        y.mul_(torch.nn.functional.silu(z.to(f32)))
    y = torch.where(ssm_math.token_keep(array_namespace(x), state_indices, seq)[:, None, None], y, 0.0)
    return y.to(x.dtype), ssm_math.store_states(array_namespace(x), ssm_state, state_indices, finals)
