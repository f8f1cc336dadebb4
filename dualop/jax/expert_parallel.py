"""Expert parallelism for jax arrays: the experts sharded over one axis of a ``jax.sharding.Mesh``.

``expert_parallel_moe(mesh, axis, hidden_states, router_logits, w13, w2, ..., op=FusedMoE(...),
mode=...)`` runs a whole MoE layer (routing, experts, combine) under ``shard_map``. Shard r of
``axis`` (n shards) holds experts ``[r E/n, (r+1) E/n)``: ``w13``/``w2`` (and biases) are split on
their expert dim, and each shard's ``expert_map`` comes from its axis index. Two combine forms:

- ``mode="all_to_all"``: tokens are split over the axis too; each shard routes its tokens, sends
  every (token, expert) pair to the expert's owner with ``jax.lax.all_to_all``, runs its experts
  on what it received, sends the weighted float32 outputs back with a second ``all_to_all`` and
  sums each token's pairs in float32. Buffers are fixed: ``capacity`` rows per (source,
  destination) pair of shards. The default, ``T_shard * top_k``, can never overflow (exact, at n
  times the traffic of a balanced load); a smaller capacity (e.g. ``ceil(1.25 * T_shard * top_k /
  n)``) cuts the buffers and the experts' rows, and pairs beyond it are DROPPED (they add 0, the
  token keeps its other experts), the usual capacity-factor trade.
- ``mode="psum"``: for small token counts (decode): every shard routes all tokens, computes its
  experts' float32 share for all of them (``expert_map`` masks the rest), and ``jax.lax.psum``
  adds the shares in float32; tokens and output are replicated.

Both give one device's result, rounded once: the shares and pairs stay float32 until the combine
is done (the experts run with ``float32_output``), so in every dtype the result is one device's
float32 sum cast once, up to the order of the float32 additions. In 16-bit dtypes that doubles the
bytes of the combine (the psum, the all-to-all's return trip; the dispatch still sends x in its
dtype): rounding each share first would make the result depend on the shard count, by a few
16-bit roundings where outputs nearly cancel. The experts run as ``modular_fused_moe`` with the
prepare/finalize objects below, so the platform's kernel (Pallas on TPU) runs inside each shard.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from dualop.backends import array_namespace
from dualop.ops.moe import FusedMoE
from dualop.ops.moe_modular import FusedMoEModularMethod, PrepareAndFinalize, Prepared, expert_owner

__all__ = ["MODES", "shard_map", "local_expert_map", "PsumPrepareAndFinalize", "AllToAllPrepareAndFinalize",
           "expert_parallel_moe"]

MODES = ("all_to_all", "psum")
_NAME = "expert_parallel_moe"


def shard_map(fn, *, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` (jax >= 0.7) or ``jax.experimental.shard_map.shard_map`` (older), with the
    replication check off: Pallas calls carry no replication rule."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def local_expert_map(num_experts: int, num_shards: int, shard_index) -> jax.Array:
    """int32 ``[num_experts]``: each global expert's index on shard ``shard_index`` (an int or a
    traced ``jax.lax.axis_index``), -1 for the others; even contiguous blocks."""
    local = num_experts // num_shards
    ids = jnp.arange(num_experts, dtype=jnp.int32) - shard_index * local
    return jnp.where((ids >= 0) & (ids < local), ids, -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class PsumPrepareAndFinalize(PrepareAndFinalize):
    """Every shard has every token; the shards' float32 shares are added with ``psum`` over
    ``axis_name`` (call inside ``shard_map``), then cast to x's dtype."""

    axis_name: Any

    def prepare(self, x, topk_weights, topk_ids, expert_map, num_local_experts: int) -> Prepared:
        return Prepared(x, topk_weights, topk_ids, expert_map)

    def finalize(self, out, prepared: Prepared, x):
        return jax.lax.psum(out.astype(jnp.float32), self.axis_name).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class AllToAllPrepareAndFinalize(PrepareAndFinalize):
    """Each shard's tokens go to their experts' owners and back with ``jax.lax.all_to_all`` over
    ``axis_name`` (``num_shards`` shards, even contiguous expert blocks; call inside ``shard_map``):
    x's rows go out in x's dtype, the pairs' float32 outputs come back and are summed in float32,
    then cast to x's dtype. ``capacity``: rows per destination shard (None: tokens * top_k, which
    never drops a pair)."""

    axis_name: Any
    num_shards: int
    capacity: int | None = None

    prepare_communicates: ClassVar[bool] = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.num_shards, bool) or not isinstance(self.num_shards, int) or self.num_shards < 1:
            raise ValueError(f"{name}: argument 'num_shards' must be a positive int, got {self.num_shards!r}")
        if self.capacity is not None and (isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
                                          or self.capacity < 1):
            raise ValueError(f"{name}: argument 'capacity' must be a positive int or None, got {self.capacity!r}")

    def prepare(self, x, topk_weights, topk_ids, expert_map, num_local_experts: int) -> Prepared:
        n = self.num_shards
        tokens, top_k = topk_ids.shape
        capacity = self.capacity or max(tokens * top_k, 1)
        num_experts = expert_map.shape[0] if expert_map is not None else num_local_experts * n
        ids = topk_ids.reshape(-1).astype(jnp.int32)
        owner = expert_owner(array_namespace(ids), ids, num_experts, n)  # n: no shard (a bad id)
        onehot = (owner[:, None] == jnp.arange(n, dtype=jnp.int32)).astype(jnp.int32)
        before = jnp.cumsum(onehot, axis=0) - onehot  # earlier pairs bound for the same shard
        slot = jnp.take_along_axis(before, jnp.minimum(owner, n - 1)[:, None], axis=1)[:, 0]
        kept = (owner < n) & (slot < capacity)
        dest = jnp.where(kept, owner, n)  # out of range: the scatters below drop it

        def scatter(fill, values):
            buf = jnp.full((n, capacity, *values.shape[1:]), fill, values.dtype)
            return buf.at[dest, slot].set(values, mode="drop")

        send_x = scatter(0, jnp.repeat(x, top_k, axis=0))
        send_ids = scatter(-1, ids)
        send_w = scatter(0, topk_weights.reshape(-1).astype(jnp.float32))
        recv = [jax.lax.all_to_all(a, self.axis_name, 0, 0, tiled=True) for a in (send_x, send_ids, send_w)]
        recv_x, recv_ids, recv_w = (a.reshape(n * capacity, *a.shape[2:]) for a in recv)
        return Prepared(recv_x, recv_w[:, None], recv_ids[:, None], expert_map, state=(dest, slot, kept, capacity, top_k))

    def finalize(self, out, prepared: Prepared, x):
        dest, slot, kept, capacity, top_k = prepared.state
        n, (tokens, hidden) = self.num_shards, x.shape
        back = jax.lax.all_to_all(out.astype(jnp.float32).reshape(n, capacity, hidden), self.axis_name, 0, 0,
                                  tiled=True)
        pairs = back[jnp.minimum(dest, n - 1), slot]  # [T * k, H] float32
        pairs = jnp.where(kept[:, None], pairs, 0.0)
        return pairs.reshape(tokens, top_k, hidden).sum(axis=1).astype(x.dtype)


