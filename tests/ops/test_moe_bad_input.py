"""Bad input to the MoE ops (grouped_topk, unquantized_fused_moe, fused_moe, transformers_fused_moe)
raises ValueError/TypeError naming the op and the argument, before any kernel launches (every
kernel reference is made to fail if resolved), on every platform path, torch and jax alike."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp
import torch

from dualop import OpsConfig, override_platform, set_config
from dualop.ops import FusedMoE, GroupedTopk, TransformersFusedMoE, UnquantizedFusedMoEMethod
from dualop.ops import moe as moe_mod


@pytest.fixture(autouse=True)
def no_kernel_may_launch(monkeypatch):
    """Every MoE kernel reference raises if resolved: validation must stop bad input first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (moe_mod._PALLAS_TOPK, moe_mod._TRITON_TOPK, moe_mod._PALLAS_EXPERTS, moe_mod._TRITON_EXPERTS,
                moe_mod._CPU_EXPERTS, moe_mod._RAGGED_EXPERTS):
        monkeypatch.setattr(ref, "resolve", forbidden)
    with set_config(OpsConfig(["all"])):
        yield


PLATFORMS = ["cpu", "cuda", "tpu"]
E, K, H, I, T = 8, 2, 32, 16, 5


def _t(*shape, dtype="float32"):
    return torch.zeros(shape, dtype=getattr(torch, dtype))


def _j(*shape, dtype="float32"):
    return jnp.zeros(shape, dtype)


def _ids(make, values):
    a = np.asarray(values, np.int32)
    return torch.from_numpy(a) if make is _t else jnp.asarray(a)


def _moe_args(make, **over):
    """A valid fused_moe call (silu, no biases); ``over`` replaces arguments by name."""
    args = dict(hidden_states=make(T, H), router_logits=make(T, E), w13=make(E, 2 * I, H), w2=make(E, H, I),
                w13_bias=None, w2_bias=None, e_score_correction_bias=None, expert_map=None)
    args.update(over)
    return args


def _experts_args(make, **over):
    args = dict(x=make(T, H), topk_weights=make(T, K), topk_ids=_ids(make, np.zeros((T, K))), w13=make(E, 2 * I, H),
                w2=make(E, H, I), w13_bias=None, w2_bias=None, expert_map=None)
    args.update(over)
    return args


pytestmark = pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])


@pytest.fixture(params=PLATFORMS)
def platform(request):
    with override_platform(request.param):
        yield request.param


def test_top_k_more_than_the_experts(make, platform):
    with pytest.raises(ValueError, match=r"fused_moe: top_k=9 is more than num_experts=8"):
        FusedMoE(E, 9, H, I)
    with pytest.raises(ValueError, match=r"grouped_topk: topk=9 is more than the 8 experts of 'gating_output'"):
        GroupedTopk(9, True)(make(T, H), make(T, E))


