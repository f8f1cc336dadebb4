"""Vocabulary-parallel embedding lookup as a Pallas TPU kernel: the ``vocab_parallel_embedding``
op's fast path (the rows of this rank's shard, ids outside it zero; the all-reduce is the op's).

Contract (``ops/embedding.py``): ``out[t] = weight[local(ids[t])]`` when ``ids[t]`` lies in this
rank's base range ``[org_start, org_end)`` (``local = id - org_start``) or added range
``[added_start, added_end)`` (``local = id - added_offset``), else a zero row. ``bounds`` holds
``(org_start, org_end, added_start, added_end, added_offset)`` as int32; it may be traced (the
rank inside ``shard_map``), so it is data, not a static argument.

Layout: the weight stays in HBM (``memory_space=pl.ANY``); only the rows the tokens need move.
The ids and the bounds are scalar-prefetched to SMEM (ids padded to whole blocks with -1, which
every bound excludes). Grid over blocks of tokens; each step starts, for every token whose id is in
this shard, one DMA of its row into a ``(block, D)`` VMEM buffer (one semaphore per row, all in
flight at once; a masked id costs no DMA), waits for them, then writes the output block in one
vector pass that applies the shard mask (masked rows zero) from the same ids, also given as a
``(block, 1)`` VMEM block.

16-bit tables: Mosaic moves 16-bit arrays in whole (16, 128) tiles and refuses a one-row slice
(seen: "Slice sizes along tiled dimensions must be aligned to tiles"), so the kernel reads the
table as the 32-bit words that hold it (``ref.bitcast(uint32)``: rows 2k and 2k+1 share a word row,
row 2k in the low half, ``pltpu.bitcast``'s packing), fetches word row ``row // 2`` and keeps the
half the row's parity selects. The shard must have an even row count (the op declines otherwise).
The interpreters cannot DMA through a bitcast ref, so there the wrapper passes the words made by
``pltpu.bitcast`` on the array (the same reinterpretation, done by XLA); the in-kernel bitcast is
checked by the real TPU compiler (``dualop compile``), not by running it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels.cost import embedding_gather_cost
from dualop.kernels.pallas.common import block_budget, compiler_params, cost_estimate, sublane_tile, tpu_jit

__all__ = ["vocab_embedding", "vocab_embedding_reference", "MAX_BLOCK_TOKENS", "block_tokens_for"]

# Rows (and DMAs in flight, one semaphore each) per grid step, at most.
MAX_BLOCK_TOKENS = 128


def vocab_embedding_reference(ids, weight, bounds):
    """Plain jax.numpy statement of the kernel (same arguments, same result)."""
    ids = ids.astype(jnp.int32)
    org_start, org_end, added_start, added_end, added_offset = (bounds[i] for i in range(5))
    in_org = (ids >= org_start) & (ids < org_end)
    in_added = (ids >= added_start) & (ids < added_end)
    row = jnp.where(in_org, ids - org_start, ids - added_offset)
    rows = jnp.take(weight, jnp.where(in_org | in_added, row, 0), axis=0)
    return jnp.where((in_org | in_added)[:, None], rows, jnp.zeros((), weight.dtype))


def _bytes_per_element(dtype) -> int:
    """VMEM per output element of a grid step: the output block (double-buffered), the fetched
    32-bit words and the epilogue's float32 temporaries."""
    return 2 * jnp.dtype(dtype).itemsize + 4 + 8


