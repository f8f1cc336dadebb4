"""Mixture of experts: routing and the fused experts, with the reference serving engine's names.

- ``grouped_topk`` (``GroupedTopk``): router logits -> ``(topk_weights float32 [T, k], topk_ids
  int32 [T, k])``, softmax or sigmoid scores, optional correction bias and expert groups
  (DeepSeek-V3), renormalization and routed scaling. ``fused_topk`` is the plain (no groups)
  routing function on the same op and kernels.
- ``unquantized_fused_moe`` (``UnquantizedFusedMoEMethod``): the experts for given routing,
  ``op(x, topk_weights, topk_ids, w13, w2, ...)`` -> ``[T, H]``; the method object ``FusedMoE``
  uses for unquantized weights (``create_weights``, ``apply``).
- ``fused_moe`` (``FusedMoE``): routing then experts, ``op(hidden_states, router_logits, w13, w2,
  ...)`` -> ``[T, H]``.

The formulas, layouts and conventions (gate rows first in ``w13``, interleaved for ``swigluoai``;
float32 intermediate; ties in top-k go to the lower expert index) are in ``kernels/moe_math.py``,
the one place every path takes them from.

Expert parallelism's building block is ``expert_map``: ``[E_global]`` int32, each global expert's
index among this device's experts or -1. With a map, ``w13``/``w2`` (and the biases) hold only the
local experts and a (token, slot) routed elsewhere contributes exactly nothing on every path (it is
selected away, never multiplied by 0, so a NaN or inf weight on it does not reach this device's
output); summing the devices' outputs gives the one-device result (``float32_output`` hands the
sum float32 partials, so it can round once, after).

Non-finite routing (NaN ranks as -inf; NaN weights stay NaN) is ``moe_math``'s rule, stated in
``GroupedTopk``'s docstring; every routing and experts path follows it.

Validation (before any kernel): shapes, dtypes, devices and options; and where values are at hand
(``_checks.concrete_values``: torch CPU/CUDA tensors, jax arrays outside a trace) the ids and the
map's entries are range-checked. Traced or lazy ids are not read: every path treats an id outside
``[0, E_global)`` or a map entry outside ``[-1, E_local)`` as -1 (adds nothing).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import ALL_FRONTENDS, CustomOp, Serves
from dualop.kernels import moe_math
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, concrete_values, dtype_name
from dualop.platforms import family_of, frontend_of
from collections.abc import Callable
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.spec import BenchCase, InputSpec, Serving, float32_normal as _normal

__all__ = ["GroupedTopk", "fused_topk", "UnquantizedFusedMoEMethod", "FusedMoE"]

TOPK_OP = "grouped_topk"
EXPERTS_OP = "unquantized_fused_moe"
MOE_OP = "fused_moe"
_INT_DTYPES = frozenset({"int32", "int64"})
_F32 = frozenset({"float32"})

# Kernel entry points (each module states its contract in its docstring).
_PALLAS_TOPK = KernelRef("dualop.kernels.pallas.moe_routing", "grouped_topk")
_TRITON_TOPK = KernelRef("dualop.kernels.cuda.moe_routing", "grouped_topk")
_PALLAS_EXPERTS = KernelRef("dualop.kernels.pallas.fused_moe", "fused_experts")
_TRITON_EXPERTS = KernelRef("dualop.kernels.cuda.fused_moe", "fused_experts")
_CPU_EXPERTS = KernelRef("dualop.kernels.cpu.fused_moe", "fused_experts")
_CPU_TOPK = KernelRef("dualop.kernels.cpu.moe_routing", "grouped_topk")
_RAGGED_EXPERTS = KernelRef("dualop.kernels.xla.fused_moe", "fused_experts")


def _check_int(op: str, name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: argument '{name}' must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{op}: argument '{name}' must be at least {minimum}, got {value}")
    return value


def _check_choice(op: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{op}: argument '{name}' is {value!r}; expected one of {', '.join(map(repr, choices))}")
    return value


def _check_scale(op: str, name: str, value: Any) -> float:
    """A finite, non-negative float (a NaN, inf or negative factor would flip or poison every
    token's weights)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: argument '{name}' must be a float, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{op}: argument '{name}' is {value!r}; expected a finite number >= 0")
    return float(value)


def _check_groups(op: str, num_expert_group: int, topk_group: int, num_experts: int | None = None) -> None:
    """Groups are off (both 0) or ``1 <= topk_group <= num_expert_group``, and, where the expert
    count is known, ``num_expert_group`` divides it (grouping is never dropped silently)."""
    if (num_expert_group == 0) != (topk_group == 0) or topk_group > num_expert_group:
        raise ValueError(f"{op}: topk_group={topk_group} with num_expert_group={num_expert_group}; expected "
                         f"1 <= topk_group <= num_expert_group (or both 0: no expert groups)")
    if num_experts is not None and num_expert_group > 1 and num_experts % num_expert_group:
        raise ValueError(f"{op}: num_expert_group={num_expert_group} does not divide the {num_experts} experts; "
                         f"expected a divisor of the expert count")


def _require(op: str, name: str, value: Any) -> None:
    if value is None:
        raise TypeError(f"{op}: argument '{name}' is required")


def _check_2d(op: str, name: str, value: Any, ref_name: str, ref: Any, fe: str, shape: tuple, **kw: Any) -> None:
    _require(op, name, value)
    check_optional_like(op, name, value, ref_name, ref, fe, shape=shape, **kw)


# ---------------------------------------------------------------------------------- routing


@CustomOp.register(TOPK_OP)
class GroupedTopk(CustomOp):
    """``GroupedTopk(topk, renormalize, num_expert_group=0, topk_group=0, scoring_func="softmax",
    routed_scaling_factor=1.0)``; ``op(hidden_states, gating_output, e_score_correction_bias=None)``
    -> ``(topk_weights float32 [T, topk], topk_ids int32 [T, topk])``.

    ``hidden_states`` ``[T, H]`` only fixes the token count (the engine's signature); the scores are
    ``gating_output`` ``[T, E]``'s softmax or sigmoid in float32. Groups apply when
    ``num_expert_group > 1`` (``num_expert_group`` and ``topk_group`` are both 0, or
    ``1 <= topk_group <= num_expert_group``; a ``num_expert_group`` not dividing E is refused at
    the call); otherwise plain top-k (``moe_math.route`` has the rule and the tie order: the lower
    expert index first). ``routed_scaling_factor`` is finite and >= 0.

    Non-finite values (``moe_math``'s rule, on every path): a NaN selection score ranks as -inf,
    so ids always lie in ``[0, E)``. A NaN or +inf logit (or a row of only -inf) under softmax
    makes that token's scores NaN: it gets the lowest-index experts its ranking leaves (the
    lowest of its kept groups), with NaN weights (so ``fused_moe`` gives NaN for that token, as
    the native body does); under sigmoid a NaN logit only makes that expert rank last. A NaN
    entry of ``e_score_correction_bias`` makes that expert rank last for every token (chosen only
    when fewer than ``topk`` experts of the kept groups have a finite biased score; then weighted
    by its unbiased score). Other tokens are never affected.
    """

    def __init__(
        self,
        topk: int,
        renormalize: bool,
        num_expert_group: int | None = 0,
        topk_group: int | None = 0,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.topk = _check_int(TOPK_OP, "topk", topk, minimum=1)
        self.renormalize = bool(renormalize)
        self.num_expert_group = _check_int(TOPK_OP, "num_expert_group", num_expert_group or 0, minimum=0)
        self.topk_group = _check_int(TOPK_OP, "topk_group", topk_group or 0, minimum=0)
        _check_groups(TOPK_OP, self.num_expert_group, self.topk_group)
        self.scoring_func = _check_choice(TOPK_OP, "scoring_func", scoring_func, moe_math.SCORING_FUNCS)
        self.routed_scaling_factor = _check_scale(TOPK_OP, "routed_scaling_factor", routed_scaling_factor)

    def routing_options(self) -> dict[str, Any]:
        """The static options every routing path takes (``moe_math.route``'s keywords)."""
        return dict(top_k=self.topk, renormalize=self.renormalize, num_expert_group=self.num_expert_group,
                    topk_group=self.topk_group, scoring_func=self.scoring_func,
                    routed_scaling_factor=self.routed_scaling_factor)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.routing_options().items())

    def check_inputs(self, hidden_states: Any, gating_output: Any, e_score_correction_bias: Any = None) -> None:
        op = TOPK_OP
        _require(op, "gating_output", gating_output)
        fe = check_array(op, "gating_output", gating_output, min_ndim=2)
        if gating_output.ndim != 2:
            raise ValueError(f"{op}: argument 'gating_output' must be [tokens, num_experts], got shape "
                             f"{tuple(gating_output.shape)}")
        tokens, num_experts = gating_output.shape
        if hidden_states is not None:
            check_optional_like(op, "hidden_states", hidden_states, "gating_output", gating_output, fe,
                                shape=tuple(hidden_states.shape))
            if hidden_states.ndim != 2 or hidden_states.shape[0] != tokens:
                raise ValueError(f"{op}: argument 'hidden_states' has shape {tuple(hidden_states.shape)}; expected "
                                 f"[{tokens}, hidden] (one row per row of 'gating_output')")
        if self.topk > num_experts:
            raise ValueError(f"{op}: topk={self.topk} is more than the {num_experts} experts of 'gating_output'")
        if self.num_expert_group > 1 and num_experts % self.num_expert_group:
            raise ValueError(f"{op}: num_expert_group={self.num_expert_group} does not divide the {num_experts} "
                             f"experts of 'gating_output'; expected a divisor of the expert count")
        check_optional_like(op, "e_score_correction_bias", e_score_correction_bias, "gating_output", gating_output, fe,
                            shape=(num_experts,))

    def forward_native(self, hidden_states: Any, gating_output: Any,
                       e_score_correction_bias: Any = None) -> tuple[Any, Any]:
        xp = array_namespace(gating_output)
        return moe_math.route(xp, gating_output, e_score_correction_bias=e_score_correction_bias,
                              **self.routing_options())

    def forward_tpu(self, hidden_states: Any, gating_output: Any,
                    e_score_correction_bias: Any = None) -> tuple[Any, Any]:
        # hidden_states only fixes the token count: the native body (JAX's gradient) does not read it.
        return call_jax_function(frontend_of(gating_output), _PALLAS_TOPK, gating_output, e_score_correction_bias,
                           native=functools.partial(self.forward_native, None), **self.routing_options())

    def forward_cuda(self, hidden_states: Any, gating_output: Any,
                     e_score_correction_bias: Any = None) -> tuple[Any, Any]:
        return call_triton(frontend_of(gating_output), _TRITON_TOPK, gating_output, e_score_correction_bias,
                           **self.routing_options())

    def forward_cpu(self, hidden_states: Any, gating_output: Any,
                    e_score_correction_bias: Any = None) -> tuple[Any, Any]:
        """torch on the CPU: the C++ routing kernel (``kernels/cpu/moe_routing.py``)."""
        return _CPU_TOPK(gating_output, e_score_correction_bias, **self.routing_options())



def fused_topk(gating_output: Any, topk: int, renormalize: bool, scoring_func: str = "softmax",
               e_score_correction_bias: Any = None) -> tuple[Any, Any]:
    """Plain top-k routing (no groups): ``(topk_weights float32 [T, topk], topk_ids int32 [T, topk])``.
    The ``grouped_topk`` op with no groups, so the same kernels and dispatch serve it."""
    op = GroupedTopk(topk, renormalize, 0, 0, scoring_func)
    return op(gating_output, gating_output, e_score_correction_bias)


# ---------------------------------------------------------------------------------- experts


def _check_experts(op: str, x: Any, w13: Any, w2: Any, w13_bias: Any, w2_bias: Any, expert_map: Any,
                   activation: str, *, hidden_size: int | None = None, intermediate_size: int | None = None,
                   num_experts: int | None = None) -> tuple[str, int, int]:
    """Shapes of the expert weights against ``x`` and each other; returns (frontend, E_local, E_global)."""
    _require(op, "hidden_states", x)
    fe = check_array(op, "hidden_states", x, min_ndim=2)
    if x.ndim != 2:
        raise ValueError(f"{op}: argument 'hidden_states' must be [tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    if hidden_size is not None and hidden != hidden_size:
        raise ValueError(f"{op}: argument 'hidden_states' has hidden size {hidden}; expected {hidden_size}")
    for name, w in (("w13", w13), ("w2", w2)):
        _require(op, name, w)
        check_optional_like(op, name, w, "hidden_states", x, fe, shape=tuple(w.shape), same_dtype=True)
        if w.ndim != 3:
            raise ValueError(f"{op}: argument '{name}' must be 3-D [experts, ...], got shape {tuple(w.shape)}")
    local, rows, w13_hidden = w13.shape
    if w13_hidden != hidden:
        raise ValueError(f"{op}: argument 'w13' has shape {tuple(w13.shape)}; expected [experts, rows, {hidden}] "
                         f"(the hidden size of 'hidden_states')")
    inter = w2.shape[2]
    if intermediate_size is not None and inter != intermediate_size:
        raise ValueError(f"{op}: argument 'w2' has intermediate size {inter}; expected {intermediate_size}")
    want_rows = moe_math.w13_rows(activation, inter)
    if rows != want_rows:
        raise ValueError(f"{op}: argument 'w13' has {rows} rows per expert; expected {want_rows} "
                         f"({'2 * ' if moe_math.is_gated(activation) else ''}the intermediate size {inter} of 'w2' "
                         f"for activation {activation!r})")
    if tuple(w2.shape) != (local, hidden, inter):
        raise ValueError(f"{op}: argument 'w2' has shape {tuple(w2.shape)}; expected ({local}, {hidden}, {inter}) "
                         f"([experts, hidden, intermediate], agreeing with 'w13' and 'hidden_states')")
    check_optional_like(op, "w13_bias", w13_bias, "hidden_states", x, fe, shape=(local, rows))
    check_optional_like(op, "w2_bias", w2_bias, "hidden_states", x, fe, shape=(local, hidden))
    return fe, local, _check_expert_map(op, x, fe, expert_map, local, num_experts, weights_name="w13")


def _check_expert_map(op: str, x: Any, fe: str, expert_map: Any, local: int, num_experts: int | None, *,
                      weights_name: str) -> int:
    """``expert_map`` against the ``local`` experts the weights (``weights_name``) hold; returns the
    global expert count (``local`` without a map)."""
    if expert_map is None:
        num_global = local
        if num_experts is not None and local != num_experts:
            raise ValueError(f"{op}: argument '{weights_name}' holds {local} experts; expected num_experts={num_experts} "
                             f"(pass expert_map when the weights hold only this device's experts)")
    else:
        if expert_map.ndim != 1:
            raise ValueError(f"{op}: argument 'expert_map' must be 1-D [num_experts], got shape {tuple(expert_map.shape)}")
        num_global = expert_map.shape[0]
        if num_experts is not None and num_global != num_experts:
            raise ValueError(f"{op}: argument 'expert_map' has length {num_global}; expected num_experts={num_experts} "
                             f"(one entry per global expert)")
        check_optional_like(op, "expert_map", expert_map, "hidden_states", x, fe, shape=(num_global,),
                            dtypes=_INT_DTYPES)
        values = concrete_values(expert_map)
        if values is not None and values.size and (values.min() < -1 or values.max() >= local):
            bad = int(values[(values < -1) | (values >= local)][0])
            raise ValueError(f"{op}: argument 'expert_map' holds {bad}; expected -1 (elsewhere) or a local expert "
                             f"index in [0, {local}) ('{weights_name}' holds {local} experts)")
    return num_global


def _check_routing(op: str, x: Any, fe: str, topk_weights: Any, topk_ids: Any, num_global: int) -> None:
    _require(op, "topk_weights", topk_weights)
    _require(op, "topk_ids", topk_ids)
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: argument 'topk_ids' has shape {tuple(topk_ids.shape)}; expected [{x.shape[0]}, top_k]")
    check_optional_like(op, "topk_ids", topk_ids, "hidden_states", x, fe, shape=tuple(topk_ids.shape),
                        dtypes=_INT_DTYPES)
    check_optional_like(op, "topk_weights", topk_weights, "hidden_states", x, fe, shape=tuple(topk_ids.shape))
    ids = concrete_values(topk_ids)
    if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= num_global):
        bad = int(ids[(ids < 0) | (ids >= num_global)][0])
        raise ValueError(f"{op}: argument 'topk_ids' holds expert {bad}; expected ids in [0, {num_global})")


def layer_expert_weights(op: str, layer: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``(w13, w2, w13_bias, w2_bias, expert_map)`` from an engine-style MoE layer: its
    ``w13_weight`` and ``w2_weight`` (required), ``w13_bias``, ``w2_bias`` and ``expert_map`` (None
    when absent), as the engine's ``FusedMoE`` holds them; what ``apply(layer, ...)`` reads."""
    missing = [name for name in ("w13_weight", "w2_weight") if getattr(layer, name, None) is None]
    if missing:
        raise TypeError(f"{op}: argument 'layer' ({type(layer).__qualname__}) has no {' or '.join(missing)}; expected "
                        f"the engine's FusedMoE layer (create_weights gives it the expert weights)")
    return (layer.w13_weight, layer.w2_weight, getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None),
            getattr(layer, "expert_map", None))


@CustomOp.register(EXPERTS_OP)
class UnquantizedFusedMoEMethod(CustomOp):
    """``UnquantizedFusedMoEMethod(activation="silu", apply_router_weight_on_input=False,
    float32_output=False)``; ``op(x, topk_weights, topk_ids, w13, w2, w13_bias=None, w2_bias=None,
    expert_map=None)`` -> ``[T, H]`` in x's dtype: the experts of unquantized weights for given
    routing (the engine's method object; ``FusedMoE`` calls it after routing).

    ``float32_output``: return the float32 weighted sum instead of casting it to x's dtype, so a
    caller that adds several devices' partial outputs (expert parallelism, ``modular_fused_moe``)
    rounds once, after the sum; every path (native body and kernels) honours it.

    ``create_weights`` gives the weights' shapes (and makes them on a layer); ``apply(layer, x,
    topk_weights, topk_ids)`` runs the op with the layer's weights and expert map.
    """

    def __init__(self, activation: str = "silu", apply_router_weight_on_input: bool = False,
                 float32_output: bool = False, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.activation = _check_choice(EXPERTS_OP, "activation", activation, moe_math.MOE_ACTIVATIONS)
        self.apply_router_weight_on_input = bool(apply_router_weight_on_input)
        self.float32_output = bool(float32_output)

    def extra_repr(self) -> str:
        return (f"activation={self.activation!r}, apply_router_weight_on_input={self.apply_router_weight_on_input}, "
                f"float32_output={self.float32_output}")

    # -------------------------------------------------------------- weights

    def weight_shapes(self, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                      has_bias: bool = False) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the layer's expert weights (the engine's names)."""
        rows = moe_math.w13_rows(self.activation, intermediate_size_per_partition)
        shapes = {"w13_weight": (num_experts, rows, hidden_size),
                  "w2_weight": (num_experts, hidden_size, intermediate_size_per_partition)}
        if has_bias:
            shapes.update(w13_bias=(num_experts, rows), w2_bias=(num_experts, hidden_size))
        return shapes

    def create_weights(self, layer: Any, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: Any, has_bias: bool = False) -> None:
        """Give ``layer`` zero-filled expert weights: frozen ``nn.Parameter``s on a torch module,
        jax arrays as attributes otherwise."""
        shapes = self.weight_shapes(num_experts, hidden_size, intermediate_size_per_partition, has_bias)
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and isinstance(layer, torch.nn.Module):
            for name, shape in shapes.items():
                layer.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=params_dtype),
                                                                  requires_grad=False))
            return
        import jax.numpy as jnp

        for name, shape in shapes.items():
            setattr(layer, name, jnp.zeros(shape, dtype=params_dtype))

    def apply(self, layer: Any, x: Any, topk_weights: Any, topk_ids: Any) -> Any:
        """The engine's call (``quant_method.apply(layer=..., x=..., topk_weights=..., topk_ids=...)``):
        the experts with ``layer``'s weights (``layer_expert_weights``)."""
        return self(x, topk_weights, topk_ids, *layer_expert_weights(EXPERTS_OP, layer))

    # -------------------------------------------------------------- the op

    def check_inputs(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                     w2_bias: Any = None, expert_map: Any = None) -> None:
        fe, _, num_global = _check_experts(EXPERTS_OP, x, w13, w2, w13_bias, w2_bias, expert_map, self.activation)
        _check_routing(EXPERTS_OP, x, fe, topk_weights, topk_ids, num_global)
        if self.apply_router_weight_on_input and topk_ids.shape[1] != 1:
            raise ValueError(f"{EXPERTS_OP}: apply_router_weight_on_input needs top_k == 1; 'topk_ids' has "
                             f"top_k {topk_ids.shape[1]}")

    def _options(self) -> dict[str, Any]:
        """The static options every experts path takes (``moe_math.experts_reference``'s keywords)."""
        return dict(activation=self.activation, apply_router_weight_on_input=self.apply_router_weight_on_input,
                    float32_output=self.float32_output)

    def forward_native(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                       w2_bias: Any = None, expert_map: Any = None) -> Any:
        xp = array_namespace(x)
        return moe_math.experts_reference(xp, x, topk_weights, topk_ids, w13, w2, w13_bias=w13_bias,
                                          w2_bias=w2_bias, expert_map=expert_map, **self._options())

    def forward_tpu(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                    w2_bias: Any = None, expert_map: Any = None) -> Any:
        return call_jax_function(frontend_of(x), _PALLAS_EXPERTS, x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias,
                           expert_map, native=self.forward_native, **self._options())

    def forward_cuda(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                     w2_bias: Any = None, expert_map: Any = None) -> Any:
        """torch on CUDA/ROCm: the Triton kernels; jax arrays on a GPU: XLA's ``ragged_dot``."""
        fe = frontend_of(x)
        kernel = _RAGGED_EXPERTS if family_of(fe) == "jax" else _TRITON_EXPERTS
        args = (x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map)
        if kernel is _RAGGED_EXPERTS:
            return kernel(*args, on_cpu=False, **self._options())
        return call_triton(fe, kernel, *args, **self._options())

    def forward_cpu(self, x: Any, topk_weights: Any, topk_ids: Any, w13: Any, w2: Any, w13_bias: Any = None,
                    w2_bias: Any = None, expert_map: Any = None) -> Any:
        """torch on the CPU: ``kernels/cpu/fused_moe.py``; jax arrays on the CPU: XLA's ``ragged_dot``."""
        if frontend_of(x) == "jax":
            return _RAGGED_EXPERTS(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map, on_cpu=True,
                                   **self._options())
        return _CPU_EXPERTS(x, topk_weights, topk_ids, w13, w2, w13_bias, w2_bias, expert_map, **self._options())

    # torch tensors take the C++ / Triton kernels, jax arrays XLA's ragged_dot (CPU and GPUs).
    serves = {"forward_cpu": Serves(("torch", "jax"), "no cpu kernel for {frontend} tensors"),
              "forward_cuda": Serves(("torch", "jax"), "no cuda kernel for {frontend} tensors"),
              "forward_hip": Serves(("torch", "jax"), "no cuda kernel for {frontend} tensors")}


@CustomOp.register(MOE_OP)
class FusedMoE(CustomOp):
    """``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=True,
    use_grouped_topk=False, num_expert_group=None, topk_group=None, scoring_func="softmax",
    routed_scaling_factor=1.0, activation="silu", apply_router_weight_on_input=False, has_bias=False)``;
    ``op(hidden_states [T, H], router_logits [T, E], w13, w2, w13_bias=None, w2_bias=None,
    e_score_correction_bias=None, expert_map=None)`` -> ``[T, H]``.

    With ``use_grouped_topk``, ``1 <= topk_group <= num_expert_group`` and ``num_expert_group``
    divides ``num_experts``; ``routed_scaling_factor`` is finite and >= 0 (refused otherwise).
    Routing is ``grouped_topk`` (``self.router``, dispatched as its own op: its kernel, config and
    report row are its own; its docstring has the non-finite rule: a token whose router row is NaN
    under softmax gets NaN output on every path); the experts are ``unquantized_fused_moe``
    (``self.quant_method``), whose kernel for this platform this op's platform method runs, so a
    cell of ``fused_moe`` counts as a kernel cell only when the experts' kernel ran.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        use_grouped_topk: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        scoring_func: str = "softmax",
        routed_scaling_factor: float = 1.0,
        activation: str = "silu",
        apply_router_weight_on_input: bool = False,
        has_bias: bool = False,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = type(self).name
        self.num_experts = _check_int(op, "num_experts", num_experts, minimum=1)
        self.top_k = _check_int(op, "top_k", top_k, minimum=1)
        if self.top_k > self.num_experts:
            raise ValueError(f"{op}: top_k={top_k} is more than num_experts={num_experts}")
        self.hidden_size = _check_int(op, "hidden_size", hidden_size, minimum=1)
        self.intermediate_size = _check_int(op, "intermediate_size", intermediate_size, minimum=1)
        self.use_grouped_topk = bool(use_grouped_topk)
        if self.use_grouped_topk and (num_expert_group is None or topk_group is None):
            raise ValueError(f"{op}: use_grouped_topk=True needs num_expert_group and topk_group")
        if not self.use_grouped_topk:
            num_expert_group = topk_group = 0
        else:  # named for this op before the router checks them again
            _check_int(op, "num_expert_group", num_expert_group, minimum=1)
            _check_int(op, "topk_group", topk_group, minimum=1)
            _check_groups(op, num_expert_group, topk_group, self.num_experts)
        _check_scale(op, "routed_scaling_factor", routed_scaling_factor)
        if apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(f"{op}: apply_router_weight_on_input=True needs top_k == 1, got top_k={top_k}")
        self.has_bias = bool(has_bias)
        self.router = GroupedTopk(self.top_k, renormalize, num_expert_group, topk_group, scoring_func,
                                  routed_scaling_factor)
        self.quant_method = UnquantizedFusedMoEMethod(activation, apply_router_weight_on_input)
        self.renormalize = self.router.renormalize
        self.num_expert_group, self.topk_group = self.router.num_expert_group, self.router.topk_group
        self.scoring_func, self.routed_scaling_factor = self.router.scoring_func, self.router.routed_scaling_factor
        self.activation = self.quant_method.activation
        self.apply_router_weight_on_input = self.quant_method.apply_router_weight_on_input

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, {self.router.extra_repr()}, "
                f"activation={self.activation!r}, apply_router_weight_on_input={self.apply_router_weight_on_input}, "
                f"has_bias={self.has_bias}")

    def check_inputs(self, hidden_states: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any = None,
                     w2_bias: Any = None, e_score_correction_bias: Any = None, expert_map: Any = None) -> None:
        fe, _, _ = _check_experts(type(self).name, hidden_states, w13, w2, w13_bias, w2_bias, expert_map,
                                  self.activation, hidden_size=self.hidden_size,
                                  intermediate_size=self.intermediate_size, num_experts=self.num_experts)
        self._check_router_inputs(hidden_states, fe, router_logits, e_score_correction_bias,
                                  biases={"w13_bias": w13_bias, "w2_bias": w2_bias})

    def _check_router_inputs(self, hidden_states: Any, fe: str, router_logits: Any, e_score_correction_bias: Any,
                             biases: dict[str, Any]) -> None:
        """``router_logits`` and the correction bias; with ``has_bias``, the expert ``biases``
        (``{argument name: value}``) must be given."""
        op = type(self).name
        _check_2d(op, "router_logits", router_logits, "hidden_states", hidden_states, fe,
                  (hidden_states.shape[0], self.num_experts))
        if self.has_bias and any(b is None for b in biases.values()):
            raise ValueError(f"{op}: has_bias=True needs {' and '.join(map(repr, biases))}")
        check_optional_like(op, "e_score_correction_bias", e_score_correction_bias, "hidden_states", hidden_states,
                            fe, shape=(self.num_experts,))

    def route(self, hidden_states: Any, router_logits: Any, e_score_correction_bias: Any = None) -> tuple[Any, Any]:
        """``(topk_weights, topk_ids)`` from the router op (dispatched on its own)."""
        return self.router(hidden_states, router_logits, e_score_correction_bias)

    def forward_native(self, hidden_states: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any = None,
                       w2_bias: Any = None, e_score_correction_bias: Any = None, expert_map: Any = None) -> Any:
        weights, ids = self.router.forward_native(hidden_states, router_logits, e_score_correction_bias)
        return self.quant_method.forward_native(hidden_states, weights, ids, w13, w2, w13_bias, w2_bias, expert_map)

    def _fast(self, method: str, hidden_states: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any,
              w2_bias: Any, e_score_correction_bias: Any, expert_map: Any) -> Any:
        weights, ids = self.route(hidden_states, router_logits, e_score_correction_bias)
        experts = getattr(self.quant_method, method)
        return experts(hidden_states, weights, ids, w13, w2, w13_bias, w2_bias, expert_map)

    def forward_tpu(self, hidden_states: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any = None,
                    w2_bias: Any = None, e_score_correction_bias: Any = None, expert_map: Any = None) -> Any:
        return self._fast("forward_tpu", hidden_states, router_logits, w13, w2, w13_bias, w2_bias,
                          e_score_correction_bias, expert_map)

    def forward_cuda(self, hidden_states: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any = None,
                     w2_bias: Any = None, e_score_correction_bias: Any = None, expert_map: Any = None) -> Any:
        return self._fast("forward_cuda", hidden_states, router_logits, w13, w2, w13_bias, w2_bias,
                          e_score_correction_bias, expert_map)

    def forward_cpu(self, hidden_states: Any, router_logits: Any, w13: Any, w2: Any, w13_bias: Any = None,
                    w2_bias: Any = None, e_score_correction_bias: Any = None, expert_map: Any = None) -> Any:
        return self._fast("forward_cpu", hidden_states, router_logits, w13, w2, w13_bias, w2_bias,
                          e_score_correction_bias, expert_map)

    # Whatever its experts' method serves (asked per instance below).
    serves = {m: Serves(ALL_FRONTENDS) for m in ("forward_cpu", "forward_cuda", "forward_hip")}

    def declines(self, method: str, frontend: str) -> str | None:
        return self.quant_method.passes_over(method, frontend)


# ---------------------------------------------------------------------------------- check cases


def _expert_weights(rng, num_experts: int, hidden: int, inter: int, activation: str, bias: bool):
    from dualop.testing import normal

    rows = moe_math.w13_rows(activation, inter)
    w13 = normal((num_experts, rows, hidden), rng, hidden ** -0.5)
    w2 = normal((num_experts, hidden, inter), rng, inter ** -0.5)
    b13 = normal((num_experts, rows), rng, 0.1) if bias else None
    b2 = normal((num_experts, hidden), rng, 0.1) if bias else None
    return w13, w2, b13, b2


def check_cases():
    """Small routing and MoE problems (CI runs every cell in interpreters).

    grouped_topk shapes are ``(tokens, num_expert_group, experts_per_group)``; fused_moe and
    unquantized_fused_moe shapes are ``(tokens, top_k, hidden)`` with the experts and intermediate
    size in the label."""
    import numpy as np

    from dualop.testing import OpCase, Pinned, normal

    def topk_inputs(bias: bool):
        def make(shape, rng):
            tokens, groups, per_group = shape
            experts = groups * per_group
            corr = Pinned(normal((experts,), rng, 0.5), "float32") if bias else None
            return (normal((tokens, 16), rng), normal((tokens, experts), rng, 2.0), corr)
        return make

    topk_shapes = ((0, 4, 8), (1, 1, 8), (13, 4, 16), (33, 8, 8))
    cases = [
        OpCase(TOPK_OP, f"{TOPK_OP}[softmax,k2]", lambda s: GroupedTopk(2, True), topk_inputs(False), topk_shapes),
        OpCase(TOPK_OP, f"{TOPK_OP}[softmax,groups,k4,no_renorm]",
               lambda s: GroupedTopk(4, False, s[1], max(1, s[1] // 2)), topk_inputs(False), topk_shapes),
        OpCase(TOPK_OP, f"{TOPK_OP}[sigmoid,groups,bias,k6,scale2.5]",
               lambda s: GroupedTopk(6, True, s[1], max(1, s[1] // 2), "sigmoid", 2.5), topk_inputs(True),
               topk_shapes),
    ]

    def moe_inputs(experts: int, inter: int, activation: str, bias: bool, correction: bool, holes: bool):
        def make(shape, rng):
            tokens, _, hidden = shape
            local = experts // 2 if holes else experts
            w13, w2, b13, b2 = _expert_weights(rng, local, hidden, inter, activation, bias)
            corr = Pinned(normal((experts,), rng, 0.5), "float32") if correction else None
            expert_map = None
            if holes:  # this device holds every other expert, in shuffled local order
                mapping = np.full(experts, -1, np.int32)
                mapping[rng.permutation(experts)[:local]] = rng.permutation(local)
                expert_map = Pinned(mapping, "int32")
            return (normal((tokens, hidden), rng), normal((tokens, experts), rng, 2.0), w13, w2, b13, b2, corr,
                    expert_map)
        return make

    moe_shapes = ((0, 2, 128), (1, 1, 200), (13, 2, 256))
    cases += [
        OpCase(MOE_OP, f"{MOE_OP}[silu,E8,I128]", lambda s: FusedMoE(8, s[1], s[2], 128),
               moe_inputs(8, 128, "silu", False, False, False), moe_shapes),
        OpCase(MOE_OP, f"{MOE_OP}[grouped,sigmoid,bias,scale,E16,I64]",
               lambda s: FusedMoE(16, s[1], s[2], 64, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                                  scoring_func="sigmoid", routed_scaling_factor=2.5),
               moe_inputs(16, 64, "silu", False, True, False), ((0, 4, 128), (1, 1, 200), (13, 6, 256))),
        OpCase(MOE_OP, f"{MOE_OP}[swigluoai,has_bias,E8,I96]",
               lambda s: FusedMoE(8, s[1], s[2], 96, activation="swigluoai", has_bias=True),
               moe_inputs(8, 96, "swigluoai", True, False, False), moe_shapes),
        OpCase(MOE_OP, f"{MOE_OP}[gelu_tanh,expert_map,E16,I128]",
               lambda s: FusedMoE(16, s[1], s[2], 128, activation="gelu_tanh"),
               moe_inputs(16, 128, "gelu_tanh", False, False, True), moe_shapes),
        OpCase(MOE_OP, f"{MOE_OP}[relu2,weight_on_input,E8,I128]",
               lambda s: FusedMoE(8, 1, s[2], 128, activation="relu2", apply_router_weight_on_input=True,
                                  renormalize=False),
               moe_inputs(8, 128, "relu2", False, False, False), ((0, 1, 128), (1, 1, 200), (13, 1, 256))),
    ]

    def experts_inputs(shape, rng):
        tokens, top_k, hidden = shape
        experts, inter = 8, 128
        w13, w2, _, _ = _expert_weights(rng, experts // 2, hidden, inter, "gelu", False)
        ids = np.array([rng.permutation(experts)[:top_k] for _ in range(tokens)], np.int32).reshape(tokens, top_k)
        weights = rng.random((tokens, top_k)).astype(np.float32)
        mapping = np.full(experts, -1, np.int32)
        mapping[rng.permutation(experts)[: experts // 2]] = rng.permutation(experts // 2)
        return (normal((tokens, hidden), rng), Pinned(weights, "float32"), Pinned(ids.astype(np.int32), "int32"),
                w13, w2, None, None, Pinned(mapping, "int32"))

    cases.append(OpCase(EXPERTS_OP, f"{EXPERTS_OP}[gelu,expert_map,E8,I128]",
                        lambda s: UnquantizedFusedMoEMethod("gelu"), experts_inputs, moe_shapes))
    return cases


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- mixture of experts ------------------------------------------------------------------------
# ``fused_moe`` (routing + experts) on x of (tokens, hidden), with the expert count, top-k and the
# intermediate size per hidden size of two model families: Mixtral (8 experts, top-2, I = 3.5 H)
# and Qwen3-MoE (top-8, I = 0.375 H; 64 experts here, half of Qwen3-30B-A3B's 128). Pass sizes
# (``--sizes 1x1024,64x1024,512x1024``): the default sizes are for row-wise ops.
MOE_FAMILIES: dict[str, tuple[int, int, float]] = {"mixtral": (8, 2, 3.5), "qwen3": (64, 8, 0.375)}


def _moe_op(family: str) -> Callable[[int], Any]:
    def make(hidden: int):
        from dualop.ops import FusedMoE

        experts, top_k, ratio = MOE_FAMILIES[family]
        return FusedMoE(experts, top_k, hidden, max(1, round(hidden * ratio)), renormalize=True)

    return make


def _moe_inputs(family: str) -> Callable[[tuple[int, ...], np.random.Generator], tuple]:
    def make(shape, rng):
        tokens, hidden = shape
        experts, _, ratio = MOE_FAMILIES[family]
        inter = max(1, round(hidden * ratio))
        return (_normal(shape, rng), _normal((tokens, experts), rng, 2.0),
                _normal((experts, 2 * inter, hidden), rng, hidden ** -0.5),
                _normal((experts, hidden, inter), rng, inter ** -0.5))

    return make


def _moe_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.fused_moe_cost(shape[0], op.top_k, op.num_experts, shape[1], op.intermediate_size, itemsize)


def _torch_moe(op):
    """transformers' own experts (``MixtralExperts``, the module Mixtral's sparse block calls; its
    eager implementation) after the router's softmax and top-k. Run in float32: in bfloat16 the
    block rounds the intermediate to bfloat16 and so computes a different value from the op's
    (float32 until the second matmul); its bfloat16 timings are in docs/BENCHMARKS.md."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=op.hidden_size, intermediate_size=op.intermediate_size,
                           num_local_experts=op.num_experts, num_experts_per_tok=op.top_k)
    config._experts_implementation = "eager"
    experts = MixtralExperts(config).requires_grad_(False)

    def moe(hidden_states, router_logits, w13, w2):
        # top-k as a stable sort: equal scores (frequent with 16-bit logits) go to the lower expert
        # index, the op's rule (torch.topk leaves their order unspecified)
        weights, ids = torch.sort(torch.softmax(router_logits.float(), dim=-1), dim=-1, descending=True, stable=True)
        weights, ids = weights[:, :op.top_k], ids[:, :op.top_k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        experts.gate_up_proj.data, experts.down_proj.data = w13.float(), w2.float()
        return experts(hidden_states.float(), ids, weights).to(hidden_states.dtype)

    return moe


def _jax_moe(op):
    """What a user writes with ``jax.lax.ragged_dot``: softmax and top-k, the routed rows sorted by
    expert, both projections as ragged matmuls with float32 accumulation (the second in float32,
    so the intermediate is not rounded), a scatter-add of the weighted rows."""
    import jax
    import jax.numpy as jnp

    f32, top_k, num_experts = jnp.float32, op.top_k, op.num_experts

    def moe(hidden_states, router_logits, w13, w2):
        weights, ids = jax.lax.top_k(jax.nn.softmax(router_logits.astype(f32), axis=-1), top_k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        order = jnp.argsort(ids.reshape(-1), stable=True)
        sizes = jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)
        token = order // top_k
        h = jax.lax.ragged_dot(hidden_states[token], jnp.swapaxes(w13, 1, 2), sizes, preferred_element_type=f32)
        inter = w2.shape[2]
        a = jax.nn.silu(h[:, :inter]) * h[:, inter:]
        y = jax.lax.ragged_dot(a, jnp.swapaxes(w2, 1, 2).astype(f32), sizes, preferred_element_type=f32)
        out = jnp.zeros(hidden_states.shape, f32).at[token].add(y * weights.reshape(-1)[order, None])
        return out.astype(hidden_states.dtype)

    return moe


# --- mixture of experts ---------------------------------------------------------------------------
# fused_moe / unquantized_fused_moe: (tokens, E_global, top_k, hidden, intermediate, E_local). One
# chip's experts: DeepSeek-V3 (256 experts of 7168 -> 2048, top-8, grouped sigmoid routing) with
# experts spread over 8 chips (32 local, the rest masked by expert_map), and Qwen3-235B-A22B (128
# experts of 4096 -> 1536, top-8, softmax) whole; a 16-token decode batch and an 8192-token prefill.
_MOE_SERVING = (
    (16, 256, 8, 7168, 2048, 32), (8192, 256, 8, 7168, 2048, 32),
    (16, 128, 8, 4096, 1536, 128), (8192, 128, 8, 4096, 1536, 128),
)


def _deepseek_like(num_experts: int) -> bool:
    return num_experts == 256


def _moe_weight_specs(shape: tuple[int, ...]) -> tuple:
    tokens, experts, top_k, hidden, inter, local = shape
    return (InputSpec((local, 2 * inter, hidden), None), InputSpec((local, hidden, inter), None))


def _fused_moe_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, experts, top_k, hidden, inter, local = shape
    w13, w2 = _moe_weight_specs(shape)
    correction = InputSpec((experts,), "float32") if _deepseek_like(experts) else None
    expert_map = InputSpec((experts,), "int32") if local < experts else None
    return (InputSpec((tokens, hidden), None), InputSpec((tokens, experts), None), w13, w2, None, None, correction,
            expert_map)


def _fused_moe_op(shape: tuple[int, ...]):
    from dualop.ops import FusedMoE

    tokens, experts, top_k, hidden, inter, local = shape
    if _deepseek_like(experts):
        return FusedMoE(experts, top_k, hidden, inter, use_grouped_topk=True, num_expert_group=8, topk_group=4,
                        scoring_func="sigmoid", routed_scaling_factor=2.5)
    return FusedMoE(experts, top_k, hidden, inter)


def _experts_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, experts, top_k, hidden, inter, local = shape
    w13, w2 = _moe_weight_specs(shape)
    routing = (InputSpec((tokens, top_k), "float32"), InputSpec((tokens, top_k), "int32"))
    expert_map = InputSpec((experts,), "int32") if local < experts else None
    return (InputSpec((tokens, hidden), None), *routing, w13, w2, None, None, expert_map)


def _experts_op(shape: tuple[int, ...]):
    from dualop.ops import UnquantizedFusedMoEMethod

    return UnquantizedFusedMoEMethod("silu")


def _grouped_topk_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, experts, groups, topk_group, top_k = shape
    correction = InputSpec((experts,), "float32") if groups else None
    return (InputSpec((tokens, 16), None), InputSpec((tokens, experts), None), correction)


def _grouped_topk_op(shape: tuple[int, ...]):
    from dualop.ops import GroupedTopk

    tokens, experts, groups, topk_group, top_k = shape
    if groups:
        return GroupedTopk(top_k, True, groups, topk_group, "sigmoid", 2.5)
    return GroupedTopk(top_k, True)


def bench_cases():
    """Not run by default: fused_moe per model family against a per-expert loop (torch) and a
    hand-written jax.numpy MoE."""
    return [BenchCase(f"fused_moe[{family}]", "fused_moe", _moe_op(family), _moe_inputs(family), _moe_cost,
                      _torch_moe, _jax_moe, default=False, matrix=True) for family in MOE_FAMILIES]


def serving():
    """One chip's experts (``_MOE_SERVING``); the routing op at DeepSeek-V3's grouped sigmoid router
    (8 groups, best 4, correction bias) and Qwen3-235B's plain softmax top-8, as (tokens,
    num_experts, num_expert_group, topk_group, top_k). MoE models are served in 16-bit (a float32
    DeepSeek-V3 or Qwen3-235B layer is not a shape anyone serves), and each MoE build at 8192 tokens
    costs the compilers tens of seconds: bfloat16 only, one model-shaped case each. The experts op
    runs the same kernels as fused_moe (which builds them at every serving shape): one decode step
    of DeepSeek-V3's expert-parallel slice (the expert_map variant) is enough for it."""
    bf16 = ("bfloat16",)
    return {
        "fused_moe": Serving(_MOE_SERVING, _fused_moe_inputs, {"fused_moe[silu,E8,I128]": _fused_moe_op}, bf16,
                             ("fused_moe[silu,E8,I128]",)),
        "unquantized_fused_moe": Serving(
            _MOE_SERVING[:1], _experts_inputs, {"unquantized_fused_moe[gelu,expert_map,E8,I128]": _experts_op}, bf16,
            ("unquantized_fused_moe[gelu,expert_map,E8,I128]",)),
        "grouped_topk": Serving(((16, 256, 8, 4, 8), (8192, 256, 8, 4, 8), (16, 128, 0, 0, 8), (8192, 128, 0, 0, 8)),
                                _grouped_topk_inputs, {"grouped_topk[softmax,k2]": _grouped_topk_op}, bf16,
                                ("grouped_topk[softmax,k2]",)),
    }

# jax arrays on the CPU and GPUs: XLA's own kernels (dot, ragged_dot) are the platform path
JAX_XLA = {("jax", "cpu"): "forward_cpu", ("jax", "cuda"): "forward_cuda"}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {
    "grouped_topk": {"traits": {"case_shapes_only"}},
    # the experts run XLA's grouped matmul (jax.lax.ragged_dot) for jax arrays on the CPU and GPUs
    **{op: {"traits": {"case_shapes_only", "contraction"}, "kernel_in_native_cells": JAX_XLA}
       for op in ("fused_moe", "unquantized_fused_moe")},
}
