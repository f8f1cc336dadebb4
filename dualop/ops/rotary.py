"""Rotary position embeddings (the reference engine's Rope family).

``RotaryEmbedding`` owns a ``cos_sin_cache`` ``[max_position, rotary_dim]`` (cos half, sin half),
built once in float32 with numpy; each call gathers the rows of its ``positions``, casts them to
the query's dtype (as the engine does) and rotates the first ``rotary_dim`` channels of every
head (``kernels/rope_math.rotate``). Scaled variants (``get_rope``) override only
``_compute_inv_freq`` / ``_compute_cos_sin_cache`` (and ``mscale``); variants that pick angles
differently (multimodal, dual chunk) override ``cos_sin``. All share the same rotation kernels.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, validates_inputs
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.kernels.rope_math import rotate
from dualop.ops._checks import (
    check_array, check_positive_int, checked_before, concrete_values, decline_if_recording, dtype_name,
    remember_checked,
)
from dualop.ops._outputs import check_output, write_outputs
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving, float32_normal as _normal

__all__ = ["RotaryEmbedding", "ApplyRotaryEmb", "DualChunkRotaryEmbedding"]

INT_DTYPES = frozenset({"int32", "int64"})

# One rotation kernel per backend, shared by every rope op: query [T, Hq, D] and key [T, Hk, D] (or
# None) by per-token cos/sin [Tc, rotary_dim / 2] (token t takes row t % Tc), in one launch.
_PALLAS_ROTARY = KernelRef("dualop.kernels.pallas.rotary", "rotary")
_PALLAS_ROTARY_QUERY = KernelRef("dualop.kernels.pallas.rotary", "rotary_query")
_TRITON_ROTARY = KernelRef("dualop.kernels.cuda.rotary", "rotary")
_CPU_ROTARY = KernelRef("dualop.kernels.cpu.rotary", "rotary")
_CPU_ROTARY_BY_POSITION = KernelRef("dualop.kernels.cpu.rotary", "rotary_by_position")
_CPU_FAST_ROTARY = KernelRef("dualop.kernels.cpu.rotary", "FAST_ROTARY_BY_POSITION")
KERNEL_METHODS = ("forward_tpu", "forward_cuda", "forward_cpu")


def rotate_pair(query: Any, key: Any, cos: Any, sin: Any, *, rotary_dim: int, is_neox_style: bool) -> tuple[Any, Any]:
    """The kernels' contract in the native formula (``rope_math.rotate``): query/key ``[T, H, D]``,
    cos/sin ``[Tc, rotary_dim // 2]`` repeated over T // Tc blocks of tokens. The Pallas path's
    backward pass differentiates this."""
    xp = array_namespace(query)
    reps = query.shape[0] // cos.shape[0] if cos.shape[0] else 1
    if reps > 1:
        cos, sin = xp.concat([cos] * reps, axis=0), xp.concat([sin] * reps, axis=0)
    out = [None if x is None else rotate(xp, x, cos, sin, rotary_dim, is_neox_style) for x in (query, key)]
    return out[0], out[1]


def rotate_heads(method: str, query: Any, key: Any, cos: Any, sin: Any, rotary_dim: int,
                 is_neox_style: bool) -> tuple[Any, Any]:
    """Run ``method``'s rotation kernel (``forward_tpu``: Pallas, ``forward_cuda``: Triton,
    ``forward_cpu``: C++) on query/key ``[T, H, D]``; anything a kernel cannot take raises
    NotImplementedError, which the dispatcher reports as a fallback to forward_native."""
    fe = frontend_of(query)
    static = dict(rotary_dim=rotary_dim, is_neox_style=is_neox_style)
    if method == "forward_tpu":
        if key is None:  # one output: no None for the bridges to carry
            native = lambda q, c, s: rotate_pair(q, None, c, s, **static)[0]  # noqa: E731
            return call_jax_function(fe, _PALLAS_ROTARY_QUERY, query, cos, sin, native=native, **static), None
        native = functools.partial(rotate_pair, **static)
        return call_jax_function(fe, _PALLAS_ROTARY, query, key, cos, sin, native=native, **static)
    if method == "forward_cuda":
        return call_triton(fe, _TRITON_ROTARY, query, key, cos, sin, **static)
    if method == "forward_cpu":
        decline_if_recording("rotary", query, key, cos, sin)
        return _CPU_ROTARY(query, key, cos, sin, **static)
    raise AssertionError(method)


def check_positive_float(op: str, name: str, value: Any) -> float:
    """A finite number > 0 (ints and numpy floats too, bools not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not value > 0:
        raise ValueError(f"{op}: {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be a positive number, got {value!r}; expected a finite value")
    return float(value)


def dtype_label(dtype: Any, op: str = "dualop") -> str | None:
    """``torch.bfloat16``, ``jnp.bfloat16``, ``"bfloat16"`` -> ``"bfloat16"`` (None stays None)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except (TypeError, ValueError):
        raise TypeError(f"{op}: dtype must be None, a dtype name or a torch / jax / numpy dtype, got {dtype!r}") from None


def _dynamo_tracing() -> bool:
    """Whether torch.compile's Dynamo is tracing this call."""
    from dualop.backends.torch.library import is_compiling

    return bool(is_compiling())


def _is_fake(x: Any) -> bool:
    """Whether ``x`` is a torch fake tensor (a fake kernel's input under torch.compile, opcheck);
    Dynamo tracing user code sees its inputs as ordinary tensors, where a kept real cache is a fine
    constant."""
    if not type(x).__module__.startswith("torch"):
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _is_jax_tracer(x: Any) -> bool:
    """Whether ``x`` is a jax tracer (inside ``jit``, ``shard_map``, ``vmap``, ...)."""
    if not type(x).__module__.startswith("jax"):
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """Rotary embedding of queries and keys by token position.

    ``op(positions, query, key=None)`` -> ``(query, key)``: ``positions`` holds T integer positions
    (any shape, flattened); ``query``/``key`` are ``[..., H*D]`` or ``[..., H, D]`` with T tokens in
    the leading dims (key may have fewer heads). Only the first ``rotary_dim`` channels of each head
    rotate: halves (``is_neox_style``) or interleaved pairs (GPT-J). Returns new arrays of the
    inputs' shapes and dtypes (key None in, None out). Positions must lie in
    ``[0, max_position_embeddings)``: checked before launch when their values are visible
    (eager torch, concrete jax), clamped into range otherwise (under ``jit``). torch tensors given
    as ``query_out`` / ``key_out`` receive the results instead (``ops/_outputs.py``);
    ``query_out=query, key_out=key`` is the engine's in-place rope.
    """

    output_args: ClassVar[tuple[str, ...]] = ("query_out", "key_out")
    output_present: ClassVar[tuple[str | None, ...]] = (None, "key")

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
        self.dtype = dtype_label(dtype, op)
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
        per (frontend, device, dtype) and kept (per trace for tracers and fake tensors)."""
        fe = frontend_of(like)
        if _is_fake(like) or _is_jax_tracer(like):
            # a trace's fake tensors (torch.compile, opcheck) or tracers (jit, shard_map): a cache made
            # for them is valid only in that trace (under shard_map its arrays carry the trace's mesh),
            # and a kept one not: a constant of this trace instead
            return self._trace_constant(like, dtype)
        key = (fe, str(getattr(like, "device", "")), str(dtype))
        cache = self._frontend_caches.get(key)
        if cache is None:
            if fe == "torch" and _dynamo_tracing():
                # Dynamo tracing the native body (custom_ops 'none') cannot trace the lock that guards
                # making a kept cache: a constant of this trace (a kept one, found above, is one too)
                return self._trace_constant(like, dtype)
            with self._cache_lock:
                cache = self._frontend_caches.get(key)
                if cache is None:
                    cache = self._trace_constant(like, dtype)  # made once, then kept
                    self._frontend_caches[key] = cache
        return cache

    def _trace_constant(self, like: Any, dtype: Any) -> Any:
        """``cos_sin_cache`` as a new array of ``like``'s frontend and device, in ``dtype``."""
        xp = array_namespace(like)
        return xp.astype(xp.asarray(self.cos_sin_cache, like, xp.float32), dtype)

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

    def check_inputs(self, positions: Any, query: Any, key: Any = None, *, query_out: Any = None,
                     key_out: Any = None) -> None:
        op = type(self).name
        fe = check_array(op, "positions", positions, min_ndim=0, dtypes=INT_DTYPES)
        tokens = math.prod(positions.shape)
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
        if query_out is not None or key_out is not None:  # written forms (ops/_outputs.py)
            inputs = {"positions": positions, "query": query, "key": key}
            if query_out is not None:
                check_output(op, "query_out", query_out, query.shape, query.dtype, query.device, inputs,
                             (("key_out", key_out),))
            if key_out is not None:
                if key is None:
                    raise ValueError(f"{op}: argument 'key_out' given without a key; expected None")
                check_output(op, "key_out", key_out, key.shape, key.dtype, key.device, inputs)
        if checked_before("positions", (positions,), (self.cache_positions,)):
            return  # the same positions, checked by the previous layer's rotary embedding
        values = concrete_values(positions)
        if values is not None and values.size:
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi >= self.cache_positions:
                raise ValueError(
                    f"{op}: argument 'positions' holds values in [{lo}, {hi}]; expected 0 <= position < "
                    f"{self.cache_positions} (max_position_embeddings)"
                )
            remember_checked("positions", (positions,), (self.cache_positions,))

    def heads_of(self, arg: str, x: Any, tokens: int) -> int:
        """Heads in ``x`` (``[..., H*D]`` or ``[..., H, D]`` holding ``tokens`` tokens), or a ValueError."""
        op = type(self).name
        d = self.head_size
        size = math.prod(x.shape)
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

    def forward_native(self, positions: Any, query: Any, key: Any = None, *, query_out: Any = None,
                       key_out: Any = None) -> tuple[Any, Any | None]:
        xp = array_namespace(query)
        cos, sin = self.cos_sin(positions, query.dtype)
        return write_outputs(self.rotate_all(xp, cos, sin, query, key), (query_out, key_out))

    def rotate_all(self, xp: Any, cos: Any, sin: Any, query: Any, key: Any, method: str | None = None) -> tuple[Any, Any]:
        """Rotate query (and key) by per-token ``cos``/``sin``: the native formula, or ``method``'s
        kernel (one launch for both); outputs keep the inputs' shapes."""
        tokens = cos.shape[0]
        heads = [
            None if x is None else (x.reshape(tokens, -1, self.head_size) if tokens else x.reshape(0, 1, self.head_size))
            for x in (query, key)
        ]
        if method is None:
            out = [None if h is None else rotate(xp, h, cos, sin, self.rotary_dim, self.is_neox_style) for h in heads]
        else:
            out = rotate_heads(method, heads[0], heads[1], cos, sin, self.rotary_dim, self.is_neox_style)
        return tuple(None if o is None else o.reshape(x.shape) for o, x in zip(out, (query, key)))

    def forward_kernel(self, method: str, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        """The per-token cos/sin of ``cos_sin`` (which subclasses override) through ``method``'s kernel."""
        cos, sin = self.cos_sin(positions, query.dtype)
        return self.rotate_all(array_namespace(query), cos, sin, query, key, method)

    def forward_tpu(self, positions: Any, query: Any, key: Any = None, *, query_out: Any = None,
                    key_out: Any = None) -> tuple[Any, Any]:
        return write_outputs(self.forward_kernel("forward_tpu", positions, query, key), (query_out, key_out))

    def forward_cuda(self, positions: Any, query: Any, key: Any = None, *, query_out: Any = None,
                     key_out: Any = None) -> tuple[Any, Any]:
        return write_outputs(self.forward_kernel("forward_cuda", positions, query, key), (query_out, key_out))

    @validates_inputs
    def forward_cpu(self, positions: Any, query: Any, key: Any = None, *, query_out: Any = None,
                    key_out: Any = None) -> tuple[Any, Any]:
        """torch on the CPU: the C++ kernel (``kernels/cpu/csrc/rotary.cc``, query and key in one
        OpenMP pass, straight into given outputs); a rope whose angles are rows of its cache picked
        by position (``cos_sin`` not overridden) gathers them inside the kernel. It declines while
        autograd records (no backward). A call of plain row-major tensors goes straight to the
        kernel's torch operator, which checks it (positions included) in C++; any other call is
        checked here first."""
        by_position = type(self).cos_sin is RotaryEmbedding.cos_sin
        if by_position:
            fast = self._cpu_fast
            if fast is None:
                fast = self._cpu_fast = self._fast_cpu_call()
            cache = fast[1].get(getattr(query, "dtype", None)) if fast else None
            if cache is None and fast and frontend_of(query) == "torch" and frontend_of(positions) == "torch":
                cache = fast[1][query.dtype] = self.cache_for(positions, query.dtype)
            if cache is not None:
                q, k = fast[0].take(positions, query, key, cache, query_out, key_out, *fast[2]) or (None, None)
                if q is not None:
                    return q, k
        self.check_inputs(positions, query, key, query_out=query_out, key_out=key_out)
        decline_if_recording("rotary", query, key)
        if by_position:
            return _CPU_ROTARY_BY_POSITION(positions, query, key, self.cache_for(positions, query.dtype),
                                           head_size=self.head_size, rotary_dim=self.rotary_dim,
                                           is_neox_style=self.is_neox_style, query_out=query_out, key_out=key_out)
        return write_outputs(self.forward_kernel("forward_cpu", positions, query, key), (query_out, key_out))

    _cpu_fast: tuple | None = None

    def _fast_cpu_call(self) -> tuple:
        """``(operator, caches by dtype, constants)`` of the CPU fast path, or ``()`` where the
        operators cannot be built here."""
        operator = _CPU_FAST_ROTARY.resolve()
        if operator.get() is None:
            return ()
        return operator, {}, (self.head_size, self.rotary_dim, self.cache_positions, self.is_neox_style)


    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )


@CustomOp.register("apply_rotary_emb")
class ApplyRotaryEmb(CustomOp):
    """Rotary embedding by given angles (the vision encoders' rope): ``op(x, cos, sin)``.

    ``x`` is ``[B, S, H, D]`` or ``[S, H, D]``; ``cos``/``sin`` are ``[S, D/2]`` (any float dtype),
    shared by the batch. Every channel of a head rotates (halves with ``is_neox_style``, else
    interleaved pairs). The arithmetic is float32 with one cast to ``x``'s dtype in both modes;
    ``enable_fp32_compute`` decides only the angles' precision: True uses cos/sin in float32, False
    first rounds them to ``x``'s dtype, as the reference engine does. (The engine without
    ``enable_fp32_compute`` also does the products and sums in ``x``'s dtype, rounding each; dualop
    rounds once, so bfloat16 results can differ from it by an ulp, closer to the exact value.)
    """

    def __init__(self, enforce_enable: bool = False, is_neox_style: bool = True,
                 enable_fp32_compute: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.is_neox_style = bool(is_neox_style)
        self.enable_fp32_compute = bool(enable_fp32_compute)

    def check_inputs(self, x: Any, cos: Any, sin: Any) -> None:
        op = type(self).name
        fe = check_array(op, "x", x, min_ndim=3)
        if x.ndim > 4:
            raise ValueError(f"{op}: argument 'x' has shape {tuple(x.shape)}; expected [B, S, H, D] or [S, H, D]")
        seq, head_size = x.shape[-3], x.shape[-1]
        if head_size % 2:
            raise ValueError(f"{op}: argument 'x' has head size {head_size}; expected an even head size")
        for arg, t in (("cos", cos), ("sin", sin)):
            tfe = check_array(op, arg, t, min_ndim=2)
            if family_of(tfe) != family_of(fe):
                raise TypeError(f"{op}: argument '{arg}' is a {family_of(tfe)} array but 'x' is a {family_of(fe)} array")
            if tuple(t.shape) != (seq, head_size // 2):
                raise ValueError(
                    f"{op}: argument '{arg}' has shape {tuple(t.shape)}; expected ({seq}, {head_size // 2}) "
                    f"([S, D/2] for x of shape {tuple(x.shape)})"
                )

    def angles(self, x: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
        """cos/sin in the precision the rotation uses (see the class docstring)."""
        xp = array_namespace(x)
        dtype = xp.float32 if self.enable_fp32_compute else x.dtype
        return xp.astype(cos, dtype), xp.astype(sin, dtype)

    def _rotate(self, method: str | None, x: Any, cos: Any, sin: Any) -> Any:
        cos, sin = self.angles(x, cos, sin)
        heads = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])  # no -1: H may be 0
        static = dict(rotary_dim=x.shape[-1], is_neox_style=self.is_neox_style)
        if method is None:
            out, _ = rotate_pair(heads, None, cos, sin, **static)
        else:
            out, _ = rotate_heads(method, heads, None, cos, sin, **static)
        return out.reshape(x.shape)

    def forward_native(self, x: Any, cos: Any, sin: Any) -> Any:
        return self._rotate(None, x, cos, sin)

    def forward_tpu(self, x: Any, cos: Any, sin: Any) -> Any:
        return self._rotate("forward_tpu", x, cos, sin)

    def forward_cuda(self, x: Any, cos: Any, sin: Any) -> Any:
        return self._rotate("forward_cuda", x, cos, sin)

    def forward_cpu(self, x: Any, cos: Any, sin: Any) -> Any:
        """torch on the CPU: the C++ rotation kernel (declines while autograd records)."""
        return self._rotate("forward_cpu", x, cos, sin)


    def extra_repr(self) -> str:
        return f"is_neox_style={self.is_neox_style}, enable_fp32_compute={self.enable_fp32_compute}"


@CustomOp.register("dual_chunk_rotary_embedding")
class DualChunkRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding for dual chunk attention (long context in chunks of ``chunk_size``).

    ``op(positions, query, key, offsets=None)`` -> ``(query5, key)``. With p = positions (+ offsets)
    and L = chunk_size - local_size, the key rotates by angle position ``p % L``; the query by five
    angle sets, concatenated along its last dim in this order: intra (``p % L``), succ
    (``min(p % L + L, chunk_size)``), inter (the constant ``min(2L - 1, chunk_size)``), succ
    unclamped (``p % L + L``) and inter unclamped (``p % L + chunk_size``). So a ``[T, H*D]`` query
    gives ``[T, 5*H*D]`` and a ``[T, H, D]`` one ``[T, H, 5*D]``, as the reference engine's. The
    angle tables are one float32 cache (key rows for every position, then L rows of each query
    set), cast to the query's dtype like ``RotaryEmbedding``'s. p must lie in
    ``[0, max_position_embeddings)`` (checked where visible, clamped under ``jit``).
    """

    output_args: ClassVar[tuple[str, ...]] = ()  # five query angle sets: no written form

    # query angle sets after the key rows, in output order; "inter" is one row of the succ set
    QUERY_SETS = ("intra", "succ", "inter", "succ_unclamped", "inter_unclamped")

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any,
        chunk_size: int,
        local_size: int,
        *,
        enforce_enable: bool = False,
    ) -> None:
        op = type(self).name
        self.chunk_size = check_positive_int(op, "chunk_size", chunk_size)
        if isinstance(local_size, bool) or not isinstance(local_size, (int, np.integer)) or not 0 <= local_size < chunk_size:
            raise ValueError(f"{op}: local_size must be an int in [0, chunk_size={chunk_size}), got {local_size!r}")
        self.local_size = int(local_size)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype,
                         enforce_enable=enforce_enable)

    @property
    def chunk_len(self) -> int:
        return self.chunk_size - self.local_size

    def _compute_cos_sin_cache(self) -> np.ndarray:
        """Key rows ``[max_position]`` (angle position p % L), then L rows each of intra, succ,
        succ unclamped and inter unclamped query angles."""
        inv_freq = self._compute_inv_freq(self.base)
        n = self.chunk_len
        local = np.arange(n, dtype=np.float32)
        angle_positions = (
            np.arange(self.max_position_embeddings, dtype=np.float32) % np.float32(n),  # key
            local,  # intra
            np.minimum(local + n, np.float32(self.chunk_size)),  # succ
            local + n,  # succ unclamped
            local + np.float32(self.chunk_size),  # inter unclamped
        )
        freqs = np.outer(np.concatenate(angle_positions), inv_freq).astype(np.float32)
        return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)

    @property
    def cache_positions(self) -> int:
        return self.max_position_embeddings

    def check_inputs(self, positions: Any, query: Any, key: Any = None, offsets: Any = None) -> None:
        op = type(self).name
        if key is None:
            raise TypeError(f"{op}: argument 'key' is required")
        if offsets is not None:
            ofe = check_array(op, "offsets", offsets, min_ndim=0, dtypes=INT_DTYPES)
            if family_of(ofe) != family_of(frontend_of(positions)):
                raise TypeError(f"{op}: argument 'offsets' is a {family_of(ofe)} array but 'positions' is not")
            if tuple(offsets.shape) != tuple(positions.shape):
                raise ValueError(f"{op}: argument 'offsets' has shape {tuple(offsets.shape)}; expected positions' {tuple(positions.shape)}")
        super().check_inputs(positions if offsets is None else positions + offsets, query, key)

    def angle_rows(self, positions: Any, offsets: Any = None) -> list[Any]:
        """Cache row indices per token for the key, then each query set (``QUERY_SETS`` order)."""
        xp = array_namespace(positions)
        p = positions.reshape(-1) if offsets is None else positions.reshape(-1) + offsets.reshape(-1)
        p = xp.clip(p, 0, self.max_position_embeddings - 1)
        n, base = self.chunk_len, self.max_position_embeddings
        local = p % n
        return [
            p,
            base + local,
            base + n + local,
            base + n + local * 0 + (n - 1),
            base + 2 * n + local,
            base + 3 * n + local,
        ]

    def _forward(self, method: str | None, positions: Any, query: Any, key: Any, offsets: Any) -> tuple[Any, Any]:
        """Six rotations by six angle sets (the key's, then the query's five): the native formula, or
        ``method``'s kernel once per set."""
        xp = array_namespace(query)
        cache = self.cache_for(positions, query.dtype)
        half = self.rotary_dim // 2
        rotated = []
        for x, rows in zip((key, *(query,) * len(self.QUERY_SETS)), self.angle_rows(positions, offsets)):
            angles = xp.take(cache, rows, axis=0)
            rotated.append(self.rotate_all(xp, angles[:, :half], angles[:, half:], x, None, method)[0])
        return xp.concat(rotated[1:], axis=-1), rotated[0]

    def forward_native(self, positions: Any, query: Any, key: Any, offsets: Any = None) -> tuple[Any, Any]:
        return self._forward(None, positions, query, key, offsets)

    def forward_tpu(self, positions: Any, query: Any, key: Any, offsets: Any = None) -> tuple[Any, Any]:
        return self._forward("forward_tpu", positions, query, key, offsets)

    def forward_cuda(self, positions: Any, query: Any, key: Any, offsets: Any = None) -> tuple[Any, Any]:
        return self._forward("forward_cuda", positions, query, key, offsets)

    def forward_cpu(self, positions: Any, query: Any, key: Any, offsets: Any = None) -> tuple[Any, Any]:
        return self._forward("forward_cpu", positions, query, key, offsets)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}, local_size={self.local_size}"


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this family with (SMALL: every
    cell runs them in interpreters). A shape is the query's (``x``'s for apply_rotary_emb):
    ``[..., H*D]`` or, with last dim D, ``[T, H, D]``."""
    from dualop.testing import OpCase, Pinned, normal

    max_pos = 64

    def token_shape(shape, head_size):
        return tuple(shape[:-2] if shape[-1] == head_size and len(shape) == 3 else shape[:-1])

    def rope_inputs(head_size: int, key_heads: int | None, offsets: bool = False):
        def make(shape, rng):
            tokens = token_shape(shape, head_size)
            positions = Pinned(rng.integers(0, max_pos // 2 if offsets else max_pos, tokens), "int32")
            query = normal(shape, rng, 2.0)
            key = None if key_heads is None else normal((*tokens, key_heads * head_size), rng, 2.0)
            if not offsets:
                return (positions, query, key)
            return (positions, query, key, Pinned(rng.integers(0, max_pos // 2, tokens), "int32"))

        return make

    def vision_inputs(fp32_angles: bool):
        def make(shape, rng):
            seq, half = shape[-3], shape[-1] // 2
            angles = np.outer(np.arange(seq), 1.0 / 10000.0 ** (np.arange(half) / half)).astype(np.float32)
            cos, sin = np.cos(angles), np.sin(angles)
            if fp32_angles:
                cos, sin = Pinned(cos, "float32"), Pinned(sin, "float32")
            return (normal(shape, rng, 2.0), cos, sin)

        return make

    def rope(d, r, neox, cls=RotaryEmbedding, **kw):
        return lambda s: cls(d, r, max_pos, 10000.0, neox, **kw)

    return [
        OpCase("rotary_embedding", "rotary_embedding[neox,d64]", rope(64, 64, True), rope_inputs(64, 1),
               ((0, 128), (1, 192), (9, 256), (5, 2, 64))),
        OpCase("rotary_embedding", "rotary_embedding[gptj,d80,partial]", rope(80, 48, False), rope_inputs(80, 2),
               ((0, 160), (1, 80), (2, 3, 240), (6, 3, 80))),
        OpCase("rotary_embedding", "rotary_embedding[neox,d80,no_key]", rope(80, 80, True), rope_inputs(80, None),
               ((0, 160), (1, 160), (7, 320), (4, 2, 80))),
        OpCase("apply_rotary_emb", "apply_rotary_emb[neox,d80]", lambda s: ApplyRotaryEmb(), vision_inputs(False),
               ((0, 2, 80), (1, 1, 80), (7, 3, 80), (2, 5, 2, 80))),
        OpCase("apply_rotary_emb", "apply_rotary_emb[gptj,d64,fp32]",
               lambda s: ApplyRotaryEmb(is_neox_style=False, enable_fp32_compute=True), vision_inputs(True),
               ((0, 2, 64), (1, 1, 64), (6, 2, 64), (2, 3, 1, 64))),
        OpCase("dual_chunk_rotary_embedding", "dual_chunk_rotary_embedding[neox,d64,partial]",
               rope(64, 32, True, DualChunkRotaryEmbedding, dtype=None, chunk_size=16, local_size=4),
               rope_inputs(64, 1, offsets=True), ((0, 128), (1, 192), (9, 128), (5, 2, 64))),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- rope: x is the query (tokens, heads * 128) of a Llama-style attention with 8 query heads per
# KV head; positions span an 8192-token cache. torch has no built-in rope: its peer is
# torch.compile of the native body (the bench's torch-compile impl).
_ROPE_HEAD, _ROPE_GROUP, _ROPE_POSITIONS = 128, 8, 8192


def _rope(hidden: int):
    from dualop.ops import RotaryEmbedding

    head = _rope_head(hidden)
    return RotaryEmbedding(head, head, _ROPE_POSITIONS, 500000.0, True)


def _rope_head(hidden: int) -> int:
    """Llama's head size 128 when x holds whole heads of it, else one head as wide as x."""
    return _ROPE_HEAD if hidden % _ROPE_HEAD == 0 else hidden


