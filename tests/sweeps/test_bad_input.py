"""Bad input raises ValueError/TypeError naming the op and the argument, before any kernel launches."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp
import torch

from dualop import OpsConfig, override_platform, set_config
from dualop.ops import GeluAndMul, ReLUSquaredActivation, RMSNorm, SiluAndMul
from dualop.ops import activation as activation_mod
from dualop.ops import layernorm as layernorm_mod


@pytest.fixture(autouse=True)
def no_kernel_may_launch(monkeypatch):
    """Every kernel reference raises if resolved: validation must stop bad input first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (layernorm_mod._PALLAS_RMS_NORM, layernorm_mod._TRITON_RMS_NORM,
                activation_mod._PALLAS_GATED, activation_mod._TRITON_GATED):
        monkeypatch.setattr(ref, "resolve", forbidden)
    with set_config(OpsConfig(["all"])):
        yield


PLATFORMS = ["cpu", "cuda", "tpu"]


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


def _j(*shape, dtype="float32"):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])
def test_rms_norm_shape_errors(platform, make):
    op = RMSNorm(64)
    with override_platform(platform):
        with pytest.raises(ValueError, match=r"rms_norm: argument 'x' has last dim 32; expected hidden_size=64"):
            op(make(4, 32))
        with pytest.raises(ValueError, match=r"rms_norm: argument 'x' must have at least 1 dimension"):
            op(make())
        with pytest.raises(ValueError, match=r"rms_norm: argument 'weight' has shape \(32,\); expected \(64,\)"):
            op(make(4, 64), make(32))
        with pytest.raises(ValueError, match=r"rms_norm: argument 'residual' has shape \(3, 64\); expected \(4, 64\)"):
            op(make(4, 64), None, make(3, 64))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_rms_norm_dtype_errors(platform):
    op = RMSNorm(64)
    with override_platform(platform):
        with pytest.raises(TypeError, match=r"rms_norm: argument 'x' has dtype int32; expected one of bfloat16, float16, float32"):
            op(_t(4, 64, dtype=torch.int32))
        with pytest.raises(TypeError, match=r"rms_norm: argument 'x' has dtype float64"):
            op(_t(4, 64, dtype=torch.float64))
        with pytest.raises(TypeError, match=r"rms_norm: argument 'residual' has dtype float32; expected bfloat16"):
            op(_t(4, 64, dtype=torch.bfloat16), None, _t(4, 64))
        with pytest.raises(TypeError, match=r"rms_norm: argument 'x' has dtype int32"):
            op(_j(4, 64, dtype="int32"))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_mixed_frontends_are_rejected(platform):
    with override_platform(platform):
        with pytest.raises(TypeError, match=r"rms_norm: argument 'weight' is a jax array but 'x' is a torch array"):
            RMSNorm(64)(_t(4, 64), _j(64))
        with pytest.raises(TypeError, match=r"rms_norm: argument 'residual' is a torch array but 'x' is a jax array"):
            RMSNorm(64)(_j(4, 64), None, _t(4, 64))


def test_non_arrays_are_rejected():
    with pytest.raises(TypeError, match=r"rms_norm: argument 'weight' must be None, a torch.Tensor or a jax.Array, got numpy.ndarray"):
        RMSNorm(64)(_t(4, 64), np.zeros(64, np.float32))
    with pytest.raises(TypeError, match=r"silu_and_mul: expected a torch.Tensor or jax.Array as the first argument, got numpy.ndarray"):
        SiluAndMul()(np.zeros((4, 64), np.float32))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("op_cls, name", [(SiluAndMul, "silu_and_mul"), (GeluAndMul, "gelu_and_mul")])
@pytest.mark.parametrize("make", [_t, _j], ids=["torch", "jax"])
def test_gated_ops_need_an_even_last_dim(platform, op_cls, name, make):
    with override_platform(platform):
        with pytest.raises(ValueError, match=rf"{name}: argument 'x' must have an even last dim .*\(4, 33\)"):
            op_cls()(make(4, 33))
        with pytest.raises(ValueError, match=rf"{name}: argument 'x' must have at least 1 dimension"):
            op_cls()(make())


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="rms_norm: hidden_size must be a positive int"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="rms_norm: hidden_size must be a positive int"):
        RMSNorm(64.0)
    with pytest.raises(ValueError, match="rms_norm: eps must be a non-negative float"):
        RMSNorm(64, eps=-1.0)
    with pytest.raises(ValueError, match="gelu_and_mul: approximate must be 'none' or 'tanh'"):
        GeluAndMul("erf")


def test_relu2_accepts_any_rank_but_checks_dtype():
    assert ReLUSquaredActivation()(torch.tensor(-2.0)).item() == 0.0
    with pytest.raises(TypeError, match="relu2: argument 'x' has dtype int64"):
        ReLUSquaredActivation()(torch.tensor([1, 2]))
