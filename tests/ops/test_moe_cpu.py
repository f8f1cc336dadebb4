"""The CPU MoE paths against the dense reference (moe_math.experts_reference, the ops' native
body) on the edges the check cases do not reach: no tokens, experts with no tokens, every token on
one expert, expert maps with holes, groups on both sides of the C++ kernel / torch matmul split,
bfloat16; and the C++ routing kernel against moe_math.route (ties, groups, bias)."""

from __future__ import annotations

import importlib
import numpy as np
import pytest

torch = importlib.import_module("torch")

from dualop.backends.torch import array_api as torch_xp  # noqa: E402
from dualop.kernels import moe_math  # noqa: E402
from dualop.testing import TOLERANCES  # noqa: E402  (the one tolerance table)


def _problem(tokens, experts, top_k, hidden, inter, *, activation="silu", bias=False, holes=False, one_expert=False,
             seed=0):
    rng = np.random.default_rng(seed)
    local = experts // 2 if holes else experts
    rows = moe_math.w13_rows(activation, inter)
    w13 = torch.tensor(rng.standard_normal((local, rows, hidden), dtype=np.float32) * hidden ** -0.5)
    w2 = torch.tensor(rng.standard_normal((local, hidden, inter), dtype=np.float32) * inter ** -0.5)
    b13 = torch.tensor(rng.standard_normal((local, rows), dtype=np.float32) * 0.1) if bias else None
    b2 = torch.tensor(rng.standard_normal((local, hidden), dtype=np.float32) * 0.1) if bias else None
    x = torch.tensor(rng.standard_normal((tokens, hidden), dtype=np.float32))
    if one_expert:
        ids = np.zeros((tokens, top_k), np.int32) + np.arange(top_k, dtype=np.int32)
    else:
        ids = np.array([rng.permutation(experts)[:top_k] for _ in range(tokens)], np.int32).reshape(tokens, top_k)
    weights = torch.tensor(rng.random((tokens, top_k), dtype=np.float32))
    expert_map = None
    if holes:
        mapping = np.full(experts, -1, np.int32)
        mapping[rng.permutation(experts)[:local]] = rng.permutation(local)
        expert_map = torch.tensor(mapping)
    return x, weights, torch.tensor(ids), w13, w2, b13, b2, expert_map


def _cast(args, dtype):
    x, weights, ids, w13, w2, b13, b2, expert_map = args
    c = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return c(x), weights, ids, c(w13), c(w2), c(b13), c(b2), expert_map


def _reference(args, activation, on_input=False):
    x, weights, ids, w13, w2, b13, b2, expert_map = args
    return moe_math.experts_reference(torch_xp, x, weights, ids, w13, w2, activation=activation, w13_bias=b13,
                                      w2_bias=b2, expert_map=expert_map, apply_router_weight_on_input=on_input)


def _close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOLERANCES[str(dtype).removeprefix("torch.")]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol.atol, rtol=tol.rtol)


def _torch_kernel():
    from dualop.kernels.cpu import KernelUnavailable, fused_moe, load

    try:
        load()
    except KernelUnavailable as err:
        pytest.skip(f"no C++ compiler on this machine: {err}")
    return fused_moe.fused_experts


def _ragged_kernel(args):
    jnp = importlib.import_module("jax.numpy")
    from dualop.kernels.xla import fused_moe as xla_fused_moe

    def run(*a, **kw):
        conv = [None if t is None else jnp.asarray(t.float().numpy()).astype(
            jnp.bfloat16 if t.dtype == torch.bfloat16 else (jnp.int32 if not t.is_floating_point() else jnp.float32))
            for t in a]
        out = xla_fused_moe.fused_experts(*conv, **kw)
        return torch.tensor(np.asarray(out.astype(jnp.float32))).to(a[0].dtype)

    return run


