"""``dualop check --fuzz``: a bounded, derandomised sweep of mutated op cases through each kernel
path, every path in its own watched subprocess, every result classified against forward_native.

What it draws. For each case of ``dualop.testing.cases_for()`` (an op's ``check_cases()``) it takes
the case's smallest non-empty shape and, per mutation family (``FAMILIES``), one draw (``--draws``
more): the inputs come from ``case.make_inputs`` and the mutation's choices (which input, which
element, which value) from the same generator, seeded by ``(seed, case label, family, index)``, so
a run repeats on every machine. Families: the case in each float dtype, an int array where a float
is expected and a float one where an int index is, one float input in another float dtype;
non-contiguous torch views with the same values (transposed storage, a strided view with sentinels
in its gaps, an int input as a column of an ``[n, 2]`` buffer); NaN, +inf or -inf planted in one
element or a whole row of one float input; a rank more or less, one dim one larger, the case at a
grown shape; int metadata at -1, at int max, past the end of every index space, just above its own
maximum, and a ``cu_seqlens``-like array that ends before or after its tokens; the same metadata
traced under ``jax.jit`` (the op cannot read it there); one argument of the other frontend; NaN,
inf, -1 or 0 for a numeric constructor argument or call option.

How it runs. Paths (``PATHS``): torch on the CPU (C++ kernels), jax on the CPU, Triton through its
interpreter (torch, platform cuda), Pallas in TPU interpret mode (jax, platform tpu), all with
``OpsConfig(["all"])``. Each path's items run in worker processes (``python -c`` ->
``_worker_main``) that report one JSON line per item; the parent kills a worker that exceeds the
case timeout, classifies the item it was on as ``crash`` (as it does when a worker dies: a
segfault, an abort), and starts a fresh worker at the next item. A worker retires itself (and a
fresh one continues) after ``process_timeout`` seconds.

How it classifies (``classify``), the kernel path's call against the reference (``check_inputs``
then ``forward_native`` under ``OpsConfig(["none"])``, on its own copy of the same inputs, under
the same ``jax.jit`` where the item is traced): ``refused`` (a ValueError/TypeError naming the op,
with every torch input byte-identical afterwards), ``correct`` (every output, and the final state
of every torch argument, equal to the reference's within ``dualop.testing``'s tolerance table, NaN
where it has NaN, infinities of its sign), and the failures ``crash``, ``unclear_error`` (any other
exception, or the reference's own unclear error where the kernel path returned), ``wrong``
(differs; or returns where the reference refuses) and ``nan_where_native_finite``. ``skipped``: the
path's frontend is not installed here (not a failure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from dualop import testing

__all__ = [
    "PATHS", "FAMILIES", "CLASSES", "FAILURES", "FuzzItem", "FuzzResult", "Mutation", "Outcome",
    "plan", "draw", "make_mutation", "run_item", "run_one", "classify", "run_fuzz", "format_report",
    "summary",
]

# name -> (frontend, platform): the paths a sweep runs, each in its own processes.
PATHS: dict[str, tuple[str, str]] = {
    "torch-cpu": ("torch", "cpu"),
    "jax-cpu": ("jax", "cpu"),
    "triton": ("torch", "cuda"),
    "pallas": ("jax", "tpu"),
}
CLASSES = ("correct", "refused", "crash", "unclear_error", "wrong", "nan_where_native_finite", "skipped")
FAILURES = ("crash", "unclear_error", "wrong", "nan_where_native_finite")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
BOTH, TORCH, JAX = ("torch", "jax"), ("torch",), ("jax",)

# Mutation families: name -> the frontends it applies to (layouts are torch views; tracing is jax's).
FAMILIES: dict[str, tuple[str, ...]] = {
    "dtype.float32": BOTH, "dtype.bfloat16": BOTH, "dtype.float16": BOTH,
    "dtype.int_for_float": BOTH, "dtype.float_for_int": BOTH, "dtype.mixed_float": BOTH,
    "layout.transposed": TORCH, "layout.strided": TORCH, "layout.meta_column": TORCH,
    "nonfinite.nan": BOTH, "nonfinite.posinf": BOTH, "nonfinite.neginf": BOTH,
    "nonfinite.nan_row": BOTH, "nonfinite.neginf_row": BOTH,
    "shape.rank_up": BOTH, "shape.rank_down": BOTH, "shape.dim_plus_one": BOTH, "shape.resize": BOTH,
    "meta.neg1": BOTH, "meta.huge": BOTH, "meta.past_end": BOTH, "meta.above_max": BOTH,
    "meta.cu_short": BOTH, "meta.cu_long": BOTH,
    "jit.plain": JAX, "jit.neg1": JAX, "jit.huge": JAX, "jit.past_end": JAX, "jit.cu_long": JAX,
    "mix.frontend": BOTH,
    "ctor": BOTH, "option": BOTH,
}
# Draws per family per case (times ``draws``); the rest draw once.
FAMILY_DRAWS = {"ctor": 3}
# (op, family) -> where the op documents that its kernel paths accept what forward_native refuses.
ACCEPTS_WHAT_NATIVE_REFUSES: dict[tuple[str, str], str] = {}
# Finite sentinel written into the gaps of a strided float view (a kernel that ignores the strides
# reads it); ints get 7, as a column of ``torch.stack([m, m * 0 + 7], 1)`` does.
GAP_FLOAT, GAP_INT = 1000.0, 7

# Appended to a refusal's detail when forward_native accepts the same input.
ACCEPTED_NOTE = " [forward_native accepts this input]"

CASE_TIMEOUT = 180.0
PROCESS_TIMEOUT = 900.0
STARTUP_TIMEOUT = 300.0


# --- mutations ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One array argument of a mutated call: its values and how to hand them to the op."""

    values: np.ndarray  # float32 for float inputs, int64 for int ones, bool
    dtype: str  # the dtype it is given in
    layout: str = ""  # torch only: "transposed", "strided:<dim>", "column"
    other_frontend: bool = False  # given as the other frontend's array (jax <-> torch)

    @property
    def kind(self) -> str:
        return "float" if self.dtype in FLOAT_DTYPES else ("bool" if self.dtype == "bool" else "int")


