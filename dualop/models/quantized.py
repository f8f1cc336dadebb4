"""The quantization formats of the checkpoints people serve, read from a checkpoint's header: which
linear layers hold quantized weights, in which scheme, and which tensors carry their codes, scales
and zero points. Nothing here reads a weight (only a packed layer's two-element ``weight_shape``):
``read_quantization`` checks every quantized layer's tensors (names, dtypes, shapes) against its
``quantization_config`` and raises one ``CheckpointError`` listing every problem before any weight
is loaded.

The formats (``SUPPORTED_METHODS``):

- ``fp8`` (DeepSeek-V3, the Qwen3 "-FP8" releases): ``<layer>.weight`` float8_e4m3fn ``[N, K]``
  with, for ``weight_block_size [bn, bk]``, ``<layer>.weight_scale_inv`` ``[ceil(N/bn),
  ceil(K/bk)]`` (float32, bfloat16 or float8_e8m0), else one ``<layer>.weight_scale`` per tensor;
  ``activation_scheme`` ``dynamic``, or ``static`` with one ``<layer>.input_scale``. Layers named in
  ``ignored_layers`` / ``modules_to_not_convert`` stay float.
- ``compressed-tensors`` (llm-compressor): ``config_groups``, each with ``targets`` (``Linear`` or
  ``re:`` patterns of layer names) and ``weights`` (``num_bits``, ``type`` int / float,
  ``strategy`` tensor / channel / group / block, ``group_size``, ``block_structure``,
  ``symmetric``), and ``input_activations`` (dynamic, or static with ``input_scale``); ``format``
  ``float-quantized`` / ``int-quantized`` / ``naive-quantized`` (``<layer>.weight`` in float8 or
  int8) or ``pack-quantized`` (``<layer>.weight_packed`` int32, ``K * bits / 32`` columns, and
  ``<layer>.weight_shape``); ``<layer>.weight_scale`` shaped ``[1]``, ``[N, 1]``, ``[N, ceil(K/g)]`` or
  ``[ceil(N/bn), ceil(K/bk)]`` by strategy; ``<layer>.weight_zero_point`` where not symmetric
  (packed along its first dim in ``pack-quantized``); ``ignore`` lists layers that stay float.
- ``awq`` (GEMM layout, ``version: gemm``): ``<layer>.qweight`` int32 ``[K, N/8]``,
  ``<layer>.qzeros`` int32 ``[K/g, N/8]``, ``<layer>.scales`` ``[K/g, N]``, 4 bits, group ``g``.

The dequantisation of each scheme is ``dualop.kernels.quant_math``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dualop.models.checkpoint import QUANTIZED_DTYPES, Checkpoint, CheckpointError
from dualop.ops.quantized_weight import WeightQuant

__all__ = ["SUPPORTED_METHODS", "QuantizedLinear", "QuantizedCheckpoint", "read_quantization"]

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "awq")

_FLOAT8 = ("F8_E4M3", "F8_E5M2")
_SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclasses.dataclass(frozen=True)
class QuantizedLinear:
    """One linear layer's quantized weight as its checkpoint stores it.

    ``scheme``: ``fp8`` or ``int`` (the codes' type); ``bits``: 4 or 8; ``strategy``: ``tensor``,
    ``channel``, ``group`` or ``block`` (how many weights share a scale); ``group_size`` (group),
    ``block`` ((bn, bk), block); ``symmetric``: no zero points; ``activations``: ``none``
    (weight-only), ``dynamic`` or ``static`` (an ``input_scale`` tensor); ``layout``: ``plain``
    (codes in a ``[N, K]`` tensor), ``packed`` (int32 words along K) or ``awq`` (AWQ's GEMM
    layout); ``shape``: the float weight's ``(N, K)``; ``tensors``: role (``codes``, ``scale``,
    ``zero_point``, ``input_scale``, ``shape``) -> checkpoint tensor name."""

    layer: str
    scheme: str
    bits: int
    strategy: str
    shape: tuple[int, int]
    tensors: Mapping[str, str]
    layout: str = "plain"
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    activations: str = "none"

    def describe(self) -> str:
        """A few words on the scheme, e.g. ``fp8 weights in 128x128 blocks, dynamic activations``."""
        grain = {"tensor": "one scale per tensor", "channel": "a scale per output channel",
                 "group": f"groups of {self.group_size}",
                 "block": f"{self.block[0]}x{self.block[1]} blocks" if self.block else "blocks"}[self.strategy]
        codes = "fp8" if self.scheme == "fp8" else f"int{self.bits}"
        zero = "" if self.symmetric else " with zero points"
        acts = "weight-only" if self.activations == "none" else f"{self.activations} activation scales"
        return f"{codes} weights in {grain}{zero}, {acts}"


@dataclasses.dataclass(frozen=True)
class QuantizedCheckpoint:
    """The parsed ``quantization_config``: its ``method``, the quantized ``linears`` by layer name,
    and the layer names it leaves float (``ignored``, as the config gives them)."""

    method: str
    linears: Mapping[str, QuantizedLinear]
    ignored: tuple[str, ...] = ()

    def summary(self) -> str:
        schemes = sorted({q.describe() for q in self.linears.values()})
        return f"{len(self.linears)} quantized linear layers: " + "; ".join(schemes)


class _Problems:
    """The problems found so far, raised together."""

    def __init__(self, ckpt: Checkpoint, method: str) -> None:
        self.ckpt, self.method, self.lines = ckpt, method, []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def raise_if_any(self) -> None:
        if self.lines:
            shown = self.lines[:12] + ([f"... and {len(self.lines) - 12} more"] if len(self.lines) > 12 else [])
            raise CheckpointError(
                f"from_pretrained: the {self.method!r} quantized checkpoint {self.ckpt.path!r} does not match its "
                f"quantization_config; nothing was loaded\n  " + "\n  ".join(shown))


def read_quantization(ckpt: Checkpoint) -> QuantizedCheckpoint | None:
    """The checkpoint's quantization (None for a float checkpoint), every quantized layer's tensors
    checked. Raises ``CheckpointError`` (nothing read) for a ``quant_method`` not in
    ``SUPPORTED_METHODS``, a config it cannot follow, a layer's tensor missing or of the wrong dtype
    or shape, or a tensor of a quantized dtype that the config does not explain."""
    quant = ckpt.config.get("quantization_config")
    if quant is None:
        stray = _quantized_dtype_tensors(ckpt, claimed=set())
        if stray:
            raise CheckpointError(
                f"from_pretrained: the checkpoint {ckpt.path!r} holds tensors of quantized dtypes ({len(stray)}: "
                + ", ".join(stray[:4]) + (" ..." if len(stray) > 4 else "")
                + ") though config.json has no quantization_config to say how to read them; nothing was loaded")
        return None
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method not in SUPPORTED_METHODS:
        raise CheckpointError(
            f"from_pretrained: the checkpoint {ckpt.path!r} is quantized with quant_method {method!r}, which dualop "
            f"does not read; supported: {', '.join(SUPPORTED_METHODS)}; nothing was loaded")
    problems = _Problems(ckpt, method)
    reader = {"fp8": _read_fp8, "compressed-tensors": _read_compressed_tensors, "awq": _read_awq}[method]
    linears, ignored = reader(ckpt, quant, problems)
    claimed = {name for q in linears.values() for name in q.tensors.values()}
    for name in _quantized_dtype_tensors(ckpt, claimed):
        problems.add(f"{name}: a quantized dtype, but no quantized layer of the config owns it")
    if not linears and not problems.lines:
        problems.add("the config names a quantization but no layer holds quantized tensors")
    problems.raise_if_any()
    return QuantizedCheckpoint(method, dict(sorted(linears.items())), tuple(ignored))


def _quantized_dtype_tensors(ckpt: Checkpoint, claimed: set[str]) -> list[str]:
    return [f"{name} ({dtype})" for name, dtype in ckpt.dtypes.items()
            if dtype in QUANTIZED_DTYPES and name not in claimed]


def _scheme(problems: _Problems, layer: str, *args: Any, **kwargs: Any) -> WeightQuant | None:
    """The ``WeightQuant`` (whose shape rules the layer's tensors are checked by), or None with the
    reason added where the scheme cannot exist."""
    try:
        return WeightQuant(*args, **kwargs)
    except ValueError as err:
        problems.add(f"{layer}: {err}")
        return None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _ignored(layer: str, patterns: Sequence[str]) -> bool:
    """Whether ``layer`` is in an ignore list: an exact name, a name's last part (``lm_head``), or a
    ``re:`` pattern (compressed-tensors)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], layer):
                return True
        elif layer == pattern or layer.endswith("." + pattern) or layer.startswith(pattern + "."):
            return True
    return False


