"""quant_fp8 (QuantFP8): every (frontend, platform) cell against forward_native, the kernels on
ragged blocks and chunked rows, forward_native's exact semantics against torch's own float8 cast,
zero rows, scale_ub, bad input, jax jit/vmap on the TPU path, and the float8_e4m3fnuz format
(max 224) ROCm MI300 gets (against torch's and ml_dtypes' own fnuz casts)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dualop import OpsConfig, check, dispatch_report, override_platform, set_config, testing
from dualop.ops import quantization as quant_mod
from dualop.ops.quantization import E4M3FN, E4M3FNUZ, FP8_MAX, FP8_MIN_SCALE, GroupShape, QuantFP8, fp8_format


CASES = list(testing.cases_for(["quant_fp8"]))
GRANULARITIES = {"per_tensor": "tensor", "per_token": "token", (1, 128): "group"}


def _bits(t):
    """A float8 tensor's bit patterns (exact comparison, NaN and -0.0 included)."""
    return t.view(torch.uint8)


def _torch_fp8(y):
    """The independent reference cast: torch's own float32 -> float8_e4m3fn."""
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _same_bits(a, b):
    """Two arrays (jax or torch, float8 or float32) of one shape hold the same bytes."""
    def raw(t):
        if isinstance(t, torch.Tensor):
            return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return np.ascontiguousarray(np.asarray(t)).reshape(-1).view(np.uint8)

    same_dtype = str(a.dtype).removeprefix("torch.") == str(b.dtype).removeprefix("torch.")
    return tuple(a.shape) == tuple(b.shape) and same_dtype and bool(np.array_equal(raw(a), raw(b)))


def _quantised(x, s):
    """x_q as specified: x times the float32 reciprocal of its (broadcast) scale, torch's cast."""
    return _torch_fp8(x.float() * (1.0 / s))


# ------------------------------------------------------------------------------------ cells


def test_cases_cover_each_mode_and_ragged_shapes():
    labels = {c.label for c in CASES}
    assert labels == {
        "quant_fp8[dynamic,per_tensor]", "quant_fp8[dynamic,per_token]", "quant_fp8[dynamic,per_token,scale_ub]",
        "quant_fp8[dynamic,group128]", "quant_fp8[static,per_tensor]",
    }
    for case in CASES:
        assert any(s[0] == 0 for s in case.shapes), case.label
        assert any(len(s) == 2 and s[0] == 1 for s in case.shapes), case.label
        assert any(len(s) == 3 for s in case.shapes), case.label
        assert any(len(s) == 2 and s[0] % 8 for s in case.shapes), case.label  # ragged row count
        if "group" not in case.label:
            assert any(s[-1] % 128 for s in case.shapes), case.label


def test_harness_catches_a_wrong_scale(monkeypatch):
    """A fast path whose scale is 1% off fails its cell (the scale is compared, not only x_q)."""
    real = QuantFP8.forward_cpu
    monkeypatch.setattr(QuantFP8, "forward_cpu", lambda self, *a: (real(self, *a)[0], real(self, *a)[1] * 1.01))
    case = next(c for c in CASES if c.label == "quant_fp8[dynamic,per_token]")
    assert check._run_cell(case, "torch", "cpu", "float32", seed=0).status == "fail"


# ------------------------------------------------------------------- semantics (torch native)