@dataclasses.dataclass
class Mutation:
    """A case with one mutation applied: what the worker calls, on kernel path and reference alike."""

    label: str
    family: str
    index: int
    what: str  # one line: what was changed
    shape: tuple[int, ...]
    args: list  # Spec | None | a Python scalar, positional
    options: dict[str, Any]
    dtype: str  # the case's dtype: the tolerance row of outputs whose own dtype has none
    ctor: dict[str, Any] | None = None  # constructor arguments replaced
    jit: bool = False
    frontends: tuple[str, ...] = BOTH
    widened: bool = False  # compare with testing.compare(widened_nonfinite=True)


@dataclasses.dataclass(frozen=True)
class FuzzItem:
    """One (case, family, draw index): regenerated from these in any process."""

    op: str
    label: str
    family: str
    index: int
    what: str


def _derive(*parts: Any) -> int:
    """A 64-bit seed from the parts' text: the same on every machine and Python."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


def base_shape(case: testing.OpCase) -> tuple[int, ...]:
    """The case's smallest shape with no zero dim (its first shape if all have one)."""
    full = [s for s in case.shapes if all(d > 0 for d in s)]
    return min(full, key=lambda s: (math.prod(s), case.shapes.index(s))) if full else case.shapes[0]


def _spec(a: Any, dtype: str) -> Any:
    if isinstance(a, testing.Pinned):
        values = np.asarray(a.array)
        if a.dtype in FLOAT_DTYPES:
            values = values.astype(np.float32)
        elif a.dtype != "bool":
            values = values.astype(np.int64)
        return Spec(values, a.dtype)
    if isinstance(a, np.ndarray):
        return Spec(a.astype(np.float32), dtype)
    return a


def _param_names(op: Any) -> list[str]:
    try:
        return list(inspect.signature(type(op).forward_native).parameters)[1:]
    except (TypeError, ValueError):
        return []


class _Ctx:
    """What a family's generator sees: the case, its inputs as Specs, its op, a generator."""

    def __init__(self, case: testing.OpCase, family: str, index: int, seed: int) -> None:
        self.case, self.family, self.index, self.seed = case, family, index, seed
        self.rng = np.random.default_rng(_derive(seed, case.label, family, index))
        self.shape = base_shape(case)
        self.op = case.make_op(self.shape)
        self.names = _param_names(self.op)
        raw = case.make_inputs(self.shape, self.rng)
        self.pinned = [isinstance(a, testing.Pinned) for a in raw]
        self.args = [_spec(a, "float32") for a in raw]

    def name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"arg{i}"

    def where(self, kinds: Iterable[str], min_size: int = 1, min_ndim: int = 0) -> list[int]:
        return [i for i, a in enumerate(self.args) if isinstance(a, Spec) and a.kind in kinds
                and a.values.size >= min_size and a.values.ndim >= min_ndim]

    def pick(self, positions: list[int]) -> int | None:
        return positions[int(self.rng.integers(len(positions)))] if positions else None

    def mutation(self, what: str, **kw: Any) -> Mutation:
        fields = dict(label=self.case.label, family=self.family, index=self.index, what=what, shape=self.shape,
                      args=self.args, options=dict(self.case.options), dtype="float32",
                      frontends=FAMILIES[self.family])
        fields.update(kw)
        return Mutation(**fields)

    def replace(self, i: int, spec: Any) -> list:
        args = list(self.args)
        args[i] = spec
        return args

    def element(self, values: np.ndarray) -> tuple[int, ...]:
        return tuple(int(self.rng.integers(d)) for d in values.shape)


def _fmt_index(idx: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, idx)) + "]"


def _with_dtype(ctx: _Ctx, dtype: str) -> Mutation:
    args = [dataclasses.replace(a, dtype=dtype) if isinstance(a, Spec) and a.kind == "float"
            and not ctx.pinned[i] else a for i, a in enumerate(ctx.args)]
    return ctx.mutation(f"the case in {dtype}", args=args, dtype=dtype)


def _fam_dtype(ctx: _Ctx) -> Mutation | None:
    fam = ctx.family
    if fam in ("dtype.float32", "dtype.bfloat16", "dtype.float16"):
        return _with_dtype(ctx, fam.split(".")[1])
    if fam == "dtype.int_for_float":
        i = ctx.pick(ctx.where(["float"], min_size=0))
        if i is None:
            return None
        a = ctx.args[i]
        values = np.nan_to_num(np.round(a.values * 3)).astype(np.int64)
        return ctx.mutation(f"'{ctx.name(i)}' as int32 (it is {a.dtype})",
                            args=ctx.replace(i, Spec(values, "int32")))
    if fam == "dtype.float_for_int":
        i = ctx.pick(ctx.where(["int", "bool"], min_size=0))
        if i is None:
            return None
        a = ctx.args[i]
        return ctx.mutation(f"'{ctx.name(i)}' as float32 (it is {a.dtype})",
                            args=ctx.replace(i, Spec(a.values.astype(np.float32), "float32")))
    if fam == "dtype.mixed_float":
        i = ctx.pick(ctx.where(["float"], min_size=0))
        if i is None:
            return None
        a = ctx.args[i]
        others = [d for d in FLOAT_DTYPES if d != a.dtype]
        dtype = others[int(ctx.rng.integers(len(others)))]
        return ctx.mutation(f"'{ctx.name(i)}' alone in {dtype}",
                            args=ctx.replace(i, dataclasses.replace(a, dtype=dtype)))
    raise AssertionError(fam)


def _fam_layout(ctx: _Ctx) -> Mutation | None:
    fam = ctx.family
    if fam == "layout.transposed":
        i = ctx.pick([j for j in ctx.where(["float"], min_ndim=2) if min(ctx.args[j].values.shape[-2:]) > 1])
        if i is None:
            return None
        return ctx.mutation(f"'{ctx.name(i)}' as a view of transposed storage",
                            args=ctx.replace(i, dataclasses.replace(ctx.args[i], layout="transposed")))
    if fam == "layout.strided":
        i = ctx.pick([j for j in ctx.where(["float"], min_ndim=1) if max(ctx.args[j].values.shape) > 1])
        if i is None:
            return None
        dims = [d for d, n in enumerate(ctx.args[i].values.shape) if n > 1]
        dim = dims[int(ctx.rng.integers(len(dims)))]
        return ctx.mutation(f"'{ctx.name(i)}' as a view with stride 2 in dim {dim}",
                            args=ctx.replace(i, dataclasses.replace(ctx.args[i], layout=f"strided:{dim}")))
    if fam == "layout.meta_column":
        i = ctx.pick(ctx.where(["int", "bool"], min_size=2))  # a single entry's view is contiguous
        if i is None:
            return None
        return ctx.mutation(f"'{ctx.name(i)}' as column 0 of an [n, 2] buffer",
                            args=ctx.replace(i, dataclasses.replace(ctx.args[i], layout="column")))
    raise AssertionError(fam)