def _expect(ckpt: Checkpoint, problems: _Problems, name: str, dtypes: Sequence[str], shape: tuple[int, ...] | None,
            what: str, numel: int | None = None) -> bool:
    """Check tensor ``name`` exists with one of ``dtypes`` and ``shape`` (or ``numel`` elements)."""
    if name not in ckpt.shapes:
        problems.add(f"{name}: missing ({what})")
        return False
    ok = True
    if ckpt.dtypes[name] not in dtypes:
        problems.add(f"{name}: dtype {ckpt.dtypes[name]}, expected {' or '.join(dtypes)} ({what})")
        ok = False
    got = ckpt.shapes[name]
    if shape is not None and got != tuple(shape):
        problems.add(f"{name}: shape {got}, expected {tuple(shape)} ({what})")
        ok = False
    if numel is not None and math.prod(got) != numel:
        problems.add(f"{name}: shape {got}, expected {numel} element(s) ({what})")
        ok = False
    return ok


def _weight_shape(ckpt: Checkpoint, problems: _Problems, name: str) -> tuple[int, int] | None:
    shape = ckpt.shapes[name]
    if len(shape) != 2:
        problems.add(f"{name}: shape {shape}, expected a 2-D [out_features, in_features] weight")
        return None
    return shape[0], shape[1]


