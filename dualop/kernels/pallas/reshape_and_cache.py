"""KV-cache write as a Pallas TPU kernel: the ``reshape_and_cache`` op's fast path.

Contract (``ops/kv_cache.py``): token t's key and value heads ``[Hkv, D]`` go to cache page
``slot_mapping[t] // page_size``, offset ``slot_mapping[t] % page_size``, K head h at combined head
2h and V head h at 2h+1; slots outside ``[0, num_pages * page_size)`` (negative: padding) are skipped.
Two tokens with one slot race here (which row stays is unspecified): the op first drops
every token a later one overwrites (``ops/kv_cache.py::last_writes``), so the last one wins.
Returns the new cache; under ``jax.jit`` donate it (``donate_argnums``) so XLA updates it in place.
A float8 cache (float8_e4m3fn, float8_e5m2) gets the codes ``quantize_kv`` gives (``kernels/kv_cache_math.py``)
with the inverse scales ``k_inverse`` / ``v_inverse`` (float32 arrays of shape (1,)).

Layout: the wrapper interleaves K and V into ``[T, 2*Hkv, D]`` (one small XLA op, which also casts or
quantises them to the cache's dtype) so each token's
row matches a cache row. Grid over blocks of ``BLOCK_TOKENS`` tokens; each step's rows sit in VMEM
(a ``(BLOCK_TOKENS, 2*Hkv, D)`` block, whole minor dims), the slot mapping is scalar-prefetched to
SMEM (padded with -1 to whole blocks), and the cache stays in HBM (``memory_space=pl.ANY``),
aliased input -> output (``input_output_aliases``): only the written rows move. Per token one DMA
``VMEM row -> HBM cache[page, offset]``; all of a step's copies are started, then all awaited, on
one DMA semaphore, each under the same slot test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.backends import array_namespace
from dualop.kernels.kv_cache_math import fp8_kv_format, quantize_kv
from dualop.kernels.pallas.common import compiler_params, tpu_jit

__all__ = ["reshape_and_cache", "reshape_and_cache_reference", "BLOCK_TOKENS"]

BLOCK_TOKENS = 32


def _cache_rows(key, value, kv_pages, k_inverse, v_inverse):
    """``[T, 2*Hkv, D]``: K and V interleaved in the cache's dtype (an fp8 cache's codes)."""
    tokens, _, head_dim = key.shape
    if fp8_kv_format(kv_pages.dtype) is None:
        key, value = key.astype(kv_pages.dtype), value.astype(kv_pages.dtype)
    else:
        xp = array_namespace(key)
        key, value = (quantize_kv(xp, x, inverse, kv_pages.dtype, xla=True)
                      for x, inverse in ((key, k_inverse), (value, v_inverse)))
    return jnp.stack([key, value], axis=2).reshape(tokens, kv_pages.shape[2], head_dim)


def reshape_and_cache_reference(key, value, kv_pages, slot_mapping, k_inverse=None, v_inverse=None):
    """Plain jax.numpy statement of the kernel (same arguments, same result)."""
    num_pages, page_size, combined, head_dim = kv_pages.shape
    kv = _cache_rows(key, value, kv_pages, k_inverse, v_inverse)
    slot = slot_mapping.astype(jnp.int32)
    keep = (slot >= 0) & (slot < num_pages * page_size)
    page = jnp.where(keep, slot // page_size, num_pages)  # out of range: dropped
    return kv_pages.at[page, slot % page_size].set(kv, mode="drop")


def _kernel(slots_ref, kv_ref, cache_in_ref, cache_ref, sem, *, page_size: int, capacity: int, block_tokens: int):
    del cache_in_ref  # the same HBM buffer as cache_ref (aliased)
    base = pl.program_id(0) * block_tokens

    def copy(i):
        slot = slots_ref[base + i]
        # lax.div/rem (truncating; used only for slots >= 0): jnp's floor division lowers through
        # sign, whose Mosaic rule asks the default device for the TPU generation (the CPU here).
        page, offset = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        return slot, pltpu.make_async_copy(kv_ref.at[i], cache_ref.at[page, offset], sem)

    def start(i, carry):
        slot, dma = copy(i)

        @pl.when((slot >= 0) & (slot < capacity))
        def _():
            dma.start()

        return carry

    def wait(i, carry):
        slot, dma = copy(i)

        @pl.when((slot >= 0) & (slot < capacity))
        def _():
            dma.wait()

        return carry

    jax.lax.fori_loop(0, block_tokens, start, 0)
    jax.lax.fori_loop(0, block_tokens, wait, 0)


@tpu_jit(static_argnames=("interpret", "block_tokens"))
def reshape_and_cache(key, value, kv_pages, slot_mapping, k_inverse=None, v_inverse=None, *, interpret=False,
                      block_tokens: int | None = None):
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_pages`` ``[num_pages, page_size, 2*Hkv, D]``
    at ``slot_mapping`` ``[T]``; returns the updated cache (a new array unless donated). An fp8
    cache needs ``k_inverse`` and ``v_inverse`` (``1 / k_scale``, ``1 / v_scale``: float32, shape (1,))."""
    tokens = key.shape[0]
    num_pages, page_size, combined, head_dim = kv_pages.shape
    if tokens == 0 or num_pages == 0:
        return kv_pages
    block = block_tokens or min(BLOCK_TOKENS, tokens)
    steps = pl.cdiv(tokens, block)
    kv = _cache_rows(key, value, kv_pages, k_inverse, v_inverse)
    slots = jnp.full((steps * block,), -1, jnp.int32).at[:tokens].set(slot_mapping.astype(jnp.int32))
    itemsize = jnp.dtype(kv_pages.dtype).itemsize
    kernel = functools.partial(_kernel, page_size=page_size, capacity=num_pages * page_size, block_tokens=block)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((block, combined, head_dim), lambda i, slots: (i, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv_pages.shape, kv_pages.dtype),
        input_output_aliases={2: 0},  # operands: slots (scalar prefetch), kv, kv_pages
        compiler_params=compiler_params(1, vmem_bytes=2 * block * combined * head_dim * itemsize),
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * kv.size * itemsize),
        interpret=interpret,
    )(slots, kv, kv_pages)
