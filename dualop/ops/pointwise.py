"""Pointwise activation ops (``y = f(x)`` elementwise): GELU (exact), GELUTanh, NewGELU, FastGELU,
QuickGELU, ReLU² and xIELU. They share one kernel family per platform (``kernels/pallas/pointwise_activation.py``,
``kernels/cuda/pointwise_activation.py``) with the activation as a static parameter.

Every op takes ``x`` of any rank (0 included) in float32, bfloat16 or float16, computes in float32
and casts back to x's dtype once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels import cost as cost_model
from dualop.kernels import gate_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, dtype_name
from dualop.platforms import frontend_of
from dualop.spec import BenchCase, Serving, x_only_inputs

__all__ = ["FastGELU", "GELU", "GELUTanh", "NewGELU", "QuickGELU", "ReLUSquaredActivation", "XIELU"]

_PALLAS_POINTWISE = KernelRef("dualop.kernels.pallas.pointwise_activation", "pointwise_activation")
_TRITON_POINTWISE = KernelRef("dualop.kernels.cuda.pointwise_activation", "pointwise_activation")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_new(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))


def _gelu_fast(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(0.7978845608 * x * (1.0 + 0.044715 * (x * x))))


def _quick_gelu(xp, x):
    return x * xp.sigmoid(1.702 * x)


def _relu2(xp, x):
    r = xp.maximum(x, 0.0)
    return r * r


_FUNCTIONS = {"gelu_new": _gelu_new, "gelu": gate_math.gelu, "gelu_fast": _gelu_fast, "quick_gelu": _quick_gelu,
              "relu2": _relu2}


def _may_overwrite(torch, xf) -> bool:
    """Whether a temporary computed from ``xf`` may be overwritten in place: not when autograd
    is recording, which may have saved it for the backward pass."""
    return not (torch.is_grad_enabled() and xf.requires_grad)


class _PointwiseActivation(CustomOp):
    """``f(x)`` elementwise in float32. Subclasses set ``activation`` (a key of the kernels'
    activation tables) and give ``forward_cpu`` a float32 torch body of their own in ``_torch_cpu``
    (torch's fused GELU, or the formula with its temporaries reused in place: one pass and one
    allocation fewer than forward_native). Such a body is its own implementation, checked against
    forward_native, so it counts as the CPU kernel; without one, forward_cpu declines."""

    activation: str = "relu2"
    parameterless = True  # the layer modules wrap the op as it is (dualop.torch/jax.layers)

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def check_inputs(self, x: Any) -> None:
        check_array(type(self).name, "x", x, min_ndim=0)

    def forward_native(self, x: Any) -> Any:
        xp = array_namespace(x)
        return xp.astype(_FUNCTIONS[self.activation](xp, xp.astype(x, xp.float32)), x.dtype)

    def declines(self, method: str, frontend: str) -> str | None:
        if method == "forward_cpu" and type(self)._torch_cpu is _PointwiseActivation._torch_cpu:
            return f"no torch CPU body of its own for {self.activation}"
        return None

    def forward_cpu(self, x: Any) -> Any:
        """torch on the CPU: the subclass's float32 torch body (``_torch_cpu``)."""
        import torch

        return self._torch_cpu(torch, x.to(torch.float32)).to(x.dtype)

    def _torch_cpu(self, torch, xf):
        """``f(xf)`` for a float32 torch tensor, by a route of the subclass's own."""
        raise NotImplementedError(f"no torch CPU body of its own for {self.activation}")

    def forward_cuda(self, x: Any) -> Any:
        return call_triton(frontend_of(x), _TRITON_POINTWISE, x, activation=self.activation)

    def forward_tpu(self, x: Any) -> Any:
        return call_jax_function(
            frontend_of(x), _PALLAS_POINTWISE, x, activation=self.activation, native=self.forward_native
        )


@CustomOp.register("gelu_new")
class NewGELU(_PointwiseActivation):
    """GPT-2's GELU: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``."""

    activation = "gelu_new"

    def _torch_cpu(self, torch, xf):
        return torch.nn.functional.gelu(xf, approximate="tanh")  # the same formula, one fused loop


