"""Paged KV-cache writes: ``ReshapeAndCache`` (registered ``reshape_and_cache``), the reference
serving engine's op that stores a step's new keys and values in the paged cache
``ragged_paged_attention`` reads.

``op = ReshapeAndCache()``; ``kv_pages = op(key, value, kv_pages, slot_mapping, *,
kv_cache_dtype="auto", k_scale=None, v_scale=None)``.

- ``key``, ``value``: ``[T, Hkv, D]``, float32/bfloat16/float16.
- ``kv_pages``: ``[num_pages, page_size, 2*Hkv, D]``, K and V heads interleaved as
  ``ragged_paged_attention`` reads them: key head h goes to combined head 2h, value head h to 2h+1.
  Its dtype is the key's (``kv_cache_dtype="auto"``, the engine's default), or float8: an fp8
  cache (``"fp8"`` or ``"fp8_e4m3"``: float8_e4m3fn; ``"fp8_e5m2"``: float8_e5m2) holds half the
  bytes of a 16-bit one. A ``kv_cache_dtype`` that names another dtype than the cache's is refused.
- ``k_scale``, ``v_scale`` (an fp8 cache's scales, the engine's ``layer._k_scale`` /
  ``layer._v_scale``): a Python number or a float32 array of one element, positive and finite;
  None is 1.0 (the engine's default). An fp8 cache stores ``fp8(clip(key * (1 / k_scale), -max,
  max))`` computed in float32, rounded to nearest even (max 448 for e4m3fn, 57344 for e5m2; the
  rule and why it multiplies by the reciprocal: ``kernels/kv_cache_math.py``), and the same for
  values with ``v_scale``; ``ragged_paged_attention`` reads ``code * scale``. Every path writes
  the same bytes. A float cache ignores the scales, as the engine does (they are still checked).
  Under ``torch.compile`` the scales are tensors (the op's schema types them ``Tensor?``).
- ``slot_mapping``: int32/int64 ``[T]``; token t goes to page ``slot // page_size``, offset
  ``slot % page_size``. Negative slots are padding: those tokens are skipped. Two tokens with one
  slot: the last of them in token order wins, on every path (the reference engine leaves it
  unspecified; here each path first drops every token a later token overwrites, see ``last_writes``,
  so no kernel ever sees two writers of one slot).

Returns the updated cache. torch (every torch device) updates ``kv_pages`` IN PLACE and returns it
(the same tensor). JAX arrays are immutable: a new array is returned; under ``jax.jit`` pass the
cache as a donated argument (``jax.jit(step, donate_argnums=...)``) so XLA reuses its buffer
instead of copying the whole cache. The torch frontends that reach the Pallas kernel (torch_xla,
torchax) get its new array back and write it into ``kv_pages`` with ``kv_pages.copy_(new)``, so
they too see the update in place (the same contents as the jax result).

Validation before anything is written: shapes, dtypes, one device, a torch cache that can be written
in place (``check_writable_cache``: not an inference tensor outside inference mode, not a leaf that
requires grad while grad is on, no overlapping elements), and for arrays whose values are at hand
(torch CPU/CUDA tensors, concrete jax arrays) ``max(slot_mapping) < num_pages * page_size`` (on CUDA
that reads the slots back; not while a CUDA graph is being captured) and scales that are positive
and finite (a scale tensor's value is read on the CPU and from concrete jax arrays only, never from
a GPU, so a step costs no sync for it); lazy or traced slot mappings
(torch_xla, torchax, torch.compile, ``jax.jit``) are not read. Every path drops a slot
outside ``[0, num_pages * page_size)`` rather than writing out of bounds. Reading the slots also
tells whether two tokens share one; when none do (the usual step) the paths skip the sort
``last_writes`` would otherwise run.

Kernels: Pallas (``kernels/pallas/reshape_and_cache.py``: per-token DMAs into the HBM cache,
input/output aliased; an fp8 cache's codes are computed by ``quantize_kv`` in its wrapper),
Triton (``kernels/cuda/reshape_and_cache.py``: in place; fp8 codes encoded in the kernel by
integer arithmetic, so any GPU and the interpreter give the same bytes), and on the torch CPU the
C++ torch operator for a float cache, else ``index_copy_`` of the kept rows (fp8 codes from
``quantize_kv``) into the flattened cache (faster here than the native body's ``index_put_`` on
(page, offset) pairs).
"""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, validates_inputs
from dualop.kernels.kv_cache_math import FP8_KV_FORMATS, KV_CACHE_DTYPES, fp8_kv_format, inverse_scale, quantize_kv
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import (
    FLOAT_DTYPES, check_array, check_optional_like, check_writable_cache, checked_before, concrete_values,
    dtype_name, remember_checked,
)
from dualop.platforms import family_of, frontend_of
from dualop.spec import InputSpec, Serving

