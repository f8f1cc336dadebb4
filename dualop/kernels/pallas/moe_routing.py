"""MoE routing (``grouped_topk``) as a Pallas TPU kernel over blocks of tokens.

Each grid step holds ``block_rows`` tokens' router logits ``[block_rows, E]`` in VMEM (tokens on
sublanes, experts on lanes: E up to a few hundred is one small block) and does the whole of
``moe_math.route`` there: float32 softmax or sigmoid scores, the correction bias, the group scores
and the ``topk_group`` mask, ``top_k`` selection passes, renormalization and scaling.

Selection keeps ``jax.lax.top_k``'s rule exactly: each pass takes the largest remaining value and,
among equal values, the lowest expert index (a lane ``min`` over the indices holding the max); a
taken expert is removed by a mask, not by writing -inf, so values already -inf (masked groups)
still tie-break by index as ``top_k`` does. Groups are reduced with lane masks (one static pass per
group), so no in-kernel reshape of the expert axis is needed.

Non-finite values follow ``moe_math``'s rule: NaN ranks as -inf (experts and group scores), so every
pass finds a lane (ids stay in ``[0, E)``); the weights are the chosen values before ranking (a NaN
score weighs NaN, as in the native body).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualop.backends.xla import array_api as xp
from dualop.kernels import moe_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.pallas.common import (
    block_vmem_bytes,
    compiler_params,
    cost_estimate,
    resident_spec,
    row_blocks,
    tpu_jit,
)

__all__ = ["grouped_topk", "grouped_topk_reference"]

# float32 [rows, E] arrays alive at once in the kernel (logits, scores, choice, masks, iotas),
# double-buffered input included; sizes the token block.
_LIVE_ROW_ARRAYS = 10


def grouped_topk_reference(gating_output, e_score_correction_bias=None, **options):
    """The plain jax statement of the kernel: ``moe_math.route`` with jax's namespace."""
    return moe_math.route(xp, gating_output, e_score_correction_bias=e_score_correction_bias, **options)


def _ranked(values):
    """``values`` with NaN as -inf (``moe_math``'s ranking rule)."""
    return jnp.where(values == values, values, -jnp.inf)


def _first_max(values, taken, lane):
    """(max over the lanes not ``taken``, the lowest such lane holding it), each ``[rows, 1]``;
    ``values`` hold no NaN (``_ranked``).

    ``lane`` is the float32 lane index (exact below 2**24): float lane reductions are what every
    TPU generation's vector unit has."""
    width = values.shape[-1]
    best = jnp.max(jnp.where(taken, -jnp.inf, values), axis=-1, keepdims=True)
    at = jnp.min(jnp.where(~taken & (values == best), lane, float(width)), axis=-1, keepdims=True)
    return best, at


def _group_mask(choice, lane, *, num_groups: int, per_group: int, topk_group: int, has_bias: bool):
    """bool ``[rows, E]``: the experts of each token's ``topk_group`` best groups.

    A group scores its best biased score, or the sum of its two best when there is a bias
    (``moe_math.route``); groups are chosen with the same tie rule as experts. Group scores are
    kept as ``num_groups`` columns ``[rows, 1]`` (a handful), so everything stays elementwise."""
    group_of_lane = jnp.floor(lane / per_group)
    ranked = _ranked(choice)
    scores = []
    for g in range(num_groups):
        outside = group_of_lane != g
        first, at = _first_max(ranked, outside, lane)
        if has_bias and per_group > 1:
            second, _ = _first_max(ranked, outside | (lane == at), lane)
            first = _ranked(first + second)  # +inf + -inf ranks -inf
        scores.append(first)
    kept = [jnp.zeros(scores[0].shape, jnp.bool_) for _ in range(num_groups)]
    for _ in range(min(topk_group, num_groups)):
        best = functools.reduce(jnp.maximum, [jnp.where(k, -jnp.inf, s) for k, s in zip(kept, scores)])
        at = jnp.full(best.shape, num_groups, jnp.int32)
        for g in reversed(range(num_groups)):  # the lowest group holding the best score
            at = jnp.where(~kept[g] & (scores[g] == best), g, at)
        kept = [k | (at == g) for g, k in enumerate(kept)]
    mask = jnp.zeros(choice.shape, jnp.bool_)
    for g in range(num_groups):
        mask = mask | ((group_of_lane == g) & kept[g])
    return mask


