"""The modular fused MoE: prepare (quantise, dispatch tokens) -> experts -> finalize (combine).

``modular_fused_moe`` (``FusedMoEModularMethod``) has the reference engine's modular-kernel shape:
a ``PrepareAndFinalize`` object says how tokens reach the experts of this device and how the
experts' outputs come back; the experts in between are ``unquantized_fused_moe``'s (its kernel for
the platform, or its native body), always with an ``expert_map``-style local view. Prepare/finalize
objects:

- ``SingleDevicePrepareAndFinalize`` (the default): nothing moves; the experts' output is
  already the weighted combine of each token's top-k experts, and finalize casts it to x's dtype.
- expert parallel, per frontend: ``dualop.jax.expert_parallel`` (inside ``shard_map``: ``psum`` or
  ``all_to_all`` over a mesh axis) and ``dualop.torch.expert_parallel`` (``torch.distributed``:
  all-reduce or ``all_to_all_single`` over a process group).

Expert placement for expert parallelism (``expert_blocks``, ``expert_owner``) is the engine's
``determine_expert_map``: shard r holds a contiguous block of experts, the first ``E % n`` shards
one more than the rest.

Unquantized weights need no quantisation, so prepare only dispatches. A prepare that moves tokens
(all-to-all) hands the experts one row per (token, expert) pair, top_k 1, with padding rows of id
-1 (every experts path treats -1 as "not here": they add nothing); finalize brings each pair's
weighted output back and sums a token's pairs in float32.

Precision: the experts run with ``float32_output`` (``unquantized_fused_moe``'s option), so
finalize gets float32 partial outputs, combines them in float32 (the psum / all-reduce and the
all-to-all's return trip carry float32) and casts to x's dtype once, at the end: in 16-bit dtypes
the expert-parallel result is one device's float32 sum rounded once, up to float32 summation order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from dualop.backends import array_namespace
from dualop.custom_op import ALL_FRONTENDS, CustomOp, Serves
from dualop.ops.moe import UnquantizedFusedMoEMethod, _check_experts, _check_routing, layer_expert_weights
from dualop.spec import Serving

__all__ = ["PrepareAndFinalize", "Prepared", "SingleDevicePrepareAndFinalize", "FusedMoEModularMethod",
           "expert_blocks", "expert_owner"]

MODULAR_OP = "modular_fused_moe"


def expert_blocks(num_experts: int, num_shards: int) -> tuple[tuple[int, int], ...]:
    """``(first expert, count)`` of each shard: contiguous blocks, the first ``num_experts %
    num_shards`` shards one expert more (the engine's ``determine_expert_map``)."""
    if num_shards < 1 or num_experts < num_shards:
        raise ValueError(f"{MODULAR_OP}: cannot place {num_experts} experts on {num_shards} shards "
                         f"(each shard needs at least one expert)")
    base, extra = divmod(num_experts, num_shards)
    return tuple((r * base + min(r, extra), base + (r < extra)) for r in range(num_shards))


def expert_owner(xp, ids, num_experts: int, num_shards: int):
    """The shard holding each global expert id of ``ids`` (int32; ids outside ``[0, num_experts)``
    get ``num_shards``: no shard), under ``expert_blocks``' placement."""
    base, extra = divmod(num_experts, num_shards)
    ids = xp.astype(ids, xp.int32)
    big = extra * (base + 1)  # the experts of the shards holding one more
    owner = xp.where(ids < big, ids // (base + 1), extra + (ids - big) // base)
    return xp.where((ids >= 0) & (ids < num_experts), owner, num_shards)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What prepare hands the experts (``x [R, H]``, ``topk_weights``/``topk_ids [R, k]``, the
    local ``expert_map``) and ``state``: whatever finalize needs to bring the rows back."""

    x: Any
    topk_weights: Any
    topk_ids: Any
    expert_map: Any
    state: Any = None


class PrepareAndFinalize:
    """How tokens reach this device's experts and how their outputs come back.

    ``prepare(x, topk_weights, topk_ids, expert_map, num_local_experts)`` -> ``Prepared``;
    ``finalize(out, prepared, x)`` -> ``[T, H]`` in ``x``'s dtype (``out``: the experts' float32
    output for ``prepared``'s rows, combined in float32 and cast once, last). Subclasses are
    frontend-specific when they communicate.

    ``prepare_communicates``: prepare is a collective every rank must join (all-to-all). Then a
    declining experts kernel is replaced by the native body on the prepared rows, inside the same
    call, instead of the dispatcher retrying the whole op natively (which would prepare again,
    and only on the ranks whose kernel declined)."""

    prepare_communicates: ClassVar[bool] = False

    def prepare(self, x: Any, topk_weights: Any, topk_ids: Any, expert_map: Any, num_local_experts: int) -> Prepared:
        raise NotImplementedError

    def finalize(self, out: Any, prepared: Prepared, x: Any) -> Any:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SingleDevicePrepareAndFinalize(PrepareAndFinalize):
    """Every expert (or the ``expert_map``'s share) is here and so is every token: nothing moves."""

    def prepare(self, x: Any, topk_weights: Any, topk_ids: Any, expert_map: Any, num_local_experts: int) -> Prepared:
        return Prepared(x, topk_weights, topk_ids, expert_map)

    def finalize(self, out: Any, prepared: Prepared, x: Any) -> Any:
        return array_namespace(out).astype(out, x.dtype)


@CustomOp.register(MODULAR_OP)
class FusedMoEModularMethod(CustomOp):
    """``FusedMoEModularMethod(prepare_finalize=None, activation="silu",
    apply_router_weight_on_input=False)``; ``op(x, topk_weights, topk_ids, w13, w2, w13_bias=None,
    w2_bias=None, expert_map=None)`` -> ``[T, H]`` in x's dtype.

    ``prepare_finalize`` (default ``SingleDevicePrepareAndFinalize()``) dispatches tokens and
    combines outputs; the experts are ``unquantized_fused_moe`` with ``float32_output``
    (``self.experts``: finalize combines float32 partials and casts once), and this op's
    platform method runs the experts' method of the same platform (a cell counts as a kernel cell
    only when the experts' kernel ran). The arguments are validated as ``unquantized_fused_moe``'s,
    for the rows this device was given (``x``, its routing, this device's weights and map).
    """

    def __init__(self, prepare_finalize: PrepareAndFinalize | None = None, activation: str = "silu",
                 apply_router_weight_on_input: bool = False, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        if prepare_finalize is None:
            prepare_finalize = SingleDevicePrepareAndFinalize()
        if not isinstance(prepare_finalize, PrepareAndFinalize):
            raise TypeError(f"{MODULAR_OP}: argument 'prepare_finalize' must be a PrepareAndFinalize, got "
                            f"{type(prepare_finalize).__qualname__}")
        self.prepare_finalize = prepare_finalize
        self.experts = UnquantizedFusedMoEMethod(activation, apply_router_weight_on_input, float32_output=True)
        self.activation = self.experts.activation
        self.apply_router_weight_on_input = self.experts.apply_router_weight_on_input

    def extra_repr(self) -> str:
        return (f"prepare_finalize={self.prepare_finalize!r}, activation={self.activation!r}, "
                f"apply_router_weight_on_input={self.apply_router_weight_on_input}")

    def apply(self, layer: Any, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
        """The engine's call (``quant_method.apply(layer=..., x=..., topk_weights=..., topk_ids=...)``):
        this op with ``layer``'s expert weights (``layer_expert_weights``)."""
        return self(x, topk_weights, topk_ids, *layer_expert_weights(MODULAR_OP, layer))

    def check_inputs(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                     w2_bias: Any = None, expert_map: Any = None) -> None:
        fe, _, num_global = _check_experts(MODULAR_OP, x, w13, w2, w13_bias, w2_bias, expert_map, self.activation)
        _check_routing(MODULAR_OP, x, fe, topk_weights, topk_ids, num_global)
        if self.apply_router_weight_on_input and topk_ids.shape[1] != 1:
            raise ValueError(f"{MODULAR_OP}: apply_router_weight_on_input needs top_k == 1; 'topk_ids' has "
                             f"top_k {topk_ids.shape[1]}")

    def _run(self, method: str, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any,
             w2_bias: Any, expert_map: Any) -> Any:
        prepared = self.prepare_finalize.prepare(x, topk_weights, topk_ids, expert_map, w13.shape[0])
        args = (prepared.x, prepared.topk_weights, prepared.topk_ids, w13, w2, w13_bias, w2_bias, prepared.expert_map)
        try:
            out = getattr(self.experts, method)(*args)
        except NotImplementedError as err:
            if method == "forward_native" or not self.prepare_finalize.prepare_communicates:
                raise  # the dispatcher reruns the op natively (nothing was sent yet)
            self.note_decline(method, err, x)
            out = self.experts.forward_native(*args)
        return self.prepare_finalize.finalize(out, prepared, x)

    def forward_native(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                       w2_bias: Any = None, expert_map: Any = None) -> Any:
        array_namespace(x)  # a clear error for a non-array before anything moves
        return self._run("forward_native", x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)

    def forward_tpu(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                    w2_bias: Any = None, expert_map: Any = None) -> Any:
        return self._run("forward_tpu", x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)

    def forward_cuda(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                     w2_bias: Any = None, expert_map: Any = None) -> Any:
        return self._run("forward_cuda", x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)

    def forward_cpu(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                    w2_bias: Any = None, expert_map: Any = None) -> Any:
        return self._run("forward_cpu", x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)

    # Whatever its experts serve (asked per instance below).
    serves = {m: Serves(ALL_FRONTENDS) for m in ("forward_cpu", "forward_cuda", "forward_hip")}

    def declines(self, method: str, frontend: str) -> str | None:
        return self.experts.passes_over(method, frontend)


def check_cases():
    """One tiny problem (the cells run it on every platform): 8 experts of which this device holds
    4 (an expert map with holes), top-2 routing; shapes ``(tokens, top_k, hidden)``."""
    import numpy as np

    from dualop.ops.moe import _expert_weights
    from dualop.testing import OpCase, Pinned, normal

    def inputs(shape, rng):
        tokens, top_k, hidden = shape
        experts, inter = 8, 64
        w13, w2, _, _ = _expert_weights(rng, experts // 2, hidden, inter, "silu", False)
        ids = np.array([rng.permutation(experts)[:top_k] for _ in range(tokens)], np.int32).reshape(tokens, top_k)
        weights = rng.random((tokens, top_k)).astype(np.float32)
        mapping = np.full(experts, -1, np.int32)
        mapping[experts // 2:] = np.arange(experts // 2)  # this device holds the upper block
        return (normal((tokens, hidden), rng), Pinned(weights, "float32"), Pinned(ids, "int32"), w13, w2, None,
                None, Pinned(mapping, "int32"))

    return [OpCase(MODULAR_OP, f"{MODULAR_OP}[silu,expert_map,E8,I64]", lambda s: FusedMoEModularMethod(),
                   inputs, ((0, 2, 128), (1, 1, 200), (5, 2, 128)))]


# --- spec: what dualop compile builds (check_cases above) ----------------------------------


def _modular_experts_op(shape: tuple[int, ...]):
    from dualop.ops import FusedMoEModularMethod

    return FusedMoEModularMethod()


def serving():
    """The experts of unquantized_fused_moe between a single-device prepare and finalize, at
    Qwen3-235B's decode step (fused_moe builds the other model shapes), in bfloat16."""
    from dualop.ops.moe import _MOE_SERVING, _experts_inputs

    label = "modular_fused_moe[silu,expert_map,E8,I64]"
    return {"modular_fused_moe": Serving(_MOE_SERVING[2:3], _experts_inputs, {label: _modular_experts_op},
                                         ("bfloat16",), (label,))}

# jax arrays on the CPU and GPUs: XLA's own kernels (dot, ragged_dot) are the platform path
JAX_XLA = {("jax", "cpu"): "forward_cpu", ("jax", "cuda"): "forward_cuda"}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"modular_fused_moe": {"traits": {"case_shapes_only", "contraction"}, "kernel_in_native_cells": JAX_XLA}}
