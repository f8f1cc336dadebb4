"""The paged KV cache write on the CPU for torch tensors: the torch operator of
``csrc/torch/ops.cc`` (each token's key and value rows copied into their slot, in token order).
Calls it does not take go to the op's torch path (``index_copy_``)."""

from __future__ import annotations

from dualop.kernels.cpu.torch_ops import TorchOperator

__all__ = ["FAST_RESHAPE_AND_CACHE"]

# FAST_RESHAPE_AND_CACHE.get()(key, value, kv_pages, slot_mapping) returns kv_pages, written, or
# None for a call it does not take (a slot past the cache among them: nothing written then).
FAST_RESHAPE_AND_CACHE = TorchOperator("reshape_and_cache")
