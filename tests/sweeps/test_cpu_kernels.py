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
from dualop.ops import (ApplyRotaryEmb, GeluAndMul, GemmaRMSNorm, MulAndSilu, RMSNorm, RotaryEmbedding,  # noqa: E402
                        SiluAndMul)

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


pytestmark = pytest.mark.usefixtures("cpu_kernels")


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


# Hidden sizes around the vector kernels' steps (16, 32, 64 elements) and their masked last step;
# (300, 2050) and (130, 4100) hold more than a megabyte of rows, where the kernel prefetches the next
# row (into L1 for a 16-bit row, L2 for a wide float32 one), and use several threads when torch has them.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 1), (2, 15), (2, 16), (3, 17), (2, 31), (2, 32), (3, 33), (2, 63), (2, 64),
                                   (3, 65), (2, 95), (5, 100), (2, 4095), (300, 2050), (130, 4100)])
@pytest.mark.parametrize("variant", ["plain", "weight", "residual_in_place", "gemma_in_place", "no_weight_residual"])
def test_rms_norm_kernel_tails_and_in_place(dtype, shape, variant):
    g = torch.Generator().manual_seed(3)
    h = shape[-1]
    x = _with_specials(torch.randn(shape, generator=g).mul(3).to(dtype))
    w = (1 + 0.5 * torch.randn(h, generator=g)).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    op = GemmaRMSNorm(h) if variant.startswith("gemma") else RMSNorm(h, has_weight=variant in ("weight", "residual_in_place"))
    weight = None if variant in ("plain", "no_weight_residual") else w
    residual = r if variant not in ("plain", "weight") else None
    want = op.forward_native(x.clone(), weight, None if residual is None else residual.clone())
    if variant.endswith("in_place"):
        got = op.forward_cpu(x, weight, residual, out=x, residual_out=residual)
        assert got[0] is x and got[1] is residual
    else:
        got = op.forward_cpu(x, weight, residual)
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_kernel_non_finite_weight_and_rows(dtype):
    """A non-finite weight value, and rows of inf and NaN next to finite rows (each row picks its own
    path: with or without the NaN rule)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 130, generator=g).to(dtype)
    x[1, 7], x[2, 100], x[3, 129], x[4, :] = float("inf"), float("nan"), -float("inf"), float("nan")
    r = torch.randn(6, 130, generator=g).to(dtype)
    r[5, 3] = float("nan")
    for bad, weight_dtype in ((float("inf"), dtype), (float("nan"), dtype), (-float("inf"), torch.float32)):
        w = (1 + 0.5 * torch.randn(130, generator=g)).to(weight_dtype)
        w[5] = bad
        for op in (RMSNorm(130), GemmaRMSNorm(130)):
            _close(op.forward_cpu(x, w, r), op.forward_native(x, w, r))
            _close(op.forward_cpu(x, w), op.forward_native(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_kernel_keeps_denormals(dtype):
    """16-bit results in the subnormal range stay subnormal (no flush to zero): the residual sum
    of subnormal inputs (bit for bit torch's rounding) and outputs scaled into that range by one
    large value in the row."""
    tiny = torch.finfo(dtype).tiny
    h = 70
    x = torch.full((3, h), tiny / 8).to(dtype)
    x[:, 1::3] = -tiny / 4
    x[1:, :] = 4 * tiny
    x[1:, 0] = 2.0 ** 10  # rows whose rms makes their other values' outputs subnormal
    r = torch.full((3, h), tiny / 16).to(dtype)
    r[1] = 0
    r[2, 0] = 0
    w = torch.ones(h, dtype=dtype)
    for op, weight in ((RMSNorm(h), w), (GemmaRMSNorm(h), w - 1), (RMSNorm(h, has_weight=False), None)):
        got_y, got_sum = op.forward_cpu(x, weight, r)
        want_y, want_sum = op.forward_native(x, weight, r)
        assert torch.equal(got_sum.view(torch.int16), want_sum.view(torch.int16))
        assert (want_sum[0] != 0).all() and (want_y[1, 1:] != 0).all() and (want_y[1, 1:].abs() < tiny).all()
        assert torch.equal(got_y != 0, want_y != 0)
        _close(got_y, want_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (5, 600), (2, 3, 2048), (0, 64), (9, 8194)])
@pytest.mark.parametrize("make", [SiluAndMul, MulAndSilu, GeluAndMul, lambda: GeluAndMul(approximate="tanh")],
                         ids=["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_gated_kernel_matches_native(dtype, shape, make):
    g = torch.Generator().manual_seed(1)
    x = _with_specials(torch.randn(shape, generator=g).mul(4).to(dtype))
    op = make()
    _close(op.forward_cpu(x), op.forward_native(x))


@pytest.mark.parametrize("rows, d", [(2048, 2048), (1024, 4100)], ids=["whole_steps", "tail"])
def test_large_bfloat16_silu_matches_native(rows, d):
    """Many gates (where 16-bit gates would read the table, bfloat16 silu computes act with
    AVX-512 where the host has it), rows of whole 32-element steps and with a tail; specials and
    NaN payloads at the row starts."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 2 * d, generator=g).mul(4).to(torch.bfloat16)
    x[:8] = _with_nan_payloads(x[:8].clone())
    op = SiluAndMul()
    _close(op.forward_cpu(x), op.forward_native(x))


@pytest.mark.parametrize("rows", [1, 4096], ids=["computed_few", "computed_many"])
def test_bfloat16_silu_where_exp_overflows(rows):
    """Gates where exp(-g) nears and passes float32's overflow (g about -88.7): the native body's
    tiny and zero results, zero exactly where it is zero, NaN only for -inf."""
    edge = torch.tensor([-88.0, -88.5, -88.7, -88.75, -89.0, -100.0, -1e30, -float("inf"), 88.8, float("inf"),
                         float("nan"), -87.5, -87.0, 0.0, -0.0, 1.0] * 2)
    gate = edge.repeat(rows, 1)
    x = torch.cat([gate, torch.full_like(gate, 1.5)], dim=1).to(torch.bfloat16)
    got, want = SiluAndMul().forward_cpu(x), SiluAndMul().forward_native(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got == 0, want == 0)
    _close(got, want)


def _with_nan_payloads(x):
    """Specials, and for bfloat16 NaNs with the largest payloads (their float32 widening must still
    round back to NaN: 0x7fff and 0xffff)."""
    x = _with_specials(x)
    if x.dtype == torch.bfloat16 and x.numel() >= 6:
        x.view(-1).view(torch.int16)[4:6] = torch.tensor([0x7FFF, -1], dtype=torch.int16)
    return x


# Head and rotary sizes through the kernel's paths: rotated halves of 64 and 32 (angles kept in
# registers), others in steps of 32 pairs with a masked last one, partial rotary_dim (the rest
# copied, or left in place), GPT-J pairs; 70 tokens use several threads when torch has them.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head, rot", [(128, 128), (64, 64), (128, 64), (80, 80), (80, 48), (256, 128), (96, 32),
                                       (40, 40), (18, 18), (200, 136)])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("tokens, in_place", [(7, False), (7, True), (70, True)])
