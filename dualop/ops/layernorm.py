"""Normalisation ops."""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.pallas_bridge import call_pallas
from dualop.custom_op import CustomOp
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like
from dualop.platforms import frontend_of

__all__ = ["RMSNorm"]

_PALLAS_RMS_NORM = KernelRef("dualop.kernels.pallas.rms_norm", "rms_norm")
_TRITON_RMS_NORM = KernelRef("dualop.kernels.cuda.rms_norm", "rms_norm")


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """Root-mean-square normalisation over the last dim, optionally fused with a residual add.

    ``op(x, weight=None, residual=None)``: in float32, ``x`` (plus ``residual``) is scaled by
    ``rsqrt(mean(x**2) + eps)``, cast to ``x``'s dtype, then multiplied by ``weight``. With a
    residual it returns ``(out, x + residual)``, the sum cast to ``x``'s dtype, as the reference
    engine's fused add-norm does (out of place: both frontends get new arrays).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"rms_norm: hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"rms_norm: eps must be a non-negative float, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.eps}"

    def check_inputs(self, x: Any, weight: Any = None, residual: Any = None) -> None:
        fe = check_array("rms_norm", "x", x)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"rms_norm: argument 'x' has last dim {x.shape[-1]}; expected hidden_size={self.hidden_size}"
            )
        check_optional_like("rms_norm", "weight", weight, "x", x, fe, shape=(self.hidden_size,))
        check_optional_like("rms_norm", "residual", residual, "x", x, fe, same_dtype=True)

    def forward_native(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        xp = array_namespace(x)
        orig = x.dtype
        xf = xp.astype(x, xp.float32)
        if residual is not None:
            xf = xf + xp.astype(residual, xp.float32)
            residual = xp.astype(xf, orig)
        y = xp.astype(xf * xp.rsqrt(xp.mean(xf * xf, axis=-1, keepdims=True) + self.eps), orig)
        if weight is not None:
            y = xp.astype(xp.astype(y, xp.float32) * xp.astype(weight, xp.float32), orig)
        return y if residual is None else (y, residual)

    def forward_cpu(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        """CPU: torch runs a float32 body that reuses its temporaries; XLA fuses the native body."""
        if frontend_of(x) != "torch":
            return self.forward_native(x, weight, residual)
        import torch

        orig = x.dtype
        xf = x.to(torch.float32)
        owned = xf is not x  # a float32 temporary this call may overwrite
        if residual is not None:
            xf = xf + residual  # promotes to float32
            residual = xf.to(orig)
            owned = residual is not xf
        inv_rms = xf.square().mean(dim=-1, keepdim=True).add_(self.eps).rsqrt_()
        y = (xf.mul_(inv_rms) if owned else xf * inv_rms).to(orig)
        if weight is not None:
            y = y.to(torch.float32).mul_(weight).to(orig) if orig != torch.float32 else y.mul_(weight)
        return y if residual is None else (y, residual)

    def forward_cuda(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        return call_triton(frontend_of(x), _TRITON_RMS_NORM, x, weight, residual, eps=self.eps)

    def forward_tpu(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        return call_pallas(
            frontend_of(x), _PALLAS_RMS_NORM, x, weight, residual, eps=self.eps, native=self.forward_native
        )


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with."""
    from dualop.testing import NORM_SHAPES, OpCase, normal

    def inputs(weight: bool, residual: bool):
        def make(shape, rng):
            w = 1.0 + 0.5 * normal(shape[-1:], rng) if weight else None
            r = normal(shape, rng) if residual else None
            return (normal(shape, rng, 3.0), w, r)

        return make

    return [
        OpCase("rms_norm", label, lambda s: RMSNorm(s[-1]), inputs(w, r), NORM_SHAPES)
        for w, r, label in (
            (False, False, "rms_norm"),
            (True, False, "rms_norm[weight]"),
            (True, True, "rms_norm[weight,residual]"),
        )
    ]
