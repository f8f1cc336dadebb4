"""Vocabulary-parallel embedding lookup on the CPU for torch tensors (kernel: ``csrc/embedding.cc``):
one pass over the ids, each copying its row of this rank's shard or writing zeros (the shard mask
fused, no masked-id tensors)."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import pointer, threads_for

__all__ = ["vocab_embedding"]


def vocab_embedding(input_ids: Any, weight: Any, bounds: tuple[int, int, int, int, int]) -> Any:
    """Rows of ``weight`` ``[rows, D]`` for ``input_ids`` (int32/int64, any shape) under this rank's
    ``bounds`` ``(org_start, org_end, added_start, added_end, added_offset)``; ``[*ids.shape, D]``.
    Input is assumed validated (the op's check_inputs)."""
    import torch

    lib = load()
    if input_ids.device.type != "cpu" or weight.device.type != "cpu":
        raise NotImplementedError("the C++ embedding kernel takes CPU tensors")
    ids = input_ids.reshape(-1).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    dim = weight.shape[1]
    out = torch.empty((ids.shape[0], dim), dtype=weight.dtype)
    if ids.shape[0]:
        row_bytes = dim * weight.element_size()
        status = lib.dualop_vocab_embedding(
            int(ids.dtype == torch.int64), pointer(ids), pointer(weight), weight.stride(0) * weight.element_size(),
            pointer(out), ids.shape[0], row_bytes, *bounds, threads_for(ids.shape[0] * dim),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_vocab_embedding returned {status}")
    return out.reshape(*input_ids.shape, dim)
