"""The pointwise activation family (gelu, gelu_tanh, gelu_new, gelu_fast, quick_gelu, relu2, xielu): every cell's real
kernel against forward_native, forward_native against Hugging Face transformers and jax.nn, the
shared Pallas and Triton kernels directly (several blocks, ragged edges), special values, bad
input, and jit / vmap / grad through the Pallas path."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import torch

from conftest import KERNEL_CELLS, NATIVE_CASES, require_frontend
from dualop import OpsConfig, check, dispatch_report, override_platform, set_config, testing
from dualop.ops import GELU, XIELU, FastGELU, GELUTanh, NewGELU, QuickGELU, ReLUSquaredActivation
from dualop.ops import pointwise as pointwise_mod

OPS = ("gelu", "gelu_tanh", "gelu_new", "gelu_fast", "quick_gelu", "relu2", "xielu")
SIMPLE = {"gelu": GELU, "gelu_tanh": GELUTanh, "gelu_new": NewGELU, "gelu_fast": FastGELU, "quick_gelu": QuickGELU,
          "relu2": ReLUSquaredActivation}
CASES = list(testing.cases_for(list(OPS)))
ALPHAS = pointwise_mod._XIELU_CASE_ALPHAS


def _close(got, want, dtype="float32"):
    cmp = testing.compare(np.asarray(got, np.float32), np.asarray(want, np.float32), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel, cmp.detail)


def _op(name):
    return XIELU() if name == "xielu" else SIMPLE[name]()


# --------------------------------------------------------------------------- every cell


def test_cases_cover_every_op_and_the_awkward_shapes():
    assert sorted({c.op for c in CASES}) == sorted(OPS)
    for case in CASES:
        sizes = [math.prod(s) for s in case.shapes]
        assert 0 in sizes and 1 in sizes, case.label
        assert any(len(s) == 1 for s in case.shapes), case.label
        assert any(len(s) == 3 for s in case.shapes), case.label
        assert any(s[-1] % 128 and n % 128 for s, n in zip(case.shapes, sizes)), case.label  # not lane-dense
        assert any(n and n % 128 == 0 for n in sizes), case.label  # lane-dense
    x = pointwise_mod._spread((4000,), np.random.default_rng(0))
    mags = np.abs(x[x != 0])
    assert mags.min() < 1e-2 and mags.max() > 1e2 and (x > 0).any() and (x < 0).any() and (x == 0).any()


def test_xielu_case_exercises_both_branches():
    case = next(c for c in CASES if c.op == "xielu")
    x, a_p, a_n = case.make_inputs((7, 200), np.random.default_rng(0))
    assert (x > 0).any() and (x <= 0).any()
    assert a_p.dtype == a_n.dtype == "float32" and a_p.array.shape == a_n.array.shape == (1,)


# A case of special values: every fast path must give exactly what forward_native gives (NaN
# where it has NaN, the same infinities).
_SPECIALS = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.5, -1.5, 1e30, -1e30, 3e-3], np.float32)


def _special_case(name):
    def make(shape, rng):
        x = np.resize(_SPECIALS, shape)
        if name == "xielu":
            return (x, *(testing.Pinned(np.array([a], np.float32), "float32") for a in ALPHAS))
        return (x,)

    return testing.OpCase(name, f"{name}[special]", lambda s: _op(name), make, ((2, 10),))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy (Triton's interpreter, compare) on inf - inf
@pytest.mark.parametrize("name, frontend, platform, method", [
    pytest.param(name, frontend, platform, method, id=f"{name}-{frontend}-{platform}")
    for name in OPS for frontend, platform, method in KERNEL_CELLS if (name, frontend, platform) not in NATIVE_CASES
])
def test_inf_and_nan_propagate_as_native(name, frontend, platform, method):
    require_frontend(frontend)
    result = check._run_cell(_special_case(name), frontend, platform, "float32", seed=0)
    assert result.method == method, result.detail
    assert result.status == "pass", f"{result.detail} (max abs {result.max_abs})"


def test_special_values_of_native():
    """What the native bodies give at the edges (the fast paths are held to these above)."""
    x = torch.tensor([np.inf, -np.inf, np.nan, 0.0, -1e30])
    assert torch.equal(NewGELU().forward_native(x)[[0, 3, 4]], torch.tensor([np.inf, 0.0, 0.0]))
    assert NewGELU().forward_native(x)[1:3].isnan().all()  # -inf * (1 + tanh(-inf)) = -inf * 0
    assert QuickGELU().forward_native(x)[1:3].isnan().all()
    r = ReLUSquaredActivation().forward_native(x)
    assert r[0] == np.inf and r[1] == 0 and r[2].isnan() and r[4] == 0
    a = torch.tensor([0.0])
    y = XIELU().forward_native(x, a, a)
    assert y[0] == np.inf and y[1:3].isnan().all() and -2e-6 < y[3] < 0 and y[4] > 0  # x=0: expm1(eps) * a_n


# --------------------------------------------------------------------------- independent references


def _hf():
    import transformers.activations

    return transformers.activations


def _hf_xielu(alpha_p, alpha_n, beta=0.5, eps=-1e-6):
    act = _hf().XIELUActivation(beta=beta, eps=eps, dtype=torch.float32)
    with torch.no_grad():
        act.alpha_p.fill_(alpha_p)
        act.alpha_n.fill_(alpha_n)
    return act


def _hf_reference(name, x_np):
    """Hugging Face's activation of float32 ``x_np``, as float32 numpy."""
    hf = _hf()
    act = {
        "gelu": hf.GELUActivation,
        "gelu_tanh": hf.GELUTanh,
        "gelu_new": hf.NewGELUActivation,
        "gelu_fast": hf.FastGELUActivation,
        "quick_gelu": hf.QuickGELUActivation,
        "relu2": hf.ReLUSquaredActivation,
    }.get(name)
    act = act() if act is not None else _hf_xielu(*ALPHAS)
    with torch.no_grad():
        return act(torch.from_numpy(x_np)).numpy()


