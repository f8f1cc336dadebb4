"""Mamba-2's SSD scan (``ssd_chunk_scan``) as Pallas TPU kernels: the chunked prefill and the
single-token decode step. Same contract as ``ssm_math.ssd_reference`` (float32 compute, y in x's
dtype, the cache updated through ``store_states``).

Prefill (the state-space-duality chunked form, Mamba-2 paper section 6): the packed tokens are cut
into chunks of ``chunk_size``; the grid is (heads, chunks), heads ``parallel``, chunks in order
(``arbitrary``) with the carried state ``[P, N]`` of the head in VMEM scratch. Per chunk, with
``seg[t, s]`` the sum of ``Δ·A`` over tokens ``(s, t]`` (summed directly, one matmul with a 0/1
matrix: a difference of running sums would round with the chunk's whole decay):

- within the chunk, all sequences at once on the MXU: ``y = ((C Bᵀ) ⊙ L) (Δ ⊙ x)`` where the
  segment mask ``L[t, s] = exp(seg[t, s])`` for ``s <= t`` in the same sequence, else 0 (a
  sequence boundary inside the chunk resets the state);
- per sequence touching the chunk (a loop over its ``[lo, hi]`` range, read from SMEM): the state
  it enters the chunk with (the carried state, or its initial state when it starts here) adds
  ``exp(Δ·A over [first, t]) C_t h_in`` to its rows, and its state at its last token ``e`` in the
  chunk, ``exp(Δ·A over [first, e]) h_in + (Δ x ⊙ exp(Δ·A over (s, e]))ᵀ B`` (one matmul), is written to its
  final state when it ends here, else carried into the next chunk.

Initial and final states of the B sequences of one head stay resident in VMEM (``[B, P, N]``
float32 each) while the head's chunks run; the final states go into the cache after the kernel.

Decode (T == B): one grid step per (sequence, block of heads): ``h = exp(Δ A) h0 + Δ x ⊗ B``,
``y = h C``, elementwise on the VPU (there is no matmul in one token).

D, the z gate, zeroing padding sequences' rows and the cache write are XLA code around the kernels
(elementwise, fused by XLA).

A non-finite input reaches only its own sequence: a non-finite ``Δ x`` or B enters the chunk's
matmuls as 0 and its sequence's later rows in the chunk and its state are set to NaN (a superset of
the recurrence's non-finite outputs, within that sequence); other sequences' Δ·A and entering-state
terms are selected away, never multiplied by a zero mask. Tokens past ``cu_seqlens[B]`` (traced metadata that ends early)
belong to no sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost, ssd_chunk_scan_cost
from dualop.kernels.pallas.common import compiler_params, cost_estimate, rowwise_batching, tpu_jit
from dualop.backends import array_namespace

__all__ = ["ssd_chunk_scan", "SSDBlocks", "ssd_blocks"]


@dataclasses.dataclass(frozen=True)
class SSDBlocks:
    """Tiles: ``chunk`` tokens per prefill grid step, ``decode_heads`` heads per decode step."""

    chunk: int
    decode_heads: int


def ssd_blocks(num_tokens: int, heads: int, chunk_size: int) -> SSDBlocks:
    """The chunk is ``chunk_size`` rounded to the sublane tile (8), no longer than the padded
    token count (results do not depend on it); decode takes 8 heads per step when they divide H."""
    chunk = min(int(chunk_size), max(8, -(-num_tokens // 8) * 8))
    chunk = max(8, chunk // 8 * 8)
    return SSDBlocks(chunk=chunk, decode_heads=8 if heads % 8 == 0 else heads)


def _chunk_kernel(cu_ref, lo_ref, hi_ref,  # scalar prefetch (SMEM)
                  seq_row_ref, seq_col_ref, da_ref, bad_ref, dlt_ref, x_ref, b_ref, c_ref, init_ref,
                  y_ref, fin_ref, carry_ref, *, chunk: int):
    c = pl.program_id(1)
    c0 = c * chunk
    hi_prec = jax.lax.Precision.HIGHEST
    x = x_ref[...].astype(jnp.float32)  # [L, P]
    bm = b_ref[...].astype(jnp.float32)  # [L, N]
    cm = c_ref[...].astype(jnp.float32)
    da = da_ref[...]  # Δ·A of the chunk's tokens, a [1, L] row
    seq_r, seq_c = seq_row_ref[...], seq_col_ref[...]
    xd = x * dlt_ref[...]  # Δ_s x_s
    # A non-finite input reaches only its sequence: Δ x and B enter the matmuls finite (a NaN row
    # times another sequence's zero weights would be NaN), and the rows (and the state) of a
    # sequence at or after such a token are set to NaN (``bad_ref``: the same flags as a [1, L] row).
    xd_ok, bm_ok = jnp.isfinite(xd), jnp.isfinite(bm)
    bad = jnp.maximum(jnp.max(jnp.where(xd_ok, 0.0, 1.0), axis=1, keepdims=True),
                      jnp.max(jnp.where(bm_ok, 0.0, 1.0), axis=1, keepdims=True))  # [L, 1]
    xd, bm = jnp.where(xd_ok, xd, 0.0), jnp.where(bm_ok, bm, 0.0)

    # The segment sums seg[t, s] = sum of Δ·A over (s, t], summed directly (one matmul of the
    # masked row with a 0/1 matrix), not as a difference of running sums, whose rounding grows
    # with the chunk's total decay.
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    same = (seq_c == seq_r) & (row >= col)  # [t, s]: s <= t in t's sequence
    da_upto = jnp.where(same, da, 0.0)  # [t, r]: Δ·A_r for r <= t in t's sequence (selected, not masked)
    seg = jnp.dot(da_upto, (col < row).astype(jnp.float32), precision=hi_prec,
                  preferred_element_type=jnp.float32)  # [t, s]: sum over s < r <= t
    # Within the chunk: the segment-masked C Bᵀ times Δ x (non-finite only in a row of a non-finite C).
    decay = jnp.exp(jnp.where(same, seg, -jnp.inf))
    cb = jax.lax.dot_general(cm, bm, (((1,), (1,)), ((), ())), precision=hi_prec,
                             preferred_element_type=jnp.float32)
    y = jnp.dot(cb * decay, xd, precision=hi_prec, preferred_element_type=jnp.float32)
    hits = jnp.max(jnp.where(same, bad_ref[...], 0.0), axis=1, keepdims=True)  # [L, 1]
    y = jnp.where(hits > 0.0, jnp.nan, y)

    def per_sequence(j, y):
        start, end = cu_ref[j], cu_ref[j + 1]
        first = jnp.maximum(start - c0, 0)
        last = jnp.minimum(end - c0, chunk) - 1
        h_in = jnp.where(start < c0, carry_ref[...], init_ref[j])
        mine = seq_c == j  # [L, 1]
        # rows t: Δ·A over [first, t]; rows s: Δ·A over (s, last]; all of it: over [first, last]
        from_first = jnp.sum(jnp.where((col >= first) & (col <= row), da, 0.0), axis=1, keepdims=True)
        to_last = jnp.sum(jnp.where((col > row) & (col <= last), da, 0.0), axis=1, keepdims=True)
        total = jnp.sum(jnp.where((col[:1] >= first) & (col[:1] <= last), da, 0.0), axis=1, keepdims=True)
        enter = jnp.exp(jnp.where(mine, from_first, -jnp.inf))
        y = y + jnp.where(mine, enter * jax.lax.dot_general(cm, h_in, (((1,), (1,)), ((), ())), precision=hi_prec,
                                                            preferred_element_type=jnp.float32), 0.0)
        weight = jnp.exp(jnp.where(mine, to_last, -jnp.inf))
        h_out = jnp.exp(total) * h_in + jax.lax.dot_general(
            xd * weight, bm, (((0,), (0,)), ((), ())), precision=hi_prec, preferred_element_type=jnp.float32)
        h_out = jnp.where(jnp.max(jnp.where(mine, bad, 0.0)) > 0.0, jnp.nan, h_out)

        @pl.when(end <= c0 + chunk)
        def _():
            fin_ref[j] = h_out

        @pl.when(end > c0 + chunk)
        def _():
            carry_ref[...] = h_out

        return y

    y = jax.lax.fori_loop(lo_ref[c], hi_ref[c] + 1, per_sequence, y)
    y_ref[...] = y


def _step_kernel(dec_ref, dlt_ref, x_ref, b_ref, c_ref, init_ref, y_ref, fin_ref, *, heads: int):
    for k in range(heads):
        h = (dec_ref[k:k + 1, :] * init_ref[k]
             + (dlt_ref[k:k + 1, :] * x_ref[k].astype(jnp.float32)) * b_ref[k:k + 1, :].astype(jnp.float32))
        fin_ref[k] = h
        y_ref[k] = jnp.sum(h * c_ref[k:k + 1, :].astype(jnp.float32), axis=1, keepdims=True)


def _prefill(x, delta, a, bmat, cmat, init, cu, seq, num_seqs: int, chunk: int, interpret):
    """y ``[T, H, P]`` float32 and the final states ``[B, H, P, N]`` float32 of the chunked scan."""
    tokens, heads, head_dim = x.shape
    groups, state = bmat.shape[1], bmat.shape[2]
    per_group = heads // groups
    chunks = -(-tokens // chunk)
    padded = chunks * chunk
    pad = padded - tokens
    seq_p = jnp.pad(seq, (0, pad), constant_values=num_seqs)
    delta_p = jnp.pad(delta, ((0, pad), (0, 0)))  # padding tokens: Δ = 0, no decay, no input
    d_a = (delta_p * a).T  # [H, Tp]
    x_t = jnp.pad(x, ((0, pad), (0, 0), (0, 0))).transpose(1, 0, 2)  # [H, Tp, P]
    # a token's flag per head: a non-finite Δ x or B (the kernel's own test, as a [1, L] row per chunk)
    bad_b = jnp.take(jnp.any(~jnp.isfinite(bmat), axis=2), jnp.arange(heads) // per_group, axis=1)  # [T, H]
    bad = (jnp.any(~jnp.isfinite(x_t * delta_p.T[:, :, None]), axis=2)
           | jnp.pad(bad_b, ((0, pad), (0, 0))).T).astype(jnp.float32)  # [H, Tp]
    b_t = jnp.pad(bmat, ((0, pad), (0, 0), (0, 0))).transpose(1, 0, 2)  # [G, Tp, N]
    c_t = jnp.pad(cmat, ((0, pad), (0, 0), (0, 0))).transpose(1, 0, 2)
    starts = jnp.arange(chunks, dtype=jnp.int32) * chunk
    lo = seq_p[starts]  # B when the chunk starts past cu_seqlens[B]: no sequence, an empty loop
    hi = jnp.minimum(jnp.take(seq, jnp.minimum(starts + chunk, tokens) - 1), num_seqs - 1)
    init_t = init.transpose(1, 0, 2, 3)  # [H, B, P, N]

    def tok(h, c, *_):
        return (h, c, 0)

    def group_tok(h, c, *_):  # lax.div: jnp's floor division lowers through sign, which asks the device
        return (jax.lax.div(h, per_group), c, 0)

    in_specs = [
        pl.BlockSpec((None, 1, chunk), lambda h, c, *_: (c, 0, 0)),  # rows [chunks, 1, L]: whole last dims
        pl.BlockSpec((chunk, 1), lambda h, c, *_: (c, 0)),
        pl.BlockSpec((None, None, 1, chunk), lambda h, c, *_: (h, c, 0, 0)),
        pl.BlockSpec((None, None, 1, chunk), lambda h, c, *_: (h, c, 0, 0)),
        pl.BlockSpec((None, chunk, 1), tok),
        pl.BlockSpec((None, chunk, head_dim), tok),
        pl.BlockSpec((None, chunk, state), group_tok),
        pl.BlockSpec((None, chunk, state), group_tok),
        pl.BlockSpec((None, num_seqs, head_dim, state), lambda h, c, *_: (h, 0, 0, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, chunk, head_dim), tok),
        pl.BlockSpec((None, num_seqs, head_dim, state), lambda h, c, *_: (h, 0, 0, 0)),
    ]
    isz = x.dtype.itemsize
    states_bytes = 2 * 2 * num_seqs * head_dim * state * 4
    tiles = 2 * chunk * (head_dim * (isz + 4) + 2 * state * isz + 4 * 128 * 4) + 8 * chunk * chunk * 4
    vmem = states_bytes + tiles + head_dim * state * 4
    y_t, fin_t = pl.pallas_call(
        functools.partial(_chunk_kernel, chunk=chunk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(heads, chunks), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((head_dim, state), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((heads, padded, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((heads, num_seqs, head_dim, state), jnp.float32)],
        compiler_params=compiler_params(2, vmem_bytes=vmem, semantics=("parallel", "arbitrary")),
        cost_estimate=cost_estimate(ssd_chunk_scan_cost(tokens, heads, head_dim, state, groups, num_seqs, chunk, isz)),
        interpret=interpret,
        name="dualop_ssd_chunk_scan",
    )(cu, lo, hi, seq_p.reshape(chunks, 1, chunk), seq_p[:, None], d_a.reshape(heads, chunks, 1, chunk),
      bad.reshape(heads, chunks, 1, chunk), delta_p.T[:, :, None], x_t, b_t, c_t, init_t)
    return y_t.transpose(1, 0, 2)[:tokens], fin_t.transpose(1, 0, 2, 3)


def _decode(x, delta, a, bmat, cmat, init, heads_per_step: int, interpret):
    """One token per sequence: y ``[B, H, P]`` and the new states ``[B, H, P, N]``, float32."""
    seqs, heads, head_dim = x.shape
    groups, state = bmat.shape[1], bmat.shape[2]
    head_group = jnp.arange(heads) // (heads // groups)
    bh, ch = bmat[:, head_group], cmat[:, head_group]  # [B, H, N]
    hb = heads_per_step
    blk3 = lambda b, h: (b, h, 0)  # noqa: E731
    blk4 = lambda b, h: (b, h, 0, 0)  # noqa: E731
    vmem = 4 * hb * (2 * head_dim * state * 4 + head_dim * 128 * 8 + 4 * 128 * 4)
    y, fin = pl.pallas_call(
        functools.partial(_step_kernel, heads=hb),
        grid=(seqs, heads // hb),
        in_specs=[pl.BlockSpec((None, hb, 1), blk3), pl.BlockSpec((None, hb, 1), blk3),
                  pl.BlockSpec((None, hb, head_dim, 1), blk4), pl.BlockSpec((None, hb, state), blk3),
                  pl.BlockSpec((None, hb, state), blk3), pl.BlockSpec((None, hb, head_dim, state), blk4)],
        out_specs=[pl.BlockSpec((None, hb, head_dim, 1), blk4), pl.BlockSpec((None, hb, head_dim, state), blk4)],
        out_shape=[jax.ShapeDtypeStruct((seqs, heads, head_dim, 1), jnp.float32),
                   jax.ShapeDtypeStruct((seqs, heads, head_dim, state), jnp.float32)],
        compiler_params=compiler_params(2, vmem_bytes=vmem),
        cost_estimate=cost_estimate(KernelCost(
            flops=5 * seqs * heads * head_dim * state, transcendentals=seqs * heads,
            bytes_accessed=2 * seqs * heads * head_dim * (state * 4 + x.dtype.itemsize))),
        interpret=interpret,
        name="dualop_ssd_decode_step",
    )(jnp.exp(delta * a)[:, :, None], delta[:, :, None], x[..., None], bh, ch, init)
    return y[..., 0], fin


@tpu_jit(static_argnames=("chunk_size", "delta_softplus", "dt_limit", "interpret"))
def ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
                   chunk_size: int = 256, delta_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, float("inf")), interpret=False):
    """``(y [T, H, P] in x's dtype, ssm_state)`` of ``ssm_math.ssd_reference`` for validated,
    complete serving metadata (``SSMBatch``); the decode kernel when T == B, else the chunked one.
    Under ``vmap`` (independent serving batches) the batch is mapped with ``lax.map``, one kernel
    call per batch item."""
    arrays = (x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state)
    present = tuple(a is not None for a in arrays)
    static = dict(chunk_size=chunk_size, delta_softplus=delta_softplus, dt_limit=dt_limit, interpret=interpret)

    def call(*given):
        it = iter(given)
        return _ssd_chunk_scan(*(next(it) if p else None for p in present), **static)

    return rowwise_batching(call, 0)(*(a for a in arrays if a is not None))


def _ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
                    chunk_size, delta_softplus, dt_limit, interpret):
    xp = array_namespace(x)
    tokens, heads, _ = x.shape
    num_seqs = state_indices.shape[0]
    # every index the kernels read in bounds, bad traced metadata read as the native body reads it
    cu_seqlens, state_indices = ssm_math.sanitize_metadata(xp, cu_seqlens, state_indices, tokens,
                                                           ssm_state.shape[0])
    delta = ssm_math.process_dt(xp, dt, dt_bias, delta_softplus, dt_limit)  # [T, H] float32
    a = A.astype(jnp.float32)
    init = ssm_math.initial_states(xp, ssm_state, state_indices, has_initial_state)
    blocks = ssd_blocks(tokens, heads, chunk_size)
    if tokens == num_seqs:
        y, finals = _decode(x, delta, a, B, C, init, blocks.decode_heads, interpret)
        seq = jnp.arange(tokens, dtype=jnp.int32)
    else:
        seq = ssm_math.sequence_layout(xp, cu_seqlens, tokens)[0]
        y, finals = _prefill(x, delta, a, B, C, init, cu_seqlens, seq, num_seqs, blocks.chunk, interpret)
        # an empty sequence (traced metadata) writes no final state: its slot keeps its starting one
        finals = jnp.where((cu_seqlens[1:] == cu_seqlens[:-1])[:, None, None, None], init, finals)
    xf = x.astype(jnp.float32)
    if D is not None:
        d = D.astype(jnp.float32)
        y = y + (d[:, None] if d.ndim == 1 else d) * xf
    if z is not None:
        y = y * jax.nn.silu(z.astype(jnp.float32))
    y = jnp.where(ssm_math.token_keep(xp, state_indices, seq)[:, None, None], y, 0.0)
    return y.astype(x.dtype), ssm_math.store_states(xp, ssm_state, state_indices, finals)

