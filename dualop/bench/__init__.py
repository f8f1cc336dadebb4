"""``dualop bench``: measured speed (see BENCHMARKS.md)."""

from dualop.bench.dispatch import dispatch_overhead, format_dispatch

__all__ = ["dispatch_overhead", "format_dispatch"]