@pytest.mark.parametrize("name", OPS)
def test_torch_native_matches_transformers(name):
    hf = _hf()
    x_np = pointwise_mod._spread((5, 333), np.random.default_rng(3))
    x = torch.from_numpy(x_np)
    args = (x, torch.tensor([ALPHAS[0]]), torch.tensor([ALPHAS[1]])) if name == "xielu" else (x,)
    _close(_op(name).forward_native(*args), _hf_reference(name, x_np))
    assert type(hf.ACT2FN[{"gelu_tanh": "gelu_pytorch_tanh"}.get(name, name)]).__name__ == {
        "gelu": "GELUActivation", "gelu_tanh": "GELUTanh", "gelu_new": "NewGELUActivation", "gelu_fast": "FastGELUActivation", "quick_gelu": "QuickGELUActivation",
        "relu2": "ReLUSquaredActivation", "xielu": "XIELUActivation",
    }[name]


@pytest.mark.reference
@pytest.mark.parametrize("name", OPS)
def test_jax_native_matches_transformers_and_jax_nn(name):
    jnp = jax.numpy
    x_np = pointwise_mod._spread((5, 333), np.random.default_rng(4))
    x = jnp.asarray(x_np)
    args = (x, jnp.array([ALPHAS[0]]), jnp.array([ALPHAS[1]])) if name == "xielu" else (x,)
    got = _op(name).forward_native(*args)
    _close(got, _hf_reference(name, x_np))
    jax_nn = {
        "gelu": lambda t: jax.nn.gelu(t, approximate=False),
        "gelu_tanh": lambda t: jax.nn.gelu(t, approximate=True),
        "gelu_new": lambda t: jax.nn.gelu(t, approximate=True),
        "gelu_fast": lambda t: jax.nn.gelu(t, approximate=True),  # 0.7978845608 is sqrt(2/pi) in float32
        "relu2": lambda t: jnp.square(jax.nn.relu(t)),
    }.get(name)
    if jax_nn is not None:
        _close(got, jax_nn(x))


