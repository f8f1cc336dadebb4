"""What ``dualop bench`` times: every op module's ``bench_cases()`` (``dualop.spec.BenchCase``: one
way to call an op, with the peers a user would pick instead of dualop, a torch built-in or a
hand-written ``jax.numpy`` function, and the kernel's cost model).

A case's ``shape`` is always the shape of the main input ``x``: ``(N, hidden)`` for a norm,
``(N, 2d)`` for a gated activation (whose output is ``(N, d)``). Its bytes and flops come from the
kernel's own cost model, so measured GB/s and the device roofline predictions count the same
bytes. Importing this module imports neither torch nor jax.
"""

from __future__ import annotations

from collections.abc import Iterable

from dualop.spec import ITEMSIZE, BenchCase, collect, rows_of

__all__ = ["BenchCase", "CASES", "DEFAULT_CASES", "ITEMSIZE", "case_listing", "select_cases", "rows_of"]

CASES: tuple[BenchCase, ...] = tuple(collect("bench_cases"))
DEFAULT_CASES: tuple[str, ...] = tuple(c.label for c in CASES if c.default)


def case_listing(names: Iterable[str] | None = None, sizes: Iterable[tuple[int, int]] = ()) -> list[str]:
    """``dualop bench --list``: one sorted line per (case, size, dtype): whether it runs by
    default, its peers, the op it builds, the shape it runs and its cost model's numbers (what the
    roofline divides)."""
    from dualop.testing import listing_text

    cases = CASES if names is None else select_cases(names)
    lines = []
    for c in cases:
        peers = ",".join(p for p, fn in (("torch", c.torch_builtin), ("jax", c.jax_handwritten)) if fn) or "none"
        for size in sizes:
            shape = c.input_shape(tuple(size))
            op = listing_text(c.make_op(shape[-1]))
            for dtype in sorted(ITEMSIZE):
                cost = c.kernel_cost(shape, dtype)
                lines.append(f"{c.label} | op {c.op_name} | {'default' if c.default else 'on request'} | peers {peers} | "
                             f"{'matrix' if c.matrix else 'vector'} | size {tuple(size)} -> shape {shape} | {dtype} | "
                             f"{op} | bytes {cost.bytes_accessed} flops {cost.flops} "
                             f"transcendentals {cost.transcendentals}")
    return sorted(lines)


def select_cases(names: Iterable[str] | None = None) -> list[BenchCase]:
    """The cases whose label or registered op name is in ``names`` (the default cases for None); an
    op name leaves out the op's written forms (``rms_norm[out]``, ...), which are asked for by label.

    Raises ValueError naming every name that matches no case, and the valid ones.
    """
    if names is None:
        return [c for c in CASES if c.default]
    if isinstance(names, str):
        raise TypeError(f"ops must be a list of names, got the string {names!r}")
    wanted = list(names)
    unknown = [n for n in wanted if not any(n in (c.label, c.op_name) for c in CASES)]
    if unknown:
        valid = sorted({c.label for c in CASES} | {c.op_name for c in CASES})
        raise ValueError(f"--ops: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    return [c for c in CASES if c.label in wanted or (c.op_name in wanted and c.written is None)]
