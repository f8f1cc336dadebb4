"""KV-cache write as a Triton kernel: the ``reshape_and_cache`` op's CUDA/ROCm path, in place.

Contract (``ops/kv_cache.py``): token t's key and value heads ``[Hkv, D]`` go to cache page
``slot // page_size``, offset ``slot % page_size`` (``slot = slot_mapping[t]``), K head h at combined
head 2h and V head h at 2h+1; slots outside ``[0, num_pages * page_size)`` (negative: padding) are
skipped. One program per token moves its whole ``[Hkv, D]`` key and value (strided reads, so key
and value may be views); the cache is updated in place and returned.
Two tokens with one slot race here (which row stays is unspecified): the op first drops
every token a later one overwrites (``ops/kv_cache.py::last_writes``), so the last one wins.

A float8 cache (float8_e4m3fn, float8_e5m2) is written through its uint8 view with the codes of
``kernels/kv_cache_math.py``: ``clip(x * inverse, -max, max)`` in float32, then rounded to nearest
even by integer arithmetic on its bits (``fp8_code``), not by Triton's float8 casts: those need
sm_89 for e4m3 and do not round to nearest even in Triton's interpreter, while integer arithmetic
gives the same bytes on every GPU and in the interpreter. The inverse scales come as floats or as
float32 tensors of one element (read in the kernel: no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.kv_cache_math import fp8_kv_format

__all__ = ["reshape_and_cache", "fp8_code"]


@triton.jit
def fp8_code(x, inverse, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """The fp8 code (int32 holding the byte) of ``x * inverse``: float32, clipped to ``+-MAX``,
    rounded to nearest even onto the grid of a format with ``MANTISSA`` bits and exponent bias
    ``BIAS``; NaN gives 0x7f with x's sign. Normal results round the float32 significand at bit
    ``23 - MANTISSA`` (a carry moves into the exponent, as it should); below the smallest normal,
    the significand with its implicit bit is shifted to multiples of the subnormal step."""
    y = x.to(tl.float32) * inverse
    nan = y != y
    y = tl.minimum(tl.maximum(y, -MAX), MAX)
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANTISSA
    normal = ((a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)) >> drop) - ((127 - BIAS) << MANTISSA)
    mant = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((151 - BIAS - MANTISSA) - (a >> 23), 1), 31)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = tl.where(rem == half, q & 1, tl.where(rem > half, 1, 0))
    code = tl.where(a >= ((128 - BIAS) << 23), normal, q + up)
    return tl.where(nan, 0x7F, code) | sign


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    cache_stride_page, cache_stride_slot, cache_stride_head, capacity, k_inverse, v_inverse,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, INVERSE_IN_MEMORY: tl.constexpr,
    MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
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
    if FP8:  # the cache's uint8 view
        if INVERSE_IN_MEMORY:
            k_inverse = tl.load(k_inverse)
            v_inverse = tl.load(v_inverse)
        k = fp8_code(k, k_inverse, MANTISSA, BIAS, MAX)
        v = fp8_code(v, v_inverse, MANTISSA, BIAS, MAX)
    tl.store(k_ptrs, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_ptrs + cache_stride_head, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_pages: torch.Tensor,
                      slot_mapping: torch.Tensor, *, k_inverse: float | torch.Tensor = 1.0,
                      v_inverse: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_pages`` ``[num_pages, page_size, 2*Hkv, D]``
    at ``slot_mapping`` ``[T]``, in place; returns ``kv_pages``. An fp8 cache stores the codes of
    ``key * k_inverse`` and ``value * v_inverse`` (``1 / k_scale``, ``1 / v_scale``: floats or
    float32 tensors of one element). Input is assumed validated (the op's check_inputs); the
    cache's last dim must be unit-strided (the op declines otherwise)."""
    tokens, num_heads, head_dim = key.shape
    num_pages, page_size, _, _ = kv_pages.shape
    if tokens == 0 or num_pages == 0:
        return kv_pages
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(num_heads)
    fmt = fp8_kv_format(kv_pages.dtype)
    in_memory = isinstance(k_inverse, torch.Tensor) or isinstance(v_inverse, torch.Tensor)
    if in_memory:  # both as tensors (a fill, no host copy: CUDA-graph safe)
        k_inverse, v_inverse = (t.reshape(1).contiguous() if isinstance(t, torch.Tensor)
                                else torch.full((1,), t, dtype=torch.float32, device=key.device)
                                for t in (k_inverse, v_inverse))
    cache = kv_pages if fmt is None else kv_pages.view(torch.uint8)
    _reshape_and_cache_kernel[(tokens,)](
        key, value, cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), num_pages * page_size, k_inverse, v_inverse,
        PAGE_SIZE=page_size, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        FP8=fmt is not None, INVERSE_IN_MEMORY=in_memory, MANTISSA=fmt.mantissa_bits if fmt else 0,
        BIAS=fmt.exponent_bias if fmt else 0, MAX=fmt.max if fmt else 0.0,
        num_warps=min(max(block_h * block_d // 512, 1), 8),
    )
    return kv_pages