def block_tokens_for(tokens: int, dim: int, dtype) -> int:
    """Tokens per grid step: the double-buffered ``(block, dim)`` output block within
    ``block_budget()``, a multiple of the sublane tile (or every token when fewer), at most
    ``MAX_BLOCK_TOKENS``."""
    tile = sublane_tile(dtype)
    fit = block_budget() // max(1, dim * _bytes_per_element(dtype))
    block = max(tile, min(MAX_BLOCK_TOKENS, fit) // tile * tile)
    return tokens if tokens <= block else block


def _kernel(ids_ref, bounds_ref, ids_block_ref, weight_ref, out_ref, words_ref, sems, *, block_tokens: int,
            prepacked: bool):
    base = pl.program_id(0) * block_tokens
    org_start, org_end = bounds_ref[0], bounds_ref[1]
    added_start, added_end, added_offset = bounds_ref[2], bounds_ref[3], bounds_ref[4]
    packing = 4 // jnp.dtype(out_ref.dtype).itemsize
    # 16-bit rows are fetched as the 32-bit words that hold them (a free reinterpretation of the HBM
    # buffer: rows 2k and 2k+1 share a word row, 2k in the low half), since Mosaic moves 16-bit
    # arrays in whole (16, 128) tiles and refuses a one-row slice of them.
    # The interpreters cannot DMA through a bitcast ref: there the wrapper passes the words
    # (``prepacked``, the same reinterpretation done by XLA).
    words = weight_ref if packing == 1 or prepacked else weight_ref.bitcast(jnp.uint32)

    def local_row(token):
        in_org = (token >= org_start) & (token < org_end)
        in_added = (token >= added_start) & (token < added_end)
        return in_org | in_added, jnp.where(in_org, token - org_start, token - added_offset)

    def row_copy(i):
        valid, row = local_row(ids_ref[base + i])
        word_row = jax.lax.div(jnp.where(valid, row, 0), packing)  # lax.div: Mosaic's floor div asks the device
        return valid, pltpu.make_async_copy(words.at[pl.ds(word_row, 1)], words_ref.at[pl.ds(i, 1)], sems.at[i])

    def start(i, carry):
        valid, dma = row_copy(i)

        @pl.when(valid)
        def _():
            dma.start()

        return carry

    def wait(i, carry):
        valid, dma = row_copy(i)

        @pl.when(valid)
        def _():
            dma.wait()

        return carry

    jax.lax.fori_loop(0, block_tokens, start, 0)
    jax.lax.fori_loop(0, block_tokens, wait, 0)
    # The shard mask, on the whole block at once: masked ids (and rows no DMA wrote) become zeros.
    valid, row = local_row(ids_block_ref[...])  # (block, 1)
    fetched = words_ref[...]
    if packing == 2:
        half = jnp.where((row & 1) == 1, fetched >> 16, fetched & 0xFFFF)
        fetched = pltpu.bitcast(half << 16, jnp.float32)  # a bfloat16 is the top half of its float32
    out_ref[...] = jnp.where(valid, fetched, 0).astype(out_ref.dtype)


@tpu_jit(static_argnames=("interpret", "block_tokens"))
def vocab_embedding(ids, weight, bounds, *, interpret=False, block_tokens: int | None = None):
    """Rows of ``weight`` ``[rows, D]`` for ``ids`` (any shape, int32/int64) under this rank's
    ``bounds`` (see the module docstring); returns ``[*ids.shape, D]`` in ``weight``'s dtype."""
    shape = ids.shape
    flat = ids.reshape(-1).astype(jnp.int32)
    tokens, dim = flat.shape[0], weight.shape[1]
    if tokens == 0:
        return jnp.zeros((*shape, dim), weight.dtype)
    block = block_tokens or block_tokens_for(tokens, dim, weight.dtype)
    steps = pl.cdiv(tokens, block)
    padded = jnp.full((steps * block,), -1, jnp.int32).at[:tokens].set(flat)
    itemsize = jnp.dtype(weight.dtype).itemsize
    word_dtype = weight.dtype if itemsize == 4 else jnp.uint32
    prepacked = itemsize != 4 and interpret is not False
    if weight.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"vocab_embedding: float32 or bfloat16 tables, got {weight.dtype} (Mosaic refuses float16's "
                         "unpacking)")
    if weight.shape[0] % (4 // itemsize):
        raise ValueError(f"vocab_embedding: 16-bit weights need an even row count, got {weight.shape[0]}")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(steps,),
        in_specs=[pl.BlockSpec((block, 1), lambda i, ids, bounds: (i, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((block, dim), lambda i, ids, bounds: (i, 0)),
        scratch_shapes=[pltpu.VMEM((block, dim), word_dtype), pltpu.SemaphoreType.DMA((block,))],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, block_tokens=block, prepacked=prepacked),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((tokens, dim), weight.dtype),
        compiler_params=compiler_params(1, vmem_bytes=block * dim * _bytes_per_element(weight.dtype)),
        cost_estimate=cost_estimate(embedding_gather_cost(tokens, dim, itemsize)),
        interpret=interpret,
    )(padded, bounds.astype(jnp.int32), padded.reshape(-1, 1), pltpu.bitcast(weight, jnp.uint32) if prepacked else weight)
    return out.reshape(*shape, dim)