def _spread(shape, seed=0):
    """Normal data whose rows span three decades, with one all-zero row and one all-zero group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3.0
    rows = x.view(-1, shape[-1])
    rows *= torch.logspace(-1.5, 1.5, rows.shape[0]).unsqueeze(1)
    rows[1] = 0.0
    rows[2, :128] = 0.0
    return x


def _independent_scale(x, granularity, ub=None):
    """max(amax / 448, 1/(448*512)) from x with plain torch reductions, the quotient in float64."""
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().max().reshape(1)
    elif granularity == "token":
        amax = xf.abs().amax(dim=-1, keepdim=True)
        if ub is not None:
            amax = torch.minimum(amax, ub)
    else:
        amax = xf.unflatten(-1, (-1, 128)).abs().amax(dim=-1)
    return (amax.double() / 448.0).float().clamp(min=1.0 / (448.0 * 512.0))


def _broadcast(scale, x, granularity):
    return scale.repeat_interleave(128, dim=-1) if granularity == "group" else scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_shape", list(GRANULARITIES), ids=str)
@pytest.mark.parametrize("shape", [(9, 384), (2, 5, 256)], ids=str)
def test_native_dynamic_semantics(group_shape, dtype, shape):
    gran = GRANULARITIES[group_shape]
    x = _spread(shape).to(dtype)
    op = QuantFP8(False, group_shape)
    x_q, scale = op.forward_native(x)
    expect_shape = {"tensor": (1,), "token": (*shape[:-1], 1), "group": (*shape[:-1], shape[-1] // 128)}[gran]
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == x.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == expect_shape
    assert torch.equal(scale, _independent_scale(x, gran))
    s = _broadcast(scale, x, gran)
    assert torch.equal(_bits(x_q), _bits(_quantised(x, s)))
    # dequantised within half an e4m3 ulp (2**-4 relative; 2**-10 * scale below the normal range)
    err = (x_q.float() * s - x.float()).abs()
    assert bool((err <= x.float().abs() * 2.0**-4 + s * 2.0**-10 + 1e-30).all())
    # the largest |x| of each group maps to +-448 exactly
    assert x_q.float().abs().max().item() == FP8_MAX


def test_native_zero_rows_groups_and_tensors():
    x = _spread((4, 256))
    for group_shape in GRANULARITIES:
        x_q, scale = QuantFP8(False, group_shape).forward_native(x)
        assert bool((x_q[1].float() == 0).all()) and bool((x_q[2, :128].float() == 0).all())
        assert bool(torch.isfinite(scale).all())
    _, scale = QuantFP8(False, "per_token").forward_native(x)
    assert scale[1].item() == pytest.approx(FP8_MIN_SCALE, rel=1e-7)
    _, scale = QuantFP8(False, (1, 128)).forward_native(x)
    assert scale[2, 0].item() == pytest.approx(FP8_MIN_SCALE, rel=1e-7) and scale[2, 1].item() > FP8_MIN_SCALE
    x_q, scale = QuantFP8(False, "per_tensor").forward_native(torch.zeros(3, 130))
    assert scale.tolist() == pytest.approx([FP8_MIN_SCALE], rel=1e-7) and not bool(x_q.float().any())
    for group_shape, s_shape in (("per_tensor", (1,)), ("per_token", (0, 1)), ((1, 128), (0, 2))):
        x_q, scale = QuantFP8(False, group_shape).forward_native(torch.zeros(0, 256))
        assert x_q.shape == (0, 256) and tuple(scale.shape) == s_shape


def test_native_scale_ub_clamps_amax():
    x = _spread((6, 200))
    amax = x.abs().amax(dim=-1, keepdim=True)
    ub = torch.tensor([amax.median().item()], dtype=torch.float32)
    x_q, scale = QuantFP8(False, "per_token").forward_native(x, None, ub)
    clipped = amax > ub
    assert bool(clipped.any()) and bool((~clipped).any())
    assert torch.equal(scale, _independent_scale(x, "token", ub))
    assert torch.equal(scale[clipped], torch.full_like(scale[clipped], (ub.double() / 448.0).item()))
    assert bool((x_q.float().abs() <= FP8_MAX).all())
    assert bool((x_q.float()[clipped.squeeze(-1)].abs() == FP8_MAX).any())  # saturated rows
    assert torch.equal(_bits(x_q), _bits(_quantised(x, scale)))
    # a one-element scale_ub of shape () or (1, 1) means the same
    for other in (ub.reshape(()), ub.reshape(1, 1)):
        assert torch.equal(_bits(QuantFP8(False, "per_token")(x, None, other)[0]), _bits(x_q))


@pytest.mark.parametrize("group_shape", list(GRANULARITIES), ids=str)
def test_native_static_semantics(group_shape):
    gran = GRANULARITIES[group_shape]
    x = _spread((5, 256))
    s_shape = {"tensor": (1,), "token": (5, 1), "group": (5, 2)}[gran]
    scale = torch.rand(s_shape, generator=torch.Generator().manual_seed(1)) * 0.02 + 0.005
    x_q, out_scale = QuantFP8(True, group_shape).forward_native(x, scale)
    assert torch.equal(out_scale, scale)
    assert torch.equal(_bits(x_q), _bits(_quantised(x, _broadcast(scale, x, gran))))
    assert bool((x_q.float().abs() == FP8_MAX).any())  # some values saturate at this scale


def test_native_static_per_tensor_scale_forms():
    x = _spread((3, 136))
    want = QuantFP8(True, "per_tensor").forward_native(x, torch.tensor([0.01]))
    for form in (torch.tensor(0.01), torch.tensor([[0.01]])):
        x_q, scale = QuantFP8(True, "per_tensor")(x, form)
        assert tuple(scale.shape) == (1,) and torch.equal(scale, want[1])
        assert torch.equal(_bits(x_q), _bits(want[0]))


def _fp8_edge_values(dtype=torch.float8_e4m3fn):
    """Every finite value of the fp8 ``dtype``, every midpoint between neighbours (ties), and
    values just off them."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    pos = finite[torch.isfinite(finite) & (finite >= 0)].unique()
    mids = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    v = torch.cat([pos, mids, near, torch.tensor([50.0009765625, 31.6, 2.0**-10 + 2.0**-30])])
    return torch.cat([v, -v, torch.tensor([-0.0])])