def _kernel(*refs, top_k: int, renormalize: bool, num_expert_group: int, topk_group: int, scoring_func: str,
            routed_scaling_factor: float, has_bias: bool):
    logits_ref = refs[0]
    bias_ref = refs[1] if has_bias else None
    weights_ref, ids_ref = refs[-2:]

    scores = moe_math.expert_scores(xp, logits_ref[...], scoring_func)
    rows, num_experts = scores.shape
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, num_experts), 1).astype(jnp.float32)
    choice = scores if bias_ref is None else scores + bias_ref[...].astype(jnp.float32)
    if moe_math.uses_groups(num_experts, num_expert_group, topk_group):
        kept = _group_mask(choice, lane, num_groups=num_expert_group, per_group=num_experts // num_expert_group,
                           topk_group=topk_group, has_bias=has_bias)
        choice = jnp.where(kept, choice, -jnp.inf)

    slot = jax.lax.broadcasted_iota(jnp.int32, (rows, top_k), 1)
    weights = jnp.zeros((rows, top_k), jnp.float32)
    ids = jnp.zeros((rows, top_k), jnp.float32)
    taken = jnp.zeros((rows, num_experts), jnp.bool_)
    ranked = _ranked(choice)
    # Weighted by the unbiased score, or the chosen value itself (NaN kept) when there is no bias.
    weighed = choice if bias_ref is None else scores
    for j in range(top_k):
        _, at = _first_max(ranked, taken, lane)
        hit = lane == at
        taken = taken | hit
        weight = jnp.sum(jnp.where(hit, weighed, 0.0), axis=-1, keepdims=True)
        weights = jnp.where(slot == j, weight, weights)
        ids = jnp.where(slot == j, at, ids)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    weights_ref[...] = weights
    ids_ref[...] = ids.astype(jnp.int32)


@tpu_jit(static_argnames=("top_k", "renormalize", "num_expert_group", "topk_group", "scoring_func",
                          "routed_scaling_factor", "interpret", "block_rows"))
def grouped_topk(
    gating_output: jax.Array,
    e_score_correction_bias: jax.Array | None = None,
    *,
    top_k: int,
    renormalize: bool,
    num_expert_group: int = 0,
    topk_group: int = 0,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    interpret=False,
    block_rows: int | None = None,
):
    """``(topk_weights float32 [T, top_k], topk_ids int32 [T, top_k])`` for router logits
    ``gating_output`` ``[T, E]`` (any float dtype) and an optional bias ``[E]``.

    ``block_rows`` overrides the VMEM-budget choice of tokens per grid step (a multiple of 8);
    tests use it to force several blocks and a ragged last one.
    """
    tokens, num_experts = gating_output.shape
    if top_k > num_experts:
        raise ValueError(f"grouped_topk: top_k={top_k} is more than the {num_experts} experts of 'gating_output'")
    if tokens == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    has_bias = e_score_correction_bias is not None
    per_elem = 4 * _LIVE_ROW_ARRAYS
    blocks = row_blocks(tokens, num_experts, jnp.float32, bytes_per_elem=per_elem)
    br = blocks.block_rows if block_rows is None else min(block_rows, tokens)
    vmem = block_vmem_bytes(br, num_experts, jnp.float32, per_elem)
    kernel = functools.partial(
        _kernel, top_k=top_k, renormalize=renormalize, num_expert_group=num_expert_group, topk_group=topk_group,
        scoring_func=scoring_func, routed_scaling_factor=routed_scaling_factor, has_bias=has_bias)
    in_specs = [pl.BlockSpec((br, num_experts), lambda i: (i, 0))]
    operands = [gating_output]
    if has_bias:
        in_specs.append(resident_spec((1, num_experts)))
        operands.append(e_score_correction_bias.astype(jnp.float32).reshape(1, num_experts))
    out_spec = pl.BlockSpec((br, top_k), lambda i: (i, 0))
    n = tokens * num_experts
    cost = KernelCost(
        flops=n * (6 + 3 * top_k + (3 * num_expert_group if num_expert_group > 1 else 0)),
        transcendentals=n,
        bytes_accessed=n * gating_output.dtype.itemsize + tokens * top_k * 8 + (num_experts * 4 if has_bias else 0),
    )
    weights, ids = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(tokens, br),),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((tokens, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, top_k), jnp.int32)],
        compiler_params=compiler_params(1, vmem_bytes=vmem),
        cost_estimate=cost_estimate(cost),
        interpret=interpret,
        name="dualop_grouped_topk",
    )(*operands)
    return weights, ids
