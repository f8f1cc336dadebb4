"""The kernel variants ``dualop compile`` builds: every op case x dtype x non-empty shape that
``dualop check`` runs, plus the shapes an LLM server would call each op with (each op module's
``serving()``, ``dualop.spec.Serving``).

A variant carries abstract inputs (``InputSpec``: shape and dtype), never data, so a serving
shape of 8192 x 57344 costs nothing to describe. Check shapes take their inputs from the case's own
``make_inputs``; serving shapes take them from the op's ``Serving.inputs``, or else scale the inputs
of the case's first 2-D check shape (an input shaped like x becomes the serving shape, one shaped
like x's last dim becomes the serving hidden size, a small fixed input such as a (1,) scale is kept).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dualop import testing
from dualop.spec import InputSpec, Serving, collect

__all__ = ["InputSpec", "Serving", "Variant", "servings", "variants_for", "check_dtypes", "map_specs"]

_NO_SERVING = Serving(())
_SERVINGS: dict[str, Serving] = {}


def servings() -> dict[str, Serving]:
    """Every op's serving shapes, as its module declares them (``serving()``), by op name."""
    if not _SERVINGS:
        _SERVINGS.update(collect("serving"))
    return _SERVINGS


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel build: an op case at one dtype and shape. ``inputs`` are the op's positional
    arguments as ``InputSpec``s (None for an absent optional one)."""

    case: testing.OpCase
    dtype: str
    shape: tuple[int, ...]
    serving: bool
    inputs: tuple[InputSpec | None, ...]

    @property
    def key(self) -> tuple[str, str, tuple[int, ...]]:
        return (self.case.label, self.dtype, self.shape)

    def make_op(self):
        make = servings().get(self.case.op, _NO_SERVING).make_op.get(self.case.label) if self.serving else None
        return (make or self.case.make_op)(self.shape)


def map_specs(value, fn):
    """``fn(spec)`` for an ``InputSpec``, the same through a structured input's arrays
    (``map_arrays``), anything else (None, a scalar) as it is."""
    if isinstance(value, InputSpec):
        return fn(value)
    if hasattr(value, "map_arrays"):
        return value.map_arrays(lambda v: map_specs(v, fn))
    return value


def check_dtypes(dtypes: list[str] | None) -> list[str]:
    dtypes = list(dtypes or ("float32", "bfloat16"))
    unknown = [d for d in dtypes if d not in testing.DTYPES]
    if unknown:
        raise ValueError(f"dualop compile: unknown dtype(s) {unknown}; expected some of {list(testing.DTYPES)}")
    return dtypes


def _templates(arrays: tuple) -> tuple:
    """Numpy inputs from ``make_inputs`` as InputSpecs; dtype None means "the variant's dtype"
    (a ``Pinned`` input keeps its own)."""
    out = []
    for a in arrays:
        if hasattr(a, "map_arrays"):  # a structured input (a QuantizedWeight): each of its arrays
            out.append(a.map_arrays(lambda v: _templates((v,))[0]))
        elif a is None or isinstance(a, (bool, int, float)):
            out.append(a)
        elif isinstance(a, testing.Pinned):
            out.append(InputSpec(tuple(a.array.shape), a.dtype))
        else:
            out.append(InputSpec(tuple(np.shape(a)), None))
    return tuple(out)


def _scaled(case: testing.OpCase, probe: tuple[int, ...], probe_inputs: tuple, shape: tuple[int, ...]) -> tuple:
    """The probe shape's inputs re-shaped for ``shape`` (see the module docstring)."""
    out = []
    for i, spec in enumerate(probe_inputs):
        if not isinstance(spec, InputSpec):
            out.append(spec)
        elif spec.shape == probe:
            out.append(InputSpec(shape, spec.dtype))
        elif spec.shape == probe[-1:]:
            out.append(InputSpec(shape[-1:], spec.dtype))
        elif int(np.prod(spec.shape)) <= 1:
            out.append(spec)
        else:
            raise ValueError(
                f"dualop compile: cannot scale input {i} of case {case.label} (shape {spec.shape} at check "
                f"shape {probe}) to the serving shape {shape}"
            )
    return tuple(out)


def _serving_specs(case: testing.OpCase, shapes: list, templates: dict, shape: tuple[int, ...]) -> tuple:
    """A serving shape's inputs: its ``Serving.inputs`` function, else the case's first
    2-D check shape scaled up."""
    describe = servings()[case.op].inputs
    if isinstance(describe, dict):
        describe = describe.get(case.label)
    if describe is not None:
        return tuple(describe(shape))
    probe = next((s for s in shapes if len(s) == 2), None)
    if probe is None:
        raise ValueError(
            f"dualop compile: case {case.label} has no 2-D check shape to scale to {shape}; "
            f"give its Serving an inputs function"
        )
    return _scaled(case, probe, templates[probe], shape)


def variants_for(ops: list[str] | None, dtypes: list[str], serving_dtypes: list[str] | None = None) -> list[Variant]:
    """Every (case, dtype, shape) to build, check shapes first, without duplicates; serving shapes
    only in ``serving_dtypes`` (default: every one of ``dtypes``)."""
    testing.check_op_names(ops, "dualop compile")
    rng = np.random.default_rng(0)
    variants: dict[tuple, Variant] = {}
    for case in testing.cases_for(ops):
        shapes = [tuple(s) for s in case.shapes if s and s[0] > 0]
        templates = {s: _templates(case.make_inputs(s, rng)) for s in shapes}
        declared = servings().get(case.op, _NO_SERVING)
        serving = [tuple(s) for s in declared.shapes if tuple(s) not in templates]
        if case.label not in (declared.cases or (case.label,)):
            serving = []
        for dtype in dtypes:
            served = serving if dtype in (declared.dtypes or (dtype,)) else []
            if serving_dtypes is not None and dtype not in serving_dtypes:
                served = []
            for shape in shapes + served:
                is_serving = shape not in templates
                specs = _serving_specs(case, shapes, templates, shape) if is_serving else templates[shape]
                specs = tuple(map_specs(s, lambda s: InputSpec(s.shape, s.dtype or dtype)) for s in specs)
                v = Variant(case, dtype, shape, is_serving, specs)
                variants.setdefault(v.key, v)
    return list(variants.values())
