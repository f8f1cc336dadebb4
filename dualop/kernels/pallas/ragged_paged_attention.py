"""Ragged paged attention as a Pallas TPU kernel: mixed prefill and decode over a paged KV cache.

Contract (``ops/attention.py``, JAX's ``ragged_paged_attention`` layout): q ``[T, Hq, D]``;
kv_pages ``[num_pages, page_size, 2*Hkv, D]`` with K head h at combined head 2h and V head h at
2h+1; sequence i < num_seqs[0] owns query rows cu_q_lens[i]:cu_q_lens[i+1] and KV positions
0..kv_lens[i]-1 (token j at page page_indices[i, j // page_size]). Its query row r sits at position
kv_len - q_len + r and sees the positions p <= it (and > it - sliding_window). Scores are
``q . k * sm_scale`` in float32, soft-capped, masked to ``mask_value`` (positions from kv_len on
never count); softmax in float32; the output cast once to q's dtype. Rows past cu_q_lens[num_seqs[0]] (padding) come out as zeros.
Attention sinks (``sinks``, one logit per query head, clipped as ``sink_logits``; scalar-prefetched
into SMEM) start each query head's online softmax at ``(max, sum) = (sink, 1)``: they join the
softmax's denominator and weigh no V row.

Layout: the grid runs over blocks of ``block_q`` query rows (a static grid, so both interpreters
run it); q and the output move as (Hq, block_q, D) blocks (the wrapper puts heads first, so each
query head is a (block_q, D) tile). Inside a step the kernel walks the sequences whose rows meet
the block and, for each, only the KV blocks some of those rows can see (causal and window limits):
``pages_per_block`` pages per block, copied from HBM (``memory_space=ANY``) by one DMA per page
into one of two VMEM buffers, the next block's copies started before the current block is
computed (double buffering, also across sequences). Metadata (kv_lens, the page table, cu_q_lens,
num_seqs) arrives by scalar prefetch in SMEM. Per query head an online softmax keeps its running
max, sum and float32 accumulator in VMEM scratch; rows of other sequences in the block keep theirs.

K and V of head h are read from a buffer as strided row loads: the wrapper views the cache as
``[num_pages, page_size * 2*Hkv, D]`` (free when 2*Hkv is a multiple of the sublane tile, else XLA
copies), so token t's combined head c is buffer row ``t * 2*Hkv + c``. Mosaic refuses per-head DMAs
(an offset inside a tiled dim), dynamic strided loads of packed types, and strided loads from a
buffer wider than 128 lanes; hence whole-page copies (a head dim over 128 in 128-lane chunks, one
buffer each) and two buffers with static names rather than one indexed by a traced slot.

A float8 cache (float8_e4m3fn, float8_e5m2) is copied as it is (one byte per element: the page
buffers, DMAs and ``BlockSizes.vmem_bytes`` follow the cache's dtype, its 32-row sublane tile
included) and each loaded head cast to q's dtype in VMEM, exactly (every float8 value is a
bfloat16 and float16 value); ``k_scale`` / ``v_scale`` act on the float32 scores and output as for
any cache.

Defensive reads (the op validates, but no int value may make the kernel read out of bounds):
sequence ids stop at ``min(num_seqs[0], S)``; kv_lens are clipped to [0, pages_per_seq *
page_size]; cu_q_lens to [0, T] and non-decreasing (``ordered_cu_q_lens``); page-table columns
to pages_per_seq - 1 and page ids to [0, num_pages - 1]. KV rows past kv_len (the last page's tail)
score -inf and their V is zeroed, so stale cache data never reaches the output. A row that sees no position (kv_len < q_len, invalid) gets zeros.
The page table (S * pages_per_seq int32) must fit in SMEM with the other metadata.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels import cost as cost_model
from dualop.kernels.paged_attention_math import DEFAULT_MASK_VALUE, masked_positions_vanish, sink_logits
from dualop.kernels.pallas.paged_walk import SequenceWalk, ordered_cu_q_lens
from dualop.kernels.pallas.common import (
    compiler_params,
    cost_estimate,
    step_vmem_ceiling,
    sublane_tile,
    tpu_jit,
)

__all__ = ["ragged_paged_attention", "BlockSizes", "choose_block_sizes", "DEFAULT_MASK_VALUE"]

# JAX's default for masked scores (its ragged_paged_attention and flash_attention use the same).

# Query rows per grid step at most, and the KV positions one DMA block aims at (a multiple of 128
# lanes keeps the (block_q, kv positions) scores lane-dense).
MAX_BLOCK_Q = 128
KV_BLOCK_TOKENS = 256
_LANES = 128
_ANY = getattr(pltpu, "ANY", None) or pl.ANY


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """``block_q`` query rows per grid step (a multiple of q's sublane tile) and
    ``pages_per_block`` KV pages per DMA block (``pages_per_block * page_size`` positions)."""

    block_q: int
    pages_per_block: int

    def vmem_bytes(self, *, q_heads: int, kv_heads: int, head_dim: int, page_size: int, q_dtype, kv_dtype) -> int:
        """Estimated VMEM of one grid step, padded to (sublane, 128-lane) tiles: q and output
        blocks (double-buffered), the two page buffers, the float32 accumulator, running max and
        sum (lane-wide), and one head's float32 temporaries (scores, probabilities, K and V)."""
        q_dtype, kv_dtype = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
        d = _round_up(head_dim, _LANES)
        tokens = self.pages_per_block * page_size
        rows_q = _round_up(self.block_q, sublane_tile(q_dtype))
        rows_f32 = _round_up(self.block_q, 8)
        io = 2 * 2 * q_heads * rows_q * d * q_dtype.itemsize
        pages = 2 * _round_up(tokens * 2 * kv_heads, sublane_tile(kv_dtype)) * d * kv_dtype.itemsize
        state = q_heads * rows_f32 * (d + 2 * _LANES) * 4
        temps = 4 * rows_f32 * _round_up(tokens, _LANES) * 4 + 2 * _round_up(tokens, 8) * d * 4
        return io + pages + state + temps


def choose_block_sizes(tokens: int, q_heads: int, kv_heads: int, head_dim: int, page_size: int,
                       pages_per_seq: int, q_dtype, kv_dtype) -> BlockSizes:
    """The largest blocks (up to ``MAX_BLOCK_Q`` rows, ``KV_BLOCK_TOKENS`` positions) whose
    ``vmem_bytes`` fit ``step_vmem_ceiling()`` on the target generation: query rows shrink first
    (to 32), then the KV block (to one page or 128 positions), then rows to one sublane tile,
    then the KV block to one page."""
    tile = sublane_tile(q_dtype)
    block_q = min(MAX_BLOCK_Q, _round_up(max(tokens, 1), tile))
    pages = max(1, min(pages_per_seq, KV_BLOCK_TOKENS // page_size))
    ceiling = step_vmem_ceiling()

    def size(bq, pp):
        return BlockSizes(bq, pp).vmem_bytes(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                            page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype)

    def halve_rows(bq):
        return max(tile, bq // 2 // tile * tile)

    while size(block_q, pages) > ceiling:
        if block_q > max(tile, 32):
            block_q = halve_rows(block_q)
        elif pages > 1 and pages * page_size > _LANES:
            pages //= 2
        elif block_q > tile:
            block_q = halve_rows(block_q)
        elif pages > 1:
            pages //= 2
        else:
            break  # one tile of rows and one page: compiler_params asks for the most it can
    return BlockSizes(block_q, pages)


def _p_times_v(p: jax.Array, v: jax.Array) -> jax.Array:
    """``p . v`` with ``p`` kept to float32 accuracy: for a 16-bit ``v``, ``p`` goes in as two 16-bit
    halves (``hi = round(p)``, ``lo = round(p - hi)``; two MXU passes, about 16 significant bits) rather
    than one rounding, which loses outputs near zero by cancellation; the op's semantics are float32."""
    if v.dtype == jnp.float32:
        return jnp.dot(p, v, preferred_element_type=jnp.float32)
    hi = p.astype(v.dtype)
    lo = (p - hi.astype(jnp.float32)).astype(v.dtype)
    return (jnp.dot(hi, v, preferred_element_type=jnp.float32)
            + jnp.dot(lo, v, preferred_element_type=jnp.float32))


def _kernel(kv_lens_ref, page_ids_ref, cu_q_lens_ref, num_seqs_ref, sinks_ref,  # scalar prefetch (SMEM)
            q_ref, kv_hbm, o_ref,  # (Hq, block_q, D) blocks; the cache in HBM
            *scratch,  # page buffers A and B (lane_chunks each), DMA semaphores, max, sum, accumulator
            sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale, has_sinks,
            page_size, pages_per_block, pages_per_seq, num_pages, max_seqs, kv_heads, group, lane_chunks):
    bufs_a, bufs_b = scratch[:lane_chunks], scratch[lane_chunks:2 * lane_chunks]
    sems, m_ref, l_ref, acc_ref = scratch[2 * lane_chunks:]
    block_q, head_dim = q_ref.shape[1], q_ref.shape[2]
    chunk = head_dim // lane_chunks  # lanes per page buffer
    combined = 2 * kv_heads
    kv_tokens = pages_per_block * page_size  # KV positions per block
    page_rows = page_size * combined  # buffer rows one page fills
    q_start = pl.program_id(0) * block_q
    walk = SequenceWalk(kv_lens_ref, cu_q_lens_ref, num_seqs_ref, q_start, block_q, max_seqs,
                        pages_per_seq * page_size, kv_tokens, masked_positions_vanish(mask_value, soft_cap),
                        sliding_window)
    seq_info = walk.seq_info

    def page_copies(s, kb, bufs, sem):
        """One DMA per page (per 128-lane chunk of a head dim over 128) into ``bufs``."""
        base = jnp.minimum(s, max_seqs - 1) * pages_per_seq
        copies = []
        for j in range(pages_per_block):
            column = jnp.minimum(kb * pages_per_block + j, pages_per_seq - 1)
            page = jnp.clip(page_ids_ref[base + column], 0, num_pages - 1)
            for c, buf in enumerate(bufs):
                src = kv_hbm.at[page] if lane_chunks == 1 else kv_hbm.at[page, :, pl.ds(c * chunk, chunk)]
                copies.append(pltpu.make_async_copy(src, buf.at[pl.ds(j * page_rows, page_rows)], sem))
        return copies

    def start(s, kb, bufs, sem):
        for copy in page_copies(s, kb, bufs, sem):
            copy.start()

    def wait(s, kb, bufs, sem):
        for copy in page_copies(s, kb, bufs, sem):
            copy.wait()

    def load_head(bufs, c):
        """Combined head ``c`` of every position in the block: a strided row load per chunk."""
        parts = [buf[pl.ds(c, kv_tokens, stride=combined), :] for buf in bufs]
        return parts[0] if lane_chunks == 1 else jnp.concatenate(parts, axis=1)

    def compute(s, kb, bufs):
        """Fold KV block ``kb`` of sequence ``s`` (in ``bufs``) into the rows of ``s`` in this block."""
        row_lo, row_hi, kv_len, pos_of_row0 = seq_info(s)

        def rows_of_seq(width):
            rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, width), 0)
            return (rows >= row_lo) & (rows < row_hi)

        rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, kv_tokens), 0)
        kv_pos = kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (block_q, kv_tokens), 1)
        q_pos = rows + pos_of_row0
        in_cache = kv_pos < kv_len
        visible = rows_of_seq(kv_tokens) & (kv_pos <= q_pos) & in_cache
        if sliding_window is not None:
            visible &= kv_pos > q_pos - sliding_window
        # A masked position of the sequence scores mask_value; one past kv_len never counts.
        fill = jnp.where(in_cache, jnp.float32(mask_value), -jnp.inf)
        own_l, own_d = rows_of_seq(_LANES), rows_of_seq(head_dim)
        kv_in_seq = kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (kv_tokens, head_dim), 0) < kv_len
        score_scale = sm_scale if k_scale is None else sm_scale * k_scale
        for h in range(kv_heads):
            # Cache scales act on the float32 scores and output (exactly the products with scaled
            # K / V, with no rounding of scaled values to 16 bits).
            k = load_head(bufs, 2 * h).astype(q_ref.dtype)
            v = load_head(bufs, 2 * h + 1).astype(q_ref.dtype)
            v = jnp.where(kv_in_seq, v, jnp.zeros_like(v))  # stale tail rows may hold NaN

            def one_query_head(g, _, k=k, v=v, h=h):
                hq = h * group + g
                scores = jax.lax.dot_general(q_ref[hq], k, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32) * score_scale
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                scores = jnp.where(visible, scores, fill)
                m_prev, l_prev = m_ref[hq], l_ref[hq]  # (block_q, 128), equal across lanes
                m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
                # -inf until a row has seen a position (a window starting in a later block, with
                # mask_value -inf): subtract 0 then, so exp gives 0 rather than NaN.
                m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(scores - m_shift[:, :1])
                alpha = jnp.exp(m_prev - m_shift)
                l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
                pv = _p_times_v(p, v)
                acc_prev = acc_ref[hq]
                acc_ref[hq] = jnp.where(own_d, acc_prev * alpha[:, :1] + pv, acc_prev)
                m_ref[hq] = jnp.where(own_l, m_new, m_prev)
                l_ref[hq] = jnp.where(own_l, l_new, l_prev)
                return 0

            # A loop, not unrolled: the query heads of a group share K and V, and the program stays small.
            jax.lax.fori_loop(0, group, one_query_head, 0)

    if has_sinks:  # each query head starts at (max, sum) = (its sink, 1): the sink weighs no V row
        for hq in range(o_ref.shape[0]):
            m_ref[hq] = jnp.full(m_ref.shape[1:], sinks_ref[hq], jnp.float32)
        l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
    else:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    walk.run(start, wait, compute, bufs_a, bufs_b, sems.at[0], sems.at[1])

    for hq in range(o_ref.shape[0]):
        l = l_ref[hq][:, :1]
        # l is 0 only for a row that saw no position and has no sink (0 out; with a sink its
        # accumulator is 0); NaN stays NaN (``l > 0`` would zero it)
        out = acc_ref[hq] / jnp.where(l == 0, 1.0, l)
        if v_scale is not None:
            out = out * v_scale
        o_ref[hq] = jnp.where(l == 0, 0.0, out).astype(o_ref.dtype)


