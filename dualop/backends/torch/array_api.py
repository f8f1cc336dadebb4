"""The array namespace frontend-neutral op bodies use, for torch tensors.

Each backend module exposes the same names with the same meaning (the shape of the Python array
API, plus the few functions it lacks); ``backends/xla/array_api.py`` is the jax twin.
"""

from __future__ import annotations

import torch

name = "torch"

float32 = torch.float32
float16 = torch.float16
bfloat16 = torch.bfloat16


def astype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def mean(x: torch.Tensor, axis: int = -1, keepdims: bool = False) -> torch.Tensor:
    return torch.mean(x, dim=axis, keepdim=keepdims)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def erf(x: torch.Tensor) -> torch.Tensor:
    return torch.erf(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


def maximum(x: torch.Tensor, y) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        return torch.clamp(x, min=y)
    return torch.maximum(x, y)


def round(x: torch.Tensor) -> torch.Tensor:  # noqa: A001 - the array API's name
    """To the nearest integer, halves to even."""
    return torch.round(x)


def where(cond: torch.Tensor, x, y) -> torch.Tensor:
    return torch.where(cond, x, y)


float8_e4m3fn = torch.float8_e4m3fn
float8_e4m3fnuz = torch.float8_e4m3fnuz


def abs(x: torch.Tensor) -> torch.Tensor:  # noqa: A001 - the array API's name
    return torch.abs(x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x)


def square(x: torch.Tensor) -> torch.Tensor:
    return torch.square(x)


def log1p(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(x)


def expm1(x: torch.Tensor) -> torch.Tensor:
    return torch.expm1(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x)


def minimum(x: torch.Tensor, y) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        return torch.clamp(x, max=y)
    return torch.minimum(x, y)


def clip(x: torch.Tensor, min=None, max=None) -> torch.Tensor:  # noqa: A002 - the array API's names
    return torch.clamp(x, min=min, max=max)


def amax(x: torch.Tensor, axis=None, keepdims: bool = False) -> torch.Tensor:
    if axis is None:
        return torch.amax(x) if not keepdims else torch.amax(x, dim=tuple(range(x.ndim)), keepdim=True)
    return torch.amax(x, dim=axis, keepdim=keepdims)


def sum(x: torch.Tensor, axis=None, keepdims: bool = False) -> torch.Tensor:  # noqa: A001
    if axis is None:
        return torch.sum(x)
    return torch.sum(x, dim=axis, keepdim=keepdims)


def std(x: torch.Tensor, axis: int = -1, keepdims: bool = False) -> torch.Tensor:
    """Population standard deviation (ddof 0)."""
    return torch.std(x, dim=axis, keepdim=keepdims, correction=0)


def asarray(value, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A tensor holding ``value`` on ``like``'s device."""
    return torch.as_tensor(value, dtype=dtype if dtype is not None else like.dtype, device=like.device)


def concat(arrays, axis: int = 0) -> torch.Tensor:
    return torch.cat(tuple(arrays), dim=axis)


def stack(arrays, axis: int = 0) -> torch.Tensor:
    return torch.stack(tuple(arrays), dim=axis)


def take(x: torch.Tensor, indices: torch.Tensor, axis: int = 0) -> torch.Tensor:
    """Rows of ``x`` along ``axis`` picked by the integer ``indices`` (any shape)."""
    flat = torch.index_select(x, axis, indices.reshape(-1))
    return flat.reshape(*x.shape[:axis], *indices.shape, *x.shape[axis + 1:])


# --- reshape_and_cache (ops/kv_cache.py) ---------------------------------------------------


def reshape(x: torch.Tensor, shape) -> torch.Tensor:
    return torch.reshape(x, tuple(shape))


def set_at_dropping(x: torch.Tensor, index: tuple, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x[index] = values`` for the entries where ``keep`` (the others are dropped), IN PLACE:
    torch updates ``x`` and returns it (the jax twin returns a new array).

    No data-dependent shapes (torch.compile, torch_xla): a dropped entry rewrites the first kept
    entry's value at its index (a duplicate write of the same value), or, when nothing is kept,
    ``x``'s first element with itself."""
    if keep.shape[0] == 0:
        return x
    # One-element index tensors throughout (no Python ints from data: torch.compile traces this).
    first = torch.argmax(keep.to(torch.int32)).reshape(1)  # the first kept entry (0 when none is)
    rows = (1,) * (values.ndim - 1)
    any_kept = keep.index_select(0, first)
    fallback_index = tuple(torch.where(any_kept, i.index_select(0, first), 0) for i in index)
    fallback_value = torch.where(any_kept.reshape(1, *rows), values.index_select(0, first), x[fallback_index])
    index = tuple(torch.where(keep, i, f) for i, f in zip(index, fallback_index))
    x.index_put_(index, torch.where(keep.reshape(-1, *rows), values, fallback_value))
    return x
# --- integer positions (mm_encoder_attn's segment ids) ---------------------------------------
int32 = torch.int32


def arange(n: int, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """``0, 1, ..., n - 1`` on ``like``'s device (int32 unless ``dtype`` says otherwise)."""
    return torch.arange(n, dtype=dtype if dtype is not None else torch.int32, device=like.device)


def einsum(subscripts: str, *operands: torch.Tensor) -> torch.Tensor:
    return torch.einsum(subscripts, *operands)


# --- mixture of experts (kernels/moe_math.py) ------------------------------------------------


def softmax(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    return torch.softmax(x, dim=axis)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values along the last axis and their int64 indices, largest first; among
    equal values the lower index first (a stable descending sort: ``torch.topk`` leaves the order
    of equal values unspecified, ``jax.lax.top_k`` puts the lower index first). Dense results, as
    ``torch.topk``'s and ``jax.lax.top_k``'s are (not views into the whole sort: an op returning
    them would otherwise have strides its kernels and fake tensors do not share)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), indices[..., :k].contiguous()


def take_along_last(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[..., indices[..., j]]`` along the last axis (same leading shape)."""
    if indices.numel() == 0:  # torch_xla's gather refuses an empty leading dim (0 tokens)
        return x.new_empty(indices.shape)
    return torch.gather(x, -1, indices.to(torch.int64))


def argsort(x: torch.Tensor, bound: int | None = None) -> torch.Tensor:
    """Indices that sort the last axis ascending, equal values in their original order (stable).
    ``bound`` (the values lie in ``[0, bound)``) lets the jax twin pack keys; torch sorts as is."""
    del bound
    return torch.argsort(x, dim=-1, stable=True)


def bincount(x: torch.Tensor, length: int) -> torch.Tensor:
    """Counts of ``0 .. length - 1`` in the 1-D int ``x`` (values outside are not counted), int32."""
    kept = x[(x >= 0) & (x < length)].to(torch.int64)
    return torch.bincount(kept, minlength=length)[:length].to(torch.int32)


# --- state-space serving batches (ops/ssm_batch.py) --------------------------------------------
def zeros(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Zeros of ``shape`` on ``like``'s device (``like``'s dtype unless ``dtype`` says otherwise)."""
    return torch.zeros(tuple(shape), dtype=dtype if dtype is not None else like.dtype, device=like.device)
