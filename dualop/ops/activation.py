"""Gated activation ops (``act(gate) * up`` over the two halves of the last dim). They share one
kernel family per platform, with the activation as a parameter."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, validates_inputs
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.gate_math import GateSpec, apply_gate, gate_and_up, gelu  # noqa: F401  (gelu: models' nn.GELU)
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, decline_if_recording
from dualop.ops._outputs import check_output, write_outputs
from dualop.platforms import frontend_of
from dualop.spec import BenchCase, Serving, rows_of, x_only_inputs

__all__ = [
    "FatreluAndMul",
    "GeluAndMul",
    "GeluAndMulSparse",
    "MulAndSilu",
    "SiluAndMul",
    "SiluAndMulWithClamp",
    "SituAndMul",
    "SwigluOAIAndMul",
    "SwigluStepAndMul",
]

_PALLAS_GATED = KernelRef("dualop.kernels.pallas.gated_activation", "gated_activation")
_TRITON_GATED = KernelRef("dualop.kernels.cuda.gated_activation", "gated_activation")
_CPU_GATED = KernelRef("dualop.kernels.cpu.gated_activation", "gated_activation")
_CPU_GATED_COVERS = KernelRef("dualop.kernels.cpu.gated_activation", "covers")
_CPU_FAST_GATED = KernelRef("dualop.kernels.cpu.gated_activation", "FAST_GATED_ACTIVATION")
_CPU_FAST_GATED_ARGUMENTS = KernelRef("dualop.kernels.cpu.gated_activation", "fast_arguments")


class _GatedActivation(CustomOp):
    """``act(gate) * up`` over the two halves of the last dim (``d = x.shape[-1] // 2``), in float32.

    Subclasses set ``self.spec`` (a ``GateSpec``); the formula lives once in ``kernels/gate_math``
    and serves the native body and the Pallas kernel alike."""

    spec: GateSpec = GateSpec()
    parameterless = True  # the layer modules wrap the op as it is (dualop.torch/jax.layers)
    output_args: ClassVar[tuple[str, ...]] = ("out",)

    def check_inputs(self, x: Any, *, out: Any = None) -> None:
        op = type(self).name
        check_array(op, "x", x)
        if x.shape[-1] % 2:
            raise ValueError(
                f"{op}: argument 'x' must have an even last dim (gate and up halves), got shape {tuple(x.shape)}"
            )
        if out is not None:  # the engine's preallocated output (ops/_outputs.py)
            check_output(op, "out", out, (*x.shape[:-1], x.shape[-1] // 2), x.dtype, x.device, {"x": x})

    def forward_native(self, x: Any, *, out: Any = None) -> Any:
        xp = array_namespace(x)
        gate, up = gate_and_up(xp.astype(x, xp.float32), x.shape[-1] // 2, self.spec)
        return write_outputs(xp.astype(apply_gate(xp, gate, up, self.spec), x.dtype), (out,))

    def declines(self, method: str, frontend: str) -> str | None:
        """The C++ CPU kernel serves torch tensors and has the silu, gelu and gelu-tanh gates on
        either half; the other gates (sparse, interleaved, fatrelu) run the native body."""
        return _CPU_GATED_COVERS(self.spec) if method == "forward_cpu" else None

    @validates_inputs
    def forward_cpu(self, x: Any, *, out: Any = None) -> Any:
        """torch on the CPU: the C++ row kernel (``kernels/cpu``, straight into a given ``out``); it
        declines while autograd records (no backward) and when the kernels cannot be built here.
        A call of plain row-major tensors goes straight to the kernel's torch operator, which checks
        it in C++; any other call is checked here first."""
        fast = self._cpu_fast
        if fast is None:
            fast = self._cpu_fast = self._fast_cpu_call()
        if fast:
            y = fast[0].take(x, fast[1].get(getattr(x, "dtype", None)), out, fast[2], fast[3])
            if y is not None:
                return y
        self.check_inputs(x, out=out)
        decline_if_recording(type(self).name, x)
        return _CPU_GATED(x, spec=self.spec, out=out)

    _cpu_fast: tuple | None = None

    def _fast_cpu_call(self) -> tuple:
        """``(operator, tables by dtype, activation code, act on first)`` of the CPU fast path, or
        ``()`` where the operators cannot be built here."""
        operator = _CPU_FAST_GATED.resolve()
        return () if operator.get() is None else (operator, *_CPU_FAST_GATED_ARGUMENTS(self.spec))

    def forward_cuda(self, x: Any, *, out: Any = None) -> Any:
        return write_outputs(call_triton(frontend_of(x), _TRITON_GATED, x, spec=self.spec), (out,))

    def forward_tpu(self, x: Any, *, out: Any = None) -> Any:
        return write_outputs(call_jax_function(frontend_of(x), _PALLAS_GATED, x, spec=self.spec,
                                               native=self.forward_native), (out,))

    def extra_repr(self) -> str:
        return repr(self.spec)


@CustomOp.register("silu_and_mul")
class SiluAndMul(_GatedActivation):
    """SwiGLU gate: ``silu(x[..., :d]) * x[..., d:]``."""

    spec = GateSpec("silu")

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)


@CustomOp.register("mul_and_silu")
class MulAndSilu(_GatedActivation):
    """``x[..., :d] * silu(x[..., d:])`` (the halves the other way round)."""

    spec = GateSpec("silu", act_on="second")

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)


def _check_approximate(op: str, approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{op}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu" if approximate == "none" else "gelu_tanh"


@CustomOp.register("gelu_and_mul")
class GeluAndMul(_GatedActivation):
    """GeGLU gate: ``gelu(x[..., :d]) * x[..., d:]``, exact (erf) or ``approximate="tanh"``."""

    def __init__(self, approximate: str = "none", *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.approximate = approximate
        self.spec = GateSpec(_check_approximate("gelu_and_mul", approximate))


@CustomOp.register("gelu_and_mul_sparse")
class GeluAndMulSparse(_GatedActivation):
    """GeGLU with activation sparsity (Gemma 3n): keep only the top ``1 - activation_sparsity`` of
    each gate row, assuming it is normally distributed, then ``gelu(gate) * up``:
    ``gate = relu(g - (mean(g) + std(g) * Phi^-1(activation_sparsity)))`` over the last dim, std with
    ddof 0. Sparsity 0 is plain GeluAndMul (use that op)."""

    def __init__(self, activation_sparsity: float, approximate: str = "none", *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        act = _check_approximate("gelu_and_mul_sparse", approximate)
        if isinstance(activation_sparsity, bool) or not isinstance(activation_sparsity, (int, float)):
            raise TypeError(f"gelu_and_mul_sparse: activation_sparsity must be a float, got {activation_sparsity!r}")
        if activation_sparsity == 0.0:
            raise ValueError("gelu_and_mul_sparse: activation_sparsity 0.0 means no sparsity; use GeluAndMul")
        if not 0.0 < activation_sparsity < 1.0:
            raise ValueError(
                f"gelu_and_mul_sparse: activation_sparsity must be in (0, 1), got {activation_sparsity!r}"
            )
        self.activation_sparsity = float(activation_sparsity)
        self.approximate = approximate
        self.spec = GateSpec(act, sparsity=self.activation_sparsity)


def _finite(op: str, name: str, value: Any, *, positive: bool = False) -> float:
    """A constructor's float parameter: a real number, finite (and > 0 where ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be a finite float, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{op}: {name} must be positive, got {value!r}")
    return float(value)


@CustomOp.register("fatrelu_and_mul")
class FatreluAndMul(_GatedActivation):
    """FATReLU gate (MiniCPM): ``where(x1 > threshold, x1, 0) * x[..., d:]`` with ``x1 = x[..., :d]``."""

    def __init__(self, threshold: float = 0.0, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.threshold = _finite("fatrelu_and_mul", "threshold", threshold)
        self.spec = GateSpec("fatrelu", threshold=self.threshold)


@CustomOp.register("swigluoai_and_mul")
class SwigluOAIAndMul(_GatedActivation):
    """gpt-oss's clamped SwiGLU on interleaved gate/up: ``gate = x[..., 0::2].clamp(max=limit)``,
    ``up = x[..., 1::2].clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.alpha = _finite("swigluoai_and_mul", "alpha", alpha)
        self.limit = _finite("swigluoai_and_mul", "limit", limit, positive=True)
        self.spec = GateSpec("swigluoai", interleaved=True, alpha=self.alpha, limit=self.limit)


@CustomOp.register("silu_and_mul_with_clamp")
class SiluAndMulWithClamp(_GatedActivation):
    """SwiGLU with clamped inputs (some MoE models' shared experts), on gate and up halves:
    ``gate = x[..., :d].clamp(max=swiglu_limit)``, ``up = x[..., d:].clamp(-swiglu_limit,
    swiglu_limit)``, ``gate * sigmoid(alpha * gate) * (up + beta)``. ``alpha=1, beta=0`` is
    ``silu(gate) * up`` on the clamped halves; SwiGLU-OAI-style models pass their alpha and beta 1."""

    def __init__(self, swiglu_limit: float, alpha: float = 1.0, beta: float = 0.0, *,
                 enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = "silu_and_mul_with_clamp"
        self.swiglu_limit = _finite(op, "swiglu_limit", swiglu_limit, positive=True)
        self.alpha, self.beta = _finite(op, "alpha", alpha), _finite(op, "beta", beta)
        self.spec = GateSpec("silu_clamp", alpha=self.alpha, limit=self.swiglu_limit, beta=self.beta)


@CustomOp.register("swiglustep_and_mul")
class SwigluStepAndMul(_GatedActivation):
    """SwiGLU with a clamped output of the gate (Step models): ``silu(x[..., :d]).clamp(max=limit) *
    x[..., d:].clamp(-limit, limit)``."""

    def __init__(self, limit: float = 7.0, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.limit = _finite("swiglustep_and_mul", "limit", limit, positive=True)
        self.spec = GateSpec("swiglustep", limit=self.limit)


@CustomOp.register("situ_and_mul")
class SituAndMul(_GatedActivation):
    """SituGLU (Kimi): ``beta * tanh(gate / beta) * sigmoid(gate) * up`` on gate and up halves; with
    ``linear_beta``, ``up`` is first softly clipped to ``linear_beta * tanh(up / linear_beta)``."""

    def __init__(self, beta: float = 1.0, linear_beta: float | None = None, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.beta = _finite("situ_and_mul", "beta", beta, positive=True)
        self.linear_beta = None if linear_beta is None else _finite("situ_and_mul", "linear_beta", linear_beta,
                                                                    positive=True)
        self.spec = GateSpec("situ", beta=self.beta, linear_beta=self.linear_beta or 0.0)


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with."""
    from dualop.testing import GATED_SHAPES, OpCase, x_only

    return [
        OpCase("silu_and_mul", "silu_and_mul", lambda s: SiluAndMul(), x_only(), GATED_SHAPES),
        OpCase("gelu_and_mul", "gelu_and_mul", lambda s: GeluAndMul(), x_only(), GATED_SHAPES),
        OpCase("gelu_and_mul", "gelu_and_mul[tanh]", lambda s: GeluAndMul("tanh"), x_only(), GATED_SHAPES),
        OpCase("mul_and_silu", "mul_and_silu", lambda s: MulAndSilu(), x_only(), GATED_SHAPES),
        OpCase("gelu_and_mul_sparse", "gelu_and_mul_sparse[0.95]", lambda s: GeluAndMulSparse(0.95), x_only(), GATED_SHAPES),
        OpCase("gelu_and_mul_sparse", "gelu_and_mul_sparse[0.5,tanh]", lambda s: GeluAndMulSparse(0.5, "tanh"), x_only(), GATED_SHAPES),
        OpCase("fatrelu_and_mul", "fatrelu_and_mul[0.3]", lambda s: FatreluAndMul(0.3), x_only(), GATED_SHAPES),
        OpCase("swigluoai_and_mul", "swigluoai_and_mul", lambda s: SwigluOAIAndMul(), x_only(4.0), GATED_SHAPES),
        # inputs of scale 4 reach the clamps (limit 3) and the soft clips
        OpCase("silu_and_mul_with_clamp", "silu_and_mul_with_clamp[3,1.702,1]",
               lambda s: SiluAndMulWithClamp(3.0, 1.702, 1.0), x_only(4.0), GATED_SHAPES),
        OpCase("swiglustep_and_mul", "swiglustep_and_mul[3]", lambda s: SwigluStepAndMul(3.0), x_only(4.0),
               GATED_SHAPES),
        OpCase("situ_and_mul", "situ_and_mul[2,3]", lambda s: SituAndMul(2.0, 3.0), x_only(4.0), GATED_SHAPES),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


def _gated_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.gated_activation_cost(rows_of(shape), shape[-1] // 2, itemsize, op.spec)


def _torch_gated(activation: str, act_on_first: bool = True, **kw: Any):
    def builtin(op):
        import torch.nn.functional as F

        act = getattr(F, activation)

        def gated(x):
            d = x.shape[-1] // 2
            a, b = x[..., :d], x[..., d:]
            return act(a, **kw) * b if act_on_first else a * act(b, **kw)

        return gated

    return builtin


def _jax_gated(act_name: str, act_on_first: bool = True, **kw: Any):
    def handwritten(op):
        import jax
        import jax.numpy as jnp

        act = getattr(jax.nn, act_name)

        def gated(x):
            d = x.shape[-1] // 2
            xf = x.astype(jnp.float32)
            a, b = xf[..., :d], xf[..., d:]
            return (act(a, **kw) * b if act_on_first else a * act(b, **kw)).astype(x.dtype)

        return gated

    return handwritten



def bench_cases():
    """The gated activations against torch's ``F.silu``/``F.gelu`` times up, and hand-written ``jax.numpy``."""
    return [
        BenchCase("silu_and_mul", "silu_and_mul", lambda hidden: SiluAndMul(), x_only_inputs, _gated_cost,
                  _torch_gated("silu"), _jax_gated("silu")),
        BenchCase("gelu_and_mul", "gelu_and_mul", lambda hidden: GeluAndMul(), x_only_inputs, _gated_cost,
                  _torch_gated("gelu"), _jax_gated("gelu", approximate=False)),
        # not run by default; ask with --ops
        BenchCase("mul_and_silu", "mul_and_silu", lambda hidden: MulAndSilu(), x_only_inputs, _gated_cost,
                  _torch_gated("silu", act_on_first=False), _jax_gated("silu", act_on_first=False), default=False),
        BenchCase("gelu_tanh_and_mul", "gelu_and_mul", lambda hidden: GeluAndMul("tanh"), x_only_inputs, _gated_cost,
                  _torch_gated("gelu", approximate="tanh"), _jax_gated("gelu", approximate=True), default=False),
        # the engine's form (torch): into a preallocated output
        BenchCase("silu_and_mul[out]", "silu_and_mul", lambda hidden: SiluAndMul(), _gated_out_inputs, _gated_cost,
                  default=False, written=lambda a: ((a[0],), {"out": a[1]})),
    ]


def _gated_out_inputs(shape, rng):
    """x as the other cases', and the ``(..., d)`` output to write."""
    return (*x_only_inputs(shape, rng), np.zeros((*shape[:-1], shape[-1] // 2), np.float32))


# Prefill of 8192 tokens and a 16-token decode batch at the widths of Llama-3-70B (intermediate
# 28672) and Llama-3-405B (53248); gate and up side by side.
SERVING_GATED_SHAPES = ((8192, 2 * 28672), (16, 2 * 53248))


def serving():
    return {op: Serving(SERVING_GATED_SHAPES) for op in ("silu_and_mul", "mul_and_silu", "gelu_and_mul",
                                                       "gelu_and_mul_sparse", "fatrelu_and_mul", "swigluoai_and_mul",
                                                       "silu_and_mul_with_clamp", "swiglustep_and_mul",
                                                       "situ_and_mul")}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {
    "gelu_and_mul[tanh]": {"traits": {"cancelling"}},
    "gelu_and_mul_sparse[0.95]": {"traits": {"cancelling"}, "native_cells": {("torch", "cpu"): "no activation-sparsity gate"}},
    "gelu_and_mul_sparse[0.5,tanh]": {"traits": {"cancelling"},
                                      "native_cells": {("torch", "cpu"): "no activation-sparsity gate"}},
    "fatrelu_and_mul[0.3]": {"native_cells": {("torch", "cpu"): "the C++ CPU kernel has no fatrelu gate"}},
    "swigluoai_and_mul": {"native_cells": {("torch", "cpu"): "the C++ CPU kernel has no swigluoai gate"}},
    **{label: {"native_cells": {("torch", "cpu"): f"the C++ CPU kernel has no {gate} gate"}} for label, gate in (
        ("silu_and_mul_with_clamp[3,1.702,1]", "silu_clamp"), ("swiglustep_and_mul[3]", "swiglustep"),
        ("situ_and_mul[2,3]", "situ"))},
}
