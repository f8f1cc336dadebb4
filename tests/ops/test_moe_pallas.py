"""The Pallas MoE kernels (interpreted here) against the ops' native bodies (``moe_math``) on what
the cell sweep does not reach: several token blocks, ties and masked groups in routing; row, hidden
and intermediate tile boundaries, empty experts, every row on one expert, expert maps with holes
and unaligned sizes in the experts."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from dualop import testing
from dualop.backends.xla import array_api as xp
from dualop.kernels import moe_math
from dualop.kernels.pallas.common import interpret_mode
from dualop.kernels.pallas.fused_moe import MoeBlocks, fused_experts, moe_blocks
from dualop.kernels.pallas.moe_routing import grouped_topk

SMALL_TILES = MoeBlocks(rows=16, hidden=128, inter=128)


def _route_both(logits, bias=None, **options):
    got = grouped_topk(logits, bias, interpret=interpret_mode("jax"), block_rows=8, **options)
    want = moe_math.route(xp, logits, e_score_correction_bias=bias, **options)
    return got, want


def _assert_routing_equal(got, want):
    (gw, gi), (ww, wi) = got, want
    np.testing.assert_array_equal(np.asarray(gi), np.asarray(wi))
    assert gi.dtype == jnp.int32 and gw.dtype == jnp.float32
    assert testing.compare(np.asarray(gw), np.asarray(ww), "float32").ok


@pytest.mark.parametrize("tokens", [1, 8, 21])
def test_routing_deepseek_config_over_token_blocks(tokens):
    """256 experts in 8 groups, 4 kept, top 8, sigmoid with a correction bias (DeepSeek-V3), over
    whole and ragged blocks of 8 tokens."""
    rng = np.random.default_rng(tokens)
    logits = jnp.asarray(rng.normal(size=(tokens, 256)) * 2.0, jnp.bfloat16)
    bias = jnp.asarray(rng.normal(size=(256,)) * 0.1, jnp.float32)
    _assert_routing_equal(*_route_both(logits, bias, top_k=8, renormalize=True, num_expert_group=8, topk_group=4,
                                       scoring_func="sigmoid", routed_scaling_factor=2.5))


def test_routing_ties_take_the_lower_index():
    """Equal logits (whole rows and pairs), equal group scores, and more picks than the kept
    groups hold (the rest are -inf, still taken lowest index first, as jax.lax.top_k does)."""
    logits = np.zeros((4, 16), np.float32)
    logits[1, [3, 9, 12]] = 1.0
    logits[2, :] = np.tile([0.5, 1.0], 8)
    logits[3, [15, 0]] = 2.0
    logits = jnp.asarray(logits)
    bias = jnp.zeros((16,), jnp.float32)
    for options in (dict(top_k=3, renormalize=True),
                    dict(top_k=5, renormalize=False, num_expert_group=4, topk_group=2),
                    dict(top_k=6, renormalize=True, num_expert_group=4, topk_group=1, scoring_func="sigmoid")):
        _assert_routing_equal(*_route_both(logits, bias, **options))
    _assert_routing_equal(*_route_both(logits, top_k=4, renormalize=False))


def _experts_problem(tokens, top_k, num_experts, hidden, inter, activation, dtype, *, bias=False, local=None,
                     ids=None, seed=0):
    rng = np.random.default_rng(seed)
    rows = moe_math.w13_rows(activation, inter)
    local = num_experts if local is None else local
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), dtype)
    w13 = jnp.asarray(rng.normal(size=(local, rows, hidden)) * hidden ** -0.5, dtype)
    w2 = jnp.asarray(rng.normal(size=(local, hidden, inter)) * inter ** -0.5, dtype)
    b13 = jnp.asarray(rng.normal(size=(local, rows)) * 0.1, dtype) if bias else None
    b2 = jnp.asarray(rng.normal(size=(local, hidden)) * 0.1, dtype) if bias else None
    if ids is None:
        picks = [rng.permutation(num_experts)[:top_k] for _ in range(tokens)]
        ids = np.stack(picks) if picks else np.zeros((0, top_k), np.int32)
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    expert_map = None
    if local != num_experts:
        mapping = np.full(num_experts, -1, np.int32)
        mapping[rng.permutation(num_experts)[:local]] = rng.permutation(local)
        expert_map = jnp.asarray(mapping)
    return x, weights, jnp.asarray(ids, jnp.int32), w13, w2, b13, b2, expert_map


def _check_experts(args, activation, *, blocks=SMALL_TILES, on_input=False):
    got = fused_experts(*args, activation=activation, apply_router_weight_on_input=on_input,
                        interpret=interpret_mode("jax"), blocks=blocks)
    x, weights, ids, w13, w2, b13, b2, expert_map = args
    want = moe_math.experts_reference(xp, x, weights, ids, w13, w2, activation=activation, w13_bias=b13, w2_bias=b2,
                                      expert_map=expert_map, apply_router_weight_on_input=on_input)
    assert got.shape == want.shape and got.dtype == want.dtype
    result = testing.compare(np.asarray(got, np.float32), np.asarray(want, np.float32), str(jnp.dtype(x.dtype)))
    assert result.ok, result
    return np.asarray(got, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_experts_tile_boundaries(dtype):
    """17 tokens x 3 slots = 51 rows over 16-row tiles (a ragged last tile, tiles shared by two
    experts), H and I of two 128-blocks each, gate-first silu with biases."""
    _check_experts(_experts_problem(17, 3, 4, 256, 256, "silu", dtype, bias=True), "silu")


def test_experts_empty_experts_and_one_hot_expert():
    """Every row on expert 2 of 6 (the others empty), interleaved swigluoai."""
    ids = np.full((11, 2), 2, np.int32)
    ids[:, 1] = 2
    args = _experts_problem(11, 2, 6, 128, 128, "swigluoai", jnp.bfloat16, bias=True, ids=ids)
    _check_experts(args, "swigluoai")


def test_experts_map_with_holes_and_tokens_routed_elsewhere():
    """4 of 12 experts on this device; token 0 is routed only elsewhere (its output is exactly 0:
    the rows nobody wrote are selected away, not multiplied by a zero weight)."""
    rng = np.random.default_rng(3)
    args = list(_experts_problem(9, 2, 12, 128, 128, "gelu", jnp.float32, local=4))
    mapping = np.asarray(args[7])
    elsewhere = np.flatnonzero(mapping < 0)
    ids = np.asarray(args[2]).copy()
    ids[0] = rng.choice(elsewhere, 2, replace=False)
    args[2] = jnp.asarray(ids)
    out = _check_experts(tuple(args), "gelu")
    assert np.all(out[0] == 0.0)


def test_experts_everything_elsewhere():
    ids = np.zeros((5, 1), np.int32)
    args = list(_experts_problem(5, 1, 4, 128, 128, "silu", jnp.float32, local=2, ids=ids))
    mapping = np.full(4, -1, np.int32)
    mapping[1], mapping[2] = 0, 1
    args[7] = jnp.asarray(mapping)
    assert np.all(_check_experts(tuple(args), "silu") == 0.0)


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu2"])
def test_experts_unaligned_sizes(activation):
    """H 200 and I 96 (zero-padded to 256 and 128 inside)."""
    _check_experts(_experts_problem(7, 2, 4, 200, 96, activation, jnp.bfloat16, bias=True), activation)


def test_experts_router_weight_on_input():
    _check_experts(_experts_problem(13, 1, 4, 128, 128, "relu2", jnp.float32), "relu2", on_input=True)


def test_experts_budget_blocks_and_no_tokens():
    """The budget's own tiles (one row tile here), and T = 0 returns [0, H] without a launch."""
    _check_experts(_experts_problem(6, 2, 4, 256, 128, "silu", jnp.bfloat16), "silu", blocks=None)
    empty = _experts_problem(0, 2, 4, 128, 128, "silu", jnp.float32)
    out = fused_experts(*empty, activation="silu", apply_router_weight_on_input=False, interpret=interpret_mode("jax"))
    assert out.shape == (0, 128)