@CustomOp.register("gelu")
class GELU(_PointwiseActivation):
    """The exact GELU: ``0.5 * x * (1 + erf(x / sqrt(2)))`` (``nn.GELU()``)."""

    activation = "gelu"

    def _torch_cpu(self, torch, xf):
        # the formula with its temporary reused in place (torch's fused F.gelu gives NaN at +inf,
        # where the formula gives inf)
        t = torch.erf(xf * 0.7071067811865476)
        return t.add_(1.0).mul_(xf).mul_(0.5) if _may_overwrite(torch, xf) else 0.5 * xf * (1.0 + t)


@CustomOp.register("gelu_tanh")
class GELUTanh(NewGELU):
    """The tanh-approximate GELU (``nn.GELU(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``):
    the same function as ``gelu_new``, so the same kernels, under the engine's other name."""


@CustomOp.register("gelu_fast")
class FastGELU(_PointwiseActivation):
    """``0.5 * x * (1 + tanh(0.7978845608 * x * (1 + 0.044715 * x**2)))``."""

    activation = "gelu_fast"

    def _torch_cpu(self, torch, xf):
        # 0.7978845608 is sqrt(2/pi) to float32 precision and x*(1 + k*x^2) == x + k*x^3: torch's
        # tanh GELU is this function up to float32 rounding.
        return torch.nn.functional.gelu(xf, approximate="tanh")


@CustomOp.register("quick_gelu")
class QuickGELU(_PointwiseActivation):
    """``x * sigmoid(1.702 * x)``."""

    activation = "quick_gelu"

    def _torch_cpu(self, torch, xf):
        s = torch.sigmoid(xf * 1.702)
        return s.mul_(xf) if _may_overwrite(torch, xf) else s * xf


@CustomOp.register("relu2")
class ReLUSquaredActivation(_PointwiseActivation):
    """``relu(x) ** 2`` (Primer's squared ReLU)."""

    activation = "relu2"

    def _torch_cpu(self, torch, xf):
        r = torch.relu(xf)  # a new tensor: squaring it in place is safe unless autograd saved it
        return r.square_() if _may_overwrite(torch, xf) else r * r