# --- fp8 ------------------------------------------------------------------------------------------

def _read_fp8(ckpt: Checkpoint, quant: Mapping[str, Any], problems: _Problems):
    acts = quant.get("activation_scheme", "dynamic")
    if acts not in ("dynamic", "static"):
        problems.add(f"activation_scheme {acts!r}: expected 'dynamic' or 'static'")
    block = quant.get("weight_block_size")
    if block is not None and not (isinstance(block, Sequence) and len(block) == 2 and all(map(_positive_int, block))):
        problems.add(f"weight_block_size {block!r}: expected two positive ints [block_n, block_k]")
        block = None
    ignored = list(quant.get("ignored_layers") or quant.get("modules_to_not_convert") or [])
    linears = {}
    for name, dtype in ckpt.dtypes.items():
        if not name.endswith(".weight") or dtype not in _FLOAT8:
            continue
        layer = name[: -len(".weight")]
        if _ignored(layer, ignored):
            problems.add(f"{name}: float8, but the config lists {layer!r} among the layers left unquantized")
            continue
        if dtype != "F8_E4M3":
            problems.add(f"{name}: {dtype}; the fp8 method stores float8_e4m3fn weights")
            continue
        shape = _weight_shape(ckpt, problems, name)
        if shape is None:
            continue
        tensors = {"codes": name}
        if block is not None:
            bn, bk = block
            scale = f"{layer}.weight_scale_inv"
            _expect(ckpt, problems, scale, (*_SCALE_DTYPES, "F8_E8M0"),
                    WeightQuant("fp8", "block", block=(bn, bk)).scale_shape(*shape),
                    f"a scale per {bn}x{bk} block of the weight")
        else:
            scale = f"{layer}.weight_scale"
            _expect(ckpt, problems, scale, _SCALE_DTYPES, None, "the weight's per-tensor scale", numel=1)
        tensors["scale"] = scale
        if acts == "static":
            tensors["input_scale"] = f"{layer}.input_scale"
            _expect(ckpt, problems, tensors["input_scale"], _SCALE_DTYPES, None,
                    "the static activation scale (activation_scheme 'static')", numel=1)
        linears[layer] = QuantizedLinear(
            layer, "fp8", 8, "block" if block is not None else "tensor", shape, tensors,
            block=tuple(block) if block is not None else None, activations=acts)
    return linears, ignored


# --- compressed-tensors ---------------------------------------------------------------------------

_CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_CT_STRATEGIES = ("tensor", "channel", "group", "block")


