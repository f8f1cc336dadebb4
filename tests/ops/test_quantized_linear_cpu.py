"""The C++ CPU quantized GEMM (``dualop.kernels.cpu.quantized_linear``) against the reference
(``dualop.ops.linear._native_gemm``: x quantized as the scheme's W8A8 GEMM does, the weight
dequantised, float32 matmul) for every scheme it covers, in float32, bfloat16 and float16, on ragged
shapes (no rows, one, five; N and K off the tiles and the scale groups; a bias; 3-D x), with few rows
(codes decoded in registers) and more (decoded into a scratch tile); fp8 W8A8's quantisation of x bit
for bit against ``quant_fp8``'s native body; and ``supports`` declining what it does not cover."""

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
        "fp8_w8a8_block": WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"),
        "fp8_w8a8_block32": WeightQuant("fp8", "block", block=(32, 128), activations="dynamic"),
        "fp8_w8a8_block48": WeightQuant("fp8", "block", block=(16, 48), activations="dynamic"),  # portable path
        "fp8_w8a8_tensor_static": WeightQuant("fp8", "tensor", activations="static"),
        "fp8_w8a8_tensor": WeightQuant("fp8", "tensor", activations="dynamic"),
        "fp8_w8a8_channel": WeightQuant("fp8", "channel", activations="dynamic"),
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


@pytest.mark.parametrize("scheme", ["w8a8_channel", "w8a8_block", "w8a8_packed_channel", "int8_channel",
                                    "int8_group64_zero", "int4_channel_zero", "fp8_block", "fp8_w8a8_block"])
def test_a_long_k_runs_in_chunks(scheme):
    """K past the register tiles' chunks (2048 bytes of each x row: 2048 int8 codes, 1024 bfloat16
    values, 512 float32; the last chunk ragged and off the scale groups): the running sums, totals
    and zero-point terms carried between chunks, for each tile's row count; float32 x as well."""
    k = 4224 if scheme == "fp8_w8a8_block" else 4200  # fp8 W8A8 quantizes x in whole groups of 128
    for rows, dtype in ((1, "bfloat16"), (4, "bfloat16"), (8, "bfloat16"), (11, "bfloat16"), (5, "float32")):
        _check(scheme, (rows,), 40, k, dtype, bias=rows == 4)


FP8_W8A8 = ["fp8_w8a8_block", "fp8_w8a8_block32", "fp8_w8a8_block48", "fp8_w8a8_tensor_static", "fp8_w8a8_tensor",
            "fp8_w8a8_channel"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", FP8_W8A8)
def test_fp8_w8a8_matches_the_native_gemm(scheme, dtype):
    # K a multiple of the blocks' 128 (48) columns (W8A8 quantizes x in them); N off the tiles and
    # the blocks (a partial block row); no rows, decode rows (registers), more rows (scratch tiles)
    k = 144 if scheme == "fp8_w8a8_block48" else 256
    for lead, n, bias in (((0,), 40, True), ((1,), 40, True), ((5,), 200, False), ((2, 3), 24, True),
                          ((17,), 72, True)):
        _check(scheme, lead, n, k, dtype, bias)


def test_fp8_w8a8_float16():
    _check("fp8_w8a8_block", (3,), 48, 128, "float16", True)
    _check("fp8_w8a8_channel", (3,), 48, 96, "float16", True)


def _quantized_x_rows(m: int, k: int, rng) -> torch.Tensor:
    """float32 rows that probe fp8 quantisation: magnitudes far apart per 128 columns, a row whose
    scale is exactly 1 with ties of the e4m3 grid (normal and subnormal), a row of zeros."""
    x = rng.normal(0, 1, (m, k)) * np.exp2(rng.integers(-20, 12, (m, _cdiv(k, 128))).repeat(128, 1)[:, :k])
    x *= np.exp2(rng.integers(-14, 1, (m, k)))  # codes down into the subnormals
    x[0, :8] = [448, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -5 * 2.0**-10, 2.0**-11]
    x[1] = 0.0
    return torch.from_numpy(x.astype(np.float32))


@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("scheme, k", [("fp8_w8a8_block", 256), ("fp8_w8a8_block48", 96), ("fp8_w8a8_channel", 200),
                                       ("fp8_w8a8_tensor", 200), ("fp8_w8a8_tensor_static", 200)])
def test_fp8_w8a8_quantizes_x_as_quant_fp8(scheme, k, m):
    """Through an identity weight (codes 1, scales 1) y is x's codes times their scale, each
    rounded once as the reference rounds them: equal bit for bit to quantize_fp8_native's codes
    and scales, per (row, block) where the blocks scale x. Dropping x's scale, or taking another
    row's or block's, breaks it. A NaN makes its row NaN, as in the reference."""
    from dualop.ops.quantization import GroupShape, quantize_fp8_native

    rng = np.random.default_rng(2)
    quant = _weight(scheme, k, k, rng).quant
    codes = torch.eye(k).to(torch.float8_e4m3fn)
    scale = torch.ones(quant.scale_shape(k, k))
    input_scale = torch.tensor([0.03]) if quant.activations == "static" else None
    x = _quantized_x_rows(m, k, rng)
    if input_scale is not None:
        x[0, 0] = 13.44  # clipped at 448 by the static scale
    got = kernel.quantized_matmul(x, codes, scale, None, input_scale, quant=quant, n=k, k=k)
    group = (GroupShape(1, quant.block[1]) if quant.strategy == "block" else
             GroupShape.PER_TENSOR if quant.strategy == "tensor" else GroupShape.PER_TOKEN)
    x_codes, x_scale = quantize_fp8_native(x, group, input_scale)
    groups = x_scale.shape[-1] if quant.strategy == "block" else 1
    want = (x_codes.float().reshape(m, groups, -1) * x_scale.reshape(-1, groups, 1)).reshape(m, k)
    weight = QuantizedWeight(quant, codes, scale, None, input_scale, (k, k))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, _native_gemm(x, weight), rtol=0, atol=0)
    assert not torch.equal(got, x_codes.float())  # the x scale is applied
    x[2, 5] = float("nan")
    got = kernel.quantized_matmul(x, codes, scale, None, input_scale, quant=quant, n=k, k=k)
    assert got[2].isnan().all()
    torch.testing.assert_close(got, _native_gemm(x, weight), rtol=0, atol=0, equal_nan=True)


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
    (WeightQuant("fp8", "block", block=(128, 64), activations="dynamic"), "bfloat16", "do not split"),
    (WeightQuant("int8", "channel"), "int32", "x of int32"),
])
def test_supports_declines_with_a_reason(quant, dtype, match):
    k = 96 if "split" in match else 128  # 96 columns: not whole 64-column groups of x
    why = kernel.supports(quant, 64, k, dtype)
    assert why is not None and match in why
    if dtype not in _DTYPES:
        return
    with pytest.raises(NotImplementedError, match=match):
        kernel.quantized_matmul(torch.ones(2, k, dtype=_DTYPES[dtype]),
                                torch.zeros(64, k, dtype=torch.int8), torch.ones(64, 1), quant=quant, n=64, k=k)


