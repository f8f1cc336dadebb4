"""RMSNormGated (``rms_norm_gated``): every (frontend, platform) cell against forward_native, the
kernels on their own (several row blocks with a ragged last one, the Triton two-pass loop), the
native body against a float64 numpy statement of the formula and against Hugging Face
transformers' gated RMS norms, bad input, and jit / vmap / grad of the Pallas path in JAX."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch

from dualop import OpsConfig, check, dispatch_report, override_platform, set_config, testing
from dualop.ops import RMSNormGated
from dualop.ops import gated_norm as gated_norm_mod

CASES = list(testing.cases_for(["rms_norm_gated"]))


def _data(shape, seed, scale=2.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _np_reference(x, weight, z=None, *, eps=1e-5, group_size=None, norm_before_gate=False):
    """The formula in float64 numpy, written independently of the code under test."""
    x = np.asarray(x, np.float64)
    w = np.asarray(weight, np.float64)
    gate = None
    if z is not None:
        zz = np.asarray(z, np.float64)
        gate = zz / (1.0 + np.exp(-zz))
        if not norm_before_gate:
            x = x * gate
    hidden = x.shape[-1]
    g = hidden if group_size is None else group_size
    grouped = x.reshape(*x.shape[:-1], hidden // g, g)
    y = grouped / np.sqrt(np.mean(grouped**2, axis=-1, keepdims=True) + eps)
    y = y.reshape(x.shape) * w
    if gate is not None and norm_before_gate:
        y = y * gate
    return y


def _close(got, want, dtype):
    cmp = testing.compare(np.asarray(got, np.float32), np.asarray(want, np.float32), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel, cmp.detail)


def _bf16_round(a):
    """float32 numpy values rounded to bfloat16 (nearest even), kept as float32."""
    import ml_dtypes

    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


# ------------------------------------------------------------------------------------- cells


def test_cases_cover_every_variant_and_ragged_shapes():
    labels = {c.label for c in CASES}
    assert labels == {"rms_norm_gated", "rms_norm_gated[z]", "rms_norm_gated[z,norm_before_gate]", "rms_norm_gated[z,group]"}
    for case in CASES:
        shapes = case.shapes
        assert any(s[0] == 0 for s in shapes), case.label
        assert any(len(s) == 2 and s[0] == 1 for s in shapes), case.label
        assert any(s[-1] % 128 for s in shapes), case.label
        assert any(len(s) == 3 for s in shapes), case.label
    grouped = next(c for c in CASES if c.label == "rms_norm_gated[z,group]")
    groups = {grouped.make_op(s).group_size for s in grouped.shapes}
    assert any(g % 128 == 0 for g in groups) and any(g % 128 for g in groups), groups
    for s in grouped.shapes:
        op = grouped.make_op(s)
        assert op.group_size < s[-1] and s[-1] % op.group_size == 0


def test_harness_catches_a_misplaced_gate(monkeypatch):
    """A fast path that gates on the wrong side of the norm fails its cell."""

    def wrong(self, x, weight, z=None):
        flipped = RMSNormGated(self.hidden_size, self.eps, self.group_size, not self.norm_before_gate)
        return flipped.forward_native(x, weight, z)

    monkeypatch.setattr(RMSNormGated, "forward_cpu", wrong)
    case = next(c for c in CASES if c.label == "rms_norm_gated[z]")
    assert check._run_cell(case, "torch", "cpu", "float32", seed=0).status == "fail"


# ------------------------------------------------------------------- native vs independent code

jnp = jax.numpy

VARIANTS = [
    # group_size, gated, norm_before_gate
    (None, False, False),
    (None, True, False),
    (None, True, True),
    (40, True, False),
    (40, True, True),
    (40, False, False),
    (100, True, True),
]


@pytest.mark.parametrize("group_size, gated, norm_before_gate", VARIANTS)
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_native_matches_float64_formula(frontend, group_size, gated, norm_before_gate):
    shape = (2, 5, 200)
    x, w, z = _data(shape, 0, 3.0), 1.0 + 0.5 * _data(shape[-1:], 1, 1.0), (_data(shape, 2) if gated else None)
    op = RMSNormGated(200, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    want = _np_reference(x, w, z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    args = [testing.to_frontend(a, frontend, "float32") for a in (x, w, z)]
    _close(testing.to_numpy(op.forward_native(*args)), want, "float32")
    # bfloat16: inputs rounded to bfloat16, computed in float32, one rounding of the result
    args = [testing.to_frontend(a, frontend, "bfloat16") for a in (x, w, z)]
    got = op.forward_native(*args)
    assert str(got.dtype).removeprefix("torch.") == "bfloat16"
    rounded = [None if a is None else _bf16_round(a) for a in (x, w, z)]
    want16 = _np_reference(*rounded, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    _close(testing.to_numpy(got), want16, "bfloat16")


def test_variants_really_differ():
    """Gate placement and grouping change the result (so the tests above can tell them apart)."""
    x, w, z = _data((4, 200), 3), _data((200,), 4), _data((4, 200), 5)
    xt, wt, zt = (torch.from_numpy(a) for a in (x, w, z))
    outs = [
        RMSNormGated(200, group_size=g, norm_before_gate=n).forward_native(xt, wt, zt if gated else None)
        for g, gated, n in VARIANTS
    ]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert (outs[i] - outs[j]).abs().max().item() > 1e-2, (i, j)


def _transformers_module(name: str):
    """A transformers model module (transformers is in both test environments: a failing import
    is a broken install, and fails the test)."""
    import importlib

    return importlib.import_module(f"transformers.models.{name}")


@pytest.mark.parametrize("group_size", [40, 200])
def test_native_matches_transformers_mamba2_gated_norm(group_size):
    """Mamba-2's MambaRMSNormGated: x*silu(gate), group RMS norm, times weight (float32)."""
    mod = _transformers_module("mamba2.modeling_mamba2")
    ref = mod.MambaRMSNormGated(200, group_size=group_size, eps=1e-5)
    x, w, z = _data((3, 4, 200), 6, 3.0), _data((200,), 7), _data((3, 4, 200), 8)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        want = ref(torch.from_numpy(x), torch.from_numpy(z))
    op = RMSNormGated(200, eps=1e-5, group_size=group_size)
    for fe in ("torch", "jax"):
        got = op.forward_native(*(testing.to_frontend(a, fe, "float32") for a in (x, w, z)))
        _close(testing.to_numpy(got), want.numpy(), "float32")


