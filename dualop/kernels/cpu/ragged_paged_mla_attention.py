"""Absorbed MLA over a paged latent cache on the CPU for torch tensors: a C++ decode kernel and
float32 GEMMs (oneDNN/MKL).

Sequences with at most ``DECODE_ROWS`` queries (decode, short chunks) go to the C++ kernel
(``csrc/ragged_paged_mla_attention.cc``): each sequence's latent rows read once from their pages,
an online softmax in float32 (against vLLM's ``mla_decode_kvcache``: docs/BENCHMARKS.md). Where
the kernels cannot be built, those sequences take the GEMM path below.

Every head of a token reads the same latent row, so per cached element the op does about 2H
multiply-adds: GEMM-shaped work, which a BLAS GEMM runs far faster than a row loop. Without the
kernel, sequences with at most ``DECODE_ROWS`` queries are batched, ``DECODE_BATCH`` at a time, each
padded to the group's longest query and cached length (sorted by length, so padding stays small):
one gather of their pages into float32 ``[n, span, L + R]``, then ``bmm`` for the scores and for
``probs . rows[:L]``. Longer sequences (prefill) run alone, in chunks of query rows that keep the
float32 scores near ``SCORE_BYTES``. Math: float32 scores, masked, softmax, one cast; rows past a
sequence's ``kv_len`` are zeroed after
the gather (a stale row may hold NaN, and ``0 * NaN`` would reach the output). Metadata is validated by the op; here it is clamped anyway.

A float8 cache (float8_e4m3fn, float8_e5m2) takes the GEMM path for every sequence: the C++ kernel
reads pages in q's dtype only, so it declines them. The rows are gathered as bytes (torch's CPU
indexing has no float8 kernels), decoded by torch (exact) and multiplied by ``k_scale`` in float32,
the native body's ``code * k_scale``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dualop.kernels.cpu import KernelUnavailable, load
from dualop.kernels.cpu.abi import c_function
from dualop.kernels.cpu.common import dtype_code

_C_MLA_DECODE = c_function(
    "int dualop_mla_decode(const DualopArray* q, const DualopArray* latent_pages, const DualopArray* kv_lens, "
    "const DualopArray* page_indices, const DualopArray* cu_q_lens, const DualopArray* seqs, const DualopArray* out, "
    "float scale, int threads)"
)

__all__ = ["ragged_paged_mla_attention"]

DECODE_ROWS = 4
DECODE_BATCH = 16
SCORE_BYTES = 64 << 20


def _attend(q: Any, rows: Any, kv_len: Any, q_pos: Any, latent: int, sm_scale: float) -> Any:
    """``q`` float32 ``[n, R, H, D]`` (R query rows at KV positions ``q_pos [n, R]``) over ``rows``
    float32 ``[n, span, D]`` of which the first ``kv_len [n]`` count: ``[n, R, H, L]`` float32."""
    import torch

    n, r, h, d = q.shape
    span = rows.shape[1]
    pos = torch.arange(span)
    rows.masked_fill_((pos[None, :] >= kv_len[:, None])[:, :, None], 0.0)  # stale rows past kv_len may be NaN
    scores = torch.bmm(q.reshape(n, r * h, d), rows.transpose(1, 2)).mul_(sm_scale).reshape(n, r, h, span)
    allowed = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < kv_len[:, None, None])
    scores.masked_fill_(~allowed[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(n, r * h, span)
    return torch.bmm(probs, rows[:, :, :latent]).reshape(n, r, h, latent)


def _gather_rows(latent_pages: Any, index: Any, shape: tuple[int, ...], k_scale: float | None) -> Any:
    """``latent_pages[index]`` reshaped to ``shape`` in float32, an fp8 cache's codes times ``k_scale``."""
    import torch

    if latent_pages.element_size() == 1:  # float8: gathered as bytes, then decoded
        rows = latent_pages.view(torch.uint8)[index].view(latent_pages.dtype)
    else:
        rows = latent_pages[index]
    rows = rows.reshape(shape).to(torch.float32)
    return rows if k_scale is None else rows.mul_(k_scale)


