"""flax.nnx layers over dualop ops, with the reference serving engine's constructor signatures.

Twin of ``dualop.torch.layers``: each layer owns its parameters (``nnx.Param``) and calls the op,
so the config, the platform path (Pallas on TPU) and its gradient rule apply unchanged; the
layers work under ``nnx.jit`` / ``jax.jit``, ``vmap`` and ``grad``.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from dualop import ops

__all__ = [
    "OpLayer",
    "RMSNorm",
    "GemmaRMSNorm",
    "RMSNormGated",
    "XIELU",
]


class OpLayer(nnx.Module):
    """An nnx.Module around a parameterless op: ``__call__(*args)`` calls it."""

    op_class: type = ops.SiluAndMul

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.op = self.op_class(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)


def _op_layer(op_class: type) -> type:
    """A layer class named like ``op_class`` that builds and calls it."""
    doc = f"Layer over :class:`dualop.ops.{op_class.__name__}`. " + (op_class.__doc__ or "")
    return type(op_class.__name__, (OpLayer,), {"op_class": op_class, "__doc__": doc, "__module__": __name__})


for _op_class in ops.PARAMETERLESS_OPS:
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)


class RMSNorm(nnx.Module):
    """``RMSNorm(hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None)``;
    ``__call__(x, residual=None)`` returns ``out`` or ``(out, x + residual)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        dtype: Any = None,
    ) -> None:
        self.op = ops.RMSNorm(hidden_size, eps, var_hidden_size=var_hidden_size, has_weight=has_weight)
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype or jnp.float32)) if has_weight else None

    def __call__(self, x, residual=None):
        return self.op(x, None if self.weight is None else self.weight[...], residual)


class GemmaRMSNorm(nnx.Module):
    """``GemmaRMSNorm(hidden_size, eps=1e-6, dtype=None)``: scales by ``1 + weight`` (weight starts at
    zeros); ``__call__(x, residual=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Any = None) -> None:
        self.op = ops.GemmaRMSNorm(hidden_size, eps)
        self.weight = nnx.Param(jnp.zeros((hidden_size,), dtype or jnp.float32))

    def __call__(self, x, residual=None):
        return self.op(x, self.weight[...], residual)


class RMSNormGated(nnx.Module):
    """``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, dtype=None)``;
    ``__call__(x, z=None)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        dtype: Any = None,
    ) -> None:
        self.op = ops.RMSNormGated(hidden_size, eps, group_size=group_size, norm_before_gate=norm_before_gate)
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype or jnp.float32))

    def __call__(self, x, z=None):
        return self.op(x, self.weight[...], z)


class XIELU(nnx.Module):
    """``XIELU(alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6, dtype=None)``: owns the raw
    ``alpha_p``/``alpha_n`` parameters (shape (1,)), initialised as the reference engine does."""

    def __init__(
        self,
        alpha_p_init: float = 0.8,
        alpha_n_init: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        dtype: Any = None,
    ) -> None:
        self.op = ops.XIELU(alpha_p_init, alpha_n_init, beta, eps)
        alpha_p, alpha_n = self.op.initial_parameters()
        self.alpha_p = nnx.Param(jnp.asarray([alpha_p], dtype or jnp.float32))
        self.alpha_n = nnx.Param(jnp.asarray([alpha_n], dtype or jnp.float32))

    def __call__(self, x):
        return self.op(x, self.alpha_p[...], self.alpha_n[...])


class MMEncoderAttention(OpLayer):
    """``MMEncoderAttention(num_heads, head_size, scale=None, num_kv_heads=None)``; ``__call__(query,
    key, value, cu_seqlens=None, max_seqlen=None)``: the vision encoder's attention (no parameters;
    the projections around it are the model's)."""

    op_class = ops.MMEncoderAttention


__all__.append("MMEncoderAttention")
# --- rope: the engine's rotary layers hold no parameters (the cos/sin cache lives in the op, built
# once in float32 and kept per device and dtype), so each is the op behind the layer interface.
for _op_class in (ops.RotaryEmbedding, ops.DualChunkRotaryEmbedding, ops.ApplyRotaryEmb):
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)
