"""The MoE native bodies (grouped_topk, fused_moe, transformers_fused_moe) and the FusedMoE layers
against Hugging Face transformers' own MoE blocks, with the blocks' weights loaded as transformers
stores them: Mixtral (softmax top-2, renormalized), Qwen3-MoE (norm_topk_prob both ways),
DeepSeek-V3 (sigmoid scores, grouped top-k with the correction bias, routed scaling, shared experts
added outside fused_moe) and gpt-oss (interleaved, transposed gate_up with biases, swigluoai; its
router's softmax over the top-k logits). Plus a float64 numpy check of the tie rule.

Routing is compared as sets per token (transformers' DeepSeek router uses ``topk(sorted=False)``)
with the weights matched by expert id; block outputs are compared under the tolerance table.
bfloat16: dualop computes in float32 and rounds once, so its bf16 output must sit within the
table's bf16 row of the float32 block run on the same bf16-exact weights and inputs. transformers'
own bf16 forward rounds every intermediate (the two projections, the activation, the weighting
and the bf16 ``index_add_``: five roundings of up to 2^-9 each), so it is only held to 2^-5 of the
output's largest magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch

from dualop import ops, testing
from dualop.kernels import moe_math

jnp = jax.numpy
pytestmark = pytest.mark.reference


def _close(got, want, dtype="float32"):
    cmp = testing.compare(testing.to_numpy(got).astype(np.float32), testing.to_numpy(want).astype(np.float32), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


def _j(t):
    """A torch tensor as a jax array of the same dtype (bf16 via float32, which holds it exactly)."""
    return jnp.asarray(t.detach().float().numpy()).astype(str(t.dtype).removeprefix("torch."))


def _randomize(module, seed, router_scale=1.0):
    """Fill every parameter (and the correction bias) with normal values: expert weights at
    1/sqrt(fan-in) so outputs stay O(1); router weights larger so selections are clear-cut."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            fan_in = p.shape[-1] if p.ndim > 1 else 1
            scale = router_scale if ("gate.weight" in name or "router" in name) else fan_in ** -0.5
            if "bias" in name:
                scale = 0.5 if "correction" in name else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module.eval()


def _tokens(n, hidden, seed=1, dtype=torch.float32):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _routing_as_sets(ids, weights):
    """Per token: {expert id: weight}."""
    ids, weights = testing.to_numpy(ids).astype(np.int64), testing.to_numpy(weights).astype(np.float64)
    return [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)]


def _assert_same_routing(got_ids, got_weights, want_ids, want_weights):
    got, want = _routing_as_sets(got_ids, got_weights), _routing_as_sets(want_ids, want_weights)
    for t, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), f"token {t}: experts {sorted(g)} != transformers' {sorted(w)}"
        np.testing.assert_allclose([g[e] for e in sorted(g)], [w[e] for e in sorted(w)], rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------------------------ Mixtral


def _mixtral(seed=0, experts=8, hidden=48, inter=40):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2)
    return _randomize(MixtralSparseMoeBlock(cfg), seed, router_scale=0.5), cfg


def test_mixtral_routing_and_block():
    block, cfg = _mixtral()
    x = _tokens(33, cfg.hidden_size)
    with torch.no_grad():
        logits, want_w, want_ids = block.gate(x)
        want = block(x[None])[0]
    for fe in (lambda t: t, _j):
        weights, ids = ops.GroupedTopk(2, True).forward_native(fe(x), fe(logits))
        _assert_same_routing(ids, weights, want_ids, want_w)
        w13, w2 = fe(block.experts.gate_up_proj), fe(block.experts.down_proj)  # [E, 2I, H], [E, H, I]: as is
        _close(ops.FusedMoE(8, 2, 48, 40).forward_native(fe(x), fe(logits), w13, w2), want)
        hf = ops.TransformersFusedMoE(8, 2, 48, 40)
        _close(hf.forward_native(fe(x), fe(logits), w13, w2), want)


