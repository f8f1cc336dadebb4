"""RMS normalisation: ``RMSNorm`` (optionally fused with the residual add) and ``GemmaRMSNorm``.

The module keeps the reference serving engine's name (its ``layernorm.py`` holds the same RMS
norms); there is no LayerNorm here. The gated group norm is ``gated_norm.py``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, validates_inputs
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.norm_math import NormSpec, rms_normalize
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_not_engine_activation, check_optional_like, decline_if_recording
from dualop.ops._outputs import check_output, write_outputs
from dualop.platforms import frontend_of
from dualop.spec import BenchCase, Serving, float32_normal as _normal, rows_of

__all__ = ["GemmaRMSNorm", "RMSNorm"]

_PALLAS_RMS_NORM = KernelRef("dualop.kernels.pallas.rms_norm", "rms_norm")
_TRITON_RMS_NORM = KernelRef("dualop.kernels.cuda.rms_norm", "rms_norm")
_CPU_RMS_NORM = KernelRef("dualop.kernels.cpu.rms_norm", "rms_norm")
_CPU_RMS_NORM_COVERS = KernelRef("dualop.kernels.cpu.rms_norm", "covers")
_CPU_FAST_RMS_NORM = KernelRef("dualop.kernels.cpu.rms_norm", "FAST_RMS_NORM")
_CPU_FAST_CONSTANTS = KernelRef("dualop.kernels.cpu.rms_norm", "fast_constants")


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
    """Shared body of the RMS norms: ``op(x, weight, residual=None, *, out=None, residual_out=None)``;
    ``self.spec`` (a NormSpec) picks the variant, and the formula (``kernels/norm_math``) is the one
    the kernels use. torch tensors given as ``out`` / ``residual_out`` receive the result and the
    residual sum (``ops/_outputs.py``); ``out=x, residual_out=residual`` is the engine's in-place
    fused add-norm."""

    spec: NormSpec
    hidden_size: int
    weight_required = False
    output_args: ClassVar[tuple[str, ...]] = ("out", "residual_out")
    output_present: ClassVar[tuple[str | None, ...]] = (None, "residual")

    def check_inputs(self, x: Any, weight: Any = None, residual: Any = None, *, out: Any = None,
                     residual_out: Any = None) -> None:
        op = type(self).name
        fe = check_array(op, "x", x)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"{op}: argument 'x' has last dim {x.shape[-1]}; expected hidden_size={self.hidden_size}")
        has_weight = getattr(self, "has_weight", True)
        check_not_engine_activation(op, "weight", weight, "x", x, (self.hidden_size,), "norm(x, residual)",
                                    "op(x, weight, residual)" if has_weight else "op(x, residual=residual)",
                                    f"the layer {type(self).__name__} (dualop.torch.layers / dualop.jax.layers), "
                                    f"which takes norm(x, residual)")
        if weight is None and self.weight_required:
            raise ValueError(f"{op}: argument 'weight' is required (shape ({self.hidden_size},))")
        if weight is not None and not has_weight:
            raise ValueError(f"{op}: argument 'weight' must be None for an op built with has_weight=False")
        check_optional_like(op, "weight", weight, "x", x, fe, shape=(self.hidden_size,))
        check_optional_like(op, "residual", residual, "x", x, fe, same_dtype=True)
        if out is not None or residual_out is not None:
            inputs = {"x": x, "weight": weight, "residual": residual}
            if out is not None:
                check_output(op, "out", out, x.shape, x.dtype, x.device, inputs, (("residual_out", residual_out),))
            if residual_out is not None:
                if residual is None:
                    raise ValueError(f"{op}: argument 'residual_out' given without a residual; expected None")
                check_output(op, "residual_out", residual_out, x.shape, x.dtype, x.device, inputs)

    def forward_native(self, x: Any, weight: Any = None, residual: Any = None, *, out: Any = None,
                       residual_out: Any = None) -> Any | tuple[Any, Any]:
        xp = array_namespace(x)
        xf = xp.astype(x, xp.float32)
        if residual is not None:
            xf = xf + xp.astype(residual, xp.float32)
            residual = xp.astype(xf, x.dtype)
        y = rms_normalize(xp, xf, weight, self.spec, x.dtype)
        return write_outputs(y if residual is None else (y, residual), (out, residual_out))

    def declines(self, method: str, frontend: str) -> str | None:
        """The C++ CPU kernel serves torch tensors, with the statistic over the whole row."""
        return _CPU_RMS_NORM_COVERS(self.spec) if method == "forward_cpu" else None

    @validates_inputs
    def forward_cpu(self, x: Any, weight: Any = None, residual: Any = None, *, out: Any = None,
                    residual_out: Any = None) -> Any:
        """torch on the CPU: the C++ row kernel (``kernels/cpu``: one read, one write, straight into
        given outputs; see docs/BENCHMARKS.md); it declines while autograd records (no backward),
        for a residual of another dtype, and when the kernels cannot be built here. A call of plain
        row-major tensors goes straight to the kernel's torch operator, which checks it in C++ (a
        decode step's norm costs about the kernel); any other call is checked here first."""
        if weight is not None:
            fast = self._cpu_fast
            if fast is None:
                fast = self._cpu_fast = self._fast_cpu_call()
            if fast:
                y, r = fast[0].take(x, weight, residual, out, residual_out, *fast[1]) or (None, None)
                if y is not None:
                    return y if r is None else (y, r)
        self.check_inputs(x, weight, residual, out=out, residual_out=residual_out)
        decline_if_recording(type(self).name, x, weight, residual)
        return _CPU_RMS_NORM(x, weight, residual, spec=self.spec, out=out, residual_out=residual_out)

    _cpu_fast: tuple | None = None

    def _fast_cpu_call(self) -> tuple:
        """``(operator, constants)`` of the CPU fast path, or ``()`` where there is none (the
        operators cannot be built here, or a norm without a weight)."""
        operator = _CPU_FAST_RMS_NORM.resolve()
        if operator.get() is None or not getattr(self, "has_weight", True):
            return ()
        return operator, _CPU_FAST_CONSTANTS(self.hidden_size, self.spec)

    def forward_cuda(self, x: Any, weight: Any = None, residual: Any = None, *, out: Any = None,
                     residual_out: Any = None) -> Any:
        return write_outputs(call_triton(frontend_of(x), _TRITON_RMS_NORM, x, weight, residual, spec=self.spec),
                             (out, residual_out))

    def forward_tpu(self, x: Any, weight: Any = None, residual: Any = None, *, out: Any = None,
                    residual_out: Any = None) -> Any:
        return write_outputs(call_jax_function(frontend_of(x), _PALLAS_RMS_NORM, x, weight, residual, spec=self.spec,
                                               native=self.forward_native), (out, residual_out))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.spec.eps}"


