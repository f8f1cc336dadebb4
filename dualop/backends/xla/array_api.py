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


def where(cond: jax.Array, x, y) -> jax.Array:
    return jnp.where(cond, x, y)
