"""Linear layers on the CPU with weights packed once for oneDNN (torch's ``mkldnn`` ops).

Why: at decode batch sizes (a few rows) ``F.linear`` on the CPU reaches a fraction of the memory
bandwidth a weight-streaming GEMM needs (measured here with bfloat16 and float32 weights of
Llama-sized layers: about 2x slower than the same product on a packed weight; docs/BENCHMARKS.md),
because oneDNN reorders the plain ``[N, K]`` weight into its blocked layout on every call. A weight
reordered once (``torch.ops.mkldnn._reorder_linear_weight``, the layout torch's own Inductor uses
for frozen CPU linears, and what the reference engine's CPU build does with its oneDNN handler)
is then multiplied by ``torch.ops.mkldnn._linear_pointwise`` with no per-call reorder. oneDNN does
the GEMM; nothing here rewrites it.

A packed weight is a torch tensor of ``mkldnn`` layout with the weight's shape and dtype, so the
linear ops take it where they take the weight (``check_inputs`` sees the same shape and dtype); its
values cannot be written in place, so a packed weight cannot go stale. Only the owner of the
weights packs them (``dualop.models`` does, for the linear layers of the models it builds on the
CPU): an op never packs a weight it is given, since it cannot know the weight will not change.
``unpacked`` recovers the plain array for the paths that need it (the native body).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["packable", "pack", "is_packed", "unpacked", "matmul"]

# The batch size oneDNN is told to expect when it picks the packed layout (any batch works with it).
_EXPECTED_ROWS = 16


@functools.lru_cache(maxsize=None)
def _bf16_supported() -> bool:
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packable(weight: Any) -> str | None:
    """None if ``weight`` can be packed for oneDNN here, else why not."""
    import torch

    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.ndim != 2:
        return "only 2-D CPU torch tensors are packed"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if weight.dtype == torch.bfloat16 and not _bf16_supported():
        return "oneDNN has no bfloat16 GEMM on this CPU"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN's packed linear here takes float32 and bfloat16, not {weight.dtype}"
    if weight.requires_grad:
        return "a weight that requires grad is trained, not packed"
    return None


def pack(weight: Any) -> Any:
    """``weight`` ``[N, K]`` reordered once into oneDNN's layout (a new tensor; the caller drops the
    plain one). ``ValueError`` where ``packable`` says it cannot be."""
    import torch

    why = packable(weight)
    if why is not None:
        raise ValueError(f"linear: cannot pack this weight for oneDNN: {why}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _EXPECTED_ROWS)


def is_packed(weight: Any) -> bool:
    """Whether ``weight`` is a packed (mkldnn-layout) torch tensor."""
    return bool(getattr(weight, "is_mkldnn", False))


def unpacked(weight: Any) -> Any:
    """The plain array of a packed weight (a new dense tensor); anything else as it is."""
    return weight.to_dense() if is_packed(weight) else weight


def matmul(x: Any, weight: Any, bias: Any = None) -> Any:
    """``x @ weight.T + bias`` in x's dtype (float32 accumulation): oneDNN on a packed weight, else
    ``F.linear``."""
    import torch

    if not is_packed(weight):  # every plain call of a linear op passes here: one import, no more
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
