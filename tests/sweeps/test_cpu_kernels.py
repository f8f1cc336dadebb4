"""The C++ CPU kernels (dualop/kernels/cpu): built here, used by the torch CPU paths, equal to the
native bodies within the tolerance table for every dtype, special value and layout, and replaced by
the native body (with the reason in the dispatch report) when they cannot be built."""

from __future__ import annotations

import numpy as np
import pytest
import torch


from dualop import OpsConfig, set_config, testing  # noqa: E402
from dualop.custom_op import report_row  # noqa: E402
from dualop.kernels import cpu  # noqa: E402
from dualop.ops import GeluAndMul, GemmaRMSNorm, MulAndSilu, RMSNorm, SiluAndMul  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want):
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        key, _ = testing.tolerance_for(str(w.dtype).removeprefix("torch."), w)
        cmp = testing.compare(testing.to_numpy(g), testing.to_numpy(w), key)
        assert cmp.ok, cmp


def _with_specials(x):
    flat = x.view(-1)
    if flat.numel() >= 4:
        flat[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0], dtype=x.dtype)
    return x


@pytest.fixture(scope="module", autouse=True)
def built():
    try:
        cpu.load()
    except cpu.KernelUnavailable as err:  # pragma: no cover - every CI machine has g++
        pytest.skip(f"no C++ toolchain to build the CPU kernels here: {err}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (7, 300), (2, 3, 1024), (0, 64), (33, 4097)])
@pytest.mark.parametrize("variant", ["plain", "weight", "residual", "gemma", "no_weight_residual"])
def test_rms_norm_kernel_matches_native(dtype, shape, variant):
    g = torch.Generator().manual_seed(0)
    h = shape[-1]
    x = _with_specials(torch.randn(shape, generator=g).mul(3).to(dtype))
    w = (1 + 0.5 * torch.randn(h, generator=g)).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    op = GemmaRMSNorm(h) if variant == "gemma" else RMSNorm(h, has_weight=variant not in ("plain", "no_weight_residual"))
    args = {
        "plain": (x, None, None), "weight": (x, w, None), "residual": (x, w, r),
        "gemma": (x, w, r), "no_weight_residual": (x, None, r),
    }[variant]
    _close(op.forward_cpu(*args), op.forward_native(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (5, 600), (2, 3, 2048), (0, 64), (9, 8194)])
@pytest.mark.parametrize("make", [SiluAndMul, MulAndSilu, GeluAndMul, lambda: GeluAndMul(approximate="tanh")],
                         ids=["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_gated_kernel_matches_native(dtype, shape, make):
    g = torch.Generator().manual_seed(1)
    x = _with_specials(torch.randn(shape, generator=g).mul(4).to(dtype))
    op = make()
    _close(op.forward_cpu(x), op.forward_native(x))


def test_float32_functions_near_their_edges():
    """exp/erf/tanh inside the kernels, through the ops, on a grid that crosses their branch points
    (0.875, 2.25, 4 for erf; 88 and -87 for exp) and their saturation ranges."""
    grid = torch.linspace(-100, 100, 20001)
    grid = torch.cat([grid, torch.tensor([0.875, 2.25, 4.0, 88.0, -87.0, 88.5, -87.5])])
    x = torch.cat([grid[:, None], torch.ones(grid.numel(), 1)], dim=1)  # gate | up = 1
    for op in (SiluAndMul(), GeluAndMul(), GeluAndMul(approximate="tanh")):
        _close(op.forward_cpu(x), op.forward_native(x))


def test_non_contiguous_input_and_dispatch_takes_the_kernel():
    x = torch.randn(64, 512).t()  # a transposed view
    op = RMSNorm(64)
    with set_config(OpsConfig(["all"])):
        got = op(x)
    _close(got, op.forward_native(x))
    assert report_row(RMSNorm, "torch", "cpu")["method"] == "forward_cpu"


def test_autograd_recording_uses_the_differentiable_body():
    x = torch.randn(4, 32, requires_grad=True)
    op = SiluAndMul()
    with set_config(OpsConfig(["all"])):
        out = op(x)
        method, reason = op.last_run("torch")
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert method == "forward_native" and "autograd is recording and the C++ CPU kernel has no backward" in reason


def test_unavailable_toolchain_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(cpu, "_library", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    op = RMSNorm(16)
    x = torch.randn(3, 16)
    with set_config(OpsConfig(["all"])):
        got = op(x)
    np.testing.assert_array_equal(got.numpy(), op.forward_native(x).numpy())
    row = report_row(RMSNorm, "torch", "cpu")
    assert row["method"] == "forward_native" and "no C++ compiler" in row["reason"]


def test_library_path_depends_on_sources_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALOP_CACHE_DIR", str(tmp_path))
    compiler = cpu._compiler()
    path = cpu.library_path(compiler)
    assert path.parent == tmp_path / "cpu_kernels" and path.suffix == ".so"
    assert path == cpu.library_path(compiler)
