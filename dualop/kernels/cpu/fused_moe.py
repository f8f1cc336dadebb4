"""The MoE experts on the CPU for torch tensors: the (token, slot) pairs sorted by expert
(``moe_math.sort_by_expert``), then each projection as one grouped matmul over the experts that
have tokens (kernel: ``csrc/moe.cc``), the activation and the weighted combine in between.

Why a C++ grouped matmul: torch's CPU matmuls return their operands' dtype (``torch.mm`` has no
float32 output for bfloat16 operands on the CPU; ``torch._grouped_mm`` requires the output dtype
to match), and the intermediate activation must stay float32 (``moe_math``'s rule). Through torch
that means widening the used experts' weights to float32 first (a pass writing twice their bytes),
then a float32 matmul, and on a CPU ``torch._grouped_mm`` with transposed weights is slower still
than one ``torch.mm`` per expert. The kernel reads the weights once at their own size and widens
them in registers (see BENCHMARKS.md for the measurements).
"""

from __future__ import annotations

from typing import Any

from dualop.kernels import moe_math
from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, pointer, threads_for
from dualop.ops._checks import decline_if_recording

__all__ = ["fused_experts"]

_OP = "unquantized_fused_moe"


def _grouped_linear(rows: Any, weights: Any, group_expert: Any, group_start: Any) -> Any:
    """float32 ``rows[r] @ weights[e].T`` for the rows of each group (expert ``group_expert[g]``,
    rows ``group_start[g]`` to ``group_start[g + 1]``); ``rows`` float32 ``[R, K]``, ``weights``
    ``[E, N, K]`` in any kernel dtype."""
    import torch

    _, n, k = weights.shape
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    status = load().dualop_moe_grouped_linear(
        dtype_code(weights), pointer(rows), pointer(weights), pointer(group_expert), pointer(group_start),
        group_expert.shape[0], pointer(out), n, k, threads_for(rows.shape[0] * n * k))
    if status != 0:
        raise NotImplementedError(f"dualop_moe_grouped_linear returned {status}")
    return out


def fused_experts(
    x: Any,
    topk_weights: Any,
    topk_ids: Any,
    w13: Any,
    w2: Any,
    w13_bias: Any = None,
    w2_bias: Any = None,
    expert_map: Any = None,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
) -> Any:
    """``[T, H]`` in ``x``'s dtype: ``sum_j w[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e])``
    over the local experts ``e`` of token ``t``'s slots (``moe_math.experts_reference``'s value)."""
    import torch

    from dualop.backends import array_namespace

    decline_if_recording(_OP, x, topk_weights, w13, w2, w13_bias, w2_bias)
    tensors = (x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        raise NotImplementedError(f"{_OP}: the CPU path takes CPU tensors")
    if dtype_code(w13) is None:
        raise NotImplementedError(f"{_OP}: the C++ CPU kernel has no {w13.dtype} weights")
    tokens, hidden = x.shape
    if tokens == 0:
        return x.new_empty((0, hidden))
    f32 = torch.float32
    num_local, top_k = w13.shape[0], topk_ids.shape[1]
    xp = array_namespace(x)
    local_ids = moe_math.local_expert_ids(xp, topk_ids, expert_map, num_local)
    order, group_sizes = moe_math.sort_by_expert(xp, local_ids, num_local)
    sizes = group_sizes.tolist()
    used = [e for e, count in enumerate(sizes) if count]
    counts = [sizes[e] for e in used]
    pairs = order[:sum(counts)]
    out = torch.zeros((tokens, hidden), dtype=f32)
    if not used:
        return out.to(x.dtype)
    token_of_row = torch.div(pairs, top_k, rounding_mode="floor")
    weight_of_row = topk_weights.reshape(-1).to(f32).index_select(0, pairs)
    rows = x.index_select(0, token_of_row).to(f32)
    if apply_router_weight_on_input:
        rows = rows * weight_of_row[:, None]
    group_expert = torch.tensor(used, dtype=torch.int64)
    group_start = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    expert_of_row = torch.repeat_interleave(group_expert, torch.tensor(counts))
    w13, w2 = w13.contiguous(), w2.contiguous()

    h = _grouped_linear(rows, w13, group_expert, group_start)
    if w13_bias is not None:
        h += w13_bias.to(f32).index_select(0, expert_of_row)
    y = _grouped_linear(moe_math.activate(xp, h, activation).contiguous(), w2, group_expert, group_start)
    if w2_bias is not None:
        y += w2_bias.to(f32).index_select(0, expert_of_row)
    if not apply_router_weight_on_input:
        y *= weight_of_row[:, None]
    out.index_add_(0, token_of_row, y)
    return out.to(x.dtype)
