"""What is specific to ``rel_pos_attention``; the shared sweeps (every cell against forward_native,
autograd, properties, the real compilers) reach it through its ``check_cases()``.

The reference nobody here wrote: transformers' ``SamVisionAttention`` (SAM's image encoder), with
its own parameters passed to the op and, for the layers, its state dict loaded as it is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config
from dualop.ops import RelPosAttention
from dualop.kernels.rel_pos_math import rel_pos_gather_matrix
from dualop.ops import rel_pos_attention as rel_pos_mod
from dualop.testing import NoLaunch

transformers_sam = pytest.importorskip("transformers.models.sam.modeling_sam",
                                       reason="transformers' SAM is the reference")


def _sam_attention(dim: int, heads: int, use_rel_pos: bool, table: int, qkv_bias: bool = True, seed: int = 0):
    """transformers' SamVisionAttention with random parameters (its tables start at zeros, which
    would hide a swapped or mis-indexed table)."""
    from transformers import SamVisionConfig

    config = SamVisionConfig(hidden_size=dim, num_attention_heads=heads, qkv_bias=qkv_bias, use_rel_pos=use_rel_pos,
                             image_size=table * 16, patch_size=16, attention_dropout=0.0)
    torch.manual_seed(seed)
    module = transformers_sam.SamVisionAttention(config, window_size=0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 or p.shape[-1] == dim // heads else dim ** -0.5))
    return module


def _op_args(module, dtype):
    sd = {k: v.to(dtype) for k, v in module.state_dict().items()}
    return (sd["qkv.weight"], sd.get("qkv.bias"), sd["proj.weight"], sd["proj.bias"], sd.get("rel_pos_h"),
            sd.get("rel_pos_w"))


# (grid H, W, table side): the table's own size (windowed blocks: 14 x 14), and a global 16 x 16
# table with grids that make it interpolate up, down, and differently along H and W.
GRIDS = [(14, 14, 14), (16, 16, 16), (20, 18, 16), (9, 12, 16)]


@pytest.mark.parametrize("use_rel_pos", [False, True], ids=["plain", "rel_pos"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_native_matches_transformers_float32(grid, use_rel_pos):
    hh, ww, table = grid
    dim, heads = 64, 4
    module = _sam_attention(dim, heads, use_rel_pos, table)
    x = torch.randn(2, hh, ww, dim, generator=torch.Generator().manual_seed(1))
    op = RelPosAttention(dim, heads, use_rel_pos=use_rel_pos, input_size=(table, table))
    got = op.forward_native(x, *_op_args(module, torch.float32))
    with torch.no_grad():
        want = module(x)[0]
        want64 = module.double()(x.double())[0]
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grid", [(14, 14, 14), (20, 18, 16)], ids=lambda g: "x".join(map(str, g)))
def test_native_matches_transformers_bfloat16(grid):
    """bfloat16 inputs: the op computes in float32 and rounds once, so it matches transformers run
    in float32 on the same bfloat16 values to bfloat16's rounding; transformers run in bfloat16
    itself (rounding its probabilities and intermediate products) agrees to a few bfloat16 ulps."""
    hh, ww, table = grid
    dim, heads = 64, 4
    module = _sam_attention(dim, heads, True, table)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    x = torch.randn(1, hh, ww, dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    op = RelPosAttention(dim, heads, use_rel_pos=True, input_size=(table, table))
    got = op.forward_native(x, *_op_args(module, torch.bfloat16))
    assert got.dtype == torch.bfloat16
    with torch.no_grad():
        want = module(x.float())[0]
        want_bf16 = module.to(torch.bfloat16)(x)[0]
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got.float(), want_bf16.float(), rtol=6e-2, atol=6e-2)


def test_native_matches_deepseek_ocr2_windowed_attention():
    """DeepSeek-OCR 2's own copy of SAM's attention (transformers' ``deepseek_ocr2``), built as its
    windowed blocks are (``window_size`` 7: tables for 7 x 7) and called on a 7 x 7 window and on a
    9 x 6 grid (tables interpolated)."""
    ocr2 = pytest.importorskip("transformers.models.deepseek_ocr2.modeling_deepseek_ocr2",
                               reason="transformers without DeepSeek-OCR 2")
    from transformers.models.deepseek_ocr2.configuration_deepseek_ocr2 import DeepseekOcr2SamVisionConfig

    config = DeepseekOcr2SamVisionConfig(hidden_size=48, num_attention_heads=3, qkv_bias=True, use_rel_pos=True,
                                         image_size=256, patch_size=16, attention_dropout=0.0)
    torch.manual_seed(6)
    module = ocr2.DeepseekOcr2SamVisionAttention(config, window_size=7).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    op = RelPosAttention(48, 3, use_rel_pos=True, input_size=(7, 7))
    for hw in ((7, 7), (9, 6)):
        x = torch.randn(3, *hw, 48, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            want = module(x)[0]
        torch.testing.assert_close(op.forward_native(x, *_op_args(module, torch.float32)), want, rtol=1e-4, atol=1e-4)


def test_without_qkv_bias_matches_transformers():
    module = _sam_attention(32, 2, True, 6, qkv_bias=False)
    x = torch.randn(1, 6, 6, 32, generator=torch.Generator().manual_seed(3))
    op = RelPosAttention(32, 2, qkv_bias=False, use_rel_pos=True, input_size=(6, 6))
    with torch.no_grad():
        want = module(x)[0]
    torch.testing.assert_close(op.forward_native(x, *_op_args(module, torch.float32)), want, rtol=1e-4, atol=1e-4)


def test_gather_matrix_is_identity_at_the_table_size():
    """At the table's own size the resize is the identity: ``Rh[i, j]`` is row ``i - j + n - 1``."""
    n = 5
    gather = rel_pos_gather_matrix(n, 2 * n - 1)
    want = np.zeros_like(gather)
    for i in range(n):
        for j in range(n):
            want[i, j, i - j + n - 1] = 1.0
    np.testing.assert_array_equal(gather, want)


@pytest.mark.parametrize("grid", [(20, 16), (9, 16), (3, 4)])
def test_gather_matrix_matches_torch_interpolate(grid):
    size, side = grid
    table = torch.randn(2 * side - 1, 8, dtype=torch.float64)
    resized = torch.nn.functional.interpolate(table.T[None], size=2 * size - 1, mode="linear")[0].T
    index = torch.arange(size)[:, None] - torch.arange(size)[None, :] + size - 1
    gather = torch.from_numpy(rel_pos_gather_matrix(size, 2 * side - 1)).double()
    torch.testing.assert_close(torch.einsum("ijl,lc->ijc", gather, table), resized[index], rtol=1e-6, atol=1e-6)


# --- non-finite inputs on every kernel cell (the property sweep leaves this op to this file) ----

KERNEL_CELLS = [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")]


@pytest.mark.parametrize("cell", KERNEL_CELLS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [0, 5], ids=["x", "rel_pos_h"])
def test_kernels_match_native_with_nonfinite_inputs(cell, special, where):
    """A non-finite value in x or in a table: every kernel has NaN exactly where the native body
    does (a NaN or infinite key reaches every query of its image through q . k; the other image
    of the batch stays finite) and agrees elsewhere."""
    from dualop import testing

    frontend, platform = cell
    case = next(c for c in testing.cases_for(["rel_pos_attention"]) if c.label == "rel_pos_attention[rel_pos]")
    shape = (2, 6, 5, 32)
    raw = list(case.make_inputs(shape, np.random.default_rng(0)))
    raw[where].flat[7] = special
    op = case.make_op(shape)
    args = [testing.to_frontend(a, frontend, "float32") for a in raw]
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = op(*args)
        method, reason = op.last_run(frontend)
    assert method != "forward_native", reason
    want = testing.to_numpy(op.forward_native(*args))
    got = testing.to_numpy(got)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isfinite(want[1]).all() or where != 0  # the image without the planted value stays finite
    cmp = testing.compare(got, want, "float32")
    assert cmp.ok, cmp


# --- layers: transformers' state dict as it is ------------------------------------------------


@pytest.mark.parametrize("use_rel_pos", [False, True], ids=["plain", "rel_pos"])
def test_torch_layer_loads_sam_state_dict(use_rel_pos):
    from dualop.torch import layers

    module = _sam_attention(32, 2, use_rel_pos, 6)
    layer = layers.RelPosAttention(32, 2, use_rel_pos=use_rel_pos, input_size=(6, 6))
    layer.load_state_dict(module.state_dict())
    x = torch.randn(2, 6, 6, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), module(x)[0], rtol=1e-4, atol=1e-4)


def test_jax_layer_loads_sam_state_dict():
    import jax.numpy as jnp

    from dualop.jax import layers

    module = _sam_attention(32, 2, True, 6)
    layer = layers.RelPosAttention(32, 2, use_rel_pos=True, input_size=(6, 6))
    layer.load_state_dict(module.state_dict())
    x = torch.randn(1, 7, 5, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module(x)[0].numpy()
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x.numpy()))), want, rtol=1e-4, atol=1e-4)