PROBLEMS = {
    "no_tokens": dict(tokens=0, experts=8, top_k=2, hidden=64, inter=32),
    "idle_experts": dict(tokens=3, experts=16, top_k=2, hidden=64, inter=48),
    "one_expert_many_rows": dict(tokens=40, experts=8, top_k=1, hidden=64, inter=32, one_expert=True),
    "holes_and_bias": dict(tokens=21, experts=16, top_k=4, hidden=96, inter=40, holes=True, bias=True),
    "swigluoai": dict(tokens=9, experts=8, top_k=2, hidden=72, inter=24, activation="swigluoai", bias=True),
    "relu2_mixed_group_sizes": dict(tokens=37, experts=4, top_k=2, hidden=64, inter=36, activation="relu2"),
}


@pytest.mark.parametrize("path", ["torch_cpu", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_experts_match_the_reference(name, dtype, path):
    spec = dict(PROBLEMS[name])
    activation = spec.pop("activation", "silu")
    args = _cast(_problem(**spec, activation=activation), dtype)
    kernel = _torch_kernel() if path == "torch_cpu" else _ragged_kernel(args)
    out = kernel(*args, activation=activation)
    _close(out, _reference(args, activation), dtype)


@pytest.mark.parametrize("path", ["torch_cpu", "ragged"])
def test_router_weight_on_input(path):
    args = _cast(_problem(11, 8, 1, 64, 32, bias=True), torch.bfloat16)
    kernel = _torch_kernel() if path == "torch_cpu" else _ragged_kernel(args)
    out = kernel(*args, activation="gelu", apply_router_weight_on_input=True)
    _close(out, _reference(args, "gelu", on_input=True), torch.bfloat16)


def test_large_groups_take_the_torch_matmul_and_agree(monkeypatch):
    """Both sides of the kernel / torch matmul split in one call (one expert with many rows, the
    others with few), so a wrong row offset on either side shows. bfloat16 too, on the float32
    route a CPU without AVX512-BF16 takes."""
    from dualop.kernels.cpu import fused_moe

    kernel = _torch_kernel()
    monkeypatch.setattr(fused_moe, "has_bf16_dot", lambda: False)
    args = list(_problem(fused_moe._KERNEL_MAX_ROWS * 3, 8, 2, 64, 32, seed=3))
    ids = args[2].clone()
    ids[:, 0] = 5  # expert 5 gets every token's first slot: a large group
    ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    args[2] = ids
    for dtype in (torch.float32, torch.bfloat16):
        a = _cast(tuple(args), dtype)
        _close(kernel(*a, activation="silu"), _reference(a, "silu"), dtype)


def _bf16_kernel():
    """fused_experts, skipping where the library has no AVX512-BF16 (it then takes the float32 route,
    which the other tests cover)."""
    from dualop.kernels.cpu import fused_moe

    kernel = _torch_kernel()
    if not fused_moe.has_bf16_dot():
        pytest.skip("this CPU (or compiler) has no AVX512-BF16: the bfloat16 kernel is not built here")
    return kernel


def _record_bf16_calls(monkeypatch):
    """Calls of the AVX512-BF16 grouped matmul (group sizes, K, whether a low half came) and of the
    float32 route, recorded while they run."""
    from dualop.kernels.cpu import fused_moe

    calls = {"bf16": [], "float32": 0}
    bf16_linear, f32_linear = fused_moe._grouped_linear_bf16, fused_moe._grouped_linear

    def bf16_spy(hi, lo, weights, used, counts):
        calls["bf16"].append(dict(counts=list(counts), k=weights.shape[2], n=weights.shape[1], split=lo is not None))
        return bf16_linear(hi, lo, weights, used, counts)

    def f32_spy(*args):
        calls["float32"] += 1
        return f32_linear(*args)

    monkeypatch.setattr(fused_moe, "_grouped_linear_bf16", bf16_spy)
    monkeypatch.setattr(fused_moe, "_grouped_linear", f32_spy)
    return calls


# (hidden, inter): K and N off the kernel's 32-element step and 4-row tile; K past its 1024 slice,
# N over several column blocks with a partial last one (1200 = 9 x 128 + 48, 1100 = 5 x 216 + 20).
BF16_SHAPES = {"tails": (70, 37), "slices_and_blocks": (1100, 600)}


@pytest.mark.parametrize("on_input", [False, True], ids=["weights_after", "weights_on_input"])
@pytest.mark.parametrize("shape", list(BF16_SHAPES))
def test_bf16_dot_kernel_runs_every_group(shape, on_input, monkeypatch):
    """bfloat16 experts on the AVX512-BF16 kernel for groups of >= 16 rows and of fewer, experts
    with no rows and an expert map with holes: every group of both projections on the kernel (the
    second with hi/lo halves), none on the float32 route, and the reference's value."""
    from dualop.kernels.cpu import fused_moe

    kernel = _bf16_kernel()
    hidden, inter = BF16_SHAPES[shape]
    top_k = 1 if on_input else 2
    x, weights, ids, w13, w2, b13, b2, expert_map = _problem(40, 16, top_k, hidden, inter, holes=True, bias=True,
                                                             seed=5)
    mapped = [e for e, local in enumerate(expert_map.tolist()) if local >= 0]
    # first slots: 20 rows on `big`, 1 on `single`, 8 on `mid`, none on `idle`; the rest (and the
    # second slots) spread over the other experts, mapped or not
    big, idle, single, mid = mapped[:4]
    rest = mapped[4:] + [e for e in range(16) if e not in mapped]
    first = [big] * 20 + [single] + [mid] * 8 + [rest[i % len(rest)] for i in range(11)]
    rows = []
    for t in range(40):
        row, j = [first[t]], t
        while len(row) < top_k:
            row += [] if rest[j % len(rest)] in row else [rest[j % len(rest)]]
            j += 1
        rows.append(row)
    ids = torch.tensor(rows, dtype=torch.int32)
    args = _cast((x, weights, ids, w13, w2, b13, b2, expert_map), torch.bfloat16)
    calls = _record_bf16_calls(monkeypatch)
    out = kernel(*args, activation="silu", apply_router_weight_on_input=on_input)
    _close(out, _reference(args, "silu", on_input=on_input), torch.bfloat16)

    assert calls["float32"] == 0
    assert [c["split"] for c in calls["bf16"]] == [False, True]
    assert [c["k"] for c in calls["bf16"]] == [hidden, inter]
    counts = calls["bf16"][0]["counts"]
    assert max(counts) >= fused_moe._KERNEL_MAX_ROWS and min(counts) < fused_moe._KERNEL_MAX_ROWS
    assert 1 in counts and any(4 < c < fused_moe._KERNEL_MAX_ROWS for c in counts)  # single rows, small tiles
    assert 0 not in counts and len(counts) < w13.shape[0]  # the idle expert has no group


@pytest.mark.parametrize("split", [False, True], ids=["bf16_rows", "hi_lo_rows"])
def test_bf16_dot_kernel_sums_in_float32(split):
    """The grouped matmul alone against float64 of exactly the halves it was given, under the
    float32 tolerance: float32 accumulation, and the low half really added (dropping it would be
    off by ~2^-9 relative)."""
    from dualop.kernels.cpu import fused_moe

    _bf16_kernel()
    rng = np.random.default_rng(7)
    # groups of 1-3 rows (read weight row by weight row), 4-row tiles with and without a remainder;
    # K past one slice with a masked tail; N off the 4-row tile
    counts, used, n, k = [1, 17, 3, 16, 2], [2, 0, 3, 1, 4], 45, 1061
    values = torch.tensor(rng.standard_normal((sum(counts), k), dtype=np.float32))
    weights = torch.tensor(rng.standard_normal((5, n, k), dtype=np.float32) * k ** -0.5).bfloat16()
    hi, lo = fused_moe.split_bf16(values) if split else (values.bfloat16(), None)
    out = fused_moe._grouped_linear_bf16(hi, lo, weights, used, counts)
    rows = hi.double() + (lo.double() if split else 0)
    expert_of_row = torch.repeat_interleave(torch.tensor(used), torch.tensor(counts))
    ref = torch.einsum("rk,rnk->rn", rows, weights.double()[expert_of_row])
    tol = TOLERANCES["float32"]
    torch.testing.assert_close(out.double(), ref, atol=tol.atol, rtol=tol.rtol)
    if split:  # the halves: hi exact, lo the rest to bfloat16, so hi + lo is v to 16 bits
        assert torch.equal(hi.float(), values.bfloat16().float())
        assert (rows - values.double()).abs().max() <= values.abs().max().double() * 2.0 ** -16


def test_split_bf16_halves_and_special_values():
    """hi is torch's bfloat16 rounding, lo torch's rounding of the exact rest; infinities keep lo 0
    (so hi + lo stays infinite), NaN stays NaN."""
    from dualop.kernels.cpu import fused_moe

    _torch_kernel()
    values = torch.tensor([1.0 + 2.0 ** -10, -3.0 - 2.0 ** -12, 0.1, 1e-30, float("inf"), -float("inf"), 0.0,
                           float("nan")])
    hi, lo = fused_moe.split_bf16(values)
    not_nan = values[:7]
    assert torch.equal(hi[:7], not_nan.bfloat16())
    assert torch.equal(lo[:4], (not_nan[:4] - not_nan[:4].bfloat16().float()).bfloat16())
    assert lo[:2].tolist() == [2.0 ** -10, -(2.0 ** -12)]  # exact rests
    assert lo[4:7].tolist() == [0.0, 0.0, 0.0]
    assert torch.isnan(hi[7]) and torch.isnan(lo[7])


def test_transposed_weight_views_are_read_in_place():
    """transformers' gpt-oss layout reaches the CPU path as ``.mT`` views of [E, H, 2I] / [E, I, H]."""
    kernel = _torch_kernel()
    x, weights, ids, w13, w2, b13, b2, _ = _cast(_problem(20, 8, 2, 64, 32, bias=True), torch.bfloat16)
    w13_view, w2_view = w13.mT.contiguous().mT, w2.mT.contiguous().mT
    assert not w13_view.is_contiguous()
    out = kernel(x, weights, ids, w13_view, w2_view, b13, b2, activation="silu")
    _close(out, _reference((x, weights, ids, w13, w2, b13, b2, None), "silu"), torch.bfloat16)


def test_torch_kernel_declines_under_autograd():
    kernel = _torch_kernel()
    x, weights, ids, w13, w2, *_ = _problem(3, 8, 2, 64, 32)
    with pytest.raises(NotImplementedError, match="autograd"):
        kernel(x.requires_grad_(), weights, ids, w13, w2)


# ------------------------------------------------------------------------ float32_output


def _as_jax(args):
    jnp = importlib.import_module("jax.numpy")
    return [None if t is None else jnp.asarray(t.float().numpy()).astype(
        jnp.bfloat16 if t.dtype == torch.bfloat16 else (jnp.int32 if not t.is_floating_point() else jnp.float32))
        for t in args]


@pytest.mark.parametrize("path", ["native", "torch_cpu", "ragged"])
@pytest.mark.parametrize("tokens", [0, 21])
def test_float32_output_is_the_sum_before_the_cast(path, tokens):
    """``float32_output``: the experts' float32 weighted sum, not cast to x's dtype (bfloat16 here),
    through the op's own methods (so the option reaches the kernel): cast to bfloat16 it is the
    default call's output bit for bit, and it is the dense float32 reference's value (the native
    body on the inputs widened to float32, exact for bfloat16) within float32's tolerance."""
    from dualop.ops import UnquantizedFusedMoEMethod

    spec = dict(PROBLEMS["holes_and_bias"], tokens=tokens)
    args = _cast(_problem(**spec), torch.bfloat16)
    want32 = _reference(_cast(args, torch.float32), "silu")
    exact, default = UnquantizedFusedMoEMethod("silu", float32_output=True), UnquantizedFusedMoEMethod("silu")
    if path == "ragged":
        jnp = importlib.import_module("jax.numpy")
        jax_args = _as_jax(args)
        got, cast = exact.forward_cpu(*jax_args), default.forward_cpu(*jax_args)
        assert got.dtype == jnp.float32 and cast.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.bfloat16).astype(jnp.float32)),
                                      np.asarray(cast.astype(jnp.float32)))
        got = torch.tensor(np.asarray(got))
    else:
        if path == "torch_cpu":
            _torch_kernel()  # skips without a C++ compiler
        method = "forward_native" if path == "native" else "forward_cpu"
        got, cast = getattr(exact, method)(*args), getattr(default, method)(*args)
        assert cast.dtype == torch.bfloat16
        assert torch.equal(got.to(torch.bfloat16), cast)
    assert got.dtype == torch.float32 and got.shape == (tokens, spec["hidden"])
    if path == "native":  # the same float32 operations as the widened reference
        assert torch.equal(got, want32)
    _close(got, want32, torch.float32)


