"""Interleaved timing: every implementation runs once per round, so the drift of a noisy machine
(other tenants, frequency changes, a background job) hits all of them alike; statistics are taken
over rounds, and ratios are taken round by round, so the drift cancels.

What ran just before a call can slow it down (a thread pool still spinning, a cache or allocator
left in some state). So the orders of the rounds are balanced (``round_orders``): over a cycle of
rounds every entry runs first equally often and follows every other entry equally often, and the
first entry of a round runs once, untimed, right before it is timed, so that no entry inherits the
previous round's last one. With a plain rotation (A B C, B C A, C A B) every entry always follows
the same neighbour, and one that follows a disturbing neighbour is slower in every round.

Also the machine's copy bandwidth, measured as one more entry of the same rounds: the roofline an
op that must read its inputs and write its outputs once can at best reach on this machine. The
copy runs in the frontend being timed (``copy_fn``): a torch ``copy_`` between jax calls leaves
torch's OpenMP workers spinning for several milliseconds after it returns, on cores XLA needs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "Samples",
    "round_orders",
    "measure",
    "interleaved",
    "median",
    "relative_range",
    "paired_ratio",
    "copy_fn",
    "COPY_ENTRY",
    "check_counts",
]

# The name of the copy entry added to a case's rounds (never an implementation's name).
COPY_ENTRY = "copy"


def _minor_faults() -> int | None:
    """Minor page faults of this process so far (all threads), or None where getrusage is missing."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclasses.dataclass
class Samples:
    """Per-call seconds, and minor page faults per call (None where the OS cannot count them), for
    each entry, one value per timed round; ``warmup_rounds``: the untimed rounds actually run."""

    times: dict[str, list[float]]
    faults: dict[str, list[int]] | None
    warmup_rounds: int


def check_counts(rounds: Any, warmup: Any) -> None:
    """Raise ValueError unless ``rounds`` is a positive int and ``warmup`` a non-negative one."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")


def round_orders(n: int) -> list[list[int]]:
    """The orders in which ``n`` entries run, one per round, taken in turn: a Williams design.

    Over the cycle (``n`` orders for even ``n``, ``2n`` for odd) every entry runs in every position
    equally often and right after every other entry equally often, so what an entry leaves behind
    (a spinning thread pool, a cold cache) costs every other entry the same. Order ``i`` is
    ``0, 1, n-1, 2, n-2, ...`` plus ``i`` (mod ``n``); for odd ``n`` the reversed orders follow.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"round_orders: n must be a positive int, got {n!r}")
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    orders = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return orders


# A warm-up round is settled when no entry faulted in more than this many pages (1 MiB of 4 KiB
# pages): stray faults of the interpreter's own growth, not a fresh output.
SETTLED_FAULTS = 256