def test_layer_tables_start_at_zeros_or_random():
    from dualop.torch import layers

    zero = layers.RelPosAttention(32, 2, use_rel_pos=True, input_size=(4, 5))
    assert zero.rel_pos_h.shape == (7, 16) and zero.rel_pos_w.shape == (9, 16)
    assert not zero.rel_pos_h.any()
    rand = layers.RelPosAttention(32, 2, use_rel_pos=True, rel_pos_zero_init=False, input_size=(4, 5))
    assert 0.01 < float(rand.rel_pos_h.std()) < 0.03  # trunc_normal_(std=0.02)
    assert not hasattr(layers.RelPosAttention(32, 2).rel_pos_h, "shape")  # None without relative positions


def test_jax_layer_tables_start_at_zeros_or_random():
    import jax.numpy as jnp

    from dualop.jax import layers

    zero = layers.RelPosAttention(32, 2, use_rel_pos=True, input_size=(4, 5))
    assert zero.rel_pos_h.shape == (7, 16) and zero.rel_pos_w.shape == (9, 16)
    assert not jnp.any(zero.rel_pos_h[...])
    rand = layers.RelPosAttention(32, 2, use_rel_pos=True, rel_pos_zero_init=False, input_size=(4, 5))
    assert 0.01 < float(jnp.std(rand.rel_pos_h[...])) < 0.03  # as torch's trunc_normal_(std=0.02)
    assert layers.RelPosAttention(32, 2).rel_pos_h is None