def test_div_by_fp8_max_is_correctly_rounded():
    """amax / 448 without a division by a constant equals float64 division rounded once, in both
    namespaces (XLA alone compiles a / 448 as a * f32(1/448), one ulp off for some a)."""
    g = torch.Generator().manual_seed(7)
    a = torch.cat([torch.rand(200000, generator=g) * 500, torch.rand(1000, generator=g) * 1e-3, torch.tensor([0.0, 336.0, 448.0, 1e30])])
    want = (a.double() / 448.0).float()
    from dualop.backends.torch import array_api as torch_xp

    assert torch.equal(quant_mod._div_by_fp8_max(torch_xp, a), want)
    assert quant_mod._div_by_fp8_max(torch_xp, torch.tensor([float("inf")])).item() == float("inf")
    import jax
    from dualop.backends.xla import array_api as jax_xp
    from dualop.kernels.pallas.quant_fp8 import div_by_fp8_max

    for fn in (lambda v: quant_mod._div_by_fp8_max(jax_xp, v), jax.jit(lambda v: quant_mod._div_by_fp8_max(jax_xp, v)), jax.jit(div_by_fp8_max)):
        assert np.array_equal(np.asarray(fn(jax.numpy.asarray(a.numpy()))), want.numpy())


def test_round_to_fp8_grid_matches_torch_cast():
    """The XLA-side pre-rounding (written with the array namespace) equals torch's cast, ties included."""
    from dualop.backends.torch import array_api as torch_xp

    v = _fp8_edge_values()
    got = quant_mod._round_to_fp8_grid(torch_xp, v).to(torch.float8_e4m3fn)
    assert torch.equal(_bits(got), _bits(v.to(torch.float8_e4m3fn)))
    import jax.numpy as jnp
    from dualop.backends.xla import array_api as jax_xp

    got = np.asarray(quant_mod._round_to_fp8_grid(jax_xp, jnp.asarray(v.numpy())).astype(jnp.float8_e4m3fn))
    assert np.array_equal(got.view(np.uint8), _bits(v.to(torch.float8_e4m3fn)).numpy())


@pytest.mark.parametrize("group_shape", list(GRANULARITIES), ids=str)
def test_jax_native_matches_torch_cast(group_shape):
    """jax's native body rounds like torch's cast (XLA alone rounds through float16 in some releases)."""
    import jax.numpy as jnp
    gran = GRANULARITIES[group_shape]
    x = _spread((7, 256))
    x_q, scale = QuantFP8(False, group_shape).forward_native(jnp.asarray(x.numpy()))
    scale_t = torch.from_numpy(np.asarray(scale).copy())
    assert torch.equal(scale_t, _independent_scale(x, gran))  # XLA alone would multiply by f32(1/448)
    want = _quantised(x, _broadcast(scale_t, x, gran))
    assert np.array_equal(np.asarray(x_q).view(np.uint8), _bits(want).numpy())


def test_jax_native_static_cast_of_ties():
    import jax.numpy as jnp
    v = _fp8_edge_values()
    x_q, _ = QuantFP8(True, "per_tensor").forward_native(jnp.asarray(v.numpy()).reshape(1, -1), jnp.ones((1,), jnp.float32))
    assert np.array_equal(np.asarray(x_q).view(np.uint8).ravel(), _bits(v.to(torch.float8_e4m3fn)).numpy())


# ------------------------------------------------------------------------------------ kernels

KERNEL_MODES = [  # (label, granularity, static, with scale_ub)
    ("dynamic_tensor", "tensor", False, False),
    ("dynamic_token", "token", False, False),
    ("dynamic_token_ub", "token", False, True),
    ("dynamic_group", "group", False, False),
    ("static_tensor", "tensor", True, False),
    ("static_token", "token", True, False),
    ("static_group", "group", True, False),
]