def test_native_matches_transformers_qwen3_next_gated_norm():
    """Qwen3-Next's Qwen3NextRMSNormGated: RMS norm, times weight, times silu(gate) (float32)."""
    mod = _transformers_module("qwen3_next.modeling_qwen3_next")
    ref = mod.Qwen3NextRMSNormGated(136, eps=1e-6)
    x, w, z = _data((5, 136), 9, 3.0), _data((136,), 10), _data((5, 136), 11)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        want = ref(torch.from_numpy(x), torch.from_numpy(z))
    op = RMSNormGated(136, eps=1e-6, norm_before_gate=True)
    for fe in ("torch", "jax"):
        got = op.forward_native(*(testing.to_frontend(a, fe, "float32") for a in (x, w, z)))
        _close(testing.to_numpy(got), want.numpy(), "float32")


# ------------------------------------------------------------------------------ Pallas kernel


@pytest.fixture(scope="module")
def interpret():
    from dualop.kernels.pallas.common import interpret_mode

    return interpret_mode("jax")


# Ragged last blocks compile slowly in JAX 0.7's generic Pallas interpreter (about 8 s each here),
# so two layouts end in a ragged block and two run whole blocks.
PALLAS_BLOCKS = [
    # rows, hidden, group_size, gated, norm_before_gate, block_rows, dtype, weight dtype
    (37, 200, 40, True, False, 16, "bfloat16", "bfloat16"),  # unaligned groups (masked); ragged: 16+16+5
    (19, 384, 128, True, True, 8, "float32", "float32"),  # lane-aligned groups (slices); ragged: 8+8+3
    (24, 300, 100, False, False, 8, "float32", "float32"),  # unaligned groups, no gate; 3 whole blocks
    (32, 136, None, True, True, 16, "bfloat16", "float32"),  # one group off the lane grid, f32 weight; 2 blocks
]


@pytest.mark.parametrize("rows, hidden, group_size, gated, norm_before_gate, block_rows, dtype, wdtype", PALLAS_BLOCKS)
def test_pallas_several_row_blocks(interpret, rows, hidden, group_size, gated, norm_before_gate, block_rows, dtype, wdtype):
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated, rms_norm_gated_reference

    assert rows > block_rows  # several blocks
    x = jnp.asarray(_data((rows, hidden), 20, 3.0)).astype(dtype)
    w = jnp.asarray(1.0 + 0.5 * _data((hidden,), 21, 1.0)).astype(wdtype)  # may differ from x's
    z = jnp.asarray(_data((rows, hidden), 22)).astype(dtype) if gated else None
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    got = rms_norm_gated(x, w, z, interpret=interpret, block_rows=block_rows, **kw)
    assert got.dtype == x.dtype and got.shape == x.shape
    _close(got, rms_norm_gated_reference(x, w, z, **kw), dtype)
    f32 = [None if a is None else np.asarray(a, np.float32) for a in (x, w, z)]
    _close(got, _np_reference(*f32, **kw), dtype)


