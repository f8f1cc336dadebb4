"""Normalisation ops."""

from __future__ import annotations

import math
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.pallas_bridge import call_pallas
from dualop.custom_op import CustomOp
from dualop.kernels.norm_math import NormSpec, rms_normalize
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, decline_if_recording
from dualop.platforms import frontend_of

__all__ = ["GemmaRMSNorm", "RMSNorm"]

_PALLAS_RMS_NORM = KernelRef("dualop.kernels.pallas.rms_norm", "rms_norm")
_TRITON_RMS_NORM = KernelRef("dualop.kernels.cuda.rms_norm", "rms_norm")
_CPU_RMS_NORM = KernelRef("dualop.kernels.cpu.rms_norm", "rms_norm")
_CPU_RMS_NORM_COVERS = KernelRef("dualop.kernels.cpu.rms_norm", "covers")


def _check_size(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return value


def _check_eps(op: str, eps: Any) -> float:
    """A finite ``eps >= 0`` (NaN or inf would make every output NaN or zero)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")
    if not math.isfinite(eps):
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}; expected a finite value")
    return float(eps)


class _RMSNormFamily(CustomOp):
    """Shared body of the RMS norms: ``op(x, weight, residual=None)``; ``self.spec`` (a NormSpec)
    picks the variant, and the formula (``kernels/norm_math``) is the one the kernels use."""

    spec: NormSpec
    hidden_size: int
    weight_required = False

    def check_inputs(self, x: Any, weight: Any = None, residual: Any = None) -> None:
        op = type(self).name
        fe = check_array(op, "x", x)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"{op}: argument 'x' has last dim {x.shape[-1]}; expected hidden_size={self.hidden_size}")
        if weight is None and self.weight_required:
            raise ValueError(f"{op}: argument 'weight' is required (shape ({self.hidden_size},))")
        if weight is not None and not getattr(self, "has_weight", True):
            raise ValueError(f"{op}: argument 'weight' must be None for an op built with has_weight=False")
        check_optional_like(op, "weight", weight, "x", x, fe, shape=(self.hidden_size,))
        check_optional_like(op, "residual", residual, "x", x, fe, same_dtype=True)

    def forward_native(self, x: Any, weight: Any = None, residual: Any = None) -> Any | tuple[Any, Any]:
        xp = array_namespace(x)
        xf = xp.astype(x, xp.float32)
        if residual is not None:
            xf = xf + xp.astype(residual, xp.float32)
            residual = xp.astype(xf, x.dtype)
        y = rms_normalize(xp, xf, weight, self.spec, x.dtype)
        return y if residual is None else (y, residual)

    def declines(self, method: str, frontend: str) -> str | None:
        """The C++ CPU kernel serves torch tensors, with the statistic over the whole row."""
        return _CPU_RMS_NORM_COVERS(self.spec) if method == "forward_cpu" else None

    def forward_cpu(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        """torch on the CPU: the C++ row kernel (``kernels/cpu``: one read, one write; see
        docs/BENCHMARKS.md); it declines while autograd records (no backward), for a residual of
        another dtype, and when the kernels cannot be built here."""
        decline_if_recording(type(self).name, x, weight, residual)
        return _CPU_RMS_NORM(x, weight, residual, spec=self.spec)

    def forward_cuda(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        return call_triton(frontend_of(x), _TRITON_RMS_NORM, x, weight, residual, spec=self.spec)

    def forward_tpu(self, x: Any, weight: Any = None, residual: Any = None) -> Any:
        return call_pallas(
            frontend_of(x), _PALLAS_RMS_NORM, x, weight, residual, spec=self.spec, native=self.forward_native
        )

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.spec.eps}"


@CustomOp.register("rms_norm")
class RMSNorm(_RMSNormFamily):
    """Root-mean-square normalisation over the last dim, optionally fused with a residual add.

    ``op(x, weight=None, residual=None)``: in float32, ``x`` (plus ``residual``) is scaled by
    ``rsqrt(mean(x[..., :var_hidden_size]**2) + eps)``, cast to ``x``'s dtype, then multiplied by
    ``weight``. With a residual it returns ``(out, x + residual)``, the sum cast to ``x``'s dtype, as
    the reference engine's fused add-norm does (out of place: both frontends get new arrays).
    ``has_weight=False`` builds a norm that takes no weight.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = _check_size("rms_norm", "hidden_size", hidden_size)
        if var_hidden_size is not None:
            _check_size("rms_norm", "var_hidden_size", var_hidden_size)
            if var_hidden_size > hidden_size:
                raise ValueError(
                    f"rms_norm: var_hidden_size={var_hidden_size} exceeds hidden_size={hidden_size}"
                )
        self.var_hidden_size = var_hidden_size
        self.has_weight = bool(has_weight)
        self.eps = _check_eps("rms_norm", eps)
        var_size = None if var_hidden_size in (None, hidden_size) else var_hidden_size
        self.spec = NormSpec(eps=self.eps, var_size=var_size)


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(_RMSNormFamily):
    """Gemma's RMS norm: as RMSNorm, but multiplies by ``(1 + weight)``, in float32, before the one
    cast to ``x``'s dtype. ``op(x, weight, residual=None)``; the weight is required."""

    weight_required = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = _check_size("gemma_rms_norm", "hidden_size", hidden_size)
        self.eps = _check_eps("gemma_rms_norm", eps)
        self.spec = NormSpec(eps=self.eps, weight_offset=1.0, weight_in_f32=True)


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
    ] + [
        OpCase("rms_norm", "rms_norm[var_hidden_size]", lambda s: RMSNorm(s[-1], var_hidden_size=s[-1] // 2 + 1),
               inputs(True, True), NORM_SHAPES),
        OpCase("rms_norm", "rms_norm[no_weight]", lambda s: RMSNorm(s[-1], has_weight=False), inputs(False, True),
               NORM_SHAPES),
        OpCase("gemma_rms_norm", "gemma_rms_norm", lambda s: GemmaRMSNorm(s[-1]), inputs(True, False), NORM_SHAPES),
        OpCase("gemma_rms_norm", "gemma_rms_norm[residual]", lambda s: GemmaRMSNorm(s[-1]), inputs(True, True),
               NORM_SHAPES),
    ]
