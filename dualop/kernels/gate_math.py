"""Gated-activation formulas, written once against an array namespace ``xp``.

The native op bodies call them with torch's or jax's namespace; the Pallas kernels call them with
jax's inside the kernel. (Triton kernels restate them in ``tl``; ``kernels/cuda`` cannot share
Python-level array code.) Every function takes float32 arrays.

A ``GateSpec`` names one gated activation: which activation, which half it applies to, how the
halves are laid out, and its parameters. It is hashable, so kernels take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist

__all__ = ["GateSpec", "gate_and_up", "apply_gate", "ACTIVATIONS", "GATES"]

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def silu(xp, g):
    return g * xp.sigmoid(g)


def erf(xp, z):
    """``erf(z)`` as float32 rounds it: exactly +-1 from ``|z| >= 4`` (``1 - erf(4)`` is 1.5e-8, under
    half of float32's spacing below 1). Older XLA's float32 erf stops at +-(1 - 2**-24) there, which
    ``1 + erf(z)`` (the exact GELU of a large negative x) turns into an error of ``|x| * 3e-8``."""
    return xp.where(z >= 4.0, 1.0, xp.where(z <= -4.0, -1.0, xp.erf(z)))


def gelu(xp, g):
    return 0.5 * g * (1.0 + erf(xp, g * _SQRT_HALF))


def gelu_tanh(xp, g):
    return 0.5 * g * (1.0 + xp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


ACTIVATIONS = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh}
# Every gate a GateSpec may name: the activations above on the gate half, and the gates with their
# own treatment of both halves (apply_gate).
GATES = (*ACTIVATIONS, "fatrelu", "swigluoai", "silu_clamp", "swiglustep", "situ")


@dataclasses.dataclass(frozen=True)
class GateSpec:
    """One gated activation.

    activation: ``silu``, ``gelu``, ``gelu_tanh``, ``fatrelu`` (``where(g > threshold, g, 0)``),
        ``swigluoai`` (``(clip(up) + 1) * clip(g) * sigmoid(alpha * clip(g))``), ``silu_clamp``
        (``min(g, limit) * sigmoid(alpha * min(g, limit)) * (clip(up) + beta)``), ``swiglustep``
        (``min(silu(g), limit) * clip(up)``), ``situ`` (``beta * tanh(g / beta) * sigmoid(g) * up``,
        ``up`` first softly clipped to ``linear_beta * tanh(up / linear_beta)`` when that is > 0);
        ``clip`` is to ``[-limit, limit]``.
    act_on: ``first`` (``act(x[..., :d]) * x[..., d:]``) or ``second`` (``x[..., :d] * act(x[..., d:])``).
    interleaved: gate and up alternate along the last dim (gate = ``x[..., 0::2]``) instead of halves.
    threshold: fatrelu's threshold. alpha, limit: swigluoai's and silu_clamp's (limit: swiglustep's
        too). beta: silu_clamp's bias of up, situ's scale. linear_beta: situ's scale of up (0: none).
    sparsity: if > 0, keep only the top (1 - sparsity) of each gate row before the activation
        (gate = relu(g - (mean(g) + std(g) * Phi^-1(sparsity))), std with ddof 0).
    """

    activation: str = "silu"
    act_on: str = "first"
    interleaved: bool = False
    threshold: float = 0.0
    alpha: float = 1.702
    limit: float = 7.0
    sparsity: float = 0.0
    beta: float = 0.0
    linear_beta: float = 0.0
    # Phi^-1(sparsity), computed once here: a plain attribute torch.compile can read while it traces
    # the native body (it cannot trace statistics' C inv_cdf).
    std_multiplier: float = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.activation not in GATES:
            raise ValueError(f"GateSpec: unknown activation {self.activation!r}")
        if self.act_on not in ("first", "second"):
            raise ValueError(f"GateSpec: act_on must be 'first' or 'second', got {self.act_on!r}")
        if not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"GateSpec: sparsity must be in [0, 1), got {self.sparsity!r}")
        multiplier = NormalDist().inv_cdf(self.sparsity) if self.sparsity > 0.0 else 0.0
        object.__setattr__(self, "std_multiplier", multiplier)

    @property
    def needs_row_statistics(self) -> bool:
        """Whether the gate needs statistics of the whole gate row (so rows cannot be tiled)."""
        return self.sparsity > 0.0


def gate_and_up(x, d: int, spec: GateSpec):
    """Split ``x`` (..., 2d) into (gate, up) per the spec's layout and ``act_on``."""
    if spec.interleaved:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = x[..., :d], x[..., d:]
    return (first, second) if spec.act_on == "first" else (second, first)


def apply_gate(xp, gate, up, spec: GateSpec):
    """``act(gate) * up`` in float32 for the spec (row statistics over the last dim of ``gate``)."""
    if spec.sparsity > 0.0:
        mean = xp.mean(gate, axis=-1, keepdims=True)
        centred = gate - mean
        std = xp.sqrt(xp.mean(centred * centred, axis=-1, keepdims=True))
        gate = xp.maximum(gate - (mean + std * spec.std_multiplier), 0.0)
    if spec.activation == "fatrelu":
        return xp.where(gate > spec.threshold, gate, 0.0) * up
    if spec.activation == "swigluoai":
        gate = xp.minimum(gate, spec.limit)
        up = xp.clip(up, -spec.limit, spec.limit)
        return (up + 1.0) * (gate * xp.sigmoid(gate * spec.alpha))
    if spec.activation == "silu_clamp":
        gate = xp.minimum(gate, spec.limit)
        up = xp.clip(up, -spec.limit, spec.limit)
        return gate * xp.sigmoid(spec.alpha * gate) * (up + spec.beta)
    if spec.activation == "swiglustep":
        return xp.minimum(silu(xp, gate), spec.limit) * xp.clip(up, -spec.limit, spec.limit)
    if spec.activation == "situ":
        if spec.linear_beta > 0.0:
            up = spec.linear_beta * xp.tanh(up / spec.linear_beta)
        return spec.beta * xp.tanh(gate / spec.beta) * xp.sigmoid(gate) * up
    return ACTIVATIONS[spec.activation](xp, gate) * up