@pytest.mark.parametrize("group_size", [40, 128, None])
def test_pallas_non_finite_values_stay_in_their_group(interpret, group_size):
    """An inf or NaN reaches only its own group, as in the float64 formula: the membership matmul
    of unaligned groups (40) must not carry inf * 0 = NaN into the other groups."""
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated

    x = _data((3, 640), 23, 3.0)
    x[0, 45], x[1, 170], x[2, 45], x[2, 300] = np.inf, np.nan, -np.inf, np.nan
    w = 1.0 + 0.5 * _data((640,), 24, 1.0)
    got = rms_norm_gated(jnp.asarray(x), jnp.asarray(w), eps=1e-5, group_size=group_size, interpret=interpret)
    with np.errstate(invalid="ignore", over="ignore"):
        want = _np_reference(x, w, None, eps=1e-5, group_size=group_size, norm_before_gate=False)
    got = np.asarray(got, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).sum() < want.size  # finite groups stayed finite
    _close(np.where(np.isnan(got), 0.0, got), np.where(np.isnan(want), 0.0, want), "float32")


def test_pallas_cost_estimate_counts_bytes_once():
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated_cost

    c = rms_norm_gated_cost(rows=10, hidden=384, group_size=128, itemsize=2, weight_itemsize=4, has_z=True)
    assert c.bytes_accessed == 10 * 384 * 2 * 3 + 384 * 4
    assert c.transcendentals == 10 * 3 + 10 * 384
    c = rms_norm_gated_cost(rows=10, hidden=384, group_size=384, itemsize=4, weight_itemsize=4, has_z=False)
    assert c.bytes_accessed == 10 * 384 * 4 * 2 + 384 * 4 and c.transcendentals == 10


def test_pallas_kernel_rejects_a_group_that_does_not_divide(interpret):
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated

    with pytest.raises(ValueError, match="group_size=48 must divide the last dim 200"):
        rms_norm_gated(jnp.zeros((2, 200)), jnp.ones(200), group_size=48, interpret=interpret)


# ------------------------------------------------------------------------- JAX: jit, vmap, grad


@pytest.fixture
def on_tpu():
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        yield


def _assert_ran_tpu_kernel():
    methods = {r["method"] for r in dispatch_report() if r["op"] == "rms_norm_gated"}
    assert methods == {"forward_tpu"}, dispatch_report()


def test_jax_jit_and_vmap_take_the_pallas_path(on_tpu):
    op = RMSNormGated(200, group_size=40)
    x, z = jnp.asarray(_data((3, 10, 200), 30, 3.0)), jnp.asarray(_data((3, 10, 200), 31))
    w = jnp.asarray(_data((200,), 32))
    # a shared weight: the batch folds into rows
    got = jax.jit(jax.vmap(lambda a, b: op(a, w, b)))(x, z)
    _close(got, op.forward_native(x, w, z), "float32")
    # a batched weight cannot be folded: mapped instead
    ws = jnp.asarray(_data((3, 200), 33))
    got = jax.vmap(op)(x, ws, z)
    _close(got, jax.vmap(op.forward_native)(x, ws, z), "float32")
    _assert_ran_tpu_kernel()


def test_jax_grad_through_the_pallas_path(on_tpu):
    """Grad of x, weight and z: the kernel runs forward, the native body's VJP backward."""
    op = RMSNormGated(136, group_size=68, norm_before_gate=True)
    x, z = jnp.asarray(_data((6, 136), 34, 3.0)), jnp.asarray(_data((6, 136), 35))
    w = jnp.asarray(1.0 + 0.5 * _data((136,), 36, 1.0))
    probe = jnp.asarray(_data((6, 136), 37))

    def loss(fn):
        return lambda a, b, c: jnp.sum(fn(a, b, c) * probe)

    got = jax.grad(loss(op), argnums=(0, 1, 2))(x, w, z)
    want = jax.grad(loss(op.forward_native), argnums=(0, 1, 2))(x, w, z)
    for g, ww in zip(got, want, strict=True):
        assert g.shape == ww.shape
        _close(g, ww, "float32")
    _assert_ran_tpu_kernel()


# ------------------------------------------------------------------------------ Triton kernel