def measure(
    fns: Mapping[str, Callable[[], Any]],
    rounds: int,
    warmup: int,
    sync: Callable[[Any], Any] | None = None,
    settle: int = 0,
) -> Samples:
    """Run every fn once per round: ``warmup`` untimed rounds, up to ``settle`` more untimed ones
    until a whole cycle of orders (so every order was seen) ran without page faults
    (``SETTLED_FAULTS``; until then the heap is still growing to the working set), then the timed
    ones: ``rounds``, rounded up to whole cycles of ``round_orders`` so the orders stay balanced.

    Each round first calls its first entry once, untimed (its lead-in): every timed call then
    follows a call of the same round, which the balanced orders share out evenly, or of itself.
    ``sync(result)`` runs inside the timed region (for JAX: ``jax.block_until_ready``, since
    dispatch is asynchronous); the result is dropped after the clock stops, so its memory is free
    for the next entry.
    """
    check_counts(rounds, warmup)
    if isinstance(settle, bool) or not isinstance(settle, int) or settle < 0:
        raise ValueError(f"settle must be a non-negative int, got {settle!r}")
    if not isinstance(fns, Mapping) or not fns:
        raise ValueError(f"fns must be a non-empty mapping of name -> callable, got {fns!r}")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}] must be callable, got {type(fn).__name__}")
    names = list(fns)
    orders = [[names[i] for i in order] for order in round_orders(len(names))]
    clock = time.perf_counter
    counting = _minor_faults() is not None

    def call(fn: Callable[[], Any]) -> None:
        out = fn()
        if sync is not None:
            sync(out)

    def one_round(order: list[str]) -> tuple[dict[str, float], dict[str, int]]:
        call(fns[order[0]])  # the lead-in: the first timed call follows itself, not the last round
        elapsed: dict[str, float] = {}
        faulted: dict[str, int] = {}
        for name in order:
            fn = fns[name]
            f0 = _minor_faults()
            t0 = clock()
            out = fn()
            if sync is not None:
                sync(out)
            elapsed[name] = clock() - t0
            f1 = _minor_faults()
            del out
            faulted[name] = f1 - f0 if counting else 0
        return elapsed, faulted

    r = clean = 0
    while r < warmup + settle:
        _, faulted = one_round(orders[r % len(orders)])
        r += 1
        clean = clean + 1 if max(faulted.values()) <= SETTLED_FAULTS else 0
        if r >= warmup and clean >= len(orders):
            break
    warmup_rounds = r
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] | None = {n: [] for n in names} if counting else None
    for t in range(-(-rounds // len(orders)) * len(orders)):
        elapsed, faulted = one_round(orders[t % len(orders)])
        for name in names:
            times[name].append(elapsed[name])
            if faults is not None:
                faults[name].append(faulted[name])
    return Samples(times=times, faults=faults, warmup_rounds=warmup_rounds)


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    rounds: int,
    warmup: int,
    sync: Callable[[Any], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each fn, one value per timed round (see ``measure``)."""
    return measure(fns, rounds, warmup, sync).times


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return statistics.median(values)


def relative_range(values: list[float]) -> float:
    """The spread the bench reports: ``(max - min) / median`` over the rounds (0 = no spread)."""
    m = median(values)
    return (max(values) - min(values)) / m if m > 0 else float("inf")


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] / b[i]``: the two were timed in the same round, so a slow round
    slows both and cancels in the ratio."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio needs two equally long non-empty lists, got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


def copy_fn(shape: tuple[int, ...], dtype: str, frontend: str) -> tuple[Callable[[], Any], int]:
    """A copy of an array of ``shape`` and ``dtype`` (a name in ``cases.ITEMSIZE``) in ``frontend``,
    and the bytes it moves (twice the array's: one read, one write).

    torch: ``copy_`` between two preallocated, already touched tensors, parallel over the intra-op
    threads as the ops are, and over the same element count, so it takes the same serial-or-parallel
    decision the ops' elementwise passes take. jax: ``jax.jit(jnp.copy)`` of an already touched
    array, XLA's own copy into a fresh output, as every jax implementation writes one; returns the
    array, for ``measure``'s ``sync``. Each frontend's copy runs on its own runtime's threads: a
    torch copy between XLA calls leaves torch's OpenMP workers spinning on the cores the next XLA
    call needs, which slowed whichever jax implementation ran after it (docs/BENCHMARKS.md).
    """
    from dualop.bench.cases import ITEMSIZE

    shape = tuple(shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in shape):
        raise ValueError(f"copy_fn: shape must be a non-empty tuple of positive ints, got {shape!r}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"copy_fn: dtype must be one of {', '.join(ITEMSIZE)}, got {dtype!r}")
    if frontend == "jax":
        import jax
        import jax.numpy as jnp

        src_jax = jax.block_until_ready(jnp.ones(shape, jnp.dtype(dtype)))
        copy = jax.jit(jnp.copy)
        jax.block_until_ready(copy(src_jax))  # compiled here, not in the first round
        return (lambda: copy(src_jax)), 2 * src_jax.nbytes
    if frontend != "torch":
        raise ValueError(f"copy_fn: frontend must be 'torch' or 'jax', got {frontend!r}")
    import torch

    src = torch.ones(shape, dtype=getattr(torch, dtype))
    dst = torch.zeros(shape, dtype=src.dtype)
    return (lambda: dst.copy_(src)), 2 * src.nelement() * src.element_size()
