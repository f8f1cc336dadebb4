"""Rotary position embeddings (the reference engine's Rope family).

``RotaryEmbedding`` owns a ``cos_sin_cache`` ``[max_position, rotary_dim]`` (cos half, sin half),
built once in float32 with numpy; each call gathers the rows of its ``positions``, casts them to
the query's dtype (as the engine does) and rotates the first ``rotary_dim`` channels of every
head (``kernels/rope_math.rotate``). Scaled variants (``get_rope``) override only
``_compute_inv_freq`` / ``_compute_cos_sin_cache`` (and ``mscale``); variants that pick angles
differently (multimodal, dual chunk) override ``cos_sin``. All share the same rotation kernels.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.kernels.rope_math import rotate
from dualop.ops._checks import check_array, concrete_values, dtype_name
from dualop.platforms import family_of, frontend_of

__all__ = ["RotaryEmbedding"]

INT_DTYPES = frozenset({"int32", "int64"})


def check_positive_int(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    return int(value)


def check_positive_float(op: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not value > 0:
        raise ValueError(f"{op}: {name} must be a positive number, got {value!r}")
    return float(value)


def dtype_label(dtype: Any) -> str | None:
    """``torch.bfloat16``, ``jnp.bfloat16``, ``"bfloat16"`` -> ``"bfloat16"`` (None stays None)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    text = str(dtype)
    return text.removeprefix("torch.") if text.startswith("torch.") else np.dtype(dtype).name


