"""Scaled rotary embeddings and ``get_rope`` (the reference engine's Rope variants).

Every class here is a ``RotaryEmbedding`` (registered name ``rotary_embedding``, as in the engine,
which registers none of these separately) that changes only how the float32 ``cos_sin_cache`` is
built (``_compute_inv_freq`` / ``_compute_cos_sin_cache``, with the attention factor ``mscale``
folded into cos and sin where the method has one). Two also change which cache rows a token reads
(``cos_sin``): ``Phi3LongRoPEScaledRotaryEmbedding`` (short or long factors by the call's largest
position) and ``MRotaryEmbedding`` (``[3, T]`` positions, one per channel section). The rotation
itself, and so every kernel, is the base class's.

``get_rope`` maps Hugging Face ``rope_parameters`` to these classes as the engine does and keeps one
instance per distinct argument set.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.ops._checks import check_array, check_finite_float, concrete_values
from dualop.ops.rotary import (
    INT_DTYPES, DualChunkRotaryEmbedding, RotaryEmbedding, check_positive_float, check_positive_int, dtype_label,
)

__all__ = [
    "LinearScalingRotaryEmbedding",
    "NTKScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
    "DeepseekScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "Phi3LongRoPEScaledRotaryEmbedding",
    "MRotaryEmbedding",
    "get_rope",
    "ROPE_TYPES",
]


def _who(cls: type) -> str:
    """How errors name an op of this family: the registered name and the class."""
    return f"{cls.name} ({cls.__name__})"


def _angles(inv_freq: np.ndarray, positions: np.ndarray, mscale: float = 1.0) -> np.ndarray:
    """``[len(positions), rotary_dim]`` float32: ``cos`` then ``sin`` of every (position, frequency)
    angle, times ``mscale``."""
    freqs = np.outer(positions.astype(np.float32), inv_freq.astype(np.float32)).astype(np.float32)
    scale = np.float32(mscale)
    return np.concatenate([np.cos(freqs) * scale, np.sin(freqs) * scale], axis=-1).astype(np.float32)


def _scaled_rows(max_position: int, factor: float) -> int:
    """Rows a cache scaled by ``factor`` holds: ``ceil(max_position * factor)`` (the engine's
    ``arange(max_position * factor)``)."""
    return int(math.ceil(max_position * factor))


# --- YaRN helpers (the YaRN paper's formulas; shared by YaRN, DeepSeek-YaRN and mrope+YaRN) -------


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention factor ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    """The (fractional) dimension whose wavelength makes ``num_rotations`` turns over ``max_position``."""
    return dim * math.log(max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(
    rotary_dim: int,
    base: float,
    factor: float,
    original_max_position: int,
    beta_fast: float,
    beta_slow: float,
    extrapolation_factor: float = 1.0,
    truncate: bool = True,
) -> np.ndarray:
    """YaRN's blend of interpolated (``/ factor``) and extrapolated frequencies: frequencies that
    turn more than ``beta_fast`` times over the original context keep their value, fewer than
    ``beta_slow`` times are interpolated, a linear ramp in between."""
    low = _yarn_correction_dim(beta_fast, rotary_dim, base, original_max_position)
    high = _yarn_correction_dim(beta_slow, rotary_dim, base, original_max_position)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    half = rotary_dim // 2
    ramp = np.clip((np.arange(half, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolate = ((1 - ramp) * np.float32(extrapolation_factor)).astype(np.float32)
    pos_freqs = np.power(np.float32(base), np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))
    inv_extrapolation = np.float32(1.0) / pos_freqs
    inv_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (inv_interpolation * (1 - extrapolate) + inv_extrapolation * extrapolate).astype(np.float32)


# --- the cache-only variants ---------------------------------------------------------------------


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Positions divided by ``factor`` (kaiokendev's linear interpolation).

    ``scaling_factors`` is a float or a list of floats: the cache then stacks one block per factor
    (``ceil(max_position_embeddings * factor)`` rows each, in the given order), so callers serving
    adapters with different factors add ``scaling_factor_to_offset[factor]`` to their positions.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factors: list[float] | float,
        dtype: Any = None,
        *,
        enforce_enable: bool = False,
    ) -> None:
        factors = list(scaling_factors) if isinstance(scaling_factors, (list, tuple)) else [scaling_factors]
        if not factors:
            raise ValueError(f"{_who(type(self))}: scaling_factors must not be empty")
        self.scaling_factors = [check_positive_float(_who(type(self)), "scaling_factors", f) for f in factors]
        self._scaling_factor_to_offset: dict[float, int] = {}
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        inv_freq = self._compute_inv_freq(self.base)
        blocks, offset = [], 0
        for factor in self.scaling_factors:
            t = np.arange(_scaled_rows(self.max_position_embeddings, factor), dtype=np.float32) / np.float32(factor)
            self._scaling_factor_to_offset.setdefault(float(factor), offset)
            blocks.append(_angles(inv_freq, t))
            offset += blocks[-1].shape[0]
        return np.concatenate(blocks, axis=0)

    @property
    def scaling_factor_to_offset(self) -> dict[float, int]:
        """First cache row of each factor's block."""
        return dict(self._scaling_factor_to_offset)


