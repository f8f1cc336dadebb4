"""The packed-segment rules of ``mm_encoder_attn`` (``ops/encoder_attention.py``) that its native
body and its kernels share: each token's segment, and non-finite values kept inside their own
segment. Written against an array namespace (``xp``), so every frontend and kernel runs the same
code."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["isolate_nonfinite_values", "segment_ids"]


def segment_ids(xp: Any, cu_seqlens: Any, seq_len: int, like: Any) -> Any:
    """Token ``i``'s segment: how many of ``cu_seqlens[1:]`` are ``<= i`` (comparisons only, so
    it traces with ``cu_seqlens`` unknown). int32 ``[S]``."""
    pos = xp.arange(seq_len, like)
    bounds = xp.astype(cu_seqlens[1:], xp.int32)
    return xp.sum(xp.astype(pos[:, None] >= bounds[None, :], xp.int32), axis=-1)


def isolate_nonfinite_values(xp: Any, out: Any, value: Any, seg: Any, num_ids: int) -> Any:
    """Non-finite values back into their own segment's rows, and only there. ``out`` float32
    ``[B, S, Hkv, G, D]`` is attention over packed segments computed with ``value``'s non-finite
    entries zeroed (a key's weight in another segment's rows is exactly 0, but ``0 * inf`` is NaN:
    zeroing keeps them out of those rows); ``value`` float32 ``[B, S, Hkv, D]`` as given; ``seg``
    int ``[B, S]`` each token's segment id, in ``[0, num_ids)``. A row whose segment holds a NaN, or
    both +inf and -inf, in value channel d gets NaN there; one holding only +inf (-inf), +inf (-inf);
    a row already NaN stays NaN. Per-segment counts (one-hot products of ``S * num_ids`` terms)
    rather than per-row ones: one weight per (row, key) would cost a product the size of ``P @ V``."""
    ids = xp.arange(num_ids, seg)
    onehot = xp.astype(seg[:, :, None] == ids[None, None, :], xp.float32)  # [B, S, n]
    flags = xp.concat([xp.astype(value == math.inf, xp.float32), xp.astype(value == -math.inf, xp.float32),
                       xp.astype(value != value, xp.float32)], axis=-1)  # [B, S, Hkv, 3D]
    per_segment = xp.einsum("bsn,bshd->bnhd", onehot, flags)
    per_row = xp.einsum("bsn,bnhd->bshd", onehot, per_segment)[:, :, :, None, :] > 0  # [B, S, Hkv, 1, 3D]
    d = value.shape[-1]
    pos, neg, nan = per_row[..., :d], per_row[..., d: 2 * d], per_row[..., 2 * d:]
    special = xp.where(nan | (pos & neg), math.nan, xp.where(pos, math.inf, -math.inf))
    return xp.where((out == out) & (pos | neg | nan), special, out)
