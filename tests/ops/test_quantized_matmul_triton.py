"""The Triton quantized GEMM (``kernels/cuda/quantized_matmul.py``) against the linear ops'
reference (``ops/linear.py`` ``_native_gemm``), in Triton's CPU interpreter: every scheme it takes
(fp8 block / channel / tensor W8A8, dynamic and static; fp8 and int8 weight-only; int8 W8A8; int4
and int8 codes packed along K, with and without zero points; AWQ) in float32 and bfloat16, with
N, K and the scale groups off the tile sizes (partial blocks and groups, padded words), zero, one
and five rows, 3-D x and a bias; prefill-sized tiles; the fp8 ``tl.dot`` path (the interpreter
multiplies fp8 operands exactly); ROCm's fnuz activations; NaN and inf rows of W8A8 activations;
what ``supports`` declines; and the launches compiled for sm_90, sm_80 and gfx942 from meta tensors.
GEMMs sum products: compared normwise (``compare(normwise=True)``, as the op's cells)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dualop.kernels.cuda import quantized_matmul as qmm
from dualop.ops.linear import _native_gemm
from dualop.ops.quantized_weight import QuantizedWeight, WeightQuant
from dualop.platforms import override_platform
from dualop.testing import compare

N = 40  # off the 64/128-column tiles and the 32-row scale blocks; a multiple of 8 (AWQ)
K = 150  # off every K tile and group; packed words padded
K_W8A8_BLOCK = 160  # W8A8 blocks quantize x in whole groups of block[1] columns

SCHEMES = {
    "fp8_block_w8a8": WeightQuant("fp8", "block", block=(32, 32), activations="dynamic"),
    "fp8_channel_dynamic": WeightQuant("fp8", "channel", activations="dynamic"),
    "fp8_tensor_dynamic": WeightQuant("fp8", "tensor", activations="dynamic"),
    "fp8_channel_static": WeightQuant("fp8", "channel", activations="static"),
    "fp8_tensor_static": WeightQuant("fp8", "tensor", activations="static"),
    "fp8_tensor": WeightQuant("fp8", "tensor"),
    "fp8_channel": WeightQuant("fp8", "channel"),
    "fp8_block": WeightQuant("fp8", "block", block=(32, 64)),
    "int8_channel_w8a8": WeightQuant("int8", "channel", activations="dynamic"),
    "int8_tensor_static": WeightQuant("int8", "tensor", activations="static"),
    "int8_block_w8a8": WeightQuant("int8", "block", block=(16, 32), activations="dynamic"),
    "int8_channel": WeightQuant("int8", "channel"),
    "int8_group_zero": WeightQuant("int8", "group", group_size=32, symmetric=False),
    "int4_group": WeightQuant("int4", "group", group_size=32, layout="packed"),
    "int4_group_zero": WeightQuant("int4", "group", group_size=64, symmetric=False, layout="packed"),
    "int4_channel_zero": WeightQuant("int4", "channel", symmetric=False, layout="packed"),
    "int8_packed_group": WeightQuant("int8", "group", group_size=32, layout="packed"),
    "awq": WeightQuant("int4", "group", group_size=32, symmetric=False, layout="awq"),
}


def _pack(unsigned: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned codes packed into int32 words along ``axis``: code j of a word in slot ``order[j]``."""
    per = 32 // bits
    order = order or range(per)
    c = np.moveaxis(unsigned.astype(np.int64), axis, -1)
    c = np.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, (-c.shape[-1]) % per)]).reshape(*c.shape[:-1], -1, per)
    words = sum(c[..., j] << (bits * slot) for j, slot in enumerate(order))
    return np.moveaxis(((words + 2**31) % 2**32 - 2**31).astype(np.int32), -1, axis)


