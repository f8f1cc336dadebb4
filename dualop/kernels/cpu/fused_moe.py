"""The MoE experts on the CPU for torch tensors: a grouped matmul over the (token, slot) pairs
sorted by expert, computing only the experts that have tokens.

Both projections run in float32 (the intermediate activation stays float32, ``moe_math``'s rule):
torch's CPU matmuls return their operands' dtype (``torch.mm`` has no float32 output for bfloat16
operands on the CPU, and ``torch._grouped_mm`` requires the output dtype to match), so a 16-bit
layer's weights are widened to float32 - only the experts that have tokens, once per call.

The grouped matmul is ``torch._grouped_mm`` (one ATen call for all experts) where this torch has it
and the strides are 16-byte aligned (``H`` and ``I`` multiples of 4 in float32); else one
``torch.mm`` per expert with tokens.
"""

from __future__ import annotations

from typing import Any

from dualop.kernels import moe_math
from dualop.ops._checks import decline_if_recording

__all__ = ["fused_experts"]

_OP = "unquantized_fused_moe"
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _has_grouped_mm() -> bool:
    import torch

    return hasattr(torch, "_grouped_mm")


def _grouped_linear(rows: Any, weights: Any, counts: list[int]) -> Any:
    """``rows[s:e] @ weights[i].T`` for consecutive row ranges of ``counts[i]`` rows, float32.

    ``weights`` ``[G, N, K]`` float32 holds only the groups that have rows (every count > 0)."""
    import torch

    _, n, k = weights.shape
    if _has_grouped_mm() and n % 4 == 0 and k % 4 == 0 and len(counts) > 1:
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
    out = rows.new_empty((rows.shape[0], n))
    start = 0
    for group, count in enumerate(counts):
        torch.mm(rows[start:start + count], weights[group].T, out=out[start:start + count])
        start += count
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
    if str(x.dtype).removeprefix("torch.") not in _FLOAT_DTYPES:
        raise NotImplementedError(f"{_OP}: the CPU path has no {x.dtype} matmul")
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
    experts = torch.tensor(used, dtype=torch.int64)
    expert_of_row = torch.repeat_interleave(torch.arange(len(used)), torch.tensor(counts))

    def used_weights(w: Any) -> Any:
        w = w if len(used) == num_local else w.index_select(0, experts)
        return w.to(f32).contiguous()

    h = _grouped_linear(rows, used_weights(w13), counts)
    if w13_bias is not None:
        h += used_weights(w13_bias).index_select(0, expert_of_row)
    y = _grouped_linear(moe_math.activate(xp, h, activation), used_weights(w2), counts)
    if w2_bias is not None:
        y += used_weights(w2_bias).index_select(0, expert_of_row)
    if not apply_router_weight_on_input:
        y *= weight_of_row[:, None]
    out.index_add_(0, token_of_row, y)
    return out.to(x.dtype)
