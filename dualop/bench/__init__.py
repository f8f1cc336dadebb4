"""``dualop bench``: measured speed (see docs/BENCHMARKS.md).

- throughput of each op against the peers a user would pick instead, with the copy roofline
  measured in the same rounds (``run_throughput``, ``format_throughput``, ``plot_throughput``);
- predicted time on an accelerator from the kernels' cost models (``predict``, ``format_roofline``);
- the cost of dispatch itself (``dispatch_overhead``, ``format_dispatch``).

Importing this package imports neither torch nor jax.
"""

from dualop.bench.cases import CASES, DEFAULT_CASES, BenchCase, select_cases
from dualop.bench.dispatch import dispatch_overhead, format_dispatch
from dualop.bench.memory import reuse_freed_memory
from dualop.bench.plot import plot_throughput
from dualop.bench.report import format_throughput
from dualop.bench.roofline import DEVICES, Device, format_roofline, predict
from dualop.bench.throughput import FRONTENDS, IMPLS, SIZES, parse_sizes, run_throughput
from dualop.bench.timing import interleaved, measure, median, paired_ratio, relative_range

__all__ = [
    "BenchCase",
    "CASES",
    "DEFAULT_CASES",
    "DEVICES",
    "Device",
    "FRONTENDS",
    "IMPLS",
    "SIZES",
    "dispatch_overhead",
    "format_dispatch",
    "format_roofline",
    "format_throughput",
    "interleaved",
    "measure",
    "median",
    "paired_ratio",
    "parse_sizes",
    "plot_throughput",
    "predict",
    "relative_range",
    "reuse_freed_memory",
    "run_throughput",
    "select_cases",
]