def _kernel_args(gran, static, with_ub, x, rows_shape):
    lead, hidden = rows_shape[:-1], rows_shape[-1]
    n = {"tensor": None, "token": 1, "group": hidden // 128}[gran]
    scale = None
    if static:
        s_shape = (1,) if gran == "tensor" else (*lead, n)
        scale = torch.rand(s_shape, generator=torch.Generator().manual_seed(2)) * 0.02 + 0.004
    ub = torch.tensor([2.5]) if with_ub else None
    return scale, ub


def _op_for(gran, static):
    return QuantFP8(static, {"tensor": "per_tensor", "token": "per_token", "group": (1, 128)}[gran])


# every mode in float32; each of the three kernel builders (per-tensor two-phase, dynamic row,
# static row) also in bfloat16 (the cells run every mode in both dtypes through the op)
PALLAS_RUNS = [(*m, "float32") for m in KERNEL_MODES] + [
    (*m, "bfloat16") for m in KERNEL_MODES if m[0] in ("dynamic_tensor", "dynamic_group", "static_token")
]


@pytest.mark.parametrize("label, gran, static, with_ub, dtype", PALLAS_RUNS, ids=[f"{r[0]}-{r[-1]}" for r in PALLAS_RUNS])
def test_pallas_ragged_row_blocks(label, gran, static, with_ub, dtype):
    """70 rows in blocks of 32 (the float8 sublane tile): three grid rows, the last one ragged;
    two column groups for (1, 128)."""
    import jax
    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.quant_fp8 import quant_fp8, quant_fp8_reference

    shape = (70, 256)
    x = _spread(shape, seed=3).to(getattr(torch, dtype))
    scale, ub = _kernel_args(gran, static, with_ub, x, shape)
    jx = jax.numpy.asarray(x.float().numpy()).astype(dtype)
    js = None if scale is None else jax.numpy.asarray(scale.numpy())
    jub = None if ub is None else jax.numpy.asarray(ub.numpy())
    gs = 128 if gran == "group" else 0
    got = quant_fp8(jx, js, jub, granularity=gran, group_size=gs, interpret=interpret_mode("jax"), block_rows=32)
    want = quant_fp8_reference(jx, js, jub, granularity=gran, group_size=gs)
    native = _op_for(gran, static).forward_native(x, scale, ub)
    for g, w, n in zip(got, want, native):  # bit for bit: kernel, jnp reference, torch native body
        assert g.shape == w.shape == tuple(n.shape) and g.dtype == w.dtype
        assert _same_bits(g, w) and _same_bits(g, n), label


# (label, granularity, static, with_ub, shape, block_cols): column blocks with a ragged last one
COLUMN_TILED = [
    ("dynamic_token_two_pass", "token", False, False, (40, 200), 128),  # running amax, masked edge
    ("dynamic_token_ub_two_pass", "token", False, True, (40, 200), 128),
    ("static_token", "token", True, False, (40, 200), 128),
    ("dynamic_tensor", "tensor", False, False, (40, 300), 128),  # 128 + 128 + 44
    ("dynamic_group_3_per_block", "group", False, False, (40, 640), 384),  # 5 groups: 3 + 2
    ("static_group_3_per_block", "group", True, False, (40, 640), 384),
]


@pytest.mark.parametrize("label, gran, static, with_ub, shape, block_cols", COLUMN_TILED, ids=[c[0] for c in COLUMN_TILED])
def test_pallas_column_blocks(label, gran, static, with_ub, shape, block_cols):
    """Rows tiled in columns (the layout wide rows get; forced here by ``block_cols``): per token
    the two-pass running amax, per tensor elementwise blocks, per group several groups a block.
    Bit for bit against the jnp reference and the torch native body."""
    import jax

    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.quant_fp8 import quant_fp8, quant_fp8_reference

    x = _spread(shape, seed=11)
    x[3, -5] = 900.0  # the largest |x| of row 3 (and of the tensor) sits in the ragged last block
    scale, ub = _kernel_args(gran, static, with_ub, x, shape)
    jx = jax.numpy.asarray(x.numpy())
    js = None if scale is None else jax.numpy.asarray(scale.numpy())
    jub = None if ub is None else jax.numpy.asarray(ub.numpy())
    gs = 128 if gran == "group" else 0
    got = quant_fp8(jx, js, jub, granularity=gran, group_size=gs, interpret=interpret_mode("jax"),
                    block_rows=32, block_cols=block_cols)
    want = quant_fp8_reference(jx, js, jub, granularity=gran, group_size=gs)
    native = _op_for(gran, static).forward_native(x, scale, ub)
    for g, w, n in zip(got, want, native):
        assert _same_bits(g, w) and _same_bits(g, n), label


def test_pallas_rejects_unaligned_block_cols():
    import jax

    from dualop.kernels.pallas.quant_fp8 import quant_fp8

    with pytest.raises(ValueError, match="block_cols must be a multiple of 128"):
        quant_fp8(jax.numpy.zeros((4, 256)), granularity="token", block_cols=100)


@pytest.fixture(scope="module")
def triton_quant():
    why = testing.prepare_triton()
    if why is not None:
        pytest.skip(f"triton is not installed in this environment: {why}")
    from dualop.kernels.cuda import quant_fp8

    return quant_fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label, gran, static, with_ub", KERNEL_MODES, ids=[m[0] for m in KERNEL_MODES])
def test_triton_chunked_rows(triton_quant, label, gran, static, with_ub, dtype):
    """Groups wider than max_single_pass take the two-pass chunk loop (ragged last chunk); the
    result is bit-identical to the torch native body either way."""
    shape = (2, 3, 384) if gran == "group" else (2, 3, 200)
    x = _spread(shape, seed=5).to(dtype)
    scale, ub = _kernel_args(gran, static, with_ub, x, shape)
    want_q, want_s = _op_for(gran, static).forward_native(x, scale, ub)
    gs = 128 if gran == "group" else 0
    for single, chunk in ((8192, 4096), (64, 32)):  # chunked: 7 chunks of 200 (ragged), 4 of 128
        q, s = triton_quant.quant_fp8(x, scale, ub, granularity=gran, group_size=gs, max_single_pass=single, chunk=chunk)
        assert torch.equal(_bits(q), _bits(want_q)), (label, single)
        assert torch.equal(s, want_s), (label, single)


def test_triton_fp8_cast_rounds_to_nearest_even(triton_quant):
    """The interpreter's own f32 -> e4m3 cast is wrong near binade edges (31.6 -> 16); the kernel's
    rounding gives torch's bits for every e4m3 value, midpoint and near-midpoint."""
    v = _fp8_edge_values()
    x = torch.cat([v, torch.zeros(-v.numel() % 64)]).reshape(-1, 64)
    q, _ = triton_quant.quant_fp8(x, torch.ones(1), granularity="tensor")
    assert torch.equal(_bits(q), _bits(x.to(torch.float8_e4m3fn)))


def test_pallas_fp8_cast_rounds_to_nearest_even():
    import jax.numpy as jnp
    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.quant_fp8 import quant_fp8

    v = _fp8_edge_values()
    x = torch.cat([v, torch.zeros(-v.numel() % 128)]).reshape(-1, 128)
    q, _ = quant_fp8(jnp.asarray(x.numpy()), jnp.ones((1,), jnp.float32), granularity="tensor", interpret=interpret_mode("jax"))
    assert np.array_equal(np.asarray(q).view(np.uint8), _bits(x.to(torch.float8_e4m3fn)).numpy())


def test_triton_zero_tokens_launch_nothing(triton_quant):
    for gran, gs, s_shape in (("tensor", 0, (1,)), ("token", 0, (0, 1)), ("group", 128, (0, 2))):
        q, s = triton_quant.quant_fp8(torch.zeros(0, 256), granularity=gran, group_size=gs)
        assert q.shape == (0, 256) and tuple(s.shape) == s_shape
    assert triton_quant.quant_fp8(torch.zeros(0, 256), granularity="tensor")[1].item() == pytest.approx(FP8_MIN_SCALE, rel=1e-7)


# ------------------------------------------------------------------------------- jax dispatch


def test_jax_op_under_jit_and_vmap_on_tpu():
    """The Pallas path runs inside jit and vmap: per-token/group vmaps fold the batch into rows;
    per-tensor vmaps give one scale per example (the batched scale is mapped, not folded)."""
    import jax
    jnp = jax.numpy
    x = jnp.asarray(_spread((3, 40, 256), seed=6).numpy())
    ub = jnp.asarray([3.0], jnp.float32)
    per_tensor, per_token, group = QuantFP8(False, "per_tensor"), QuantFP8(False, "per_token"), QuantFP8(False, (1, 128))
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        got = {
            "tensor": jax.jit(jax.vmap(per_tensor))(x),
            "token": jax.vmap(jax.jit(lambda t: per_token(t, None, ub)))(x),
            "group": jax.jit(jax.vmap(group))(x),
        }
    assert {(r["op"], r["method"]) for r in dispatch_report()} == {("quant_fp8", "forward_tpu")}
    want = {
        "tensor": jax.vmap(per_tensor.forward_native)(x),
        "token": jax.vmap(lambda t: per_token.forward_native(t, None, ub))(x),
        "group": jax.vmap(group.forward_native)(x),
    }
    assert got["tensor"][1].shape == (3, 1) and len(set(np.asarray(got["tensor"][1]).ravel().tolist())) == 3
    for name in got:
        for g, w in zip(got[name], want[name]):
            assert _same_bits(g, w), name


# ---------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_kernel_may_launch(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (quant_mod._PALLAS_QUANT, quant_mod._TRITON_QUANT):
        monkeypatch.setattr(ref, "resolve", forbidden)
    with set_config(OpsConfig(["all"])):
        yield


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def _j(*shape, dtype="float32"):
    import jax.numpy as jnp
    return jnp.zeros(shape, dtype)


@pytest.mark.usefixtures("no_kernel_may_launch")
@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
@pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])
def test_bad_input(platform, make):
    with override_platform(platform):
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale' is required for a static op"):
            QuantFP8(True, "per_tensor")(make(4, 256))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale' must be None for a dynamic op"):
            QuantFP8(False, "per_tensor")(make(4, 256), make(1))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale' has shape \(4,\); expected \(4, 1\)"):
            QuantFP8(True, "per_token")(make(4, 256), make(4))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale' has shape \(4, 1\); expected \(4, 2\)"):
            QuantFP8(True, (1, 128))(make(4, 256), make(4, 1))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale' has shape \(2,\); expected \(1,\) or \(\) or \(1, 1\)"):
            QuantFP8(True, "per_tensor")(make(4, 256), make(2))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale_ub' is supported only by dynamic per-token"):
            QuantFP8(False, "per_tensor")(make(4, 256), None, make(1))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale_ub' is supported only by dynamic per-token"):
            QuantFP8(False, (1, 128))(make(4, 256), None, make(1))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'scale_ub' has shape \(4, 1\)"):
            QuantFP8(False, "per_token")(make(4, 256), None, make(4, 1))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'x' has last dim 200, which group_shape \(1, 128\) does not divide"):
            QuantFP8(False, (1, 128))(make(4, 200))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'x' must have at least 2 dimension"):
            QuantFP8(False, "per_token")(make(256))
        with pytest.raises(ValueError, match=r"quant_fp8: argument 'x' has an empty last dim"):
            QuantFP8(False, "per_token")(make(4, 0))
        with pytest.raises(TypeError, match=r"quant_fp8: argument 'x' has dtype int32; expected one of bfloat16, float16, float32"):
            QuantFP8(False, "per_token")(make(4, 256, dtype=torch.int32 if make is _t else "int32"))
        bf16 = torch.bfloat16 if make is _t else "bfloat16"
        with pytest.raises(TypeError, match=r"quant_fp8: argument 'scale' has dtype bfloat16; expected float32"):
            QuantFP8(True, "per_tensor")(make(4, 256), make(1, dtype=bf16))
        with pytest.raises(TypeError, match=r"quant_fp8: argument 'scale_ub' has dtype bfloat16; expected float32"):
            QuantFP8(False, "per_token")(make(4, 256), None, make(1, dtype=bf16))