def test_rope_kernel_matches_native(dtype, head, rot, neox, tokens, in_place):
    g = torch.Generator().manual_seed(5)
    op = RotaryEmbedding(head, rot, 512, 10000.0, neox)
    positions = torch.randint(0, 512, (tokens,), generator=g, dtype=torch.int32 if tokens % 2 else torch.int64)
    q = _with_nan_payloads(torch.randn(tokens, 4 * head, generator=g).mul(3).to(dtype))
    k = _with_nan_payloads(torch.randn(tokens, 2 * head, generator=g).mul(3).to(dtype).flip(0))
    want = op.forward_native(positions, q.clone(), k.clone())
    if in_place:
        got = op.forward_cpu(positions, q, k, query_out=q, key_out=k)
        assert got[0] is q and got[1] is k
    else:
        got = op.forward_cpu(positions, q, k)
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head", [128, 80])
def test_rope_kernel_with_float32_angles_holding_specials(dtype, neox, head):
    """Given angles (float32 for a 16-bit x) with NaN and infinities: the rows holding them give
    NaN where the native formula does, the others stay exact."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3, head, generator=g).to(dtype)
    cos, sin = torch.randn(5, head // 2, generator=g), torch.randn(5, head // 2, generator=g)
    cos[1, 3], sin[2, 0], cos[3, head // 2 - 1] = float("nan"), float("inf"), -float("inf")
    cos.view(torch.int32)[4, 5] = 0x7FFFFFFF  # a NaN whose payload fills the low 16 bits
    op = ApplyRotaryEmb(is_neox_style=neox, enable_fp32_compute=True)
    _close(op.forward_cpu(x, cos, sin), op.forward_native(x, cos, sin))


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