class NTKScalingRotaryEmbedding(RotaryEmbedding):
    """Fixed NTK-aware scaling: ``base * factor`` and every frequency divided by
    ``factor ** (2 / rotary_dim)``; with ``mixed_b``, frequency i (1-based) is divided by
    ``exp(ln(factor) * (i / (rotary_dim / 2)) ** mixed_b)`` instead (mixed NTK,
    https://kexue.fm/archives/9706). The cache keeps ``max_position_embeddings`` rows."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: Any = None,
        mixed_b: float | None = None,
        *,
        enforce_enable: bool = False,
    ) -> None:
        self.scaling_factor = check_positive_float(_who(type(self)), "scaling_factor", scaling_factor)
        self.mixed_b = None if mixed_b is None else check_positive_float(_who(type(self)), "mixed_b", mixed_b)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    def _compute_inv_freq(self, base: float) -> np.ndarray:
        factor = self.scaling_factor
        if self.mixed_b is None:
            inv_freq = super()._compute_inv_freq(base * factor)
            return (inv_freq / np.float32(factor ** (2.0 / self.rotary_dim))).astype(np.float32)
        half = self.rotary_dim // 2
        a = math.log(factor) / half**self.mixed_b
        divisors = np.exp(a * np.arange(1, half + 1, dtype=np.float32) ** np.float32(self.mixed_b))
        return (super()._compute_inv_freq(base) / divisors.astype(np.float32)).astype(np.float32)


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """Dynamic NTK scaling evaluated once at the scaled length: the cache holds
    ``ceil(max_position_embeddings * factor)`` rows with
    ``base * (factor**2 - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))`` (Hugging Face's dynamic
    formula at ``seq_len = factor * max_position_embeddings``)."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: Any = None,
        *,
        enforce_enable: bool = False,
    ) -> None:
        self.scaling_factor = check_positive_float(_who(type(self)), "scaling_factor", scaling_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        factor, d = self.scaling_factor, self.rotary_dim
        base = self.base * (factor * factor - (factor - 1)) ** (d / (d - 2))
        rows = _scaled_rows(self.max_position_embeddings, factor)
        return _angles(self._compute_inv_freq(base), np.arange(rows, dtype=np.float32))


class DynamicNTKAlphaRotaryEmbedding(RotaryEmbedding):
    """NTK scaling by ``alpha`` (Hunyuan): ``base * alpha ** (rotary_dim / (rotary_dim - 2))``,
    ``max_position_embeddings`` rows."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_alpha: float,
        dtype: Any = None,
        *,
        enforce_enable: bool = False,
    ) -> None:
        self.scaling_alpha = check_positive_float(_who(type(self)), "scaling_alpha", scaling_alpha)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        d = self.rotary_dim
        base = self.base * self.scaling_alpha ** (d / (d - 2))
        return _angles(self._compute_inv_freq(base), np.arange(self.max_position_embeddings, dtype=np.float32))


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN (Peng et al.): ``max_position_embeddings`` is the ORIGINAL context; the cache holds
    ``ceil(original * factor)`` rows of YaRN-blended frequencies, cos and sin multiplied by
    ``mscale``: ``yarn_get_mscale(factor) * attn_factor`` (just ``attn_factor`` when
    ``apply_yarn_scaling`` is False), or, given both ``mscale`` and ``mscale_all_dim`` (Hugging
    Face's yarn), ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) *
    attn_factor``."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: Any = None,
        *,
        extrapolation_factor: float = 1.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32,
        beta_slow: float = 1,
        apply_yarn_scaling: bool = True,
        truncate: bool = True,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        enforce_enable: bool = False,
    ) -> None:
        who = _who(type(self))
        self.scaling_factor = check_positive_float(who, "scaling_factor", scaling_factor)
        self.extrapolation_factor = check_finite_float(who, "extrapolation_factor", extrapolation_factor)
        self.attn_factor = check_positive_float(who, "attn_factor", attn_factor)
        self.beta_fast = check_positive_float(who, "beta_fast", beta_fast)
        self.beta_slow = check_positive_float(who, "beta_slow", beta_slow)
        self.truncate = bool(truncate)
        for name, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
            if value is not None:
                check_finite_float(who, name, value)
        self.mscale = float(self._magnitude(mscale, mscale_all_dim, apply_yarn_scaling) * self.attn_factor)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    def _magnitude(self, mscale: float | None, mscale_all_dim: float | None, apply_yarn_scaling: bool) -> float:
        """The attention factor before ``attn_factor``."""
        if mscale and mscale_all_dim:
            return yarn_get_mscale(self.scaling_factor, mscale) / yarn_get_mscale(self.scaling_factor, mscale_all_dim)
        return yarn_get_mscale(self.scaling_factor) if apply_yarn_scaling else 1.0

    def _compute_inv_freq(self, base: float) -> np.ndarray:
        return yarn_inv_freq(self.rotary_dim, base, self.scaling_factor, self.max_position_embeddings,
                             self.beta_fast, self.beta_slow, self.extrapolation_factor, self.truncate)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        rows = _scaled_rows(self.max_position_embeddings, self.scaling_factor)
        return _angles(self._compute_inv_freq(self.base), np.arange(rows, dtype=np.float32), self.mscale)


class DeepseekScalingRotaryEmbedding(YaRNScalingRotaryEmbedding):
    """DeepSeek's YaRN (``deepseek_yarn``): YaRN frequencies (always truncated correction range)
    and ``mscale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) *
    attn_factor``, with the engine's defaults ``mscale=1``, ``mscale_all_dim=0`` (a denominator of
    1). Same cache layout as every variant: ``[ceil(original * factor), rotary_dim]``, cos then sin."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        scaling_factor: float,
        dtype: Any = None,
        *,
        extrapolation_factor: float = 1.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32,
        beta_slow: float = 1,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, scaling_factor, dtype,
                         extrapolation_factor=extrapolation_factor, attn_factor=attn_factor,
                         beta_fast=beta_fast, beta_slow=beta_slow, truncate=True,
                         mscale=float(mscale), mscale_all_dim=float(mscale_all_dim), enforce_enable=enforce_enable)

    def _magnitude(self, mscale: float | None, mscale_all_dim: float | None, apply_yarn_scaling: bool) -> float:
        """Always the ratio (``mscale_all_dim=0`` gives a denominator of 1)."""
        return yarn_get_mscale(self.scaling_factor, mscale) / yarn_get_mscale(self.scaling_factor, mscale_all_dim)


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's frequency-dependent scaling: wavelengths shorter than
    ``orig_max_position / high_freq_factor`` keep their frequency, longer than
    ``orig_max_position / low_freq_factor`` are divided by ``scaling_factor``, a smooth blend in
    between. ``max_position_embeddings`` rows."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        orig_max_position: int,
        *,
        enforce_enable: bool = False,
    ) -> None:
        who = _who(type(self))
        self.scaling_factor = check_positive_float(who, "scaling_factor", scaling_factor)
        self.low_freq_factor = check_positive_float(who, "low_freq_factor", low_freq_factor)
        self.high_freq_factor = check_positive_float(who, "high_freq_factor", high_freq_factor)
        self.orig_max_position = check_positive_int(who, "orig_max_position", orig_max_position)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    def _compute_inv_freq(self, base: float) -> np.ndarray:
        inv_freq = super()._compute_inv_freq(base)
        wavelen = np.float32(2 * math.pi) / inv_freq
        low, high = self.low_freq_factor, self.high_freq_factor
        if low != high:
            smooth = ((self.orig_max_position / wavelen - low) / (high - low)).astype(np.float32)
        else:
            smooth = np.zeros_like(inv_freq)
        scaled = inv_freq / np.float32(self.scaling_factor)
        blended = (1 - smooth) * scaled + smooth * inv_freq
        out = np.where(wavelen < self.orig_max_position / high, inv_freq,
                       np.where(wavelen > self.orig_max_position / low, scaled, blended))
        return out.astype(np.float32)


class Phi3LongRoPEScaledRotaryEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3): per-frequency rescale factors, ``short_factor`` for contexts within
    ``original_max_position_embeddings`` and ``long_factor`` beyond, cos and sin times the
    attention factor (``sqrt(1 + ln(scale) / ln(original))`` with ``scale = max / original``, 1 if
    ``scale <= 1``, unless ``short_mscale`` / ``long_mscale`` are given).

    The cache stacks the short block (``original`` rows) over the long block
    (``max_position_embeddings`` rows). A call reads the long block for every token when its
    largest position is ``>= original`` (Hugging Face's rule: ``max(position) + 1 > original``),
    the short block otherwise; ``use_long_rope=True``/``False`` fixes the choice instead (the
    engine fixes it from the served model length, so a sequence's keys never change block).
    Neox style only, as in the engine.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        original_max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any,
        short_factor: list[float],
        long_factor: list[float],
        short_mscale: float | None = None,
        long_mscale: float | None = None,
        *,
        use_long_rope: bool | None = None,
        enforce_enable: bool = False,
    ) -> None:
        who = _who(type(self))
        if not is_neox_style:
            raise ValueError(f"{who}: only neox style is supported (is_neox_style=False given)")
        self.original_max_position_embeddings = check_positive_int(
            who, "original_max_position_embeddings", original_max_position_embeddings)
        half = int(rotary_dim) // 2 if isinstance(rotary_dim, (int, np.integer)) else None
        for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
            if not isinstance(factors, (list, tuple, np.ndarray)) or (half is not None and len(factors) != half):
                raise ValueError(f"{who}: {name} must be a list of rotary_dim // 2 = {half} numbers, got {factors!r}")
            for f in factors:
                check_positive_float(who, name, f)
        self.short_factor = [float(f) for f in short_factor]
        self.long_factor = [float(f) for f in long_factor]
        scale = max_position_embeddings / self.original_max_position_embeddings
        original = self.original_max_position_embeddings
        default = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
        self.short_mscale = default if short_mscale is None else check_finite_float(who, "short_mscale", short_mscale)
        self.long_mscale = default if long_mscale is None else check_finite_float(who, "long_mscale", long_mscale)
        self.use_long_rope = None if use_long_rope is None else bool(use_long_rope)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, True, dtype,
                         enforce_enable=enforce_enable)

    def _rescaled_inv_freq(self, factors: list[float]) -> np.ndarray:
        return (super()._compute_inv_freq(self.base) / np.asarray(factors, dtype=np.float32)).astype(np.float32)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        short = _angles(self._rescaled_inv_freq(self.short_factor),
                        np.arange(self.original_max_position_embeddings, dtype=np.float32), self.short_mscale)
        long = _angles(self._rescaled_inv_freq(self.long_factor),
                       np.arange(self.max_position_embeddings, dtype=np.float32), self.long_mscale)
        return np.concatenate([short, long], axis=0)

    @property
    def cache_positions(self) -> int:
        """Positions a call may use (the long block's rows); the short block is shorter."""
        return self.max_position_embeddings

    def cos_sin(self, positions: Any, dtype: Any) -> tuple[Any, Any]:
        xp = array_namespace(positions)
        cache = self.cache_for(positions, dtype)
        original = self.original_max_position_embeddings
        flat = xp.clip(positions.reshape(-1), 0, self.max_position_embeddings - 1)
        if self.use_long_rope is not None:
            rows = flat + original if self.use_long_rope else xp.clip(flat, 0, original - 1)
        elif flat.shape[0] == 0:
            rows = flat
        else:
            # one block for the whole call; a short-block row is clipped in case the check was skipped
            rows = xp.where(xp.amax(flat) >= original, flat + original, xp.clip(flat, 0, original - 1))
        picked = xp.take(cache, rows, axis=0)
        half = self.rotary_dim // 2
        return picked[:, :half], picked[:, half:]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, original_max_position_embeddings={self.original_max_position_embeddings}"


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (Qwen2-VL and successors): ``positions`` is ``[T]`` (text: plain rope) or
    ``[3, T]`` (temporal, height, width). Each of the ``rotary_dim // 2`` frequencies takes its
    angle from one of the three rows: in ``mrope_section = [t, h, w]`` contiguous sections
    (``t + h + w == rotary_dim // 2``), or with ``mrope_interleaved`` in the pattern ``t h w t h w
    ...`` (frequency c reads h when ``c % 3 == 1 and c < 3 h``, w when ``c % 3 == 2 and c < 3 w``,
    else t; Qwen3-VL). The cache holds ``4 * max_position_embeddings`` rows (the engine's room for
    long videos). With ``scaling_factor`` the frequencies and cache are YaRN's (mrope + yarn), the
    ramp over the original ``max_position_embeddings``, ``ceil(4 * max * factor)`` rows."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any,
        mrope_section: list[int] | None = None,
        mrope_interleaved: bool = False,
        *,
        scaling_factor: float | None = None,
        extrapolation_factor: float = 1.0,
        attn_factor: float = 1.0,
        beta_fast: float = 32,
        beta_slow: float = 1,
        truncate: bool = True,
        enforce_enable: bool = False,
    ) -> None:
        who = _who(type(self))
        max_position = check_positive_int(who, "max_position_embeddings", max_position_embeddings)
        if mrope_section is not None:
            section = list(mrope_section)
            if (len(section) != 3 or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0
                                         for s in section) or sum(section) != int(rotary_dim) // 2):
                raise ValueError(
                    f"{who}: mrope_section must be 3 non-negative ints [t, h, w] summing to rotary_dim // 2 = "
                    f"{int(rotary_dim) // 2}, got {mrope_section!r}"
                )
            mrope_section = [int(s) for s in section]
        self.mrope_section = mrope_section
        self.mrope_interleaved = bool(mrope_interleaved)
        self.scaling_factor = (None if scaling_factor is None
                               else check_positive_float(who, "scaling_factor", scaling_factor))
        self.extrapolation_factor = check_finite_float(who, "extrapolation_factor", extrapolation_factor)
        self.attn_factor = check_finite_float(who, "attn_factor", attn_factor)
        self.beta_fast = check_finite_float(who, "beta_fast", beta_fast)
        self.beta_slow = check_finite_float(who, "beta_slow", beta_slow)
        self.truncate = bool(truncate)
        self.mscale = 1.0 if self.scaling_factor is None else float(yarn_get_mscale(self.scaling_factor) * attn_factor)
        self.original_max_position = max_position
        self.cache_max_position_num = 4 * max_position
        super().__init__(head_size, rotary_dim, self.cache_max_position_num, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)
        self._section_of = self._channel_sections()

    def _compute_inv_freq(self, base: float) -> np.ndarray:
        if self.scaling_factor is None:
            return super()._compute_inv_freq(base)
        # the correction range spans the ORIGINAL context (as Hugging Face's yarn; the engine passes
        # its 4x cache length here, which moves the ramp)
        return yarn_inv_freq(self.rotary_dim, base, self.scaling_factor, self.original_max_position,
                             self.beta_fast, self.beta_slow, self.extrapolation_factor, self.truncate)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        if self.scaling_factor is None:
            return super()._compute_cos_sin_cache()
        rows = _scaled_rows(self.max_position_embeddings, self.scaling_factor)
        return _angles(self._compute_inv_freq(self.base), np.arange(rows, dtype=np.float32), self.mscale)

    def _channel_sections(self) -> np.ndarray | None:
        """Which positions row (0 t, 1 h, 2 w) each frequency reads, ``[rotary_dim // 2]`` int32."""
        if self.mrope_section is None:
            return None
        t, h, w = self.mrope_section
        channel = np.arange(self.rotary_dim // 2)
        if self.mrope_interleaved:
            section = np.zeros_like(channel)
            section[(channel % 3 == 1) & (channel < 3 * h)] = 1
            section[(channel % 3 == 2) & (channel < 3 * w)] = 2
        else:
            section = np.repeat(np.arange(3), (t, h, w))
        return section.astype(np.int32)

    def check_inputs(self, positions: Any, query: Any, key: Any = None, *, query_out: Any = None,
                     key_out: Any = None) -> None:
        op = type(self).name
        check_array(op, "positions", positions, min_ndim=0, dtypes=INT_DTYPES)
        if positions.ndim == 1:
            return super().check_inputs(positions, query, key, query_out=query_out, key_out=key_out)
        if positions.ndim != 2 or positions.shape[0] != 3:
            raise ValueError(
                f"{op}: argument 'positions' has shape {tuple(positions.shape)}; expected [T] or [3, T] "
                f"(temporal, height, width rows) for {type(self).__name__}"
            )
        if self.mrope_section is None:
            raise ValueError(
                f"{op}: argument 'positions' is [3, T] but this {type(self).__name__} has no mrope_section")
        values = concrete_values(positions)
        if values is not None and values.size:
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi >= self.cache_positions:
                raise ValueError(
                    f"{op}: argument 'positions' holds values in [{lo}, {hi}]; expected 0 <= position < "
                    f"{self.cache_positions} (4 * max_position_embeddings for {type(self).__name__})"
                )
        super().check_inputs(positions[0], query, key, query_out=query_out, key_out=key_out)

    def cos_sin(self, positions: Any, dtype: Any) -> tuple[Any, Any]:
        if positions.ndim != 2:
            return super().cos_sin(positions, dtype)
        xp = array_namespace(positions)
        cache = self.cache_for(positions, dtype)
        rows = xp.take(cache, xp.clip(positions, 0, self.cache_positions - 1), axis=0)  # [3, T, rotary_dim]
        half = self.rotary_dim // 2
        # a row is cos then sin: sin's frequency c reads the same section as cos's
        section = xp.asarray(np.concatenate([self._section_of, self._section_of]), positions)
        picked = xp.where(section == 1, rows[1], rows[0])
        picked = xp.where(section == 2, rows[2], picked)
        return picked[:, :half], picked[:, half:]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mrope_section={self.mrope_section}, mrope_interleaved={self.mrope_interleaved}"


# --- get_rope ------------------------------------------------------------------------------------

# rope_type values get_rope accepts (``mrope_section`` in the parameters selects MRotaryEmbedding for
# "default" and "yarn"; a ``dual_chunk_attention_config`` selects DualChunkRotaryEmbedding).
ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "deepseek_yarn", "deepseek_llama_scaling",
              "llama3", "longrope")