_SPECIALS = {"nan": np.nan, "posinf": np.inf, "neginf": -np.inf}


def _fam_nonfinite(ctx: _Ctx) -> Mutation | None:
    kind = ctx.family.split(".")[1]
    row = kind.endswith("_row")
    value = _SPECIALS[kind.removesuffix("_row")]
    i = ctx.pick(ctx.where(["float"]))
    if i is None:
        return None
    a = ctx.args[i]
    values = a.values.copy()
    if row:
        lead = tuple(int(ctx.rng.integers(d)) for d in values.shape[:-1])
        values[lead] = value
        where = f"row {_fmt_index(lead)}" if lead else "every element"
    else:
        idx = ctx.element(values)
        values[idx] = value
        where = f"element {_fmt_index(idx)}"
    return ctx.mutation(f"{value} in {where} of '{ctx.name(i)}'",
                        args=ctx.replace(i, dataclasses.replace(a, values=values)),
                        widened="widens_nonfinite" in ctx.case.traits)


def _fam_shape(ctx: _Ctx) -> Mutation | None:
    fam = ctx.family
    if fam == "shape.resize":
        dims = list(range(len(ctx.shape)))
        start = int(ctx.rng.integers(len(dims))) if dims else 0
        for d in dims[start:] + dims[:start]:
            shape = tuple(n + 1 if k == d else n for k, n in enumerate(ctx.shape))
            rng = np.random.default_rng(_derive(ctx.seed, ctx.case.label, ctx.family, ctx.index, shape))
            try:
                ctx.case.make_op(shape)
                raw = ctx.case.make_inputs(shape, rng)
            except Exception:  # the case's generator does not build this shape: try the next dim
                continue
            return ctx.mutation(f"the case at shape {shape}", shape=shape, args=[_spec(a, "float32") for a in raw])
        return None
    i = ctx.pick(ctx.where(["float", "int", "bool"], min_size=0, min_ndim=1 if fam == "shape.rank_down" else 0))
    if i is None:
        return None
    a = ctx.args[i]
    if fam == "shape.rank_up":
        return ctx.mutation(f"'{ctx.name(i)}' with a leading dim of 1 ({a.values.shape} -> {(1, *a.values.shape)})",
                            args=ctx.replace(i, dataclasses.replace(a, values=a.values[None])))
    if fam == "shape.rank_down":
        if a.values.shape[0] == 0:
            return None
        return ctx.mutation(f"'{ctx.name(i)}' without its leading dim ({a.values.shape} -> {a.values.shape[1:]})",
                            args=ctx.replace(i, dataclasses.replace(a, values=a.values[0])))
    if fam == "shape.dim_plus_one":
        if a.values.ndim == 0:
            return None
        d = int(ctx.rng.integers(a.values.ndim))
        pad = [(0, 1 if k == d else 0) for k in range(a.values.ndim)]
        fill = float(ctx.rng.standard_normal()) if a.kind == "float" else 0
        values = np.pad(a.values, pad, constant_values=fill)
        return ctx.mutation(f"'{ctx.name(i)}' one larger in dim {d} ({a.values.shape} -> {values.shape})",
                            args=ctx.replace(i, dataclasses.replace(a, values=values)))
    raise AssertionError(fam)


def _cu_like(a: Spec) -> bool:
    """A ``cu_seqlens``-like array: 1-D int, starts at 0, non-decreasing, at least two entries."""
    v = a.values
    return a.kind == "int" and v.ndim == 1 and v.size >= 2 and v[0] == 0 and bool(np.all(np.diff(v) >= 0))


def _fam_meta(ctx: _Ctx) -> Mutation | None:
    kind = ctx.family.split(".")[1]
    jit = ctx.family.startswith("jit.")
    tag = " (traced under jax.jit)" if jit else ""
    if kind == "plain":
        return ctx.mutation("the case under jax.jit, every array a traced argument", jit=True)
    if kind in ("cu_short", "cu_long"):
        i = ctx.pick([j for j in ctx.where(["int"]) if _cu_like(ctx.args[j])])
        if i is None:
            return None
        a = ctx.args[i]
        values = a.values.copy()
        values[-1] += -1 if kind == "cu_short" else 1
        return ctx.mutation(f"'{ctx.name(i)}' ends at {values[-1]}, not {a.values[-1]}{tag}",
                            args=ctx.replace(i, dataclasses.replace(a, values=values)), jit=jit)
    i = ctx.pick(ctx.where(["int"]))
    if i is None:
        return None
    a = ctx.args[i]
    values = a.values.copy()
    idx = ctx.element(values)
    biggest = max((s.values.size for s in ctx.args if isinstance(s, Spec) and s.kind == "float"), default=0)
    new = {
        "neg1": -1,
        "huge": np.iinfo(np.int32 if a.dtype == "int32" else np.int64).max,
        "past_end": max(biggest, int(values.max()) + 1),  # past every index space of the float inputs
        "above_max": int(values.max()) + 1,  # never equal to another entry: no new duplicate
    }[kind]
    values[idx] = new
    return ctx.mutation(f"{new} at {_fmt_index(idx)} of '{ctx.name(i)}'{tag}",
                        args=ctx.replace(i, dataclasses.replace(a, values=values)), jit=jit)


def _fam_mix(ctx: _Ctx) -> Mutation | None:
    arrays = ctx.where(["float", "int", "bool"], min_size=0)
    if len(arrays) < 2:  # one array of the other frontend is just a call from that frontend
        return None
    i = ctx.pick(arrays)
    return ctx.mutation(f"'{ctx.name(i)}' as an array of the other frontend",
                        args=ctx.replace(i, dataclasses.replace(ctx.args[i], other_frontend=True)))


