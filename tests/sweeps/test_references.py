"""The native bodies against implementations nobody here wrote: torch's own functional ops and
jax.nn. (Hugging Face transformers' modules join these when the activation family lands.)"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch

from dualop import testing
from dualop.ops import GeluAndMul, ReLUSquaredActivation, RMSNorm, SiluAndMul

F = torch.nn.functional
jnp = jax.numpy


def _data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2


def _check(got, want, dtype="float32"):
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


@pytest.mark.parametrize("shape", [(5, 200), (2, 3, 128)])
def test_rms_norm_against_torch_functional(shape):
    x = torch.from_numpy(_data(shape))
    w = torch.from_numpy(_data(shape[-1:], 1))
    want = F.rms_norm(x, (shape[-1],), weight=w, eps=1e-6)
    _check(RMSNorm(shape[-1], eps=1e-6).forward_native(x, w), want)
    _check(RMSNorm(shape[-1], eps=1e-6).forward_native(jnp.asarray(x.numpy()), jnp.asarray(w.numpy())), want)


def test_rms_norm_residual_against_torch_functional():
    x, r = (torch.from_numpy(_data((4, 96), s)) for s in (0, 1))
    out, res = RMSNorm(96).forward_native(x, None, r)
    _check(res, x + r)
    _check(out, F.rms_norm(x + r, (96,), eps=1e-6))


@pytest.mark.parametrize(
    "op, torch_fn, jax_fn",
    [
        (SiluAndMul(), F.silu, jax.nn.silu),
        (GeluAndMul(), lambda t: F.gelu(t), lambda a: jax.nn.gelu(a, approximate=False)),
        (GeluAndMul("tanh"), lambda t: F.gelu(t, approximate="tanh"), lambda a: jax.nn.gelu(a, approximate=True)),
    ],
    ids=["silu", "gelu", "gelu_tanh"],
)
def test_gated_against_library_activations(op, torch_fn, jax_fn):
    data = _data((7, 2 * 136))
    xt, xj = torch.from_numpy(data), jnp.asarray(data)
    _check(op.forward_native(xt), torch_fn(xt[:, :136]) * xt[:, 136:])
    _check(op.forward_native(xj), jax_fn(xj[:, :136]) * xj[:, 136:])


def test_relu2_against_library():
    data = _data((6, 50))
    xt, xj = torch.from_numpy(data), jnp.asarray(data)
    _check(ReLUSquaredActivation().forward_native(xt), F.relu(xt) ** 2)
    _check(ReLUSquaredActivation().forward_native(xj), jax.nn.relu(xj) ** 2)


def test_bf16_native_bodies_compute_in_float32():
    """A bfloat16 input is upcast, computed and cast once: equal to the float32 result rounded."""
    data = _data((9, 256))
    xt = torch.from_numpy(data).to(torch.bfloat16)
    want = (F.silu(xt.float()[:, :128]) * xt.float()[:, 128:]).to(torch.bfloat16)
    assert torch.equal(SiluAndMul().forward_native(xt), want)