@tpu_jit(static_argnames=("sm_scale", "sliding_window", "soft_cap", "mask_value", "k_scale", "v_scale",
                          "block_sizes", "interpret"))
def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *, sm_scale=1.0,
                           sliding_window=None, soft_cap=None, mask_value=None, k_scale=None, v_scale=None,
                           block_sizes: BlockSizes | None = None, interpret=False):
    """Attention of ``q`` [T, Hq, D] over the paged cache ``kv_pages`` (see the module docstring);
    returns [T, Hq, D] in q's dtype, zeros past cu_q_lens[num_seqs[0]]. ``block_sizes`` overrides
    ``choose_block_sizes`` (tests force several query and KV blocks with it)."""
    tokens, q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    kv_heads = combined // 2
    max_seqs, pages_per_seq = page_indices.shape
    if tokens == 0 or max_seqs == 0 or pages_per_seq == 0:  # nothing to attend to (and no empty SMEM array)
        return jnp.zeros(q.shape, q.dtype)
    blocks = block_sizes or choose_block_sizes(tokens, q_heads, kv_heads, head_dim, page_size, pages_per_seq,
                                               q.dtype, kv_pages.dtype)
    block_q = blocks.block_q
    # Mosaic's strided loads want a buffer at most 128 lanes wide: wider heads come in 128-lane chunks.
    lane_chunks = head_dim // _LANES if head_dim > _LANES and head_dim % _LANES == 0 else 1
    padded = pl.cdiv(tokens, block_q) * block_q
    q_heads_first = jnp.pad(q, ((0, padded - tokens), (0, 0), (0, 0))).transpose(1, 0, 2)
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=DEFAULT_MASK_VALUE if mask_value is None else float(mask_value),
        k_scale=k_scale, v_scale=v_scale, has_sinks=sinks is not None, page_size=page_size, pages_per_block=blocks.pages_per_block,
        pages_per_seq=pages_per_seq, num_pages=num_pages, max_seqs=max_seqs, kv_heads=kv_heads,
        group=q_heads // kv_heads, lane_chunks=lane_chunks)
    kv_rows = blocks.pages_per_block * page_size * combined
    page_buffers = [pltpu.VMEM((kv_rows, head_dim // lane_chunks), kv_pages.dtype)] * (2 * lane_chunks)
    io_block = pl.BlockSpec((q_heads, block_q, head_dim), lambda i, *_: (0, i, 0))
    vmem = blocks.vmem_bytes(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                             q_dtype=q.dtype, kv_dtype=kv_pages.dtype)
    # An upper bound (the lengths are data): every row sees a whole sequence's pages, each page read once.
    cost = cost_model.ragged_paged_attention_cost(
        tokens, min(num_pages, max_seqs * pages_per_seq) * page_size, tokens * pages_per_seq * page_size,
        q_heads, kv_heads, head_dim, q.dtype.itemsize)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(padded // block_q,),
            in_specs=[io_block, pl.BlockSpec(memory_space=_ANY)],
            out_specs=io_block,
            scratch_shapes=[
                *page_buffers,
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((q_heads, block_q, _LANES), jnp.float32),
                pltpu.VMEM((q_heads, block_q, _LANES), jnp.float32),
                pltpu.VMEM((q_heads, block_q, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((q_heads, padded, head_dim), q.dtype),
        compiler_params=compiler_params(1, vmem_bytes=vmem),
        cost_estimate=cost_estimate(cost),
        interpret=interpret,
        name="dualop_ragged_paged_attention",
    )(
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),
        ordered_cu_q_lens(cu_q_lens, tokens),
        num_seqs.astype(jnp.int32).reshape(-1)[:1],
        jnp.zeros((1,), jnp.float32) if sinks is None else sink_logits(jnp, sinks),
        q_heads_first,
        kv_pages.reshape(num_pages, page_size * combined, head_dim),
    )
    return out.transpose(1, 0, 2)[:tokens]