def _check(mesh: Mesh, axis: Any, mode: str, op: Any, w13: Any, hidden_states: Any, capacity: Any) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{_NAME}: argument 'mesh' must be a jax.sharding.Mesh, got {type(mesh).__qualname__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{_NAME}: axis {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    if mode not in MODES:
        raise ValueError(f"{_NAME}: argument 'mode' is {mode!r}; expected one of {', '.join(map(repr, MODES))}")
    if type(op) is not FusedMoE:  # a subclass may read other weight layouts (transformers_fused_moe)
        raise TypeError(f"{_NAME}: argument 'op' must be a dualop.ops.FusedMoE (the engine's weight layout), got "
                        f"{type(op).__qualname__}")
    n = mesh.shape[axis]
    if w13.shape[0] != op.num_experts or op.num_experts % n:
        raise ValueError(f"{_NAME}: 'w13' holds {w13.shape[0]} experts and op.num_experts is {op.num_experts}; "
                         f"expected all experts, a multiple of the {n} shards of axis {axis!r}")
    if hidden_states.ndim != 2:
        raise ValueError(f"{_NAME}: argument 'hidden_states' must be [tokens, hidden], got shape "
                         f"{tuple(hidden_states.shape)}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"{_NAME}: argument 'capacity' must be a positive int or None, got {capacity!r}")
    return n


def expert_parallel_moe(mesh: Mesh, axis: Any, hidden_states, router_logits, w13, w2, w13_bias=None, w2_bias=None,
                        e_score_correction_bias=None, *, op: FusedMoE, mode: str = "all_to_all",
                        capacity: int | None = None):
    """``op``'s MoE layer (routing, experts, combine) with the experts sharded over ``mesh`` axis
    ``axis``; returns ``[T, H]`` like ``op(hidden_states, router_logits, w13, w2, ...)`` on one
    device. Weights are the global ones (``[E, ...]``; place them sharded on ``axis`` to avoid a
    copy); ``mode`` and ``capacity`` as the module docstring says. Works under ``jax.jit``. In
    ``all_to_all`` mode tokens are padded to a multiple of the shard count (padding is routed and
    computed, then cut off)."""
    n = _check(mesh, axis, mode, op, w13, hidden_states, capacity)
    tokens = hidden_states.shape[0]
    if tokens == 0:  # nothing to route or send
        return jnp.zeros(hidden_states.shape, hidden_states.dtype)
    pad = (-tokens) % n if mode == "all_to_all" else 0
    if pad:
        hidden_states = jnp.pad(hidden_states, ((0, pad), (0, 0)))
        router_logits = jnp.pad(router_logits, ((0, pad), (0, 0)))
    if mode == "all_to_all":
        prepare_finalize = AllToAllPrepareAndFinalize(axis, n, capacity)
        token_spec = PartitionSpec(axis)
    else:
        prepare_finalize = PsumPrepareAndFinalize(axis)
        token_spec = PartitionSpec()
    experts = _modular_op(prepare_finalize, op.activation, op.apply_router_weight_on_input)
    num_experts = op.num_experts
    expert_spec = PartitionSpec(axis)

    def body(x, logits, w13_s, w2_s, b13, b2, correction):
        expert_map = local_expert_map(num_experts, n, jax.lax.axis_index(axis))
        weights, ids = op.route(x, logits, correction)
        return experts(x, weights, ids, w13_s, w2_s, b13, b2, expert_map)

    def spec(a, s):
        return None if a is None else s

    in_specs = (token_spec, token_spec, expert_spec, expert_spec, spec(w13_bias, expert_spec),
                spec(w2_bias, expert_spec), spec(e_score_correction_bias, PartitionSpec()))
    out = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=token_spec)(
        hidden_states, router_logits, w13, w2, w13_bias, w2_bias, e_score_correction_bias)
    return out[:tokens] if pad else out


@functools.lru_cache(maxsize=64)
def _modular_op(prepare_finalize: PrepareAndFinalize, activation: str, weight_on_input: bool) -> FusedMoEModularMethod:
    """One op object per configuration (its dispatch cache is kept across calls)."""
    return FusedMoEModularMethod(prepare_finalize, activation, weight_on_input)