@pytest.mark.usefixtures("no_kernel_may_launch")
def test_mixed_frontends_and_non_arrays_are_rejected():
    with pytest.raises(TypeError, match=r"quant_fp8: argument 'scale' is a jax array but 'x' is a torch array"):
        QuantFP8(True, "per_tensor")(_t(4, 256), _j(1))
    with pytest.raises(TypeError, match=r"quant_fp8: argument 'scale_ub' must be None, a torch.Tensor or a jax.Array"):
        QuantFP8(False, "per_token")(_t(4, 256), None, 3.0)


def test_group_shape_parsing_and_constructor_errors():
    assert GroupShape.parse("per_tensor") == GroupShape.PER_TENSOR == GroupShape(-1, -1)
    assert GroupShape.parse("per_token") == GroupShape.PER_TOKEN == GroupShape(1, -1)
    assert GroupShape.parse((1, 128)) == GroupShape(1, 128) and GroupShape(1, 128).is_per_group()
    assert QuantFP8(False, [1, 256]).group_shape == GroupShape(1, 256)
    with pytest.raises(ValueError, match=r"GroupShape: col must be -1 \(whole extent\) or a positive int, got 0"):
        GroupShape(1, 0)
    with pytest.raises(ValueError, match=r"quant_fp8: group_shape: GroupShape: unknown name 'per_channel'"):
        QuantFP8(False, "per_channel")
    with pytest.raises(ValueError, match=r"quant_fp8: group_shape \(1, 64\) is not supported; expected per_tensor"):
        QuantFP8(False, (1, 64))
    with pytest.raises(ValueError, match=r"quant_fp8: group_shape \(-1, 1\) is not supported"):
        QuantFP8(True, (-1, 1))
    with pytest.raises(ValueError, match=r"quant_fp8: group_shape: GroupShape: expected 'per_tensor'"):
        QuantFP8(False, 128)
    with pytest.raises(TypeError, match=r"quant_fp8: static must be a bool, got 'yes'"):
        QuantFP8("yes", "per_token")
    assert repr(QuantFP8(True, (1, 128))) == "QuantFP8(static=True, group_shape=(1, 128))"


