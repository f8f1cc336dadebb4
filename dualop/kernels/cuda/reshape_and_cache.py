"""KV-cache write as a Triton kernel: the ``reshape_and_cache`` op's CUDA/ROCm path, in place.

Contract (``ops/kv_cache.py``): token t's key and value heads ``[Hkv, D]`` go to cache page
``slot // page_size``, offset ``slot % page_size`` (``slot = slot_mapping[t]``), K head h at combined
head 2h and V head h at 2h+1; slots outside ``[0, num_pages * page_size)`` (negative: padding) are
skipped. One program per token moves its whole ``[Hkv, D]`` key and value (strided reads, so key
and value may be views); the cache is updated in place and returned.
Two tokens with one slot race here (which row stays is unspecified): the op first drops
every token a later one overwrites (``ops/kv_cache.py::last_writes``), so the last one wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    cache_stride_page, cache_stride_slot, cache_stride_head, capacity,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    slot = tl.where(slot < capacity, slot, -1)
    # A skipped token writes no head (a single comparison: the interpreter turns a boolean
    # `scalar & tensor` into int32, which its loads and stores refuse as a mask).
    heads = tl.where(slot >= 0, NUM_HEADS, 0)
    slot = tl.maximum(slot, 0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * key_stride_t + h[:, None] * key_stride_h + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + h[:, None] * value_stride_h + d[None, :], mask=mask)
    row = cache_ptr + (slot // PAGE_SIZE) * cache_stride_page + (slot % PAGE_SIZE) * cache_stride_slot
    k_ptrs = row + (2 * h)[:, None] * cache_stride_head + d[None, :]
    tl.store(k_ptrs, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_ptrs + cache_stride_head, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_pages: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_pages`` ``[num_pages, page_size, 2*Hkv, D]``
    at ``slot_mapping`` ``[T]``, in place; returns ``kv_pages``. Input is assumed validated (the op's
    check_inputs); the cache's last dim must be unit-strided (the op declines otherwise)."""
    tokens, num_heads, head_dim = key.shape
    num_pages, page_size, _, _ = kv_pages.shape
    if tokens == 0 or num_pages == 0:
        return kv_pages
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(num_heads)
    _reshape_and_cache_kernel[(tokens,)](
        key, value, kv_pages, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_pages.stride(0), kv_pages.stride(1), kv_pages.stride(2), num_pages * page_size,
        PAGE_SIZE=page_size, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=min(max(block_h * block_d // 512, 1), 8),
    )
    return kv_pages
