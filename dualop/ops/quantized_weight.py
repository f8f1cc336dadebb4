"""Quantized linear weights: ``WeightQuant`` (the scheme, declared once) and ``QuantizedWeight``
(its arrays), which the linear ops take wherever they take a float weight.

A ``QuantizedWeight`` holds the codes as the checkpoint stores them (float8_e4m3fn, int8, or 4/8-bit
codes packed into int32) with their scales, zero points and static activation scale; it stays
quantized in memory. What it means is ``dequantize()``: the float32 ``[N, K]`` weight of the
scheme's definition (``dualop.kernels.quant_math``), and for schemes that quantize activations
(``activations`` ``dynamic`` / ``static``: W8A8) ``quantize_activations``, the engine's
quantisation of ``x`` before its GEMM:

- fp8 with ``block`` weights: per-token groups of ``block[1]`` columns, dynamic (``quant_fp8``'s
  semantics, the engine's ``w8a8_block_fp8`` path);
- fp8 per tensor / per channel: one scale per tensor (static: ``input_scale``) or per token
  (dynamic);
- int8: symmetric, scale ``max|x| / 127`` per token (dynamic) or ``input_scale`` (static), codes
  rounded half to even and clipped to [-128, 127].

The linear ops' native body multiplies the dequantised activations and weight in float32
(``dualop.ops.linear``); schemes: fp8 (tensor, channel, block), int8 (tensor, channel, group) and
int4 (group, channel) with or without zero points, in the ``plain``, ``packed`` (compressed-tensors'
int32 words along K) and ``awq`` (AWQ's GEMM words along N) layouts.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable

from dualop.backends import array_namespace
from dualop.kernels import quant_math
from dualop.ops._checks import check_optional_like, dtype_name
from dualop.platforms import family_of, frontend_of

__all__ = ["WeightQuant", "QuantizedWeight", "quantize_activations"]

_CODES = ("fp8", "int8", "int4")
_STRATEGIES = ("tensor", "channel", "group", "block")
_LAYOUTS = ("plain", "packed", "awq")
_ACTIVATIONS = ("none", "dynamic", "static")
_SCALE_DTYPES = frozenset({"float32", "bfloat16", "float16"})
_INT8_MAX = 127.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """How a linear weight is quantized. ``codes``: ``fp8`` (float8_e4m3fn), ``int8`` or ``int4``;
    ``strategy``: ``tensor``, ``channel`` (a scale per output row), ``group`` (``group_size``
    consecutive input columns of a row share one) or ``block`` (``block = (bn, bk)`` tiles);
    ``symmetric``: no zero points; ``layout``: ``plain``, ``packed`` or ``awq`` (see the module
    docstring); ``activations``: ``none`` (weight-only), ``dynamic`` or ``static`` (W8A8)."""

    codes: str
    strategy: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    layout: str = "plain"
    activations: str = "none"

    def __post_init__(self) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"WeightQuant: {why}")

        for name, value, allowed in (("codes", self.codes, _CODES), ("strategy", self.strategy, _STRATEGIES),
                                     ("layout", self.layout, _LAYOUTS), ("activations", self.activations, _ACTIVATIONS)):
            if value not in allowed:
                raise bad(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.strategy == "group" and not _positive(self.group_size):
            raise bad(f"strategy 'group' needs a positive int group_size, got {self.group_size!r}")
        if self.strategy != "group" and self.group_size is not None:
            raise bad(f"group_size is for strategy 'group', not {self.strategy!r}")
        if self.strategy == "block":
            if not (isinstance(self.block, tuple) and len(self.block) == 2 and all(map(_positive, self.block))):
                raise bad(f"strategy 'block' needs block = (block_n, block_k) of positive ints, got {self.block!r}")
        elif self.block is not None:
            raise bad(f"block is for strategy 'block', not {self.strategy!r}")
        if self.codes == "fp8" and (self.strategy == "group" or not self.symmetric):
            raise bad("fp8 codes take tensor, channel or block scales and no zero points")
        if self.codes == "int4" and self.strategy not in ("group", "channel"):
            raise bad(f"int4 codes take group or channel scales, not {self.strategy!r}")
        if self.layout == "plain" and self.codes == "int4":
            raise bad("int4 codes are packed: layout 'packed' or 'awq'")
        if self.layout == "packed" and self.codes == "fp8":
            raise bad("layout 'packed' holds int codes")
        if self.layout == "awq" and (self.codes != "int4" or self.strategy != "group" or self.symmetric):
            raise bad("layout 'awq' is int4 codes in groups with zero points")
        if not self.symmetric and self.strategy == "block":
            raise bad("block scales take no zero points")
        if not self.symmetric and self.layout == "packed" and self.strategy == "tensor":
            raise bad("packed zero points go with group or channel scales")
        if self.activations != "none" and (self.codes == "int4" or not self.symmetric or self.strategy == "group"):
            raise bad("quantized activations (W8A8) go with symmetric 8-bit tensor, channel or block weights")

    @property
    def bits(self) -> int:
        return 4 if self.codes == "int4" else 8

    def codes_dtype(self) -> str:
        return {"plain": "float8_e4m3fn" if self.codes == "fp8" else "int8"}.get(self.layout, "int32")

    def codes_shape(self, n: int, k: int) -> tuple[int, int]:
        """The codes array of a ``[n, k]`` weight."""
        if self.layout == "packed":
            return n, _cdiv(k * self.bits, 32)
        if self.layout == "awq":
            return k, n // 8
        return n, k

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (n, 1)
        if self.strategy == "group":
            return (_cdiv(k, self.group_size), n) if self.layout == "awq" else (n, _cdiv(k, self.group_size))
        return _cdiv(n, self.block[0]), _cdiv(k, self.block[1])

    def zero_point_shape(self, n: int, k: int) -> tuple[int, ...] | None:
        if self.symmetric:
            return None
        s = self.scale_shape(n, k)
        if self.layout == "awq":
            return s[0], n // 8
        if self.layout == "packed":
            return _cdiv(s[0] * self.bits, 32), *s[1:]
        return s

    def feature_axes(self, array: str) -> dict[str, tuple[int, int] | None]:
        """Where the output (``"out"``) and input (``"in"``) features run in array ``array``
        (``codes``, ``scale``, ``zero_point``): ``(axis, features per index)``, or None when every
        feature shares it (a per-tensor scale; a per-channel scale along the input)."""
        per_word = 32 // self.bits
        awq = self.layout == "awq"
        if array == "codes":
            if awq:
                return {"out": (1, 8), "in": (0, 1)}
            return {"out": (0, 1), "in": (1, per_word if self.layout == "packed" else 1)}
        if array not in ("scale", "zero_point"):
            raise ValueError(f"WeightQuant: no array {array!r}")
        if self.strategy == "tensor":
            return {"out": None, "in": None}
        out_unit = {"block": self.block[0] if self.block else 1}.get(self.strategy, 1)
        if array == "zero_point" and self.layout in ("packed", "awq"):
            out_unit = per_word if self.layout == "packed" else 8  # zero points packed along the outputs
        in_unit = {"group": self.group_size, "block": self.block[1] if self.block else 1}.get(self.strategy)
        if awq:
            return {"out": (1, out_unit), "in": (0, in_unit)}
        return {"out": (0, out_unit), "in": None if in_unit is None else (1, in_unit)}

    def shard_alignment(self, features: str) -> int:
        """The multiple a cut through the output (``"out"``) or input (``"in"``) features must fall
        on, so that no scale block, group or packed word is split."""
        units = [axes[features][1] for axes in (self.feature_axes(a) for a in ("codes", "scale", "zero_point"))
                 if axes[features] is not None]
        return math.lcm(*units)

    def describe(self) -> str:
        grain = {"tensor": "per tensor", "channel": "per channel", "group": f"groups of {self.group_size}",
                 "block": f"{self.block[0]}x{self.block[1]} blocks" if self.block else ""}[self.strategy]
        acts = "weight-only" if self.activations == "none" else f"{self.activations} activations"
        return f"{self.codes} {grain}{'' if self.symmetric else ' with zero points'}, {acts} ({self.layout})"


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


class QuantizedWeight:
    """A quantized ``[N, K]`` linear weight: ``quant`` (a ``WeightQuant``), ``codes``, ``scale``
    and, where the scheme has them, ``zero_point`` and ``input_scale`` (arrays of one frontend).
    ``shape`` is the float weight's ``(N, K)``; it defaults to what ``codes`` says (a packed
    layout's ``K`` up to a whole word unless given). A jax pytree (its arrays the leaves)."""

    __slots__ = ("quant", "codes", "scale", "zero_point", "input_scale", "shape", "_checked", "_derived")

    def __init__(self, quant: WeightQuant, codes: Any, scale: Any, zero_point: Any = None, input_scale: Any = None,
                 shape: tuple[int, int] | None = None) -> None:
        if not isinstance(quant, WeightQuant):
            raise TypeError(f"QuantizedWeight: quant must be a WeightQuant, got {type(quant).__qualname__}")
        self.quant, self.codes, self.scale = quant, codes, scale
        self.zero_point, self.input_scale = zero_point, input_scale
        if shape is None:
            rows, cols = tuple(codes.shape[-2:]) if getattr(codes, "ndim", 0) == 2 else (0, 0)
            shape = {"packed": (rows, cols * 32 // quant.bits), "awq": (cols * 8, rows)}.get(quant.layout, (rows, cols))
        self.shape = (int(shape[0]), int(shape[1]))
        self._checked: tuple | None = None  # what check() last passed (see there)
        self._derived: dict[str, tuple] = {}  # derived()'s results, by name
        if "jax" in sys.modules:  # a pytree wherever jax is in use (jax arrays, abstract ShapeDtypeStructs)
            _register_pytree()

    ndim = 2

    @property
    def dtype(self) -> Any:
        return self.codes.dtype

    def arrays(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("codes", "scale", "zero_point", "input_scale")
                if getattr(self, name) is not None}

    def map_arrays(self, fn: Any) -> QuantizedWeight:
        """The same scheme and shape with ``fn`` applied to each array it holds (None stays None):
        how test inputs, abstract compile inputs and frontend conversions carry a quantized weight."""
        return QuantizedWeight(self.quant, fn(self.codes), fn(self.scale),
                               None if self.zero_point is None else fn(self.zero_point),
                               None if self.input_scale is None else fn(self.input_scale), shape=self.shape)

    def features(self, which: str, start: int, stop: int) -> QuantizedWeight:
        """The weight of output (``which="out"``) or input (``"in"``) features ``[start, stop)``:
        every array cut where those features are stored (a tensor parallel shard). ``ValueError``
        unless the cut falls on ``quant.shard_alignment(which)`` (or the end)."""
        n, k = self.shape
        total = n if which == "out" else k
        unit = self.quant.shard_alignment(which)
        if not 0 <= start < stop <= total or start % unit or (stop % unit and stop != total):
            raise ValueError(f"QuantizedWeight: {which}put features [{start}, {stop}) of {total} do not fall on whole "
                             f"scale blocks, groups and packed words ({self.quant.describe()}: multiples of {unit})")

        def cut(name: str, array: Any) -> Any:
            axes = self.quant.feature_axes(name) if name != "input_scale" else {"out": None, "in": None}
            if axes[which] is None:
                return array
            axis, per = axes[which]
            index = [slice(None)] * array.ndim
            index[axis] = slice(start // per, -(-stop // per))
            return array[tuple(index)]

        shape = (stop - start, k) if which == "out" else (n, stop - start)
        return QuantizedWeight(self.quant, shape=shape, **{name: cut(name, a) for name, a in self.arrays().items()})

    def check(self, op: str, arg: str, x: Any, x_frontend: str, shape: tuple[int, int]) -> None:
        """Raise a ``TypeError``/``ValueError`` naming ``op`` and ``arg`` unless this weight is a
        ``shape`` weight of its scheme, on ``x``'s frontend and device."""
        q, (n, k) = self.quant, shape
        # The verdict depends on the arrays' shapes, dtypes and devices and on x's frontend and
        # device, none of which an array changes in place: a model's weight passes once, and each
        # later call (every layer of every step) only compares the arrays it holds.
        device = getattr(x, "device", None) if family_of(x_frontend) == "torch" else None
        arrays = (self.codes, self.scale, self.zero_point, self.input_scale)
        memo = self._checked
        if memo is not None and memo[0] == (n, k, x_frontend, device) and all(
                a is b for a, b in zip(memo[1], arrays)):
            return
        if self.shape != (n, k):
            raise ValueError(f"{op}: argument '{arg}' is a quantized weight of shape {self.shape}; expected {(n, k)}")
        if q.strategy == "block" and q.activations != "none" and k % q.block[1]:
            raise ValueError(f"{op}: argument '{arg}': {k} input features do not split into the activation groups "
                             f"of {q.block[1]} its {q.block[0]}x{q.block[1]} blocks quantize x in")
        if q.layout == "awq" and n % 8:
            raise ValueError(f"{op}: argument '{arg}': AWQ packs 8 output features a word; {n} is not a multiple of 8")
        expected = {"codes": (q.codes_shape(n, k), frozenset({q.codes_dtype()})),
                    "scale": (q.scale_shape(n, k), _SCALE_DTYPES),
                    "zero_point": (q.zero_point_shape(n, k),
                                   frozenset({"int32"} if q.layout != "plain" else {"int8", "int32"}))}
        for name, (want_shape, dtypes) in expected.items():
            value = getattr(self, name)
            label = f"{arg}.{name}"
            if want_shape is None:
                if value is not None:
                    raise ValueError(f"{op}: argument '{label}' must be None for a symmetric scheme ({q.describe()})")
                continue
            if value is None:
                raise ValueError(f"{op}: argument '{label}' is required ({q.describe()}), shape {want_shape}")
            check_optional_like(op, label, value, "x", x, x_frontend, shape=want_shape, dtypes=dtypes)
        if q.activations == "static":
            if self.input_scale is None:
                raise ValueError(f"{op}: argument '{arg}.input_scale' is required for static activation scales")
            check_optional_like(op, f"{arg}.input_scale", self.input_scale, "x", x, x_frontend,
                                shape=tuple(self.input_scale.shape), dtypes=_SCALE_DTYPES)
            if math.prod(self.input_scale.shape) != 1:
                raise ValueError(f"{op}: argument '{arg}.input_scale' must hold one element, got shape "
                                 f"{tuple(self.input_scale.shape)}")
        elif self.input_scale is not None:
            raise ValueError(f"{op}: argument '{arg}.input_scale' must be None ({q.describe()})")
        if family_of(frontend_of(self.codes)) != family_of(x_frontend):
            raise TypeError(f"{op}: argument '{arg}' holds {frontend_of(self.codes)} arrays but 'x' is a "
                            f"{x_frontend} array")
        self._checked = ((n, k, x_frontend, device), arrays)

    _STATE = ("quant", "codes", "scale", "zero_point", "input_scale", "shape")

    def __getstate__(self) -> dict[str, Any]:
        # a copy or a pickle carries the weight, not the memos: derived() values hold packed
        # pointers into these very arrays, which a copy's arrays are not
        return {name: getattr(self, name) for name in self._STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in self._STATE:
            setattr(self, name, state[name])
        self._checked, self._derived = None, {}

    def derived(self, name: str, build: Callable[[], tuple[Any, bool]]) -> Any:
        """What a kernel derives from this weight's arrays (its packed call arguments), built once:
        ``build()`` returns ``(value, keep)``, and a kept value is returned again while the weight
        holds the same arrays (changed in place or not). ``keep`` false (a value that would not see
        a change made in place, such as one holding copies) builds it again each call."""
        arrays = (self.codes, self.scale, self.zero_point, self.input_scale)
        memo = self._derived.get(name)
        if memo is not None and all(a is b for a, b in zip(memo[0], arrays)):
            return memo[1]
        value, keep = build()
        if keep:
            self._derived[name] = (arrays, value)
        return value

    def dequantize(self, dtype: Any = None) -> Any:
        """The float32 ``[N, K]`` weight the scheme defines (``dtype``: cast to it)."""
        n, k = self.shape
        return quant_math.dequantize_weight(array_namespace(self.codes), self.quant, self.codes, self.scale,
                                            self.zero_point, n, k, dtype)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.quant.describe()}, shape={self.shape}, codes {dtype_name(self.codes)})"


def quantize_activations(x: Any, weight: QuantizedWeight) -> Any:
    """``x`` as the engine's W8A8 GEMM sees it: quantized by ``weight``'s activation scheme and
    dequantised again, float32 (``x`` itself in float32 for a weight-only scheme)."""
    from dualop.ops.quantization import GroupShape, quantize_fp8_native

    q, xp = weight.quant, array_namespace(x)
    xf = xp.astype(x, xp.float32)
    if q.activations == "none":
        return xf
    static = q.activations == "static"
    if q.codes == "fp8":
        group = (GroupShape(1, q.block[1]) if q.strategy == "block" else
                 GroupShape.PER_TENSOR if static or q.strategy == "tensor" else GroupShape.PER_TOKEN)
        codes, scale = quantize_fp8_native(x, group, weight.input_scale if static else None)
        codes = xp.astype(codes, xp.float32)
        if group.is_per_group():
            lead = tuple(x.shape[:-1])
            codes = xp.reshape(codes, (*lead, scale.shape[-1], q.block[1])) * scale[..., None]
            return xp.reshape(codes, x.shape)
        return codes * scale
    # int8, symmetric: per token (dynamic) or the static input scale
    if static:
        scale = xp.reshape(xp.astype(weight.input_scale, xp.float32), (1,) * x.ndim)
    else:
        amax = xp.amax(xp.abs(xf), axis=-1, keepdims=True)
        scale = xp.where(amax > 0, amax / _INT8_MAX, 1.0)  # an all-zero row: codes 0 at any scale
    codes = xp.clip(xp.round(xf / scale), -_INT8_MAX - 1, _INT8_MAX)
    return codes * scale


_registered = False


def _register_pytree() -> None:
    global _registered
    if _registered:
        return
    import jax

    def flatten(w: QuantizedWeight):
        return (w.codes, w.scale, w.zero_point, w.input_scale), (w.quant, w.shape)

    def unflatten(aux, children):
        w = object.__new__(QuantizedWeight)
        w.quant, w.shape = aux
        w.codes, w.scale, w.zero_point, w.input_scale = children
        w._checked, w._derived = None, {}
        return w

    jax.tree_util.register_pytree_node(QuantizedWeight, flatten, unflatten)
    _registered = True