def _rope_key_width(hidden: int) -> int:
    """The key's width: GQA with 8 query heads per KV head, at least one head."""
    head = _rope_head(hidden)
    return max(head, hidden // _ROPE_GROUP // head * head)


def _rope_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, hidden = shape
    positions = Pinned(rng.integers(0, _ROPE_POSITIONS, tokens).astype(np.int32), "int32")
    return (positions, _normal(shape, rng), _normal((tokens, _rope_key_width(hidden)), rng))


def _rope_cost(op, shape, itemsize) -> KernelCost:
    tokens, hidden = shape
    heads = (hidden + _rope_key_width(hidden)) // op.head_size
    return cost_model.rotary_cost(tokens, heads, op.head_size, op.rotary_dim, itemsize)


def _jax_rope(op):
    """What a jax user writes: gather cos/sin rows of a float32 table, rotate halves in float32."""
    import jax.numpy as jnp

    table = jnp.asarray(op.cos_sin_cache)
    half, head = op.rotary_dim // 2, op.head_size

    def rope(positions, query, key):
        cos, sin = jnp.split(table[positions], 2, axis=-1)
        cos, sin = cos.astype(query.dtype).astype(jnp.float32)[:, None], sin.astype(query.dtype).astype(jnp.float32)[:, None]

        def rotate(x):
            xf = x.reshape(x.shape[0], -1, head).astype(jnp.float32)
            x1, x2 = xf[..., :half], xf[..., half:]
            return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype).reshape(x.shape)

        return rotate(query), rotate(key)

    return rope