def _ct_group(key: str, group: Any, problems: _Problems, default_format: str | None):
    """One config group's (targets, weights args, activation args, format), or None if unusable."""
    if not isinstance(group, Mapping):
        problems.add(f"config_groups[{key!r}]: expected a mapping")
        return None
    targets = group.get("targets") or []
    weights = group.get("weights")
    acts = group.get("input_activations")
    fmt = group.get("format") or default_format
    ok = True
    if not isinstance(weights, Mapping):
        problems.add(f"config_groups[{key!r}]: no 'weights' arguments (only weight quantization is read)")
        return None
    if fmt not in _CT_FORMATS:
        problems.add(f"config_groups[{key!r}]: format {fmt!r}; supported: {', '.join(_CT_FORMATS)}")
        ok = False
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy", "tensor")
    if kind not in ("int", "float") or (kind == "float" and bits != 8) or (kind == "int" and bits not in (4, 8)):
        problems.add(f"config_groups[{key!r}]: {kind} weights of {bits} bits; supported: float 8 (fp8), int 4 and int 8")
        ok = False
    if strategy not in _CT_STRATEGIES:
        problems.add(f"config_groups[{key!r}]: weight strategy {strategy!r}; supported: {', '.join(_CT_STRATEGIES)}")
        ok = False
    if strategy == "group" and not _positive_int(weights.get("group_size")):
        problems.add(f"config_groups[{key!r}]: strategy 'group' needs a positive group_size, "
                     f"got {weights.get('group_size')!r}")
        ok = False
    block = weights.get("block_structure")
    if strategy == "block" and not (isinstance(block, Sequence) and len(block) == 2 and all(map(_positive_int, block))):
        problems.add(f"config_groups[{key!r}]: strategy 'block' needs block_structure [block_n, block_k], got {block!r}")
        ok = False
    if weights.get("actorder") not in (None, False, "static"):
        problems.add(f"config_groups[{key!r}]: activation ordering {weights.get('actorder')!r} (a g_idx per "
                     "column) is not read; quantize with actorder 'static' or none")
        ok = False
    if weights.get("dynamic", False):
        problems.add(f"config_groups[{key!r}]: dynamic weight scales cannot be stored in a checkpoint")
        ok = False
    if acts is not None:
        if not isinstance(acts, Mapping) or acts.get("strategy", "tensor") not in ("tensor", "token", "group"):
            problems.add(f"config_groups[{key!r}]: input_activations {acts!r}; supported: per tensor, per token "
                         "or per group")
            ok = False
        elif not acts.get("symmetric", True):
            problems.add(f"config_groups[{key!r}]: asymmetric activation quantization is not read")
            ok = False
    if not ok:
        return None
    return list(targets), weights, acts, fmt


def _read_compressed_tensors(ckpt: Checkpoint, quant: Mapping[str, Any], problems: _Problems):
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        problems.add("no config_groups")
        return {}, []
    ignored = list(quant.get("ignore") or [])
    parsed = [(key, g) for key, group in groups.items()
              if (g := _ct_group(key, group, problems, quant.get("format"))) is not None]
    layers = sorted({name.rsplit(".", 1)[0] for name in ckpt.shapes
                     if name.endswith((".weight", ".weight_packed"))})
    linears = {}
    for layer in layers:
        if _ignored(layer, ignored):
            continue
        match = [(key, g) for key, g in parsed if _ct_targets(layer, g[0], ckpt)]
        if not match:
            continue
        if len(match) > 1:
            problems.add(f"{layer}: matched by more than one config group ({', '.join(k for k, _ in match)})")
            continue
        key, (_, weights, acts, fmt) = match[0]
        q = _ct_layer(ckpt, problems, layer, weights, acts, fmt)
        if q is not None:
            linears[layer] = q
    return linears, ignored


def _ct_targets(layer: str, targets: Sequence[str], ckpt: Checkpoint) -> bool:
    """Whether a config group's targets take ``layer``: ``Linear`` (a 2-D weight, not an
    embedding's), or a ``re:`` pattern / exact name of the layer."""
    for target in targets:
        if target == "Linear":
            weight = ckpt.shapes.get(f"{layer}.weight") or ckpt.shapes.get(f"{layer}.weight_packed")
            if weight is not None and len(weight) == 2 and not layer.endswith(("embed_tokens", "embeddings")):
                return True
        elif target.startswith("re:"):
            if re.fullmatch(target[3:], layer):
                return True
        elif layer == target or layer.endswith("." + target):
            return True
    return False