def test_float32_output_in_the_library_ops_fake():
    """torch.library: the op's fake (meta) kernel reports float32 with the option, x's dtype
    without, and opcheck's fake-versus-real checks pass."""
    from dualop.backends.torch import library
    from dualop.ops import UnquantizedFusedMoEMethod

    args = _cast(_problem(5, 8, 2, 64, 32, holes=True), torch.bfloat16)
    meta = tuple(None if t is None else t.to("meta") for t in args)
    custom = library.library_op("unquantized_fused_moe")
    for float32_output, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        op = UnquantizedFusedMoEMethod("silu", float32_output=float32_output)
        out = custom(*library.library_args(op, meta, {}))
        assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", dtype, (5, 64))
    exact = UnquantizedFusedMoEMethod("silu", float32_output=True)
    result = torch.library.opcheck(torch.ops.dualop.unquantized_fused_moe.default,
                                   tuple(library.library_args(exact, args, {})))
    assert set(result.values()) == {"SUCCESS"}, result


# ------------------------------------------------------------------------ routing


def _route_args(tokens, experts, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, experts), dtype=np.float32) * 2
    if ties:  # a few values repeated in every row, so top-k must break ties by the lower index
        logits = np.round(logits)
    return torch.tensor(logits), torch.tensor(rng.standard_normal(experts, dtype=np.float32) * 0.5)


