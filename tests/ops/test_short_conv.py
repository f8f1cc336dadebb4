"""ShortConv (``short_conv``, LFM2): the op and the torch / jax layers against transformers'
``Lfm2ShortConv`` (prefill, and decode through transformers' own cache path), packed sequences
against one call per sequence, bad input. The small cell sweep runs in tests/sweeps/test_cells.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config
from dualop.ops import ShortConv

HIDDEN, L = 16, 3

transformers = pytest.importorskip("transformers")


def _hf_module(bias: bool, seed: int = 0):
    from transformers.models.lfm2.configuration_lfm2 import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    config = Lfm2Config(hidden_size=HIDDEN, conv_L_cache=L, conv_bias=bias, num_hidden_layers=1,
                        layer_types=["conv"], num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
                        intermediate_size=32)
    torch.manual_seed(seed)
    module = Lfm2ShortConv(config, layer_idx=0).eval()
    with torch.no_grad():  # biases are zero at init: make them count
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return config, module


def _op_args(module):
    sd = module.state_dict()
    bias = module.bias
    return dict(in_proj_weight=sd["in_proj.weight"], conv_weight=sd["conv.weight"][:, 0],
                out_proj_weight=sd["out_proj.weight"], conv_bias=sd.get("conv.bias") if bias else None,
                in_proj_bias=sd.get("in_proj.bias") if bias else None,
                out_proj_bias=sd.get("out_proj.bias") if bias else None)


PATHS = [("native", None), ("cpu", "cpu"), ("cuda", "cuda")]


def _run(op, platform, h, **kwargs):
    if platform is None:
        return op.forward_native(h, **kwargs)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        out = op(h, **kwargs)
    assert op.last_run("torch", platform)[0] != "forward_native"
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name, platform", PATHS)
def test_prefill_matches_transformers(bias, name, platform):
    _, module = _hf_module(bias)
    h = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        want = module(h)  # [2, 7, Hd]: two sequences, no cache
    op = ShortConv(HIDDEN, L, bias=bias)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    out, finals = _run(op, platform, h.reshape(14, HIDDEN), cu_seqlens=cu, **_op_args(module))
    np.testing.assert_allclose(out.reshape(2, 7, HIDDEN).numpy(), want.numpy(), atol=1e-5, rtol=1e-4)
    assert finals.shape == (2, HIDDEN, L - 1)


@pytest.mark.parametrize("name, platform", PATHS)
def test_decode_matches_transformers_cache_path(name, platform):
    """Prefill 5 tokens then 3 single-token steps through transformers' own cache (its
    ``causal_conv1d_update`` path) == our prefill into a cache slot then decode steps from it."""
    from transformers.cache_utils import DynamicCache

    config, module = _hf_module(False, seed=1)
    h = torch.randn(1, 8, HIDDEN)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        want = [module(h[:, :5], past_key_values=cache)]
        want += [module(h[:, t:t + 1], past_key_values=cache) for t in range(5, 8)]
    want = torch.cat(want, dim=1)[0]
    op, args = ShortConv(HIDDEN, L), _op_args(module)
    state = torch.zeros(3, HIDDEN, L - 1)
    slot = torch.tensor([2], dtype=torch.int32)
    outs = [_run(op, platform, h[0, :5], conv_state=state, state_indices=slot,
                 has_initial_state=torch.tensor([False]), **args)[0]]
    for t in range(5, 8):
        outs.append(_run(op, platform, h[0, t:t + 1], conv_state=state, state_indices=slot,
                         has_initial_state=torch.tensor([True]), **args)[0])
    np.testing.assert_allclose(torch.cat(outs).numpy(), want.numpy(), atol=1e-5, rtol=1e-4)
    assert not state[:2].any()  # other slots untouched


def test_torch_layer_loads_transformers_state_dict():
    from dualop.torch.layers import ShortConv as ShortConvLayer

    _, module = _hf_module(True, seed=2)
    layer = ShortConvLayer(HIDDEN, L, bias=True)
    layer.load_state_dict(module.state_dict())
    h = torch.randn(1, 9, HIDDEN)
    with torch.no_grad():
        want = module(h)[0]
        out, _ = layer(h[0])
    np.testing.assert_allclose(out.numpy(), want.numpy(), atol=1e-5, rtol=1e-4)


def test_jax_layer_loads_transformers_state_dict():
    pytest.importorskip("flax")
    import jax.numpy as jnp

    from dualop.jax.layers import ShortConv as ShortConvLayer

    _, module = _hf_module(False, seed=3)
    layer = ShortConvLayer(HIDDEN, L, bias=False)
    layer.load_state_dict(module.state_dict())
    h = torch.randn(1, 6, HIDDEN)
    with torch.no_grad():
        want = module(h)[0]
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        out, finals = layer(jnp.asarray(h[0].numpy()))
    np.testing.assert_allclose(np.asarray(out), want.numpy(), atol=1e-5, rtol=1e-4)
    assert finals.shape == (1, HIDDEN, L - 1)


@pytest.mark.parametrize("bias, change, error, match", [
    (False, lambda a: {**a, "in_proj_weight": a["in_proj_weight"][:20]}, ValueError, "'in_proj_weight'"),
    (False, lambda a: {**a, "conv_weight": None}, TypeError, "'conv_weight' is required"),
    (False, lambda a: {**a, "conv_bias": torch.zeros(HIDDEN)}, ValueError, "'conv_bias' must be None"),
    (True, lambda a: {**a, "out_proj_bias": None}, ValueError, "'out_proj_bias' is required"),
    (False, lambda a: {**a, "hidden_states": a["hidden_states"].to(torch.bfloat16)}, TypeError, "dtype"),
])
def test_bad_input_names_op_and_argument(bias, change, error, match):
    _, module = _hf_module(bias)
    args = change(dict(hidden_states=torch.randn(4, HIDDEN), **_op_args(module)))
    with pytest.raises(error, match=match) as info:
        ShortConv(HIDDEN, L, bias=bias)(**args)
    assert "short_conv" in str(info.value)