def test_xielu_initial_parameters_match_transformers():
    for inits in ((0.8, 0.8, 0.5), (0.3, 1.7, 0.25), (2.0, 0.6, 0.5)):
        op = XIELU(*inits)
        a_p, a_n = op.initial_parameters()
        hf = _hf().XIELUActivation(*inits, dtype=torch.float32)
        assert a_p == pytest.approx(hf.alpha_p.item(), rel=1e-6)
        assert a_n == pytest.approx(hf.alpha_n.item(), rel=1e-6)
        # the point of the inverse: the slopes come back as the *_init values
        sp = lambda v: math.log1p(math.exp(v))  # noqa: E731
        assert sp(a_p) == pytest.approx(inits[0]) and inits[2] + sp(a_n) == pytest.approx(inits[1])
    with pytest.raises(ValueError, match=r"xielu: alpha_n_init - beta = -0.1 has no inverse softplus"):
        XIELU(alpha_n_init=0.4).initial_parameters()
    with pytest.raises(ValueError, match=r"xielu: alpha_p_init = 0 has no inverse softplus"):
        XIELU(alpha_p_init=0.0).initial_parameters()


# --------------------------------------------------------------------------- the Pallas kernel


jnp = jax.numpy


@pytest.fixture(scope="module")
def interpret():
    from dualop.kernels.pallas.common import interpret_mode

    return interpret_mode("jax")


def _pallas_args(name, x):
    return (x, jnp.array([ALPHAS[0]]), jnp.array([ALPHAS[1]])) if name == "xielu" else (x,)


def test_pallas_layout_is_lane_dense_when_it_can_be():
    from dualop.kernels.pallas.pointwise_activation import _lane_block, pointwise_layout

    f32, bf16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
    assert pointwise_layout((16, 256), f32) == (8, 512)  # widest lanes leaving 8 full sublanes
    assert pointwise_layout((16, 256), bf16) == (16, 256)  # bf16 packs 16 rows per vreg
    assert pointwise_layout((2, 3, 1024), f32) == (12, 512)
    assert pointwise_layout((1, 128), f32) == (1, 128)
    assert pointwise_layout((7, 200), f32) == (7, 200)  # off the grid: (rows, last dim)
    assert pointwise_layout((2, 3, 136), f32) == (6, 136)
    assert pointwise_layout((37,), f32) == (1, 37)
    assert pointwise_layout((), f32) == (1, 1)
    # a row too wide for one VMEM block is split into 128-lane multiples
    assert _lane_block(200, f32, 24) == 200
    wide = _lane_block(1_000_003, f32, 24)
    assert wide % 128 == 0 and wide * 24 * 8 <= 4 * 1024 * 1024


# The layout code is shared by every activation (the cells above run each activation through it);
# each layout here runs with one or two activations, every activation at least once.
@pytest.mark.parametrize(
    "name, shape, dtype, block_rows, block_cols",
    [
        ("gelu_new", (37, 128), "float32", 8, None),  # lane-dense (37, 128): 5 row blocks, the last of 5 rows
        ("quick_gelu", (3, 7, 128), "bfloat16", 16, None),  # 3-D, lane-dense (21, 128): 2 row blocks
        ("xielu", (19, 300), "float32", 8, 128),  # (19, 300): 3 x 3 blocks, ragged in rows and in lanes
        ("gelu_fast", (19, 300), "bfloat16", 16, 128),  # 2 x 3 blocks, ragged in rows and in lanes
        ("relu2", (5, 333), "float32", None, 256),  # one row block, 2 lane blocks, the last of 77 lanes
    ],
)
def test_pallas_several_blocks_with_ragged_edges(interpret, name, shape, dtype, block_rows, block_cols):
    from dualop.kernels.pallas.pointwise_activation import pointwise_activation, pointwise_activation_reference

    x = jnp.asarray(pointwise_mod._spread(shape, np.random.default_rng(5))).astype(dtype)
    args = _pallas_args(name, x)
    got = pointwise_activation(*args, activation=name, interpret=interpret, block_rows=block_rows, block_cols=block_cols)
    assert got.shape == x.shape and got.dtype == x.dtype
    _close(got, pointwise_activation_reference(*args, activation=name), dtype)
    _close(got, _op(name).forward_native(*args), dtype)