def _decode_in_kernel(q: Any, pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, seqs: list[int], out: Any,
                      sm_scale: float) -> bool:
    """Decode sequences ``seqs`` into their rows of ``out`` with the C++ kernel, given the metadata
    as this module reads it (``cu_q_lens`` a clipped running max, ``kv_lens`` and page ids clamped);
    False (nothing written) where it cannot run here."""
    import torch

    if dtype_code(q) is None or pages.dtype != q.dtype:
        return False
    try:
        load()
    except KernelUnavailable:
        return False
    status = _C_MLA_DECODE(
        q=q.contiguous(), latent_pages=pages.contiguous(), kv_lens=kv_lens.contiguous(),
        page_indices=page_indices.contiguous(), cu_q_lens=cu_q_lens.contiguous(),
        seqs=torch.tensor(seqs, dtype=torch.int64), out=out, scale=sm_scale, threads=torch.get_num_threads(),
    )
    if status != 0:
        raise NotImplementedError(f"dualop_mla_decode returned {status}")
    return True


def ragged_paged_mla_attention(q_latent: Any, latent_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                               num_seqs: Any, *, kv_lora_rank: int, sm_scale: float = 1.0,
                               k_scale: float | None = None) -> Any:
    """``[T, H, L]`` in q's dtype, zeros in rows no sequence owns (see the module docstring)."""
    import torch

    tokens, heads, width = q_latent.shape
    num_pages, page_size, _ = latent_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    out = torch.zeros((tokens, heads, kv_lora_rank), dtype=q_latent.dtype)
    if tokens == 0 or max_seqs == 0 or pages_per_seq == 0:
        return out
    n = int(np.clip(int(num_seqs[0]), 0, max_seqs))
    cu = np.maximum.accumulate(np.clip(cu_q_lens.numpy().astype(np.int64), 0, tokens))  # as ops/attention.py
    lens = np.clip(kv_lens.numpy().astype(np.int64), 0, pages_per_seq * page_size)
    table = page_indices.clamp(0, num_pages - 1)
    qf = q_latent.to(torch.float32)
    short, long = [], []
    for i in range(n):
        q_len = int(cu[i + 1] - cu[i])
        if 0 < q_len <= lens[i]:  # kv_len < q_len is refused by the op; nothing to do for q_len 0
            (short if q_len <= DECODE_ROWS else long).append(i)
    if short and _decode_in_kernel(q_latent, latent_pages, torch.from_numpy(lens.astype(np.int32)), table,
                                   torch.from_numpy(cu.astype(np.int32)), short, out, sm_scale):
        short = []
    short.sort(key=lambda i: lens[i])
    for start in range(0, len(short), DECODE_BATCH):
        group = short[start: start + DECODE_BATCH]
        q_lens = np.array([cu[i + 1] - cu[i] for i in group])
        width_q = int(q_lens.max())
        pages = -(-int(lens[group].max()) // page_size)
        rows = _gather_rows(latent_pages, table[group, :pages], (len(group), pages * page_size, width), k_scale)
        offsets = np.arange(width_q)
        index = np.minimum(cu[group][:, None] + offsets[None, :], cu[np.array(group) + 1][:, None] - 1)
        q = qf[torch.from_numpy(index)]  # [n, R, H, D]; rows past a sequence's q_len repeat its last
        q_pos = torch.from_numpy(lens[group][:, None] - q_lens[:, None] + offsets[None, :])
        got = _attend(q, rows, torch.from_numpy(lens[group]), q_pos, kv_lora_rank, sm_scale)
        for j, i in enumerate(group):
            out[cu[i]: cu[i + 1]] = got[j, : q_lens[j]].to(out.dtype)
    for i in long:
        q_len, kv_len = int(cu[i + 1] - cu[i]), int(lens[i])
        pages = -(-kv_len // page_size)
        rows = _gather_rows(latent_pages, table[i, :pages], (1, pages * page_size, width), k_scale)
        chunk = max(1, SCORE_BYTES // (4 * heads * pages * page_size))
        for r0 in range(0, q_len, chunk):
            r1 = min(q_len, r0 + chunk)
            q = qf[cu[i] + r0: cu[i] + r1][None]
            q_pos = torch.arange(kv_len - q_len + r0, kv_len - q_len + r1)[None]
            got = _attend(q, rows, torch.tensor([kv_len]), q_pos, kv_lora_rank, sm_scale)
            out[cu[i] + r0: cu[i] + r1] = got[0].to(out.dtype)
    return out