def test_w13_and_w2_disagree(make, platform):
    op = FusedMoE(E, K, H, I)
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w13' has shape \(8, 32, 24\); expected \[experts, rows, 32\]"):
        op(**_moe_args(make, w13=make(E, 2 * I, 24)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w2' has shape \(8, 24, 16\); expected \(8, 32, 16\)"):
        op(**_moe_args(make, w2=make(E, 24, I)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w2' has intermediate size 12; expected 16"):
        op(**_moe_args(make, w2=make(E, H, 12)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w13' has 16 rows per expert; expected 32 \(2 \* the intermediate size 16 of 'w2'"):
        op(**_moe_args(make, w13=make(E, I, H)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w2' has shape \(4, 32, 16\); expected \(8, 32, 16\)"):
        op(**_moe_args(make, w2=make(4, H, I)))
    with pytest.raises(ValueError, match=r"unquantized_fused_moe: argument 'w13' has shape \(8, 32, 24\)"):
        UnquantizedFusedMoEMethod()(**_experts_args(make, w13=make(E, 2 * I, 24)))


def test_hidden_states_disagree_with_the_layer(make, platform):
    with pytest.raises(ValueError, match=r"fused_moe: argument 'hidden_states' has hidden size 24; expected 32"):
        FusedMoE(E, K, H, I)(**_moe_args(make, hidden_states=make(T, 24)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'hidden_states' must be \[tokens, hidden\]"):
        FusedMoE(E, K, H, I)(**_moe_args(make, hidden_states=make(1, T, H)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'router_logits' has shape \(5, 6\); expected \(5, 8\)"):
        FusedMoE(E, K, H, I)(**_moe_args(make, router_logits=make(T, 6)))


def test_weight_dtypes(make, platform):
    with pytest.raises(TypeError, match=r"fused_moe: argument 'w13' has dtype bfloat16; expected float32 \(the dtype of 'hidden_states'\)"):
        FusedMoE(E, K, H, I)(**_moe_args(make, w13=make(E, 2 * I, H, dtype="bfloat16")))
    with pytest.raises(TypeError, match=r"fused_moe: argument 'hidden_states' has dtype int32"):
        FusedMoE(E, K, H, I)(**_moe_args(make, hidden_states=make(T, H, dtype="int32")))


def test_weight_on_input_needs_top_k_1(make, platform):
    with pytest.raises(ValueError, match=r"fused_moe: apply_router_weight_on_input=True needs top_k == 1, got top_k=2"):
        FusedMoE(E, 2, H, I, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match=r"unquantized_fused_moe: apply_router_weight_on_input needs top_k == 1; 'topk_ids' has top_k 2"):
        UnquantizedFusedMoEMethod("silu", True)(**_experts_args(make))


def test_expert_map_length_and_dtype(make, platform):
    local = make(4, 2 * I, H), make(4, H, I)
    op = FusedMoE(E, K, H, I)
    with pytest.raises(ValueError, match=r"fused_moe: argument 'expert_map' has length 6; expected num_experts=8"):
        op(**_moe_args(make, w13=local[0], w2=local[1], expert_map=_ids(make, [0, 1, 2, 3, -1, -1])))
    with pytest.raises(TypeError, match=r"fused_moe: argument 'expert_map' has dtype float32; expected one of int32, int64"):
        op(**_moe_args(make, w13=local[0], w2=local[1], expert_map=make(E)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'expert_map' must be 1-D"):
        op(**_moe_args(make, w13=local[0], w2=local[1], expert_map=_ids(make, np.zeros((2, 4)))))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'expert_map' holds 4; expected -1 \(elsewhere\) or a local expert index in \[0, 4\)"):
        op(**_moe_args(make, w13=local[0], w2=local[1], expert_map=_ids(make, [0, 1, 2, 3, 4, -1, -1, -1])))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w13' holds 4 experts; expected num_experts=8 \(pass expert_map"):
        op(**_moe_args(make, w13=local[0], w2=local[1]))


def test_ids_out_of_range(make, platform):
    op = UnquantizedFusedMoEMethod()
    ids = np.zeros((T, K), np.int32)
    ids[3, 1] = E
    with pytest.raises(ValueError, match=r"unquantized_fused_moe: argument 'topk_ids' holds expert 8; expected ids in \[0, 8\)"):
        op(**_experts_args(make, topk_ids=_ids(make, ids)))
    ids[3, 1] = -2
    with pytest.raises(ValueError, match=r"unquantized_fused_moe: argument 'topk_ids' holds expert -2"):
        op(**_experts_args(make, topk_ids=_ids(make, ids)))
    with pytest.raises(TypeError, match=r"unquantized_fused_moe: argument 'topk_ids' has dtype float32; expected one of int32, int64"):
        op(**_experts_args(make, topk_ids=make(T, K)))
    with pytest.raises(ValueError, match=r"unquantized_fused_moe: argument 'topk_weights' has shape \(5, 3\); expected \(5, 2\)"):
        op(**_experts_args(make, topk_weights=make(T, 3)))


def test_bias_shapes(make, platform):
    op = FusedMoE(E, K, H, I, has_bias=True)
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w13_bias' has shape \(8, 16\); expected \(8, 32\)"):
        op(**_moe_args(make, w13_bias=make(E, I), w2_bias=make(E, H)))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'w2_bias' has shape \(8, 16\); expected \(8, 32\)"):
        op(**_moe_args(make, w13_bias=make(E, 2 * I), w2_bias=make(E, I)))
    with pytest.raises(ValueError, match=r"fused_moe: has_bias=True needs 'w13_bias' and 'w2_bias'"):
        op(**_moe_args(make))
    with pytest.raises(ValueError, match=r"fused_moe: argument 'e_score_correction_bias' has shape \(4,\); expected \(8,\)"):
        FusedMoE(E, K, H, I)(**_moe_args(make, e_score_correction_bias=make(4)))
    with pytest.raises(ValueError, match=r"grouped_topk: argument 'e_score_correction_bias' has shape \(4,\); expected \(8,\)"):
        GroupedTopk(K, True)(make(T, H), make(T, E), make(4))


def test_scoring_func_and_activation(make, platform):
    with pytest.raises(ValueError, match=r"grouped_topk: argument 'scoring_func' is 'tanh'; expected one of 'softmax', 'sigmoid'"):
        FusedMoE(E, K, H, I, scoring_func="tanh")
    with pytest.raises(ValueError, match=r"unquantized_fused_moe: argument 'activation' is 'swiglu'; expected one of 'silu', 'gelu'"):
        FusedMoE(E, K, H, I, activation="swiglu")
    with pytest.raises(ValueError, match=r"fused_moe: use_grouped_topk=True needs num_expert_group and topk_group"):
        FusedMoE(E, K, H, I, use_grouped_topk=True)


def test_mixed_frontends(make, platform):
    other = _j if make is _t else _t
    with pytest.raises(TypeError, match=r"fused_moe: argument 'w2' is a (jax|torch) array but 'hidden_states' is a (torch|jax) array"):
        FusedMoE(E, K, H, I)(**_moe_args(make, w2=other(E, H, I)))


def test_transformers_layout_errors(make, platform):
    """transformers_fused_moe names transformers' arguments and the layout it expected."""
    hidden = 24
    op = TransformersFusedMoE(E, K, hidden, I, activation="swigluoai", has_bias=True, is_transposed=True,
                              is_concatenated=False)
    good = dict(hidden_states=make(T, hidden), router_logits=make(T, E), gate_up_proj=make(E, hidden, 2 * I),
                down_proj=make(E, I, hidden), gate_up_proj_bias=make(E, 2 * I), down_proj_bias=make(E, hidden))
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'gate_up_proj' has shape \(8, 32, 24\); "
                                         r"expected \(8, 24, 32\) .*is_transposed=True"):
        op(**{**good, "gate_up_proj": make(E, 2 * I, hidden)})  # the untransposed layout given to a transposed op
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'down_proj' has shape \(8, 24, 16\); "
                                         r"expected \(8, 16, 24\)"):
        op(**{**good, "down_proj": make(E, hidden, I)})
    with pytest.raises(TypeError, match=r"transformers_fused_moe: argument 'down_proj' has dtype bfloat16; expected float32"):
        op(**{**good, "down_proj": make(E, I, hidden, dtype="bfloat16")})
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'gate_up_proj_bias' has shape \(8, 16\); expected \(8, 32\)"):
        op(**{**good, "gate_up_proj_bias": make(E, I)})
    with pytest.raises(ValueError, match=r"transformers_fused_moe: has_bias=True needs 'gate_up_proj_bias' and 'down_proj_bias'"):
        op(**{**good, "down_proj_bias": None})
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'router_logits' has shape \(5, 4\); expected \(5, 8\)"):
        op(**{**good, "router_logits": make(T, 4)})
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'expert_map' has length 4; expected num_experts=8"):
        op(**{**good, "expert_map": _ids(make, [0, 1, 2, 3])})
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'gate_up_proj' holds 8 experts; expected num_experts=16"):
        TransformersFusedMoE(16, K, hidden, I, activation="swigluoai", has_bias=True, is_transposed=True)(**good)
    with pytest.raises(TypeError, match=r"transformers_fused_moe: argument 'gate_up_proj' is required"):
        op(**{**good, "gate_up_proj": None})
    with pytest.raises(TypeError, match=r"transformers_fused_moe: argument 'is_transposed' must be a bool"):
        TransformersFusedMoE(E, K, H, I, is_transposed="yes")
    with pytest.raises(ValueError, match=r"transformers_fused_moe: top_k=9 is more than num_experts=8"):
        TransformersFusedMoE(E, 9, H, I)


def test_the_guard_bites_on_a_valid_call(make):
    """The fixture is real: a valid call does reach a (forbidden) kernel (torch: the CPU and Triton
    paths; plain torch tensors have no TPU bridge. jax: Pallas and ragged_dot)."""
    for platform in (("cpu", "cuda") if make is _t else ("cpu", "tpu")):
        with override_platform(platform), pytest.raises(AssertionError, match="a kernel was reached"):
            UnquantizedFusedMoEMethod()(**_experts_args(make))