def test_mixtral_layers_load_the_block():
    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    block, cfg = _mixtral(seed=3)
    x = _tokens(2 * 7, cfg.hidden_size, seed=4).reshape(2, 7, -1)
    with torch.no_grad():
        logits = block.gate(x)[0].reshape(2, 7, -1)
        want = block(x)
    layer = torch_layers.FusedMoE(8, 2, 48, 40).load_hf_experts(block)
    with torch.no_grad():
        _close(layer(x, logits), want)
    jlayer = jax_layers.FusedMoE(8, 2, 48, 40).load_hf_experts(block.state_dict())
    _close(jlayer(_j(x), _j(logits)), want)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_mixtral_bfloat16(frontend):
    block, cfg = _mixtral(seed=5)
    x = _tokens(17, cfg.hidden_size, seed=6, dtype=torch.bfloat16)
    with torch.no_grad():
        block.to(torch.bfloat16).to(torch.float32)  # bf16-exact weights, float32 block
        logits, route_w, route_ids = block.gate(x.float())
        want = block(x.float()[None])[0]
        # transformers' own bf16 experts on the same routing (its bf16 router could pick others)
        own_bf16 = block.experts.to(torch.bfloat16)(x, route_ids, route_w).float()
    fe = (lambda t: t) if frontend == "torch" else _j
    w13, w2 = (fe(p.to(torch.bfloat16)) for p in (block.experts.gate_up_proj, block.experts.down_proj))
    got = ops.FusedMoE(8, 2, 48, 40).forward_native(fe(x), fe(logits), w13, w2)
    assert str(got.dtype).endswith("bfloat16")
    _close(got, want, "bfloat16")
    got = testing.to_numpy(got).astype(np.float32)
    assert np.abs(got - own_bf16.numpy()).max() <= 2.0**-5 * np.abs(want.numpy()).max()


# ------------------------------------------------------------------------------------ Qwen3-MoE


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=40, moe_intermediate_size=24, num_experts=16, num_experts_per_tok=4,
                         norm_topk_prob=norm_topk_prob)
    block = _randomize(Qwen3MoeSparseMoeBlock(cfg), 7, router_scale=0.5)
    x = _tokens(33, 40, seed=8)
    with torch.no_grad():
        logits, want_w, want_ids = block.gate(x)
        want = block(x[None])[0]
    for fe in (lambda t: t, _j):
        weights, ids = ops.fused_topk(fe(logits), 4, norm_topk_prob)
        _assert_same_routing(ids, weights, want_ids, want_w)
        op = ops.FusedMoE(16, 4, 40, 24, renormalize=norm_topk_prob)
        _close(op.forward_native(fe(x), fe(logits), fe(block.experts.gate_up_proj), fe(block.experts.down_proj)),
               want)


# ------------------------------------------------------------------------------------ DeepSeek-V3


def _deepseek(seed=9, norm_topk_prob=True):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=norm_topk_prob)
    return _randomize(DeepseekV3MoE(cfg), seed, router_scale=0.3), cfg


def _deepseek_op(norm_topk_prob=True):
    return ops.FusedMoE(16, 4, 64, 32, renormalize=norm_topk_prob, use_grouped_topk=True, num_expert_group=4,
                        topk_group=2, scoring_func="sigmoid", routed_scaling_factor=2.5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_router(norm_topk_prob):
    block, _ = _deepseek(norm_topk_prob=norm_topk_prob)
    x = _tokens(57, 64, seed=10)
    with torch.no_grad():
        logits, want_w, want_ids = block.gate(x)
    bias = block.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # the correction bias really takes part
    router = _deepseek_op(norm_topk_prob).router
    for fe in (lambda t: t, _j):
        weights, ids = router.forward_native(fe(x), fe(logits), fe(bias))
        _assert_same_routing(ids, weights, want_ids, want_w)


def test_deepseek_v3_block_with_shared_experts():
    block, _ = _deepseek(seed=11)
    x = _tokens(33, 64, seed=12)
    with torch.no_grad():
        logits = block.gate(x)[0]
        want = block(x[None])[0]
        shared = block.shared_experts(x)  # outside fused_moe, as in the engine
    ex, bias = block.experts, block.gate.e_score_correction_bias
    for fe in (lambda t: t, _j):
        routed = _deepseek_op().forward_native(fe(x), fe(logits), fe(ex.gate_up_proj), fe(ex.down_proj), None, None,
                                               fe(bias))
        _close(testing.to_numpy(routed) + shared.numpy(), want)


def test_deepseek_v3_layers_with_expert_maps_sum_to_the_block():
    """Two layers holding the even and the odd experts (expert maps with holes) add up to the
    block's routed experts; the correction bias is loaded from the block's router."""
    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    block, _ = _deepseek(seed=13)
    x = _tokens(21, 64, seed=14)
    with torch.no_grad():
        logits = block.gate(x)[0]
        want = block(x[None])[0] - block.shared_experts(x)
    kwargs = dict(use_grouped_topk=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
                  routed_scaling_factor=2.5)
    maps = []
    for parity in (0, 1):
        mapping = np.full(16, -1, np.int32)
        mapping[parity::2] = np.arange(8)[::-1]  # reversed local order: the map decides
        maps.append(mapping)
    torch_parts = [torch_layers.FusedMoE(16, 4, 64, 32, expert_map=m, **kwargs).load_hf_experts(block) for m in maps]
    assert all(p.w13_weight.shape[0] == 8 and p.e_score_correction_bias is not None for p in torch_parts)
    with torch.no_grad():
        _close(sum(p(x, logits) for p in torch_parts), want)
    jax_parts = [jax_layers.FusedMoE(16, 4, 64, 32, expert_map=m, **kwargs).load_hf_experts(block) for m in maps]
    _close(sum(testing.to_numpy(p(_j(x), _j(logits))) for p in jax_parts), want)


# ------------------------------------------------------------------------------------ gpt-oss


def _gpt_oss(seed=15, experts=8, hidden=48, inter=40):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2)
    block = _randomize(GptOssMLP(cfg), seed, router_scale=0.5)
    with torch.no_grad():  # pre-activations beyond the clamp limit (7) on both sides for some tokens
        block.experts.gate_up_proj.mul_(6.0)
    return block, cfg


