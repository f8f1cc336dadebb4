"""Rotary embedding on the CPU for torch tensors (kernel: ``csrc/rotary.cc``): query and key in one
OpenMP pass over tokens, float32 math, one cast."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.kernels.cpu.abi import c_function

_C_ROTARY = c_function(
    "int dualop_rotary(const DualopArray* q, const DualopArray* k, const DualopArray* cos, const DualopArray* sin, "
    "const DualopArray* q_out, const DualopArray* k_out, int64_t rotary_dim, int is_neox, int threads)"
)

__all__ = ["rotary", "supports"]

MAX_HALF = 1024  # the kernel keeps a token's cos/sin row (rotary_dim / 2 floats) on the stack


def supports(query: Any, cos: Any) -> str | None:
    """None if the kernel takes these arguments, else why not."""
    if dtype_code(query) is None:
        return f"dtype {query.dtype} on {query.device} has no CPU kernel"
    if dtype_code(cos) is None:
        return f"cos/sin of dtype {cos.dtype} on {cos.device} have no CPU kernel"
    if cos.shape[-1] > MAX_HALF:
        return f"rotary_dim {2 * cos.shape[-1]} exceeds the CPU kernel's {2 * MAX_HALF}"
    return None


def _cos_sin_rows(cos: Any, sin: Any) -> tuple[Any, Any]:
    """cos and sin with unit last stride and one shared row stride (views of one cache row stay views)."""
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0) or cos.dtype != sin.dtype:
        cos, sin = cos.contiguous(), sin.to(cos.dtype).contiguous()
    return cos, sin


def rotary(query: Any, key: Any, cos: Any, sin: Any, *, rotary_dim: int, is_neox_style: bool) -> tuple[Any, Any]:
    """Rotate ``query`` ``[T, Hq, D]`` (and ``key`` ``[T, Hk, D]`` or None) by ``cos``/``sin``
    ``[Tc, rotary_dim // 2]`` (token t takes row t % Tc); returns new ``(query, key)``."""
    import torch

    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    why = supports(query, cos)
    if why is not None:
        raise NotImplementedError(why)
    tokens = query.shape[0]
    query = query.contiguous()
    q_out = torch.empty_like(query)
    k_out = None
    if key is not None:
        key = key.contiguous()
        k_out = torch.empty_like(key)
    if tokens and query.numel() + (0 if key is None else key.numel()):  # no query heads still rotates the key
        cos, sin = _cos_sin_rows(cos, sin)
        status = _C_ROTARY(
            q=query, k=key, cos=cos, sin=sin, q_out=q_out, k_out=k_out, rotary_dim=rotary_dim,
            is_neox=int(is_neox_style), threads=threads_for(query.numel() + (0 if key is None else key.numel())),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_rotary returned {status}")
    return q_out, k_out