def test_the_op_packs_a_weight_once_and_sees_it_change_in_place_or_be_copied():
    """The linear op's CPU path packs a weight's arguments once (``QuantizedWeight.derived``) and
    reuses them while the weight holds the same arrays: a change made in place is seen (the packed
    pointers are the arrays' own), a swapped array is packed again, a copy or a pickle of a used
    weight is packed anew (never the original's pointers), and a weight whose arrays are not
    row-major (packed as copies) is packed each call."""
    import copy
    import pickle

    from dualop import override_platform
    from dualop.ops import ReplicatedLinear

    rng = np.random.default_rng(21)
    n, k = 40, 96
    weight = _weight("w8a8_channel", n, k, rng)
    op = ReplicatedLinear(k, n, bias=False, return_bias=False)
    x = torch.from_numpy(rng.normal(0, 1, (3, k)).astype(np.float32)).to(torch.bfloat16)

    def agrees(w):
        got = op(x, w)
        result = compare(got.float().numpy(), _native_gemm(x, w).float().numpy(), "bfloat16", normwise=True)
        assert result.ok, result
        return got

    with override_platform("cpu"), torch.inference_mode():
        first = agrees(weight)
        prepared = weight.derived("cpu", lambda: pytest.fail("the packed call was not kept"))
        assert isinstance(prepared, kernel.PreparedWeight)
        weight.codes.copy_(weight.codes.flip(1))  # in place: same pointers, new values
        assert not torch.equal(agrees(weight), first)
        assert weight.derived("cpu", lambda: pytest.fail("an in-place change repacked")) is prepared
        weight.scale = weight.scale * 2  # a new array: packed again
        agrees(weight)
        assert weight.derived("cpu", lambda: pytest.fail("not kept")) is not prepared
        del prepared
        for clone in (copy.deepcopy(weight), pickle.loads(pickle.dumps(weight))):
            assert clone.derived("cpu", lambda: ("not packed", False)) == "not packed"
            del weight  # the original's arrays freed: a reused pointer would read freed memory
            agrees(clone)
            weight = clone
        wide = QuantizedWeight(weight.quant, torch.cat([weight.codes, weight.codes], 1)[:, :k], weight.scale,
                               shape=(n, k))
        assert not wide.codes.is_contiguous()
        agrees(wide)
        assert wide.derived("cpu", lambda: ("not kept", False)) == "not kept"
