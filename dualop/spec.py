"""What an op declares about itself, beside its definition, for the tools and tests to loop over.

An op module (``dualop/ops/<family>.py``) may define three module-level hooks; every tool reads
them through ``collect`` and holds no per-op code:

- ``check_cases()``: ``testing.OpCase`` list, the inputs and shapes ``dualop check``, ``dualop
  compile`` (at check shapes) and the test sweeps run, with the traits the tests key on.
- ``serving()``: ``{op name: Serving}``, the shapes an LLM server calls the op with, which
  ``dualop compile`` builds for the real TPU and GPU compilers.
- ``bench_cases()``: ``BenchCase`` list, what ``dualop bench`` times, with the peers a user would
  pick instead and the cost model the roofline divides.

This module imports neither torch nor jax, nor any tool (``bench``, ``aot``, ``check``, ``cli``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dualop.kernels.cost import KernelCost

__all__ = ["BenchCase", "ITEMSIZE", "InputSpec", "Serving", "collect", "float32_normal", "op_modules", "rows_of",
           "x_only_inputs"]

# The dtypes the bench runs, and their bytes per element (for the cost model, without a framework).
ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows of a row-wise op: the product of every dim but the last."""
    return math.prod(shape[:-1])


def float32_normal(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Standard normal values drawn in float32, times ``scale`` (the bench cases' inputs; the check
    cases draw in float64 and round, ``testing.normal``)."""
    out = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        out *= np.float32(scale)
    return out


def x_only_inputs(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray]:
    """``make_inputs`` of a bench case called as ``op(x)``: x at scale 3."""
    return (float32_normal(shape, rng, 3.0),)


# --- serving shapes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """An abstract input: what a ``jax.ShapeDtypeStruct`` or a torch meta tensor is made from.
    dtype None: the variant's dtype."""

    shape: tuple[int, ...]
    dtype: str | None


@dataclasses.dataclass(frozen=True)
class Serving:
    """The shapes a server calls one op with, which ``dualop compile`` builds (no data is made).

    shapes: one tuple per build. For a row-wise op a shape is x's shape, and the inputs of the
    case's first 2-D check shape are scaled to it; otherwise ``inputs(shape)`` says what the
    tuple means by returning the op's positional arguments (``InputSpec``, scalars or None);
    ``inputs`` may also be ``{case label: inputs}`` where cases take different arguments.
    make_op: ``{case label: make(shape)}`` for cases whose own ``make_op`` only knows check
    shapes. dtypes: build the serving shapes in these dtypes only (None: every dtype asked).
    cases: build them for these case labels only (None: every case of the op).
    """

    shapes: tuple[tuple[int, ...], ...]
    inputs: Callable[[tuple[int, ...]], tuple] | Mapping[str, Callable[[tuple[int, ...]], tuple]] | None = None
    make_op: Mapping[str, Callable[[tuple[int, ...]], Any]] = dataclasses.field(default_factory=dict)
    dtypes: tuple[str, ...] | None = None
    cases: tuple[str, ...] | None = None


# --- bench cases ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One way to call one op, as ``dualop bench`` times it.

    label: the name in tables and ``--ops`` (``rms_norm[residual]``); op_name: the registered op's
    name (``--ops`` matches either). make_op(hidden): the op for inputs whose last dim is
    ``hidden``. make_inputs(shape, rng): float32 numpy positional arguments. cost(op, shape,
    itemsize): the kernel's cost model for one call. torch_builtin(op) / jax_handwritten(op): the
    peer's function, called with the same arguments as the op, or None when there is none.
    default: run when ``--ops`` is not given. shape_of: see ``input_shape``. matrix: the flops
    are matmuls on the matrix units (the roofline then takes the device's 16-bit matrix peak for
    16-bit inputs, rather than its float32 vector peak). written: a written form (``out=``, in
    place: torch only): ``written(args)`` gives the op's ``(positional, keyword)`` arguments from
    the case's inputs, outputs by keyword, and each check runs on copies of the inputs; a
    ``vllm-kernel`` peer takes the inputs as they are. options: keyword options every
    implementation is called with, bound before any ``jit`` (static, as ``OpCase.options``:
    attention's ``sliding_window``); the peers take them too.
    """

    label: str
    op_name: str
    make_op: Callable[[int], Any]
    make_inputs: Callable[[tuple[int, ...], np.random.Generator], tuple]
    cost: Callable[[Any, tuple[int, ...], int], KernelCost]
    torch_builtin: Callable[[Any], Callable[..., Any]] | None = None
    jax_handwritten: Callable[[Any], Callable[..., Any]] | None = None
    default: bool = True
    shape_of: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None
    matrix: bool = False
    written: Callable[[tuple], tuple[tuple, dict]] | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def input_shape(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this case runs for a bench size (``small``, ``RxC``, ...): the size itself,
        the shape of x, for row-wise ops; ``shape_of(size)`` for a case whose inputs are not rows
        (attention over a paged cache), whose ``make_inputs`` and cost read that shape."""
        return tuple(self.shape_of(tuple(size))) if self.shape_of is not None else tuple(size)

    def kernel_cost(self, shape: tuple[int, ...], dtype: str) -> KernelCost:
        """The cost model's numbers for one call on ``x`` of ``shape`` in ``dtype``."""
        return self.cost(self.make_op(shape[-1]), tuple(shape), ITEMSIZE[dtype])

    def bytes_moved(self, shape: tuple[int, ...], itemsize: int) -> int:
        """Bytes one call must move: every input read once, every output written once."""
        return self.cost(self.make_op(shape[-1]), tuple(shape), itemsize).bytes_accessed

    def inputs(self, shape: tuple[int, ...], dtype: str, frontend: str, rng: np.random.Generator) -> tuple:
        """The positional arguments as ``frontend`` arrays in ``dtype``."""
        from dualop.testing import to_frontend

        return tuple(to_frontend(a, frontend, dtype) for a in self.make_inputs(tuple(shape), rng))


# --- the registry's modules -------------------------------------------------------------------------


def op_modules() -> list[str]:
    """Modules defining registered ops, in registry order, each followed by the dualop modules of
    its subclasses (variants sharing the registered name, e.g. the scaled rotary embeddings)."""
    import dualop.ops  # noqa: F401  (registers every op)
    from dualop.custom_op import CustomOp

    def with_subclasses(cls: type) -> Iterator[str]:
        yield cls.__module__
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("dualop."):
                yield from with_subclasses(sub)

    return list(dict.fromkeys(m for cls in CustomOp.op_registry.values() for m in with_subclasses(cls)))


def collect(hook: str) -> list[Any]:
    """Every op module's ``hook()`` results, in registry order: a list hook's items concatenated,
    a dict hook's items as ``(key, value)`` pairs."""
    out: list[Any] = []
    for name in op_modules():
        provider = getattr(importlib.import_module(name), hook, None)
        if provider is None:
            continue
        found = provider()
        out.extend(found.items() if isinstance(found, Mapping) else found)
    return out
