"""nn.Module layers over dualop ops, with the reference serving engine's constructor signatures.

Each layer owns its parameters (a norm's weight) and calls the op in ``forward``; the op's
dispatch (config, platform path, fallbacks) and its torch.compile support apply unchanged.
Parameterless ops are wrapped by ``OpLayer`` so they can sit in an ``nn.Sequential``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dualop import ops

__all__ = [
    "OpLayer",
    "RMSNorm",
    "GemmaRMSNorm",
    "RMSNormGated",
    "XIELU",
]


class OpLayer(nn.Module):
    """An nn.Module around a parameterless op: ``forward(*args)`` calls it."""

    op_class: type = ops.SiluAndMul

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.op = self.op_class(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


def _op_layer(op_class: type) -> type:
    """A layer class named like ``op_class`` that builds and calls it."""
    doc = f"Layer over :class:`dualop.ops.{op_class.__name__}`. " + (op_class.__doc__ or "")
    return type(op_class.__name__, (OpLayer,), {"op_class": op_class, "__doc__": doc, "__module__": __name__})


for _op_class in ops.PARAMETERLESS_OPS:
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)


class RMSNorm(nn.Module):
    """``RMSNorm(hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None)``;
    ``forward(x, residual=None)`` returns ``out`` or ``(out, x + residual)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = ops.RMSNorm(hidden_size, eps, var_hidden_size=var_hidden_size, has_weight=has_weight)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if has_weight else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.op(x, self.weight, residual)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class GemmaRMSNorm(nn.Module):
    """``GemmaRMSNorm(hidden_size, eps=1e-6, dtype=None)``: scales by ``1 + weight`` (weight starts at
    zeros, as the reference engine's); ``forward(x, residual=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.op = ops.GemmaRMSNorm(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.op(x, self.weight, residual)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class RMSNormGated(nn.Module):
    """``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, dtype=None)``;
    ``forward(x, z=None)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = ops.RMSNormGated(hidden_size, eps, group_size=group_size, norm_before_gate=norm_before_gate)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return self.op(x, self.weight, z)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class XIELU(nn.Module):
    """``XIELU(alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6, dtype=None)``: owns the raw
    ``alpha_p``/``alpha_n`` parameters (shape (1,)), initialised as the reference engine does."""

    def __init__(
        self,
        alpha_p_init: float = 0.8,
        alpha_n_init: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = ops.XIELU(alpha_p_init, alpha_n_init, beta, eps)
        alpha_p, alpha_n = self.op.initial_parameters()
        self.alpha_p = nn.Parameter(torch.tensor([alpha_p], dtype=dtype or torch.float32))
        self.alpha_n = nn.Parameter(torch.tensor([alpha_n], dtype=dtype or torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.alpha_p, self.alpha_n)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class MMEncoderAttention(OpLayer):
    """``MMEncoderAttention(num_heads, head_size, scale=None, num_kv_heads=None)``; ``forward(query,
    key, value, cu_seqlens=None, max_seqlen=None)``: the vision encoder's attention (no parameters;
    the projections around it are the model's)."""

    op_class = ops.MMEncoderAttention


__all__.append("MMEncoderAttention")
# --- rope: the engine's rotary layers hold no parameters (the cos/sin cache lives in the op, built
# once in float32 and kept per device and dtype), so each is the op behind the layer interface.
for _op_class in (ops.RotaryEmbedding, ops.DualChunkRotaryEmbedding, ops.ApplyRotaryEmb):
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)
