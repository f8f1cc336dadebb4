"""Ragged paged attention on the CPU for torch tensors (kernel: ``csrc/ragged_paged_attention.cc``):
each K/V row read straight from its page, once per (sequence, KV head, block of query rows). A
float8 cache (float8_e4m3fn, float8_e5m2) is passed as its uint8 view; the kernel decodes each
element by table."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code
from dualop.kernels.cpu.abi import c_function
from dualop.kernels.cpu.torch_ops import TorchOperator
from dualop.kernels.kv_cache_math import fp8_kv_format

# Declared for the torch operator (csrc/torch/ops.cc calls it); the calls here go through the _kv form.
_C_RAGGED_PAGED_ATTENTION = c_function(
    "int dualop_ragged_paged_attention(const DualopArray* q, const DualopArray* kv_pages, const DualopArray* kv_lens, "
    "const DualopArray* page_indices, const DualopArray* cu_q_lens, int32_t num_seqs, const DualopArray* out, "
    "float scale, int64_t window, float soft_cap, int custom_mask, float mask_value, float v_scale, int threads)"
)

# The same with the cache's format: kv_format 0 (q's dtype), 1 (float8_e4m3fn) or 2 (float8_e5m2),
# the float8 caches passed as uint8, and the attention sinks (float32 [q_heads], or None).
_C_RAGGED_PAGED_ATTENTION_KV = c_function(
    "int dualop_ragged_paged_attention_kv(const DualopArray* q, const DualopArray* kv_pages, "
    "const DualopArray* kv_lens, const DualopArray* page_indices, const DualopArray* cu_q_lens, int32_t num_seqs, "
    "const DualopArray* out, const DualopArray* sinks, float scale, int64_t window, float soft_cap, int custom_mask, "
    "float mask_value, float v_scale, int kv_format, int threads)"
)
_KV_FORMATS = {None: 0, "float8_e4m3fn": 1, "float8_e5m2": 2}

__all__ = ["FAST_RAGGED_PAGED_ATTENTION", "ragged_paged_attention"]

# The torch operator in front of dualop_ragged_paged_attention (csrc/torch/ops.cc) for calls with
# sm_scale alone: FAST_RAGGED_PAGED_ATTENTION.get()(q, kv_pages, kv_lens, page_indices, cu_q_lens,
# num_seqs, sm_scale) returns the output, or None for a call it does not take (metadata values
# included).
FAST_RAGGED_PAGED_ATTENTION = TorchOperator("ragged_paged_attention")


def ragged_paged_attention(q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
                           sinks: Any = None, *,
                           sm_scale: float = 1.0, sliding_window: int | None = None, soft_cap: float | None = None,
                           mask_value: float | None = None, k_scale: float | None = None,
                           v_scale: float | None = None) -> Any:
    """``[T, Hq, D]`` in q's dtype; rows past ``cu_q_lens[num_seqs]`` are zeros. Inputs validated
    by the op (``RaggedPagedAttention.check_inputs``)."""
    import torch

    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    if dtype_code(q) is None:
        raise NotImplementedError(f"dtype {q.dtype} on {q.device} has no CPU kernel")
    num_tokens = q.shape[0]
    fmt = fp8_kv_format(kv_pages.dtype)
    q, kv_pages = q.contiguous(), kv_pages.contiguous()
    if fmt is not None:
        kv_pages = kv_pages.view(torch.uint8)
    kv_lens, page_indices, cu_q_lens = kv_lens.contiguous(), page_indices.contiguous(), cu_q_lens.contiguous()
    count = int(num_seqs[0])
    # zeros: padding rows past cu_q_lens[num_seqs], and any row metadata the op did not validate
    # (a caller past its checks) leaves unwritten, stay finite; one memset, small next to attention
    out = torch.zeros_like(q)
    if num_tokens:
        status = _C_RAGGED_PAGED_ATTENTION_KV(
            q=q, kv_pages=kv_pages, kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
            num_seqs=count, out=out, sinks=None if sinks is None else sinks.to(torch.float32).contiguous(), scale=sm_scale * (1.0 if k_scale is None else k_scale), window=sliding_window or 0,
            soft_cap=soft_cap or 0.0, custom_mask=int(mask_value is not None),
            mask_value=0.0 if mask_value is None else mask_value, v_scale=1.0 if v_scale is None else v_scale,
            kv_format=_KV_FORMATS[None if fmt is None else fmt.dtype], threads=torch.get_num_threads(),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_ragged_paged_attention_kv returned {status}")
    return out
