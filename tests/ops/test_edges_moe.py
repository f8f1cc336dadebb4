"""MoE edges: non-finite routing and refused options.

- Routing (``grouped_topk``, plain and grouped, softmax and sigmoid, with a correction bias) of
  router rows holding NaN, -NaN, +-inf and all -inf: ids stay in ``[0, E)`` and every kernel path
  (C++, Triton, Pallas) picks the native body's ids and weights; the native body (torch and jax)
  follows the float64 statement of ``moe_math``'s rule (NaN ranks as -inf, per token).
- A NaN correction-bias entry ranks its expert last on every path (as a -inf entry does).
- ``fused_moe`` gives NaN for a token whose softmax router row is NaN, on every path, as the native
  body does (the Triton and Pallas routing used to pick expert E and return 0 for it).
- A slot routed to another device's expert adds exactly nothing, NaN or inf weight included, on
  every experts path (the native body used to add 0 * NaN).
- Constructor and call-time refusals: NaN/inf/negative ``routed_scaling_factor``, inconsistent or
  non-dividing expert groups, bad all-to-all capacities.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import FusedMoE, GroupedTopk, TransformersFusedMoE, UnquantizedFusedMoEMethod
from dualop.ops import moe as moe_mod
from dualop.ops.moe_modular import FusedMoEModularMethod

NAN, INF = float("nan"), float("inf")
E = 8
# (frontend, platform, the method that must run): each platform's routing kernel.
ROUTING_PATHS = [("torch", "cpu", "forward_cpu"), ("torch", "cuda", "forward_cuda"), ("jax", "tpu", "forward_tpu")]
# The experts also run XLA's ragged_dot for jax arrays on the CPU.
EXPERTS_PATHS = ROUTING_PATHS + [("jax", "cpu", "forward_cpu")]


def _arr(a, frontend):
    a = np.asarray(a)
    return torch.from_numpy(a.copy()) if frontend == "torch" else jnp.asarray(a)


def _np(a):
    return np.asarray(a.detach() if hasattr(a, "detach") else a)


def _run(op, frontend, platform, method, *args):
    """``op(*args)`` dispatched on ``platform``; asserts that its kernel (``method``) ran."""
    op.last_fallback = None
    with override_platform(platform), set_config(OpsConfig(["all"])):
        out = op(*args)
        assert op.last_run(frontend)[0] == method, op.last_run(frontend)
    return out


def _logits_with_nonfinite_rows(seed=0):
    """[9, 8] float32: finite rows around rows holding NaN, -NaN, +-inf, all -inf and all NaN."""
    logits = np.random.default_rng(seed).normal(size=(9, E)).astype(np.float32) * 2
    logits[1, 3] = NAN
    logits[2, 5] = INF
    logits[3, 0] = -INF
    logits[4, :] = -INF
    logits[5, 2] = -np.float32(NAN)  # sign bit set: jax.lax.top_k ranks it below -inf, torch's sort first
    logits[6, [1, 6]] = [NAN, INF]
    logits[7, :] = NAN
    return logits


# float64 statement of the routing rule ---------------------------------------------------------


def _route64(logits, bias, *, topk, renormalize, num_expert_group=0, topk_group=0, scoring_func="softmax",
             routed_scaling_factor=1.0):
    """``moe_math.route``'s documented rule in float64 numpy, one token at a time: NaN ranks as
    -inf (experts and groups), ties to the lower index, weights the values before ranking."""
    l64 = np.asarray(logits, np.float64)
    with np.errstate(all="ignore"):
        if scoring_func == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-l64))
        else:
            e = np.exp(l64 - np.max(l64, axis=-1, keepdims=True))
            scores = e / np.sum(e, axis=-1, keepdims=True)
        choice = scores if bias is None else scores + np.asarray(bias, np.float64)
    tokens, experts = choice.shape
    ids = np.zeros((tokens, topk), np.int64)
    weights = np.zeros((tokens, topk))

    def ranked(v):
        return np.where(np.isnan(v), -np.inf, v)

    def best_first(v):  # descending, lower index first among equals (-inf included)
        return np.argsort(-ranked(v), kind="stable")

    for t in range(tokens):
        c = choice[t].copy()
        if num_expert_group > 1:
            per = experts // num_expert_group
            groups = ranked(c).reshape(num_expert_group, per)
            if bias is None:
                group_scores = groups.max(axis=-1)
            else:
                with np.errstate(invalid="ignore"):
                    group_scores = np.sort(groups, axis=-1)[:, ::-1][:, :2].sum(axis=-1)
            kept = best_first(group_scores)[:topk_group]
            c = np.where(np.isin(np.arange(experts) // per, kept), c, -np.inf)
        ids[t] = best_first(c)[:topk]
        weights[t] = (c if bias is None else scores[t])[ids[t]]
    with np.errstate(invalid="ignore"):
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        weights = weights * routed_scaling_factor
    return weights, ids


ROUTING_CONFIGS = {
    "softmax,k2": (dict(topk=2, renormalize=True), False),
    "softmax,groups": (dict(topk=3, renormalize=False, num_expert_group=4, topk_group=2), False),
    "sigmoid,k3": (dict(topk=3, renormalize=False, scoring_func="sigmoid"), False),
    "sigmoid,groups,bias": (dict(topk=3, renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                                 routed_scaling_factor=2.5), True),
}


def _bias(seed=1):
    return (np.random.default_rng(seed).normal(size=(E,)) * 0.5).astype(np.float32)


def _assert_routing_equal(got, want, what):
    (gw, gi), (ww, wi) = [(_np(w).astype(np.float64), _np(i)) for w, i in (got, want)]
    assert gi.min() >= 0 and gi.max() < E, f"{what}: ids {gi.tolist()} outside [0, {E})"
    np.testing.assert_array_equal(gi, wi, err_msg=what)
    np.testing.assert_array_equal(np.isnan(gw), np.isnan(ww), err_msg=f"{what}: NaN weights differ")
    np.testing.assert_allclose(gw, ww, rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("config", ROUTING_CONFIGS)
def test_native_routing_of_nonfinite_rows_follows_the_float64_rule(config, frontend):
    """The native body's ids and weights are the float64 rule's (NaN ranks as -inf whatever sign
    it carries), so torch's and jax's top-k orders of NaN no longer show through."""
    options, with_bias = ROUTING_CONFIGS[config]
    logits, bias = _logits_with_nonfinite_rows(), _bias() if with_bias else None
    op = GroupedTopk(**options)
    got = op.forward_native(None, _arr(logits, frontend), None if bias is None else _arr(bias, frontend))
    _assert_routing_equal(got, _route64(logits, bias, **options), f"{config} native {frontend}")


@pytest.mark.parametrize("frontend, platform, method", ROUTING_PATHS)
@pytest.mark.parametrize("config", ROUTING_CONFIGS)
def test_routing_kernels_of_nonfinite_rows_match_the_native_body(config, frontend, platform, method):
    """Every routing kernel keeps ids in [0, E) and picks the native body's ids and weights on rows
    with NaN/inf (the rows around them, finite, are routed as the native body routes them)."""
    options, with_bias = ROUTING_CONFIGS[config]
    logits, bias = _logits_with_nonfinite_rows(), _bias() if with_bias else None
    op = GroupedTopk(**options)
    args = (_arr(logits, frontend), _arr(logits, frontend), None if bias is None else _arr(bias, frontend))
    got = _run(op, frontend, platform, method, *args)
    _assert_routing_equal(got, op.forward_native(*args), f"{config} {method} {frontend}")


def _nonfinite_bias():
    bias = _bias()
    bias[1], bias[4], bias[6] = NAN, INF, -INF
    return bias


@pytest.mark.parametrize("frontend, platform, method", ROUTING_PATHS)
def test_a_nan_correction_bias_entry_ranks_its_expert_last_on_every_path(frontend, platform, method):
    """A NaN bias entry: its expert is chosen by no token while finite-biased experts are left (the
    same ids as a -inf entry), the other tokens' choices stay, and every path agrees."""
    options = dict(topk=3, renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid")
    logits = np.random.default_rng(2).normal(size=(6, E)).astype(np.float32)
    bias = _nonfinite_bias()
    op = GroupedTopk(**options)
    args = (_arr(logits, frontend), _arr(logits, frontend), _arr(bias, frontend))
    got = _run(op, frontend, platform, method, *args)
    want = op.forward_native(*args)
    _assert_routing_equal(got, want, f"{method} {frontend}")
    ids = _np(got[1])
    assert not (ids == 1).any(), f"expert 1 (NaN bias) chosen: {ids.tolist()}"
    assert (ids[:, 0] == 4).all(), f"expert 4 (+inf bias) not first everywhere: {ids.tolist()}"
    as_minus_inf = bias.copy()
    as_minus_inf[1] = -INF
    np.testing.assert_array_equal(ids, _np(op.forward_native(args[0], args[1], _arr(as_minus_inf, frontend))[1]))
    assert np.isfinite(_np(got[0])).all()


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_an_all_nan_correction_bias_follows_the_float64_rule(frontend):
    """Every expert ranks -inf, whatever the NaN's sign (jax.lax.top_k put +NaN first and -NaN
    last): the lowest groups and experts are taken, weighted by their (finite) unbiased scores, in
    the native body as in the float64 rule."""
    options = dict(topk=3, renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid")
    logits = np.random.default_rng(3).normal(size=(4, E)).astype(np.float32)
    bias = np.full((E,), NAN, np.float32)
    bias[:4] = -bias[:4]  # sign bit set on the lower half
    got = GroupedTopk(**options).forward_native(None, _arr(logits, frontend), _arr(bias, frontend))
    want = _route64(logits, bias, **options)
    _assert_routing_equal(got, want, f"all-NaN bias, native {frontend}")
    assert (_np(got[1]) == [0, 1, 2]).all()


# fused_moe -------------------------------------------------------------------------------------

H, INTER = 32, 16


def _moe_weights(num_experts, seed=4):
    rng = np.random.default_rng(seed)
    w13 = (rng.normal(size=(num_experts, 2 * INTER, H)) * H ** -0.5).astype(np.float32)
    w2 = (rng.normal(size=(num_experts, H, INTER)) * INTER ** -0.5).astype(np.float32)
    return w13, w2


@pytest.mark.parametrize("frontend, platform, method", EXPERTS_PATHS)
def test_fused_moe_gives_nan_for_a_nan_router_row_on_every_path(frontend, platform, method):
    """``FusedMoE(8, 2)``: tokens whose router row holds NaN or +inf (softmax: all scores NaN) come
    out NaN on every path, as in the native body; the other tokens agree with it."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, H)).astype(np.float32)
    logits = rng.normal(size=(4, E)).astype(np.float32)
    logits[1, 3], logits[2, 6] = NAN, INF
    w13, w2 = _moe_weights(E)
    op = FusedMoE(E, 2, H, INTER)
    args = [_arr(a, frontend) for a in (x, logits, w13, w2)]
    got = _np(_run(op, frontend, platform, method, *args))
    want = _np(op.forward_native(*args))
    assert np.isnan(want[1:3]).all() and np.isfinite(want[[0, 3]]).all()
    result = testing.compare(got, want, "float32")
    assert result.ok, (method, frontend, result)


def _silu_experts64(x, weights, ids, w13, w2, b13, b2, expert_map):
    """float64 ``sum`` over a token's slots owned here (``expert_map[id] >= 0``) of ``w * (w2 @
    silu(gate) * up + b2)``; slots owned elsewhere are skipped, whatever their weight."""
    x, w13, w2, b13, b2 = (np.asarray(a, np.float64) for a in (x, w13, w2, b13, b2))
    out = np.zeros((x.shape[0], w2.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = expert_map[ids[t, j]]
            if e < 0:
                continue
            h = w13[e] @ x[t] + b13[e]
            gate, up = h[:INTER], h[INTER:]
            out[t] += float(weights[t, j]) * (w2[e] @ (gate / (1.0 + np.exp(-gate)) * up) + b2[e])
    return out


def _unowned_slots_problem():
    """8 global experts, this device holding the odd ones (local order shuffled); NaN and inf
    weights on slots owned elsewhere; local expert 0's biases are NaN and no token is routed to it
    (a path that reads them for unowned slots and multiplies by 0 gets NaN)."""
    rng = np.random.default_rng(6)
    expert_map = np.full((E,), -1, np.int32)
    expert_map[[1, 3, 5, 7]] = [2, 0, 3, 1]  # global 3 is local 0: used by no token below
    ids = np.array([[1, 0], [2, 5], [4, 6], [7, 1], [0, 7]], np.int32)
    weights = np.array([[0.6, NAN], [INF, 0.3], [NAN, -INF], [0.5, 0.5], [NAN, 0.25]], np.float32)
    x = rng.normal(size=(5, H)).astype(np.float32)
    w13, w2 = _moe_weights(4, seed=7)
    b13 = (rng.normal(size=(4, 2 * INTER)) * 0.1).astype(np.float32)
    b2 = (rng.normal(size=(4, H)) * 0.1).astype(np.float32)
    b13[0], b2[0] = NAN, NAN
    return x, weights, ids, w13, w2, b13, b2, expert_map


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_native_experts_skip_unowned_slots_like_float64(frontend):
    """The native bodies of ``unquantized_fused_moe`` and ``modular_fused_moe`` (an
    expert-parallel shard's experts) add nothing for slots owned elsewhere: the float64 sum over
    the owned slots only (token 2, nothing owned, is exactly 0)."""
    problem = _unowned_slots_problem()
    want = _silu_experts64(*problem)
    args = [_arr(a, frontend) for a in problem]
    for op in (UnquantizedFusedMoEMethod(), FusedMoEModularMethod()):
        got = _np(op.forward_native(*args))
        assert np.isfinite(got).all(), (type(op).__name__, got)
        assert (got[2] == 0).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=type(op).__name__)


@pytest.mark.parametrize("frontend, platform, method", EXPERTS_PATHS)
def test_experts_kernels_skip_unowned_slots(frontend, platform, method):
    """Every experts path matches the native body on slots owned elsewhere with NaN/inf weights
    and a local expert whose biases are NaN (finite everywhere, token 2 exactly 0)."""
    args = [_arr(a, frontend) for a in _unowned_slots_problem()]
    op = UnquantizedFusedMoEMethod()
    got = _np(_run(op, frontend, platform, method, *args))
    want = _np(op.forward_native(*args))
    assert np.isfinite(got).all() and (got[2] == 0).all(), (method, frontend, got)
    result = testing.compare(got, want, "float32")
    assert result.ok, (method, frontend, result)


@pytest.mark.parametrize("frontend, platform, method", EXPERTS_PATHS)
@pytest.mark.parametrize("special", [NAN, INF])
def test_an_experts_nonfinite_weights_reach_only_its_own_tokens(frontend, platform, method, special):
    """A NaN/inf in one expert's weights (used or not) changes only the tokens routed to it:
    XLA:CPU's ragged dot masked groups by multiplication and spread it to every token."""
    rng = np.random.default_rng(3)
    tokens, hidden, inter = 6, 16, 8
    x = rng.normal(size=(tokens, hidden)).astype(np.float32)
    w13 = (rng.normal(size=(E, 2 * inter, hidden)) * 0.3).astype(np.float32)
    w2 = (rng.normal(size=(E, hidden, inter)) * 0.3).astype(np.float32)
    ids = np.array([[0], [3], [3], [5], [0], [5]], np.int32)  # experts 1 and 2 unused
    w2[2, 0, 0] = special  # unused expert
    w13[5, 1, 2] = special  # used by tokens 3 and 5
    args = [_arr(a, frontend) for a in (x, np.ones((tokens, 1), np.float32), ids, w13, w2)]
    op = UnquantizedFusedMoEMethod()
    got = _np(_run(op, frontend, platform, method, *args))
    want = _np(op.forward_native(*args))
    assert np.isfinite(want[[0, 1, 2, 4]]).all() and not np.isfinite(want[[3, 5]]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=method)
    result = testing.compare(got, want, "float32")
    assert result.ok, (method, frontend, result)


# refused options -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [NAN, INF, -INF, -0.5])
def test_a_nonfinite_or_negative_routed_scaling_factor_is_refused(value):
    for make, name in ((lambda v: GroupedTopk(2, True, routed_scaling_factor=v), "grouped_topk"),
                       (lambda v: FusedMoE(E, 2, H, INTER, routed_scaling_factor=v), "fused_moe"),
                       (lambda v: TransformersFusedMoE(E, 2, H, INTER, routed_scaling_factor=v),
                        "transformers_fused_moe")):
        with pytest.raises(ValueError, match=rf"^{name}: argument 'routed_scaling_factor' is .*; expected a finite "
                                             rf"number >= 0"):
            make(value)


@pytest.mark.parametrize("groups, topk_group", [(2, 3), (4, 0), (0, 2)])
def test_inconsistent_expert_groups_are_refused(groups, topk_group):
    message = (rf"topk_group={topk_group} with num_expert_group={groups}; expected 1 <= topk_group <= "
               rf"num_expert_group \(or both 0: no expert groups\)")
    with pytest.raises(ValueError, match="^grouped_topk: " + message):
        GroupedTopk(2, True, groups, topk_group)
    if groups and topk_group:
        with pytest.raises(ValueError, match="^fused_moe: " + message):
            FusedMoE(E, 2, H, INTER, use_grouped_topk=True, num_expert_group=groups, topk_group=topk_group)


def test_fused_moe_refuses_groups_not_dividing_the_experts():
    with pytest.raises(ValueError, match=r"^fused_moe: num_expert_group=3 does not divide the 8 experts; expected a "
                                         r"divisor of the expert count"):
        FusedMoE(E, 2, H, INTER, use_grouped_topk=True, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match=r"^fused_moe: argument 'num_expert_group' must be at least 1, got 0"):
        FusedMoE(E, 2, H, INTER, use_grouped_topk=True, num_expert_group=0, topk_group=0)
    with pytest.raises(ValueError, match=r"^transformers_fused_moe: num_expert_group=16 does not divide the 8"):
        TransformersFusedMoE(E, 2, H, INTER, use_grouped_topk=True, num_expert_group=16, topk_group=2)


@pytest.mark.parametrize("frontend, platform", [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu"), ("jax", "cpu")])
def test_grouped_topk_refuses_groups_not_dividing_the_experts_before_any_kernel(monkeypatch, frontend, platform):
    """E is known at the call: 3 groups of 8 experts are refused there (they used to fall back to
    plain top-k silently), before any kernel is resolved."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (moe_mod._PALLAS_TOPK, moe_mod._TRITON_TOPK, moe_mod._CPU_TOPK):
        monkeypatch.setattr(ref, "resolve", forbidden)
    logits = _arr(np.zeros((3, E), np.float32), frontend)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        with pytest.raises(ValueError, match=r"^grouped_topk: num_expert_group=3 does not divide the 8 experts of "
                                             r"'gating_output'; expected a divisor of the expert count"):
            GroupedTopk(2, True, 3, 1)(logits, logits)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_shards=0), r"argument 'num_shards' must be a positive int, got 0"),
    (dict(num_shards=2, capacity=0), r"argument 'capacity' must be a positive int or None, got 0"),
    (dict(num_shards=2, capacity=-3), r"argument 'capacity' must be a positive int or None, got -3"),
])
def test_all_to_all_prepare_refuses_bad_sizes(kwargs, message):
    from dualop.jax.expert_parallel import AllToAllPrepareAndFinalize

    with pytest.raises(ValueError, match="^AllToAllPrepareAndFinalize: " + message):
        AllToAllPrepareAndFinalize("ep", **kwargs)
