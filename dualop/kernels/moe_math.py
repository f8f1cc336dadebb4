"""Mixture-of-experts formulas, written once against an array namespace ``xp``: routing (softmax or
sigmoid scores, grouped top-k with a correction bias), the experts' activations, and the dense
reference the native bodies of ``fused_moe`` and ``unquantized_fused_moe`` compute.

Every kernel path (Pallas, Triton, the CPU paths, ``ragged_dot``) must agree with these under the
tolerance table; the native bodies are checked against transformers' MoE blocks.

Conventions every path follows:

- ``w13`` is ``[E, 2I, H]`` with the gate rows first (``[gate | up]``) for ``silu``/``gelu``/
  ``gelu_tanh``; interleaved (gate rows 0, 2, 4, ...; up rows 1, 3, 5, ...) for ``swigluoai``, as
  gpt-oss stores it; ``[E, I, H]`` for ``relu2`` (no gate). ``w2`` is ``[E, H, I]``.
- The intermediate activation stays float32 (one cast, at the end; ``float32_output`` leaves the
  cast to a caller that first adds several devices' outputs): a kernel that feeds a 16-bit
  matrix unit must not round it to 16 bits (split it into a high and a low 16-bit half and do two
  matmuls, as the paged attention kernels do for ``p . v``, or keep float32 operands).
- Top-k picks the largest values; among equal values the LOWER index comes first. That is
  ``jax.lax.top_k``'s documented rule. ``torch.topk`` leaves the order of equal values unspecified
  (on this CPU ``torch.topk([1, 3, 3, 2, 3, 1], 2)`` returns indices ``[2, 4]``), so dualop does not
  inherit it: the torch namespace's ``top_k`` is a stable descending sort, and every kernel keeps
  the lower index on ties. On distinct values all of them equal ``torch.topk(sorted=True)``.
- Routed weights are float32 and ids int32, ``[T, top_k]``, in descending order of the selection
  score (score + correction bias when there is one).
- Non-finite routing (``route``; every path keeps it): a NaN selection score (a NaN or +inf
  router logit, or a row of only -inf, under softmax makes the whole row NaN; a NaN logit under
  sigmoid, that expert's score; a NaN correction-bias entry, that expert's score on every token;
  a lone -inf logit is a score of 0, not NaN) RANKS AS -inf, for the experts and for the group
  scores alike (a group's two best summing +inf and -inf rank -inf too).
  So ids always lie in ``[0, E)``, ties among -inf (NaN, masked groups) go to the lower index as
  any other tie, and an expert whose bias entry is NaN is chosen only when fewer than ``top_k``
  experts of the kept groups have a finite biased score. The weight of a chosen expert is its
  value as before ranking: the unbiased score (NaN stays NaN, so the token's weights renormalize
  to NaN and its MoE output is NaN on every path), or -inf for a dropped group's expert when there
  is no bias. Routing is per token: nothing non-finite in one row changes another row.
- A (token, slot) pair whose expert lives elsewhere (``local_expert_ids`` -1) adds exactly nothing
  to the token, whatever its weight (NaN or inf included): every path selects it away, never
  multiplies it by 0.
"""

from __future__ import annotations

from dualop.kernels.gate_math import GateSpec, apply_gate, gate_and_up

__all__ = [
    "MOE_ACTIVATIONS", "SCORING_FUNCS", "gate_spec", "is_gated", "w13_rows", "activate",
    "expert_scores", "uses_groups", "route", "local_expert_ids", "routing_matrix", "experts_reference",
    "sort_by_expert",
]

MOE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")
SCORING_FUNCS = ("softmax", "sigmoid")

# gpt-oss's clamped SwiGLU constants.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def gate_spec(activation: str) -> GateSpec | None:
    """The gated activation of ``activation`` (None for ``relu2``, which has no gate)."""
    if activation == "relu2":
        return None
    if activation == "swigluoai":
        return GateSpec("swigluoai", interleaved=True, alpha=SWIGLUOAI_ALPHA, limit=SWIGLUOAI_LIMIT)
    return GateSpec(activation)


def is_gated(activation: str) -> bool:
    return activation != "relu2"