# --- serving rope: (tokens, query width) -> positions, query and key of Llama-3-70B's attention ----
_ROPE_KV_HEADS = 8


def _serving_rope_inputs(shape, *, offsets: bool = False):
    tokens, width = shape
    positions = InputSpec((tokens,), "int32")
    args = (positions, InputSpec((tokens, width), None), InputSpec((tokens, _ROPE_KV_HEADS * _ROPE_HEAD), None))
    return (*args, positions) if offsets else args


def _vision_rope_inputs(shape):
    seq, heads, head_size = shape
    return (InputSpec(shape, None), InputSpec((seq, head_size // 2), None), InputSpec((seq, head_size // 2), None))


def _serving_rope(case_label: str):
    def make(shape):
        from dualop.ops import DualChunkRotaryEmbedding, RotaryEmbedding

        neox = "gptj" not in case_label
        rotary_dim = _ROPE_HEAD * 3 // 4 if "partial" in case_label else _ROPE_HEAD
        if case_label.startswith("dual_chunk"):  # Qwen2.5-1M style chunks, at this cache's length
            return DualChunkRotaryEmbedding(_ROPE_HEAD, rotary_dim, _ROPE_POSITIONS, 1e6, neox, None, 2048, 256)
        return RotaryEmbedding(_ROPE_HEAD, rotary_dim, _ROPE_POSITIONS, 500000.0, neox)

    return make


def _rope_in_place_inputs(shape, rng):
    """The engine's in-place rope: int64 positions, the query (tokens, heads * 128) and a key of a
    quarter of its heads (Llama-3-8B: 32 query heads, 8 KV heads)."""
    from dualop.testing import Pinned

    tokens, hidden = shape
    positions = Pinned(rng.integers(0, _ROPE_POSITIONS, tokens).astype(np.int64), "int64")
    return (positions, _normal(shape, rng), _normal((tokens, max(_rope_head(hidden), hidden // 4)), rng))


def _rope_in_place_cost(op, shape, itemsize) -> KernelCost:
    tokens, hidden = shape
    heads = (hidden + max(op.head_size, hidden // 4)) // op.head_size
    return cost_model.rotary_cost(tokens, heads, op.head_size, op.rotary_dim, itemsize)


def bench_cases():
    """Not run by default (ask with --ops): against a hand-written ``jax.numpy`` rope, and the
    engine's in-place form (torch; against its own kernel where vLLM is installed)."""
    return [BenchCase("rotary_embedding", "rotary_embedding", _rope, _rope_inputs, _rope_cost, None, _jax_rope,
                      default=False),
            BenchCase("rotary_embedding[in_place]", "rotary_embedding", _rope, _rope_in_place_inputs,
                      _rope_in_place_cost, default=False,
                      written=lambda a: (a, {"query_out": a[1], "key_out": a[2]}))]


def serving():
    """Llama-3-70B (64 query heads, 8 KV heads, head 128) for the text ropes, prefill 8192 and a
    16-token decode batch; the Qwen2.5-VL vision encoder (4096 patches, 16 heads, head 80)."""
    make_op = {label: _serving_rope(label)
               for label in ("rotary_embedding[neox,d64]", "rotary_embedding[gptj,d80,partial]",
                             "rotary_embedding[neox,d80,no_key]", "dual_chunk_rotary_embedding[neox,d64,partial]")}
    text = ((8192, 64 * 128), (16, 64 * 128))
    return {
        "rotary_embedding": Serving(text, _serving_rope_inputs, make_op),
        "dual_chunk_rotary_embedding": Serving(text, lambda shape: _serving_rope_inputs(shape, offsets=True), make_op),
        "apply_rotary_emb": Serving(((4096, 16, 80),), _vision_rope_inputs, make_op),
    }