def _gpt_oss_logits(block, x):
    return torch.nn.functional.linear(x, block.router.weight, block.router.bias)


def test_gpt_oss_layout_is_what_transformers_says():
    block, _ = _gpt_oss()
    ex = block.experts
    assert tuple(ex.gate_up_proj.shape) == (8, 48, 80) and tuple(ex.down_proj.shape) == (8, 40, 48)
    assert (ex.is_transposed, ex.is_concatenated, ex.has_bias) == (True, False, True)


def test_gpt_oss_router_and_experts():
    block, cfg = _gpt_oss()
    x = _tokens(33, 48, seed=16)
    with torch.no_grad():
        logits, want_w, want_ids = block.router(x)
        want, _ = block(x[None])
        want = want[0]
    assert np.abs(testing.to_numpy(logits) - testing.to_numpy(_gpt_oss_logits(block, x))).max() == 0
    ex = block.experts
    hf_weights = (ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias, ex.down_proj_bias)
    op = ops.TransformersFusedMoE(8, 2, 48, 40, activation="swigluoai", has_bias=True, is_transposed=True,
                                  is_concatenated=False)
    for fe in (lambda t: t, _j):
        weights, ids = ops.fused_topk(fe(logits), 2, True)  # softmax of the top-k logits = renormalized
        _assert_same_routing(ids, weights, want_ids, want_w)
        _close(op.forward_native(fe(x), fe(logits), *(fe(w) for w in hf_weights)), want)
        engine = ops.hf_to_engine(*(fe(w) for w in hf_weights), activation="swigluoai", is_transposed=True,
                                  is_concatenated=False)
        plain = ops.FusedMoE(8, 2, 48, 40, activation="swigluoai", has_bias=True)
        _close(plain.forward_native(fe(x), fe(logits), *engine), want)


def test_gpt_oss_layers_load_the_block():
    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    block, _ = _gpt_oss(seed=17)
    x = _tokens(3 * 5, 48, seed=18).reshape(3, 5, 48)
    with torch.no_grad():
        logits = _gpt_oss_logits(block, x)
        want, _ = block(x)
    kwargs = dict(activation="swigluoai", has_bias=True)
    layer = torch_layers.FusedMoE(8, 2, 48, 40, **kwargs).load_hf_experts(block)  # flags from the experts module
    with torch.no_grad():
        _close(layer(x, logits), want)
    state = {k: v.numpy() for k, v in block.state_dict().items()}
    with pytest.raises(ValueError, match="pass is_concatenated for swigluoai"):
        jax_layers.FusedMoE(8, 2, 48, 40, **kwargs).load_hf_experts(state)
    jlayer = jax_layers.FusedMoE(8, 2, 48, 40, **kwargs).load_hf_experts(state, is_concatenated=False)
    _close(jlayer(_j(x), _j(logits)), want)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_gpt_oss_bfloat16(frontend):
    block, _ = _gpt_oss(seed=19)
    x = _tokens(17, 48, seed=20, dtype=torch.bfloat16)
    with torch.no_grad():
        block.to(torch.bfloat16).to(torch.float32)
        logits = _gpt_oss_logits(block, x.float())
        _, route_w, route_ids = block.router(x.float())
        want = block(x.float()[None])[0][0]
        own_bf16 = block.experts.to(torch.bfloat16)(x, route_ids, route_w).float()
    ex = block.experts
    fe = (lambda t: t) if frontend == "torch" else _j
    hf_weights = [fe(w) for w in (ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias, ex.down_proj_bias)]
    op = ops.TransformersFusedMoE(8, 2, 48, 40, activation="swigluoai", has_bias=True, is_transposed=True,
                                  is_concatenated=False)
    got = op.forward_native(fe(x), fe(logits), *hf_weights)
    _close(got, want, "bfloat16")
    got = testing.to_numpy(got).astype(np.float32)
    assert np.abs(got - own_bf16.numpy()).max() <= 2.0**-5 * np.abs(want.numpy()).max()


