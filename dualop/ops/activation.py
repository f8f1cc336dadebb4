"""Gated activation ops (``act(gate) * up`` over the two halves of the last dim). They share one
kernel family per platform, with the activation as a parameter."""

from __future__ import annotations

import math
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.pallas_bridge import call_pallas
from dualop.custom_op import CustomOp
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array
from dualop.platforms import frontend_of

__all__ = ["GeluAndMul", "SiluAndMul"]

_PALLAS_GATED = KernelRef("dualop.kernels.pallas.gated_activation", "gated_activation")
_TRITON_GATED = KernelRef("dualop.kernels.cuda.gated_activation", "gated_activation")
_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu(xp, g):
    return g * xp.sigmoid(g)


def _gelu(xp, g):
    return 0.5 * g * (1.0 + xp.erf(g * _SQRT_HALF))


def _gelu_tanh(xp, g):
    return 0.5 * g * (1.0 + xp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


_GATE_FUNCTIONS = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}


class _GatedActivation(CustomOp):
    """``act(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``, computed in float32.

    Subclasses set ``activation`` (a key of the kernels' activation tables)."""

    activation: str = "silu"

    def check_inputs(self, x: Any) -> None:
        op = type(self).name
        check_array(op, "x", x)
        if x.shape[-1] % 2:
            raise ValueError(f"{op}: argument 'x' must have an even last dim (gate and up halves), got shape {tuple(x.shape)}")

    def forward_native(self, x: Any) -> Any:
        xp = array_namespace(x)
        d = x.shape[-1] // 2
        xf = xp.astype(x, xp.float32)
        return xp.astype(_GATE_FUNCTIONS[self.activation](xp, xf[..., :d]) * xf[..., d:], x.dtype)

    def forward_cpu(self, x: Any) -> Any:
        return self.forward_native(x)

    def forward_cuda(self, x: Any) -> Any:
        return call_triton(frontend_of(x), _TRITON_GATED, x, activation=self.activation)

    def forward_tpu(self, x: Any) -> Any:
        return call_pallas(
            frontend_of(x), _PALLAS_GATED, x, activation=self.activation, native=self.forward_native
        )


@CustomOp.register("silu_and_mul")
class SiluAndMul(_GatedActivation):
    """SwiGLU gate: ``silu(x[..., :d]) * x[..., d:]``."""

    activation = "silu"

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(_GatedActivation):
    """GeGLU gate: ``gelu(x[..., :d]) * x[..., d:]``, exact (erf) or ``approximate="tanh"``."""

    def __init__(self, approximate: str = "none", *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate
        self.activation = "gelu" if approximate == "none" else "gelu_tanh"

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with."""
    from dualop.testing import GATED_SHAPES, OpCase, x_only

    return [
        OpCase("silu_and_mul", "silu_and_mul", lambda s: SiluAndMul(), x_only(), GATED_SHAPES),
        OpCase("gelu_and_mul", "gelu_and_mul", lambda s: GeluAndMul(), x_only(), GATED_SHAPES),
        OpCase("gelu_and_mul", "gelu_and_mul[tanh]", lambda s: GeluAndMul("tanh"), x_only(), GATED_SHAPES),
    ]
