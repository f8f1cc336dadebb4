"""The MoE experts on the CPU for torch tensors: the (token, slot) pairs sorted by expert
(``moe_math.sort_by_expert``), then each projection as a grouped matmul over only the experts that
have tokens, the activation (float32) and the weighted combine in between.

The intermediate activation must stay float32 (``moe_math``'s rule), and torch's CPU matmuls
return their operands' dtype (``torch.mm`` has no float32 output for bfloat16 operands on the CPU;
``torch._grouped_mm`` requires the output dtype to match, and with transposed weights it measured
slower than one ``torch.mm`` per expert). So a 16-bit layer's matmuls run in float32. For the
small groups of decode the C++ kernel (``csrc/moe.cc``) reads each weight once at its own size and
widens it in registers; larger groups are compute-bound and go to torch's float32 matmul with that
expert's weights widened once.
"""

from __future__ import annotations

from typing import Any

from dualop.kernels import moe_math
from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, pointer, threads_for
from dualop.ops._checks import decline_if_recording

__all__ = ["fused_experts"]

_OP = "unquantized_fused_moe"
# Row count from which torch's float32 matmul beats the C++ kernel on one expert's group.
_KERNEL_MAX_ROWS = 16


def _grouped_linear(rows: Any, weights: Any, used: list[int], counts: list[int]) -> Any:
    """float32 ``rows[r] @ weights[used[g]].T`` for consecutive row groups of ``counts[g]`` rows;
    ``rows`` float32 ``[R, K]``, ``weights`` ``[E, N, K]`` in any kernel dtype.

    Groups of fewer than ``_KERNEL_MAX_ROWS`` rows (decode) go to the C++ kernel, which reads each
    weight once at its own size; larger groups are compute-bound and go to torch's float32
    matmul with that expert's weights widened (measured crossover, BENCHMARKS.md). The kernel
    needs each weight row contiguous (``K`` innermost); other layouts (the transposed views of
    transformers' gpt-oss weights) take torch's matmul for every group rather than a copy of
    every expert."""
    import torch

    _, n, k = weights.shape
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    rows_contiguous = weights.stride(2) == 1 and weights.stride(1) == k and weights.stride(0) == n * k
    small = [g for g, count in enumerate(counts) if count < _KERNEL_MAX_ROWS and rows_contiguous]
    if small:
        group_expert = torch.tensor([used[g] for g in small], dtype=torch.int64)
        group_start = torch.tensor([starts[g] for g in small], dtype=torch.int64)
        group_end = torch.tensor([starts[g + 1] for g in small], dtype=torch.int64)
        status = load().dualop_moe_grouped_linear(
            dtype_code(weights), pointer(rows), pointer(weights), pointer(group_expert), pointer(group_start),
            pointer(group_end), len(small), pointer(out), n, k,
            threads_for(sum(counts[g] for g in small) * n * k))
        if status != 0:
            raise NotImplementedError(f"dualop_moe_grouped_linear returned {status}")
    for g, count in enumerate(counts):
        if count >= _KERNEL_MAX_ROWS or not rows_contiguous:
            torch.mm(rows[starts[g]:starts[g + 1]], weights[used[g]].to(torch.float32).T,
                     out=out[starts[g]:starts[g + 1]])
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
    float32_output: bool = False,
) -> Any:
    """``[T, H]`` in ``x``'s dtype (float32 with ``float32_output``): ``sum_j w[t, j] * (w2[e] @
    act(w13[e] @ x[t] + b13[e]) + b2[e])`` over the local experts ``e`` of token ``t``'s slots
    (``moe_math.experts_reference``'s value)."""
    import torch

    from dualop.backends import array_namespace

    decline_if_recording(_OP, x, topk_weights, w13, w2, w13_bias, w2_bias)
    tensors = (x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        raise NotImplementedError(f"{_OP}: the CPU path takes CPU tensors")
    if dtype_code(w13) is None:
        raise NotImplementedError(f"{_OP}: the C++ CPU kernel has no {w13.dtype} weights")
    tokens, hidden = x.shape
    out_dtype = torch.float32 if float32_output else x.dtype
    if tokens == 0:
        return x.new_empty((0, hidden), dtype=out_dtype)
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
        return out.to(out_dtype)
    token_of_row = torch.div(pairs, top_k, rounding_mode="floor")
    weight_of_row = topk_weights.reshape(-1).to(f32).index_select(0, pairs)
    rows = x.index_select(0, token_of_row).to(f32)
    if apply_router_weight_on_input:
        rows = rows * weight_of_row[:, None]
    expert_of_row = torch.repeat_interleave(torch.tensor(used), torch.tensor(counts))

    h = _grouped_linear(rows, w13, used, counts)
    if w13_bias is not None:
        h += w13_bias.to(f32).index_select(0, expert_of_row)
    y = _grouped_linear(moe_math.activate(xp, h, activation).contiguous(), w2, used, counts)
    if w2_bias is not None:
        y += w2_bias.to(f32).index_select(0, expert_of_row)
    if not apply_router_weight_on_input:
        y *= weight_of_row[:, None]
    out.index_add_(0, token_of_row, y)
    return out.to(out_dtype)