@pytest.fixture(scope="module")
def triton_mod():
    why = testing.prepare_triton()
    if why is not None:
        pytest.skip(f"triton is not installed in this environment: {why}")
    from dualop.kernels.cuda import rms_norm_gated

    return rms_norm_gated


@pytest.mark.parametrize(
    "group_size, norm_before_gate, dtype", [(200, False, "float32"), (40, True, "bfloat16"), (100, False, "bfloat16")]
)
def test_triton_two_pass_path(triton_mod, monkeypatch, group_size, norm_before_gate, dtype):
    """Groups wider than MAX_SINGLE_PASS loop over chunks (shrunk here to keep shapes small)."""
    monkeypatch.setattr(triton_mod, "MAX_SINGLE_PASS", 32)
    monkeypatch.setattr(triton_mod, "CHUNK", 16)
    tdtype = getattr(torch, dtype)
    x = torch.from_numpy(_data((5, 200), 40, 3.0)).to(tdtype)
    z = torch.from_numpy(_data((5, 200), 41)).to(tdtype)
    w = torch.from_numpy(_data((200,), 42)).to(tdtype)
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    got = triton_mod.rms_norm_gated(x, w, z, **kw)
    _close(got.float(), RMSNormGated(200, **kw).forward_native(x, w, z).float(), dtype)
    got = triton_mod.rms_norm_gated(x, w, None, **kw)
    _close(got.float(), RMSNormGated(200, **kw).forward_native(x, w).float(), dtype)


def test_triton_non_contiguous_inputs(triton_mod):
    x = torch.from_numpy(_data((200, 7), 43, 3.0)).t()  # (7, 200) with a non-unit last stride
    z = torch.from_numpy(_data((200, 7), 44)).t()
    w = torch.from_numpy(_data((400,), 45))[::2]  # a strided weight
    op = RMSNormGated(200, group_size=40)
    _close(triton_mod.rms_norm_gated(x, w, z, group_size=40), op.forward_native(x, w, z), "float32")


def test_triton_bf16_rounds_like_torch(triton_mod):
    """The interpreter truncates float32 -> bfloat16; the kernel rounds to nearest even."""
    x = torch.from_numpy(_data((16, 256), 46, 3.0)).to(torch.bfloat16)
    z = torch.from_numpy(_data((16, 256), 47)).to(torch.bfloat16)
    w = torch.from_numpy(_data((256,), 48)).to(torch.bfloat16)
    op = RMSNormGated(256, group_size=128)
    got = triton_mod.rms_norm_gated(x, w, z, group_size=128)
    want = op.forward_native(x, w, z)
    assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_torch_paths_take_a_float32_weight_with_bfloat16_rows(triton_mod, platform):
    op = RMSNormGated(200, group_size=40, norm_before_gate=True)
    x = torch.from_numpy(_data((3, 200), 49, 3.0)).to(torch.bfloat16)
    z = torch.from_numpy(_data((3, 200), 50)).to(torch.bfloat16)
    w = torch.from_numpy(_data((200,), 51))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = op(x, w, z)
    assert {r["method"] for r in dispatch_report()} == {f"forward_{platform}"}
    assert got.dtype == torch.bfloat16
    _close(got.float(), op.forward_native(x, w, z).float(), "bfloat16")


