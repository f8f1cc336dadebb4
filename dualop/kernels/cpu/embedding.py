"""Vocabulary-parallel embedding lookup on the CPU for torch tensors (kernel: ``csrc/embedding.cc``):
a pass that checks every id against the vocabulary, then one pass over the ids, each copying its
row of this rank's shard or writing zeros (the shard mask fused, no masked-id tensors). At decode
sizes the call's fixed cost is the point, so the wrapper does no more than it must."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import threads_for
from dualop.kernels.cpu.abi import c_function

_C_VOCAB_EMBEDDING = c_function(
    "int dualop_vocab_embedding(int ids_are_64, const void* ids, const void* weight, int64_t weight_row_stride, "
    "void* out, int64_t tokens, int64_t row_bytes, int64_t org_start, int64_t org_end, int64_t added_start, "
    "int64_t added_end, int64_t added_offset, int threads, int64_t num_embeddings)"
)

__all__ = ["vocab_embedding", "OutOfVocabulary"]


class OutOfVocabulary(ValueError):
    """An id is negative or ``>= num_embeddings``; nothing was written."""


def vocab_embedding(input_ids: Any, weight: Any, bounds: tuple[int, int, int, int, int], num_embeddings: int) -> Any:
    """Rows of ``weight`` ``[rows, D]`` for ``input_ids`` (int32/int64, any shape) under this rank's
    ``bounds`` ``(org_start, org_end, added_start, added_end, added_offset)``; ``[*ids.shape, D]``.
    Raises ``OutOfVocabulary`` before writing when an id is outside ``[0, num_embeddings)``."""
    import torch

    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    if input_ids.device.type != "cpu" or weight.device.type != "cpu":
        raise NotImplementedError("the C++ embedding kernel takes CPU tensors")
    ids = input_ids if input_ids.ndim == 1 and input_ids.is_contiguous() else input_ids.reshape(-1).contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    tokens, dim = ids.shape[0], weight.shape[1]
    out = torch.empty((tokens, dim), dtype=weight.dtype)
    if tokens:
        itemsize = weight.element_size()
        org_start, org_end, added_start, added_end, added_offset = bounds
        status = _C_VOCAB_EMBEDDING(
            ids_are_64=ids.dtype == torch.int64, ids=ids, weight=weight,
            weight_row_stride=weight.stride(0) * itemsize, out=out, tokens=tokens, row_bytes=dim * itemsize,
            org_start=org_start, org_end=org_end, added_start=added_start, added_end=added_end,
            added_offset=added_offset, threads=threads_for(tokens * dim), num_embeddings=num_embeddings,
        )
        if status == 2:
            raise OutOfVocabulary
        if status != 0:
            raise NotImplementedError(f"dualop_vocab_embedding returned {status}")
    return out if input_ids.ndim == 1 else out.reshape(*input_ids.shape, dim)