def _is_fake(x: Any) -> bool:
    """Whether a torch tensor is a fake tensor (a fake kernel's input under torch.compile); Dynamo
    tracing user code sees its inputs as ordinary tensors, where a kept real cache is a fine constant."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Rotary embedding of queries and keys by token position.

    ``op(positions, query, key=None)`` -> ``(query, key)``: ``positions`` holds T integer positions
    (any shape, flattened); ``query``/``key`` are ``[..., H*D]`` or ``[..., H, D]`` with T tokens in
    the leading dims (key may have fewer heads). Only the first ``rotary_dim`` channels of each head
    rotate: halves (``is_neox_style``) or interleaved pairs (GPT-J). Returns new arrays of the
    inputs' shapes and dtypes (key None in, None out). Positions must lie in
    ``[0, max_position_embeddings)``: checked before launch when their values are visible
    (eager torch, concrete jax), clamped into range otherwise (under ``jit``).
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool = True,
        dtype: Any = None,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = type(self).name
        self.head_size = check_positive_int(op, "head_size", head_size)
        self.rotary_dim = check_positive_int(op, "rotary_dim", rotary_dim)
        if self.rotary_dim % 2 or self.rotary_dim > self.head_size:
            raise ValueError(f"{op}: rotary_dim must be even and at most head_size={head_size}, got {rotary_dim}")
        self.max_position_embeddings = check_positive_int(op, "max_position_embeddings", max_position_embeddings)
        self.base = check_positive_float(op, "base", base)
        self.is_neox_style = bool(is_neox_style)
        self.dtype = dtype_label(dtype)
        self._frontend_caches: dict[tuple, Any] = {}
        self._cache_lock = threading.Lock()
        self.cos_sin_cache = np.asarray(self._compute_cos_sin_cache(), dtype=np.float32)

    # --- the cache (scaled variants override these) -------------------------------------------

    def _compute_inv_freq(self, base: float) -> np.ndarray:
        """``1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)`` in float32."""
        exponents = np.arange(0, self.rotary_dim, 2, dtype=np.float32) / np.float32(self.rotary_dim)
        return (np.float32(1.0) / np.power(np.float32(base), exponents)).astype(np.float32)

    def _compute_cos_sin_cache(self) -> np.ndarray:
        """``[max_position, rotary_dim]``: cos of every (position, frequency) angle, then sin."""
        inv_freq = self._compute_inv_freq(self.base)
        t = np.arange(self.max_position_embeddings, dtype=np.float32)
        freqs = np.outer(t, inv_freq).astype(np.float32)
        return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)

    @property
    def cache_positions(self) -> int:
        """Rows of ``cos_sin_cache`` (positions it covers)."""
        return int(self.cos_sin_cache.shape[0])

    def cache_for(self, like: Any, dtype: Any) -> Any:
        """``cos_sin_cache`` as an array of ``like``'s frontend and device, in ``dtype``; made once
        per (frontend, device, dtype) and kept."""
        fe = frontend_of(like)
        if fe == "torch" and _is_fake(like):  # torch.compile / fake kernels: a constant of the trace, never kept
            xp = array_namespace(like)
            return xp.astype(xp.asarray(self.cos_sin_cache, like, xp.float32), dtype)
        key = (fe, str(getattr(like, "device", "")), str(dtype))
        cache = self._frontend_caches.get(key)
        if cache is None:
            with self._cache_lock:
                cache = self._frontend_caches.get(key)
                if cache is None:
                    xp = array_namespace(like)
                    if family_of(fe) == "jax":
                        import jax

                        with jax.ensure_compile_time_eval():
                            cache = xp.astype(xp.asarray(self.cos_sin_cache, like, xp.float32), dtype)
                    else:
                        cache = xp.astype(xp.asarray(self.cos_sin_cache, like, xp.float32), dtype)
                    self._frontend_caches[key] = cache
        return cache

    def cos_sin(self, positions: Any, dtype: Any) -> tuple[Any, Any]:
        """``(cos, sin)``, each ``[T, rotary_dim // 2]`` in ``dtype``, for the flattened positions
        (clamped into the cache: values were checked before launch where visible)."""
        xp = array_namespace(positions)
        cache = self.cache_for(positions, dtype)
        flat = xp.clip(positions.reshape(-1), 0, self.cache_positions - 1)
        rows = xp.take(cache, flat, axis=0)
        half = self.rotary_dim // 2
        return rows[:, :half], rows[:, half:]

    # --- checks and the native body -----------------------------------------------------------

    def check_inputs(self, positions: Any, query: Any, key: Any = None) -> None:
        op = type(self).name
        fe = check_array(op, "positions", positions, min_ndim=0, dtypes=INT_DTYPES)
        tokens = int(np.prod(positions.shape))
        for arg, x in (("query", query), ("key", key)):
            if x is None:
                if arg == "query":
                    raise TypeError(f"{op}: argument 'query' is required")
                continue
            xfe = check_array(op, arg, x)
            if family_of(xfe) != family_of(fe):
                raise TypeError(f"{op}: argument '{arg}' is a {family_of(xfe)} array but 'positions' is a {family_of(fe)} array")
            self.heads_of(arg, x, tokens)
        if key is not None and dtype_name(key) != dtype_name(query):
            raise TypeError(f"{op}: argument 'key' has dtype {dtype_name(key)}; expected {dtype_name(query)} (query's)")
        values = concrete_values(positions)
        if values is not None and values.size:
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi >= self.cache_positions:
                raise ValueError(
                    f"{op}: argument 'positions' holds values in [{lo}, {hi}]; expected 0 <= position < "
                    f"{self.cache_positions} (max_position_embeddings)"
                )

    def heads_of(self, arg: str, x: Any, tokens: int) -> int:
        """Heads in ``x`` (``[..., H*D]`` or ``[..., H, D]`` holding ``tokens`` tokens), or a ValueError."""
        op = type(self).name
        d = self.head_size
        size = int(np.prod(x.shape))
        if tokens == 0:
            if size != 0:
                raise ValueError(f"{op}: argument '{arg}' has shape {tuple(x.shape)} but positions is empty")
            return 0
        if size % (tokens * d):
            raise ValueError(
                f"{op}: argument '{arg}' has shape {tuple(x.shape)}; expected {tokens} tokens (positions) of "
                f"H heads of head_size {d} ([..., H*{d}] or [..., H, {d}])"
            )
        last = x.shape[-1]
        if last != d and last % d:
            raise ValueError(f"{op}: argument '{arg}' has last dim {last}; expected head_size={d} or a multiple of it")
        return size // (tokens * d)

    def forward_native(self, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        xp = array_namespace(query)
        cos, sin = self.cos_sin(positions, query.dtype)
        return self.rotate_all(xp, cos, sin, query, key)

    def rotate_all(self, xp: Any, cos: Any, sin: Any, query: Any, key: Any) -> tuple[Any, Any]:
        """Rotate query (and key) by per-token ``cos``/``sin``; outputs keep the inputs' shapes."""
        tokens = cos.shape[0]
        out = []
        for x in (query, key):
            if x is None:
                out.append(None)
                continue
            heads = x.reshape(tokens, -1, self.head_size) if tokens else x.reshape(0, 1, self.head_size)
            out.append(rotate(xp, heads, cos, sin, self.rotary_dim, self.is_neox_style).reshape(x.shape))
        return out[0], out[1]

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )
