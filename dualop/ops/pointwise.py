"""Pointwise activation ops (``y = f(x)`` elementwise)."""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.ops._checks import check_array

__all__ = ["ReLUSquaredActivation"]


@CustomOp.register("relu2")
class ReLUSquaredActivation(CustomOp):
    """``relu(x) ** 2`` (Primer's squared ReLU)."""

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def check_inputs(self, x: Any) -> None:
        check_array("relu2", "x", x, min_ndim=0)

    def forward_native(self, x: Any) -> Any:
        xp = array_namespace(x)
        r = xp.maximum(xp.astype(x, xp.float32), 0.0)
        return xp.astype(r * r, x.dtype)


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with."""
    from dualop.testing import GATED_SHAPES, OpCase, x_only

    return [OpCase("relu2", "relu2", lambda s: ReLUSquaredActivation(), x_only(), GATED_SHAPES)]