def _numeric_candidates(pairs: Iterable[tuple[str, Any, Any]]) -> list[tuple[str, Any]]:
    """(name, new value) for every numeric argument: NaN, inf, -1 and 0 (ints get -1 and 0 as ints)."""
    out = []
    for name, value, annotation in pairs:
        numeric = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
        hinted = value is None and re.search(r"\b(float|int)\b", str(annotation or ""))
        if not (numeric or hinted):
            continue
        as_int = isinstance(value, (int, np.integer)) or (value is None and "float" not in str(annotation))
        out += [(name, math.nan), (name, math.inf), (name, -1 if as_int else -1.0), (name, 0 if as_int else 0.0)]
    return out


def _ctor_arguments(op: Any) -> tuple[type, inspect.BoundArguments] | None:
    """The op's class and its constructor call bound to ``__init__`` (from its ``ctor_spec``)."""
    spec = getattr(op, "_ctor", None)
    if spec is None:
        return None
    from dualop import ctor_spec

    _, args, kwargs = json.loads(spec)
    cls = type(op)
    args = ctor_spec._decode_value(args)
    kwargs = {k: ctor_spec._decode_value(v) for k, v in kwargs.items()}
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return cls, bound


def _fam_ctor(ctx: _Ctx) -> Mutation | None:
    found = _ctor_arguments(ctx.op)
    if found is None:
        return None
    cls, bound = found
    params = inspect.signature(cls.__init__).parameters
    pairs = [(n, v, params[n].annotation) for n, v in list(bound.arguments.items())[1:]
             if n != "enforce_enable" and params[n].kind not in (params[n].VAR_POSITIONAL, params[n].VAR_KEYWORD)]
    cands = _numeric_candidates(pairs)
    order = np.random.default_rng(_derive(ctx.seed, ctx.case.label, ctx.family, "order")).permutation(len(cands))
    if ctx.index >= len(cands):
        return None
    name, value = cands[order[ctx.index]]
    return ctx.mutation(f"constructor argument {name}={value!r}", ctor={name: value})


def _fam_option(ctx: _Ctx) -> Mutation | None:
    cands = _numeric_candidates((n, v, None) for n, v in ctx.case.options.items())
    if not cands:
        return None
    order = np.random.default_rng(_derive(ctx.seed, ctx.case.label, ctx.family, "order")).permutation(len(cands))
    if ctx.index >= len(cands):
        return None
    name, value = cands[order[ctx.index]]
    return ctx.mutation(f"call option {name}={value!r}", options={**ctx.case.options, name: value})


_GENERATORS: dict[str, Callable[[_Ctx], Mutation | None]] = {}
for _f in FAMILIES:
    _GENERATORS[_f] = {"dtype": _fam_dtype, "layout": _fam_layout, "nonfinite": _fam_nonfinite, "shape": _fam_shape,
                       "meta": _fam_meta, "jit": _fam_meta, "mix": _fam_mix, "ctor": _fam_ctor,
                       "option": _fam_option}[_f.split(".")[0]]


def make_mutation(case: testing.OpCase, family: str, index: int, seed: int = 0) -> Mutation | None:
    """The mutation ``(case, family, index)`` draws under ``seed``, or None where the family does
    not apply to the case (no int input for a metadata family, ...)."""
    if family not in FAMILIES:
        raise ValueError(f"dualop check --fuzz: unknown mutation family {family!r}; expected one of {list(FAMILIES)}")
    ctx = _Ctx(case, family, index, seed)
    return _GENERATORS[family](ctx)


def plan(cases: list[testing.OpCase], seed: int = 0, draws: int = 1,
         paths: Iterable[str] = PATHS) -> dict[str, list[FuzzItem]]:
    """Every applicable item per path, in case order (the whole sweep)."""
    per_path: dict[str, list[FuzzItem]] = {p: [] for p in paths}
    for case in cases:
        for family, frontends in FAMILIES.items():
            for index in range(FAMILY_DRAWS.get(family, 1) * draws):
                m = make_mutation(case, family, index, seed)
                if m is None:
                    continue
                item = FuzzItem(case.op, case.label, family, index, m.what)
                for p in per_path:
                    if PATHS[p][0] in frontends:
                        per_path[p].append(item)
    return per_path


def draw(items: list[FuzzItem], budget: int | None, seed: int = 0) -> list[FuzzItem]:
    """``budget`` items spread evenly over ops (round robin in registry order), each op's own taken
    one family at a time in a seeded order; kept in sweep order. None: every item."""
    if budget is None or budget >= len(items):
        return list(items)
    by_op: dict[str, list[FuzzItem]] = {}
    for it in items:
        by_op.setdefault(it.op, []).append(it)
    queues = []
    for op, its in by_op.items():
        order = np.random.default_rng(_derive(seed, "draw", op)).permutation(len(its))
        seen: dict[str, int] = {}
        ranked = []
        for k in order:
            fam = its[k].family
            ranked.append((seen.get(fam, 0), len(ranked), its[k]))
            seen[fam] = seen.get(fam, 0) + 1
        queues.append([it for *_, it in sorted(ranked, key=lambda r: r[:2])])
    chosen: set[FuzzItem] = set()
    while len(chosen) < budget:
        for q in queues:
            if q and len(chosen) < budget:
                chosen.add(q.pop(0))
    return [it for it in items if it in chosen]


# --- running one item -----------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """What one call did: its error, or its outputs and the final state of its torch arguments."""

    error: BaseException | None = None
    outputs: list | None = None  # flattened: None, (numpy float32, dtype name), or a plain value
    states: dict[str, tuple[np.ndarray, str]] = dataclasses.field(default_factory=dict)
    changed: list[str] = dataclasses.field(default_factory=list)  # torch args changed by a refused call
    method: str = ""


@dataclasses.dataclass
class FuzzResult:
    op: str
    case: str
    family: str
    index: int
    mutation: str
    path: str
    cls: str
    detail: str = ""
    method: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _other(frontend: str) -> str:
    return "jax" if frontend == "torch" else "torch"


