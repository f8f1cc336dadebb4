"""Mamba-1's selective scan as Pallas TPU kernels: the ``selective_scan`` op's fast path.

Contract: ``ssm_math.selective_scan_reference`` over a validated serving batch (``ops/ssm_batch.py``),
same arguments, ``(y [T, I] in x's dtype, new cache)``.

Layout: the state of a block of channels is ``[N, I_block]`` (N on sublanes, channels on the
128 lanes), so every step is whole-vreg work; A enters as ``A.T`` ``[N, I]`` and B, C as ``[N, T]``
(XLA transposes; B and C are small). Each token's B/C column is picked out of the chunk's
``[N, T_chunk]`` block by a lane select and a lane sum (no dynamic lane slicing); tokens are taken
in groups of 16 rows (one aligned load/store of x, dt, z, y per group, whole packed bf16 tiles).

Prefill (``_prefill_kernel``): grid ``(I blocks, chunks of T)``, channels parallel, chunks
sequential; ``cu_seqlens``, each chunk's first sequence, the sequence after each one's end (empty
ones skipped) and the padding flags are scalar-prefetched (SMEM); tokens past ``cu_seqlens[B]``
(traced metadata that ends early) belong to no sequence and read or write no state. The state
lives in VMEM scratch across the chunk loop; a sequence that starts inside a chunk loads its
initial state by DMA from the HBM array of initial states, and a sequence that ends writes its
final state by DMA to the HBM array of final states (both ``[B, N, I]``, gathered from and
scattered to the cache by XLA around the kernel).

Decode (``_decode_kernel``, T == B: each token its own sequence): grid ``(I blocks, blocks of 16
sequences)``, all parallel; initial and final states stream as ``[16, N, I_block]`` blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.backends import array_namespace
from dualop.kernels import ssm_math
from dualop.kernels.cost import selective_scan_cost
from dualop.kernels.pallas.common import compiler_params, cost_estimate, tpu_jit

__all__ = ["selective_scan", "ScanBlocks", "scan_blocks"]

_GROUP = 16  # tokens per aligned row group (a packed bf16 tile's sublanes)
_LANES = 128


@dataclasses.dataclass(frozen=True)
class ScanBlocks:
    """Block sizes: ``channels`` per I block (a multiple of 128, or all of I) and ``chunk`` tokens
    per T block (a multiple of 128 when T spans several chunks, else T rounded up to 16)."""

    channels: int
    chunk: int


def scan_blocks(tokens: int, dim: int, *, channels: int = 512, chunk: int = 256) -> ScanBlocks:
    """The blocks for ``tokens`` x ``dim``: whole I when it is not a multiple of 128 (the block
    must then span it), else the largest multiple of 128 up to ``channels`` dividing I."""
    if dim % _LANES:
        block_i = dim
    else:
        block_i = max(c for c in range(_LANES, min(channels, dim) + 1, _LANES) if dim % c == 0)
    padded = pl.cdiv(max(tokens, 1), _GROUP) * _GROUP
    return ScanBlocks(block_i, padded if padded <= chunk else chunk)


def _step(h, d, xv, a_t, b_col, c_col):
    """One token of a channel block: ``h [N, Ib]``, ``d``/``xv`` ``[1, Ib]``, ``b_col``/``c_col``
    ``[N, 1]``; returns the new state and ``sum_n h C`` ``[1, Ib]``."""
    h = jnp.exp(d * a_t) * h + (d * xv) * b_col
    return h, jnp.sum(h * c_col, axis=0, keepdims=True)


def _column(block, lane_ids, index):
    """Column ``index`` of ``block`` ``[N, L]`` as ``[N, 1]`` (a select and a lane sum)."""
    return jnp.sum(jnp.where(lane_ids == index, block, 0.0), axis=1, keepdims=True)


def _group_rows(refs, start, rows):
    return [r[pl.ds(start, rows), :].astype(jnp.float32) if r is not None else None for r in refs]


def _finish(y, xv, d_skip, zv):
    if d_skip is not None:
        y = y + d_skip * xv
    if zv is not None:
        y = y * (zv * jax.nn.sigmoid(zv))
    return y


def _delta(dt_rows, bias, softplus):
    d = dt_rows if bias is None else dt_rows + bias
    return jax.nn.softplus(d) if softplus else d


def _prefill_kernel(cu_ref, first_seq_ref, next_seq_ref, keep_ref, *refs, tokens, chunk, has_d, has_z, has_bias,
                    softplus):
    it = iter(refs)
    x_ref, dt_ref = next(it), next(it)
    z_ref = next(it) if has_z else None
    bt_ref, ct_ref, at_ref = next(it), next(it), next(it)
    d_ref = next(it) if has_d else None
    bias_ref = next(it) if has_bias else None
    init_hbm, y_ref, final_hbm, h_ref, sem = next(it), next(it), next(it), next(it), next(it)

    block_i = x_ref.shape[1]
    num_seqs = keep_ref.shape[0]  # seq == num_seqs: a token no sequence owns
    i0 = pl.program_id(0) * block_i
    t0 = pl.program_id(1) * chunk
    a_t = at_ref[...]
    b_all, c_all = bt_ref[...].astype(jnp.float32), ct_ref[...].astype(jnp.float32)
    d_skip = d_ref[...].astype(jnp.float32) if has_d else None
    bias = bias_ref[...].astype(jnp.float32) if has_bias else None
    lane_ids = jax.lax.broadcasted_iota(jnp.int32, b_all.shape, 1)
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (_GROUP, block_i), 0)

    def state_dma(seq, to_hbm):
        whole = final_hbm if to_hbm else init_hbm
        if block_i == whole.shape[2]:  # one block spans I (which need not be lane-aligned)
            hbm = whole.at[seq]
        else:
            hbm = whole.at[seq, :, pl.ds(pl.multiple_of(i0, _LANES), block_i)]
        return pltpu.make_async_copy(h_ref, hbm, sem) if to_hbm else pltpu.make_async_copy(hbm, h_ref, sem)

    def group(g, carry):
        h, seq = carry
        start = pl.multiple_of(g * _GROUP, _GROUP)
        xs, dts, zs = _group_rows((x_ref, dt_ref, z_ref), start, _GROUP)
        deltas = _delta(dts, bias, softplus)
        out = jnp.zeros((_GROUP, block_i), jnp.float32)
        for j in range(_GROUP):  # static: row slices of the loaded group
            pos = t0 + start + j
            real = pos < tokens
            # at its sequence's end a token moves on to the next non-empty sequence (or none)
            ends = (seq < num_seqs) & (pos >= cu_ref[jnp.minimum(seq + 1, num_seqs)])
            seq = jnp.where(real & ends, next_seq_ref[jnp.minimum(seq, num_seqs - 1)], seq)
            owned = real & (seq < num_seqs)
            row = jnp.minimum(seq, num_seqs - 1)  # every index below in bounds
            opens = owned & (pos == cu_ref[row])

            @pl.when(opens)
            def _():
                dma = state_dma(row, False)
                dma.start()
                dma.wait()

            h = jnp.where(opens, h_ref[...], h)
            h, y = _step(h, deltas[j:j + 1], xs[j:j + 1], a_t, _column(b_all, lane_ids, start + j),
                         _column(c_all, lane_ids, start + j))
            y = _finish(y, xs[j:j + 1], d_skip, None if zs is None else zs[j:j + 1])
            y = jnp.where(owned & (keep_ref[row] > 0), y, 0.0)
            out = jnp.where(row_ids == j, y, out)

            @pl.when(owned & (pos == cu_ref[row + 1] - 1))
            def _():
                h_ref[...] = h
                dma = state_dma(row, True)
                dma.start()
                dma.wait()

        y_ref[pl.ds(start, _GROUP), :] = out.astype(y_ref.dtype)
        return h, seq

    h, _ = jax.lax.fori_loop(0, chunk // _GROUP, group, (h_ref[...], first_seq_ref[pl.program_id(1)]))
    h_ref[...] = h  # carried into the next chunk (a sequence that continues)


def _decode_kernel(*refs, has_d, has_z, has_bias, softplus):
    it = iter(refs)
    x_ref, dt_ref = next(it), next(it)
    z_ref = next(it) if has_z else None
    bt_ref, ct_ref, at_ref = next(it), next(it), next(it)
    d_ref = next(it) if has_d else None
    bias_ref = next(it) if has_bias else None
    keep_ref, init_ref, y_ref, final_ref = next(it), next(it), next(it), next(it)

    rows, block_i = x_ref.shape
    base = pl.program_id(1) * rows
    a_t = at_ref[...]
    b_all, c_all = bt_ref[...].astype(jnp.float32), ct_ref[...].astype(jnp.float32)
    lane_ids = jax.lax.broadcasted_iota(jnp.int32, b_all.shape, 1)
    row_ids = jax.lax.broadcasted_iota(jnp.int32, (rows, block_i), 0)
    xs, dts, zs = _group_rows((x_ref, dt_ref, z_ref), 0, rows)
    deltas = _delta(dts, bias_ref[...].astype(jnp.float32) if has_bias else None, softplus)
    d_skip = d_ref[...].astype(jnp.float32) if has_d else None
    keep = keep_ref[...]  # [rows, 1] int32
    out = jnp.zeros((rows, block_i), jnp.float32)
    for j in range(rows):
        h, y = _step(init_ref[j], deltas[j:j + 1], xs[j:j + 1], a_t, _column(b_all, lane_ids, base + j),
                     _column(c_all, lane_ids, base + j))
        final_ref[j] = h
        y = _finish(y, xs[j:j + 1], d_skip, None if zs is None else zs[j:j + 1])
        out = jnp.where(row_ids == j, y, out)
    y_ref[...] = jnp.where(keep > 0, out, 0.0).astype(y_ref.dtype)


def _pad_tokens(a, padded):
    return a if a is None or a.shape[0] == padded else jnp.pad(a, ((0, padded - a.shape[0]), (0, 0)))


@tpu_jit(static_argnames=("interpret", "delta_softplus", "decode"))
def selective_scan(x, dt, A, B, C, D, z, dt_bias, state, cu_seqlens, state_indices, has_initial_state, *,
                   delta_softplus=True, decode=False, interpret=False):
    """``(y [T, I], new state cache)``; the arguments of ``SelectiveScan.forward_native`` after
    ``ssm_batch`` (int32 ``cu_seqlens``/``state_indices``, bool ``has_initial_state``, a cache)."""
    tokens, dim = x.shape
    n = A.shape[1]
    seqs = cu_seqlens.shape[0] - 1
    if tokens == 0:
        return x, state
    xp = array_namespace(x)
    # every index the kernels read in bounds, bad traced metadata read as the native body reads it
    cu_seqlens, state_indices = ssm_math.sanitize_metadata(xp, cu_seqlens, state_indices, tokens, state.shape[0])
    blocks = scan_blocks(tokens if not decode else _GROUP, dim)
    block_i = blocks.channels
    rows = blocks.chunk
    padded = pl.cdiv(tokens, rows) * rows
    init = jnp.swapaxes(ssm_math.initial_states(xp, state, state_indices, has_initial_state), 1, 2)  # [B, N, I]
    keep = (state_indices >= 0).astype(jnp.int32)
    xs = [_pad_tokens(a, padded) for a in (x, dt, z) if a is not None]
    # B and C as [N, T] f32 (padded lanes are zeros, never selected for a real token)
    bt, ct = (jnp.pad(a.astype(jnp.float32), ((0, padded - tokens), (0, 0))).T for a in (B, C))
    at = A.astype(jnp.float32).T
    per_channel = [a.reshape(1, dim).astype(jnp.float32) for a in (D, dt_bias) if a is not None]
    flags = dict(has_d=D is not None, has_z=z is not None, has_bias=dt_bias is not None, softplus=delta_softplus)
    itemsize = jnp.dtype(x.dtype).itemsize
    grid = (dim // block_i, padded // rows)
    vmem = (2 * (len(xs) + 1) * rows * block_i * itemsize + 4 * n * rows * 4 + 4 * n * block_i * 4
            + (4 * rows * n * block_i * 4 if decode else 0))
    cost = cost_estimate(selective_scan_cost(tokens, dim, n, seqs, itemsize, has_z=z is not None))
    out_y = jax.ShapeDtypeStruct((padded, dim), x.dtype)
    out_state = jax.ShapeDtypeStruct((seqs if not decode else padded, n, dim), jnp.float32)

    if decode:
        init = _pad_tokens(init.reshape(seqs, n * dim), padded).reshape(padded, n, dim)
        keep_rows = _pad_tokens(keep.reshape(-1, 1), padded)
        row_spec = pl.BlockSpec((rows, block_i), lambda i, t: (t, i))
        col_spec = pl.BlockSpec((n, padded), lambda i, t: (0, 0))
        chan_spec = pl.BlockSpec((1, block_i), lambda i, t: (0, i))
        state_spec = pl.BlockSpec((rows, n, block_i), lambda i, t: (t, 0, i))
        y, finals = pl.pallas_call(
            functools.partial(_decode_kernel, **flags),
            grid=grid,
            in_specs=[*[row_spec] * len(xs), col_spec, col_spec, pl.BlockSpec((n, block_i), lambda i, t: (0, i)),
                      *[chan_spec] * len(per_channel), pl.BlockSpec((rows, 1), lambda i, t: (t, 0)), state_spec],
            out_specs=[row_spec, state_spec],
            out_shape=[out_y, out_state],
            compiler_params=compiler_params(2, vmem_bytes=vmem),
            cost_estimate=cost,
            interpret=interpret,
        )(*xs, bt, ct, at, *per_channel, keep_rows, init)
        finals = finals[:seqs]
    else:
        # each chunk's first token's sequence, and the sequence after each one's end (skipping
        # empty ones); B: no sequence
        first_seq = jnp.sum((jnp.arange(0, padded, rows, dtype=jnp.int32)[:, None] >= cu_seqlens[None, 1:]),
                            axis=1).astype(jnp.int32)
        next_seq = jnp.clip(jnp.searchsorted(cu_seqlens, cu_seqlens[1:], side="right") - 1, 0, seqs).astype(jnp.int32)
        row_spec = pl.BlockSpec((rows, block_i), lambda i, c, *_: (c, i))
        col_spec = pl.BlockSpec((n, rows), lambda i, c, *_: (0, c))
        chan_spec = pl.BlockSpec((1, block_i), lambda i, c, *_: (0, i))
        hbm = pl.BlockSpec(memory_space=pl.ANY)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=[*[row_spec] * len(xs), col_spec, col_spec,
                      pl.BlockSpec((n, block_i), lambda i, c, *_: (0, i)), *[chan_spec] * len(per_channel), hbm],
            out_specs=[row_spec, hbm],
            scratch_shapes=[pltpu.VMEM((n, block_i), jnp.float32), pltpu.SemaphoreType.DMA(())],
        )
        kernel = functools.partial(_prefill_kernel, tokens=tokens, chunk=rows, **flags)
        y, finals = pl.pallas_call(
            kernel,
            grid_spec=grid_spec,
            out_shape=[out_y, out_state],
            compiler_params=compiler_params(2, vmem_bytes=vmem, semantics=("parallel", "arbitrary")),
            cost_estimate=cost,
            interpret=interpret,
        )(cu_seqlens, first_seq, next_seq, keep, *xs, bt, ct, at, *per_channel, init)
        # an empty sequence (traced metadata) writes no final state: its slot keeps its starting one
        finals = jnp.where((cu_seqlens[1:] == cu_seqlens[:-1])[:, None, None], init, finals)
    new_state = ssm_math.store_states(xp, state, state_indices, jnp.swapaxes(finals, 1, 2))
    return y[:tokens], new_state
