"""The cost of dispatch itself.

Measured on an op whose methods return their input, so only the dispatcher is timed: ``op(x)``
against calling the resolved method directly, and against the reference serving engine's pattern
(``forward(*args, **kwargs)`` calling a bound method chosen at construction), plus the same with a
fixed argument list. Every contender is called the same way (as an object, on the same tiny
input), interleaved in the balanced orders of ``timing.round_orders`` so the machine's drift and
what one contender leaves behind hit all alike; medians over rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from dualop.bench.timing import round_orders
from dualop.custom_op import CustomOp

__all__ = ["dispatch_overhead", "format_dispatch"]


class _EchoOp(CustomOp):
    """Returns its input from every path: what remains of a call is the dispatch."""

    def forward_native(self, x: Any) -> Any:
        return x

    def forward_cpu(self, x: Any) -> Any:
        return x


class _ReferencePattern:
    """The reference engine's dispatch: ``forward(*args, **kwargs)`` calls one bound method picked
    at construction. Called as an object (``ref(x)``), as ``op(x)`` is; the engine's own ops add
    ``nn.Module.__call__`` on top of this."""

    def __init__(self, method):
        self._forward_method = method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    __call__ = forward


class _FixedArityReference:
    """The same indirection with the argument list spelled out (no ``*args`` packing): the cheapest
    one-indirection dispatcher Python allows, reported beside the engine's pattern."""

    def __init__(self, method):
        self._forward_method = method

    def __call__(self, x: Any) -> Any:
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


def _paired_ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of (numerator - direct) / (denominator - direct), each round on its own,
    so a round the machine slowed down counts for both sides alike."""
    ratios = [
        (a - d) / (b - d)
        for a, b, d in zip(samples[numerator], samples[denominator], samples["direct"])
        if b - d > 0
    ]
    return statistics.median(ratios) if ratios else float("nan")


# Rounds are short (20,000 calls, ~10 ms) and many: a round that a scheduler tick or the other
# core's work lands on is one outlier among many, and the medians and paired ratios ignore it.
MIN_ROUNDS = 15


def dispatch_overhead(frontends: list[str], rounds: int = 7, calls: int = 20000, progress: bool = True) -> list[dict]:
    """One record per frontend: ``op(x)`` of an op that returns its input, the resolved method
    called directly, and the two reference dispatchers, in ns per call (at least ``MIN_ROUNDS``
    rounds). ``ratio`` / ``fixed_arity_ratio``: dualop's overhead over the reference's, per round,
    median over rounds."""
    from tqdm import tqdm

    rounds = max(rounds, MIN_ROUNDS)
    records = []
    for fe in frontends:
        x = _tiny(fe)
        op = _EchoOp()
        op(x)  # resolve once
        direct = op._armed.method  # the dispatch cache's last hit: the resolved bound method
        contenders = {
            "dualop": op,
            "direct": direct,
            "reference": _ReferencePattern(direct),
            "fixed_arity_reference": _FixedArityReference(direct),
        }
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        names = list(contenders)
        orders = round_orders(len(names))
        rounds = -(-rounds // len(orders)) * len(orders)  # whole cycles of orders
        for r in tqdm(range(rounds), desc=f"dispatch {fe}", disable=not progress, leave=False):
            for i in orders[r % len(orders)]:
                samples[names[i]].append(_per_call_ns(contenders[names[i]], x, calls))
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
            "fixed_arity_reference_overhead_ns": med["fixed_arity_reference"] - med["direct"],
            "ratio": _paired_ratio(samples, "dualop", "reference"),
            "fixed_arity_ratio": _paired_ratio(samples, "dualop", "fixed_arity_reference"),
            "spread_ns": max(samples["dualop"]) - min(samples["dualop"]),
            "rounds": rounds,
            "calls_per_round": calls,
        })
    return records


def format_dispatch(records: list[dict]) -> str:
    lines = [
        "frontend  method        op(x) ns  direct ns  overhead ns  reference overhead ns  ratio"
        "  fixed-arity overhead ns  ratio"
    ]
    for r in records:
        lines.append(
            f"{r['frontend']:<9} {r['method']:<13} {r['call_ns']:>8.0f}  {r['direct_ns']:>9.0f}  "
            f"{r['overhead_ns']:>11.0f}  {r['reference_overhead_ns']:>21.0f}  {r['ratio']:>5.2f}  "
            f"{r['fixed_arity_reference_overhead_ns']:>23.0f}  {r['fixed_arity_ratio']:>5.2f}"
        )
    lines.append(
        "overhead = op(x) - direct call; ratio = dualop's overhead / the reference's, per round, median "
        "over rounds; reference = the engine's forward(*args, **kwargs) -> bound method; fixed-arity = "
        "the same with the argument spelled out"
    )
    return "\n".join(lines)