def _ct_layer(ckpt, problems, layer, weights, acts, fmt) -> QuantizedLinear | None:
    bits, kind, strategy = weights["num_bits"], weights.get("type", "int"), weights.get("strategy", "tensor")
    symmetric = bool(weights.get("symmetric", True))
    group = weights.get("group_size") if strategy == "group" else None
    block = tuple(weights["block_structure"]) if strategy == "block" else None
    layout = "packed" if fmt == "pack-quantized" else "plain"
    if layout == "packed" and kind != "int":
        problems.add(f"{layer}: pack-quantized holds int weights, the config says {kind}")
        return None
    if layout == "plain" and bits != 8:
        problems.add(f"{layer}.weight: {fmt} stores 8-bit codes, the config says {bits} bits")
        return None
    scheme = _scheme(problems, layer, "fp8" if kind == "float" else f"int{bits}", strategy, group_size=group,
                     block=block, symmetric=symmetric, layout=layout)
    if scheme is None:
        return None
    if layout == "packed":
        codes, shape_name = f"{layer}.weight_packed", f"{layer}.weight_shape"
        if not (_expect(ckpt, problems, codes, ("I32",), None, "the packed int32 codes")
                and _expect(ckpt, problems, shape_name, ("I64", "I32"), (2,), "the weight's [out, in] shape")):
            return None
        n, k = (int(v) for v in ckpt.get(shape_name, "numpy"))
        if ckpt.shapes[codes] != scheme.codes_shape(n, k):
            problems.add(f"{codes}: shape {ckpt.shapes[codes]}, expected {scheme.codes_shape(n, k)} ({bits}-bit codes "
                         f"of a [{n}, {k}] weight packed into int32 along its rows)")
            return None
        tensors = {"codes": codes, "shape": shape_name}
    else:
        codes = f"{layer}.weight"
        want = _FLOAT8[:1] if kind == "float" else ("I8",)
        if not _expect(ckpt, problems, codes, want, None, f"{fmt}, {kind} {bits}-bit codes"):
            return None
        shape = _weight_shape(ckpt, problems, codes)
        if shape is None:
            return None
        n, k = shape
        tensors = {"codes": codes}
    scale = tensors["scale"] = f"{layer}.weight_scale"
    _expect(ckpt, problems, scale, _SCALE_DTYPES, scheme.scale_shape(n, k), f"{strategy} weight scales")
    if not symmetric:
        zp = tensors["zero_point"] = f"{layer}.weight_zero_point"
        _expect(ckpt, problems, zp, ("I8", "I32", *_SCALE_DTYPES), scheme.zero_point_shape(n, k),
                "zero points, one per scale" + (", packed into int32 along the first dim" if layout == "packed" else ""))
    activations = "none"
    if acts is not None:
        activations = "dynamic" if acts.get("dynamic", False) else "static"
        if activations == "static":
            tensors["input_scale"] = f"{layer}.input_scale"
            _expect(ckpt, problems, tensors["input_scale"], _SCALE_DTYPES, None, "the static activation scale",
                    numel=1)
    return QuantizedLinear(layer, "fp8" if kind == "float" else "int", bits, strategy, (n, k), tensors, layout=layout,
                           group_size=group, block=block, symmetric=symmetric, activations=activations)


# --- awq ------------------------------------------------------------------------------------------

def _read_awq(ckpt: Checkpoint, quant: Mapping[str, Any], problems: _Problems):
    bits, group, version = quant.get("bits", quant.get("w_bit")), quant.get("group_size", quant.get("q_group_size")), \
        str(quant.get("version", "gemm")).lower()
    ok = True
    if bits != 4:
        problems.add(f"bits {bits!r}: AWQ checkpoints are read with 4 bits")
        ok = False
    if not _positive_int(group):
        problems.add(f"group_size {group!r}: expected a positive int")
        ok = False
    if version != "gemm":
        problems.add(f"version {version!r}: only AWQ's 'gemm' layout is read")
        ok = False
    if not quant.get("zero_point", True):
        problems.add("zero_point false: AWQ's GEMM layout has zero points")
        ok = False
    ignored = list(quant.get("modules_to_not_convert") or [])
    linears = {}
    if not ok:
        return linears, ignored
    for name in ckpt.shapes:
        if not name.endswith(".qweight"):
            continue
        layer = name[: -len(".qweight")]
        if not _expect(ckpt, problems, name, ("I32",), None, "AWQ's packed codes"):
            continue
        qshape = ckpt.shapes[name]
        if len(qshape) != 2:
            problems.add(f"{name}: shape {qshape}, expected [in_features, out_features / 8]")
            continue
        k, n = qshape[0], qshape[1] * 8
        if k % group:
            problems.add(f"{name}: {k} input features do not split into groups of {group}")
            continue
        scheme = WeightQuant("int4", "group", group_size=group, symmetric=False, layout="awq")
        _expect(ckpt, problems, f"{layer}.qzeros", ("I32",), scheme.zero_point_shape(n, k), "AWQ's packed zero points")
        _expect(ckpt, problems, f"{layer}.scales", _SCALE_DTYPES, scheme.scale_shape(n, k), "AWQ's group scales")
        linears[layer] = QuantizedLinear(
            layer, "int", 4, "group", (n, k),
            {"codes": name, "zero_point": f"{layer}.qzeros", "scale": f"{layer}.scales"},
            layout="awq", group_size=group, symmetric=False)
    return linears, ignored
