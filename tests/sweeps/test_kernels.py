"""The kernels themselves: several grid blocks with a ragged last one, the Triton two-pass path,
the vmap/jit behaviour of the Pallas wrappers, and their cost estimates."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch

from dualop import testing

jnp = jax.numpy


def _close(got, want, dtype):
    cmp = testing.compare(np.asarray(got, np.float32), np.asarray(want, np.float32), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel, cmp.detail)


@pytest.fixture(scope="module")
def interpret():
    from dualop.kernels.pallas.common import interpret_mode

    return interpret_mode("jax")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows, hidden, block_rows", [(37, 200, 16), (19, 384, 8), (33, 128, 32)])
def test_pallas_rms_norm_ragged_row_blocks(interpret, dtype, rows, hidden, block_rows):
    from dualop.kernels.pallas.rms_norm import rms_norm, rms_norm_reference

    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (rows, hidden)).astype(dtype)
    w = jax.random.normal(key[1], (hidden,)).astype(dtype)
    r = jax.random.normal(key[2], (rows, hidden)).astype(dtype)
    from dualop.kernels.norm_math import NormSpec

    for spec in (NormSpec(), NormSpec(var_size=hidden // 2), NormSpec(weight_offset=1.0, weight_in_f32=True)):
        out, res = rms_norm(x, w, r, spec=spec, interpret=interpret, block_rows=block_rows)
        want_out, want_res = rms_norm_reference(x, w, r, spec=spec)
        _close(out, want_out, dtype)
        _close(res, want_res, dtype)
    out, res = rms_norm(x, w, r, interpret=interpret, block_rows=block_rows)
    want_out, want_res = rms_norm_reference(x, w, r)
    _close(out, want_out, dtype)
    _close(res, want_res, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows, d", [(21, 100), (21, 256), (3, 2176)])
def test_pallas_gated_ragged_blocks_both_layouts(interpret, dtype, rows, d):
    """d % 128 == 0 takes the two-column-block layout, otherwise the full-row layout."""
    from dualop.kernels.gate_math import GateSpec
    from dualop.kernels.pallas.gated_activation import gated_activation, gated_activation_reference

    x = jax.random.normal(jax.random.key(1), (rows, 2 * d)).astype(dtype)
    specs = [GateSpec(a) for a in ("silu", "gelu", "gelu_tanh")] + [
        GateSpec("silu", act_on="second"),
        GateSpec("fatrelu", threshold=0.2),
        GateSpec("swigluoai", interleaved=True),
        GateSpec("gelu", sparsity=0.9),
    ]
    for spec in specs:
        got = gated_activation(x, spec=spec, interpret=interpret, block_rows=8)
        _close(got, gated_activation_reference(x, spec=spec), dtype)


def test_pallas_lane_block_divides_d():
    from dualop.kernels.pallas.gated_activation import _lane_block

    for d in (128, 256, 384, 2176, 14336, 4096 * 3):
        b = _lane_block(d)
        assert b % 128 == 0 and d % b == 0 and b <= 2048


def test_row_blocks_respect_tpu_tiling():
    from dualop.kernels.pallas.common import row_blocks

    for rows in (1, 7, 8, 9, 100, 5000, 100000):
        for dtype, tile in (("float32", 8), ("bfloat16", 16)):
            b = row_blocks(rows, 4096, jnp.dtype(dtype), bytes_per_elem=16)
            assert b.block_rows == rows or b.block_rows % tile == 0, (rows, dtype, b)
            assert b.block_rows * 4096 * 16 <= 4 * 1024 * 1024 or b.block_rows == tile


def test_pallas_under_jit_and_vmap(interpret):
    from dualop.kernels.pallas.gated_activation import gated_activation, gated_activation_reference
    from dualop.kernels.pallas.rms_norm import rms_norm, rms_norm_reference

    x = jax.random.normal(jax.random.key(2), (3, 20, 256))
    w = jax.random.normal(jax.random.key(3), (3, 256))  # a batched weight: mapped, not folded
    got = jax.jit(jax.vmap(lambda t: rms_norm(t, interpret=interpret, block_rows=8)))(x)
    _close(got, rms_norm_reference(x), "float32")
    got = jax.vmap(lambda t, ww: rms_norm(t, ww, interpret=interpret))(x, w)
    _close(got, jax.vmap(lambda t, ww: rms_norm_reference(t, ww))(x, w), "float32")
    got = jax.vmap(jax.vmap(lambda t: gated_activation(t, interpret=interpret)))(x)
    _close(got, gated_activation_reference(x), "float32")


def test_pallas_cost_estimates_count_bytes_once():
    from dualop.kernels.pallas.gated_activation import gated_activation_cost
    from dualop.kernels.pallas.rms_norm import rms_norm_cost

    c = rms_norm_cost(rows=10, hidden=128, itemsize=2, has_weight=True, has_residual=True)
    assert c.bytes_accessed == 10 * 128 * 2 * 4 + 128 * 2
    assert c.transcendentals == 10
    c = gated_activation_cost(rows=10, d=64, itemsize=4)
    assert c.bytes_accessed == 10 * 64 * 4 * 3


@pytest.fixture(scope="module")
def triton_kernels():
    why = testing.prepare_triton()
    if why is not None:
        pytest.skip(f"triton is not installed in this environment: {why}")
    from dualop.kernels.cuda import gated_activation, rms_norm

    return rms_norm, gated_activation


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_rms_norm_two_pass_path(triton_kernels, dtype):
    """Rows wider than MAX_SINGLE_PASS take the two-pass loop."""
    rms_mod, _ = triton_kernels
    from dualop.ops import RMSNorm

    hidden = rms_mod.MAX_SINGLE_PASS + 136
    tdtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, hidden, generator=g).to(tdtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(tdtype)
    from dualop.ops import GemmaRMSNorm

    for op in (RMSNorm(hidden), RMSNorm(hidden, var_hidden_size=hidden - 200), GemmaRMSNorm(hidden)):
        out, res = rms_mod.rms_norm(x, w, r, spec=op.spec)
        want_out, want_res = op.forward_native(x, w, r)
        _close(out.float(), want_out.float(), dtype)
        assert torch.equal(res, want_res)


def test_triton_non_contiguous_input(triton_kernels):
    rms_mod, gated_mod = triton_kernels
    from dualop.ops import RMSNorm, SiluAndMul

    x = torch.randn(64, 12).t()  # (12, 64) with a non-unit last stride
    _close(rms_mod.rms_norm(x), RMSNorm(64).forward_native(x), "float32")
    _close(gated_mod.gated_activation(x), SiluAndMul().forward_native(x), "float32")


def test_triton_bf16_rounding_matches_torch(triton_kernels):
    """The interpreter truncates float32 -> bfloat16; the kernels round to nearest even as a GPU does."""
    _, gated_mod = triton_kernels
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 512, generator=g).to(torch.bfloat16)
    want = (torch.nn.functional.silu(x[:, :256].float()) * x[:, 256:].float()).to(torch.bfloat16)
    got = gated_mod.gated_activation(x)
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.float().abs().max().item()
    assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("frontend, platform", [("torch", "cuda"), ("torch", "cpu"), ("jax", "tpu")])
def test_sparse_gate_inf_row_is_nan_as_native(frontend, platform):
    """An inf in a row's gate half makes its mean inf and its std NaN, so the native body's relu
    turns the whole row NaN; a kernel's max must propagate that NaN, not return 0 (the Triton
    default: a NaN-dropping max gave a finite row)."""
    from dualop import OpsConfig, override_platform, set_config
    from dualop.ops import GeluAndMulSparse

    x = np.random.default_rng(1).standard_normal((3, 200)).astype(np.float32)
    x[1, 58] = np.inf  # gate half of row 1
    op = GeluAndMulSparse(0.95)
    arg = testing.to_frontend(x, frontend, "float32")
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = testing.to_numpy(op(arg))
    want = testing.to_numpy(op.forward_native(testing.to_frontend(x, frontend, "float32")))
    assert np.isnan(want[1]).all() and not np.isnan(want[[0, 2]]).any()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    _close(np.nan_to_num(got), np.nan_to_num(want), "float32")


NON_FINITE_QUERY_CASES = {  # label -> the check-case shape (several rows, several heads)
    "mm_encoder_attn": (2, 37, 160),
    "mm_encoder_attn[cu_seqlens]": (1, 37, 160),
    "ragged_paged_attention[mixed,gqa2]": (12, 8, 128),
    "ragged_paged_mla_attention[mixed]": (9, 4, 72),
}


@pytest.mark.latest_only
@pytest.mark.parametrize("special", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("frontend, platform", [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")])
@pytest.mark.parametrize("label", sorted(NON_FINITE_QUERY_CASES))
def test_attention_kernels_keep_a_non_finite_query_row_nan(label, frontend, platform, special):
    """A non-finite query element makes its row's scores NaN or +-inf: softmax (the native body) is
    NaN there. A kernel must not zero that row: torch's SDPA returns zeros for a NaN or all -inf
    row, and a ``where(l > 0, out, 0)`` finish read a NaN sum as 'no position seen'."""
    from dualop import OpsConfig, override_platform, set_config

    case = next(testing.cases_for([label]))
    shape = NON_FINITE_QUERY_CASES[label]
    op = case.make_op(shape)

    def inputs():
        raw = list(case.make_inputs(shape, np.random.default_rng(5)))
        raw[0] = raw[0].copy()
        raw[0].reshape(-1)[3] = special  # query token 0, head 0
        return tuple(testing.to_frontend(a, frontend, "float32") for a in raw)

    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = testing.to_numpy(op(*inputs()))
        method, reason = op.last_run(frontend)
    assert method != "forward_native", reason
    want = testing.to_numpy(op.forward_native(*inputs()))
    assert np.isnan(want).any() and not np.isnan(want).all()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    _close(np.nan_to_num(got), np.nan_to_num(want), "float32")
