"""Dequantisation of the weight formats quantized checkpoints ship, written once against an array
namespace ``xp`` (torch's or jax's): the reference the quantized linear layers' native bodies and
kernels are held to.

Every function returns the weight in the linear layers' layout, ``[..., out_features, in_features]``
(``[N, K]``), as float32 unless ``dtype`` says otherwise; a code is widened to float32 and
multiplied by its scale in float32 (a zero point subtracted first), as the reference engine's
dequantisation does. The formats, as their writers define them:

- **Block-scaled** (DeepSeek-V3, the Qwen3 "-FP8" releases: ``quant_method: fp8`` with
  ``weight_block_size: [bn, bk]``): ``q [N, K]`` (float8_e4m3fn) and one float32 scale per
  ``bn x bk`` block, ``scale [ceil(N / bn), ceil(K / bk)]`` (``weight_scale_inv``: despite the name,
  a multiplier): ``w[n, k] = q[n, k] * scale[n // bn, k // bk]``. The last block row and column may
  be partial.
- **Per tensor / per channel** (fp8 or int8; ``compressed-tensors`` ``tensor`` / ``channel``
  strategies, ``quant_method: fp8`` without blocks): ``scale`` of one element or ``[N]`` /
  ``[N, 1]``: ``w[n, k] = q[n, k] * scale[n]``.
- **Grouped** (``compressed-tensors`` ``group`` strategy, GPTQ-style W4A16 / W8A16): ``scale`` and
  an optional ``zero_point`` ``[N, K / g]``: ``w[n, k] = (q[n, k] - zero_point[n, k // g]) *
  scale[n, k // g]``.
- **Packed integers** (``compressed-tensors`` ``pack-quantized``): ``num_bits``-bit codes packed
  ``32 // num_bits`` to an int32 word along the input dim, code ``i`` of a word in bits
  ``[num_bits * i, num_bits * (i + 1))``, stored with ``2 ** (num_bits - 1)`` added (unsigned),
  rows padded to whole words; ``unpack_int32`` returns the signed codes.
- **AWQ** (``quant_method: awq``, GEMM layout): ``qweight`` and ``qzeros`` int32 packed along the
  OUTPUT dim, ``[K, N / 8]`` and ``[K / g, N / 8]``, code ``j`` of a word's 8 in nibble
  ``AWQ_NIBBLE_OF[j]``, unsigned; ``scales [K / g, N]``: ``w[n, k] = (q[k, n] - z[k // g, n]) *
  s[k // g, n]``.
"""

from __future__ import annotations

__all__ = ["AWQ_NIBBLE_OF", "dequantize_awq", "dequantize_blocks", "dequantize_groups", "dequantize_per_channel",
           "dequantize_weight", "pack_int32", "unpack_awq", "unpack_int32"]

# AWQ's order within a 32-bit word: logical code j sits in nibble AWQ_NIBBLE_OF[j] (bits 4n to 4n+3).
AWQ_NIBBLE_OF = (0, 4, 1, 5, 2, 6, 3, 7)


