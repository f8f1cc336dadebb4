"""RMS-norm formula, written once against an array namespace ``xp``; the native op bodies use it
with torch's or jax's namespace and the Pallas kernel with jax's (Triton restates it in ``tl``).

A ``NormSpec`` names one variant and is hashable, so kernels take it as a static argument.
"""

from __future__ import annotations

import dataclasses

__all__ = ["NormSpec", "rms_normalize"]


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """One RMS-norm variant.

    eps: added to the mean square. var_size: take the statistic over ``x[..., :var_size]`` only
    (None: the whole row). weight_offset: multiply by ``weight_offset + weight`` (Gemma: 1).
    weight_in_f32: multiply by the weight in float32 and cast once (Gemma); otherwise cast the
    normalised row first, then multiply in the output dtype (Llama, the reference RMSNorm).
    """

    eps: float = 1e-6
    var_size: int | None = None
    weight_offset: float = 0.0
    weight_in_f32: bool = False


def rms_normalize(xp, xf, weight, spec: NormSpec, out_dtype):
    """Normalise float32 rows ``xf`` and apply ``weight`` (or None); return ``out_dtype``."""
    xv = xf if spec.var_size is None else xf[..., : spec.var_size]
    y = xf * xp.rsqrt(xp.mean(xv * xv, axis=-1, keepdims=True) + spec.eps)
    if weight is None:
        return xp.astype(y, out_dtype)
    w = xp.astype(weight, xp.float32)
    if spec.weight_offset:
        w = w + spec.weight_offset
    if spec.weight_in_f32:
        return xp.astype(y * w, out_dtype)
    return xp.astype(xp.astype(xp.astype(y, out_dtype), xp.float32) * w, out_dtype)