_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}
_ROPE_CACHE_LOCK = threading.Lock()


def _hashable(value: Any, where: str) -> Any:
    """``value`` as a cache key: lists, tuples and numpy arrays made tuples, dicts made item tuples
    sorted by key, numpy scalars made Python numbers, recursively. Anything else unhashable (a set,
    a bytearray, ...) is a TypeError naming ``where`` (the argument and the key path)."""
    if isinstance(value, Mapping):
        items = [(k, _hashable(v, f"{where}[{k!r}]")) for k, v in value.items()]
        return ("dict", tuple(sorted(items, key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))))
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v, f"{where}[{i}]") for i, v in enumerate(value))
    if isinstance(value, np.generic):
        return value.item()
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"get_rope: {where} is a {type(value).__name__}, which cannot key the shared cache of "
                        f"rotary embeddings; expected numbers, strings, bools, None, or lists / dicts of them") from None
    return value


def _required(params: dict, key: str, rope_type: str) -> Any:
    if key not in params:
        raise ValueError(f"get_rope: rope_type {rope_type!r} needs rope_parameters[{key!r}], which is missing")
    return params[key]


def _picked(params: dict, names: tuple[str, ...]) -> dict:
    return {k: params[k] for k in names if k in params}


def get_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool = True,
    rope_parameters: dict[str, Any] | None = None,
    dtype: Any = None,
    dual_chunk_attention_config: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """The rotary embedding a model's Hugging Face ``rope_parameters`` describe (``rope_type``,
    ``rope_theta`` (default 10000), ``partial_rotary_factor`` in (0, 1] (rotary_dim =
    int(head_size * factor)), and the type's own keys), built once per distinct arguments and
    shared afterwards, as the reference engine's ``get_rope``.

    Types: ``default`` (``RotaryEmbedding``, or ``MRotaryEmbedding`` given ``mrope_section``),
    ``linear``, ``dynamic`` (``factor`` or ``alpha``), ``ntk`` (``factor``, ``mixed_b``), ``yarn``
    (``factor``, ``original_max_position_embeddings``; with ``mrope_section``: mrope + YaRN),
    ``deepseek_yarn``, ``llama3``, ``longrope``. ``dual_chunk_attention_config`` (``chunk_size``,
    ``local_size``) builds ``DualChunkRotaryEmbedding``.
    """
    for name, value in (("rope_parameters", rope_parameters), ("dual_chunk_attention_config",
                                                               dual_chunk_attention_config)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"get_rope: {name} must be a dict or None, got {type(value).__name__}")
    head_size = check_positive_int("get_rope", "head_size", head_size)
    max_position = check_positive_int("get_rope", "max_position", max_position)
    params = dict(rope_parameters or {})
    label = dtype_label(dtype, "get_rope")
    key = (
        head_size, max_position, bool(is_neox_style), _hashable(params, "rope_parameters"), label,
        None if dual_chunk_attention_config is None else _hashable(
            {k: v for k, v in dual_chunk_attention_config.items() if k != "sparse_attention_config"},
            "dual_chunk_attention_config"),
    )
    with _ROPE_CACHE_LOCK:
        rope = _ROPE_CACHE.get(key)
        if rope is None:
            rope = _build_rope(head_size, max_position, bool(is_neox_style), params, label, dual_chunk_attention_config)
            _ROPE_CACHE[key] = rope
    return rope


