"""The MoE Triton kernels (``kernels/cuda/moe_routing.py``, ``kernels/cuda/fused_moe.py``) beyond the
cell sweep, in Triton's CPU interpreter: routing ties and groups against ``jax.lax.top_k`` and the
op's native body; the block alignment against ``moe_math.sort_by_expert``; the experts against
``forward_native`` at block boundaries (rows per expert at, below and above ``BLOCK_M``; hidden and
intermediate sizes off the tile sizes), with experts that get no tokens, all tokens on one expert,
the same expert twice in a token, expert maps with holes and tokens routed only elsewhere; and
launches on meta tensors (``dualop compile``) with grids from the shapes alone. Shapes are small:
the interpreter runs every program in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop.backends import array_namespace
from dualop.kernels import moe_math
from dualop.kernels.cuda import fused_moe as fused_moe_mod
from dualop.kernels.cuda.fused_moe import align_block_size, block_sizes, fused_experts
from dualop.kernels.cuda.moe_routing import grouped_topk
from dualop.ops.moe import GroupedTopk, UnquantizedFusedMoEMethod
from dualop.testing import compare

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    result = compare(got.float().numpy(), want.float().numpy(), _DTYPE_NAMES[dtype])
    assert result.ok, result


# ---------------------------------------------------------------------------------- routing


def _route_both(logits, bias=None, **options):
    op = GroupedTopk(**options)
    got = grouped_topk(logits, bias, **op.routing_options())
    want = op.forward_native(None, logits, bias)
    return got, want


@pytest.mark.parametrize("options, experts", [
    (dict(topk=3, renormalize=True), 6),
    (dict(topk=4, renormalize=False, num_expert_group=4, topk_group=2), 16),
    (dict(topk=5, renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid"), 12),
])
def test_routing_ties_take_the_lower_index_like_jax_top_k(options, experts):
    """Equal logits (whole rows, and pairs of equal values) choose the lower expert first, as
    ``jax.lax.top_k`` does (nobody here wrote it); weights match the native body."""
    import jax

    rng = np.random.default_rng(0)
    logits = rng.integers(-2, 3, size=(19, experts)).astype(np.float32)  # many exact ties
    logits[0] = 1.0
    (w, ids), (rw, rids) = _route_both(torch.from_numpy(logits), **options)
    assert torch.equal(ids, rids)
    _assert_close(w, rw, torch.float32)
    if "num_expert_group" not in options:
        scores = torch.softmax(torch.from_numpy(logits), -1).numpy()
        _, jax_ids = jax.lax.top_k(scores, options["topk"])
        np.testing.assert_array_equal(ids.numpy(), np.asarray(jax_ids))
    assert ids[0].tolist() == list(range(options["topk"]))  # a row of equal logits


@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_routing_groups_any_size_with_bias_and_dropped_groups(tokens):
    """Three groups of five (not powers of two), a correction bias (groups score their two best),
    token counts at and past a token block; and top_k above the experts of the kept groups, so
    experts of dropped groups (scored -inf) are chosen, lowest index first, as the native body does."""
    rng = np.random.default_rng(tokens)
    logits = torch.from_numpy(rng.normal(size=(tokens, 15)).astype(np.float32) * 2)
    bias = torch.from_numpy(rng.normal(size=(15,)).astype(np.float32) * 0.5)
    for options in (dict(topk=4, renormalize=True, num_expert_group=3, topk_group=2, scoring_func="sigmoid",
                         routed_scaling_factor=2.5),
                    dict(topk=7, renormalize=False, num_expert_group=3, topk_group=1)):
        (w, ids), (rw, rids) = _route_both(logits, bias, **options)
        assert torch.equal(ids, rids), options
        _assert_close(w, rw, torch.float32)


def test_routing_bfloat16_logits_and_one_expert_per_group():
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(9, 8)).astype(np.float32)).to(torch.bfloat16)
    bias = torch.from_numpy(rng.normal(size=(8,)).astype(np.float32))
    (w, ids), (rw, rids) = _route_both(logits, bias, topk=3, renormalize=True, num_expert_group=8, topk_group=4)
    assert torch.equal(ids, rids)
    _assert_close(w, rw, torch.float32)


# ---------------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("block_m", [2, 4, 16])
def test_alignment_pads_each_expert_and_drops_pairs_elsewhere(block_m):
    """Every local pair exactly once, in blocks of its own expert, in ``moe_math.sort_by_expert``'s
    (stable) order; padding holds the sentinel; experts with no pairs get no block; pairs of id -1
    appear nowhere; blocks past the last run have expert -1."""
    local_ids = torch.tensor([[3, -1], [0, 3], [3, 0], [-1, -1], [3, 5], [0, 3]], dtype=torch.int32)
    num_local, num_pairs = 6, local_ids.numel()
    sorted_pairs, block_expert = align_block_size(local_ids, num_local, block_m)
    assert sorted_pairs.shape[0] == block_expert.shape[0] * block_m
    assert block_expert.shape[0] == num_pairs // block_m + min(num_local, num_pairs)
    order, group_sizes = moe_math.sort_by_expert(array_namespace(local_ids), local_ids, num_local)
    flat = local_ids.reshape(-1)
    rows = sorted_pairs.tolist()
    real = [p for p in rows if p < num_pairs]
    assert real == order[: int(group_sizes.sum())].tolist()
    for block, expert in enumerate(block_expert.tolist()):
        pairs = rows[block * block_m:(block + 1) * block_m]
        if expert < 0:
            assert all(p == num_pairs for p in pairs)
        else:
            assert all(p == num_pairs or int(flat[p]) == expert for p in pairs)
            assert pairs[0] < num_pairs  # a block starts with a real row
    used = [e for e in block_expert.tolist() if e >= 0]
    want = [e for e in range(num_local) for _ in range(-(-int(group_sizes[e]) // block_m))]
    assert used == want  # experts 1, 2 and 4 have no pairs and no blocks
    assert used == sorted(used) and all(e < 0 for e in block_expert.tolist()[len(used):])


_META_PROBE = """
import json, sys
import torch
from dualop.aot import gpu
from dualop.kernels import cuda
from dualop.kernels.cuda.fused_moe import fused_experts
from dualop.kernels.cuda.moe_routing import grouped_topk

