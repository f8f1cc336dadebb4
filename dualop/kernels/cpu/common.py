"""What the torch wrappers of the CPU kernels share: which tensors they take, and thread counts."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import DTYPE_CODES
from dualop.kernels.cpu.abi import PARALLEL_MIN_ELEMENTS

__all__ = ["dtype_code", "threads_for"]


def dtype_code(t: Any) -> int | None:
    """The C entry points' code for a CPU tensor's dtype, or None if they do not take it."""
    if t.device.type != "cpu":
        return None
    return DTYPE_CODES.get(str(t.dtype).removeprefix("torch."))


def threads_for(numel: int) -> int:
    import torch

    return 1 if numel < PARALLEL_MIN_ELEMENTS else torch.get_num_threads()