# ------------------------------------------------------------------- GPU targets without e4m3


@pytest.mark.parametrize("target, reason", [("sm80", "sm80 has no float8 e4m3 conversion")])
def test_triton_declines_gpus_without_e4m3fn(triton_quant, target, reason):
    """Built for an A100 (no e4m3 in hardware; Triton refuses tl.float8e4nv, see
    test_real_compilers), the CUDA path declines with the reason before any launch, and dispatch
    falls back to forward_native and reports why."""
    from dualop.kernels.cuda import GPU_TARGETS, compile_target

    op = QuantFP8(False, "per_token")
    x = _spread((5, 256), seed=4)
    with compile_target(GPU_TARGETS[target]):
        with pytest.raises(NotImplementedError, match=reason):
            op.forward_cuda(x)
        with override_platform("cuda"), set_config(OpsConfig(["all"])):
            x_q, scale = op(x)
            row = next(r for r in dispatch_report() if r["op"] == "quant_fp8" and r["platform"] == "cuda")
    want_q, want_s = op.forward_native(x)
    assert _same_bits(x_q, want_q) and _same_bits(scale, want_s)
    assert row["method"] == "forward_native" and re.search(reason, row["reason"]), row


def test_triton_runs_for_sm90(triton_quant):
    """sm_90 has e4m3: no decline (here the kernel runs in Triton's interpreter)."""
    from dualop.kernels.cuda import GPU_TARGETS, compile_target

    op = QuantFP8(False, "per_token")
    x = _spread((5, 256), seed=4)
    with compile_target(GPU_TARGETS["sm90"]):
        got = op.forward_cuda(x)
    for g, w in zip(got, op.forward_native(x)):
        assert _same_bits(g, w)