# --- bad input, refused before any kernel runs -----------------------------------------------


@pytest.fixture
def no_kernel(monkeypatch):
    for name in ("_PALLAS", "_TRITON", "_CPU"):
        monkeypatch.setattr(rel_pos_mod, name, NoLaunch())


def _good(dim=32, heads=2, rel=True, hw=(4, 4), table=4):
    rng = np.random.default_rng(0)
    t = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    d = dim // heads
    return [t(1, *hw, dim), t(3 * dim, dim), t(3 * dim), t(dim, dim), t(dim),
            t(2 * table - 1, d) if rel else None, t(2 * table - 1, d) if rel else None]


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("index, value, error, match", [
    (0, torch.zeros(1, 16, 32), ValueError, r"rel_pos_attention: argument 'x' must have at least 4"),
    (0, torch.zeros(1, 4, 4, 48), ValueError, r"argument 'x' has shape \(1, 4, 4, 48\); expected \[B, H, W, 32\]"),
    (0, torch.zeros(1, 4, 4, 32, dtype=torch.int32), TypeError, r"argument 'x' has dtype int32"),
    (1, torch.zeros(96, 16), ValueError, r"argument 'qkv_weight' has shape \(96, 16\); expected \(96, 32\)"),
    (1, None, TypeError, r"argument 'qkv_weight' is required"),
    (2, None, ValueError, r"argument 'qkv_bias' is required \(qkv_bias=True\)"),
    (3, torch.zeros(32, 32, dtype=torch.bfloat16), TypeError, r"argument 'proj_weight' has dtype bfloat16; expected float32"),
    (4, None, TypeError, r"argument 'proj_bias' is required"),
    (5, torch.zeros(9, 16), ValueError, r"argument 'rel_pos_h' has shape \(9, 16\); expected \(7, 16\)"),
    (6, None, ValueError, r"argument 'rel_pos_w' is required \(use_rel_pos=True\)"),
    (6, torch.zeros(7, 8), ValueError, r"argument 'rel_pos_w' has shape \(7, 8\); expected \(7, 16\)"),
])
def test_bad_input_is_refused(no_kernel, platform, index, value, error, match):
    args = _good()
    args[index] = value
    op = RelPosAttention(32, 2, use_rel_pos=True, input_size=(4, 4))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        with pytest.raises(error, match=match):
            op(*args)


def test_tables_refused_without_rel_pos(no_kernel):
    args = _good(rel=True)
    with set_config(OpsConfig(["all"])), pytest.raises(ValueError, match=r"'rel_pos_h' must be None \(use_rel_pos=False\)"):
        RelPosAttention(32, 2)(*args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=30, num_heads=4), r"rel_pos_attention: dim=30 must be a multiple of num_heads=4"),
    (dict(dim=32, num_heads=0), r"num_heads must be a positive int"),
    (dict(dim=32, use_rel_pos=True), r"use_rel_pos=True needs input_size"),
    (dict(dim=32, input_size=(4,)), r"input_size must be None or \(height, width\)"),
    (dict(dim=32, input_size=(4, 0)), r"input_size\[1\] must be a positive int"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RelPosAttention(**kwargs)
