"""The quantized linear layers' GEMM for jax arrays off the TPU (XLA:CPU and XLA:GPU): the weight
stays in its codes, and each scale is applied to the partial sums of the columns it covers rather
than to the weight, so no float copy of the weight is made; XLA does the dots.

``quantized_linear(x, codes, scale, zero_point=None, input_scale=None, bias=None, *, quant, n, k,
interpret=False)`` is the linear ops' reference (``_native_gemm`` with a ``QuantizedWeight``: the
activations quantized as the scheme's W8A8 GEMM quantizes them, then ``x @ w.T``) reordered:

- int8 W8A8: ``x`` quantized per token (or by the static ``input_scale``) to int8, one
  int8 x int8 -> int32 ``dot_general`` (XLA's integer dot), then ``x_scale * w_scale`` per
  (row, output) in float32;
- fp8 W8A8: ``x`` quantized to float8_e4m3fn as ``quant_fp8`` does (``quant_fp8_reference``, its
  plain statement), the codes of both multiplied as exact 16-bit values, each (token group,
  weight block) partial sum scaled by both scales;
- weight-only: the codes widened to ``x``'s dtype (int8, int4 and e4m3 codes are exact in
  bfloat16) and multiplied with ``x``; per channel, the scale multiplies the output; per group or
  block, the dot runs per group of columns (``mgc,ngc->mng``) and the scales weight the groups'
  sums; zero points subtract ``z * sum(x over the group)``.

Accumulation is float32 (int32 for int8 x int8), the bias is added in float32, one cast to ``x``'s
dtype at the end. ``interpret`` (XLA:CPU, which has no bfloat16 x bfloat16 -> float32 dot in
jax 0.7.1) widens the 16-bit operands to float32 first: their products are exact in float32, so
the sums are the same ones. ``quant`` is the weight's ``WeightQuant`` (read by attribute only).

On XLA:CPU the per-group form loses to one GEMM on the dequantised weight from a few rows on:
there XLA's batched dot over the groups transposes the widened codes and writes a
``[rows, N, groups]`` float32 partial per call, where a dequantise-then-dot streams the codes once
into Eigen's GEMM. So on XLA:CPU, from ``DEQUANTIZE_ROWS`` rows (and always for AWQ, whose
nibble-order unpack already makes a whole-weight pass), weight-only and fp8 W8A8 products
dequantise the weight in float32 inside the program (a transient buffer of the call, as the
engine's AWQ GEMM does for large batches; the stored weight stays quantized) and run one float32
dot; fp8 W8A8's activations are their codes times their scales. int8 W8A8 keeps XLA's integer dot.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from dualop.backends import array_namespace
from dualop.kernels import quant_math
from dualop.kernels.pallas.quant_fp8 import quant_fp8_reference

__all__ = ["quantized_linear", "supports"]

_INT8_MAX = 127.0
_F32 = jnp.float32
# XLA:CPU: from this many rows of x, a grouped or per-channel product runs as one GEMM on the
# dequantised weight (measured on a 4096 x 4096 weight: the per-group form is faster at 1 row,
# 1.3-1.4x slower from 4).
DEQUANTIZE_ROWS = 4


def supports(quant: Any, n: int, k: int, dtype_name: str) -> str | None:
    """Every scheme a ``QuantizedWeight`` holds (this is XLA, not a tiled kernel)."""
    return None


def _dot(a: jax.Array, b: jax.Array, spec: str, interpret: Any) -> jax.Array:
    """``einsum(spec, a, b)`` with float32 accumulation (integer operands: int32)."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.int32)
    if interpret or a.dtype == _F32:
        a, b = a.astype(_F32), b.astype(_F32)
    return jnp.einsum(spec, a, b, preferred_element_type=_F32,
                      precision=jax.lax.Precision.HIGHEST if a.dtype == _F32 else None)


def _int8_activations(xf: jax.Array, quant: Any, input_scale: Any) -> tuple[jax.Array, jax.Array]:
    """int8 codes and their float32 scales (``[..., 1]``) of ``x``, as ``quantize_activations``."""
    if quant.activations == "static":
        scale = jnp.reshape(input_scale.astype(_F32), (1,) * xf.ndim)
    else:
        amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True, initial=0.0)
        scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
    codes = jnp.clip(jnp.round(xf / scale), -_INT8_MAX - 1, _INT8_MAX).astype(jnp.int8)
    return codes, scale


def _fp8_activations(x: jax.Array, quant: Any, input_scale: Any) -> tuple[jax.Array, jax.Array]:
    """float8_e4m3fn codes of ``x`` and their float32 scales: per token group of ``block[1]``
    (block weights, ``[..., groups]``), per tensor (static, or a per-tensor weight) or per token."""
    if quant.strategy == "block":
        return quant_fp8_reference(x, granularity="group", group_size=quant.block[1])
    if quant.activations == "static":
        return quant_fp8_reference(x, input_scale.reshape(1).astype(_F32), granularity="tensor")
    return quant_fp8_reference(x, granularity="tensor" if quant.strategy == "tensor" else "token")


def _unpacked_codes(codes: jax.Array, zero_point: Any, quant: Any, n: int, k: int):
    """int8 codes ``[N, K]`` and int32 zero points (``[N, groups]`` or None) of a ``packed``
    (compressed-tensors) weight."""
    q = quant_math.unpack_int32(jnp, codes, quant.bits, k).astype(jnp.int8)
    zero = None
    if zero_point is not None:
        groups = zero_point.shape[-1]
        zero = quant_math.unpack_int32(jnp, zero_point.T, quant.bits, n).T[:, :groups]
    return q, zero


