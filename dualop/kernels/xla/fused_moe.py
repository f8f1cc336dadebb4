"""The MoE experts for jax arrays with XLA's grouped matmul, ``jax.lax.ragged_dot_general``: the
(token, slot) pairs sorted by local expert (``moe_math.sort_by_expert``), both projections as one
ragged matmul each over the experts' row groups, the activation and the weighted combine in between.
The op runs it for jax arrays on the CPU and on GPUs (XLA lowers the ragged matmul for each).

The weights are read in their stored layout (``w13`` ``[E, rows, H]``, ``w2`` ``[E, H, I]``
contract their last dim), so no transposed copy of them is made. Both matmuls accumulate in
float32. The float32 intermediate is never rounded to 16 bits (``moe_math``'s rule): on GPUs it
meets 16-bit ``w2`` as a high and a low 16-bit half (two ragged matmuls on the matrix units); on
the CPU, whose XLA dot widens 16-bit operands to float32 anyway, the operands are widened instead
(one float32 matmul each; measured faster there). The op says which (``on_cpu``).
Pairs routed to other devices' experts sort last, outside every group, and are selected away from
the combine (never multiplied by a 0 weight: their rows read local expert 0's biases, which may be
non-finite).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["fused_experts"]


def _ragged_linear(rows: Any, weights: Any, group_sizes: Any, on_cpu: bool) -> Any:
    """float32 ``rows[r] @ weights[g(r)].T`` where row ``r`` lies in group ``g(r)`` of ``group_sizes``
    (rows past the groups give 0); ``weights`` ``[G, N, K]`` contracts its last dim."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def dot(lhs: Any, rhs: Any) -> Any:
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, preferred_element_type=jnp.float32)

    if on_cpu:
        # XLA's CPU dot widens 16-bit operands to float32 anyway; widening here keeps XLA:CPU on its
        # float32 ragged dot (jax 0.7.1's XLA:CPU aborted compiling a 16-bit one, once, in a long run).
        # XLA:CPU's ragged dot masks every group's product by multiplication, so a NaN or inf in any
        # expert's weights reached the same output column of every row (0 * NaN); weights that are
        # not all finite take a loop over the groups that selects each group's rows instead.
        f32 = jnp.float32
        return jax.lax.cond(jnp.all(jnp.isfinite(weights)), lambda r, w: dot(r.astype(f32), w.astype(f32)),
                            lambda r, w: _grouped_by_select(r.astype(f32), w.astype(f32), group_sizes), rows, weights)
    if rows.dtype == weights.dtype:
        return dot(rows, weights)
    # 16-bit matrix units: the float32 rows as a high and a low 16-bit half
    high = rows.astype(weights.dtype)
    return dot(high, weights) + dot((rows - high.astype(jnp.float32)).astype(weights.dtype), weights)


def _grouped_by_select(rows: Any, weights: Any, group_sizes: Any) -> Any:
    """float32 ``rows[r] @ weights[g(r)].T`` one group at a time, each group's rows selected by
    ``where`` (rows past the groups give 0): non-finite weights reach only their own group's rows.
    Every group multiplies every row (G times the ragged dot's work): the path for weights that
    are not all finite only."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jnp.arange(rows.shape[0])

    def one_group(g, out):
        product = jnp.dot(rows, weights[g].T, preferred_element_type=jnp.float32)
        inside = (row >= starts[g]) & (row < ends[g])
        return jnp.where(inside[:, None], product, out)

    return jax.lax.fori_loop(0, weights.shape[0], one_group, jnp.zeros((rows.shape[0], weights.shape[1]), jnp.float32))


@functools.partial(jax.jit, static_argnames=("activation", "apply_router_weight_on_input", "float32_output", "on_cpu"))
def _experts(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map, *, activation,
             apply_router_weight_on_input, float32_output, on_cpu):
    from dualop.backends.xla import array_api as xp
    from dualop.kernels import moe_math

    f32 = jnp.float32
    tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    local_ids = moe_math.local_expert_ids(xp, topk_ids, expert_map, num_local)
    order, group_sizes = moe_math.sort_by_expert(xp, local_ids, num_local)
    token_of_row = order // top_k
    expert_of_row = jnp.take(local_ids.reshape(-1), order)  # -1 for the pairs past the groups
    weight_of_row = jnp.where(expert_of_row >= 0, jnp.take(topk_weights.reshape(-1).astype(f32), order), 0.0)
    h = _ragged_linear(jnp.take(x, token_of_row, axis=0), w13, group_sizes, on_cpu)
    if apply_router_weight_on_input:  # (x * w) @ w13.T, as w * (x @ w13.T) in float32
        h = h * weight_of_row[:, None]
        weight_of_row = (expert_of_row >= 0).astype(f32)
    safe_expert = jnp.maximum(expert_of_row, 0)
    if w13_bias is not None:
        h = h + jnp.take(w13_bias.astype(f32), safe_expert, axis=0)
    y = _ragged_linear(moe_math.activate(xp, h, activation), w2, group_sizes, on_cpu)
    if w2_bias is not None:
        y = y + jnp.take(w2_bias.astype(f32), safe_expert, axis=0)
    contrib = jnp.where((expert_of_row >= 0)[:, None], y * weight_of_row[:, None], 0.0)
    out = jnp.zeros((tokens, x.shape[1]), f32).at[token_of_row].add(contrib)
    return out if float32_output else out.astype(x.dtype)


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
    on_cpu: bool = True,
) -> Any:
    """``[T, H]`` in ``x``'s dtype (float32 with ``float32_output``): ``moe_math.experts_reference``'s
    value, computed for the routed pairs only (jit-able; the options are static). ``on_cpu``: the
    op's CPU path (float32 operands); False for GPUs (16-bit operands, the intermediate as two halves)."""
    if x.shape[0] == 0:
        return jnp.zeros((0, x.shape[1]), jnp.float32 if float32_output else x.dtype)
    return _experts(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map, activation=activation,
                    apply_router_weight_on_input=apply_router_weight_on_input, float32_output=float32_output,
                    on_cpu=on_cpu)