__all__ = ["KV_CACHE_DTYPES", "ReshapeAndCache", "last_writes", "scales_as_tensors"]

_PALLAS_RESHAPE_AND_CACHE = KernelRef("dualop.kernels.pallas.reshape_and_cache", "reshape_and_cache")
_TRITON_RESHAPE_AND_CACHE = KernelRef("dualop.kernels.cuda.reshape_and_cache", "reshape_and_cache")
_CPU_FAST_RESHAPE_AND_CACHE = KernelRef("dualop.kernels.cpu.kv_cache", "FAST_RESHAPE_AND_CACHE")
_SLOT_DTYPES = ("int32", "int64")
_CACHE_DTYPES = FLOAT_DTYPES | frozenset(FP8_KV_FORMATS)


def _known_slots(slot_mapping: Any, frontend: str) -> Any:
    """``slot_mapping``'s values as numpy where they are at hand without a device sync of a lazy
    graph or a trace: torch CPU/CUDA tensors and concrete jax arrays; None otherwise."""
    if frontend == "torch":
        import torch

        if slot_mapping.device.type not in ("cpu", "cuda") or torch.compiler.is_compiling():
            return None
        if isinstance(slot_mapping, torch._subclasses.FakeTensor):
            return None
    elif frontend != "jax":
        return None
    # (concrete_values: None for jax tracers and a CUDA graph being captured; numpy, not jnp, for a
    # concrete array closed over by jit or shard_map, where jnp would give a tracer)
    return concrete_values(slot_mapping)


# The verdict of the last slot check on this thread: (slot_mapping, whether its kept slots are
# distinct: True, False, or None when its values were not read). check_inputs sets it and the
# method the same call runs takes it, so a step whose slots are known distinct skips the sort.
_SLOT_VERDICT = threading.local()


def _take_verdict(slot_mapping: Any) -> bool:
    """Whether the check that just ran on this very ``slot_mapping`` found its kept slots distinct
    (the verdict is taken: a later call checks again)."""
    verdict = getattr(_SLOT_VERDICT, "last", None)
    _SLOT_VERDICT.last = None
    return verdict is not None and verdict[0] is slot_mapping and verdict[1] is True


def last_writes(slot_mapping: Any) -> Any:
    """``slot_mapping`` with -1 (skip) for every token whose slot a later token also writes, so the
    last token in order wins on every path and no kernel sees two writers of one slot. A stable
    sort by slot, then each run of equal slots keeps its last token (traceable: no data-dependent
    shapes). Returns ``slot_mapping`` itself when this call's check read the slots and found
    them distinct."""
    if _take_verdict(slot_mapping):
        return slot_mapping
    tokens = slot_mapping.shape[0]
    if tokens <= 1:
        return slot_mapping
    if family_of(frontend_of(slot_mapping)) == "torch":
        import torch

        order = torch.argsort(slot_mapping, stable=True)
        ordered = slot_mapping[order]
        last = torch.cat([ordered[1:] != ordered[:-1], torch.ones_like(ordered[:1], dtype=torch.bool)])
        keep = torch.empty_like(last).scatter_(0, order, last)
        return torch.where(keep, slot_mapping, torch.full_like(slot_mapping, -1))
    import jax.numpy as jnp

    order = jnp.argsort(slot_mapping, stable=True)
    ordered = slot_mapping[order]
    last = jnp.concatenate([ordered[1:] != ordered[:-1], jnp.ones((1,), bool)])
    keep = jnp.zeros((tokens,), bool).at[order].set(last)
    return jnp.where(keep, slot_mapping, jnp.asarray(-1, slot_mapping.dtype))


