"""The fp8 KV cache's formats and its quantisation rule, shared by every path that writes or reads
one (``reshape_and_cache`` and ``ragged_paged_attention``: their native bodies, the Pallas, Triton
and CPU kernels, and the tests).

A float8 cache stores ``code = fp8(clip(x * (1 / scale), -max, max))``, all in float32, the cast
rounding to nearest even, and is read back as ``code * scale`` in float32 (the reference serving
engine's ``k_scale`` / ``v_scale``; it divides by the scale, see ``inverse_scale``). ``max`` is
the format's largest finite value: 448 for float8_e4m3fn, 57344 for float8_e5m2. A NaN stays NaN;
+-inf and anything past ``max`` saturate to ``+-max``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Fp8KvFormat", "E4M3FN", "E5M2", "FP8_KV_FORMATS", "KV_CACHE_DTYPES", "fp8_kv_format",
           "inverse_scale", "round_to_fp8_grid", "quantize_kv"]


@dataclasses.dataclass(frozen=True)
class Fp8KvFormat:
    """A float8 cache format: ``dtype`` (the torch/jax dtype name), ``max`` (its largest finite
    value, where values saturate), ``mantissa_bits`` and ``exponent_bias``."""

    dtype: str
    max: float
    mantissa_bits: int
    exponent_bias: int

    @property
    def subnormal_step(self) -> float:
        """The grid's spacing below the smallest normal value, ``2**(1 - bias - mantissa_bits)``."""
        return 2.0 ** (1 - self.exponent_bias - self.mantissa_bits)


E4M3FN = Fp8KvFormat("float8_e4m3fn", 448.0, 3, 7)  # OCP e4m3: no inf, NaN 0x7f/0xff
E5M2 = Fp8KvFormat("float8_e5m2", 57344.0, 2, 15)  # OCP e5m2: IEEE-like, inf and NaN
FP8_KV_FORMATS = {fmt.dtype: fmt for fmt in (E4M3FN, E5M2)}

# The engine's kv_cache_dtype names and the cache dtype each one means ("auto": the model's dtype,
# the dtype of the keys and values written).
KV_CACHE_DTYPES: dict[str, str | None] = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                                          "fp8_e5m2": "float8_e5m2"}


def fp8_kv_format(dtype: Any) -> Fp8KvFormat | None:
    """The format of a cache dtype (torch or jax dtype, or its name), None for a float cache."""
    return FP8_KV_FORMATS.get(str(dtype).removeprefix("torch."))


def inverse_scale(scale: float) -> float:
    """``1 / scale`` rounded once to float32 (a Python number's reciprocal, computed on the host).

    Every path multiplies by this reciprocal instead of dividing by the scale: XLA rewrites a
    division by a broadcast scalar into a multiplication by its reciprocal (jax 0.10's CPU
    backend does, even for a traced scalar), so a division could not give the same bytes on every
    path; ``x * (1 / scale)`` can. It differs from the engine's ``x / scale`` only where ``x /
    scale`` lies within one float32 ulp of a rounding midpoint of the fp8 grid."""
    return float(np.float32(1.0) / np.float32(scale))


def round_to_fp8_grid(xp: Any, y: Any, fmt: Fp8KvFormat) -> Any:
    """``y`` (float32, ``|y| <= fmt.max``) rounded to the nearest value of ``fmt``'s grid, ties to
    even, kept in float32, so the cast that follows is exact: XLA's float32 -> float8 convert rounds
    twice (through float16) in some releases (jax 0.7.1, torch_xla 2.9), so the XLA-backed paths
    round here first, with array-namespace arithmetic only (no bit casts).

    With ``q = mantissa_bits`` and ``big = max(|y| * 2**(23 - q), subnormal_step * 2**23)``,
    ``(|y| + big) - big`` rounds ``|y|`` to a multiple of ulp(big), to nearest even: ``2**(e - q)``
    in binade ``2**e`` (the format's quantum), ``subnormal_step`` below its smallest normal. Only
    where ``|y| + big`` crosses into the next binade (|y| just below ``2**(e + 1)``) does it land one
    quantum low, at ``(2**(q+1) - 1) * 2**(e - q)``; that is detected (``|y| - r`` above half a
    quantum, ``r / 2**(q + 1)``, impossible for a correctly rounded ``r``) and replaced by ``r + r /
    (2**(q+1) - 1)`` = ``2**(e + 1)``. ``big`` depends on the data on purpose: XLA folds ``(a + C) -
    C`` to ``a`` for a constant ``C``. (``quant_fp8``'s e4m3 rounding is this rule with q = 3.)"""
    q = fmt.mantissa_bits
    m = xp.abs(y)
    big = xp.maximum(m * 2.0 ** (23 - q), fmt.subnormal_step * 2.0 ** 23)
    r = (m + big) - big
    low = m - r > xp.maximum(r * 2.0 ** -(q + 1), fmt.subnormal_step * 0.5)
    r = xp.where(low, r + r * (1.0 / (2 ** (q + 1) - 1)), r)
    r = xp.where(y < 0, -r, r)
    return xp.where(m == 0, y, r)  # keeps the sign of zero; NaN stays NaN


def quantize_kv(xp: Any, x: Any, inverse: Any, dtype: Any, *, xla: bool) -> Any:
    """``x`` (any float dtype) as codes of the float8 ``dtype``: ``fp8(clip(x * inverse, -max,
    max))`` in float32 (``inverse``: ``inverse_scale``'s float, or a float32 array that broadcasts,
    the reciprocal of a scale tensor). ``xla``: the array is XLA-backed (jax, torch_xla, torchax),
    whose cast is preceded by ``round_to_fp8_grid``."""
    fmt = fp8_kv_format(dtype)
    y = xp.clip(xp.astype(x, xp.float32) * inverse, -fmt.max, fmt.max)
    if xla:
        y = round_to_fp8_grid(xp, y, fmt)
    return xp.astype(y, dtype)