def _pad_to(a: jax.Array, axis: int, size: int) -> jax.Array:
    extra = size - a.shape[axis]
    if extra == 0:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, extra)
    return jnp.pad(a, pad)


def _grouped(x: jax.Array, codes_nk: jax.Array, group: int, interpret: Any) -> tuple[jax.Array, jax.Array]:
    """Per-group partial sums ``[..., N, G]`` of ``x . codes`` and the group sums of ``x``
    ``[..., G]`` (K padded with zeros to whole groups)."""
    k = x.shape[-1]
    groups = -(-k // group)
    xg = _pad_to(x, -1, groups * group).reshape(*x.shape[:-1], groups, group)
    wg = _pad_to(codes_nk, 1, groups * group).reshape(codes_nk.shape[0], groups, group)
    return _dot(xg, wg.astype(x.dtype), "...gc,ngc->...ng", interpret), jnp.sum(xg.astype(_F32), axis=-1)


def _dequantized_product(x: jax.Array, codes: jax.Array, scale: jax.Array, zero_point: Any, input_scale: Any,
                         quant: Any, n: int, k: int) -> jax.Array:
    """``x @ w.T`` in float32 on the weight dequantised in float32 (fp8 W8A8: x's codes times
    their scales first): the native body's product, as one GEMM."""
    if quant.activations != "none":
        xq, xs = _fp8_activations(x, quant, input_scale)
        if quant.strategy == "block":
            xs = jnp.repeat(xs, quant.block[1], axis=-1)[..., :k]
        xf = xq.astype(_F32) * xs
    else:
        xf = x.astype(_F32)
    w = quant_math.dequantize_weight(array_namespace(codes), quant, codes, scale, zero_point, n, k)
    return jnp.matmul(xf, w.T, precision=jax.lax.Precision.HIGHEST)  # AWQ's [K, N] transposed twice: none


def quantized_linear(x: jax.Array, codes: jax.Array, scale: jax.Array, zero_point: Any = None, input_scale: Any = None,
                     bias: Any = None, *, quant: Any, n: int, k: int, interpret: Any = False) -> jax.Array:
    xf = x.astype(_F32)
    rows = math.prod(x.shape[:-1])
    int8_w8a8 = quant.activations != "none" and quant.codes == "int8"
    if interpret and not int8_w8a8 and (rows >= DEQUANTIZE_ROWS or quant.layout == "awq"):
        y = _dequantized_product(x, codes, scale, zero_point, input_scale, quant, n, k)
    elif int8_w8a8:
        xq, xs = _int8_activations(xf, quant, input_scale)
        acc = _dot(xq, codes, "...k,nk->...n", interpret).astype(_F32)
        y = acc * xs * jnp.reshape(scale.astype(_F32), (-1,))
    elif quant.activations != "none":  # fp8 W8A8: codes times codes, both scales per partial sum
        xq, xs = _fp8_activations(x, quant, input_scale)
        xq, wq = xq.astype(jnp.bfloat16), codes.astype(jnp.bfloat16)
        if quant.strategy == "block":
            bn, bk = quant.block
            partial, _ = _grouped(xq, wq, bk, interpret)  # [..., N, K / bk]
            w_scale = jnp.repeat(scale.astype(_F32), bn, axis=0)[:n]  # [N, K / bk]
            y = jnp.sum(partial * w_scale * xs[..., None, :], axis=-1)
        else:
            partial = _dot(xq, wq, "...k,nk->...n", interpret)
            y = partial * (xs if xs.ndim == x.ndim else jnp.reshape(xs, (1,) * x.ndim)) * jnp.reshape(
                scale.astype(_F32), (-1,))
    else:
        y = _weight_only(x, codes, scale, zero_point, quant, n, k, interpret)
    if bias is not None:
        y = y + bias.astype(_F32)
    return y.astype(x.dtype)


def _weight_only(x, codes, scale, zero_point, quant, n: int, k: int, interpret: Any) -> jax.Array:
    """``x @ dequantize(w).T`` in float32 with the scales (and zero points) applied to partial sums."""
    s = scale.astype(_F32)
    if quant.layout == "awq":
        g = quant.group_size
        q = quant_math.unpack_awq(jnp, codes).T.astype(jnp.int8)  # [N, K], unsigned codes 0..15
        z = quant_math.unpack_awq(jnp, zero_point).T  # [N, groups]
        partial, xsum = _grouped(x, q, g, interpret)
        return jnp.sum((partial - z.astype(_F32) * xsum[..., None, :]) * s.T, axis=-1)
    zero = zero_point
    if quant.layout == "packed":
        codes, zero = _unpacked_codes(codes, zero_point, quant, n, k)
    if quant.strategy == "group":
        partial, xsum = _grouped(x, codes, quant.group_size, interpret)
        if zero is not None:
            partial = partial - zero.astype(_F32) * xsum[..., None, :]
        return jnp.sum(partial * s, axis=-1)
    if quant.strategy == "block":
        bn, bk = quant.block
        partial, _ = _grouped(x, codes, bk, interpret)
        return jnp.sum(partial * jnp.repeat(s, bn, axis=0)[:n], axis=-1)
    acc = _dot(x, codes.astype(x.dtype), "...k,nk->...n", interpret)
    s = jnp.reshape(s, (-1,))  # per channel [N], or per tensor [1]
    if zero is not None:
        acc = acc - jnp.reshape(zero.astype(_F32), (-1,)) * jnp.sum(x.astype(_F32), axis=-1, keepdims=True)
    return acc * s