@pytest.mark.parametrize("name, shape", [("xielu", ()), ("gelu_new", (5,)), ("xielu", (0,)), ("relu2", (3, 0, 4))])
def test_pallas_tiny_and_empty_inputs(interpret, name, shape):
    from dualop.kernels.pallas import pointwise_activation as mod

    x = jnp.asarray(pointwise_mod._spread(shape, np.random.default_rng(6)))
    args = _pallas_args(name, x)
    got = mod.pointwise_activation(*args, activation=name, interpret=interpret)
    assert got.shape == shape
    _close(got, _op(name).forward_native(*args))


def test_pallas_empty_input_launches_nothing(interpret, monkeypatch):
    from dualop.kernels.pallas import pointwise_activation as mod

    def no_launch(*a, **k):
        raise AssertionError("pallas_call for an empty input")

    monkeypatch.setattr(mod.pl, "pallas_call", no_launch)
    mod._build.cache_clear()
    try:
        out = mod.pointwise_activation(jnp.zeros((0, 77), jnp.bfloat16), activation="relu2", interpret=interpret)
    finally:
        mod._build.cache_clear()
    assert out.shape == (0, 77) and out.dtype == jnp.bfloat16


def test_pallas_rejects_a_wrong_parameter_set(interpret):
    from dualop.kernels.pallas.pointwise_activation import pointwise_activation

    x = jnp.ones((8, 128))
    with pytest.raises(ValueError, match="'xielu' takes alpha_p and alpha_n"):
        pointwise_activation(x, activation="xielu", interpret=interpret)
    with pytest.raises(ValueError, match="'relu2' takes no parameters"):
        pointwise_activation(x, jnp.ones(1), jnp.ones(1), activation="relu2", interpret=interpret)
    with pytest.raises(ValueError, match="activation 'swish' is not one of"):
        pointwise_activation(x, activation="swish", interpret=interpret)


def test_pallas_cost_estimate():
    from dualop.kernels.pallas.pointwise_activation import pointwise_activation_cost

    c = pointwise_activation_cost(1000, 2, "gelu_new")
    assert c.bytes_accessed == 2 * 1000 * 2 and c.transcendentals == 1000 and c.flops > 0
    c = pointwise_activation_cost(1000, 4, "xielu")
    assert c.bytes_accessed == 2 * 1000 * 4 + 8 and c.transcendentals == 2000
    assert pointwise_activation_cost(1000, 4, "relu2").transcendentals == 0


def test_pallas_vmap_with_batched_alphas(interpret):
    """Per-example xIELU parameters cannot fold into rows: the batch is mapped (vmap with shared
    alphas, which folds, runs in test_jax_jit_vmap_grad_through_the_pallas_path)."""
    from dualop.kernels.pallas.pointwise_activation import pointwise_activation, pointwise_activation_reference

    x = jnp.asarray(pointwise_mod._spread((3, 10, 40), np.random.default_rng(7)))
    a_p = jnp.array([[0.4], [-1.0], [2.0]])
    a_n = jnp.array([[-0.3], [0.5], [1.0]])
    f = lambda t, p, n: pointwise_activation(t, p, n, activation="xielu", interpret=interpret)  # noqa: E731
    ref = lambda t, p, n: pointwise_activation_reference(t, p, n, activation="xielu")  # noqa: E731
    _close(jax.jit(jax.vmap(f))(x, a_p, a_n), jax.vmap(ref)(x, a_p, a_n))


# --------------------------------------------------------------------------- jax: jit, vmap, grad on tpu


def _xielu_grads_by_hand(x, a_p_raw, a_n_raw, eps=-1e-6):
    """d sum(xielu) / d alpha: softplus' = sigmoid, times the sum of each branch's slope factor."""
    x = np.asarray(x, np.float64)
    sig = lambda v: 1.0 / (1.0 + math.exp(-v))  # noqa: E731
    pos = x > 0
    g_p = sig(a_p_raw) * np.sum(np.where(pos, x * x, 0.0))
    g_n = sig(a_n_raw) * np.sum(np.where(pos, 0.0, np.expm1(np.minimum(x, eps)) - x))
    return g_p, g_n


