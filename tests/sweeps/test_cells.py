"""Every (frontend, platform) cell of every registered op runs its real kernel and matches
forward_native, in float32 and bfloat16, over ragged shapes; every cell with no kernel says so,
with its reason.

The harness is ``dualop.check`` (the same code ``dualop check`` runs); a kernel cell passes only
when a kernel actually ran (forward_native running fails here) and every output is within the
tolerance table. A native cell must report the reason conftest's NATIVE_CELLS / NATIVE_CASES give.
"""

from __future__ import annotations

import math

import pytest

from conftest import (KERNEL_CELLS, KERNEL_CASES_IN_NATIVE_CELLS, NATIVE_CASES, NATIVE_CELLS, NATIVE_DTYPE_CASES,
                      require_frontend)
from dualop import check, testing

CASES = list(testing.cases_for(None))  # every registered op's check cases
KERNEL_SWEEP = [
    pytest.param(case, frontend, platform, method, id=f"{case.label}-{frontend}-{platform}")
    for case in CASES
    for frontend, platform, method in [*KERNEL_CELLS, *((f, p, m) for (label, f, p), m in KERNEL_CASES_IN_NATIVE_CELLS.items()
                                                        if label == case.label)]
    if (case.label, frontend, platform) not in NATIVE_CASES
]
NATIVE_SWEEP = [
    pytest.param(case, frontend, platform, NATIVE_CASES.get((case.label, frontend, platform)) or NATIVE_CELLS[(frontend, platform)],
                 id=f"{case.label}-{frontend}-{platform}")
    for case in CASES for frontend, platform in [*NATIVE_CELLS, *((f, p) for f, p, _ in KERNEL_CELLS)]
    if ((frontend, platform) in NATIVE_CELLS and (case.label, frontend, platform) not in KERNEL_CASES_IN_NATIVE_CELLS)
    or (case.label, frontend, platform) in NATIVE_CASES
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case, frontend, platform, method", KERNEL_SWEEP)
def test_cell_matches_native(case, frontend, platform, method, dtype):
    require_frontend(frontend)
    result = check._run_cell(case, frontend, platform, dtype, seed=1)
    declined = NATIVE_DTYPE_CASES.get((case.label, frontend, platform, dtype))
    if declined is not None:  # the native body is this dtype's faster path: it must say so
        assert (result.status, result.method) == ("native", "forward_native"), result.detail
        assert declined in result.detail
        return
    assert result.method == method, result.detail
    assert result.status == "pass", f"{result.detail} (max abs {result.max_abs}, max rel {result.max_rel})"
    assert result.shapes == len(case.shapes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case, frontend, platform, reason", NATIVE_SWEEP)
def test_native_cell_reports_its_reason(case, frontend, platform, reason, dtype):
    """No kernel here: the cell says native, with the reason, never a silent pass."""
    require_frontend(frontend)
    result = check._run_cell(case, frontend, platform, dtype, seed=1)
    assert (result.status, result.method) == ("native", "forward_native"), result.detail
    assert reason in result.detail


def test_native_expectations_name_real_cases():
    labels = {c.label for c in CASES}
    assert {label for label, _, _ in NATIVE_CASES} <= labels
    assert {label for label, _, _, _ in NATIVE_DTYPE_CASES} <= labels


@pytest.mark.parametrize("case", list({c.op: c for c in CASES}.values()), ids=lambda c: c.op)
def test_rocm_runs_the_triton_kernel(case):
    result = check._run_cell(case, "torch", "rocm", "float32", seed=1)
    reason = NATIVE_CASES.get((case.label, "torch", "cuda"))
    if reason is not None:  # no CUDA kernel for this case: ROCm reports the same reason
        assert (result.status, result.method) == ("native", "forward_native") and reason in result.detail, result.detail
        return
    assert result.method == "forward_cuda", result.detail
    assert result.status == "pass", result.detail


# Case shapes that are not an input's rows, by trait (declared with each op, dualop.testing.TRAITS):
# "spatial", a convolution's x [N, C, *spatial] (tests/ops/test_conv.py checks that they hold no items,
# one item, and spatial sizes off the kernel's multiple); "token_table", (tokens, vocab, org_vocab,
# dim): zero and one token; "packed_sequences", (tokens, sequences, widths...) of a packed serving
# batch: every sequence has a token (no zero-token batch), so they cover a single token, a decode step
# (T == B) and a multi-sequence prefill instead, at a width off the 128-lane multiple; "image_grid",
# an image's tokens x [B, H, W, dim]: over an op's cases, no image, a one-token image and a 3-D
# batch of images (below).
NOT_ROW_SHAPES = frozenset({"spatial", "image_grid", "token_table", "packed_sequences"})


def test_image_grid_ops_cover_no_image_one_token_and_a_batch():
    ops = {c.op for c in CASES if "image_grid" in c.traits}
    for op in ops:
        shapes = [s for c in CASES if c.op == op for s in c.shapes]
        assert any(s[0] == 0 for s in shapes), op
        assert any(math.prod(s[:-1]) == 1 for s in shapes), op
        assert any(s[0] > 1 and s[1] != s[2] for s in shapes), op


def test_token_table_cases_cover_zero_and_one_token():
    for case in (c for c in CASES if "token_table" in c.traits):
        assert {0, 1} <= {s[0] for s in case.shapes}, case.label


def test_packed_sequence_cases_cover_one_token_decode_and_prefill():
    """Per op; a variant case (a mixer's other norms and biases: its own math, not the kernels')
    may run the packed prefill alone."""
    for op in sorted({c.op for c in CASES if "packed_sequences" in c.traits}):
        cases = [c for c in CASES if c.op == op]
        batches = {(s[0], s[1]) for c in cases for s in c.shapes}
        assert (1, 1) in batches, op
        assert any(t == b > 1 for t, b in batches), op
        for case in cases:
            assert any(t > b > 1 for t, b in ((s[0], s[1]) for s in case.shapes)), case.label
            assert any(any(d % 128 for d in s[2:]) for s in case.shapes), case.label


def test_cells_cover_zero_one_ragged_and_3d_shapes():
    for case in (c for c in CASES if not NOT_ROW_SHAPES & c.traits):
        shapes = case.shapes
        assert any(math.prod(s) == 0 for s in shapes), case.label  # nothing to do: no launch
        assert any(math.prod(s[:-1]) == 1 for s in shapes), case.label  # a single token
        assert any(len(s) == 3 for s in shapes), case.label
        if "group" not in case.label and "block_w8a8" not in case.label:  # fp8 group quantisation (of x in a
            assert any(s[-1] % 128 for s in shapes), case.label             # W8A8 GEMM too) needs whole 128-lane groups


def test_a_call_time_decline_is_reported_by_the_cell(monkeypatch):
    """A kernel that declines one call (NotImplementedError) makes that cell native, with its
    reason, although the op resolved to the kernel."""
    from dualop.ops import SiluAndMul

    def forward_cpu(self, x):
        raise NotImplementedError("this input is not taken")

    monkeypatch.setattr(SiluAndMul, "forward_cpu", forward_cpu)
    case = next(c for c in CASES if c.op == "silu_and_mul")
    result = check._run_cell(case, "torch", "cpu", "float32", seed=0)
    assert result.status == "native" and "forward_cpu declined this call (this input is not taken)" in result.detail


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


@pytest.mark.parametrize("platform, method", [("cpu", "forward_native"), ("tpu", "forward_tpu")])
def test_jax_ops_dispatch_under_jit_and_vmap(platform, method):
    """Dispatch sees tracers as jax arrays; the resolved method runs inside jit and vmap (on the
    CPU that is the native body: no CPU kernel for jax arrays)."""
    import jax
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
    assert methods == {("rms_norm", method), ("silu_and_mul", method)}
    for got, want in ((got_norm, norm.forward_native(x, w)), (got_silu, silu.forward_native(x))):
        assert testing.compare(np.asarray(got), np.asarray(want), "float32").ok
