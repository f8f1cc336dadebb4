"""Each class the dualop plugin replaces, built the way vLLM's models build it (its constructor, or
vLLM's own ``get_rope`` for every rope scaling), gives through dualop's kernel what vLLM's own
native body gives, with the parameters vLLM's loader fills; in the 'vllm' environment."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.vllm_env

pytest.importorskip("vllm", reason="vLLM is installed in the 'vllm' environment (scripts/env.sh vllm)")
import torch  # noqa: E402  (vLLM brings it)


@pytest.fixture(scope="module")
def vllm_context(tmp_path_factory):
    """vLLM's config and a one-process tensor-parallel group (its layers ask for their rank)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (cleanup_dist_env_and_memory, init_distributed_environment,
                                  initialize_model_parallel)

    from dualop import vllm_plugin

    vllm_plugin.register()
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1)
        yield
        cleanup_dist_env_and_memory()


def _t(rng, *shape, scale=1.0):
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))


def _randomize(module, rng):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(_t(rng, *p.shape, scale=0.5) + (1.0 if p.ndim == 1 else 0.0))


def _rope(rope_parameters, *, neox=True, head=64, max_position=256):
    def make():
        from vllm.model_executor.layers.rotary_embedding import get_rope

        return get_rope(head, max_position, neox, dict(rope_parameters), torch.float32)
    return make


def _rope_inputs(rng):
    positions = torch.from_numpy(rng.integers(0, 256, 7))
    return positions, _t(rng, 7, 4 * 64), _t(rng, 7, 2 * 64)


def _mla_rope_inputs(rng):
    """DeepSeek's rope takes q_pe [T, H, R] and k_pe [T, 1, R], as its attention passes them."""
    positions = torch.from_numpy(rng.integers(0, 256, 7))
    return positions, _t(rng, 7, 4, 64), _t(rng, 7, 1, 64)


def _vllm(module_path, name, *args, **kwargs):
    def make():
        import importlib

        return getattr(importlib.import_module(module_path), name)(*args, **kwargs)
    return make


_ACT = "vllm.model_executor.layers.activation"
_ROPE_COMMON = "vllm.model_executor.layers.rotary_embedding.common"


def _quant_fp8(static, shape):
    def make():
        from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
        from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

        return QuantFP8(static, getattr(GroupShape, shape))
    return make


def _cos_sin(rng):
    angles = torch.from_numpy(rng.uniform(0, 3, (5, 8)).astype(np.float32))
    return angles.cos(), angles.sin()
_NORM = "vllm.model_executor.layers.layernorm"
_LINEAR = "vllm.model_executor.layers.linear"

