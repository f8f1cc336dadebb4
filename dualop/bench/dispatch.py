"""``dualop bench``: measured speed. For now, the cost of dispatch itself.

Dispatch overhead is measured on an op whose methods return their input, so only the dispatcher
is timed: ``op(x)`` against calling the resolved method directly, and against the reference serving
engine's pattern (``forward`` calling a bound method chosen at construction), interleaved
(A B C A B C ...) so the machine's drift hits all three alike; medians over rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from dualop.custom_op import CustomOp

__all__ = ["dispatch_overhead", "format_dispatch"]


class _EchoOp(CustomOp):
    """Returns its input from every path: what remains of a call is the dispatch."""

    def forward_native(self, x: Any) -> Any:
        return x

    def forward_cpu(self, x: Any) -> Any:
        return x


class _ReferencePattern:
    """The reference engine's dispatch: one bound method picked at construction."""

    def __init__(self, method):
        self._forward_method = method

    def forward(self, x: Any) -> Any:
        return self._forward_method(x)


def _per_call_ns(fn, x, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter_ns() - start) / calls


def _tiny(frontend: str):
    if frontend == "jax":
        import jax.numpy as jnp

        return jnp.zeros((1, 8), jnp.float32)
    import torch

    return torch.zeros(1, 8)


def dispatch_overhead(frontends: list[str], rounds: int = 7, calls: int = 20000, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    records = []
    for fe in frontends:
        x = _tiny(fe)
        op = _EchoOp()
        op(x)  # resolve once
        direct = op._dispatch_cache[next(iter(op._dispatch_cache))]
        ref = _ReferencePattern(direct)
        samples: dict[str, list[float]] = {"dualop": [], "direct": [], "reference": []}
        for _ in tqdm(range(rounds), desc=f"dispatch {fe}", disable=not progress, leave=False):
            samples["dualop"].append(_per_call_ns(op, x, calls))
            samples["direct"].append(_per_call_ns(direct, x, calls))
            samples["reference"].append(_per_call_ns(ref.forward, x, calls))
        med = {k: statistics.median(v) for k, v in samples.items()}
        records.append({
            "op": "dispatch",
            "frontend": fe,
            "method": direct.__name__,
            "call_ns": med["dualop"],
            "direct_ns": med["direct"],
            "reference_call_ns": med["reference"],
            "overhead_ns": med["dualop"] - med["direct"],
            "reference_overhead_ns": med["reference"] - med["direct"],
            "spread_ns": max(samples["dualop"]) - min(samples["dualop"]),
            "rounds": rounds,
            "calls_per_round": calls,
        })
    return records


def format_dispatch(records: list[dict]) -> str:
    lines = ["frontend  method        op(x) ns  direct ns  overhead ns  reference overhead ns  ratio"]
    for r in records:
        ratio = r["overhead_ns"] / r["reference_overhead_ns"] if r["reference_overhead_ns"] > 0 else float("nan")
        lines.append(
            f"{r['frontend']:<9} {r['method']:<13} {r['call_ns']:>8.0f}  {r['direct_ns']:>9.0f}  "
            f"{r['overhead_ns']:>11.0f}  {r['reference_overhead_ns']:>21.0f}  {ratio:>5.2f}"
        )
    return "\n".join(lines)