# ------------------------------------------------------------------------------------ ties


def _route_float64(logits, *, top_k, renormalize, num_expert_group=0, topk_group=0, scoring_func="softmax",
                   routed_scaling_factor=1.0, bias=None):
    """DeepSeek/engine grouped top-k in float64 numpy, ties to the lower index (a stable sort)."""
    logits = np.asarray(logits, np.float64)
    if scoring_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    tokens, experts = scores.shape

    def top(values, k):
        return np.argsort(-values, axis=-1, kind="stable")[..., :k]

    if moe_math.uses_groups(experts, num_expert_group, topk_group):
        grouped = choice.reshape(tokens, num_expert_group, -1)
        if bias is None:
            group_scores = grouped.max(-1)
        else:
            group_scores = np.take_along_axis(grouped, top(grouped, 2), -1).sum(-1)
        keep = np.zeros_like(group_scores, bool)
        np.put_along_axis(keep, top(group_scores, topk_group), True, -1)
        choice = np.where(np.repeat(keep, experts // num_expert_group, -1), choice, -np.inf)
    ids = top(choice, top_k)
    weights = np.take_along_axis(scores, ids, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights * routed_scaling_factor, ids


TIE_CASES = [
    # plain top-2: three experts tie for first
    (dict(top_k=2, renormalize=True), [[1.0, 3.0, 3.0, 2.0, 3.0, 1.0, 0.0, 3.0]]),
    # every logit equal: ids 0, 1, 2
    (dict(top_k=3, renormalize=False), [[0.5] * 8]),
    # groups tie (groups 1 and 2 have the same best score; 1 wins), then experts tie inside it
    (dict(top_k=2, renormalize=True, num_expert_group=4, topk_group=1), [[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]),
    # sigmoid, equal scores, a correction bias on the odd experts: every group ties (groups 0, 1
    # kept), experts 1 and 3 lead, then 0 and 2 tie (0 wins); the weights are the unbiased scores
    (dict(top_k=3, renormalize=True, num_expert_group=4, topk_group=2, scoring_func="sigmoid",
          routed_scaling_factor=2.5, bias=[0.0, 0.25, 0.0, 0.25, 0.0, 0.25, 0.0, 0.25]),
     [[0.0] * 8]),
]


@pytest.mark.parametrize("options, logits", TIE_CASES, ids=["top2", "all_equal", "group_tie", "sigmoid_bias"])
def test_ties_go_to_the_lower_index_in_both_frontends(options, logits):
    options = dict(options)
    bias = options.pop("bias", None)
    want_w, want_ids = _route_float64(logits, bias=bias, **options)
    for name, make in (("torch", lambda a: torch.tensor(a, dtype=torch.float32)),
                       ("jax", lambda a: jnp.asarray(a, jnp.float32))):
        from dualop.backends import array_namespace

        arr = make(logits)
        weights, ids = moe_math.route(array_namespace(arr), arr, e_score_correction_bias=None if bias is None else make(bias),
                                      **options)
        np.testing.assert_array_equal(testing.to_numpy(ids), want_ids, err_msg=name)
        np.testing.assert_allclose(testing.to_numpy(weights), want_w, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("pairs", [0, 1, 37, 512])
def test_sort_by_expert_is_numpys_stable_argsort(pairs):
    """Pairs grouped by local expert as numpy's stable argsort orders them (ties keep pair order,
    other devices' pairs (-1) last), and the group sizes as np.bincount counts them, in both
    frontends; jax takes the packed single-operand sort, torch its own stable argsort."""
    from dualop.backends import array_namespace

    num_local, top_k = 6, 2
    ids = np.random.default_rng(pairs).integers(-1, num_local, size=(pairs // top_k + pairs % top_k, top_k))
    flat = ids.reshape(-1)
    want_order = np.argsort(np.where(flat < 0, num_local, flat), kind="stable")
    want_sizes = np.bincount(flat[flat >= 0], minlength=num_local)
    for local_ids in (torch.from_numpy(ids).to(torch.int32), jnp.asarray(ids, dtype=jnp.int32)):
        order, sizes = moe_math.sort_by_expert(array_namespace(local_ids), local_ids, num_local)
        np.testing.assert_array_equal(testing.to_numpy(order), want_order)
        np.testing.assert_array_equal(testing.to_numpy(sizes), want_sizes)