# ------------------------------------------------------------------- ROCm: float8_e4m3fnuz


def _fnuz_reference(x, s):
    """x_q in fnuz as specified, with torch's own float32 -> float8_e4m3fnuz cast."""
    return (x.float() * (1.0 / s)).clamp(-224.0, 224.0).to(torch.float8_e4m3fnuz)


def test_fp8_format_follows_the_platform_and_target():
    """fnuz (max 224) on ROCm gfx94x and on ROCm with no known target (the interpreter, jax);
    e4m3fn (max 448) on CUDA, CPU, TPU and gfx950. Built inside compile_target for each GPU."""
    import jax.numpy as jnp
    from dualop.kernels.cuda import GPU_TARGETS, compile_target

    x, jx = torch.zeros(2, 128), jnp.zeros((2, 128))
    assert (E4M3FNUZ.max, E4M3FNUZ.min_scale) == (224.0, 1.0 / (224.0 * 512.0))
    for platform, want in (("cpu", E4M3FN), ("cuda", E4M3FN), ("tpu", E4M3FN), ("rocm", E4M3FNUZ)):
        with override_platform(platform):
            assert fp8_format(x) == want and fp8_format(jx) == want, platform
    for target, platform, want in (("gfx942", "rocm", E4M3FNUZ), ("gfx950", "rocm", E4M3FN),
                                   ("sm90", "cuda", E4M3FN)):
        with override_platform(platform), compile_target(GPU_TARGETS[target]):
            assert fp8_format(x) == want, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_shape", list(GRANULARITIES), ids=str)
def test_native_fnuz_semantics_on_rocm(group_shape, dtype):
    """On ROCm the torch native body gives fnuz: scale = max(amax / 224, 1/(224*512)) (float64
    quotient rounded once) and torch's own fnuz cast of x * (1/scale) clipped to +-224."""
    gran = GRANULARITIES[group_shape]
    x = _spread((9, 384)).to(dtype)
    with override_platform("rocm"):
        x_q, scale = QuantFP8(False, group_shape).forward_native(x)
    xf = x.float()
    amax = {"tensor": lambda: xf.abs().max().reshape(1), "token": lambda: xf.abs().amax(-1, keepdim=True),
            "group": lambda: xf.unflatten(-1, (-1, 128)).abs().amax(-1)}[gran]()
    assert x_q.dtype == torch.float8_e4m3fnuz
    assert torch.equal(scale, (amax.double() / 224.0).float().clamp(min=1.0 / (224.0 * 512.0)))
    assert torch.equal(_bits(x_q), _bits(_fnuz_reference(x, _broadcast(scale, x, gran))))
    assert x_q.float().abs().max().item() == 224.0  # the engine's max, not fnuz's 240


@pytest.mark.parametrize("group_shape", list(GRANULARITIES), ids=str)
def test_jax_native_fnuz_matches_ml_dtypes(group_shape):
    """jax's native body on ROCm equals ml_dtypes' float8_e4m3fnuz cast in numpy (and the torch
    body, bit for bit)."""
    import jax.numpy as jnp
    import ml_dtypes

    gran = GRANULARITIES[group_shape]
    x = _spread((7, 256))
    with override_platform("rocm"):
        jq, js = QuantFP8(False, group_shape).forward_native(jnp.asarray(x.numpy()))
        tq, ts = QuantFP8(False, group_shape).forward_native(x)
    assert jq.dtype == jnp.float8_e4m3fnuz and np.array_equal(np.asarray(js), ts.numpy())
    s = _broadcast(ts, x, gran).numpy()
    want = np.clip(x.numpy() * (np.float32(1.0) / s), -224.0, 224.0).astype(ml_dtypes.float8_e4m3fnuz)
    assert np.array_equal(np.asarray(jq).view(np.uint8), want.view(np.uint8))
    assert np.array_equal(np.asarray(jq).view(np.uint8), _bits(tq).numpy())