def w13_rows(activation: str, intermediate_size: int) -> int:
    """Rows of ``w13`` per expert: ``2 * I`` for gated activations, ``I`` for ``relu2``."""
    return 2 * intermediate_size if is_gated(activation) else intermediate_size


def activate(xp, h, activation: str):
    """The experts' activation on float32 ``h`` ``[..., w13_rows]`` -> ``[..., I]``."""
    spec = gate_spec(activation)
    if spec is None:
        r = xp.maximum(h, 0.0)
        return r * r
    gate, up = gate_and_up(h, h.shape[-1] // 2, spec)
    return apply_gate(xp, gate, up, spec)


def expert_scores(xp, gating_output, scoring_func: str):
    """float32 scores ``[T, E]``: softmax or sigmoid of the router logits."""
    logits = xp.astype(gating_output, xp.float32)
    if scoring_func == "sigmoid":
        return xp.sigmoid(logits)
    return xp.softmax(logits, axis=-1)


def uses_groups(num_experts: int, num_expert_group: int, topk_group: int) -> bool:
    """Whether grouped selection applies: more than one group dividing the experts evenly (and a
    positive ``topk_group``); otherwise routing is plain top-k."""
    return num_expert_group > 1 and topk_group > 0 and num_experts % num_expert_group == 0


def _ranked(xp, values):
    """``values`` with NaN as -inf: what routing ranks (experts and groups alike)."""
    return xp.where(values == values, values, float("-inf"))


def route(
    xp,
    gating_output,
    *,
    top_k: int,
    renormalize: bool,
    num_expert_group: int = 0,
    topk_group: int = 0,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias=None,
):
    """(topk_weights float32 ``[T, k]``, topk_ids int32 ``[T, k]``): the reference engine's
    ``grouped_topk`` (plain top-k when groups do not apply).

    Experts are chosen by ``score + bias`` and weighted by the unbiased ``score``. With groups, a
    group's score is the sum of its two best biased scores when there is a bias, its best score
    otherwise; only the ``topk_group`` best groups compete (the rest are set to ``-inf``). Then the
    weights are renormalized (if asked) and multiplied by ``routed_scaling_factor``. NaN ranks as
    -inf everywhere (the module docstring's rule), so the result does not depend on how a
    framework's top-k orders NaN (torch's sort puts every NaN first, ``jax.lax.top_k`` +NaN first
    and -NaN last).
    """
    scores = expert_scores(xp, gating_output, scoring_func)
    tokens, num_experts = scores.shape
    choice = scores if e_score_correction_bias is None else scores + xp.astype(e_score_correction_bias, xp.float32)
    if uses_groups(num_experts, num_expert_group, topk_group):
        per_group = num_experts // num_expert_group
        grouped = xp.reshape(_ranked(xp, choice), (tokens, num_expert_group, per_group))
        if e_score_correction_bias is None:
            group_scores = xp.amax(grouped, axis=-1)
        else:
            group_scores = xp.sum(xp.top_k(grouped, min(2, per_group))[0], axis=-1)
        _, best_groups = xp.top_k(_ranked(xp, group_scores), min(topk_group, num_expert_group))
        kept_groups = xp.amax(xp.astype(best_groups[..., None] == xp.arange(num_expert_group, like=best_groups), xp.float32),
                              axis=-2)  # [T, G]: 1 where the group is among the best
        kept = xp.reshape(xp.stack([kept_groups] * per_group, axis=-1), (tokens, num_experts))
        choice = xp.where(kept > 0.0, choice, float("-inf"))
    _, topk_ids = xp.top_k(_ranked(xp, choice), top_k)
    # the chosen experts' values before ranking: a NaN score weighs NaN, not -inf
    topk_weights = xp.take_along_last(choice if e_score_correction_bias is None else scores, topk_ids)
    if renormalize:
        topk_weights = topk_weights / xp.sum(topk_weights, axis=-1, keepdims=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, xp.astype(topk_ids, xp.int32)


def local_expert_ids(xp, topk_ids, expert_map, num_local_experts: int):
    """Each routed expert's index among this device's ``num_local_experts`` experts, or -1 when it
    lives elsewhere (``expert_map[global id]`` is -1) or the id is out of range (ids outside
    ``[0, E_global)`` and map entries outside ``[0, E_local)`` count as -1, so a traced bad id adds
    nothing instead of reading out of bounds; eager calls reject them before this)."""
    num_global = num_local_experts if expert_map is None else expert_map.shape[0]
    ids = xp.astype(topk_ids, xp.int32)
    valid = (ids >= 0) & (ids < num_global)
    ids = xp.where(valid, ids, 0)
    if expert_map is not None:
        ids = xp.astype(xp.take(expert_map, ids), xp.int32)
        valid = valid & (ids >= 0) & (ids < num_local_experts)
    return xp.where(valid, ids, -1)


def routing_matrix(xp, topk_weights, local_ids, num_local_experts: int):
    """float32 ``[T, E_local]``: token t's weight for local expert e (0 when not routed to it; the
    slots of a token routed to experts elsewhere, id -1, add nothing). Other slots' weights are
    selected away, not multiplied by 0: a NaN weight on one slot reaches only its own expert."""
    hits = local_ids[..., None] == xp.arange(num_local_experts, like=local_ids)
    return xp.sum(xp.where(hits, xp.astype(topk_weights, xp.float32)[..., None], 0.0), axis=-2)


def experts_reference(
    xp,
    x,
    topk_weights,
    topk_ids,
    w13,
    w2,
    *,
    activation: str = "silu",
    w13_bias=None,
    w2_bias=None,
    expert_map=None,
    apply_router_weight_on_input: bool = False,
    float32_output: bool = False,
):
    """The experts' output ``[T, H]`` in ``x``'s dtype (float32 with ``float32_output``: the sum
    before the one cast, for a caller that adds partial outputs across devices and casts after),
    computed densely in float32: every local expert on every token, weighted by the routing matrix
    (zero for experts a token does not use).

    ``out[t] = sum_e r[t, e] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e])``; with
    ``apply_router_weight_on_input`` (top_k 1) the weight scales the input instead,
    ``x[t] * w[t]``, and ``r`` is 1 where routed. O(T * E * I * H): the reference, not a fast path.
    """
    f32 = xp.float32
    num_local = w13.shape[0]
    local_ids = local_expert_ids(xp, topk_ids, expert_map, num_local)
    xf = xp.astype(x, f32)
    if apply_router_weight_on_input:
        xf = xf * xp.astype(topk_weights, f32)[:, :1]
        topk_weights = xp.astype(local_ids >= 0, f32)
    routing = routing_matrix(xp, topk_weights, local_ids, num_local)  # [T, E]
    h = xp.einsum("th,enh->ten", xf, xp.astype(w13, f32))
    if w13_bias is not None:
        h = h + xp.astype(w13_bias, f32)[None]
    a = activate(xp, h, activation)  # [T, E, I]
    y = xp.einsum("tei,ehi->teh", a, xp.astype(w2, f32))
    if w2_bias is not None:
        y = y + xp.astype(w2_bias, f32)[None]
    # Only the experts a token is routed to count: an unrouted expert's output (NaN or inf when the
    # token holds one) must not reach the sum as 0 * NaN.
    routed = routing_matrix(xp, xp.astype(local_ids >= 0, f32), local_ids, num_local) > 0.0  # [T, E]
    weighted = xp.where(routed[..., None], y * routing[..., None], 0.0)
    out = xp.sum(weighted, axis=1)
    return out if float32_output else xp.astype(out, x.dtype)


def sort_by_expert(xp, local_ids, num_local_experts: int):
    """The (token, slot) pairs grouped by local expert, for grouped-matmul paths.

    Returns ``(order, group_sizes)``: ``order`` int ``[T * k]`` lists flat pair indices (``t * k +
    j``; the token is ``order // k``) sorted by local expert, stably (a token's pairs keep their
    slot order within an expert), pairs for other devices' experts (id -1) last; ``group_sizes``
    int32 ``[E_local]`` counts each local expert's rows, so ``sum(group_sizes)`` rows are real
    and the rest of ``order`` belongs to no local expert (weight 0).
    """
    flat = xp.reshape(local_ids, (-1,))
    key = xp.where(flat < 0, num_local_experts, flat)
    return xp.argsort(key, bound=num_local_experts + 1), xp.bincount(flat, num_local_experts)
