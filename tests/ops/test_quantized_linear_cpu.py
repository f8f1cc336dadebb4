"""The C++ CPU quantized GEMM (``dualop.kernels.cpu.quantized_linear``) against the reference
(``dualop.ops.linear._native_gemm``: x quantized as the scheme's W8A8 GEMM does, the weight
dequantised, float32 matmul) for every scheme it covers, in float32, bfloat16 and float16, on ragged
shapes (no rows, one, five; N and K off the tiles and the scale groups; a bias; 3-D x), with few rows
(codes decoded in registers) and more (decoded into a scratch tile); and ``supports`` declining what
it does not cover."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop.kernels.cpu import KernelUnavailable, load
from dualop.kernels.cpu import quantized_linear as kernel
from dualop.ops import QuantizedWeight, WeightQuant
from dualop.ops.linear import _native_gemm
from dualop.testing import compare

try:
    load()
except KernelUnavailable as err:  # pragma: no cover
    pytest.skip(f"CPU kernels unavailable: {err}", allow_module_level=True)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pack(codes: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    """Unsigned ``bits``-bit codes packed into int32 words along ``axis`` (code j of a word in slot
    ``order[j]``), the tail padded with zeros."""
    per = 32 // bits
    order = order or range(per)
    c = np.moveaxis(codes.astype(np.int64), axis, -1)
    c = np.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, (-c.shape[-1]) % per)]).reshape(*c.shape[:-1], -1, per)
    words = sum(c[..., j] << (bits * slot) for j, slot in enumerate(order))
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(((words + 2**31) % 2**32 - 2**31).astype(np.int32), -1,
                                                             axis)))


def _scales(rng, shape, dtype) -> torch.Tensor:
    return torch.from_numpy(rng.uniform(0.002, 0.02, shape).astype(np.float32)).to(dtype)


def _weight(name: str, n: int, k: int, rng) -> QuantizedWeight:
    """A QuantizedWeight of scheme ``name`` with random codes, scales and zero points."""
    spec = {
        "int8_channel": WeightQuant("int8", "channel"),
        "int8_tensor": WeightQuant("int8", "tensor"),
        "int8_group64_zero": WeightQuant("int8", "group", group_size=64, symmetric=False),
        "int8_block": WeightQuant("int8", "block", block=(32, 64)),
        "int8_packed_group32": WeightQuant("int8", "group", group_size=32, layout="packed"),
        "int8_packed_channel_zero": WeightQuant("int8", "channel", symmetric=False, layout="packed"),
        "int8_group48": WeightQuant("int8", "group", group_size=48),  # not a multiple of 32: portable path
        "fp8_tensor": WeightQuant("fp8", "tensor"),
        "fp8_channel": WeightQuant("fp8", "channel"),
        "fp8_block": WeightQuant("fp8", "block", block=(128, 128)),
        "int4_group32": WeightQuant("int4", "group", group_size=32, layout="packed"),
        "int4_group128": WeightQuant("int4", "group", group_size=128, layout="packed"),
        "int4_group64_zero": WeightQuant("int4", "group", group_size=64, symmetric=False, layout="packed"),
        "int4_channel": WeightQuant("int4", "channel", layout="packed"),
        "int4_channel_zero": WeightQuant("int4", "channel", symmetric=False, layout="packed"),
        "awq_group64": WeightQuant("int4", "group", group_size=64, symmetric=False, layout="awq"),
        "awq_group32": WeightQuant("int4", "group", group_size=32, symmetric=False, layout="awq"),
        "w8a8_channel": WeightQuant("int8", "channel", activations="dynamic"),
        "w8a8_tensor_static": WeightQuant("int8", "tensor", activations="static"),
        "w8a8_block": WeightQuant("int8", "block", block=(32, 128), activations="dynamic"),
        "w8a8_packed_channel": WeightQuant("int8", "channel", layout="packed", activations="dynamic"),
    }[name]
    scale_dtype = (torch.float32, torch.bfloat16, torch.float16)[len(name) % 3]
    scale = _scales(rng, spec.scale_shape(n, k), scale_dtype)
    zero = input_scale = None
    if spec.layout == "awq":
        periods = spec.scale_shape(n, k)[0]
        codes = _pack(rng.integers(0, 16, (k, n)), 4, 1, _AWQ_ORDER)
        zero = _pack(rng.integers(0, 16, (periods, n)), 4, 1, _AWQ_ORDER)
        scale = scale.to(torch.float16)
    elif spec.layout == "packed":
        codes = _pack(rng.integers(0, 2**spec.bits, (n, k)), spec.bits, 1)
        if not spec.symmetric:
            zero = _pack(rng.integers(0, 2**spec.bits, spec.scale_shape(n, k)), spec.bits, 0)
    elif spec.codes == "int8":
        codes = torch.from_numpy(rng.integers(-128, 128, (n, k)).astype(np.int8))
        if not spec.symmetric:
            zero = torch.from_numpy(rng.integers(-30, 30, spec.scale_shape(n, k)).astype(np.int8))
    else:  # fp8 values of every magnitude, subnormals and zeros included
        w = rng.normal(0, 1, (n, k)) * np.exp2(rng.integers(-12, 8, (n, k)))
        w[rng.random((n, k)) < 0.05] = 0.0
        codes = torch.from_numpy(np.clip(w, -448, 448).astype(np.float32)).to(torch.float8_e4m3fn)
    if spec.activations == "static":
        input_scale = torch.tensor([0.03], dtype=torch.float32)
    return QuantizedWeight(spec, codes, scale, zero, input_scale, shape=(n, k))


def _check(name: str, lead: tuple[int, ...], n: int, k: int, dtype: str, bias: bool, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    weight = _weight(name, n, k, rng)
    x = torch.from_numpy(rng.normal(0, 1, (*lead, k)).astype(np.float32)).to(_DTYPES[dtype])
    b = torch.from_numpy(rng.normal(0, 1, n).astype(np.float32)).to(x.dtype) if bias else None
    assert kernel.supports(weight.quant, n, k, dtype) is None
    got = kernel.quantized_matmul(x, weight.codes, weight.scale, weight.zero_point, weight.input_scale, b,
                                  quant=weight.quant, n=n, k=k)
    want = _native_gemm(x, weight, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    result = compare(got.float().numpy(), want.float().numpy(), dtype, normwise=True)
    assert result.ok, f"{name} {lead} {n}x{k} {dtype}: {result}"


SCHEMES = ["int8_channel", "int8_tensor", "int8_group64_zero", "int8_block", "int8_packed_group32",
           "int8_packed_channel_zero", "int8_group48", "fp8_tensor", "fp8_channel", "fp8_block", "int4_group32",
           "int4_group128", "int4_group64_zero", "int4_channel", "int4_channel_zero", "awq_group64", "awq_group32",
           "w8a8_channel", "w8a8_tensor_static", "w8a8_block", "w8a8_packed_channel"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_matches_the_native_gemm(scheme, dtype):
    # ragged: N and K off every tile and group; decode rows (registers), more rows (scratch tiles)
    for lead, n, k, bias in (((1,), 40, 200, True), ((5,), 56, 256, False), ((2, 3), 24, 96, True),
                             ((13,), 72, 328, True)):
        _check(scheme, lead, n, k, dtype, bias)


@pytest.mark.parametrize("scheme", ["int8_channel", "fp8_block", "int4_group64_zero", "awq_group64", "w8a8_block"])
def test_float16_and_no_rows(scheme):
    _check(scheme, (3,), 48, 160, "float16", True)
    _check(scheme, (0,), 48, 160, "bfloat16", True)


def test_a_wrong_code_fails():
    """The comparison can fail: one flipped code is caught."""
    rng = np.random.default_rng(1)
    weight = _weight("int4_group32", 32, 128, rng)
    x = torch.from_numpy(rng.normal(0, 1, (2, 128)).astype(np.float32))
    want = _native_gemm(x, weight)
    codes = weight.codes.clone()
    codes[3, 5] ^= 0x70000
    got = kernel.quantized_matmul(x, codes, weight.scale, quant=weight.quant, n=32, k=128)
    assert not compare(got.numpy(), want.numpy(), "float32", normwise=True).ok


@pytest.mark.parametrize("quant, dtype, match", [
    (WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"), "bfloat16", "fp8 W8A8"),
    (WeightQuant("fp8", "tensor", activations="static"), "float32", "fp8 W8A8"),
    (WeightQuant("int8", "channel"), "int32", "x of int32"),
])
def test_supports_declines_with_a_reason(quant, dtype, match):
    why = kernel.supports(quant, 64, 128, dtype)
    assert why is not None and match in why
    if dtype not in _DTYPES:
        return
    with pytest.raises(NotImplementedError, match=match):
        kernel.quantized_matmul(torch.ones(2, 128, dtype=_DTYPES[dtype]),
                                torch.zeros(64, 128, dtype=torch.int8), torch.ones(64, 1), quant=quant, n=64, k=128)