ROUTINGS = {
    "softmax_k2": dict(top_k=2, renormalize=True),
    "softmax_groups": dict(top_k=4, renormalize=False, num_expert_group=4, topk_group=2),
    "sigmoid_groups_bias_scale": dict(top_k=6, renormalize=True, num_expert_group=8, topk_group=4,
                                      scoring_func="sigmoid", routed_scaling_factor=2.5, bias=True),
    "sigmoid_plain_bias": dict(top_k=8, renormalize=False, scoring_func="sigmoid", bias=True),
    "groups_do_not_divide": dict(top_k=3, renormalize=True, num_expert_group=5, topk_group=2),
}


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("experts", [32, 256])
def test_routing_kernel_matches_route(name, experts, ties):
    from dualop.kernels.cpu import moe_routing

    _torch_kernel()
    options = dict(ROUTINGS[name])
    use_bias = options.pop("bias", False)
    options = dict(dict(num_expert_group=0, topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0), **options)
    logits, bias = _route_args(37, experts, ties=ties)
    bias = bias if use_bias else None
    weights, ids = moe_routing.grouped_topk(logits, bias, **options)
    ref_weights, ref_ids = moe_math.route(torch_xp, logits, e_score_correction_bias=bias, **options)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    tol = TOLERANCES["float32"]
    torch.testing.assert_close(weights, ref_weights, atol=tol.atol, rtol=tol.rtol)


def test_routing_kernel_no_tokens_and_bf16_logits():
    from dualop.kernels.cpu import moe_routing

    _torch_kernel()
    opts = dict(top_k=2, renormalize=True, num_expert_group=0, topk_group=0, scoring_func="softmax",
                routed_scaling_factor=1.0)
    w, i = moe_routing.grouped_topk(torch.zeros(0, 8), None, **opts)
    assert w.shape == (0, 2) and i.shape == (0, 2)
    logits = _route_args(5, 8)[0].bfloat16()
    w, i = moe_routing.grouped_topk(logits, None, **opts)
    rw, ri = moe_math.route(torch_xp, logits, **opts)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, atol=TOLERANCES["float32"].atol, rtol=TOLERANCES["float32"].rtol)
