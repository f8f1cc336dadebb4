"""What the torch wrappers of the CPU kernels share: which tensors they take, and thread counts."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import DTYPE_CODES, KernelUnavailable
from dualop.kernels.cpu.abi import PARALLEL_MIN_ELEMENTS, c_function

__all__ = ["dtype_code", "team_for_usage", "team_size", "threads_for"]

# csrc/threads.cc: the OpenMP team a kernel runs on, the cores other processes keep busy given up.
# Every kernel's parallel region asks dualop_team_size itself; these serve Python callers and tests.
_TEAM_SIZE = c_function("int dualop_team_size(int requested)")
_TEAM_FOR_USAGE = c_function("int dualop_team_for_usage(int requested, int cores, double others_busy_cores)")


def dtype_code(t: Any) -> int | None:
    """The C entry points' code for a CPU tensor's dtype, or None if they do not take it."""
    if t.device.type != "cpu":
        return None
    return DTYPE_CODES.get(str(t.dtype).removeprefix("torch."))


def threads_for(numel: int) -> int:
    import torch

    return 1 if numel < PARALLEL_MIN_ELEMENTS else torch.get_num_threads()


def team_size(requested: int) -> int:
    """How many of ``requested`` threads a kernel runs on now: fewer by the cores other processes
    keep busy (measured from /proc/stat at most every 100 ms; ``DUALOP_CPU_ADAPTIVE_THREADS=0``
    keeps ``requested``). ``requested`` itself where the kernels are unavailable."""
    try:
        return int(_TEAM_SIZE(requested=int(requested)))
    except KernelUnavailable:
        return max(1, int(requested))


def team_for_usage(requested: int, cores: int, others_busy_cores: float) -> int:
    """The rule ``team_size`` applies: of ``cores``, those other processes keep busy more than half
    the time are taken; at least 1 and at most ``requested`` threads run."""
    return int(_TEAM_FOR_USAGE(requested=int(requested), cores=int(cores), others_busy_cores=float(others_busy_cores)))