# id -> (make the vLLM module, make its forward arguments)
CASES = {
    "rms_norm": (_vllm(_NORM, "RMSNorm", 64, eps=1e-5), lambda rng: (_t(rng, 5, 64, scale=3.0),)),
    "rms_norm[residual]": (_vllm(_NORM, "RMSNorm", 64, eps=1e-5), lambda rng: (_t(rng, 5, 64), _t(rng, 5, 64))),
    "gemma_rms_norm": (_vllm(_NORM, "GemmaRMSNorm", 64), lambda rng: (_t(rng, 5, 64), _t(rng, 5, 64))),
    **{name: (_vllm(_ACT, cls, *args), lambda rng: (_t(rng, 5, 64, scale=3.0),)) for name, cls, args in (
        ("silu_and_mul", "SiluAndMul", ()), ("mul_and_silu", "MulAndSilu", ()), ("gelu_and_mul", "GeluAndMul", ()),
        ("gelu_and_mul[tanh]", "GeluAndMul", ("tanh",)), ("gelu_new", "NewGELU", ()), ("gelu_fast", "FastGELU", ()),
        ("quick_gelu", "QuickGELU", ()), ("relu2", "ReLUSquaredActivation", ()),
        ("swigluoai_and_mul", "SwigluOAIAndMul", ()), ("fatrelu_and_mul", "FatreluAndMul", (0.3,)),
        ("gelu_and_mul_sparse", "GeluAndMulSparse", (0.95,)), ("silu_and_mul_with_clamp", "SiluAndMulWithClamp",
                                                               (3.0, 1.702, 1.0)),
        ("swiglustep_and_mul", "SwigluStepAndMul", (3.0,)), ("situ_and_mul", "SituAndMul", (2.0, 3.0)),
        ("situ_and_mul[no linear_beta]", "SituAndMul", (2.0,)), ("gelu", "GELU", ()), ("gelu_tanh", "GELUTanh", ()))},
    "mixer2_gated_rms_norm": (_vllm("vllm.model_executor.layers.mamba.mamba_mixer2", "Mixer2RMSNormGated", 64, 2),
                              lambda rng: (_t(rng, 5, 64), _t(rng, 5, 64))),
    "rope[deepseek_yarn]": (_rope({"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0},
                                  neox=False), _mla_rope_inputs),
    **{f"rope[{kind}]": (_rope(params, neox=neox), _rope_inputs) for kind, params, neox in (
        ("default", {"rope_type": "default", "rope_theta": 10000.0}, True),
        ("gptj", {"rope_type": "default", "rope_theta": 10000.0}, False),
        ("linear", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, True),
        ("yarn", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
         True),
        ("llama3", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, True))},
    "rms_norm_gated": (_vllm(_NORM, "RMSNormGated", 64, group_size=32, norm_before_gate=True),
                       lambda rng: (_t(rng, 5, 64), _t(rng, 5, 64))),
    "rms_norm_gated[no gate]": (_vllm(_NORM, "RMSNormGated", 64), lambda rng: (_t(rng, 5, 64),)),
    "conv2d": (_vllm("vllm.model_executor.layers.conv", "Conv2dLayer", 3, 8, (2, 2), stride=(2, 2)),
               lambda rng: (_t(rng, 2, 3, 4, 6),)),
    "conv3d": (_vllm("vllm.model_executor.layers.conv", "Conv3dLayer", 3, 8, (1, 2, 2), stride=(1, 2, 2), bias=False),
               lambda rng: (_t(rng, 1, 3, 2, 4, 4),)),
    "grouped_topk": (_vllm("vllm.model_executor.layers.fused_moe.router.grouped_topk_router", "GroupedTopk", 2, True,
                           num_expert_group=2, topk_group=1, scoring_func="sigmoid"),
                     lambda rng: (_t(rng, 6, 16), _t(rng, 6, 8), _t(rng, 8, scale=0.1))),
    "apply_rotary_emb": (_vllm(_ROPE_COMMON, "ApplyRotaryEmb", is_neox_style=False, enable_fp32_compute=True),
                         lambda rng: (_t(rng, 2, 5, 3, 16), *_cos_sin(rng))),
    "mm_encoder_attn": (_vllm("vllm.model_executor.layers.attention.mm_encoder_attention", "MMEncoderAttention", 2, 16,
                              num_kv_heads=1, prefix="visual.blocks.0.attn"),
                        lambda rng: (_t(rng, 1, 12, 32), _t(rng, 1, 12, 16), _t(rng, 1, 12, 16),
                                     torch.tensor([0, 3, 7, 12], dtype=torch.int32), torch.tensor(5))),
    "mm_encoder_attn[batched]": (_vllm("vllm.model_executor.layers.attention.mm_encoder_attention",
                                       "MMEncoderAttention", 2, 16),
                                 lambda rng: (_t(rng, 2, 6, 2, 16), _t(rng, 2, 6, 2, 16), _t(rng, 2, 6, 2, 16))),
    **{f"quant_fp8[{label}]": (_quant_fp8(static, shape), inputs) for label, static, shape, inputs in (
        ("dynamic per token", False, "PER_TOKEN", lambda rng: (_t(rng, 5, 64, scale=3.0),)),
        ("dynamic per token, ub", False, "PER_TOKEN", lambda rng: (_t(rng, 5, 64, scale=3.0), None,
                                                                   torch.tensor([2.0]))),
        ("static per tensor", True, "PER_TENSOR", lambda rng: (_t(rng, 5, 64, scale=3.0), torch.tensor([0.02]))))},
    "replicated_linear": (_vllm(_LINEAR, "ReplicatedLinear", 64, 48, bias=True), lambda rng: (_t(rng, 5, 64),)),
    "column_parallel_linear": (_vllm(_LINEAR, "ColumnParallelLinear", 64, 48, bias=True, skip_bias_add=True),
                               lambda rng: (_t(rng, 5, 64),)),
    "qkv_parallel_linear": (_vllm(_LINEAR, "QKVParallelLinear", 64, 16, 4, 2, bias=False), lambda rng: (_t(rng, 5, 64),)),
    "row_parallel_linear": (_vllm(_LINEAR, "RowParallelLinear", 64, 48, bias=True), lambda rng: (_t(rng, 5, 64),)),
}


# Classes the plugin leaves to vLLM, built as vLLM builds them, and why (logged by the plugin).
DECLINED = {
    "rope[dynamic]": (_rope({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
                      "max_trained_positions=256 has no counterpart"),
}


def _assert_close(got, want):
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want)
        for g, w in zip(got, want):
            _assert_close(g, w)
    elif want is None:
        assert got is None
    elif want.dtype.itemsize == 1 and want.is_floating_point():  # float8: the same codes
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    else:
        # two float32 implementations: reductions in other orders; rope tables of angles up to 255 rad
        # (base 500000) rounded apart by ~3e-5
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_replacement_gives_vllms_result(vllm_context, case):
    from dualop import vllm_plugin

    make, inputs = CASES[case]
    module = make()
    name = type(module).__name__
    assert name.startswith("Dualop"), f"{case}: vLLM built its own {name} (not replaced)"
    assert module._dualop_op is not None, vllm_plugin.not_replaced()
    rng = np.random.default_rng(0)
    _randomize(module, rng)
    args = inputs(rng)
    vllm_class = type(module).vllm_class
    clone = lambda a: None if a is None else a.clone()  # noqa: E731
    own = super(type(module), module)  # vLLM's methods, bound (static ones too)
    with torch.no_grad():
        if hasattr(vllm_class, "forward_native"):
            got = module.forward_cpu(*map(clone, args))
            want = own.forward_native(*map(clone, args))
        else:  # a PluggableLayer: vLLM's forward with its own unquantized GEMM (F.linear)
            got = module.forward(*args)
            module.cpu_linear = torch.nn.functional.linear  # what vLLM's CPU loader would set
            want = own.forward(*args)
    if math.isnan(sum(float(a.float().sum()) for a in args if a is not None)):
        pytest.fail("inputs hold NaN")
    _assert_close(got, want)


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_what_dualop_does_not_serve_keeps_vllms_methods(vllm_context, case):
    from dualop import vllm_plugin

    make, why = DECLINED[case]
    module = make()
    assert module._dualop_op is None
    assert why in vllm_plugin.not_replaced()[type(module).vllm_class.__name__]
    rng = np.random.default_rng(0)
    args = _rope_inputs(rng)
    with torch.no_grad():
        _assert_close(module.forward_cpu(*[a.clone() for a in args]),
                      super(type(module), module).forward_cpu(*[a.clone() for a in args]))