def check_kv_scale(op: str, name: str, scale: Any, ref_name: str, ref: Any, fe: str) -> None:
    """An fp8 cache scale: None, a Python number, or a float32 array of one element on ``ref``'s
    frontend and device; positive and finite wherever its value is at hand (a number, a CPU tensor,
    a concrete jax array; a GPU tensor is not read: no sync per step)."""
    if scale is None:
        return
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) or frontend_of(scale) is not None):
        raise TypeError(f"{op}: argument '{name}' must be None, a number or a float32 array of one element, got "
                        f"{type(scale).__module__}.{type(scale).__qualname__}")
    if isinstance(scale, (int, float)):
        value = float(scale)
    else:
        check_optional_like(op, name, scale, ref_name, ref, fe, shape=tuple(scale.shape),
                            dtypes=frozenset({"float32"}))
        if math.prod(scale.shape) != 1:
            raise ValueError(f"{op}: argument '{name}' has shape {tuple(scale.shape)}; expected one element "
                             f"(a per-tensor scale)")
        readable = frontend_of(scale) == "jax" or getattr(scale, "device", None) is not None and \
            scale.device.type == "cpu"
        values = concrete_values(scale) if readable else None
        if values is None:
            return
        value = float(values.reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: argument '{name}' is {value!r}; expected a positive, finite scale")


def inverse_scale_operand(xp: Any, scale: Any) -> Any:
    """What the paths multiply by (``kernels/kv_cache_math.py``): a number's reciprocal as a Python
    float (``inverse_scale``; None is 1.0), a scale array's as a float32 array of shape (1,) in its
    frontend (one division there, no host read)."""
    if scale is None or isinstance(scale, (int, float)):
        return inverse_scale(1.0 if scale is None else float(scale))
    return 1.0 / xp.reshape(xp.astype(scale, xp.float32), (1,))


def _bytes(x: Any) -> Any:
    """A plain torch tensor's uint8 view (torch 2.9's CPU indexing has no float8 kernels); any
    other array as it is."""
    if frontend_of(x) == "torch" and fp8_kv_format(x.dtype) is not None:
        import torch

        return x.view(torch.uint8)
    return x


@CustomOp.register("reshape_and_cache")
class ReshapeAndCache(CustomOp):
    """Write new keys and values into the paged KV cache (see the module docstring)."""

    # The argument torch updates in place (torch.library declares it mutated; see library.py).
    mutates_args: ClassVar[tuple[str, ...]] = ("kv_pages",)

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)

    def check_inputs(self, key: Any, value: Any, kv_pages: Any, slot_mapping: Any, *, kv_cache_dtype: str = "auto",
                     k_scale: Any = None, v_scale: Any = None) -> None:
        op = "reshape_and_cache"
        fe = check_array(op, "key", key, min_ndim=3)
        if key.ndim != 3:
            raise ValueError(f"{op}: argument 'key' must be [tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
        tokens, heads, head_dim = key.shape
        if value is None:
            raise ValueError(f"{op}: argument 'value' is required (shape {tuple(key.shape)})")
        check_optional_like(op, "value", value, "key", key, fe, same_dtype=True)
        if kv_pages is None:
            raise ValueError(f"{op}: argument 'kv_pages' is required ([num_pages, page_size, {2 * heads}, {head_dim}])")
        check_array(op, "kv_pages", kv_pages, min_ndim=4, dtypes=_CACHE_DTYPES)
        if kv_pages.ndim != 4:
            raise ValueError(f"{op}: argument 'kv_pages' must be [num_pages, page_size, 2*num_kv_heads, head_dim], "
                             f"got shape {tuple(kv_pages.shape)}")
        num_pages, page_size = kv_pages.shape[:2]
        wanted = self._cache_dtype(op, kv_cache_dtype, kv_pages)
        check_optional_like(op, "kv_pages", kv_pages, "key", key, fe, shape=(num_pages, page_size, 2 * heads, head_dim),
                            same_dtype=wanted is None, dtypes=_CACHE_DTYPES)
        check_kv_scale(op, "k_scale", k_scale, "key", key, fe)
        check_kv_scale(op, "v_scale", v_scale, "key", key, fe)
        check_writable_cache(op, "kv_pages", kv_pages)
        self._check_slot_mapping(op, slot_mapping, key, fe, tokens, num_pages * page_size)

    @staticmethod
    def _cache_dtype(op: str, kv_cache_dtype: Any, kv_pages: Any, name: str = "kv_pages") -> str | None:
        """The cache dtype ``kv_cache_dtype`` names (None for "auto": the key's), refused where it
        is not the dtype of the cache (argument ``name``)."""
        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{op}: argument 'kv_cache_dtype' is {kv_cache_dtype!r}; expected one of "
                             f"{', '.join(repr(k) for k in KV_CACHE_DTYPES)}")
        wanted, have = KV_CACHE_DTYPES[kv_cache_dtype], dtype_name(kv_pages)
        if wanted is None and have in FP8_KV_FORMATS:
            names = " or ".join(repr(k) for k, v in KV_CACHE_DTYPES.items() if v == have)
            raise ValueError(f"{op}: argument 'kv_cache_dtype' is 'auto' (a cache in the key's dtype) but '{name}' "
                             f"has dtype {have}; pass kv_cache_dtype={names} for it")
        if wanted is not None and have != wanted:
            raise ValueError(f"{op}: argument 'kv_cache_dtype' is {kv_cache_dtype!r} (a {wanted} cache) but "
                             f"'{name}' has dtype {have}")
        return wanted

    @staticmethod
    def _check_slot_mapping(op: str, slot_mapping: Any, key: Any, fe: str, tokens: int, capacity: int) -> None:
        slot_fe = frontend_of(slot_mapping)
        if slot_fe is None:
            raise TypeError(f"{op}: argument 'slot_mapping' must be a torch.Tensor or jax.Array, got "
                            f"{type(slot_mapping).__module__}.{type(slot_mapping).__qualname__}")
        if family_of(slot_fe) != family_of(fe):
            raise TypeError(f"{op}: argument 'slot_mapping' is a {family_of(slot_fe)} array but 'key' is a "
                            f"{family_of(fe)} array; pass arrays of one frontend")
        if slot_fe != fe or (family_of(fe) == "torch" and slot_mapping.device != key.device):
            raise ValueError(f"{op}: argument 'slot_mapping' is on {getattr(slot_mapping, 'device', slot_fe)} but 'key' "
                             f"is on {getattr(key, 'device', fe)}; expected the same device")
        if dtype_name(slot_mapping) not in _SLOT_DTYPES:
            raise TypeError(f"{op}: argument 'slot_mapping' has dtype {dtype_name(slot_mapping)}; expected int32 or int64")
        if tuple(slot_mapping.shape) != (tokens,):
            raise ValueError(f"{op}: argument 'slot_mapping' has shape {tuple(slot_mapping.shape)}; expected ({tokens},) "
                             f"(one slot per token of 'key')")
        _SLOT_VERDICT.last = (slot_mapping, ReshapeAndCache._slot_values(op, slot_mapping, fe, tokens, capacity))

    @staticmethod
    def _slot_values(op: str, slot_mapping: Any, fe: str, tokens: int, capacity: int) -> bool | None:
        """Check the slots' values where they are at hand; return whether the kept (non-negative)
        slots are distinct, None when the values were not read. Remembered per step (see
        ``checked_before``): the next layer's write compares instead of checking again."""
        if not tokens:
            return True
        for verdict in (True, False):
            if checked_before("slot_mapping", (slot_mapping,), (capacity, verdict)):
                return verdict
        values = _known_slots(slot_mapping, fe)
        if values is None:
            return None
        import numpy as np

        top = int(values.max())
        if top >= capacity:
            raise ValueError(f"{op}: argument 'slot_mapping' holds slot {top}; expected slots below "
                             f"num_pages * page_size = {capacity} (negative slots are skipped)")
        kept = np.sort(values[values >= 0])
        distinct = not bool((kept[1:] == kept[:-1]).any())
        remember_checked("slot_mapping", (slot_mapping,), (capacity, distinct))
        return distinct

    def library_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The schema types the scales as tensors: a Python number becomes a one-element float32
        tensor on the key's device."""
        return args, scales_as_tensors(kwargs, args[0] if args else kwargs.get("key"), ("k_scale", "v_scale"))

    def forward_native(self, key: Any, value: Any, kv_pages: Any, slot_mapping: Any, *, kv_cache_dtype: str = "auto",
                       k_scale: Any = None, v_scale: Any = None) -> Any:
        xp = array_namespace(kv_pages)
        slot_mapping = last_writes(slot_mapping)
        num_pages, page_size, combined, head_dim = kv_pages.shape
        key, value = cache_rows(xp, key, value, kv_pages, k_scale, v_scale)
        rows = xp.reshape(xp.stack([_bytes(key), _bytes(value)], axis=2), (key.shape[0], combined, head_dim))
        keep = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
        index = (slot_mapping // page_size, slot_mapping % page_size)
        written = xp.set_at_dropping(_bytes(kv_pages), index, rows, keep)
        return kv_pages if frontend_of(kv_pages) == "torch" else written

    @validates_inputs
    def forward_cpu(self, key: Any, value: Any, kv_pages: Any, slot_mapping: Any, *, kv_cache_dtype: str = "auto",
                    k_scale: Any = None, v_scale: Any = None) -> Any:
        """torch on the CPU: a plain call (a row-major cache in the key's dtype, key and value
        rows unit-strided, slots in range) goes to the C++ torch operator (``kernels/cpu/kv_cache.py``: the rows copied in token
        order, checked in C++); any other call is checked here, then ``index_copy_`` of the kept
        tokens' interleaved rows (an fp8 cache's codes from ``quantize_kv``, copied as bytes) into
        the cache viewed as ``[num_pages * page_size, 2*Hkv, D]`` (needs a contiguous cache to view)."""
        if (kv_cache_dtype == "auto" and k_scale is None and v_scale is None
                and _CPU_FAST_RESHAPE_AND_CACHE.resolve().take(key, value, kv_pages, slot_mapping) is not None):
            return kv_pages
        self.check_inputs(key, value, kv_pages, slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
                          v_scale=v_scale)
        import torch

        if not kv_pages.is_contiguous():
            raise NotImplementedError("reshape_and_cache: the CPU path views the cache flat and needs it contiguous")
        num_pages, page_size, combined, head_dim = kv_pages.shape
        key, value = cache_rows(array_namespace(key), key, value, kv_pages, k_scale, v_scale)
        rows = torch.stack((_bytes(key), _bytes(value)), dim=2).reshape(key.shape[0], combined, head_dim)
        slots = last_writes(slot_mapping).to(torch.int64)
        keep = (slots >= 0) & (slots < num_pages * page_size)
        flat = _bytes(kv_pages).view(num_pages * page_size, combined, head_dim)
        if bool(keep.all()):  # no padding token (a decode step): no masked copies of rows and slots
            flat.index_copy_(0, slots, rows)
        else:
            flat.index_copy_(0, slots[keep], rows[keep])
        return kv_pages

    def forward_cuda(self, key: Any, value: Any, kv_pages: Any, slot_mapping: Any, *, kv_cache_dtype: str = "auto",
                     k_scale: Any = None, v_scale: Any = None) -> Any:
        fe = frontend_of(key)
        if fe == "torch" and kv_pages.stride(-1) != 1:
            raise NotImplementedError("reshape_and_cache: the Triton kernel writes a cache with a unit-strided last dim")
        scales = {}
        if fe == "torch" and fp8_kv_format(kv_pages.dtype) is not None:
            xp = array_namespace(key)
            scales = dict(k_inverse=inverse_scale_operand(xp, k_scale), v_inverse=inverse_scale_operand(xp, v_scale))
        return call_triton(fe, _TRITON_RESHAPE_AND_CACHE, key, value, kv_pages, last_writes(slot_mapping), **scales)

    def forward_tpu(self, key: Any, value: Any, kv_pages: Any, slot_mapping: Any, *, kv_cache_dtype: str = "auto",
                    k_scale: Any = None, v_scale: Any = None) -> Any:
        """The Pallas kernel; the torch frontends get its new array written back into ``kv_pages``
        (``copy_``), so torch callers see the update in place on every device. An fp8 cache's
        inverse scales reach it as float32 arrays of shape (1,)."""
        fe = frontend_of(key)
        inverses = ()
        if fp8_kv_format(kv_pages.dtype) is not None:
            xp = array_namespace(key)
            inverses = tuple(_as_array(xp, inverse_scale_operand(xp, s), key) for s in (k_scale, v_scale))
        new = call_jax_function(fe, _PALLAS_RESHAPE_AND_CACHE, key, value, kv_pages, last_writes(slot_mapping), *inverses)
        if family_of(fe) == "torch":
            kv_pages.copy_(new)
            return kv_pages
        return new


def cache_rows(xp: Any, key: Any, value: Any, kv_pages: Any, k_scale: Any, v_scale: Any) -> tuple[Any, Any]:
    """``key`` and ``value`` as the cache stores them: cast to a float cache's dtype, or an fp8
    cache's codes (``quantize_kv``, with each scale's ``inverse_scale_operand``): the native body's
    and the CPU path's values; the Pallas wrapper calls ``quantize_kv`` with the same inverse
    scales, the Triton kernel states the same rule in integer arithmetic."""
    if fp8_kv_format(kv_pages.dtype) is None:
        return xp.astype(key, kv_pages.dtype), xp.astype(value, kv_pages.dtype)
    xla = frontend_of(kv_pages) != "torch"  # XLA-backed arrays (jax, torch_xla, torchax)
    return tuple(quantize_kv(xp, x, inverse_scale_operand(xp, s), kv_pages.dtype, xla=xla)
                 for x, s in ((key, k_scale), (value, v_scale)))


def scales_as_tensors(kwargs: dict, like: Any, names: tuple[str, ...]) -> dict:
    """``kwargs`` with each scale in ``names`` given as a Python number made a one-element float32
    tensor on ``like``'s device (the ``torch.library`` schema's form of an fp8 cache's scales)."""
    out = dict(kwargs)
    for name in names:
        value = out.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            import torch

            out[name] = torch.full((1,), float(value), dtype=torch.float32, device=like.device)
    return out


def _as_array(xp: Any, inverse: Any, like: Any) -> Any:
    """An inverse scale as a float32 array of shape (1,) on ``like``'s device (made there, as zeros
    plus the value: no host-to-device copy, which a traced or fake device tensor cannot take)."""
    if not isinstance(inverse, float):
        return inverse
    return xp.zeros((1,), like=like, dtype=xp.float32) + inverse


def check_cases():
    """Small caches: shapes are the key's ``(tokens, num_kv_heads, head_dim)``; the cache has
    ``2 * tokens + 3`` slots in pages of 4 (so untouched rows remain), a fifth of the tokens are
    padding (slot -1), the rest go to distinct slots in random order."""
    import numpy as np

    from dualop.testing import OpCase, Pinned, normal

    page_size = 4

    def make_inputs(shape, rng):
        tokens, heads, head_dim = shape
        num_pages = -(-(2 * tokens + 3) // page_size)
        slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
        slots[rng.random(tokens) < 0.2] = -1
        cache = normal((num_pages, page_size, 2 * heads, head_dim), rng)
        return (normal(shape, rng), normal(shape, rng), cache, Pinned(slots, "int32"))

    def fp8_inputs(cache_dtype):
        """The same write into an fp8 cache whose old rows are codes of unit-scale values."""

        def make(shape, rng):
            key, value, cache, slots = make_inputs(shape, rng)
            return (key * 40.0, value, Pinned(cache, cache_dtype), slots)  # keys past e4m3's 448 / k_scale saturate

        return make

    shapes = ((0, 2, 64), (1, 1, 64), (7, 2, 128), (12, 1, 72), (5, 4, 32))
    fp8_shapes = ((0, 2, 64), (1, 1, 64), (7, 2, 128), (12, 1, 72))
    return [
        OpCase("reshape_and_cache", "reshape_and_cache", lambda s: ReshapeAndCache(), make_inputs, shapes),
        # scales off powers of two, so the reciprocal's rounding shows in the codes
        *(OpCase("reshape_and_cache", f"reshape_and_cache[{name}]", lambda s: ReshapeAndCache(), fp8_inputs(dtype),
                 fp8_shapes, options={"kv_cache_dtype": name, "k_scale": 0.0371, "v_scale": 2.7})
          for name, dtype in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"))),
    ]


# --- spec: what dualop compile builds (check_cases above) ----------------------------------


def _reshape_and_cache_inputs(shape, cache_dtype=None):
    """A step's tokens written into a paged cache of ``num_pages`` pages (Llama-3-70B's 8 KV heads
    of 128); ``cache_dtype`` None: the keys' dtype."""
    tokens, heads, head_dim, num_pages, page_size = shape
    kv = InputSpec((tokens, heads, head_dim), None)
    return (kv, kv, InputSpec((num_pages, page_size, 2 * heads, head_dim), cache_dtype), InputSpec((tokens,), "int32"))


def serving():
    """(tokens, num_kv_heads, head_dim, num_pages, page_size): a step's 2048 tokens written into a
    paged cache of 2048 pages of 16 and of 128 tokens, in the keys' dtype and in float8_e4m3fn
    (e5m2 differs only in the rounding's constants: its check shapes still build)."""
    return {"reshape_and_cache": Serving(
        ((2048, 8, 128, 2048, 16), (2048, 8, 128, 2048, 128)),
        {"reshape_and_cache": _reshape_and_cache_inputs,
         "reshape_and_cache[fp8_e4m3]": lambda shape: _reshape_and_cache_inputs(shape, "float8_e4m3fn")},
        cases=("reshape_and_cache", "reshape_and_cache[fp8_e4m3]"))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"reshape_and_cache": {"traits": {"not_differentiable"}},
              **{f"reshape_and_cache[{name}]": {"traits": {"fp8_inputs"}} for name in ("fp8_e4m3", "fp8_e5m2")}}
