"""Ragged paged attention on the CPU for torch tensors (kernel: ``csrc/ragged_paged_attention.cc``):
each K/V row read straight from its page, once per (sequence, KV head, block of query rows)."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code
from dualop.kernels.cpu.abi import c_function

_C_RAGGED_PAGED_ATTENTION = c_function(
    "int dualop_ragged_paged_attention(int dtype, const void* q, const void* kv_pages, const int32_t* kv_lens, "
    "const int32_t* page_indices, const int32_t* cu_q_lens, int32_t num_seqs, void* out, int64_t tokens, "
    "int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t num_pages, int64_t page_size, "
    "int64_t pages_per_seq, int64_t max_seqs, float scale, int64_t window, float soft_cap, int custom_mask, "
    "float mask_value, float v_scale, int threads)"
)

__all__ = ["ragged_paged_attention"]


def ragged_paged_attention(q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any, *,
                           sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                           mask_value: float | None = None, k_scale: float | None = None,
                           v_scale: float | None = None) -> Any:
    """``[T, Hq, D]`` in q's dtype; rows past ``cu_q_lens[num_seqs]`` are zeros. Inputs validated
    by the op (``RaggedPagedAttention.check_inputs``)."""
    import torch

    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    code = dtype_code(q)
    if code is None:
        raise NotImplementedError(f"dtype {q.dtype} on {q.device} has no CPU kernel")
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    q, kv_pages = q.contiguous(), kv_pages.contiguous()
    kv_lens, page_indices, cu_q_lens = kv_lens.contiguous(), page_indices.contiguous(), cu_q_lens.contiguous()
    count = int(num_seqs[0])
    # zeros: padding rows past cu_q_lens[num_seqs], and any row metadata the op did not validate
    # (a caller past its checks) leaves unwritten, stay finite; one memset, small next to attention
    out = torch.zeros_like(q)
    if num_tokens:
        status = _C_RAGGED_PAGED_ATTENTION(
            dtype=code, q=q, kv_pages=kv_pages, kv_lens=kv_lens, page_indices=page_indices,
            cu_q_lens=cu_q_lens, num_seqs=count, out=out, tokens=num_tokens, q_heads=num_q_heads,
            kv_heads=combined // 2, head_dim=head_dim, num_pages=num_pages, page_size=page_size,
            pages_per_seq=pages_per_seq, max_seqs=max_seqs,
            scale=sm_scale * (1.0 if k_scale is None else k_scale), window=sliding_window or 0,
            soft_cap=soft_cap or 0.0, custom_mask=int(mask_value is not None),
            mask_value=0.0 if mask_value is None else mask_value, v_scale=1.0 if v_scale is None else v_scale,
            threads=torch.get_num_threads(),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_ragged_paged_attention returned {status}")
    return out