def _build_rope(head_size, max_position, is_neox_style, params, dtype, dual_chunk_attention_config) -> RotaryEmbedding:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"get_rope: unknown rope_type {rope_type!r}; expected one of {', '.join(ROPE_TYPES)}")
    base = params.get("rope_theta", 10000)
    partial = params.get("partial_rotary_factor", 1.0)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0.0 < partial <= 1.0:
        raise ValueError(f"get_rope: partial_rotary_factor must be in (0, 1], got {partial!r}")
    head_size = check_positive_int("get_rope", "head_size", head_size)
    rotary_dim = int(head_size * partial)
    common = (head_size, rotary_dim, max_position, base, is_neox_style)

    if dual_chunk_attention_config is not None:
        for name in ("chunk_size", "local_size"):
            if name not in dual_chunk_attention_config:
                raise ValueError(f"get_rope: dual_chunk_attention_config needs {name!r}, which is missing")
        extra = _picked(dual_chunk_attention_config, ("chunk_size", "local_size"))
        return DualChunkRotaryEmbedding(*common, dtype, **extra)

    if rope_type == "default":
        if "mrope_section" in params:
            return MRotaryEmbedding(*common, dtype, mrope_section=params["mrope_section"],
                                    mrope_interleaved=params.get("mrope_interleaved", False))
        return RotaryEmbedding(*common, dtype)
    if rope_type == "linear":
        return LinearScalingRotaryEmbedding(*common, _required(params, "factor", rope_type), dtype)
    if rope_type == "ntk":
        return NTKScalingRotaryEmbedding(*common, _required(params, "factor", rope_type), dtype, params.get("mixed_b"))
    if rope_type == "dynamic":
        if "alpha" in params:
            return DynamicNTKAlphaRotaryEmbedding(*common, params["alpha"], dtype)
        if "factor" in params:
            return DynamicNTKScalingRotaryEmbedding(*common, params["factor"], dtype)
        raise ValueError("get_rope: rope_type 'dynamic' needs rope_parameters['factor'] or ['alpha'], neither given")
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            *common, dtype, _required(params, "factor", rope_type), _required(params, "low_freq_factor", rope_type),
            _required(params, "high_freq_factor", rope_type),
            _required(params, "original_max_position_embeddings", rope_type),
        )
    if rope_type == "longrope":
        extra = _picked(params, ("short_mscale", "long_mscale"))
        if "attention_factor" in params:  # Hugging Face's one factor for both blocks
            extra = {"short_mscale": params["attention_factor"], "long_mscale": params["attention_factor"], **extra}
        return Phi3LongRoPEScaledRotaryEmbedding(
            head_size, rotary_dim, max_position, _required(params, "original_max_position_embeddings", rope_type),
            base, is_neox_style, dtype, _required(params, "short_factor", rope_type),
            _required(params, "long_factor", rope_type), **extra,
        )

    # yarn and deepseek_yarn: the cache is built over the ORIGINAL context, scaled by factor
    factor = _required(params, "factor", rope_type)
    original = _required(params, "original_max_position_embeddings", rope_type)
    scaled = (head_size, rotary_dim, original, base, is_neox_style)
    if rope_type == "yarn":
        extra = _picked(params, ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "truncate"))
        if "mrope_section" in params:
            return MRotaryEmbedding(*scaled, dtype, mrope_section=params["mrope_section"],
                                    mrope_interleaved=params.get("mrope_interleaved", False), scaling_factor=factor,
                                    **extra)
        extra.update(_picked(params, ("apply_yarn_scaling", "mscale", "mscale_all_dim")))
        if params.get("attention_factor") is not None:  # Hugging Face's override of the whole factor
            extra.update(attn_factor=params["attention_factor"], apply_yarn_scaling=False, mscale=None)
        for beta in ("beta_fast", "beta_slow"):  # Hugging Face's None means the default
            if extra.get(beta) is None:
                extra.pop(beta, None)
        return YaRNScalingRotaryEmbedding(*scaled, factor, dtype, **extra)
    extra = _picked(params, ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale",
                             "mscale_all_dim"))
    return DeepseekScalingRotaryEmbedding(*scaled, factor, dtype, **extra)