@pytest.mark.parametrize("name", OPS)
def test_jax_jit_vmap_grad_through_the_pallas_path(name):
    """jit(value_and_grad(sum of vmap(op))): the kernel runs forward under vmap and jit, and the
    backward pass (the VJP of forward_native) reaches x and xIELU's alphas."""
    x = jnp.asarray(pointwise_mod._spread((3, 6, 50), np.random.default_rng(8)) / 100)
    op = _op(name)
    extra = (jnp.array([ALPHAS[0]]), jnp.array([ALPHAS[1]])) if name == "xielu" else ()
    argnums = tuple(range(1 + len(extra)))

    def loss(fn):
        def f(t, *e):
            y = jax.vmap(fn, in_axes=(0, *(None for _ in e)))(t, *e)
            return jnp.sum(y), y

        return jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))

    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        (_, y), grads = loss(op)(x, *extra)
    assert {(r["op"], r["method"]) for r in dispatch_report() if r["frontend"] == "jax"} == {(name, "forward_tpu")}
    (_, want), want_grads = loss(op.forward_native)(x, *extra)
    _close(y, want)
    for g, w in zip(grads, want_grads, strict=True):
        _close(g, w)
    if name == "relu2":
        _close(grads[0], 2 * jnp.maximum(x, 0))
    if name == "xielu":
        g_p, g_n = _xielu_grads_by_hand(x, *ALPHAS)
        assert grads[1].shape == grads[2].shape == (1,)
        assert float(grads[1][0]) == pytest.approx(g_p, rel=1e-4)
        assert float(grads[2][0]) == pytest.approx(g_n, rel=1e-4)


def test_jax_grad_wrt_xielu_alphas_under_jit_and_vmap():
    """Per-example parameters: vmap over (x, alpha_p, alpha_n) with grad inside, all jitted."""
    op = XIELU()
    x = jnp.asarray(pointwise_mod._spread((2, 40), np.random.default_rng(9)) / 50)
    a_p = jnp.array([[0.4], [-0.7]])
    a_n = jnp.array([[-0.3], [1.1]])
    loss = lambda t, p, n: jnp.sum(op(t, p, n))  # noqa: E731
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        g = jax.jit(jax.vmap(jax.grad(loss, argnums=(1, 2))))(x, a_p, a_n)
    for i in range(2):
        g_p, g_n = _xielu_grads_by_hand(x[i], float(a_p[i, 0]), float(a_n[i, 0]))
        assert float(g[0][i, 0]) == pytest.approx(g_p, rel=1e-4)
        assert float(g[1][i, 0]) == pytest.approx(g_n, rel=1e-4)


def test_xielu_alphas_in_x_dtype_and_custom_constants_on_tpu():
    x = jnp.asarray(pointwise_mod._spread((4, 130), np.random.default_rng(10))).astype(jnp.bfloat16)
    a_p, a_n = (jnp.array([a], jnp.bfloat16) for a in ALPHAS)
    op = XIELU(beta=0.25, eps=-1e-2)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        got = op(x, a_p, a_n)
    assert got.dtype == jnp.bfloat16
    _close(got, op.forward_native(x, a_p, a_n), "bfloat16")


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def no_kernel_may_launch(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (pointwise_mod._PALLAS_POINTWISE, pointwise_mod._TRITON_POINTWISE):
        monkeypatch.setattr(ref, "resolve", forbidden)
    with set_config(OpsConfig(["all"])):
        yield


def _t(*shape, dtype=None):
    return torch.zeros(shape, dtype=dtype or torch.float32)


def _j(*shape, dtype="float32"):
    return jnp.zeros(shape, dtype)


@pytest.mark.usefixtures("no_kernel_may_launch")
@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])
@pytest.mark.parametrize("name", OPS)
def test_bad_x_is_rejected_before_any_kernel(name, make, platform):
    op = _op(name)
    extra = (make(1), make(1)) if name == "xielu" else ()
    int_dtype = torch.int32 if make is _t else "int32"
    with override_platform(platform):
        with pytest.raises(TypeError, match=rf"{name}: argument 'x' has dtype int32; expected one of bfloat16, float16, float32"):
            op(make(3, 4, dtype=int_dtype), *extra)
        if make is _t:  # jax has no float64 unless x64 is enabled
            with pytest.raises(TypeError, match=rf"{name}: argument 'x' has dtype float64"):
                op(make(3, dtype=torch.float64), *extra)
    with pytest.raises(TypeError, match=rf"{name}: expected a torch.Tensor or jax.Array as the first argument, got numpy.ndarray"):
        op(np.zeros(3, np.float32), *extra)


