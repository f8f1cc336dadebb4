"""Output arguments: the torch forms of an op that write into given tensors instead of new ones.

An op whose class lists ``output_args`` (one keyword argument per result item, such as RMSNorm's
``("out", "residual_out")``) takes those tensors and returns them, written. That is the engine's
preallocated-output (``out=``) and in-place forms: an output argument may be the very input it
replaces (``norm(x, w, residual, out=x, residual_out=residual)`` is the engine's in-place fused
add-norm; ``rope(positions, q, k, query_out=q, key_out=k)`` its in-place rope), and every kernel
reads a row's inputs before it writes that row. An output that overlaps an input without being
exactly it would be read after it was written: refused. Only torch tensors can be written: a jax
array is immutable, so ``out=`` with jax arrays is a ``TypeError`` (jax donates buffers to
``jax.jit`` instead).

``check_output`` validates one output argument before any kernel runs; ``write_outputs`` puts a
result computed out of place into the given outputs (the native body and the paths whose kernels
return new arrays). ``torch.library`` declares the written form as its own mutating op
(``dualop/backends/torch/library.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dualop.ops._checks import dtype_name
from dualop.platforms import family_of, frontend_of

__all__ = ["check_output", "write_outputs"]


def _span(t: Any) -> tuple[int, int]:
    """The byte range ``[start, end)`` a non-empty torch tensor's elements cover."""
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
    return (t.data_ptr(), t.data_ptr() + extent * t.element_size())


def check_output(op: str, arg: str, out: Any, shape: tuple[int, ...], dtype: Any, device: Any,
                 inputs: Mapping[str, Any], others: Sequence[tuple[str, Any]] = ()) -> None:
    """Refuse an output argument that cannot take the result: not a torch tensor (``TypeError``,
    also for jax arrays, which are immutable), another dtype (``TypeError``), device or shape
    (``ValueError``), or memory that overlaps an input without being exactly that input (same
    start, shape and strides), or overlaps another output (``others``) at all (``ValueError``)."""
    fe = frontend_of(out)
    if fe is None or family_of(fe) != "torch":
        kind = ("a jax array (immutable: jax.jit with donate_argnums reuses buffers instead)" if fe else
                f"a {type(out).__module__}.{type(out).__qualname__}")
        raise TypeError(f"{op}: argument '{arg}' must be None or a torch.Tensor to write into, got {kind}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{op}: argument '{arg}' has shape {tuple(out.shape)}; expected {tuple(shape)} (the result's)")
    if out.dtype != dtype:
        raise TypeError(f"{op}: argument '{arg}' has dtype {dtype_name(out)}; expected "
                        f"{str(dtype).removeprefix('torch.')} (the result's)")
    if out.device != device:
        raise ValueError(f"{op}: argument '{arg}' is on {out.device}; expected {device} (the inputs')")
    if fe != "torch":
        return  # a torchax tensor's copy_ rebinds its array (no shared memory)
    from torch._C import _is_alias_of  # same storage: only then are the byte ranges compared

    for name, value in inputs.items():
        if value is None or value is out or frontend_of(value) != "torch" or not _is_alias_of(out, value):
            continue
        if not (value.data_ptr() == out.data_ptr() and value.shape == out.shape and value.stride() == out.stride()) \
                and _overlap(out, value):
            raise ValueError(f"{op}: argument '{arg}' overlaps '{name}' without being it; pass '{name}' itself "
                             f"(in place) or memory apart from it")
    for name, value in others:
        if value is not None and (value is out or _is_alias_of(out, value) and _overlap(out, value)):
            raise ValueError(f"{op}: arguments '{arg}' and '{name}' overlap; expected separate outputs")


def _rows(t: Any) -> tuple[int, int, int, int] | None:
    """A tensor as rows of one stride: ``(first element, rows, row length, row stride)`` in
    elements, or None when its layout is not that (a column slice of a matrix is: q, k and v split
    from one qkv projection)."""
    if t.ndim == 0 or t.stride(-1) != 1:
        return None
    width, rows, stride = t.shape[-1], 1, None
    for d in range(t.ndim - 2, -1, -1):
        if t.shape[d] == 1:
            continue
        step = t.stride(d) if stride is None else stride * rows
        if stride is None:
            stride = t.stride(d)
        elif t.stride(d) != step:
            return None
        rows *= t.shape[d]
    return (t.storage_offset(), rows, width, stride or width)


def _overlap(a: Any, b: Any) -> bool:
    """Whether two tensors of one storage share an element: exactly for rows of one stride (column
    slices of one matrix), else by their byte ranges (which may refuse two interleaved tensors that
    share nothing; never passes two that do)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    ra, rb = _rows(a), _rows(b)
    if ra is not None and rb is not None and ra[3] == rb[3] and a.element_size() == b.element_size():
        (start_a, rows_a, width_a, stride), (start_b, rows_b, width_b, _) = ra, rb
        col_a, col_b = start_a % stride, start_b % stride
        if col_a + width_a <= stride and col_b + width_b <= stride:  # no row wraps into the next
            row_a, row_b = start_a // stride, start_b // stride
            rows_meet = row_a < row_b + rows_b and row_b < row_a + rows_a
            return rows_meet and col_a < col_b + width_b and col_b < col_a + width_a
    (lo_a, hi_a), (lo_b, hi_b) = _span(a), _span(b)
    return lo_a < hi_b and lo_b < hi_a


def write_outputs(result: Any, outputs: Sequence[Any]) -> Any:
    """``result`` (an array, or a tuple of them and None) with each item whose output argument was
    given copied into it and replaced by it; items without one stay as computed."""
    if not any(o is not None for o in outputs):
        return result
    items = result if isinstance(result, tuple) else (result,)
    written = tuple(item if out is None or item is None else (out if item is out else out.copy_(item))
                    for item, out in zip(items, outputs))
    written += items[len(written):]
    return written if isinstance(result, tuple) else written[0]