@CustomOp.register("rms_norm")
class RMSNorm(_RMSNormFamily):
    """Root-mean-square normalisation over the last dim, optionally fused with a residual add.

    ``op(x, weight=None, residual=None)``: in float32, ``x`` (plus ``residual``) is scaled by
    ``rsqrt(mean(x[..., :var_hidden_size]**2) + eps)``, cast to ``x``'s dtype, then multiplied by
    ``weight``. With a residual it returns ``(out, x + residual)``, the sum cast to ``x``'s dtype, as
    the reference engine's fused add-norm does: new arrays, or (torch) written into ``out`` and
    ``residual_out``, which may be ``x`` and ``residual`` themselves (the engine's in-place form).
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


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


def _norm_inputs(residual: bool) -> Callable[[tuple[int, ...], np.random.Generator], tuple]:
    """x (scale 3), a weight around 1, and a residual when asked (as the op's own check cases)."""

    def make(shape, rng):
        x = _normal(shape, rng, 3.0)
        w = 1.0 + _normal(shape[-1:], rng, 0.5)
        return (x, w, _normal(shape, rng)) if residual else (x, w)

    return make


def _norm_cost(residual: bool) -> Callable[[Any, tuple[int, ...], int], KernelCost]:
    def cost(op, shape, itemsize):
        return cost_model.rms_norm_cost(rows_of(shape), shape[-1], itemsize, True, residual)

    return cost


def _torch_rms_norm(residual: bool):
    def builtin(op):
        import torch.nn.functional as F

        shape, eps = (op.hidden_size,), op.eps
        if not residual:
            return lambda x, w: F.rms_norm(x, shape, w, eps)

        def fused(x, w, r):
            s = x + r
            return F.rms_norm(s, shape, w, eps), s

        return fused

    return builtin


def _torch_gemma_rms_norm(op):
    import torch.nn.functional as F

    shape, eps = (op.hidden_size,), op.eps

    def gemma(x, w):
        return (F.rms_norm(x.float(), shape, None, eps) * (1.0 + w.float())).to(x.dtype)

    return gemma


def _jax_rms_norm(residual: bool, gemma: bool = False):
    """Llama's RMSNorm (round to x's dtype, then times the weight), or Gemma's (times 1 + weight in
    float32, one cast); with a residual, the float32 sum is normalised and returned cast."""

    def handwritten(op):
        import jax
        import jax.numpy as jnp

        eps = op.eps

        def normalise(xf, w, dtype):
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            if gemma:
                return (y * (1.0 + w.astype(jnp.float32))).astype(dtype)
            return y.astype(dtype) * w

        if not residual:
            return lambda x, w: normalise(x.astype(jnp.float32), w, x.dtype)

        def fused(x, w, r):
            s = x.astype(jnp.float32) + r.astype(jnp.float32)
            return normalise(s, w, x.dtype), s.astype(x.dtype)

        return fused

    return handwritten



def bench_cases():
    """The norms against torch's ``F.rms_norm`` and hand-written ``jax.numpy``."""
    return [
        BenchCase("rms_norm", "rms_norm", RMSNorm, _norm_inputs(False), _norm_cost(False),
                  _torch_rms_norm(False), _jax_rms_norm(False)),
        BenchCase("rms_norm[residual]", "rms_norm", RMSNorm, _norm_inputs(True), _norm_cost(True),
                  _torch_rms_norm(True), _jax_rms_norm(True)),
        BenchCase("gemma_rms_norm", "gemma_rms_norm", GemmaRMSNorm, _norm_inputs(False), _norm_cost(False),
                  _torch_gemma_rms_norm, _jax_rms_norm(False, gemma=True)),
        # the engine's written forms (torch; against its own kernels where vLLM is installed): into a
        # preallocated output, and the fused add-norm in place
        BenchCase("rms_norm[out]", "rms_norm", RMSNorm, _norm_out_inputs, _norm_cost(False), default=False,
                  written=lambda a: ((a[0], a[1]), {"out": a[2]})),
        BenchCase("rms_norm[in_place]", "rms_norm", RMSNorm, _norm_inputs(True), _norm_cost(True),
                  default=False, written=lambda a: (a, {"out": a[0], "residual_out": a[2]})),
    ]


def _norm_out_inputs(shape, rng):
    """x and a weight as ``rms_norm``'s, and the output to write."""
    return (*_norm_inputs(False)(shape, rng), np.zeros(shape, np.float32))


# Prefill of 8192 tokens and a 16-token decode batch at the widths of Llama-3-70B (hidden 8192) and
# Llama-3-405B (hidden 16384).
SERVING_NORM_SHAPES = ((8192, 8192), (16, 16384))


def serving():
    return {"rms_norm": Serving(SERVING_NORM_SHAPES), "gemma_rms_norm": Serving(SERVING_NORM_SHAPES)}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"rms_norm[var_hidden_size]": {"native_cells": {("torch", "cpu"): "var_hidden_size < hidden_size"}}}
