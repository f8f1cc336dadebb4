"""Gated RMS normalisation (the Mamba-2 / gated-delta-net output norm): RMSNormGated."""

from __future__ import annotations

import math
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_not_engine_activation, check_optional_like, decline_if_recording
from dualop.platforms import frontend_of
from dualop.spec import Serving

__all__ = ["RMSNormGated"]

_PALLAS_RMS_NORM_GATED = KernelRef("dualop.kernels.pallas.rms_norm_gated", "rms_norm_gated")
_TRITON_RMS_NORM_GATED = KernelRef("dualop.kernels.cuda.rms_norm_gated", "rms_norm_gated")
_CPU_RMS_NORM_GATED = KernelRef("dualop.kernels.cpu.rms_norm", "rms_norm_gated")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@CustomOp.register("rms_norm_gated")
class RMSNormGated(CustomOp):
    """Group-wise RMS normalisation with an optional SiLU gate.

    ``op(x, weight, z=None)`` with ``x`` of shape ``(..., hidden_size)``, ``weight`` of shape
    ``(hidden_size,)`` and ``z`` (the gate) shaped and typed like ``x``. Everything is computed in
    float32 and cast to ``x``'s dtype once, at the end (the reference engine's mamba
    ``layernorm_gated`` reference with ``upcast=True``):

    1. if ``z`` is given and not ``norm_before_gate``: ``x = x * silu(z)``;
    2. per group of ``group_size`` consecutive features (``None``: the whole last dim):
       ``x = x * rsqrt(mean(x**2 over the group) + eps)``;
    3. ``x = x * weight`` (with ``cast_before_weight``, the Mamba-2 mixers' ``weight * x.to(dtype)``:
       ``x`` is first rounded to ``x``'s dtype, and the product rounded again at the end);
    4. if ``z`` is given and ``norm_before_gate``: ``x = x * silu(z)``.

    ``weight`` is an argument, not state, so one op object serves every layer of a model.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        cast_before_weight: bool = False,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if not _positive_int(hidden_size):
            raise ValueError(f"rms_norm_gated: hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
            raise ValueError(f"rms_norm_gated: eps must be a non-negative float, got {eps!r}")
        if not math.isfinite(eps):
            raise ValueError(f"rms_norm_gated: eps must be a non-negative float, got {eps!r}; expected a finite value")
        if group_size is not None:
            if not _positive_int(group_size):
                raise ValueError(f"rms_norm_gated: group_size must be None or a positive int, got {group_size!r}")
            if hidden_size % group_size:
                raise ValueError(
                    f"rms_norm_gated: group_size={group_size} must divide hidden_size={hidden_size}"
                )
        if not isinstance(norm_before_gate, bool):
            raise TypeError(f"rms_norm_gated: norm_before_gate must be a bool, got {norm_before_gate!r}")
        if not isinstance(cast_before_weight, bool):
            raise TypeError(f"rms_norm_gated: cast_before_weight must be a bool, got {cast_before_weight!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.cast_before_weight = cast_before_weight

    @property
    def _group(self) -> int:
        """Features per normalisation group (the whole hidden dim when ``group_size`` is None)."""
        return self.hidden_size if self.group_size is None else self.group_size

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}"
            + (", cast_before_weight=True" if self.cast_before_weight else "")
        )

    def check_inputs(self, x: Any, weight: Any = None, z: Any = None) -> None:
        fe = check_array("rms_norm_gated", "x", x)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"rms_norm_gated: argument 'x' has last dim {x.shape[-1]}; expected hidden_size={self.hidden_size}"
            )
        if weight is None:
            raise TypeError(
                f"rms_norm_gated: argument 'weight' is required; expected an array of shape ({self.hidden_size},)"
            )
        check_not_engine_activation("rms_norm_gated", "weight", weight, "x", x, (self.hidden_size,), "norm(x, z)",
                                    "op(x, weight, z)", "the layer RMSNormGated (dualop.torch.layers / "
                                    "dualop.jax.layers), which owns it and takes norm(x, z)")
        check_optional_like("rms_norm_gated", "weight", weight, "x", x, fe, shape=(self.hidden_size,))
        check_optional_like("rms_norm_gated", "z", z, "x", x, fe, same_dtype=True)

    def forward_native(self, x: Any, weight: Any, z: Any = None) -> Any:
        xp = array_namespace(x)
        f32 = xp.float32
        shape, group = tuple(x.shape), self._group
        h = xp.astype(x, f32)
        gate = None
        if z is not None:
            zf = xp.astype(z, f32)
            gate = zf * xp.sigmoid(zf)
            if not self.norm_before_gate:
                h = h * gate
        if group != self.hidden_size:
            h = h.reshape(*shape[:-1], self.hidden_size // group, group)
        h = h * xp.rsqrt(xp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        h = h.reshape(shape)
        if self.cast_before_weight:
            h = xp.astype(xp.astype(h, x.dtype), f32)
        h = h * xp.astype(weight, f32)
        if gate is not None and self.norm_before_gate:
            h = h * gate
        return xp.astype(h, x.dtype)


    def forward_cpu(self, x: Any, weight: Any, z: Any = None) -> Any:
        """torch on the CPU: one C++ pass over each row (``csrc/rms_norm.cc``); while autograd
        records, the native body (the kernel has no backward)."""
        decline_if_recording("rms_norm_gated", x, weight, z)
        return _CPU_RMS_NORM_GATED.resolve()(
            x, weight, z, group_size=self._group, eps=self.eps, norm_before_gate=self.norm_before_gate,
            cast_before_weight=self.cast_before_weight,
        )

    def forward_cuda(self, x: Any, weight: Any, z: Any = None) -> Any:
        return call_triton(
            frontend_of(x), _TRITON_RMS_NORM_GATED, x, weight, z,
            eps=self.eps, group_size=self._group, norm_before_gate=self.norm_before_gate,
            cast_before_weight=self.cast_before_weight,
        )

    def forward_tpu(self, x: Any, weight: Any, z: Any = None) -> Any:
        return call_jax_function(
            frontend_of(x), _PALLAS_RMS_NORM_GATED, x, weight, z,
            eps=self.eps, group_size=self._group, norm_before_gate=self.norm_before_gate,
            cast_before_weight=self.cast_before_weight,
            native=self.forward_native,
        )


# Shapes of the cases: zero tokens, one token, a 3-D input, hidden sizes off the 128-lane grid.
# Two shapes that launch a kernel per case keep the interpreted cells quick; several row blocks
# with a ragged last one are tested at kernel level (tests/ops/test_rms_norm_gated.py).
WHOLE_SHAPES = ((0, 136), (1, 200), (2, 3, 136))
# For the grouped case, with the group size each hidden size is split into: lane-aligned groups
# (384 = 3 x 128) and groups off the 128 grid (200 = 5 x 40).
GROUPED_SHAPES = ((0, 200), (1, 384), (2, 3, 200))
_GROUP_OF = {384: 128, 200: 40}


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with.

    One case per way the op is used by models: no gate, gate before the norm (Mamba-2 with one
    group), gate after the norm (Qwen3-Next), and gate before a group-wise norm (Mamba-2 with
    several groups). The remaining combinations run at kernel level in the tests.
    """
    from dualop.testing import OpCase, normal

    def inputs(gated: bool):
        def make(shape, rng):
            x = normal(shape, rng, 3.0)
            w = 1.0 + 0.5 * normal(shape[-1:], rng)
            return (x, w, normal(shape, rng, 2.0) if gated else None)

        return make

    name = "rms_norm_gated"
    return [
        OpCase(name, name, lambda s: RMSNormGated(s[-1]), inputs(False), WHOLE_SHAPES),
        OpCase(name, f"{name}[z]", lambda s: RMSNormGated(s[-1]), inputs(True), WHOLE_SHAPES),
        OpCase(
            name, f"{name}[z,norm_before_gate]", lambda s: RMSNormGated(s[-1], norm_before_gate=True),
            inputs(True), WHOLE_SHAPES,
        ),
        OpCase(
            name, f"{name}[z,group]", lambda s: RMSNormGated(s[-1], group_size=_GROUP_OF[s[-1]]),
            inputs(True), GROUPED_SHAPES,
        ),
    ]


# --- spec: what dualop compile builds (check_cases above) ----------------------------------


def _grouped_rms_norm_gated(shape):
    from dualop.ops import RMSNormGated

    return RMSNormGated(shape[-1], group_size=shape[-1] // 8)  # Mamba-2 style: 8 groups


def serving():
    """Prefill of 8192 tokens and a 16-token decode batch at hidden 8192 and 16384."""
    return {"rms_norm_gated": Serving(((8192, 8192), (16, 16384)), None,
                                      {"rms_norm_gated[z,group]": _grouped_rms_norm_gated})}