# -------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_kernel_may_launch(monkeypatch):
    """Kernel references raise if resolved: validation must stop bad input first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (gated_norm_mod._PALLAS_RMS_NORM_GATED, gated_norm_mod._TRITON_RMS_NORM_GATED):
        monkeypatch.setattr(ref, "resolve", forbidden)
    with set_config(OpsConfig(["all"])):
        yield


def _t(*shape, dtype="float32"):
    return torch.zeros(shape, dtype=getattr(torch, dtype))


def _j(*shape, dtype="float32"):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])
def test_bad_inputs_name_op_and_argument(no_kernel_may_launch, platform, make):
    op = RMSNormGated(64, group_size=16)
    x, w = make(4, 64), make(64)
    with override_platform(platform):
        with pytest.raises(ValueError, match=r"rms_norm_gated: argument 'x' has last dim 32; expected hidden_size=64"):
            op(make(4, 32), w)
        with pytest.raises(ValueError, match=r"rms_norm_gated: argument 'x' must have at least 1 dimension"):
            op(make(), w)
        with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'weight' is required; expected an array of shape \(64,\)"):
            op(x)
        with pytest.raises(ValueError, match=r"rms_norm_gated: argument 'weight' has shape \(32,\); expected \(64,\)"):
            op(x, make(32))
        with pytest.raises(ValueError, match=r"rms_norm_gated: argument 'weight' has shape \(1, 64\); expected \(64,\)"):
            op(x, make(1, 64))
        with pytest.raises(ValueError, match=r"rms_norm_gated: argument 'z' has shape \(3, 64\); expected \(4, 64\)"):
            op(x, w, make(3, 64))
        with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'z' has dtype bfloat16; expected float32 \(the dtype of 'x'\)"):
            op(x, w, make(4, 64, dtype="bfloat16"))
        with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'x' has dtype int32; expected one of bfloat16, float16, float32"):
            op(make(4, 64, dtype="int32"), w)
        with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'weight' has dtype int32"):
            op(x, make(64, dtype="int32"))


def test_mixed_frontends_and_non_arrays_are_rejected(no_kernel_may_launch):
    op = RMSNormGated(64)
    with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'weight' is a jax array but 'x' is a torch array"):
        op(_t(4, 64), _j(64))
    with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'z' is a torch array but 'x' is a jax array"):
        op(_j(4, 64), _j(64), _t(4, 64))
    with pytest.raises(TypeError, match=r"rms_norm_gated: argument 'weight' must be None, a torch.Tensor or a jax.Array, got numpy.ndarray"):
        op(_t(4, 64), np.ones(64, np.float32))


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match=r"rms_norm_gated: group_size=48 must divide hidden_size=200"):
        RMSNormGated(200, group_size=48)
    with pytest.raises(ValueError, match=r"rms_norm_gated: group_size must be None or a positive int, got 0"):
        RMSNormGated(200, group_size=0)
    with pytest.raises(ValueError, match=r"rms_norm_gated: group_size must be None or a positive int, got 40.0"):
        RMSNormGated(200, group_size=40.0)
    with pytest.raises(ValueError, match=r"rms_norm_gated: hidden_size must be a positive int, got True"):
        RMSNormGated(True)
    with pytest.raises(ValueError, match=r"rms_norm_gated: hidden_size must be a positive int, got 0"):
        RMSNormGated(0)
    with pytest.raises(ValueError, match=r"rms_norm_gated: eps must be a non-negative float, got -1.0"):
        RMSNormGated(64, eps=-1.0)
    with pytest.raises(TypeError, match=r"rms_norm_gated: norm_before_gate must be a bool, got 'yes'"):
        RMSNormGated(64, norm_before_gate="yes")
    op = RMSNormGated(200, 1e-6, 40, True, enforce_enable=True)
    assert (op.hidden_size, op.eps, op.group_size, op.norm_before_gate, op.enforce_enable) == (200, 1e-6, 40, True, True)
    assert "group_size=40" in repr(op) and RMSNormGated.name == "rms_norm_gated"


def _count_equations(jaxpr) -> int:
    """Equations of a jaxpr and of every jaxpr nested in its equations (the Pallas kernel body
    included), so the count reflects the whole program a compiler gets."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr holds its Jaxpr
    total = 0
    for eqn in inner.eqns:
        total += 1
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(getattr(v, "jaxpr", v), "eqns"):
                    total += _count_equations(v)
    return total


# Whole program (wrapper and kernel body) of the Pallas path, whatever the number of groups. At
# group 40 the masked loop this replaced made 2003 equations at hidden 40000.
MAX_EQUATIONS = 150


@pytest.mark.parametrize("group", [40, 100, 128])
def test_pallas_program_size_does_not_grow_with_groups(interpret, group):
    """Groups off the lane grid are summed by a membership matmul and lane-aligned ones in blocks
    of at most 16: the traced program is as large at 1000 groups as at 100 (a ragged last column
    block at both, so both mask), and within the bound at any count."""
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated

    sizes = []
    for n_groups in (5, 100, 1000):
        hidden = group * n_groups
        x = jax.ShapeDtypeStruct((8, hidden), jnp.float32)
        w = jax.ShapeDtypeStruct((hidden,), jnp.float32)
        fn = lambda a, b, c: rms_norm_gated(a, b, c, group_size=group, interpret=interpret)  # noqa: E731
        sizes.append(_count_equations(jax.make_jaxpr(fn)(x, w, x)))
    assert sizes[1] == sizes[2] and max(sizes) <= MAX_EQUATIONS, sizes


def test_pallas_column_blocks_hold_whole_aligned_groups():
    from dualop.kernels.pallas.rms_norm_gated import column_block

    for hidden, group in ((200, 40), (40000, 40), (53248, 416), (53248, 128), (8192, 1024), (300, 100), (4096, 4096)):
        bc = column_block(hidden, group)
        assert bc % group == 0 and (bc == hidden or bc % 128 == 0), (hidden, group, bc)
        assert bc // group <= 128, (hidden, group, bc)
