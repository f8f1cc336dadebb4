"""MoE routing on the CPU for torch tensors (kernel: ``csrc/moe.cc``, ``dualop_grouped_topk``).

One pass per token row: scores, groups, ``top_k`` picks of the largest free score (ties to the
lower expert index, ``moe_math``'s rule), renormalisation and scaling. The native body takes a
dozen torch ops and a stable sort of every row; at decode sizes their launch cost dominates and at
256 experts the sort does (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any

from dualop.kernels import moe_math
from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.backends.torch.recording import decline_if_recording
from dualop.kernels.cpu.abi import c_function

_C_GROUPED_TOPK = c_function(
    "int dualop_grouped_topk(const DualopArray* logits, const DualopArray* bias, const DualopArray* weights, "
    "const DualopArray* ids, int renormalize, int64_t groups, int topk_group, int scoring, float scale, int threads)"
)

__all__ = ["grouped_topk"]

_OP = "grouped_topk"
_SCORING_CODES = {"softmax": 0, "sigmoid": 1}


def grouped_topk(gating_output: Any, e_score_correction_bias: Any, *, top_k: int, renormalize: bool,
                 num_expert_group: int, topk_group: int, scoring_func: str,
                 routed_scaling_factor: float) -> tuple[Any, Any]:
    """``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])``: ``moe_math.route``'s value."""
    import torch

    decline_if_recording(_OP, gating_output, e_score_correction_bias)
    if dtype_code(gating_output) is None:
        raise NotImplementedError(f"{_OP}: dtype {gating_output.dtype} on {gating_output.device} has no CPU kernel")
    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    tokens, experts = gating_output.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32)
    ids = torch.empty((tokens, top_k), dtype=torch.int32)
    if tokens == 0:
        return weights, ids
    logits = gating_output.contiguous()
    bias = None if e_score_correction_bias is None else e_score_correction_bias.to(torch.float32).contiguous()
    groups = num_expert_group if moe_math.uses_groups(experts, num_expert_group, topk_group) else 0
    status = _C_GROUPED_TOPK(
        logits=logits, bias=bias, weights=weights, ids=ids, renormalize=int(renormalize), groups=groups,
        topk_group=topk_group,
        scoring=_SCORING_CODES[scoring_func], scale=routed_scaling_factor,
        threads=threads_for(tokens * experts * top_k),
    )
    if status != 0:
        raise NotImplementedError(f"dualop_grouped_topk returned {status}")
    return weights, ids
