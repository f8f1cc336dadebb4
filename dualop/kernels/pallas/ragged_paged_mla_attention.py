"""Absorbed multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache, as a
Pallas TPU kernel: the ``ragged_paged_mla_attention`` op's TPU path.

Contract (``ops/mla.py``): ``q_latent`` ``[T, H, L + R]`` (the query already multiplied by W_UK
for its first L channels, then its R rope channels); ``latent_pages`` ``[num_pages, page_size,
L + R]``, one latent row per token (``[kv_c | k_pe]``); the ragged metadata of
``ragged_paged_attention`` (sequence i owns query rows ``cu_q_lens[i]:cu_q_lens[i+1]``, its last
positions, and KV positions ``0..kv_lens[i]-1`` through ``page_indices[i]``). Score =
``q_latent . row * sm_scale`` in float32, causal, softmax in float32, output ``[T, H, L]`` =
``probs . row[:L]`` cast once to q's dtype; rows past ``cu_q_lens[num_seqs[0]]`` are zeros.

Layout: every head shares the one latent row of a token (MQA), so a grid step folds its
``block_q`` query rows and all H heads into one ``(block_q * H, L + R)`` matrix (the wrapper's free
reshape ``[T, H, D] -> [T * H, D]``): one MXU product per KV block for every head, scores
``(block_q * H, kv_tokens)``, and ``p . row[:L]`` the second product on the same VMEM block (the
cache is read once for both K and V). The walk over sequences and KV blocks, the whole-page DMAs
from HBM into two VMEM buffers (double buffered) and the metadata clamping are
``paged_walk.SequenceWalk``'s, shared with ``ragged_paged_attention``; ``p . v`` keeps p to float32
accuracy for 16-bit caches (``ragged_paged_attention._p_times_v``). A page's rows land at row
``j * page_size`` of a buffer; pages off the sublane tile (e.g. 8 rows of bfloat16) are copied one
per block (offset 0). KV rows past ``kv_len`` are zeroed before use and score -inf, so stale
cache data never reaches the output; the rows of a block's other sequences keep their running
state through a ``where`` (not a product with 0 weights), so a NaN in one sequence's cached rows
stays in its own rows.

A float8 cache (float8_e4m3fn, float8_e5m2) is copied as it is (one byte per element: the page
buffers, DMAs and ``MlaBlocks.vmem_bytes`` follow the cache's dtype and its 32-row sublane tile)
and each block cast to q's dtype in VMEM, exactly (every float8 value is a bfloat16 and float16
value); ``k_scale`` (static) multiplies the float32 scores (folded into ``sm_scale``) and the
output, exactly the products with the rows ``code * k_scale``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels import cost as cost_model
from dualop.kernels.pallas.common import compiler_params, cost_estimate, step_vmem_ceiling, sublane_tile, tpu_jit
from dualop.kernels.pallas.paged_walk import SequenceWalk, ordered_cu_q_lens
from dualop.kernels.pallas.ragged_paged_attention import _ANY, _LANES, KV_BLOCK_TOKENS, _p_times_v, _round_up

__all__ = ["ragged_paged_mla_attention", "MlaBlocks", "choose_mla_blocks"]

# Rows (query rows x heads) a grid step aims at (the KV block is ragged_paged_attention's KV_BLOCK_TOKENS).
TARGET_ROWS = 512


@dataclasses.dataclass(frozen=True)
class MlaBlocks:
    """``block_q`` query rows per grid step (all heads of each) and ``pages_per_block`` pages per DMA block."""

    block_q: int
    pages_per_block: int

    def vmem_bytes(self, *, heads: int, width: int, latent: int, page_size: int, dtype, cache_dtype=None) -> int:
        """Estimated VMEM of one step, padded to (sublane, 128-lane) tiles: q and output blocks
        (double-buffered), two page buffers (in ``cache_dtype``, None: q's), the float32 accumulator,
        running max and sum, and the float32 temporaries (scores, probabilities and their halves,
        the V slice; for an fp8 cache also the block cast to q's dtype)."""
        dtype = jnp.dtype(dtype)
        cache_dtype = dtype if cache_dtype is None else jnp.dtype(cache_dtype)
        rows = self.block_q * heads
        tokens = self.pages_per_block * page_size
        d, lat, kv = _round_up(width, _LANES), _round_up(latent, _LANES), _round_up(tokens, _LANES)
        io = 2 * _round_up(rows, sublane_tile(dtype)) * (d + lat) * dtype.itemsize
        pages = 2 * _round_up(tokens, sublane_tile(cache_dtype)) * d * cache_dtype.itemsize
        if cache_dtype != dtype:
            pages += _round_up(tokens, sublane_tile(dtype)) * d * dtype.itemsize
        state = _round_up(rows, 8) * (lat + 2 * _LANES) * 4
        temps = 4 * _round_up(rows, 8) * kv * 4 + 2 * _round_up(tokens, 8) * d * 4
        return io + pages + state + temps


def _rows_ok(block_q: int, heads: int, dtype, padded_tokens: int) -> bool:
    """A (block_q * H)-row block is legal: a multiple of the sublane tile, or the whole array."""
    return (block_q * heads) % sublane_tile(dtype) == 0 or block_q >= padded_tokens


def choose_mla_blocks(tokens: int, heads: int, width: int, latent: int, page_size: int, pages_per_seq: int,
                      dtype, cache_dtype=None) -> MlaBlocks:
    """The largest blocks near ``TARGET_ROWS`` rows and ``KV_BLOCK_TOKENS`` positions whose
    ``vmem_bytes`` fit ``step_vmem_ceiling()``: rows shrink first (keeping the block legal),
    then KV pages. A page size off the cache's sublane tile takes one page per block."""
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    tile = sublane_tile(dtype)
    step = tile // _gcd(heads, tile)  # block_q granularity that keeps block_q * H on the tile
    block_q = max(step, TARGET_ROWS // max(heads, 1) // step * step)
    if block_q >= tokens:
        block_q = max(tokens, 1)  # one block: its rows are the whole (padded) array
    pages = max(1, min(pages_per_seq, KV_BLOCK_TOKENS // page_size))
    if page_size % sublane_tile(cache_dtype):
        pages = 1
    ceiling = step_vmem_ceiling()

    def size(bq, pp):
        return MlaBlocks(bq, pp).vmem_bytes(heads=heads, width=width, latent=latent, page_size=page_size, dtype=dtype,
                                            cache_dtype=cache_dtype)

    while size(block_q, pages) > ceiling:
        if block_q > step:
            block_q = max(step, block_q // 2 // step * step)
        elif pages > 1:
            pages //= 2
        else:
            break  # one tile of rows and one page: compiler_params asks for the most it can
    return MlaBlocks(block_q, pages)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _kernel(kv_lens_ref, page_ids_ref, cu_q_lens_ref, num_seqs_ref,  # scalar prefetch (SMEM)
            q_ref, cache_hbm, o_ref,  # (block_q * H, D) and (block_q * H, L) blocks; the cache in HBM
            buf_a, buf_b, sems, m_ref, l_ref, acc_ref,
            *, sm_scale, out_scale, heads, latent, page_size, pages_per_block, pages_per_seq, num_pages, max_seqs):
    rows = q_ref.shape[0]
    block_q = rows // heads
    kv_tokens = pages_per_block * page_size
    q_start = pl.program_id(0) * block_q
    walk = SequenceWalk(kv_lens_ref, cu_q_lens_ref, num_seqs_ref, q_start, block_q, max_seqs,
                        pages_per_seq * page_size, kv_tokens, skip_masked=True)

    def page_copies(s, kb, buf, sem):
        base = jnp.minimum(s, max_seqs - 1) * pages_per_seq
        copies = []
        for j in range(pages_per_block):
            column = jnp.minimum(kb * pages_per_block + j, pages_per_seq - 1)
            page = jnp.clip(page_ids_ref[base + column], 0, num_pages - 1)
            copies.append(pltpu.make_async_copy(cache_hbm.at[page], buf.at[pl.ds(j * page_size, page_size)], sem))
        return copies

    def start(s, kb, buf, sem):
        for copy in page_copies(s, kb, buf, sem):
            copy.start()

    def wait(s, kb, buf, sem):
        for copy in page_copies(s, kb, buf, sem):
            copy.wait()

    def rows_of_seq(row_lo, row_hi, width):
        token = q_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, width), 0), heads)
        return (token >= row_lo) & (token < row_hi)

    def compute(s, kb, buf):
        """Fold KV block ``kb`` of sequence ``s`` into its rows of this block; the rows of other
        sequences keep their running state (a ``where``, not a masked product: their weights are
        0 there, and ``0 * NaN`` from a non-finite row of ``s`` would reach them)."""
        row_lo, row_hi, kv_len, pos_of_row0 = walk.seq_info(s)
        token = q_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tokens), 0), heads)
        kv_pos = kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tokens), 1)
        visible = rows_of_seq(row_lo, row_hi, kv_tokens) & (kv_pos <= token + pos_of_row0) & (kv_pos < kv_len)
        in_seq = kb * kv_tokens + jax.lax.broadcasted_iota(jnp.int32, (kv_tokens, 1), 0) < kv_len
        row = buf[...].astype(q_ref.dtype)
        row = jnp.where(in_seq, row, jnp.zeros_like(row))  # stale tail rows may hold NaN
        scores = jax.lax.dot_general(q_ref[...], row, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * sm_scale
        scores = jnp.where(visible, scores, -jnp.inf)
        m_prev, l_prev = m_ref[...], l_ref[...]  # (rows, 128), equal across lanes
        m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: exp gives 0, not NaN
        p = jnp.exp(scores - m_shift[:, :1])
        alpha = jnp.exp(m_prev - m_shift)
        own_l, own_v = rows_of_seq(row_lo, row_hi, m_prev.shape[1]), rows_of_seq(row_lo, row_hi, latent)
        l_ref[...] = jnp.where(own_l, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), l_prev)
        m_ref[...] = jnp.where(own_l, m_new, m_prev)
        acc_prev = acc_ref[...]
        acc_ref[...] = jnp.where(own_v, acc_prev * alpha[:, :1] + _p_times_v(p, row[:, :latent]), acc_prev)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    walk.run(start, wait, compute, buf_a, buf_b, sems.at[0], sems.at[1])
    l = l_ref[:, :1]
    # l is 0 only for a row that saw no position (0 out); NaN stays NaN (``l > 0`` would zero it)
    out = acc_ref[...] / jnp.where(l == 0, 1.0, l)
    if out_scale is not None:
        out = out * out_scale
    o_ref[...] = jnp.where(l == 0, 0.0, out).astype(o_ref.dtype)