tokens, top_k, hidden, inter, experts, local = (int(v) for v in sys.argv[1:])

def meta(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")

with cuda.compile_target(cuda.GPU_TARGETS["sm90"]), gpu.capture_launches() as launches:
    w, ids = grouped_topk(meta((tokens, experts), torch.float32), meta((experts,), torch.float32), top_k=top_k,
                          renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                          routed_scaling_factor=2.5)
    out = fused_experts(meta((tokens, hidden)), w, ids, meta((local, 2 * inter, hidden)),
                        meta((local, hidden, inter)), meta((local, 2 * inter)), meta((local, hidden)),
                        meta((experts,), torch.int32), activation="swigluoai", apply_router_weight_on_input=False)
print(json.dumps({"out": [out.device.type, list(out.shape), str(out.dtype)],
                  "launches": [[launch.fn.__name__, list(launch.grid)] for launch in launches]}))
"""


def test_alignment_and_launches_on_meta_tensors_need_no_values(tmp_path):
    """The whole wrapper (routing, alignment, both expert kernels) runs on meta tensors inside
    ``compile_target`` (what ``dualop compile`` does; so no value is read back to the host): three
    launches with grids from the shapes alone. In a compiled-mode child: the interpreter does not
    go through the launch ``capture_launches`` records."""
    import json
    import os
    import subprocess
    import sys

    from dualop.aot.gpu import child_environment

    tokens, top_k, hidden, inter, experts, local = 64, 8, 256, 96, 32, 8
    script = tmp_path / "moe_meta_probe.py"
    script.write_text(_META_PROBE)
    env = child_environment(str(tmp_path / "triton-cache"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    args = [str(v) for v in (tokens, top_k, hidden, inter, experts, local)]
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"] == ["meta", [tokens, hidden], "torch.bfloat16"]
    block_m, block_n, _, _ = block_sizes(tokens * top_k, local, 2)
    blocks = tokens * top_k // block_m + local
    assert [name for name, _ in result["launches"]] == ["_grouped_topk_kernel", "_experts_up_kernel",
                                                        "_experts_down_kernel"]
    assert result["launches"][1][1] == [blocks, -(-inter // block_n)]
    assert result["launches"][2][1] == [blocks, -(-hidden // block_n)]


# ---------------------------------------------------------------------------------- experts


def _experts_problem(rng, tokens, top_k, hidden, inter, num_local, activation, dtype, *, bias=False,
                     num_global=None, ids=None):
    rows = moe_math.w13_rows(activation, inter)

    def normal(shape, scale):
        return torch.from_numpy(rng.normal(size=shape).astype(np.float32) * scale).to(dtype)

    x = normal((tokens, hidden), 1.0)
    w13, w2 = normal((num_local, rows, hidden), hidden ** -0.5), normal((num_local, hidden, inter), inter ** -0.5)
    b13 = normal((num_local, rows), 0.1) if bias else None
    b2 = normal((num_local, hidden), 0.1) if bias else None
    num_global = num_global or num_local
    if ids is None:
        ids = np.stack([rng.permutation(num_global)[:top_k] for _ in range(tokens)]).reshape(tokens, top_k)
    weights = torch.from_numpy(rng.random((tokens, top_k)).astype(np.float32))
    return x, weights, torch.from_numpy(np.asarray(ids, np.int32)), w13, w2, b13, b2


def _check_experts(problem, dtype, expert_map=None, activation="silu", weight_on_input=False):
    x, weights, ids, w13, w2, b13, b2 = problem
    got = fused_experts(x, weights, ids, w13, w2, b13, b2, expert_map, activation=activation,
                        apply_router_weight_on_input=weight_on_input)
    want = UnquantizedFusedMoEMethod(activation, weight_on_input).forward_native(x, weights, ids, w13, w2, b13, b2,
                                                                                 expert_map)
    _assert_close(got, want, dtype)
    return got


@pytest.mark.parametrize("tokens", [15, 16, 17, 33])
def test_all_tokens_on_one_expert_across_block_boundaries(tokens):
    """Every token on expert 2 of 4 (the others empty): rows per expert below, at and past
    ``BLOCK_M``, and past two blocks; hidden 72 and intermediate 40 are not multiples of the tiles."""
    rng = np.random.default_rng(tokens)
    problem = _experts_problem(rng, tokens, 1, 72, 40, 4, "silu", torch.float32, ids=np.full((tokens, 1), 2))
    _check_experts(problem, torch.float32)


def test_32_row_blocks_two_per_expert():
    """40 tokens on both of 2 experts: 40 rows per expert take 32-row blocks (``block_sizes``), one
    full and one of 8 rows each."""
    assert block_sizes(80, 2, 4)[0] == 32
    rng = np.random.default_rng(13)
    problem = _experts_problem(rng, 40, 2, 64, 48, 2, "gelu_tanh", torch.float32)
    _check_experts(problem, torch.float32, activation="gelu_tanh")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_experts_16_bit_and_an_expert_twice(dtype):
    """Twelve experts, tokens on only three of them (most experts empty), one token routed to the
    same expert in both slots (its weights add), hidden 130 past two reduction steps."""
    rng = np.random.default_rng(5)
    ids = rng.choice([1, 7, 10], size=(11, 2))
    ids[0] = [7, 7]
    problem = _experts_problem(rng, 11, 2, 130, 64, 12, "gelu", dtype, ids=ids)
    _check_experts(problem, dtype, activation="gelu")


def test_float16_intermediate_past_the_float16_range():
    """Inputs scaled by 300: the float32 intermediate exceeds float16's 65504 while the outputs fit.
    Its two float16 halves would overflow (inf - inf: NaN rows); each row is scaled by a power of
    two before the split, as the native body keeps the intermediate in float32."""
    rng = np.random.default_rng(3)
    x, weights, ids, w13, w2, b13, b2 = _experts_problem(rng, 5, 2, 200, 128, 8, "silu", torch.float16)
    x = (x.float() * 300).to(torch.float16)
    want = UnquantizedFusedMoEMethod("silu", False).forward_native(x, weights, ids, w13, w2, b13, b2)
    assert torch.isfinite(want.float()).any()
    got = fused_experts(x, weights, ids, w13, w2, b13, b2, None, activation="silu", apply_router_weight_on_input=False)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = torch.isfinite(want) & torch.isfinite(got)
    result = compare(got[finite].float().numpy(), want[finite].float().numpy(), "float16", normwise=True)
    assert result.ok, result


def test_expert_map_with_holes_and_tokens_only_elsewhere():
    """Six of sixteen experts local, in shuffled order; some tokens routed only to experts elsewhere
    (their rows are 0); swigluoai's interleaved rows with biases; bfloat16."""
    rng = np.random.default_rng(7)
    mapping = np.full(16, -1, np.int32)
    held = rng.permutation(16)[:6]
    mapping[held] = rng.permutation(6)
    elsewhere = np.flatnonzero(mapping < 0)
    ids = np.stack([rng.permutation(16)[:3] for _ in range(9)])
    ids[:3] = np.stack([rng.permutation(elsewhere)[:3] for _ in range(3)])
    problem = _experts_problem(rng, 9, 3, 128, 96, 6, "swigluoai", torch.bfloat16, bias=True, ids=ids)
    got = _check_experts(problem, torch.bfloat16, torch.from_numpy(mapping), activation="swigluoai")
    assert torch.count_nonzero(got[:3]) == 0 and torch.count_nonzero(got[3:]) > 0


def test_bad_map_entries_and_ids_add_nothing():
    """A map entry past the local experts and an id past the map (values validation would reject
    eagerly) contribute 0 instead of reading out of bounds, as ``moe_math.local_expert_ids`` rules."""
    rng = np.random.default_rng(9)
    problem = _experts_problem(rng, 5, 2, 64, 32, 4, "silu", torch.float32, num_global=8)
    mapping = torch.tensor([0, 1, 2, 3, -1, 99, -1, -1], dtype=torch.int32)
    x, weights, ids, *rest = problem
    ids[0, 0], ids[1, 1] = 5, 42
    _check_experts((x, weights, ids, *rest), torch.float32, mapping)


@pytest.mark.parametrize("tokens, num_local", [(0, 4), (1, 4), (70, 1)])
def test_relu2_weight_on_input_float16(tokens, num_local):
    """relu2 (one w13 tile, no gate), the router weight scaling the input (top_k 1); 70 tokens on
    one expert take 64-row blocks (``block_sizes``); no tokens returns an empty result."""
    rng = np.random.default_rng(tokens)
    ids = rng.integers(0, num_local, size=(tokens, 1))
    problem = _experts_problem(rng, tokens, 1, 96, 80, num_local, "relu2", torch.float16, ids=ids)
    got = _check_experts(problem, torch.float16, activation="relu2", weight_on_input=True)
    assert tuple(got.shape) == (tokens, 96)
    assert block_sizes(tokens, num_local, 2)[0] == (64 if tokens == 70 else 16)


def test_bfloat16_outputs_near_zero_keep_the_float32_intermediate():
    """w2 rows that nearly cancel: rounding the float32 intermediate to bfloat16 once would miss
    the tolerance (atol 1e-5); the hi/lo halves keep it."""
    rng = np.random.default_rng(11)
    x, weights, ids, w13, w2, _, _ = _experts_problem(rng, 6, 2, 64, 64, 4, "silu", torch.bfloat16)
    w2 = w2.clone()
    w2[:, :, 32:] = -w2[:, :, :32]  # outputs sum a[:32] - a[32:] pairs of w2 entries
    w13 = w13.clone()
    w13[:, 32:64] = w13[:, 0:32] + (torch.rand_like(w13[:, 0:32].float()) * 1e-2).to(torch.bfloat16)
    w13[:, 96:128] = w13[:, 64:96]
    _check_experts((x, weights, ids, w13, w2, None, None), torch.bfloat16)


@pytest.mark.parametrize("tokens", [0, 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_output_is_the_sum_before_the_cast(dtype, tokens):
    """``float32_output`` through the op's CUDA method (so the option reaches the kernels): the
    float32 sum of the k slots, not cast; cast to x's dtype it is the default call's output bit for
    bit, and it is the dense float32 reference's value (the native body on the inputs widened to
    float32, exact) within float32's tolerance. Six of twelve experts local, swigluoai with biases."""
    rng = np.random.default_rng(2)
    mapping = np.full(12, -1, np.int32)
    mapping[rng.permutation(12)[:6]] = rng.permutation(6)
    expert_map = torch.from_numpy(mapping)
    ids = np.array([rng.permutation(12)[:3] for _ in range(tokens)]).reshape(tokens, 3)
    problem = _experts_problem(rng, tokens, 3, 72, 40, 6, "swigluoai", dtype, bias=True, ids=ids)
    got = UnquantizedFusedMoEMethod("swigluoai", float32_output=True).forward_cuda(*problem, expert_map)
    cast = UnquantizedFusedMoEMethod("swigluoai").forward_cuda(*problem, expert_map)
    assert got.dtype == torch.float32 and cast.dtype == dtype and got.shape == (tokens, 72)
    assert torch.equal(got.to(dtype), cast)
    x, weights, ids, *weight_args = problem
    widened = [None if w is None else w.float() for w in weight_args]
    want = UnquantizedFusedMoEMethod("swigluoai").forward_native(x.float(), weights, ids, *widened, expert_map)
    _assert_close(got, want, torch.float32)


def test_block_sizes_follow_rows_per_expert():
    assert block_sizes(16 * 8, 32, 2)[0] == 16
    assert block_sizes(8192 * 8, 32, 2) == (64, 64, 64, 8)
    assert block_sizes(8192 * 8, 32, 4)[2] == 32
    assert fused_moe_mod._RELU2 not in moe_math.MOE_ACTIVATIONS
