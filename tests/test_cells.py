"""Every (frontend, platform) cell of every registered op runs its real kernel and matches
forward_native, in float32 and bfloat16, over ragged shapes.

The harness is ``dualop.check`` (the same code ``dualop check`` runs); a cell passes only when the
fast path actually ran (a fallback to forward_native fails here) and every output is within the
tolerance table.
"""

from __future__ import annotations

import math

import pytest

from conftest import KERNEL_CELLS, require_frontend
from dualop import check, testing

CASES = list(testing.cases_for(None))  # every registered op's check cases


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("frontend, platform, method", KERNEL_CELLS, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_cell_matches_native(case, frontend, platform, method, dtype):
    require_frontend(frontend)
    result = check._run_cell(case, frontend, platform, dtype, seed=1)
    assert result.method == method, result.detail
    assert result.status == "pass", f"{result.detail} (max abs {result.max_abs}, max rel {result.max_rel})"
    assert result.shapes == len(case.shapes)


@pytest.mark.parametrize("case", list({c.op: c for c in CASES}.values()), ids=lambda c: c.op)
def test_rocm_runs_the_triton_kernel(case):
    result = check._run_cell(case, "torch", "rocm", "float32", seed=1)
    assert result.method == "forward_cuda", result.detail
    assert result.status == "pass", result.detail


def test_cells_cover_zero_one_ragged_and_3d_shapes():
    for case in CASES:
        shapes = case.shapes
        assert any(math.prod(s) == 0 for s in shapes), case.label  # nothing to do: no launch
        assert any(math.prod(s[:-1]) == 1 for s in shapes), case.label  # a single token
        assert any(len(s) == 3 for s in shapes), case.label
        if "group" not in case.label:  # fp8 group quantisation needs whole 128-lane groups
            assert any(s[-1] % 128 for s in shapes), case.label


def test_jax_cuda_falls_back_with_a_reason():
    """JAX on CUDA would need jax-triton: the cell reports a fallback, never a silent pass."""
    case = next(c for c in CASES if c.op == "silu_and_mul")
    result = check._run_cell(case, "jax", "cuda", "float32", seed=0)
    assert result.status == "fallback" and "jax-triton" in result.detail


def test_harness_catches_a_wrong_kernel(monkeypatch):
    """The cell harness must fail a kernel that is off by more than the tolerance."""
    from dualop.ops import SiluAndMul

    real = SiluAndMul.forward_cpu
    monkeypatch.setattr(SiluAndMul, "forward_cpu", lambda self, x: real(self, x) * 1.01)
    case = next(c for c in CASES if c.op == "silu_and_mul")
    result = check._run_cell(case, "torch", "cpu", "float32", seed=0)
    assert result.status == "fail" and result.max_rel > 5e-3


def test_harness_catches_a_wrong_residual(monkeypatch):
    from dualop.ops import RMSNorm

    real = RMSNorm.forward_cpu

    def off(self, x, weight=None, residual=None):
        out, res = real(self, x, weight, residual)
        return out, res + 1

    monkeypatch.setattr(RMSNorm, "forward_cpu", off)
    case = next(c for c in CASES if c.label == "rms_norm[weight,residual]")
    assert check._run_cell(case, "torch", "cpu", "bfloat16", seed=0).status == "fail"


jax = pytest.importorskip("jax", reason="jax is part of both test environments")


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_jax_ops_dispatch_under_jit_and_vmap(platform):
    """Dispatch sees tracers as jax arrays; the fast path runs inside jit and vmap."""
    import numpy as np

    from dualop import OpsConfig, dispatch_report, override_platform, set_config
    from dualop.ops import RMSNorm, SiluAndMul

    jnp = jax.numpy
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 256)), jnp.float32)
    w = jnp.linspace(0.5, 1.5, 256)
    norm, silu = RMSNorm(256), SiluAndMul()
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got_norm = jax.jit(jax.vmap(lambda t: norm(t, w)))(x)
        got_silu = jax.vmap(jax.jit(silu))(x)
    methods = {(r["op"], r["method"]) for r in dispatch_report()}
    fast = f"forward_{platform}"
    assert methods == {("rms_norm", fast), ("silu_and_mul", fast)}
    for got, want in ((got_norm, norm.forward_native(x, w)), (got_silu, silu.forward_native(x))):
        assert testing.compare(np.asarray(got), np.asarray(want), "float32").ok