@CustomOp.register("xielu")
class XIELU(_PointwiseActivation):
    """xIELU (arXiv:2411.13010): ``op(x, alpha_p, alpha_n)`` with ``a_p = softplus(alpha_p)``,
    ``a_n = beta + softplus(alpha_n)``::

        x > 0:  a_p * x**2 + beta * x
        else:   (expm1(min(x, eps)) - x) * a_n + beta * x

    ``alpha_p`` and ``alpha_n`` are the raw (pre-softplus) trainable parameters, arrays of shape
    (1,) in float32 or x's dtype, passed on every call (the op holds no state); a layer creates
    them from ``initial_parameters()``. ``beta`` and ``eps`` are fixed constants.
    """

    parameterless = False  # its alphas are learnt: the layers hold them

    activation = "xielu"

    def __init__(
        self,
        alpha_p_init: float = 0.8,
        alpha_n_init: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        for arg, value in (("alpha_p_init", alpha_p_init), ("alpha_n_init", alpha_n_init), ("beta", beta), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"xielu: {arg} must be a finite float, got {value!r}")
        self.alpha_p_init = float(alpha_p_init)
        self.alpha_n_init = float(alpha_n_init)
        self.beta = float(beta)
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return (
            f"alpha_p_init={self.alpha_p_init}, alpha_n_init={self.alpha_n_init}, "
            f"beta={self.beta}, eps={self.eps}"
        )

    def initial_parameters(self) -> tuple[float, float]:
        """The raw ``(alpha_p, alpha_n)`` a layer starts from, as the reference engine derives
        them: the inverse softplus ``log(exp(v) - 1)`` of ``alpha_p_init`` and of
        ``alpha_n_init - beta``, so that ``softplus(alpha_p) == alpha_p_init`` and
        ``beta + softplus(alpha_n) == alpha_n_init``. Computed in float64 here; the reference
        engine computes them in its parameter dtype (bfloat16 by default), so a layer rounds these
        to its own parameter dtype.
        """
        out = []
        for arg, value in (("alpha_p_init", self.alpha_p_init), ("alpha_n_init - beta", self.alpha_n_init - self.beta)):
            if not value > 0:
                raise ValueError(f"xielu: {arg} = {value:g} has no inverse softplus; it must be > 0")
            out.append(math.log(math.expm1(value)))
        return out[0], out[1]

    def check_inputs(self, x: Any, alpha_p: Any = None, alpha_n: Any = None) -> None:
        fe = check_array("xielu", "x", x, min_ndim=0)
        for arg, value in (("alpha_p", alpha_p), ("alpha_n", alpha_n)):
            if value is None:
                raise TypeError(
                    f"xielu: argument '{arg}' is required: the raw (pre-softplus) parameter, an array "
                    f"of shape (1,) in float32 or x's dtype (see XIELU.initial_parameters()); the engine's "
                    f"call act(x) is the layer XIELU's (dualop.torch.layers / dualop.jax.layers), which owns them"
                )
            check_optional_like("xielu", arg, value, "x", x, fe, shape=(1,))
            if dtype_name(value) not in ("float32", dtype_name(x)):
                raise TypeError(
                    f"xielu: argument '{arg}' has dtype {dtype_name(value)}; expected float32 or "
                    f"{dtype_name(x)} (the dtype of 'x')"
                )

    def forward_native(self, x: Any, alpha_p: Any, alpha_n: Any) -> Any:
        xp = array_namespace(x)
        xf = xp.astype(x, xp.float32)
        a_p = xp.softplus(xp.astype(alpha_p, xp.float32))[0]  # 0-d, so a 0-d x stays 0-d
        a_n = self.beta + xp.softplus(xp.astype(alpha_n, xp.float32))[0]
        pos = a_p * xf * xf + self.beta * xf
        neg = (xp.expm1(xp.minimum(xf, self.eps)) - xf) * a_n + self.beta * xf
        return xp.astype(xp.where(xf > 0, pos, neg), x.dtype)

    def declines(self, method: str, frontend: str) -> str | None:
        if method == "forward_cpu":
            return "no CPU kernel: torch has no fused xIELU, and the native body is a few vectorised float32 passes"
        return None

    def forward_cuda(self, x: Any, alpha_p: Any, alpha_n: Any) -> Any:
        return call_triton(
            frontend_of(x), _TRITON_POINTWISE, x, alpha_p, alpha_n, activation="xielu", beta=self.beta, eps=self.eps
        )

    def forward_tpu(self, x: Any, alpha_p: Any, alpha_n: Any) -> Any:
        return call_jax_function(
            frontend_of(x), _PALLAS_POINTWISE, x, alpha_p, alpha_n,
            activation="xielu", beta=self.beta, eps=self.eps, native=self.forward_native,
        )


# Shapes of the pointwise cases: zero elements; one element (1-D); a last dim off the 128-lane grid
# with an element count off it too (the (rows, last dim) layout); 3-D with a last dim off the grid
# but a lane-dense element count (768 = 6 x 128, the lane-dense layout).
_POINTWISE_SHAPES = ((0, 128), (1,), (7, 200), (2, 4, 96))
# Raw xIELU parameters of the check case: softplus gives a_p ~ 0.91, a_n ~ 0.5 + 0.55.
_XIELU_CASE_ALPHAS = (0.4, -0.3)


def _spread(shape, rng) -> Any:
    """float32 values of both signs whose magnitudes span 1e-3 .. 1e3, with some exact zeros."""
    import numpy as np

    mag = 10.0 ** rng.uniform(-3.0, 3.0, size=shape)
    sign = rng.choice(np.array([-1.0, 0.0, 1.0]), size=shape, p=[0.48, 0.04, 0.48])
    return (sign * mag).astype(np.float32)


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with."""
    import numpy as np

    from dualop.testing import OpCase, Pinned

    def x_spread(shape, rng):
        return (_spread(shape, rng),)

    def xielu_inputs(shape, rng):
        a_p, a_n = (Pinned(np.array([v], np.float32), "float32") for v in _XIELU_CASE_ALPHAS)
        return (_spread(shape, rng), a_p, a_n)

    simple = [
        OpCase(name, name, (lambda s, c=cls: c()), x_spread, _POINTWISE_SHAPES)
        for name, cls in (
            ("gelu", GELU),
            ("gelu_tanh", GELUTanh),
            ("gelu_new", NewGELU),
            ("gelu_fast", FastGELU),
            ("quick_gelu", QuickGELU),
            ("relu2", ReLUSquaredActivation),
        )
    ]
    return [*simple, OpCase("xielu", "xielu", lambda s: XIELU(), xielu_inputs, _POINTWISE_SHAPES)]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


def _pointwise_cost(activation: str) -> Callable[[Any, tuple[int, ...], int], KernelCost]:
    def cost(op, shape, itemsize):
        return cost_model.pointwise_activation_cost(math.prod(shape), itemsize, activation)

    return cost


def _torch_gelu_new(op):
    import torch.nn.functional as F

    return lambda x: F.gelu(x, approximate="tanh")


def _torch_gelu(op):
    import torch.nn.functional as F

    return lambda x: F.gelu(x)


def _torch_relu2(op):
    import torch
    import torch.nn.functional as F

    return lambda x: torch.square(F.relu(x))


def _jax_pointwise(body: Callable[[Any, Any], Any]):
    """``body(jax, xf)`` on the float32 upcast of x, cast back."""

    def handwritten(op):
        import jax
        import jax.numpy as jnp

        return lambda x: body(jax, x.astype(jnp.float32)).astype(x.dtype)

    return handwritten



def bench_cases():
    """Not run by default (ask with --ops): against torch's functions and hand-written ``jax.numpy``."""
    return [
        BenchCase("gelu", "gelu", lambda hidden: GELU(), x_only_inputs, _pointwise_cost("gelu"), _torch_gelu,
                  _jax_pointwise(lambda jax, x: jax.nn.gelu(x, approximate=False)), default=False),
        BenchCase("gelu_new", "gelu_new", lambda hidden: NewGELU(), x_only_inputs, _pointwise_cost("gelu_new"),
                  _torch_gelu_new, _jax_pointwise(lambda jax, x: jax.nn.gelu(x, approximate=True)), default=False),
        BenchCase("quick_gelu", "quick_gelu", lambda hidden: QuickGELU(), x_only_inputs, _pointwise_cost("quick_gelu"),
                  None, _jax_pointwise(lambda jax, x: x * jax.nn.sigmoid(1.702 * x)), default=False),
        BenchCase("relu2", "relu2", lambda hidden: ReLUSquaredActivation(), x_only_inputs, _pointwise_cost("relu2"),
                  _torch_relu2, _jax_pointwise(lambda jax, x: jax.numpy.square(jax.nn.relu(x))), default=False),
    ]


# Prefill of 8192 tokens and a 16-token decode batch at Llama-3-70B's and -405B's intermediate widths.
SERVING_POINTWISE_SHAPES = ((8192, 28672), (16, 53248))


def serving():
    return {op: Serving(SERVING_POINTWISE_SHAPES) for op in ("gelu", "gelu_tanh", "gelu_new", "gelu_fast", "quick_gelu",
                                                           "relu2", "xielu")}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {
    "gelu": {"traits": {"cancelling"}},
    "gelu_tanh": {"traits": {"cancelling"}},
    "gelu_new": {"traits": {"cancelling"}},
    "gelu_fast": {"traits": {"cancelling"}},
    "xielu": {"native_cells": {("torch", "cpu"): "torch has no fused xIELU"}},
}