def test_round_to_fnuz_grid_and_div_by_224():
    """The XLA-side pre-rounding onto the fnuz grid (subnormal step 2**-10) equals torch's fnuz
    cast for every fnuz value, tie and near-tie, in both namespaces (fnuz has no -0: torch drops
    its sign); amax / 224 is the correctly rounded quotient."""
    import jax.numpy as jnp
    from dualop.backends.torch import array_api as torch_xp
    from dualop.backends.xla import array_api as jax_xp

    v = _fp8_edge_values(torch.float8_e4m3fnuz).clamp(-224.0, 224.0)
    want = _bits(v.to(torch.float8_e4m3fnuz))
    assert int(want[-1]) == 0  # -0.0 -> 0x00
    got = quant_mod._round_to_fp8_grid(torch_xp, v, E4M3FNUZ).to(torch.float8_e4m3fnuz)
    assert torch.equal(_bits(got), want)
    got = np.asarray(quant_mod._round_to_fp8_grid(jax_xp, jnp.asarray(v.numpy()), E4M3FNUZ).astype(jnp.float8_e4m3fnuz))
    assert np.array_equal(got.view(np.uint8), want.numpy())
    a = torch.cat([torch.rand(100000, generator=torch.Generator().manual_seed(8)) * 300, torch.tensor([0.0, 224.0, 1e30])])
    want_q = (a.double() / 224.0).float()
    assert torch.equal(quant_mod._div_by_fp8_max(torch_xp, a, 224.0), want_q)
    assert np.array_equal(np.asarray(quant_mod._div_by_fp8_max(jax_xp, jnp.asarray(a.numpy()), 224.0)), want_q.numpy())


def test_triton_fnuz_cast_rounds_to_nearest_even(triton_quant):
    """The interpreted kernel writes torch's fnuz bytes for every fnuz value, tie, near-tie, -0.0
    (0x00) and NaN (0x80); values beyond 224 clip to 224."""
    v = torch.cat([_fp8_edge_values(torch.float8_e4m3fnuz), torch.tensor([float("nan"), 239.0, -300.0])])
    x = torch.cat([v, torch.zeros(-v.numel() % 64)]).reshape(-1, 64)
    q, _ = triton_quant.quant_fp8(x, torch.ones(1), granularity="tensor", fp8_dtype="float8_e4m3fnuz", fp8_max=224.0)
    assert q.dtype == torch.float8_e4m3fnuz
    assert torch.equal(_bits(q), _bits(x.clamp(-224.0, 224.0).to(torch.float8_e4m3fnuz)))


@pytest.mark.parametrize("label, gran, static, with_ub", KERNEL_MODES, ids=[m[0] for m in KERNEL_MODES])
def test_triton_fnuz_matches_native_on_rocm(triton_quant, label, gran, static, with_ub):
    """On the rocm platform the op dispatches to the Triton kernel (interpreted here), which gives
    the native body's fnuz bits and scales, single-pass and chunked."""
    shape = (2, 3, 384) if gran == "group" else (2, 3, 200)
    x = _spread(shape, seed=6)
    scale, ub = _kernel_args(gran, static, with_ub, x, shape)
    op = _op_for(gran, static)
    with override_platform("rocm"), set_config(OpsConfig(["all"])):
        got_q, got_s = op(x, scale, ub)
        row = next(r for r in dispatch_report() if r["op"] == "quant_fp8" and r["platform"] == "rocm")
        want_q, want_s = op.forward_native(x, scale, ub)
        chunked = triton_quant.quant_fp8(x, scale, ub, granularity=gran, group_size=128 if gran == "group" else 0,
                                         fp8_dtype="float8_e4m3fnuz", fp8_max=224.0, max_single_pass=64, chunk=32)
    assert row["method"] in ("forward_hip", "forward_cuda"), row
    assert want_q.dtype == got_q.dtype == torch.float8_e4m3fnuz
    for q, s in ((got_q, got_s), chunked):
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s), label


def test_triton_runs_fnuz_for_gfx942(triton_quant):
    """Built for an MI300 (gfx942) the ROCm path no longer declines: it writes fnuz (here in
    Triton's interpreter), equal to the native body on that target."""
    from dualop.kernels.cuda import GPU_TARGETS, compile_target

    op = QuantFP8(False, "per_token")
    x = _spread((5, 256), seed=4)
    with override_platform("rocm"), compile_target(GPU_TARGETS["gfx942"]):
        got = op.forward_cuda(x)
        want = op.forward_native(x)
    assert got[0].dtype == torch.float8_e4m3fnuz
    for g, w in zip(got, want):
        assert _same_bits(g, w)