def _weight(quant: WeightQuant, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
    """Random codes, scales and zero points of ``quant``'s layout for an ``[n, k]`` weight."""
    arrays = {}
    if quant.layout == "awq":
        arrays["codes"] = _pack(rng.integers(0, 16, (k, n)), 4, 1, (0, 4, 1, 5, 2, 6, 3, 7))
    elif quant.layout == "packed":
        arrays["codes"] = _pack(rng.integers(0, 2**quant.bits, (n, k)), quant.bits, 1)
    elif quant.codes == "fp8":  # normals, subnormals and the extremes of e4m3fn
        w = rng.normal(0, 60, (n, k)).astype(np.float32)
        w.flat[:4] = [448.0, -448.0, 2.0**-9, -3 * 2.0**-9]
        arrays["codes"] = torch.from_numpy(np.clip(w, -448, 448)).to(torch.float8_e4m3fn)
    else:
        arrays["codes"] = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scale_shape = quant.scale_shape(n, k)
    arrays["scale"] = rng.uniform(0.5, 1.5, scale_shape).astype(np.float32) * 0.01
    if quant.layout == "awq":
        arrays["scale"] = arrays["scale"].astype(np.float16)  # AWQ checkpoints store float16 scales
    if not quant.symmetric:
        if quant.layout == "awq":
            arrays["zero_point"] = _pack(rng.integers(0, 16, scale_shape), 4, 1, (0, 4, 1, 5, 2, 6, 3, 7))
        elif quant.layout == "packed":
            arrays["zero_point"] = _pack(rng.integers(0, 2**quant.bits, scale_shape), quant.bits, 0)
        else:
            arrays["zero_point"] = rng.integers(-20, 20, scale_shape).astype(np.int8)
    if quant.activations == "static":
        arrays["input_scale"] = np.asarray([0.01], np.float32)  # |x| above 4.48 (int8: 1.27) saturates
    tensors = {name: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
               for name, a in arrays.items()}
    return QuantizedWeight(quant, **tensors, shape=(n, k))


def _run(x, weight: QuantizedWeight, bias=None, **platform_kw):
    return qmm.quantized_matmul(x, weight.codes, weight.scale, weight.zero_point, weight.input_scale, bias,
                                quant=weight.quant, n=weight.shape[0], k=weight.shape[1], **platform_kw)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    name = str(want.dtype).removeprefix("torch.")
    result = compare(got.float().numpy(), want.float().numpy(), name, normwise=True)
    assert result.ok, result


def _problem(scheme: str, lead: tuple[int, ...], dtype: torch.dtype, seed: int, *, n: int = N, k: int | None = None,
             bias: bool = True):
    quant = SCHEMES[scheme] if isinstance(scheme, str) else scheme
    k = k or (K_W8A8_BLOCK if quant.strategy == "block" and quant.activations != "none" else K)
    rng = np.random.default_rng(seed)
    weight = _weight(quant, n, k, rng)
    x = torch.from_numpy(rng.normal(0, 1, (*lead, k)).astype(np.float32))
    if x.ndim >= 2 and x.shape[-2] >= 3:  # rows of different magnitudes (one all zero): scales differ per row
        x = x * torch.logspace(-1, 1, x.shape[-2]).unsqueeze(-1)
        x[..., 1, :] = 0.0
    b = torch.from_numpy(rng.normal(0, 1, n).astype(np.float32)).to(dtype) if bias else None
    return x.to(dtype), weight, b


@pytest.mark.each_env  # the interpreters differ (triton 3.5 and 3.9): fp8, int8 and 16-bit tl.dot
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_kernel_matches_native(scheme, dtype):
    """3-D x (6 rows, one all zero), a bias, N and K off the tiles."""
    x, weight, bias = _problem(scheme, (2, 3), dtype, seed=list(SCHEMES).index(scheme))
    assert qmm.supports(weight.quant, N, weight.shape[1], str(dtype).removeprefix("torch.")) is None
    _check(_run(x, weight, bias), _native_gemm(x, weight, bias))


@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("scheme", ["fp8_block_w8a8", "int8_channel_w8a8", "awq", "int4_group_zero"])
def test_row_counts(scheme, rows):
    x, weight, _ = _problem(scheme, (rows,), torch.float32, seed=rows, bias=False)
    got = _run(x, weight)
    assert got.shape == (rows, N)
    _check(got, _native_gemm(x, weight))


@pytest.mark.parametrize("scheme", [
    WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"),  # the engine's w8a8_block_fp8
    WeightQuant("int4", "group", group_size=128, layout="packed"),
    WeightQuant("int8", "channel", activations="dynamic"),
], ids=["fp8_block_128", "int4_group_128", "int8_channel_w8a8"])
def test_prefill_tiles(scheme):
    """130 rows x 200 columns: the prefill tiles (W8A8 128 x 128, weight-only 64 x 128), two or
    three row tiles by two column tiles, in the grouped program order."""
    x, weight, bias = _problem(scheme, (130,), torch.bfloat16, seed=3, n=200, k=256)
    assert qmm.block_sizes(130, 1, 128, w8a8=True).m == 128 and qmm.block_sizes(130, 2, 128, w8a8=False).m == 64
    _check(_run(x, weight, bias), _native_gemm(x, weight, bias))


def test_fp8_dot_operands_give_the_decoded_products():
    """``tl.dot`` on fp8 operands (sm_89+), run by the interpreter: the same products as the
    bfloat16 path (both exact), so the same sums."""
    x, weight, bias = _problem("fp8_block_w8a8", (7,), torch.bfloat16, seed=4)
    got = _run(x, weight, bias, fp8_dot=True)
    _check(got, _native_gemm(x, weight, bias))
    assert torch.equal(got, _run(x, weight, bias, fp8_dot=False))


@pytest.mark.parametrize("scheme", ["fp8_block_w8a8", "fp8_channel_dynamic", "fp8_tensor_static"])
def test_fnuz_activations_on_rocm(scheme):
    """MI300's format (the op passes ``fp8_format``: float8_e4m3fnuz, max 224) against the native
    body on the rocm platform; the weights stay e4m3fn."""
    x, weight, bias = _problem(scheme, (5,), torch.float32, seed=5)
    with override_platform("rocm"):
        want = _native_gemm(x, weight, bias)
    got = _run(x, weight, bias, fp8_dtype="float8_e4m3fnuz", fp8_max=224.0)
    _check(got, want)
    if weight.quant.activations == "static":  # dynamic fnuz codes are e4m3fn's halved, at twice the scale
        assert not torch.equal(got, _run(x, weight, bias))  # static: fnuz saturates at 224, e4m3fn at 448


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf / inf, inf * 0
@pytest.mark.parametrize("scheme", ["int8_channel_w8a8", "int8_tensor_static", "fp8_block_w8a8",
                                    "fp8_channel_dynamic", "fp8_tensor_static"])
def test_nonfinite_activations(scheme):
    """A NaN in a row, an inf in another: the W8A8 rows come out as the native body's (NaN rows,
    or a saturated code)."""
    x, weight, _ = _problem(scheme, (4,), torch.float32, seed=6, bias=False)
    x[0, 3] = float("nan")
    x[2, 7] = float("inf")
    want = _native_gemm(x, weight)
    assert torch.isnan(want[0]).all()
    _check(_run(x, weight), want)


def test_supports_declines_with_reasons():
    assert qmm.supports(SCHEMES["awq"], 64, 256, "bfloat16") is None
    assert "float64" in qmm.supports(SCHEMES["awq"], 64, 256, "float64")
    assert "multiple of 16" in qmm.supports(WeightQuant("int4", "group", group_size=8, layout="packed"), 64, 256,
                                            "bfloat16")
    assert "multiple of 16" in qmm.supports(WeightQuant("fp8", "block", block=(128, 40)), 64, 240, "float32")
    assert "activation groups of 128" in qmm.supports(
        WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"), 64, 320, "bfloat16")


# Compiled mode needs its own process (the interpreter is chosen when kernels are defined).
_COMPILE_PROBE = """
import json, sys
import torch
from dualop.aot import gpu
from dualop.kernels import cuda
from dualop.kernels.cuda import quantized_matmul as qmm
from dualop.ops.quantized_weight import WeightQuant

def meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")

def arrays(quant, n, k):
    codes_dtype = {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}.get(quant.codes_dtype(), torch.int32)
    zero = quant.zero_point_shape(n, k)
    return (meta(quant.codes_shape(n, k), codes_dtype), meta(quant.scale_shape(n, k), torch.float32),
            None if zero is None else meta(zero, torch.int32))

rows, n, k = 16, 256, 512
out = {}
for target, quant, kw in (
        ("sm90", WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"), {}),
        ("sm80", WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"), {}),
        ("gfx942", WeightQuant("int4", "group", group_size=128, symmetric=False, layout="awq"), {})):
    codes, scale, zero = arrays(quant, n, k)
    with cuda.compile_target(cuda.GPU_TARGETS[target]), gpu.capture_launches() as launches:
        y = qmm.quantized_matmul(meta((rows, k), torch.bfloat16), codes, scale, zero, None, meta((n,), torch.bfloat16),
                                 quant=quant, n=n, k=k, **kw)
    assert y.device.type == "meta" and tuple(y.shape) == (rows, n)
    results = []
    for launch in launches:
        details, error = gpu.compile_launch(launch, cuda.GPU_TARGETS[target])
        results.append({"kernel": launch.fn.__name__, "error": error, "fp8_dot": launch.kwargs.get("FP8_DOT"),
                        "shared": details.get("shared_bytes"), "registers": details.get("registers")})
    out[target] = results
print(json.dumps(out, default=str))
"""


@pytest.mark.latest_only
def test_launches_on_meta_tensors_compile_for_sm90_sm80_gfx942(tmp_path):
    """Inside ``compile_target`` the wrapper takes meta tensors (``dualop compile``; nothing reads
    a value) and Triton compiles each launch: fp8 block W8A8 with fp8 ``tl.dot`` on sm_90 and its
    bfloat16 fallback on sm_80 (no fp8 there), AWQ's unpacking on gfx942."""
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"dualop compile's launch specialisation follows triton 3.9 (installed: {triton.__version__}; "
                    "the latest environment has 3.9)")
    from dualop.aot.gpu import child_environment

    script = tmp_path / "qmm_probe.py"
    script.write_text(_COMPILE_PROBE)
    env = child_environment(str(tmp_path / "triton-cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in out["sm90"]] == ["_quant_kernel", "_gemm_kernel"]
    assert out["sm90"][1]["fp8_dot"] is True and out["sm80"][1]["fp8_dot"] is False
    assert [r["kernel"] for r in out["gfx942"]] == ["_gemm_kernel"]
    for target, results in out.items():
        for r in results:
            assert r["error"] is None, (target, r)