# --- check cases ---------------------------------------------------------------------------------

# The scaled variants share the base class's kernels, so a few cases suffice: one whose cache is
# scaled with an attention factor (yarn, neox), one with partial rotation in GPT-J style (llama3),
# and mrope with [3, T] positions. Query shapes as ``[T, H*64]`` or ``[T, H, 64]``; key has 1 head.
_CHECK_HEAD = 64
_CHECK_SHAPES = ((0, 128), (1, 192), (9, 320), (5, 2, 64))


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family's variants with."""
    from dualop.testing import OpCase, Pinned, normal

    def inputs(op_of, mrope: bool = False):
        def make(shape, rng):
            tokens = int(np.prod(shape[:-1])) if len(shape) == 2 else int(shape[0])
            limit = op_of(shape).cache_positions
            rows = (3, tokens) if mrope else (tokens,)
            positions = Pinned(rng.integers(0, limit, size=rows).astype(np.int32), "int32")
            query = normal(shape, rng)
            key = normal((tokens, _CHECK_HEAD), rng)
            return positions, query, key

        return make

    def yarn(shape):
        return YaRNScalingRotaryEmbedding(_CHECK_HEAD, _CHECK_HEAD, 64, 10000.0, True, 4.0)

    def llama3(shape):
        return Llama3RotaryEmbedding(_CHECK_HEAD, 32, 512, 500000.0, False, None, 8.0, 1.0, 4.0, 64)

    def mrope(shape):
        return MRotaryEmbedding(_CHECK_HEAD, _CHECK_HEAD, 64, 1000000.0, True, None, mrope_section=[8, 12, 12])

    return [
        OpCase("rotary_embedding", "rotary_embedding[yarn]", yarn, inputs(yarn), _CHECK_SHAPES),
        OpCase("rotary_embedding", "rotary_embedding[llama3,gptj,partial]", llama3, inputs(llama3), _CHECK_SHAPES),
        OpCase("rotary_embedding", "rotary_embedding[mrope]", mrope, inputs(mrope, mrope=True), _CHECK_SHAPES),
    ]