def _relayout(t: Any, layout: str) -> Any:
    """The same values as a non-contiguous torch view (see ``Spec.layout``)."""
    import torch

    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "column":
        return torch.stack([t, torch.full_like(t, GAP_INT)], -1)[..., 0]
    if layout.startswith("strided:"):
        dim = int(layout.split(":")[1])
        shape = list(t.shape)
        shape[dim] *= 2
        buf = torch.full(shape, GAP_FLOAT if t.is_floating_point() else GAP_INT, dtype=t.dtype)
        index = [slice(None)] * t.ndim
        index[dim] = slice(0, None, 2)
        buf[tuple(index)] = t
        return buf[tuple(index)]
    raise ValueError(layout)


def materialize(m: Mutation, frontend: str) -> list:
    """The call's positional arguments as ``frontend``'s arrays (fresh copies on every call)."""
    out = []
    for a in m.args:
        if not isinstance(a, Spec):
            out.append(a)
            continue
        fe = _other(frontend) if a.other_frontend else frontend
        x = testing.to_frontend(testing.Pinned(a.values, a.dtype), fe, a.dtype)
        if a.layout and fe == "torch":
            x = _relayout(x, a.layout)
        out.append(x)
    return out


def _flatten(x: Any) -> list:
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in _flatten(item)]
    return [x]


def _is_array(x: Any) -> bool:
    from dualop.platforms import frontend_of

    return x is not None and frontend_of(x) is not None


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _capture(values: list) -> list:
    out = []
    for v in values:
        if _is_array(v):
            out.append((testing.to_numpy(v), _dtype_name(v)))
        else:
            out.append(v)
    return out


def _torch_bytes(args: list, names: list[str]) -> dict[str, Any]:
    import torch

    snap = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            copy = torch.empty(a.shape, dtype=a.dtype)  # fresh strides: a size-1 view may keep stride 2
            copy.copy_(a.detach().cpu())
            snap[names[i] if i < len(names) else f"arg{i}"] = copy.reshape(-1).view(torch.uint8)
    return snap


def _torch_states(args: list, names: list[str]) -> dict[str, tuple[np.ndarray, str]]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    return {(names[i] if i < len(names) else f"arg{i}"): (testing.to_numpy(a), _dtype_name(a))
            for i, a in enumerate(args) if isinstance(a, torch.Tensor)}


# Jitted calls by what is static in them (the case, its shapes and dtypes, options, constructor,
# path, kernel or reference): the traced-metadata items of a case differ only in values, so they
# share one compiled program instead of compiling the interpreted kernels once each.
_JITTED: dict[tuple, Callable] = {}


def _call(fn: Callable, args: list, options: dict, jit: bool, key: tuple = ()) -> Any:
    """``fn(*args, **options)``, or under ``jax.jit`` with every jax array a traced argument."""
    if not jit:
        return fn(*args, **options)
    import jax

    where = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
    static = tuple((tuple(a.shape), str(a.dtype)) if i in where else repr(a) for i, a in enumerate(args))
    full_key = (*key, static, repr(sorted(options.items())))
    jitted = _JITTED.get(full_key) if key else None
    if jitted is None:
        def traced(*arrays):
            full = list(args)
            for i, a in zip(where, arrays):
                full[i] = a
            return fn(*full, **options)

        jitted = jax.jit(traced)
        if key:
            if len(_JITTED) >= 64:
                _JITTED.pop(next(iter(_JITTED)))
            _JITTED[full_key] = jitted
    return jax.block_until_ready(jitted(*[args[i] for i in where]))


def _build_op(case: testing.OpCase, m: Mutation) -> Any:
    op = case.make_op(m.shape)
    if m.ctor:
        cls, bound = _ctor_arguments(op)
        for name, value in m.ctor.items():
            bound.arguments[name] = value
        op = cls(*bound.args[1:], **bound.kwargs)
    return op


def _outcome(run: Callable[[Any, list], Any], case: testing.OpCase, m: Mutation, frontend: str,
             platform: str, config: str) -> Outcome:
    """Build the op and the inputs, call ``run(op, args)`` under the path's platform and ``config``."""
    from dualop.config import OpsConfig, set_config
    from dualop.platforms import override_platform

    res = Outcome()
    try:
        op = _build_op(case, m)
    except Exception as err:  # the constructor refused (or failed on) the mutated argument
        res.error = err
        return res
    names = _param_names(op)
    args = materialize(m, frontend)
    before = _torch_bytes(args, names) if "torch" in sys.modules else {}
    try:
        with override_platform(platform), set_config(OpsConfig([config])), testing.frontend_context(frontend):
            op.last_fallback = None
            out = run(op, args)
            res.outputs = _capture(_flatten(out))
            if config == "all":
                res.method = op.last_run(frontend, platform)[0]
    except Exception as err:
        res.error = err
        _reset_pallas_interpreter()
        after = _torch_bytes(args, names) if before else {}
        import torch

        res.changed = [n for n, b in before.items() if not torch.equal(b, after[n])] if before else []
        return res
    res.states = _torch_states(args, names)
    return res


def _reset_pallas_interpreter() -> None:
    from dualop.check import _reset_pallas_interpreter as reset

    reset()


def run_item(case: testing.OpCase, m: Mutation, path: str) -> FuzzResult:
    """Run one mutated case on one path, in this process: the kernel path, then the reference."""
    frontend, platform = PATHS[path]
    start = time.perf_counter()
    key = (case.label, m.shape, repr(m.ctor), path)
    kernel = _outcome(lambda op, args: _call(op, args, m.options, m.jit, (*key, "kernel")), case, m, frontend,
                      platform, "all")

    def reference(op, args):
        def native(*a, **kw):
            op.check_inputs(*a, **kw)
            return op.forward_native(*a, **kw)
        return _call(native, args, m.options, m.jit, (*key, "reference"))

    native = _outcome(reference, case, m, frontend, platform, "none")
    # the names an error may call the op by: registered, the class's, the case's (a variant such as
    # merged_column_parallel_linear speaks for itself under column_parallel_linear)
    names = {case.op, getattr(type(_safe_op(case, m)), "name", None), case.label.partition("[")[0]}
    cls, detail = classify(kernel, native, names, m.dtype, widened=m.widened,
                           accepted=ACCEPTS_WHAT_NATIVE_REFUSES.get((case.op, m.family)))
    return FuzzResult(case.op, case.label, m.family, m.index, m.what, path, cls, detail, kernel.method,
                      time.perf_counter() - start)


