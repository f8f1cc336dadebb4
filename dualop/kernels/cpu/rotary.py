"""Rotary embedding on the CPU for torch tensors (kernel: ``csrc/rotary.cc``): query and key in one
OpenMP pass over tokens, float32 math, one cast."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.kernels.cpu.abi import c_function
from dualop.kernels.cpu.torch_ops import TorchOperator

_C_ROTARY = c_function(
    "int dualop_rotary(const DualopArray* q, const DualopArray* k, const DualopArray* cos, const DualopArray* sin, "
    "const DualopArray* q_out, const DualopArray* k_out, int64_t rotary_dim, int is_neox, int threads)"
)

_C_ROTARY_BY_POSITION = c_function(
    "int dualop_rotary_by_position(const DualopArray* positions, const DualopArray* q, const DualopArray* k, "
    "const DualopArray* cos_sin_cache, const DualopArray* q_out, const DualopArray* k_out, int64_t rotary_dim, "
    "int is_neox, int threads)"
)

__all__ = ["FAST_ROTARY_BY_POSITION", "rotary", "rotary_by_position", "supports"]

# The torch operator in front of dualop_rotary_by_position (csrc/torch/ops.cc): called as
# FAST_ROTARY_BY_POSITION.get()(positions, query, key, cos_sin_cache, query_out, key_out, head_size,
# rotary_dim, max_position, is_neox), it returns (query, key), or (None, None) for a call it does
# not take (a position outside [0, max_position) among them).
FAST_ROTARY_BY_POSITION = TorchOperator("rotary_by_position")

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


def _written(given: Any, like: Any) -> Any:
    """Where the kernel writes: the given output (viewed as ``like``'s ``[T, H, D]``) when it is
    row-major, else a new array (copied into the given one afterwards)."""
    import torch

    if given is not None and given.is_contiguous():
        return given.view(like.shape)
    return torch.empty_like(like)


def _delivered(results: tuple, given: tuple, shapes: tuple) -> tuple[Any, Any]:
    """The kernel's results in the inputs' shapes, or the given outputs (written, or copied into
    where the kernel wrote elsewhere)."""
    out = []
    for result, target, shape in zip(results, given, shapes):
        if result is None:
            out.append(None)
        elif target is None:
            out.append(result.view(shape))
        else:
            if result.data_ptr() != target.data_ptr():
                target.copy_(result.view(target.shape))
            out.append(target)
    return tuple(out)


def rotary_by_position(positions: Any, query: Any, key: Any, cos_sin_cache: Any, *, head_size: int, rotary_dim: int,
                       is_neox_style: bool, query_out: Any = None, key_out: Any = None) -> tuple[Any, Any]:
    """The engine's rope in one kernel: token t of ``query`` / ``key`` (``[..., H*D]`` or
    ``[..., H, D]``, T tokens) rotates by row ``positions[t]`` of ``cos_sin_cache``
    ``[P, rotary_dim]`` (cos half then sin half, in the query's dtype). Positions were checked by
    the op (the kernel clamps them all the same). Returns ``(query, key)`` of the inputs' shapes:
    new arrays, or the given ``query_out`` / ``key_out`` written (which may be the inputs: in place)."""
    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    why = supports(query, cos_sin_cache[:, : rotary_dim // 2])
    if why is not None:
        raise NotImplementedError(why)
    if cos_sin_cache.dtype != query.dtype:
        raise NotImplementedError(f"a cos/sin cache of {cos_sin_cache.dtype} for a {query.dtype} query")
    flat = positions.reshape(-1)
    tokens = flat.shape[0]
    shapes = (query.shape, None if key is None else key.shape)
    if tokens == 0:  # nothing to rotate (and no head count to read from an empty array)
        return _delivered((query.new_empty(query.shape), None if key is None else key.new_empty(key.shape)),
                          (query_out, key_out), shapes)
    q = query.contiguous().view(tokens, -1, head_size)
    k = None if key is None else key.contiguous().view(tokens, -1, head_size)
    q_out, k_out = _written(query_out, q), None if k is None else _written(key_out, k)
    if q.numel() + (0 if k is None else k.numel()):
        status = _C_ROTARY_BY_POSITION(
            positions=flat.contiguous(), q=q, k=k, cos_sin_cache=cos_sin_cache, q_out=q_out, k_out=k_out,
            rotary_dim=rotary_dim, is_neox=int(is_neox_style),
            threads=threads_for(q.numel() + (0 if k is None else k.numel())),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_rotary_by_position returned {status}")
    return _delivered((q_out, k_out), (query_out, key_out), shapes)


def rotary(query: Any, key: Any, cos: Any, sin: Any, *, rotary_dim: int, is_neox_style: bool, query_out: Any = None,
           key_out: Any = None) -> tuple[Any, Any]:
    """Rotate ``query`` ``[T, Hq, D]`` (and ``key`` ``[T, Hk, D]`` or None) by ``cos``/``sin``
    ``[Tc, rotary_dim // 2]`` (token t takes row t % Tc); returns new ``(query, key)``, or the given
    ``query_out`` / ``key_out`` (any shape of as many elements; may be the inputs) written."""
    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    why = supports(query, cos)
    if why is not None:
        raise NotImplementedError(why)
    tokens = query.shape[0]
    shapes = (query.shape, None if key is None else key.shape)
    query = query.contiguous()
    q_out = _written(query_out, query)
    k_out = None
    if key is not None:
        key = key.contiguous()
        k_out = _written(key_out, key)
    if tokens and query.numel() + (0 if key is None else key.numel()):  # no query heads still rotates the key
        cos, sin = _cos_sin_rows(cos, sin)
        status = _C_ROTARY(
            q=query, k=key, cos=cos, sin=sin, q_out=q_out, k_out=k_out, rotary_dim=rotary_dim,
            is_neox=int(is_neox_style), threads=threads_for(query.numel() + (0 if key is None else key.numel())),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_rotary returned {status}")
    return _delivered((q_out, k_out), (query_out, key_out), shapes)
