"""Vocabulary-parallel embedding lookup on the CPU for torch tensors (kernel: ``csrc/embedding.cc``):
a pass that checks every id against the vocabulary, then one pass over the ids, each copying its
row of this rank's shard or writing zeros (the shard mask fused, no masked-id tensors). At decode
sizes the call's fixed cost is the point, so the wrapper does no more than it must."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import threads_for

__all__ = ["vocab_embedding", "OutOfVocabulary"]


class OutOfVocabulary(ValueError):
    """An id is negative or ``>= num_embeddings``; nothing was written."""


def vocab_embedding(input_ids: Any, weight: Any, bounds: tuple[int, int, int, int, int], num_embeddings: int) -> Any:
    """Rows of ``weight`` ``[rows, D]`` for ``input_ids`` (int32/int64, any shape) under this rank's
    ``bounds`` ``(org_start, org_end, added_start, added_end, added_offset)``; ``[*ids.shape, D]``.
    Raises ``OutOfVocabulary`` before writing when an id is outside ``[0, num_embeddings)``."""
    import torch

    lib = load()
    if input_ids.device.type != "cpu" or weight.device.type != "cpu":
        raise NotImplementedError("the C++ embedding kernel takes CPU tensors")
    ids = input_ids if input_ids.ndim == 1 and input_ids.is_contiguous() else input_ids.reshape(-1).contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    tokens, dim = ids.shape[0], weight.shape[1]
    out = torch.empty((tokens, dim), dtype=weight.dtype)
    if tokens:
        itemsize = weight.element_size()
        status = lib.dualop_vocab_embedding(
            ids.dtype == torch.int64, ids.data_ptr(), weight.data_ptr(), weight.stride(0) * itemsize,
            out.data_ptr(), tokens, dim * itemsize, *bounds, threads_for(tokens * dim), num_embeddings,
        )
        if status == 2:
            raise OutOfVocabulary
        if status != 0:
            raise NotImplementedError(f"dualop_vocab_embedding returned {status}")
    return out if input_ids.ndim == 1 else out.reshape(*input_ids.shape, dim)