def _safe_op(case: testing.OpCase, m: Mutation) -> Any:
    try:
        return case.make_op(m.shape)
    except Exception:
        return None


# --- classifying ----------------------------------------------------------------------------


def _one_line(text: str, limit: int = 220) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(err: BaseException) -> str:
    return _one_line(f"{type(err).__name__}: {err}")


def names_the_op(err: BaseException, names: Iterable[str]) -> bool:
    """A clear refusal: a ValueError or TypeError whose message names the op."""
    if not isinstance(err, (ValueError, TypeError)):
        return False
    text = str(err)
    return any(n and re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", text) for n in names)


def _first_bad(bad: np.ndarray) -> str:
    idx = np.argwhere(bad)
    return _fmt_index(tuple(int(v) for v in idx[0])) if idx.size else "?"


def _compare(name: str, got: Any, want: Any, dtype: str, widened: bool) -> tuple[str, str] | None:
    """None if ``got`` matches ``want``, else (class, detail)."""
    if (got is None) != (want is None):
        return "wrong", f"{name} is None in only one of the kernel path and forward_native"
    if got is None:
        return None
    if not isinstance(got, tuple) or not isinstance(want, tuple):
        if isinstance(got, tuple) or isinstance(want, tuple):
            return "wrong", f"{name}: an array in only one of the kernel path and forward_native"
        return None if got == want or (got != got and want != want) else ("wrong", f"{name}: {got!r} != {want!r}")
    (g, gd), (w, wd) = got, want
    if gd != wd:
        return "wrong", f"{name} has dtype {gd}; forward_native gives {wd}"
    if g.shape != w.shape:
        return "wrong", f"{name} has shape {g.shape}; forward_native gives {w.shape}"
    key = wd if wd in testing.TOLERANCES else dtype
    cmp = testing.compare(g, w, key, widened_nonfinite=widened)
    if cmp.ok:
        return None
    nan_bad = np.isnan(g) & np.isfinite(w)
    if nan_bad.any() and not widened:
        return "nan_where_native_finite", (f"{name}: NaN at {int(nan_bad.sum())} of {g.size} elements where "
                                           f"forward_native is finite (first {_first_bad(nan_bad)})")
    tol = testing.TOLERANCES[key]
    with np.errstate(invalid="ignore", over="ignore"):
        close = ((g == w) | (np.isnan(g) & np.isnan(w))
                 | (np.isfinite(w) & (np.abs(g - w) <= tol.atol + tol.rtol * np.abs(w))))
    if widened:
        close |= ~np.isfinite(w) & ~np.isfinite(g)
    bad = ~close
    first = tuple(int(v) for v in np.argwhere(bad)[0]) if bad.any() else None
    at = f"; first at {_fmt_index(first)}: {float(g[first]):.6g} vs {float(w[first]):.6g}" if first is not None else ""
    return "wrong", (f"{name}: {cmp.detail or 'outside tolerance'} ({int(bad.sum())} of {g.size} elements, "
                     f"{key} tolerance){at}")


def classify(kernel: Outcome, native: Outcome, names: Iterable[str], dtype: str = "float32", *,
             widened: bool = False, accepted: str | None = None) -> tuple[str, str]:
    """(class, one line of detail) of a kernel-path call against the reference's on the same inputs."""
    names = set(names)
    with np.errstate(all="ignore"):
        return _classify(kernel, native, names, dtype, widened, accepted)


def _classify(kernel: Outcome, native: Outcome, names: set, dtype: str, widened: bool,
              accepted: str | None) -> tuple[str, str]:
    if kernel.error is not None:
        if not names_the_op(kernel.error, names):
            return "unclear_error", _describe(kernel.error)
        if kernel.changed:
            return "wrong", f"refused ({_describe(kernel.error)}) but changed {', '.join(kernel.changed)} in place"
        note = "" if native.error is not None else ACCEPTED_NOTE
        return "refused", _describe(kernel.error) + note
    if native.error is not None:
        if names_the_op(native.error, names):
            if accepted:
                return "correct", f"accepted as documented ({accepted})"
            return "wrong", f"returned a result where forward_native refuses: {_describe(native.error)}"
        return "unclear_error", f"forward_native raised {_describe(native.error)} (the kernel path returned)"
    got, want = kernel.outputs or [], native.outputs or []
    if len(got) != len(want):
        return "wrong", f"{len(got)} outputs; forward_native gives {len(want)}"
    failures = []
    for k, (g, w) in enumerate(zip(got, want)):
        bad = _compare(f"output {k}", g, w, dtype, widened)
        if bad:
            failures.append(bad)
    for name, g in kernel.states.items():
        w = native.states.get(name)
        if w is not None:
            bad = _compare(f"argument '{name}' after the call", g, w, dtype, widened)
            if bad:
                failures.append(bad)
    if not failures:
        return "correct", ""
    nan = [f for f in failures if f[0] == "nan_where_native_finite"]
    return nan[0] if nan else failures[0]


# --- the worker -----------------------------------------------------------------------------


def _load_provider(spec: str | None) -> Callable[[], list[testing.OpCase]]:
    """``module:function`` or ``path/to/file.py:function`` returning OpCases; None: every op's."""
    if not spec:
        return lambda: list(testing.cases_for(None))
    target, _, fn = spec.rpartition(":")
    if target.endswith(".py"):
        import importlib.util

        mod_spec = importlib.util.spec_from_file_location(f"_dualop_fuzz_cases_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        import importlib

        module = importlib.import_module(target)
    return getattr(module, fn)


def prepare_environment() -> None:
    """What a worker sets before torch or jax is imported: Triton's interpreter without a GPU,
    torch_xla's CPU client, no TPU runtime search, and XLA's CPU backend at optimisation level 0
    (kernel paths and references compile under the same flags; most of the sweep's time is XLA
    compiling interpreted kernels, and LLVM's passes are most of that)."""
    import shutil

    if "TRITON_INTERPRET" not in os.environ and not (shutil.which("nvidia-smi") or shutil.which("rocm-smi")):
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from dualop.platforms import keep_tpu_runtimes_off_without_tpu

    keep_tpu_runtimes_off_without_tpu()
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


def _import_frontends() -> None:
    """torch and jax both (an item may hand the op one array of the other frontend); jax's CPU
    dispatch synchronous, as the TPU interpreter's host callbacks need (see kernels/pallas/common)."""
    testing.prepare_triton()
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401
    with contextlib.suppress(ImportError):
        import jax

        jax.config.update("jax_cpu_enable_async_dispatch", False)


def _worker_main(argv: list[str] | None = None) -> int:
    """A worker: run ``items[start:]`` of one path, one JSON line per event on the protocol fd."""
    import argparse
    import faulthandler

    p = argparse.ArgumentParser()
    p.add_argument("--path", required=True)
    p.add_argument("--items", required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--provider")
    p.add_argument("--process-timeout", type=float, default=PROCESS_TIMEOUT)
    args = p.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the ops or libraries print goes to stderr, not into the protocol
    faulthandler.enable()
    prepare_environment()
    _import_frontends()
    if PATHS[args.path] == ("torch", "cpu"):  # build the C++ kernels now (minutes, once per source hash), not in a case
        with contextlib.suppress(Exception):
            from dualop.kernels.cpu import load

            load()

    def send(**msg: Any) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    with open(args.items) as fh:
        items = json.load(fh)
    cases = {c.label: c for c in _load_provider(args.provider)()}
    born = time.monotonic()
    send(ready=True)
    for n in range(args.start, len(items)):
        label, family, index = items[n]
        send(start=n)
        case = cases[label]
        try:
            m = make_mutation(case, family, index, args.seed)
            result = run_item(case, m, args.path) if m is not None else None
        except Exception as err:  # the harness itself failed on this item: say so, never hide it
            result = FuzzResult(case.op, label, family, index, "", args.path, "unclear_error",
                                f"fuzz harness: {_describe(err)}")
        if result is None:
            result = FuzzResult(case.op, label, family, index, "", args.path, "skipped", "the family does not apply")
        send(result=n, **result.as_dict())
        testing.release_compiled_code_near_map_limit()
        if time.monotonic() - born > args.process_timeout and n + 1 < len(items):
            send(retire=n + 1)
            return 0
    send(done=True)
    return 0


# --- the parent -----------------------------------------------------------------------------


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _stderr_tail(path: str) -> str:
    """The last informative line a dead worker wrote (faulthandler's innermost frame, or its error)."""
    try:
        with open(path, errors="replace") as fh:
            lines = [line.strip() for line in fh.read().splitlines()[-60:] if line.strip()]
    except OSError:
        return ""
    frames = [line for line in lines if line.startswith("File ")]
    fatal = [line for line in lines if line.startswith("Fatal Python error")]
    parts = fatal[-1:] + frames[:1] if (fatal or frames) else lines[-1:]
    return _one_line("; ".join(parts), 200)


def _spawn(path: str, items_file: str, start: int, seed: int, provider: str | None, process_timeout: float,
           stderr_file: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "import sys; from dualop.fuzz import _worker_main; sys.exit(_worker_main())",
           "--path", path, "--items", items_file, "--start", str(start), "--seed", str(seed),
           "--process-timeout", str(process_timeout)]
    if provider:
        cmd += ["--provider", provider]
    err = open(stderr_file, "w")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    finally:
        err.close()
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


# Workers alive now: each runs in its own session (so a kill takes what it started), which also
# means an interrupted parent must end them itself (run_fuzz's ``finally``).
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


def _kill(proc: subprocess.Popen) -> None:
    """End a worker and whatever it started (its own process group), if it has not ended (a
    reaped worker's id may belong to another process by now)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def _run_path(path: str, items: list[FuzzItem], seed: int, provider: str | None, case_timeout: float,
              process_timeout: float, startup_timeout: float, tick: Callable[[FuzzResult], None]) -> list[FuzzResult]:
    """Every item of one path through watched workers; a dead or hung worker costs one item."""
    results: dict[int, FuzzResult] = {}
    tmp = tempfile.mkdtemp(prefix="dualop-fuzz-")
    items_file = os.path.join(tmp, "items.json")
    with open(items_file, "w") as fh:
        json.dump([[it.label, it.family, it.index] for it in items], fh)

    def crash(n: int, detail: str) -> None:
        it = items[n]
        results[n] = FuzzResult(it.op, it.label, it.family, it.index, it.what, path, "crash", detail)
        tick(results[n])

    start, failed_starts, spawn = 0, 0, 0
    while start < len(items):
        stderr_file = os.path.join(tmp, f"stderr-{spawn}.txt")
        spawn += 1
        proc = _spawn(path, items_file, start, seed, provider, process_timeout, stderr_file)
        lines: queue.Queue = queue.Queue()

        def read(stream=proc.stdout, q=lines) -> None:
            for line in stream:
                q.put(line)
            q.put(None)

        threading.Thread(target=read, daemon=True).start()
        current, ready, next_start = None, False, None
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                _kill(proc)
                if current is None:
                    crash(start, f"the worker did not start within {startup_timeout:.0f} s")
                    next_start = start + 1
                else:
                    crash(current, f"hang: no result within {case_timeout:.0f} s (worker killed)")
                    next_start = current + 1
                break
            if line is None:  # the worker is gone
                rc = proc.wait()
                if current is not None and current not in results:
                    why = _signal_name(rc) if rc < 0 else f"exit status {rc}"
                    crash(current, f"the worker died ({why}): {_stderr_tail(stderr_file)}")
                    next_start = current + 1
                elif not ready:
                    crash(start, f"the worker died before it started (exit status {rc}): {_stderr_tail(stderr_file)}")
                    next_start = start + 1
                elif next_start is None:
                    next_start = (current + 1) if current is not None else len(items)
                break
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("ready"):
                ready, deadline = True, time.monotonic() + case_timeout
            elif "start" in msg:
                current, deadline = msg["start"], time.monotonic() + case_timeout
            elif "result" in msg:
                n = msg.pop("result")
                results[n] = FuzzResult(**msg)
                tick(results[n])
            elif "retire" in msg:
                next_start = msg["retire"]
            elif msg.get("done"):
                next_start = len(items)
        _kill(proc)  # gone already, or done: make sure, and forget it
        failed_starts = failed_starts + 1 if not ready else 0
        start = max(next_start, start + 1) if next_start is not None else start + 1
        if failed_starts >= 3 and start < len(items):  # it cannot start at all: say so for the rest
            for n in range(start, len(items)):
                crash(n, f"not run: the worker failed to start three times ({_stderr_tail(stderr_file)})")
            break
    shutil.rmtree(tmp, ignore_errors=True)
    return [results[n] for n in sorted(results)]


def _path_unavailable(path: str) -> str | None:
    from dualop.check import frontend_missing

    frontend = PATHS[path][0]
    return f"{frontend} is not installed here" if frontend_missing(frontend) else None


def run_fuzz(ops: list[str] | None = None, paths: list[str] | None = None, budget: int | None = None,
             seed: int = 0, draws: int = 1, progress: bool = True, jobs: int | None = None,
             case_timeout: float = CASE_TIMEOUT, process_timeout: float = PROCESS_TIMEOUT,
             startup_timeout: float = STARTUP_TIMEOUT, provider: str | None = None,
             only: list[tuple[str, str, int]] | None = None) -> list[FuzzResult]:
    """Plan the sweep, draw ``budget`` items per path (None: all), run each path's items in watched
    workers (``jobs`` paths at a time) and return every result."""
    from tqdm import tqdm

    paths = list(paths or PATHS)
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise ValueError(f"dualop check --fuzz: unknown path(s) {unknown}; expected some of {list(PATHS)}")
    if draws < 1 or (budget is not None and budget < 1):
        raise ValueError("dualop check --fuzz: --draws and --budget must be positive")
    if provider is None:
        testing.check_op_names([o for o in ops or () if o not in {c.label for c in testing.cases_for(None)}],
                               "dualop check --fuzz")
        cases = list(testing.cases_for(ops))
    else:
        cases = [c for c in _load_provider(provider)() if not ops or c.op in ops or c.label in ops]
    labels = [c.label for c in cases]
    if len(set(labels)) != len(labels):
        raise ValueError("dualop check --fuzz: case labels must be unique")
    per_path = plan(cases, seed, draws, paths)
    if only is not None:
        keep = set(only)
        per_path = {p: [it for it in its if (it.label, it.family, it.index) in keep] for p, its in per_path.items()}
    chosen = {p: draw(its, budget, seed) for p, its in per_path.items()}
    total = sum(len(v) for v in chosen.values())
    bar = tqdm(total=total, desc="dualop check --fuzz", unit="case", disable=not progress, dynamic_ncols=True)
    lock = threading.Lock()
    counts: dict[str, int] = {}

    def tick(r: FuzzResult) -> None:
        with lock:
            counts[r.cls] = counts.get(r.cls, 0) + 1
            bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in sorted(counts.items())), refresh=False)
            bar.update(1)

    out: dict[str, list[FuzzResult]] = {}

    def run(p: str) -> None:
        why = _path_unavailable(p)
        if why is not None:
            out[p] = [FuzzResult(it.op, it.label, it.family, it.index, it.what, p, "skipped", why) for it in chosen[p]]
            for r in out[p]:
                tick(r)
            return
        out[p] = _run_path(p, chosen[p], seed, provider, case_timeout, process_timeout, startup_timeout, tick)

    jobs = max(1, min(jobs or min(len(paths), os.cpu_count() or 1), len(paths)))
    pending = [p for p in paths if chosen[p]]
    threads: list[threading.Thread] = []
    try:
        while pending or threads:
            while pending and len(threads) < jobs:
                t = threading.Thread(target=run, args=(pending.pop(0),), daemon=True)
                t.start()
                threads.append(t)
            threads[0].join(0.2)
            threads = [t for t in threads if t.is_alive()]
    finally:
        with _LIVE_LOCK:
            live = list(_LIVE)
        for proc in live:  # interrupted: end the workers this sweep started
            _kill(proc)
        bar.close()
    return [r for p in paths for r in out.get(p, [])]


def run_one(label: str, family: str, index: int = 0, path: str = "torch-cpu", seed: int = 0,
            provider: str | None = None) -> FuzzResult:
    """One item in this process (a repro: no watchdog): ``dualop.fuzz.run_one(label, family, index, path)``."""
    prepare_environment()
    _import_frontends()
    cases = {c.label: c for c in _load_provider(provider)()}
    m = make_mutation(cases[label], family, index, seed)
    if m is None:
        raise ValueError(f"dualop check --fuzz: {family} does not apply to {label}")
    return run_item(cases[label], m, path)


# --- the report -----------------------------------------------------------------------------


def failed(results: list[FuzzResult]) -> bool:
    return any(r.cls in FAILURES for r in results)


def summary(results: list[FuzzResult]) -> dict[str, dict[str, int]]:
    """{path: {class: count}} with a ``total`` row."""
    table: dict[str, dict[str, int]] = {}
    for r in results:
        for key in (r.path, "total"):
            row = table.setdefault(key, dict.fromkeys(CLASSES, 0))
            row[r.cls] += 1
    if "total" in table:
        table["total"] = table.pop("total")
    return table


def format_report(results: list[FuzzResult], seconds: float | None = None, header: str = "") -> str:
    """Totals per path and class, then one line per failing item."""
    table = summary(results)
    head = ["path", *CLASSES, "cases"]
    rows = [head] + [[p, *(str(c[k]) for k in CLASSES), str(sum(c.values()))] for p, c in table.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [header] if header else []
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(2 if header else 1, "  ".join("-" * w for w in widths))
    bad = [r for r in results if r.cls in FAILURES]
    if bad:
        lines += ["", f"failures ({len(bad)}): op | case | family#index: mutation | path | class | detail"]
        lines += [f"  {r.op} | {r.case} | {r.family}#{r.index}: {r.mutation} | {r.path} | {r.cls} | {r.detail}"
                  for r in bad]
    refused_valid = [r for r in results if r.cls == "refused" and r.detail.endswith(ACCEPTED_NOTE)]
    if refused_valid:
        lines += ["", f"note: {len(refused_valid)} refusal(s) of input forward_native accepts (see --json)"]
    if seconds is not None:
        lines += ["", f"{len(results)} cases in {seconds:.0f} s; {len(bad)} failing"]
    return "\n".join(lines)
