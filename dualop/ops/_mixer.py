"""The projections of the Mamba-family mixers (``mamba_mixer``, ``mamba_mixer2``,
``plamo2_mamba_mixer``): one rule for their GEMMs.

Each projection is a one-rank ``ReplicatedLinear``: the native body runs its reference
(``_native_gemm``: float32 operands at full precision, one rounding to x's dtype), and a platform
method runs the same platform method of the linear op, so a mixer's matmuls are the vendor GEMM the
linear ops use (``F.linear`` on the torch CPU and GPUs; XLA's dot through the Pallas bridge on a
TPU, from jax, torch_xla, torchax and torch_tpu).
"""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.ops.linear import ReplicatedLinear
from dualop.parallel import TensorParallel

__all__ = ["projection", "project"]


def projection(input_size: int, output_size: int, bias: bool = False) -> ReplicatedLinear:
    """A mixer's projection ``y = x @ W.T (+ b)``, ``W [output_size, input_size]``, on one rank."""
    return ReplicatedLinear(input_size, output_size, bias=bias, return_bias=False, tp=TensorParallel(),
                            enforce_enable=True)


def project(linear: ReplicatedLinear, method: str, x: Any, weight: Any, bias: Any = None) -> Any:
    """``linear``'s ``method`` (``forward_native`` or the mixer's own platform method) on ``x``. The
    vendor GEMM takes operands of one dtype, so a platform method casts weights of another dtype to
    x's; the reference multiplies them in float32 as given."""
    if method != "forward_native" and weight.dtype != x.dtype:
        xp = array_namespace(x)
        weight = xp.astype(weight, x.dtype)
        bias = None if bias is None else xp.astype(bias, x.dtype)
    return getattr(linear, method)(x, weight, bias)
