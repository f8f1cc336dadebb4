"""Native bodies against code nobody here wrote: Hugging Face transformers' modules and functions
(Llama and Gemma RMS norms, ACT2FN activations, Gemma 3n's gaussian top-k, gpt-oss's gate), and
jax.nn on the JAX side. transformers is a test-only dependency (dualop[dev])."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import jax
import torch
import transformers

from dualop import ops, testing

jnp = jax.numpy
from transformers.activations import ACT2FN  # noqa: E402

# Against transformers (the same version in both environments): run once, in 'latest' (conftest).
pytestmark = pytest.mark.reference


def _data(shape, seed=0, scale=2.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


def _close(got, want, dtype="float32"):
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_matches_llama(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 200
    ref = LlamaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(1 + 0.3 * _data((hidden,), 1)))
    ref = ref.to(getattr(torch, dtype))
    x = torch.from_numpy(_data((2, 7, hidden))).to(getattr(torch, dtype))
    with torch.no_grad():
        want = ref(x)
    _close(ops.RMSNorm(hidden).forward_native(x, ref.weight.detach()), want, dtype)
    _close(ops.RMSNorm(hidden).forward_native(jnp.asarray(testing.to_numpy(x)).astype(dtype),
                                              jnp.asarray(testing.to_numpy(ref.weight)).astype(dtype)), want, dtype)


def test_fused_add_rms_norm_matches_llama_on_the_sum():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(96)
    x, r = (torch.from_numpy(_data((5, 96), s)) for s in (0, 1))
    out, res = ops.RMSNorm(96).forward_native(x, ref.weight.detach(), r)
    with torch.no_grad():
        _close(out, ref(x + r))
    _close(res, x + r)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_rms_norm_matches_gemma(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hidden = 136
    ref = GemmaRMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(0.3 * _data((hidden,), 2)))
    x = torch.from_numpy(_data((9, hidden))).to(getattr(torch, dtype))
    with torch.no_grad():
        want = ref(x)
    _close(ops.GemmaRMSNorm(hidden).forward_native(x, ref.weight.detach()), want, dtype)


@pytest.mark.parametrize(
    "op, act, first",
    [
        (ops.SiluAndMul(), "silu", True),
        (ops.MulAndSilu(), "silu", False),
        (ops.GeluAndMul(), "gelu", True),
        (ops.GeluAndMul("tanh"), "gelu_pytorch_tanh", True),
    ],
    ids=["silu_and_mul", "mul_and_silu", "gelu_and_mul", "gelu_and_mul_tanh"],
)
def test_gated_activations_match_act2fn(op, act, first):
    x = torch.from_numpy(_data((6, 2 * 100)))
    a, b = x[..., :100], x[..., 100:]
    fn = ACT2FN[act]
    want = fn(a) * b if first else a * fn(b)
    _close(op.forward_native(x), want)


@pytest.mark.parametrize("sparsity, approximate", [(0.95, "none"), (0.5, "tanh")])
def test_gelu_and_mul_sparse_matches_gemma3n(sparsity, approximate):
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

    x = torch.from_numpy(_data((4, 2 * 128)))
    gate = Gemma3nTextMLP._gaussian_topk(SimpleNamespace(activation_sparsity=sparsity), x[..., :128])
    act = ACT2FN["gelu" if approximate == "none" else "gelu_pytorch_tanh"]
    _close(ops.GeluAndMulSparse(sparsity, approximate).forward_native(x), act(gate) * x[..., 128:])


def test_swigluoai_matches_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x = torch.from_numpy(_data((5, 2 * 72), scale=6.0))  # beyond the clamp limit on both sides
    want = GptOssExperts._apply_gate(SimpleNamespace(alpha=1.702, limit=7.0), x)
    _close(ops.SwigluOAIAndMul().forward_native(x), want)


def test_fatrelu_matches_torch_threshold():
    x = torch.from_numpy(_data((5, 2 * 64)))
    want = torch.nn.functional.threshold(x[..., :64], 0.3, 0.0) * x[..., 64:]
    _close(ops.FatreluAndMul(0.3).forward_native(x), want)


def test_jax_side_matches_jax_nn():
    x = jnp.asarray(_data((6, 2 * 96)))
    g, u = x[..., :96], x[..., 96:]
    _close(ops.SiluAndMul().forward_native(x), jax.nn.silu(g) * u)
    _close(ops.MulAndSilu().forward_native(x), g * jax.nn.silu(u))
    _close(ops.GeluAndMul().forward_native(x), jax.nn.gelu(g, approximate=False) * u)
    _close(ops.GeluAndMul("tanh").forward_native(x), jax.nn.gelu(g, approximate=True) * u)
    _close(ops.FatreluAndMul(0.2).forward_native(x), jnp.where(g > 0.2, g, 0.0) * u)