def _expand(xp, scale, size: int, block: int, axis: int):
    """``scale`` repeated ``block`` times along ``axis`` and cut to ``size`` entries there."""
    return xp.take(scale, xp.arange(size, like=scale) // block, axis=axis)


def dequantize_blocks(xp, q, scale, block: tuple[int, int], dtype=None):
    """Block-scaled ``q [..., N, K]`` with ``scale [..., ceil(N / bn), ceil(K / bk)]`` (see the
    module docstring); ``block = (bn, bk)``."""
    bn, bk = block
    n, k = q.shape[-2], q.shape[-1]
    s = xp.astype(scale, xp.float32)
    s = _expand(xp, _expand(xp, s, n, bn, s.ndim - 2), k, bk, s.ndim - 1)
    w = xp.astype(q, xp.float32) * s
    return w if dtype is None else xp.astype(w, dtype)


def dequantize_per_channel(xp, q, scale, dtype=None):
    """``q [..., N, K]`` times a per-tensor (one element) or per-output-channel (``[..., N]`` or
    ``[..., N, 1]``) ``scale``."""
    s = xp.astype(scale, xp.float32)
    if s.ndim == q.ndim - 1:
        s = xp.reshape(s, (*s.shape, 1))
    elif s.ndim != q.ndim:
        s = xp.reshape(s, (1,) * q.ndim)
    w = xp.astype(q, xp.float32) * s
    return w if dtype is None else xp.astype(w, dtype)


def dequantize_groups(xp, q, scale, group_size: int, zero_point=None, dtype=None):
    """Grouped ``q [..., N, K]`` with ``scale`` (and ``zero_point``) ``[..., N, K / group_size]``."""
    k = q.shape[-1]
    w = xp.astype(q, xp.float32)
    if zero_point is not None:
        w = w - _expand(xp, xp.astype(zero_point, xp.float32), k, group_size, zero_point.ndim - 1)
    w = w * _expand(xp, xp.astype(scale, xp.float32), k, group_size, scale.ndim - 1)
    return w if dtype is None else xp.astype(w, dtype)


def _codes(xp, words, num_bits: int, order) -> list:
    """The codes of int32 ``words``, one array per position of ``order`` (code j from slot order[j]).

    Each slot is masked out before the shift, so the shift divides exactly: torch_xla shifts a
    negative int32 right by dividing, rounded toward zero (``-3 >> 1 == -1``), where torch, jax and
    numpy floor; shifting first would give a word's high codes off by one there."""
    mask = (1 << num_bits) - 1

    def slot_mask(slot: int) -> int:  # mask << (num_bits * slot) as a signed int32
        return ((mask << (num_bits * slot)) + 2**31) % 2**32 - 2**31

    return [((words & slot_mask(slot)) >> (num_bits * slot)) & mask for slot in order]


def unpack_int32(xp, packed, num_bits: int, size: int):
    """``num_bits``-bit codes packed along the last dim of int32 ``packed [..., words]`` (the
    ``pack-quantized`` layout), as signed int32 codes ``[..., size]`` (padding dropped)."""
    per_word = 32 // num_bits
    codes = xp.stack(_codes(xp, packed, num_bits, range(per_word)), axis=-1)
    codes = xp.reshape(codes, (*packed.shape[:-1], packed.shape[-1] * per_word))[..., :size]
    return codes - (1 << (num_bits - 1))


def unpack_awq(xp, packed):
    """AWQ's int32 ``[rows, N / 8]`` as unsigned codes ``[rows, N]``."""
    codes = xp.stack(_codes(xp, packed, 4, AWQ_NIBBLE_OF), axis=-1)
    return xp.reshape(codes, (*packed.shape[:-1], packed.shape[-1] * 8))


def dequantize_awq(xp, qweight, qzeros, scales, group_size: int, dtype=None):
    """AWQ's GEMM layout (``qweight [K, N / 8]``, ``qzeros [K / g, N / 8]``, ``scales [K / g, N]``)
    as the linear's ``[N, K]`` weight."""
    k = qweight.shape[0]
    q = xp.astype(unpack_awq(xp, qweight), xp.float32)
    z = _expand(xp, xp.astype(unpack_awq(xp, qzeros), xp.float32), k, group_size, 0)
    s = _expand(xp, xp.astype(scales, xp.float32), k, group_size, 0)
    w = xp.einsum("kn->nk", (q - z) * s)
    return w if dtype is None else xp.astype(w, dtype)


def dequantize_weight(xp, quant, codes, scale, zero_point, n: int, k: int, dtype=None):
    """The ``[N, K]`` weight a quantized weight's arrays hold under ``quant`` (its ``WeightQuant``,
    read by attribute: ``layout``, ``strategy``, ``bits``, ``block``, ``group_size``)."""
    if quant.layout == "awq":
        return dequantize_awq(xp, codes, zero_point, scale, quant.group_size, dtype)
    zero = zero_point
    if quant.layout == "packed":
        codes = unpack_int32(xp, codes, quant.bits, k)
        if zero_point is not None:
            rows = scale.shape[0]
            zero = xp.einsum("kn->nk", unpack_int32(xp, xp.einsum("nk->kn", zero_point), quant.bits, rows))
    if quant.strategy == "block":
        return dequantize_blocks(xp, codes, scale, quant.block, dtype)
    if quant.strategy == "group":
        return dequantize_groups(xp, codes, scale, quant.group_size, zero, dtype)
    if zero is not None:  # per channel / tensor with zero points: one group of all K columns
        s = xp.reshape(scale, (-1, 1)) if quant.strategy == "channel" else xp.reshape(scale, (1, 1))
        w = (xp.astype(codes, xp.float32) - xp.astype(xp.reshape(zero, s.shape), xp.float32)) * xp.astype(s, xp.float32)
        return w if dtype is None else xp.astype(w, dtype)
    return dequantize_per_channel(xp, codes, xp.reshape(scale, (-1,)) if quant.strategy == "channel" else scale, dtype)


def pack_int32(codes, num_bits: int, axis: int = -1, order=None):
    """Unsigned ``num_bits``-bit numpy ``codes`` packed into int32 words along ``axis`` (padded with
    zero codes to whole words): code ``j`` of a word in slot ``order[j]`` (default ``j``), slot ``s``
    at bits ``[num_bits * s, num_bits * (s + 1))``. The inverse of ``unpack_int32`` (which also
    subtracts the offset) and ``unpack_awq`` (``order=AWQ_NIBBLE_OF``); for writing checkpoints and
    test weights."""
    import numpy as np

    per = 32 // num_bits
    order = tuple(range(per)) if order is None else tuple(order)
    c = np.moveaxis(np.asarray(codes).astype(np.int64), axis, -1)
    c = np.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, (-c.shape[-1]) % per)]).reshape(*c.shape[:-1], -1, per)
    words = sum(c[..., j] << (num_bits * slot) for j, slot in enumerate(order))
    return np.moveaxis(((words + 2**31) % 2**32 - 2**31).astype(np.int32), -1, axis)
