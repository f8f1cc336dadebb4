"""The op reference page of the documentation, generated from the registry and the ops' specs.

For every registered op: its class(es) and constructor, its call signature, the first paragraph of
its docstring, the method each (frontend, platform) cell resolves to with the dispatcher's reason,
the cases where a kernel cell runs the native body instead (the case's ``native_cells``), the
tolerance its kernels are held to, and the cases ``dualop check``, ``dualop compile`` and ``dualop
bench`` run. ``dualop ops --markdown`` prints it; the documentation site writes its op reference
page with it when it is built (``scripts/docs_hooks.py``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Iterable
from typing import Any

__all__ = ["implemented_methods", "op_reference_markdown"]

# The cells the page shows, in order (ROCm runs the Triton kernels CUDA does).
_CELLS = (("torch", "cpu"), ("torch", "cuda"), ("torch", "rocm"), ("jax", "cpu"), ("jax", "cuda"), ("jax", "tpu"),
          ("torch_xla", "tpu"), ("torchax", "tpu"))


def _only_raises(fn: Any) -> bool:
    """Whether ``fn``'s body (after its docstring) is one ``raise`` statement: a method that exists
    only to refuse (``CustomOp``'s defaults, an op with no forward)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # no source to read (built at run time): take it as a body
        return False
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _declines_always(cls: type, method: str) -> bool:
    """Whether ``cls.declines`` refuses ``method`` for every frontend it serves whatever the
    constructor's arguments: asked of a bare instance (no ``__init__`` run), a decline that reads no
    constructor state answers; one that does raises (AttributeError and the like), and then some
    instances may take the method."""
    from dualop.custom_op import CustomOp

    if cls.declines is CustomOp.declines:
        return False
    bare = object.__new__(cls)
    try:
        return all(bare.declines(method, frontend) is not None for frontend in cls.served_by(method).frontends)
    except Exception:  # the decline depends on what the constructor set
        return False


def implemented_methods(cls: type) -> tuple[str, ...]:
    """The forward methods ``cls`` really implements: ``forward_native``, then the platform methods
    in ``PLATFORM_METHOD`` order. A platform method counts when the class (or a parent below
    ``CustomOp``) defines it with more than a ``raise`` and does not decline it for every frontend
    and every instance (``_declines_always``); inherited defaults that only fall back do not. Empty
    when the op has no forward at all (its ``forward_native`` only raises). ``dualop ops`` and this
    page both say what this returns."""
    from dualop.custom_op import PLATFORM_METHOD

    if _only_raises(cls.forward_native):
        return ()
    platform = [m for m in dict.fromkeys(PLATFORM_METHOD.values())
                if cls._implements(m) and not _only_raises(getattr(cls, m)) and not _declines_always(cls, m)]
    return ("forward_native", *platform)


def _signature(fn: Any, drop: int = 1) -> str:
    """``(a, b=1, *, c=None)`` without the first ``drop`` parameters and without annotations."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in list(sig.parameters.values())[drop:]]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    first = doc.split("\n\n")[0]
    return " ".join(line.strip() for line in first.splitlines()).replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _why(reason: str) -> str:
    """The dispatcher's reason without the default config's note (every cell has it)."""
    return _cell(re.sub(r"^default: config holds 'all'(; )?", "", reason)) or "the platform's method"


def _family_summary(module: str) -> str:
    """The module docstring's first paragraph: what the family is."""
    doc = inspect.getdoc(importlib.import_module(module)) or ""
    first = doc.split("\n\n")[0]
    return " ".join(line.strip() for line in first.splitlines()).replace("``", "`")


def _tolerance_line(traits: Iterable[str]) -> str:
    from dualop.testing import DTYPES, TOLERANCES

    rows = ", ".join(f"{d} atol {TOLERANCES[d].atol:g} rtol {TOLERANCES[d].rtol:g}" for d in DTYPES)
    scale = ("; at large magnitudes against the output's scale (normwise)"
             if {"contraction", "cancelling"} & set(traits) else "")
    widen = "; a non-finite input may widen to the rest of its chunk" if "widens_nonfinite" in set(traits) else ""
    return f"|kernel − forward_native| ≤ atol + rtol·|forward_native| elementwise ({rows}){scale}{widen}"


def _resolutions(op: Any) -> list[tuple[str, str, str, str]]:
    from dualop.platforms import override_platform

    rows = []
    for frontend, platform in _CELLS:
        with override_platform(platform):
            method, reason = op.resolution(frontend, platform)
        rows.append((frontend, platform, method, reason))
    return rows


def _op_section(name: str, cls: type) -> list[str]:
    from dualop import testing
    from dualop.aot.variants import servings
    from dualop.bench.cases import CASES as BENCH_CASES

    cases = [c for c in testing.cases_for([name]) if c.op == name]
    classes = [cls, *(sub for sub in _subclasses(cls) if sub.__module__.startswith("dualop."))]
    lines = [f"### `{name}`", ""]
    for c in classes:
        where = c.__module__.replace(".", "/") + ".py"
        lines.append(f"- `{c.__name__}{_signature(c.__init__)}` ({where})")
    lines += ["", f"Call: `op{_signature(cls.forward_native)}`", ""]
    summary = _summary(cls)
    if summary:
        lines += [summary, ""]
    methods = implemented_methods(cls)
    if methods:
        lines += ["Implements: " + ", ".join(f"`{m}`" for m in methods) + ".", ""]
    else:
        lines += ["No forward: its `forward_native` only raises, so no platform method runs either.", ""]
    if not cases:
        lines += ["No check case of its own, so no cell table here" + (
            ": `dualop check` reaches its computation through the ops and layers built on it." if methods
            else "."), ""]
    else:
        shape = next((s for s in cases[0].shapes if s and s[0] > 0), cases[0].shapes[0])
        op = cases[0].make_op(shape)
        lines += ["| frontend | platform | method | why |", "| --- | --- | --- | --- |"]
        for frontend, platform, method, reason in _resolutions(op):
            lines.append(f"| {frontend} | {platform} | `{method}` | {_why(reason)} |")
        lines.append("")
        declines = [(c.label, f, p, r) for c in cases for (f, p), r in sorted(c.native_cells.items())]
        declines += [(c.label, f, p, f"{d}: {r}") for c in cases for (f, p, d), r in sorted(c.native_dtypes.items())]
        if declines:
            lines.append("Cases that run the native body in a kernel cell: "
                         + "; ".join(f"`{label}` on {f}/{p} ({_cell(r)})" for label, f, p, r in declines) + ".")
            lines.append("")
        traits = set().union(*(c.traits for c in cases))
        lines += [f"Tolerance: {_tolerance_line(traits)}.", ""]
        lines.append("Check cases: " + ", ".join(f"`{c.label}` {list(map(tuple, c.shapes))}" for c in cases) + ".")
        lines.append("")
    serving = servings().get(name)
    if serving is not None and serving.shapes:
        dtypes = f" in {', '.join(serving.dtypes)}" if serving.dtypes else ""
        only = f" for {', '.join(f'`{c}`' for c in serving.cases)}" if serving.cases else ""
        lines += [f"Serving shapes (`dualop compile`){dtypes}{only}: "
                  + ", ".join(str(tuple(s)) for s in serving.shapes) + ".", ""]
    bench = [b for b in BENCH_CASES if b.op_name == name]
    if bench:
        def peers(b) -> str:
            return ", ".join(p for p, fn in (("torch", b.torch_builtin), ("jax", b.jax_handwritten)) if fn) or "none"

        lines += ["Bench cases (`dualop bench`): " + ", ".join(
            f"`{b.label}` ({'default' if b.default else 'on request'}; peers {peers(b)})" for b in bench) + ".", ""]
    return lines


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def op_reference_markdown() -> str:
    """The whole reference page, ops grouped by the module that defines them, in registry order."""
    import dualop.ops  # noqa: F401  (registers every op)
    from dualop.custom_op import CustomOp

    by_module: dict[str, list[tuple[str, type]]] = {}
    for name, cls in CustomOp.op_registry.items():
        if cls.__module__.startswith("dualop."):
            by_module.setdefault(cls.__module__, []).append((name, cls))
    lines = [
        "# Op reference",
        "",
        "Generated from the registry and each op's spec when this site is built (`dualop ops --markdown`",
        "prints the same page). For each op: the constructor, the call,",
        "what each frontend and platform resolves to and why (per-call declines, such as a dtype a kernel",
        "does not take, are listed under the cases), the tolerance its kernels are held to against",
        "`forward_native`, and the cases `dualop check`, `dualop compile` and `dualop bench` run.",
        "",
    ]
    for module, ops in by_module.items():
        lines += [f"## `{module.replace('.', '/')}.py`", "", _family_summary(module), ""]
        for name, cls in ops:
            lines += _op_section(name, cls)
    text = "\n".join(lines).rstrip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)