@pytest.mark.parametrize("dtype, tokens", [(jnp.bfloat16, 7), (jnp.float16, 7), (jnp.bfloat16, 0)])
def test_experts_float32_output_is_the_sum_before_the_cast(dtype, tokens):
    """``float32_output`` through the op's TPU method (so the option reaches the kernel; float16
    takes the widening branch): the float32 combine, not cast; cast to x's dtype it is the default
    call's output bit for bit, and it is the dense float32 reference's value (the native body on
    the inputs widened to float32, exact) within float32's tolerance. 4 of 8 experts local."""
    from dualop.ops import UnquantizedFusedMoEMethod

    args = _experts_problem(tokens, 2, 8, 128, 128, "silu", dtype, bias=True, local=4, seed=5)
    got = UnquantizedFusedMoEMethod("silu", float32_output=True).forward_tpu(*args)
    cast = UnquantizedFusedMoEMethod("silu").forward_tpu(*args)
    assert got.dtype == jnp.float32 and cast.dtype == dtype and got.shape == (tokens, 128)
    np.testing.assert_array_equal(np.asarray(got.astype(dtype), np.float32), np.asarray(cast, np.float32))
    widened = [a if a is None or not jnp.issubdtype(a.dtype, jnp.floating) else a.astype(jnp.float32) for a in args]
    want = moe_math.experts_reference(xp, *widened[:5], w13_bias=widened[5], w2_bias=widened[6],
                                      expert_map=widened[7], activation="silu")
    result = testing.compare(np.asarray(got), np.asarray(want), "float32")
    assert result.ok, result


@pytest.mark.parametrize("frontend", ["torch_xla", "torchax"])
def test_experts_float32_output_from_torch_frontends(frontend):
    """The Pallas kernel's float32 output reaches torch_xla and torchax callers as float32 tensors,
    and cast to bfloat16 it is the default call's output bit for bit."""
    import torch

    from conftest import require_frontend
    from dualop.ops import UnquantizedFusedMoEMethod

    require_frontend(frontend)
    problem = _experts_problem(5, 2, 8, 128, 128, "silu", jnp.float32, local=4, seed=6)
    dtypes = ["bfloat16", "float32", "int32", "bfloat16", "bfloat16", None, None, "int32"]
    args = [None if a is None else testing.to_frontend(np.array(a), frontend, d) for a, d in zip(problem, dtypes)]
    got = UnquantizedFusedMoEMethod("silu", float32_output=True).forward_tpu(*args)
    cast = UnquantizedFusedMoEMethod("silu").forward_tpu(*args)
    assert got.dtype == torch.float32 and cast.dtype == torch.bfloat16 and tuple(got.shape) == (5, 128)
    rounded = testing.to_numpy(testing.to_frontend(testing.to_numpy(got), "jax", "bfloat16"))
    np.testing.assert_array_equal(rounded, testing.to_numpy(cast))


def test_block_choice_fits_budget_and_divides():
    blocks = moe_blocks(8192 * 8, 7168, 2048, 2, gated=True)
    assert 7168 % blocks.hidden == 0 and 2048 % blocks.inter == 0 and blocks.rows % 16 == 0
    from dualop.kernels.pallas.common import block_budget

    assert max(blocks.gate_up_vmem(2, True), blocks.down_vmem(2)) <= block_budget()
    assert moe_blocks(3, 128, 128, 4, gated=False).rows == 16