@pytest.mark.usefixtures("no_kernel_may_launch")
@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])
def test_bad_xielu_parameters_are_rejected(make, platform):
    op = XIELU()
    x = make(4, 8)
    other = _j if make is _t else _t
    fp16 = torch.float16 if make is _t else "float16"
    i32 = torch.int32 if make is _t else "int32"
    with override_platform(platform):
        with pytest.raises(TypeError, match=r"xielu: argument 'alpha_p' is required: .*shape \(1,\)"):
            op(x)
        with pytest.raises(TypeError, match=r"xielu: argument 'alpha_n' is required"):
            op(x, make(1))
        with pytest.raises(ValueError, match=r"xielu: argument 'alpha_p' has shape \(2,\); expected \(1,\)"):
            op(x, make(2), make(1))
        with pytest.raises(ValueError, match=r"xielu: argument 'alpha_n' has shape \(\); expected \(1,\)"):
            op(x, make(1), make())
        with pytest.raises(TypeError, match=r"xielu: argument 'alpha_p' has dtype float16; expected float32 or float32"):
            op(x, make(1, dtype=fp16), make(1))
        with pytest.raises(TypeError, match=r"xielu: argument 'alpha_n' has dtype int32"):
            op(x, make(1), make(1, dtype=i32))
        with pytest.raises(TypeError, match=r"xielu: argument 'alpha_p' is a \w+ array but 'x' is a \w+ array"):
            op(x, other(1), make(1))
        with pytest.raises(TypeError, match=r"xielu: argument 'alpha_n' must be None, a torch.Tensor or a jax.Array"):
            op(x, make(1), np.zeros(1, np.float32))


def test_xielu_constructor_arguments_are_checked():
    for kwargs, arg in (({"beta": "0.5"}, "beta"), ({"eps": float("nan")}, "eps"), ({"alpha_p_init": True}, "alpha_p_init"),
                        ({"alpha_n_init": float("inf")}, "alpha_n_init")):
        with pytest.raises(ValueError, match=rf"xielu: {arg} must be a finite float"):
            XIELU(**kwargs)
    op = XIELU(1, 0.9, 0.25, -1e-5)
    assert (op.alpha_p_init, op.alpha_n_init, op.beta, op.eps) == (1.0, 0.9, 0.25, -1e-5)
    assert "beta=0.25" in repr(op)


@pytest.mark.parametrize("name", OPS)
def test_torch_cpu_path_keeps_autograd(name):
    """The tuned CPU bodies work in place only when autograd is not recording."""
    op = _op(name)
    x_np = pointwise_mod._spread((4, 33), np.random.default_rng(15)) / 100
    extra = tuple(torch.tensor([a], requires_grad=True) for a in ALPHAS) if name == "xielu" else ()
    x = torch.from_numpy(x_np).requires_grad_()
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        y = op(x, *extra)
        assert op.dispatched_method("torch") == ("forward_native" if name == "xielu" else "forward_cpu")
    grads = torch.autograd.grad(y.sum(), (x, *extra))
    x_ref = torch.from_numpy(x_np).requires_grad_()
    extra_ref = tuple(torch.tensor([a], requires_grad=True) for a in ALPHAS) if name == "xielu" else ()
    want = torch.autograd.grad(op.forward_native(x_ref, *extra_ref).sum(), (x_ref, *extra_ref))
    for g, w in zip(grads, want, strict=True):
        _close(g, w)
    with torch.no_grad():
        _close(op(x, *extra), y.detach())


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("name", OPS)
def test_zero_dim_input_on_every_torch_path(name, platform):
    """Rank 0 is accepted (torch's tpu path has no bridge for a CPU tensor and falls back)."""
    op = _op(name)
    extra = (torch.tensor([ALPHAS[0]]), torch.tensor([ALPHAS[1]])) if name == "xielu" else ()
    x = torch.tensor(-2.0)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = op(x, *extra)
    assert got.shape == () and got.dtype == torch.float32
    _close(got, op.forward_native(x, *extra))


# --------------------------------------------------------------------------- the Triton kernel


