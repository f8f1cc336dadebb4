"""The math every path of ``rel_pos_attention`` shares (``xp``: the frontend's array namespace):
the projections and the decomposed relative-position terms the native body and the three kernels
(Pallas, Triton, C++) compute around their attention loops. See ``dualop/ops/rel_pos_attention.py``
for the op."""

from __future__ import annotations

import numpy as np

__all__ = ["rel_pos_gather_matrix", "project_qkv", "rel_pos_terms", "project_out"]


def rel_pos_gather_matrix(size: int, table_rows: int) -> np.ndarray:
    """float32 ``[size, size, table_rows]``: row ``(i, j)`` holds the weights that make ``Rh[i, j]``
    (``T[i - j + size - 1]``, ``T`` the table linearly resized to ``2 size - 1`` rows with
    align_corners=False: source position ``(r + 0.5) L / (2 size - 1) - 0.5`` clamped at 0, between
    its floor and the next row, the last row repeated) out of the table's rows."""
    out_rows = 2 * size - 1
    resize = np.zeros((out_rows, table_rows), np.float64)
    ratio = table_rows / out_rows
    for r in range(out_rows):
        src = max((r + 0.5) * ratio - 0.5, 0.0)
        lo = min(int(np.floor(src)), table_rows - 1)
        hi = min(lo + 1, table_rows - 1)
        frac = src - lo
        resize[r, lo] += 1.0 - frac
        resize[r, hi] += frac
    index = np.arange(size)[:, None] - np.arange(size)[None, :] + size - 1
    return resize[index].astype(np.float32)


def _f32(xp, a):
    return None if a is None else xp.astype(a, xp.float32)


def project_qkv(xp, x, qkv_weight, qkv_bias, num_heads: int):
    """float32 q, k, v ``[B, heads, S, head_dim]`` (S = H W, row-major over the image) of ``x``."""
    b, hh, ww, dim = x.shape
    d = dim // num_heads
    qkv = xp.einsum("tc,oc->to", xp.astype(x, xp.float32).reshape(b * hh * ww, dim), _f32(xp, qkv_weight))
    if qkv_bias is not None:
        qkv = qkv + _f32(xp, qkv_bias)
    qkv = qkv.reshape(b, hh * ww, 3, num_heads, d)
    return tuple(qkv[:, :, i].swapaxes(1, 2) for i in range(3))


def rel_pos_terms(xp, q, rel_pos_h, rel_pos_w, height: int, width: int):
    """The decomposed relative-position terms of float32 ``q [B, heads, H W, d]``: ``rel_h [B, heads,
    H W, H]`` (``q . Rh[h_q, h']``) and ``rel_w [B, heads, H W, W]`` (``q . Rw[w_q, w']``). The logit of
    query ``(h, w)`` and key ``(h', w')`` gains ``rel_h[.., (h, w), h'] + rel_w[.., (h, w), w']``."""
    b, n, s, d = q.shape
    tables = []
    for table, size in ((rel_pos_h, height), (rel_pos_w, width)):
        size = int(size)  # the gather is built on the host: a traced size (torch.compile's) is specialised
        gather = xp.asarray(rel_pos_gather_matrix(size, int(table.shape[0])).reshape(size * size, -1), like=q,
                            dtype=xp.float32)
        tables.append(xp.einsum("pl,lc->pc", gather, _f32(xp, table)).reshape(size, size, d))
    grid = q.reshape(b, n, height, width, d)
    rel_h = xp.einsum("bnhwc,hkc->bnhwk", grid, tables[0]).reshape(b, n, s, height)
    rel_w = xp.einsum("bnhwc,wkc->bnhwk", grid, tables[1]).reshape(b, n, s, width)
    return rel_h, rel_w


def project_out(xp, attended, proj_weight, proj_bias, x):
    """``proj`` of float32 ``attended [B, heads, S, d]``, as ``x``'s shape and dtype."""
    b, n, s, d = attended.shape
    rows = attended.swapaxes(1, 2).reshape(b * s, n * d)
    out = xp.einsum("tc,oc->to", rows, _f32(xp, proj_weight))
    if proj_bias is not None:
        out = out + _f32(xp, proj_bias)
    return xp.astype(out.reshape(x.shape), x.dtype)
