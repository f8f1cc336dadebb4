"""The array namespace frontend-neutral op bodies use, for jax arrays (twin of the torch one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

name = "jax"

float32 = jnp.float32
float16 = jnp.float16
bfloat16 = jnp.bfloat16


def astype(x: jax.Array, dtype) -> jax.Array:
    return x.astype(dtype)


def mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return jnp.mean(x, axis=axis, keepdims=keepdims)


def rsqrt(x: jax.Array) -> jax.Array:
    return jax.lax.rsqrt(x)


def sigmoid(x: jax.Array) -> jax.Array:
    return jax.nn.sigmoid(x)


def tanh(x: jax.Array) -> jax.Array:
    return jnp.tanh(x)


def erf(x: jax.Array) -> jax.Array:
    return jax.scipy.special.erf(x)


def exp(x: jax.Array) -> jax.Array:
    return jnp.exp(x)


def maximum(x: jax.Array, y) -> jax.Array:
    return jnp.maximum(x, y)


def round(x: jax.Array) -> jax.Array:  # noqa: A001 - the array API's name
    """To the nearest integer, halves to even."""
    return jnp.round(x)


def where(cond: jax.Array, x, y) -> jax.Array:
    return jnp.where(cond, x, y)


float8_e4m3fn = jnp.float8_e4m3fn
float8_e4m3fnuz = jnp.float8_e4m3fnuz


def abs(x: jax.Array) -> jax.Array:  # noqa: A001 - the array API's name
    return jnp.abs(x)


def sqrt(x: jax.Array) -> jax.Array:
    return jnp.sqrt(x)


def square(x: jax.Array) -> jax.Array:
    return jnp.square(x)


def log1p(x: jax.Array) -> jax.Array:
    return jnp.log1p(x)


def expm1(x: jax.Array) -> jax.Array:
    return jnp.expm1(x)


def softplus(x: jax.Array) -> jax.Array:
    return jax.nn.softplus(x)


def minimum(x: jax.Array, y) -> jax.Array:
    return jnp.minimum(x, y)


def clip(x: jax.Array, min=None, max=None) -> jax.Array:  # noqa: A002 - the array API's names
    return jnp.clip(x, min, max)


def amax(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    return jnp.max(x, axis=axis, keepdims=keepdims)


def sum(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:  # noqa: A001
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def std(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Population standard deviation (ddof 0)."""
    return jnp.std(x, axis=axis, keepdims=keepdims)


def asarray(value, like: jax.Array, dtype=None) -> jax.Array:
    """An array holding ``value`` (jax places it; ``like`` fixes the default dtype)."""
    return jnp.asarray(value, dtype=dtype if dtype is not None else like.dtype)


def concat(arrays, axis: int = 0) -> jax.Array:
    return jnp.concatenate(tuple(arrays), axis=axis)


def stack(arrays, axis: int = 0) -> jax.Array:
    return jnp.stack(tuple(arrays), axis=axis)


def take(x: jax.Array, indices: jax.Array, axis: int = 0) -> jax.Array:
    """Rows of ``x`` along ``axis`` picked by the integer ``indices`` (any shape); out-of-range
    indices are clamped (XLA's gather semantics, made explicit)."""
    return jnp.take(x, indices, axis=axis, mode="clip")


# --- reshape_and_cache (ops/kv_cache.py) ---------------------------------------------------


def reshape(x: jax.Array, shape) -> jax.Array:
    return jnp.reshape(x, tuple(shape))


def set_at_dropping(x: jax.Array, index: tuple, values: jax.Array, keep: jax.Array) -> jax.Array:
    """``x[index] = values`` for the entries where ``keep`` (the others are dropped), as a NEW
    array (jax arrays are immutable; the torch twin updates in place). A dropped entry's first
    index becomes ``x.shape[0]``, out of range, which ``mode="drop"`` skips."""
    first = jnp.where(keep, index[0], x.shape[0])
    return x.at[(first, *index[1:])].set(values, mode="drop")
# --- integer positions (mm_encoder_attn's segment ids) ---------------------------------------
int32 = jnp.int32


def arange(n: int, like: jax.Array, dtype=None) -> jax.Array:
    """``0, 1, ..., n - 1`` (int32 unless ``dtype`` says otherwise); ``like`` for the torch twin's device."""
    return jnp.arange(n, dtype=dtype if dtype is not None else jnp.int32)


def einsum(subscripts: str, *operands: jax.Array) -> jax.Array:
    """At full float32 precision (XLA:TPU otherwise multiplies float32 in bfloat16 passes)."""
    return jnp.einsum(subscripts, *operands, precision=jax.lax.Precision.HIGHEST)


# --- mixture of experts (kernels/moe_math.py) ------------------------------------------------


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    return jax.nn.softmax(x, axis=axis)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest values along the last axis and their int32 indices, largest first; among
    equal values the lower index first (``jax.lax.top_k``'s rule; the torch twin sorts stably)."""
    return jax.lax.top_k(x, k)


def take_along_last(x: jax.Array, indices: jax.Array) -> jax.Array:
    """``x[..., indices[..., j]]`` along the last axis (same leading shape)."""
    return jnp.take_along_axis(x, indices, axis=-1)


def argsort(x: jax.Array, bound: int | None = None) -> jax.Array:
    """Indices that sort the last axis ascending, equal values in their original order (stable).

    ``bound``: the values are ints in ``[0, bound)``. A 1-D ``x`` then sorts as one int32 operand,
    ``x * n + index`` (the index breaks ties, so it stays stable), instead of a (key, index) pair
    sort: half the data through the sort network, and XLA:TPU compiles it in about half the time
    at serving sizes (65536 MoE pairs)."""
    n = x.shape[-1]
    if bound is not None and x.ndim == 1 and 0 < n and bound * n < 2**31 and jnp.issubdtype(x.dtype, jnp.integer):
        packed = x.astype(jnp.int32) * n + jnp.arange(n, dtype=jnp.int32)
        return jax.lax.rem(jnp.sort(packed), jnp.int32(n))
    return jnp.argsort(x, axis=-1, stable=True).astype(jnp.int32)


def bincount(x: jax.Array, length: int) -> jax.Array:
    """Counts of ``0 .. length - 1`` in the 1-D int ``x`` (values outside are not counted), int32."""
    kept = jnp.where((x >= 0) & (x < length), x, length)
    return jnp.bincount(kept, length=length + 1)[:length].astype(jnp.int32)


# --- state-space serving batches (ops/ssm_batch.py) --------------------------------------------
def zeros(shape, like: jax.Array, dtype=None) -> jax.Array:
    """Zeros of ``shape`` (``like``'s dtype unless ``dtype`` says otherwise)."""
    return jnp.zeros(tuple(shape), dtype=dtype if dtype is not None else like.dtype)
