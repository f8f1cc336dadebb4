"""MoE routing as one Triton kernel: the ``grouped_topk`` op's CUDA/ROCm path.

The rule is ``moe_math.route``'s: float32 softmax or sigmoid scores of the router logits; experts
chosen by ``score + bias`` (the correction bias, when given) and weighted by the unbiased score;
with groups (``moe_math.uses_groups``) a group scores its best biased score (the sum of its two
best when there is a bias) and only the ``topk_group`` best groups compete; then renormalize and
scale. Ties go to the LOWER index, for groups and experts alike.

Grid: one program per block of ``BLOCK_T`` tokens; a program holds its tokens' ``[BLOCK_T, E]``
logits (E padded to a power of two, the padding never chosen). Every top-k is ``k`` passes of
"largest available value, then the lowest available index holding it", so ties resolve exactly
as ``jax.lax.top_k`` does, ``-inf`` included (experts of dropped groups are still chosen, lowest
index first, when ``top_k`` exceeds the experts left). Group scores are built with one masked
reduction per group (``num_expert_group`` is a constexpr), so any group size works.

Non-finite values follow ``moe_math``'s rule: NaN ranks as -inf (experts and group scores), so every
pick finds an available index (ids stay in ``[0, E)``); the weights are the chosen values before
ranking (a NaN score weighs NaN, as in the native body).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels import moe_math

__all__ = ["grouped_topk"]


@triton.jit
def _ranked(values):
    """``values`` with NaN as -inf (``moe_math``'s ranking rule)."""
    return tl.where(values == values, values, float("-inf"))


@triton.jit
def _pick(values, available, idx, NO_INDEX: tl.constexpr):
    """(largest available value per row, the lowest available index holding it) of ``[R, C]``
    ``values`` holding no NaN (``_ranked``)."""
    best = tl.max(tl.where(available, values, float("-inf")), axis=1)
    hit = available & (values == best[:, None])
    # An available -inf equals best = -inf; a row with nothing available picks NO_INDEX.
    chosen = tl.min(tl.where(hit, idx[None, :], NO_INDEX), axis=1)
    return best, chosen


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_tokens, logits_stride, routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    USE_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr, G_PAD: tl.constexpr, PER_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, SCALE: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    experts = tl.arange(0, E_PAD)
    expert_ok = experts < NUM_EXPERTS
    rows = tl.where(token_ok, tokens, 0).to(tl.int64)  # rows past T re-read row 0, never stored
    logits = tl.load(logits_ptr + rows[:, None] * logits_stride + experts[None, :],
                     mask=(rows >= 0)[:, None] & expert_ok[None, :], other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])  # padding columns: exp(-inf) = 0
        scores = e / tl.sum(e, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + experts, mask=expert_ok, other=0.0).to(tl.float32)[None, :]
    available = expert_ok[None, :] & (tokens >= 0)[:, None]  # [BLOCK_T, E_PAD] booleans

    if USE_GROUPS:
        group_of = experts // PER_GROUP
        groups = tl.arange(0, G_PAD)
        group_scores = tl.full([BLOCK_T, G_PAD], float("-inf"), tl.float32)
        ranked = _ranked(choice)
        for g in tl.static_range(NUM_GROUPS):
            in_group = available & (group_of == g)[None, :]
            first, first_idx = _pick(ranked, in_group, experts, E_PAD)
            score = first
            if HAS_BIAS:
                if PER_GROUP > 1:
                    second, _ = _pick(ranked, in_group & (experts[None, :] != first_idx[:, None]), experts, E_PAD)
                    score = _ranked(first + second)  # +inf + -inf ranks -inf
            group_scores = tl.where(groups[None, :] == g, score[:, None], group_scores)
        group_open = (groups < NUM_GROUPS)[None, :] & (tokens >= 0)[:, None]
        expert_kept = available & (experts < 0)[None, :]  # all False, [BLOCK_T, E_PAD]
        for _ in tl.static_range(TOPK_GROUP):
            _, best_group = _pick(group_scores, group_open, groups, G_PAD)
            expert_kept = expert_kept | (group_of[None, :] == best_group[:, None])
            group_open = group_open & (groups[None, :] != best_group[:, None])
        # Experts of dropped groups stay available but score -inf (moe_math.route masks them so).
        choice = tl.where(expert_kept, choice, float("-inf"))

    slots = tl.arange(0, K_PAD)
    out_w = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    out_id = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    ranked = _ranked(choice)
    # Weighted by the unbiased score, or the chosen value itself (NaN kept) when there is no bias.
    weighed = scores if HAS_BIAS else choice
    for j in tl.static_range(TOP_K):
        _, chosen = _pick(ranked, available, experts, E_PAD)
        weight = tl.sum(tl.where(experts[None, :] == chosen[:, None], weighed, 0.0), axis=1)
        out_w = tl.where(slots[None, :] == j, weight[:, None], out_w)
        out_id = tl.where(slots[None, :] == j, chosen[:, None], out_id)
        available = available & (experts[None, :] != chosen[:, None])
    if RENORMALIZE:
        out_w = out_w / tl.sum(out_w, axis=1)[:, None]
    if SCALE:
        out_w = out_w * routed_scaling_factor
    out_mask = token_ok[:, None] & (slots < TOP_K)[None, :]
    offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, out_w, mask=out_mask)
    tl.store(ids_ptr + offs, out_id, mask=out_mask)


def grouped_topk(gating_output, e_score_correction_bias, *, top_k, renormalize, num_expert_group, topk_group,
                 scoring_func, routed_scaling_factor):
    """``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])`` of ``moe_math.route`` for
    torch ``gating_output`` ``[T, E]``. Input is assumed validated by the op."""
    num_tokens, num_experts = gating_output.shape
    device = gating_output.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    if gating_output.stride(-1) != 1:
        gating_output = gating_output.contiguous()
    bias = e_score_correction_bias
    if bias is not None:
        bias = bias.contiguous()
    use_groups = moe_math.uses_groups(num_experts, num_expert_group, topk_group)
    num_groups = num_expert_group if use_groups else 1
    e_pad = triton.next_power_of_2(num_experts)
    # A program's [BLOCK_T, E_PAD] tiles stay within 2K float32 values: 16 per thread of 4 warps
    # (4K values took 254 registers at E=256 on sm_90, per `dualop compile`).
    block_t = max(1, min(16, 2048 // e_pad, triton.next_power_of_2(num_tokens)))
    _grouped_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        gating_output, gating_output if bias is None else bias, weights, ids,
        num_tokens, gating_output.stride(0), float(routed_scaling_factor),
        NUM_EXPERTS=num_experts, E_PAD=e_pad, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        BLOCK_T=block_t, SIGMOID=scoring_func == "sigmoid", HAS_BIAS=bias is not None,
        RENORMALIZE=bool(renormalize), USE_GROUPS=use_groups, NUM_GROUPS=num_groups,
        G_PAD=triton.next_power_of_2(num_groups), PER_GROUP=num_experts // num_groups,
        TOPK_GROUP=min(topk_group, num_groups) if use_groups else 0, SCALE=routed_scaling_factor != 1.0,
        num_warps=4,
    )
    return weights, ids
