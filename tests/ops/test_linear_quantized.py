"""The linear ops on quantized weights (``dualop.ops.quantized_weight``): each scheme's native body
against float64 numpy written from the format's definition (codes unpacked bit by bit, zero points
subtracted, scales broadcast, and for W8A8 schemes ``x`` quantized as the engine does), in both
frontends; torch's int8 GEMM (``torch._weight_int8pack_mm``, the CPU fallback) against the native
body; a scheme no CPU kernel takes declining to the native body with its reason; tensor-parallel
cuts of every array; bad weights and impossible schemes refused before any GEMM. (The kernels
against the native body: tests/ops/test_quantized_*.py and the cell sweep.)"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from dualop import OpsConfig, dispatch_report, set_config
from dualop.custom_op import clear_dispatch_report
from dualop.kernels import quant_math
from dualop.ops import QuantizedWeight, ReplicatedLinear, RowParallelLinear, WeightQuant

N, K, ROWS = 48, 256, 5
FP8_MAX = 448.0


def _cdiv(a, b):
    return -(-a // b)


def _fp8(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.float8_e4m3fn)


def _scheme(name: str, rng: np.random.Generator):
    """(WeightQuant, {array name: numpy array}, float64 [N, K] weight by the definition)."""
    if name == "int8_channel":
        q = rng.integers(-128, 128, (N, K)).astype(np.int8)
        s = rng.uniform(0.001, 0.01, (N, 1)).astype(np.float32)
        return WeightQuant("int8", "channel"), {"codes": q, "scale": s}, q * s.astype(np.float64)
    if name == "int8_tensor_w8a8":
        q = rng.integers(-128, 128, (N, K)).astype(np.int8)
        s = np.asarray([0.004], np.float32)
        return WeightQuant("int8", "tensor", activations="dynamic"), {"codes": q, "scale": s}, q * np.float64(s[0])
    if name in ("fp8_block_w8a8", "fp8_block"):
        w = rng.normal(0, 2, (N, K)).astype(np.float32)
        q = _fp8(np.clip(w, -FP8_MAX, FP8_MAX))
        s = rng.uniform(0.001, 0.01, (_cdiv(N, 32), _cdiv(K, 128))).astype(np.float32)
        full = np.repeat(np.repeat(s.astype(np.float64), 32, 0)[:N], 128, 1)[:, :K]
        acts = "dynamic" if name.endswith("w8a8") else "none"
        return (WeightQuant("fp8", "block", block=(32, 128), activations=acts), {"codes": q, "scale": s},
                q.astype(np.float64) * full)
    if name == "fp8_tensor_static":
        q = _fp8(rng.normal(0, 2, (N, K)))
        s = np.asarray([0.003], np.float32)
        return (WeightQuant("fp8", "tensor", activations="static"),
                {"codes": q, "scale": s, "input_scale": np.asarray([0.02], np.float32)}, q.astype(np.float64) * s[0])
    if name in ("int4_packed", "int4_packed_zero"):
        group, zero = 64, name.endswith("zero")
        u = rng.integers(0, 16, (N, K))
        s = rng.uniform(0.001, 0.01, (N, K // group)).astype(np.float32)
        arrays = {"codes": quant_math.pack_int32(u, 4, 1), "scale": s}
        w = (u - 8).astype(np.float64)
        if zero:
            z = rng.integers(0, 16, (N, K // group))
            arrays["zero_point"] = quant_math.pack_int32(z, 4, 0)
            w = w - np.repeat(z - 8, group, 1)
        return (WeightQuant("int4", "group", group_size=group, symmetric=not zero, layout="packed"), arrays,
                w * np.repeat(s.astype(np.float64), group, 1))
    if name == "awq":
        group = 64
        u = rng.integers(0, 16, (K, N))
        z = rng.integers(0, 16, (K // group, N))
        s = rng.uniform(0.001, 0.01, (K // group, N)).astype(np.float16)
        order = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ's nibble of code j
        arrays = {"codes": quant_math.pack_int32(u, 4, 1, order), "zero_point": quant_math.pack_int32(z, 4, 1, order), "scale": s}
        w = (u - np.repeat(z, group, 0)) * np.repeat(s.astype(np.float64), group, 0)
        return WeightQuant("int4", "group", group_size=group, symmetric=False, layout="awq"), arrays, w.T
    raise AssertionError(name)


def _x_as_quantized(x: np.ndarray, quant: WeightQuant, arrays) -> np.ndarray:
    """x as the W8A8 GEMM sees it, float64, by the engine's rules (module docstring of
    dualop.ops.quantized_weight)."""
    x32 = x.astype(np.float32)
    if quant.activations == "none":
        return x32.astype(np.float64)
    if quant.codes == "int8":
        scale = np.abs(x32).max(-1, keepdims=True) / np.float32(127)
        return np.clip(np.round(x32 / scale), -128, 127).astype(np.float64) * scale
    if quant.strategy == "block":
        g = x32.reshape(*x.shape[:-1], -1, quant.block[1])
        scale = np.maximum(np.abs(g).max(-1, keepdims=True) / np.float32(FP8_MAX), np.float32(1 / (FP8_MAX * 512)))
        codes = _fp8(np.clip(g * (np.float32(1) / scale), -FP8_MAX, FP8_MAX)).astype(np.float64)
        return (codes * scale).reshape(x.shape)
    scale = np.float32(arrays["input_scale"][0])
    return _fp8(np.clip(x32 * (np.float32(1) / scale), -FP8_MAX, FP8_MAX)).astype(np.float64) * scale


def _weight(quant, arrays, frontend):
    def arr(a):
        if frontend == "jax":
            return jnp.asarray(a)
        if a.dtype == ml_dtypes.float8_e4m3fn:
            return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.ascontiguousarray(a))

    return QuantizedWeight(quant, **{name: arr(a) for name, a in arrays.items()}, shape=(N, K))


SCHEMES = ["int8_channel", "int8_tensor_w8a8", "fp8_block_w8a8", "fp8_block", "fp8_tensor_static", "int4_packed",
           "int4_packed_zero", "awq"]


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_native_body_is_the_formats_definition(scheme, frontend):
    rng = np.random.default_rng(SCHEMES.index(scheme))
    quant, arrays, w64 = _scheme(scheme, rng)
    x = rng.normal(0, 1, (ROWS, K)).astype(np.float32)
    want = _x_as_quantized(x, quant, arrays) @ w64.T
    op = ReplicatedLinear(K, N, bias=False, return_bias=False)
    xa = jnp.asarray(x) if frontend == "jax" else torch.from_numpy(x)
    got = np.asarray(op.forward_native(xa, _weight(quant, arrays, frontend)), np.float64)
    # float32 products summed in float32 against float64: K terms of about |want| each
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_shard_of_features_is_the_same_cut_of_the_weight(scheme):
    """``features`` cuts every array where the features it keeps are stored (a tensor-parallel
    shard): dequantised, the cut equals the float64 weight's rows or columns."""
    rng = np.random.default_rng(20 + SCHEMES.index(scheme))
    quant, arrays, w64 = _scheme(scheme, rng)
    weight = _weight(quant, arrays, "torch")
    for which, total in (("out", N), ("in", K)):
        unit = quant.shard_alignment(which)
        cut = (unit, 3 * unit) if 3 * unit <= total else (0, unit)
        part = weight.features(which, *cut)
        want = w64[cut[0]:cut[1]] if which == "out" else w64[:, cut[0]:cut[1]]
        np.testing.assert_allclose(part.dequantize().double().numpy(), want, rtol=1e-6, atol=1e-9)
        if unit > 1:
            with pytest.raises(ValueError, match="do not fall on whole scale blocks, groups and packed words"):
                weight.features(which, cut[0] + 1, cut[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_weights_fall_back_to_torchs_int8_gemm_without_the_cpu_kernels(dtype, monkeypatch):
    """Where the C++ quantized GEMM is unavailable (no compiler; simulated), int8 weight-only per
    channel still runs forward_cpu, on torch._weight_int8pack_mm, matching the native body within
    the dtype's tolerance, with the bias."""
    from dualop.kernels.registry import KernelRef
    from dualop.ops import linear

    kernel, _ = linear._QUANTIZED["cpu"]
    unavailable = KernelRef("dualop.kernels.cpu.no_such_module", "supports")
    monkeypatch.setitem(linear._QUANTIZED, "cpu", (kernel, unavailable))
    rng = np.random.default_rng(7)
    quant, arrays, _ = _scheme("int8_channel", rng)
    x = torch.from_numpy(rng.normal(0, 1, (2, 3, K)).astype(np.float32)).to(getattr(torch, dtype))
    bias = torch.from_numpy(rng.normal(0, 1, N).astype(np.float32)).to(x.dtype)
    weight = _weight(quant, arrays, "torch")
    op = ReplicatedLinear(K, N, bias=True, return_bias=False)
    clear_dispatch_report()
    with set_config(OpsConfig(["all"])):
        got = op(x, weight, bias)
    row = dispatch_report()[0]
    assert row["method"] == "forward_cpu", row
    want = op.forward_native(x, weight, bias)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


def test_without_the_cpu_kernels_other_schemes_run_the_native_body_and_say_why(monkeypatch):
    """The C++ quantized GEMM unavailable (simulated): an fp8 weight declines to the native body,
    and the dispatch report says why."""
    from dualop.kernels.registry import KernelRef
    from dualop.ops import linear

    kernel, _ = linear._QUANTIZED["cpu"]
    monkeypatch.setitem(linear._QUANTIZED, "cpu", (kernel, KernelRef("dualop.kernels.cpu.no_such_module", "supports")))
    rng = np.random.default_rng(8)
    quant, arrays, _ = _scheme("fp8_block_w8a8", rng)
    op = ReplicatedLinear(K, N, bias=False, return_bias=False)
    clear_dispatch_report()
    with set_config(OpsConfig(["all"])):
        op(torch.ones(2, K), _weight(quant, arrays, "torch"))
    row = dispatch_report()[0]
    assert row["method"] == "forward_native" and "no_such_module" in row["reason"], row


def test_row_parallel_takes_a_quantized_shard():
    """One rank's shard of a row-parallel layer (tp size 1 here): the same checks and body."""
    rng = np.random.default_rng(9)
    quant, arrays, w64 = _scheme("int4_packed", rng)
    x = rng.normal(0, 1, (ROWS, K)).astype(np.float32)
    op = RowParallelLinear(K, N, bias=False, return_bias=False)
    got = op(torch.from_numpy(x), _weight(quant, arrays, "torch"))
    np.testing.assert_allclose(got.numpy(), x.astype(np.float64) @ w64.T, rtol=1e-5, atol=1e-4)


def _bad(scheme, **change):
    rng = np.random.default_rng(10)
    quant, arrays, _ = _scheme(scheme, rng)
    arrays.update(change)
    return _weight(quant, {k: v for k, v in arrays.items() if v is not None}, "torch")


@pytest.mark.parametrize("weight, error, match", [
    (lambda: _bad("int8_channel", scale=np.ones((N, 2), np.float32)), ValueError,
     r"argument 'weight.scale' has shape \(48, 2\); expected \(48, 1\)"),
    (lambda: _bad("int8_channel", codes=np.zeros((N, K), np.int32)), TypeError,
     r"argument 'weight.codes' has dtype int32; expected one of int8"),
    (lambda: _bad("int4_packed", codes=np.zeros((N, K // 8 - 1), np.int32)), ValueError,
     r"argument 'weight.codes' has shape \(48, 31\); expected \(48, 32\)"),
    (lambda: _bad("int4_packed_zero", zero_point=None), ValueError,
     r"argument 'weight.zero_point' is required \(int4 groups of 64 with zero points"),
    (lambda: _bad("int4_packed", zero_point=np.zeros((6, 4), np.int32)), ValueError,
     r"argument 'weight.zero_point' must be None for a symmetric scheme"),
    (lambda: _bad("fp8_tensor_static", input_scale=None), ValueError,
     r"argument 'weight.input_scale' is required for static activation scales"),
    (lambda: _bad("fp8_tensor_static", input_scale=np.ones(2, np.float32)), ValueError,
     r"argument 'weight.input_scale' must hold one element"),
])
def test_bad_quantized_weights_are_refused_before_any_gemm(weight, error, match):
    op = ReplicatedLinear(K, N, bias=False, return_bias=False)
    with pytest.raises(error, match=r"replicated_linear: " + match):
        op(torch.ones(2, K), weight())


def test_a_weight_that_passed_is_checked_again_once_it_changes():
    """The check remembers the arrays a weight last passed with; an array swapped for a bad one, or
    the same weight at another width, is refused all the same."""
    rng = np.random.default_rng(12)
    quant, arrays, _ = _scheme("int8_channel", rng)
    weight = _weight(quant, arrays, "torch")
    op = ReplicatedLinear(K, N, bias=False, return_bias=False)
    op(torch.ones(2, K), weight)
    op(torch.ones(2, K), weight)  # passes again from the memo
    with pytest.raises(ValueError, match=r"replicated_linear: argument 'weight' is a quantized weight of shape"):
        ReplicatedLinear(K, 2 * N, bias=False, return_bias=False)(torch.ones(2, K), weight)
    weight.scale = torch.ones(N, 2)
    with pytest.raises(ValueError, match=r"argument 'weight.scale' has shape \(48, 2\); expected \(48, 1\)"):
        op(torch.ones(2, K), weight)


def test_w8a8_block_needs_whole_activation_groups():
    quant = WeightQuant("fp8", "block", block=(32, 128), activations="dynamic")
    op = ReplicatedLinear(200, N, bias=False, return_bias=False)
    weight = QuantizedWeight(quant, torch.zeros(N, 200).to(torch.float8_e4m3fn), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"200 input features do not split into the activation groups of 128"):
        op(torch.ones(2, 200), weight)


def test_a_weight_of_mixed_frontends_is_refused():
    rng = np.random.default_rng(11)
    quant, arrays, _ = _scheme("int8_channel", rng)
    weight = QuantizedWeight(quant, torch.from_numpy(arrays["codes"]), jnp.asarray(arrays["scale"]))
    with pytest.raises(TypeError, match=r"argument 'weight.scale' is a jax array but 'x' is a torch array"):
        ReplicatedLinear(K, N, bias=False, return_bias=False)(torch.ones(2, K), weight)


@pytest.mark.parametrize("kwargs, match", [
    (dict(codes="int3", strategy="group", group_size=8), r"codes must be one of fp8, int8, int4, got 'int3'"),
    (dict(codes="int8", strategy="group"), r"strategy 'group' needs a positive int group_size"),
    (dict(codes="fp8", strategy="block", block=(128, 0)), r"strategy 'block' needs block = \(block_n, block_k\) of positive ints"),
    (dict(codes="int4", strategy="group", group_size=32), r"int4 codes are packed"),
    (dict(codes="int4", strategy="group", group_size=32, layout="packed", activations="dynamic"),
     r"quantized activations \(W8A8\) go with symmetric 8-bit"),
    (dict(codes="int8", strategy="block", block=(32, 32), symmetric=False), r"block scales take no zero points"),
    (dict(codes="int8", strategy="tensor", symmetric=False, layout="packed"),
     r"packed zero points go with group or channel scales"),
])
def test_a_scheme_that_cannot_exist_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=r"WeightQuant: " + match):
        WeightQuant(**kwargs)
