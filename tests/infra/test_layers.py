"""Layers for both frontends: they own their parameters, call the op (so config and dispatch
apply), and work under torch.compile / nnx.jit and grad."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch
from flax import nnx

from dualop import OpsConfig, dispatch_report, override_platform, set_config, testing

jnp = jax.numpy

from dualop.jax import layers as jl  # noqa: E402
from dualop.torch import layers as tl  # noqa: E402


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_torch_norm_layers_own_their_weights():
    norm, gemma = tl.RMSNorm(64, eps=1e-5), tl.GemmaRMSNorm(64)
    assert set(norm.state_dict()) == {"weight"} and torch.equal(norm.weight, torch.ones(64))
    assert torch.equal(gemma.weight, torch.zeros(64))
    assert tl.RMSNorm(64, has_weight=False).weight is None
    assert tl.RMSNorm(64, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    x, r = torch.from_numpy(_x(3, 64)), torch.from_numpy(_x(3, 64, seed=1))
    with torch.no_grad():
        norm.weight.mul_(2)
    out, res = norm(x, r)
    want_out, want_res = norm.op.forward_native(x, norm.weight, r)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(res, want_res)


def test_gated_norm_layers():
    x, z = _x(3, 48), _x(3, 48, seed=2)
    t = tl.RMSNormGated(48, group_size=16, norm_before_gate=True)
    torch.testing.assert_close(t(torch.from_numpy(x), torch.from_numpy(z)),
                               t.op.forward_native(torch.from_numpy(x), torch.ones(48), torch.from_numpy(z)))
    j = jl.RMSNormGated(48, group_size=16)
    want = j.op.forward_native(jnp.asarray(x), jnp.ones(48), jnp.asarray(z))
    assert testing.compare(np.asarray(j(jnp.asarray(x), jnp.asarray(z))), np.asarray(want), "float32").ok


def test_torch_activation_layers_in_sequential():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), tl.SiluAndMul(), torch.nn.Linear(16, 8))
    assert model(torch.randn(4, 16)).shape == (4, 8)
    for layer, width in ((tl.MulAndSilu(), 32), (tl.GeluAndMul("tanh"), 32), (tl.GeluAndMulSparse(0.9), 32),
                         (tl.FatreluAndMul(0.1), 32), (tl.SwigluOAIAndMul(), 32)):
        x = torch.from_numpy(_x(3, width))
        torch.testing.assert_close(layer(x), layer.op.forward_native(x))


def test_torch_layers_follow_the_config():
    norm = tl.RMSNorm(32)
    x = torch.randn(2, 32)
    with override_platform("cpu"):
        with set_config(OpsConfig(["none"])):
            norm(x)
            assert {r["method"] for r in dispatch_report()} == {"forward_native"}
        with set_config(OpsConfig(["none", "+rms_norm"])), torch.no_grad():
            norm(x)
            assert {r["method"] for r in dispatch_report()} == {"forward_cpu"}
        with set_config(OpsConfig(["none", "+rms_norm"])):
            norm(x)  # the weight is a Parameter: autograd records, the C++ kernel declines and says why
            (row,) = dispatch_report()
            assert row["method"] == "forward_native" and "autograd is recording" in row["reason"]


def test_torch_layers_compile_fullgraph_and_train():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), tl.SiluAndMul(), tl.RMSNorm(32))
    x = torch.randn(4, 32)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    compiled(x).square().sum().backward()
    assert model[2].weight.grad is not None and model[0].weight.grad is not None


def test_jax_norm_layers_own_their_params():
    norm, gemma = jl.RMSNorm(64), jl.GemmaRMSNorm(64)
    params = nnx.state(norm, nnx.Param)
    assert [p.shape for p in jax.tree.leaves(params)] == [(64,)]
    assert jnp.all(gemma.weight[...] == 0)
    assert jl.RMSNorm(64, has_weight=False).weight is None
    x = jnp.asarray(_x(3, 64))
    out = norm(x)
    assert jnp.allclose(out, norm.op.forward_native(x, jnp.ones(64)))


@pytest.mark.parametrize("platform, method", [("cpu", "forward_native"), ("tpu", "forward_tpu")])
def test_jax_layers_under_nnx_jit_and_grad(platform, method):
    x = jnp.asarray(_x(5, 64))
    norm = jl.GemmaRMSNorm(64)
    norm.weight[...] = jnp.linspace(-0.5, 0.5, 64)

    @nnx.jit
    def apply(m, v):
        return m(v)

    def loss(m, v):
        return jnp.sum(m(v) ** 2)

    with override_platform(platform), set_config(OpsConfig(["all"])):
        out = apply(norm, x)
        grads = nnx.grad(loss)(norm, x)
    want = norm.op.forward_native(x, norm.weight[...])
    assert testing.compare(np.asarray(out), np.asarray(want), "float32").ok
    want_grad = jax.grad(lambda w: jnp.sum(norm.op.forward_native(x, w) ** 2))(norm.weight[...])
    assert testing.compare(np.asarray(grads["weight"][...]), np.asarray(want_grad), "float32").ok
    assert {r["method"] for r in dispatch_report()} == {method}  # no CPU kernel for jax arrays


def test_jax_activation_layers():
    x = jnp.asarray(_x(3, 32))
    for layer in (jl.SiluAndMul(), jl.MulAndSilu(), jl.GeluAndMul(), jl.GeluAndMulSparse(0.8),
                  jl.FatreluAndMul(0.2), jl.SwigluOAIAndMul()):
        assert testing.compare(np.asarray(layer(x)), np.asarray(layer.op.forward_native(x)), "float32").ok


def test_pointwise_layers_both_frontends():
    x = _x(4, 40) * 2
    for name in ("NewGELU", "FastGELU", "QuickGELU", "ReLUSquaredActivation"):
        t, j = getattr(tl, name)(), getattr(jl, name)()
        torch.testing.assert_close(t(torch.from_numpy(x)), t.op.forward_native(torch.from_numpy(x)))
        assert testing.compare(np.asarray(j(jnp.asarray(x))), np.asarray(j.op.forward_native(jnp.asarray(x))), "float32").ok


def test_xielu_layers_own_and_train_their_alphas():
    x = _x(4, 40) * 2
    t = tl.XIELU()
    assert set(t.state_dict()) == {"alpha_p", "alpha_n"}
    out = t(torch.from_numpy(x))
    torch.testing.assert_close(out, t.op.forward_native(torch.from_numpy(x), t.alpha_p, t.alpha_n))
    out.sum().backward()
    assert t.alpha_p.grad is not None and t.alpha_n.grad is not None
    j = jl.XIELU()
    assert float(j.alpha_p[...][0]) == pytest.approx(t.op.initial_parameters()[0], rel=1e-6)
    grads = nnx.grad(lambda m, v: jnp.sum(m(v)))(j, jnp.asarray(x))
    assert set(grads) == {"alpha_p", "alpha_n"}


def test_quant_layers():
    x = _x(4, 256)
    t, j = tl.QuantFP8(False, "per_token"), jl.QuantFP8(False, "per_token")
    q, scale = t(torch.from_numpy(x))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    jq, jscale = j(jnp.asarray(x))
    assert np.array_equal(np.asarray(jscale), scale.numpy())
    assert np.array_equal(np.asarray(jq.astype(jnp.float32)), q.float().numpy())


def test_jax_checkpoint_loading_refuses_whole_or_not_at_all():
    """A state dict with one bad entry (a wrong shape, then a key for a bias the layer lacks) is
    refused naming the key, and no parameter was written before the refusal."""
    layer = jl.RelPosAttention(16, num_heads=2, use_rel_pos=True, input_size=(4, 4), rngs=nnx.Rngs(0))
    before = {name: np.asarray(getattr(layer, name)[...]) for name in jl.RelPosAttention._HF_KEYS}
    good = {key: np.full(before[name].shape, 0.5, np.float32) for name, key in jl.RelPosAttention._HF_KEYS.items()}
    with pytest.raises(ValueError, match=r"RelPosAttention.load_state_dict: 'rel_pos_w' has shape \(3, 8\)"):
        layer.load_state_dict({**good, "rel_pos_w": np.zeros((3, 8), np.float32)})
    assert all(np.array_equal(getattr(layer, n)[...], v) for n, v in before.items())
    conv = jl.ShortConv(8, 3, bias=False, rngs=nnx.Rngs(0))
    names = [name for name in jl.ShortConv._HF_KEYS if getattr(conv, name) is not None]
    conv_before = {name: np.asarray(getattr(conv, name)[...]) for name in names}
    weights = {jl.ShortConv._HF_KEYS[name]: np.full((8, 1, 3) if name == "conv_weight" else conv_before[name].shape,
                                                    0.25, np.float32) for name in names}
    with pytest.raises(ValueError, match=r"ShortConv.load_state_dict: 'conv.bias' given but the layer has no conv_bias"):
        conv.load_state_dict({**weights, "conv.bias": np.ones(8, np.float32)})
    assert all(np.array_equal(getattr(conv, n)[...], v) for n, v in conv_before.items())
    layer.load_state_dict(good)
    assert all(np.all(np.asarray(getattr(layer, n)[...]) == 0.5) for n in before)
