"""The rotary-embedding formula every path shares (native bodies; kernels compute the same).

A head's first ``rotary_dim`` channels rotate in pairs by per-token angles, the rest pass through.
Neox style pairs channel i with i + rotary_dim/2 (halves); GPT-J style pairs 2i with 2i+1
(interleaved). With ``x1, x2`` a pair and ``cos, sin`` of its angle:
``(x1 cos - x2 sin, x2 cos + x1 sin)``. ``cos``/``sin`` come from the op's cache cast to the
query's dtype (as the reference engine does); the arithmetic is float32, cast once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rotate"]


def rotate(xp: Any, x: Any, cos: Any, sin: Any, rotary_dim: int, is_neox_style: bool) -> Any:
    """Rotate ``x`` ``[T, H, D]`` by ``cos``/``sin`` ``[T, rotary_dim // 2]``; returns ``x``'s dtype."""
    half = rotary_dim // 2
    xf = xp.astype(x[..., :rotary_dim], xp.float32)
    c = xp.astype(cos, xp.float32)[:, None, :]
    s = xp.astype(sin, xp.float32)[:, None, :]
    if is_neox_style:
        x1, x2 = xf[..., :half], xf[..., half:]
        rotated = xp.concat((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = xp.stack((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1).reshape(xf.shape)
    rotated = xp.astype(rotated, x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return xp.concat((rotated, x[..., rotary_dim:]), axis=-1)