@tpu_jit(static_argnames=("kv_lora_rank", "sm_scale", "k_scale", "blocks", "interpret"))
def ragged_paged_mla_attention(q_latent, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, kv_lora_rank,
                               sm_scale=1.0, k_scale=None, blocks: MlaBlocks | None = None, interpret=False):
    """``[T, H, L]`` in q's dtype (see the module docstring); ``blocks`` overrides ``choose_mla_blocks``."""
    tokens, heads, width = q_latent.shape
    num_pages, page_size, _ = latent_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    latent = kv_lora_rank
    if tokens == 0 or max_seqs == 0 or pages_per_seq == 0:
        return jnp.zeros((tokens, heads, latent), q_latent.dtype)
    blocks = blocks or choose_mla_blocks(tokens, heads, width, latent, page_size, pages_per_seq, q_latent.dtype,
                                         latent_pages.dtype)
    block_q = blocks.block_q
    padded = pl.cdiv(tokens, block_q) * block_q
    rows = block_q * heads
    q_rows = jnp.pad(q_latent, ((0, padded - tokens), (0, 0), (0, 0))).reshape(padded * heads, width)
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale) * (1.0 if k_scale is None else k_scale), out_scale=k_scale, heads=heads, latent=latent, page_size=page_size,
        pages_per_block=blocks.pages_per_block, pages_per_seq=pages_per_seq, num_pages=num_pages,
        max_seqs=max_seqs)
    kv_rows = blocks.pages_per_block * page_size
    vmem = blocks.vmem_bytes(heads=heads, width=width, latent=latent, page_size=page_size, dtype=q_latent.dtype,
                             cache_dtype=latent_pages.dtype)
    # An upper bound (the lengths are data): every row sees a whole sequence's pages, each page read once.
    cost = cost_model.ragged_paged_mla_attention_cost(
        tokens, min(num_pages, max_seqs * pages_per_seq) * page_size, tokens * pages_per_seq * page_size, heads,
        latent, width - latent, q_latent.dtype.itemsize)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(padded // block_q,),
            in_specs=[pl.BlockSpec((rows, width), lambda i, *_: (i, 0)), pl.BlockSpec(memory_space=_ANY)],
            out_specs=pl.BlockSpec((rows, latent), lambda i, *_: (i, 0)),
            scratch_shapes=[
                pltpu.VMEM((kv_rows, width), latent_pages.dtype),
                pltpu.VMEM((kv_rows, width), latent_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((rows, _LANES), jnp.float32),
                pltpu.VMEM((rows, _LANES), jnp.float32),
                pltpu.VMEM((rows, latent), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((padded * heads, latent), q_latent.dtype),
        compiler_params=compiler_params(1, vmem_bytes=vmem),
        cost_estimate=cost_estimate(cost),
        interpret=interpret,
        name="dualop_ragged_paged_mla_attention",
    )(
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),
        ordered_cu_q_lens(cu_q_lens, tokens),
        num_seqs.astype(jnp.int32).reshape(-1)[:1],
        q_rows,
        latent_pages,
    )
    return out.reshape(padded, heads, latent)[:tokens]