@pytest.fixture(scope="module")
def triton_kernel():
    why = testing.prepare_triton()
    if why is not None:
        pytest.skip(f"triton is not installed in this environment: {why}")
    from dualop.kernels.cuda import pointwise_activation

    return pointwise_activation


def _torch_args(name, x, alpha_dtype=torch.float32):
    if name != "xielu":
        return (x,)
    return (x, *(torch.tensor([a], dtype=alpha_dtype) for a in ALPHAS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", OPS)
def test_triton_several_programs_and_a_ragged_tail(triton_kernel, name, dtype):
    x = torch.from_numpy(pointwise_mod._spread((3, 333), np.random.default_rng(11))).to(getattr(torch, dtype))
    args = _torch_args(name, x)
    statics = {"beta": 0.5, "eps": -1e-6} if name == "xielu" else {}
    got = triton_kernel.pointwise_activation(*args, activation=_op(name).activation, block=128,
                                             **statics)  # 8 programs, 103 in the last
    assert got.shape == x.shape and got.dtype == x.dtype
    _close(got.float(), _op(name).forward_native(*args).float(), dtype)


def test_triton_non_contiguous_and_empty(triton_kernel):
    x = torch.from_numpy(pointwise_mod._spread((64, 12), np.random.default_rng(12))).t()  # non-unit last stride
    _close(triton_kernel.pointwise_activation(x, activation="gelu_new"), NewGELU().forward_native(x))
    e = triton_kernel.pointwise_activation(torch.zeros(0, 5, dtype=torch.bfloat16), activation="relu2")
    assert e.shape == (0, 5) and e.dtype == torch.bfloat16


def test_triton_xielu_parameters_in_x_dtype_and_custom_constants(triton_kernel):
    x = torch.from_numpy(pointwise_mod._spread((2, 300), np.random.default_rng(13))).to(torch.bfloat16)
    op = XIELU(beta=0.25, eps=-1e-4)
    args = _torch_args("xielu", x, alpha_dtype=torch.bfloat16)
    got = triton_kernel.pointwise_activation(*args, activation="xielu", beta=0.25, eps=-1e-4)
    _close(got.float(), op.forward_native(*args).float(), "bfloat16")


def test_triton_bf16_rounds_to_nearest_even(triton_kernel):
    """The interpreter truncates float32 -> bfloat16; the kernel rounds as a GPU does."""
    x = torch.from_numpy(pointwise_mod._spread((16, 512), np.random.default_rng(14)) / 100).to(torch.bfloat16)
    want = (x.float() * torch.sigmoid(1.702 * x.float())).to(torch.bfloat16)
    got = triton_kernel.pointwise_activation(x, activation="quick_gelu")
    assert (got != want).float().mean().item() < 0.01


def test_triton_rejects_a_wrong_parameter_set(triton_kernel):
    with pytest.raises(ValueError, match="'xielu' takes alpha_p and alpha_n"):
        triton_kernel.pointwise_activation(torch.ones(4), activation="xielu")
    with pytest.raises(ValueError, match="'quick_gelu' takes no parameters"):
        triton_kernel.pointwise_activation(torch.ones(4), torch.ones(1), torch.ones(1), activation="quick_gelu")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("alpha_p", [-math.inf, math.nan, math.inf])
def test_xielu_kernels_take_non_finite_parameters_as_the_native_body(platform, alpha_p):
    """softplus(-inf) is 0, not NaN: a kernel must not carry the parameter through ``0 * a``."""
    x = np.linspace(-4, 4, 64, dtype=np.float32).reshape(4, 16)
    a_p, a_n = np.array([alpha_p], np.float32), np.array([ALPHAS[1]], np.float32)
    op = XIELU()
    if platform == "cuda":
        args = [torch.from_numpy(v) for v in (x, a_p, a_n)]
    else:
        args = [jax.numpy.asarray(v) for v in (x, a_p, a_n)]
    want = testing.to_numpy(op.forward_native(*args))
    frontend = "torch" if platform == "cuda" else "jax"
    with set_config(OpsConfig(["all"])), override_platform(platform):
        op.last_fallback = None
        got = testing.to_numpy(op(*args))
        assert op.last_run(frontend)[0] != "forward_native"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
