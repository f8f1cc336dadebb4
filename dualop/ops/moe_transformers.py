"""``transformers_fused_moe``: the fused MoE on Hugging Face transformers' stacked expert weights.

transformers (5.x) keeps a MoE block's experts as stacked tensors, described by the flags of its
``use_experts_implementation`` decorator, which this op takes by the same names:

- ``gate_up_proj`` ``[E, 2I, H]`` (``is_transposed=False``: Mixtral, Qwen3-MoE, DeepSeek-V3) or
  ``[E, H, 2I]`` (``is_transposed=True``: gpt-oss, Aria); gate and up halves concatenated
  (``is_concatenated=True``, ``[gate | up]``) or interleaved (``False``: gpt-oss, gate at the even
  rows). Experts with no gate (``relu2``, Nemotron-H's ``up_proj`` ``[E, I, H]``) pass their
  ``up_proj`` as ``gate_up_proj``.
- ``down_proj`` ``[E, H, I]`` (``[E, I, H]`` transposed); optional ``gate_up_proj_bias``
  ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``.

``hf_to_engine`` turns them into the engine layout the kernels take (``kernels/moe_math.py``:
``w13`` ``[E, 2I, H]`` gate first, interleaved for ``swigluoai``; ``w2`` ``[E, H, I]``):

- transposed weights become ``x.mT``: a strided view of torch tensors (no copy: the Triton and CPU
  kernels read the strides), a transpose in the traced program for jax arrays, torch_xla and
  torchax tensors (XLA chooses whether to materialise it for a dot; a Pallas call takes its
  operands in their default row-major layout, so there XLA writes a transposed copy per call);
- gate/up order differing from the engine's (concatenated ``swigluoai``, interleaved for the other
  activations) is re-ordered: a copy of ``gate_up_proj`` (and its bias) on every call.

Mixtral, Qwen3-MoE and DeepSeek-V3 cost nothing; gpt-oss costs the transposes on XLA devices.
Serving code that calls the experts many times converts once, at load
(``dualop.torch.layers.FusedMoE.load_hf_experts`` and its JAX twin), and calls ``fused_moe``.
"""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.kernels import moe_math
from dualop.ops._checks import check_array, check_optional_like, dtype_name
from dualop.ops.moe import FusedMoE, _check_expert_map, _require
from dualop.platforms import frontend_of
from dualop.spec import InputSpec, Serving

__all__ = ["TransformersFusedMoE", "hf_to_engine"]

HF_MOE_OP = "transformers_fused_moe"
_ROUTING_IDS = frozenset({"int32", "int64"})  # transformers' top_k_index dtypes


def _engine_gate_up_order(w: Any, activation: str, is_concatenated: bool) -> Any:
    """Re-order the rows (axis 1) of ``w`` ``[E, 2I, ...]`` from transformers' gate/up order to the
    engine's (interleaved for ``swigluoai``, concatenated otherwise): a copy when they differ."""
    interleaved = moe_math.gate_spec(activation).interleaved
    if is_concatenated != interleaved:
        return w
    xp = array_namespace(w)
    experts, rows, *rest = w.shape
    half = rows // 2
    if is_concatenated:  # [gate | up] -> gate_0, up_0, gate_1, up_1, ...
        halves = xp.reshape(w, (experts, 2, half, *rest))
        return xp.reshape(xp.stack([halves[:, 0], halves[:, 1]], axis=2), (experts, rows, *rest))
    pairs = xp.reshape(w, (experts, half, 2, *rest))  # interleaved -> [gate | up]
    return xp.concat([pairs[:, :, 0], pairs[:, :, 1]], axis=1)


def hf_to_engine(gate_up_proj: Any, down_proj: Any, gate_up_proj_bias: Any = None, down_proj_bias: Any = None, *,
                 activation: str = "silu", is_transposed: bool = False,
                 is_concatenated: bool = True) -> tuple[Any, Any, Any, Any]:
    """``(w13, w2, w13_bias, w2_bias)`` in the engine layout from transformers' stacked experts
    (the module docstring says what is a view and what is a copy)."""
    w13, w2 = (gate_up_proj.mT, down_proj.mT) if is_transposed else (gate_up_proj, down_proj)
    if moe_math.is_gated(activation):
        w13 = _engine_gate_up_order(w13, activation, is_concatenated)
        if gate_up_proj_bias is not None:
            gate_up_proj_bias = _engine_gate_up_order(gate_up_proj_bias, activation, is_concatenated)
    return w13, w2, gate_up_proj_bias, down_proj_bias


@CustomOp.register(HF_MOE_OP)
class TransformersFusedMoE(FusedMoE):
    """``TransformersFusedMoE(num_experts, top_k, hidden_size, intermediate_size, ...,
    is_transposed=False, is_concatenated=True)`` (``FusedMoE``'s arguments, then transformers'
    layout flags); ``op(hidden_states [T, H], router_logits [T, E], gate_up_proj, down_proj,
    gate_up_proj_bias=None, down_proj_bias=None, e_score_correction_bias=None, expert_map=None)``
    -> ``[T, H]``: ``fused_moe`` with the experts as transformers stores them, on the same kernels.

    gpt-oss: ``activation="swigluoai", has_bias=True, is_transposed=True, is_concatenated=False``,
    router logits from its router's ``F.linear(x, weight, bias)`` (its softmax over the top-k
    logits is ``renormalize=True``). With ``expert_map`` the weights hold the local experts only.
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
        is_transposed: bool = False,
        is_concatenated: bool = True,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize, use_grouped_topk,
                         num_expert_group, topk_group, scoring_func, routed_scaling_factor, activation,
                         apply_router_weight_on_input, has_bias, enforce_enable=enforce_enable)
        for name, flag in (("is_transposed", is_transposed), ("is_concatenated", is_concatenated)):
            if not isinstance(flag, bool):
                raise TypeError(f"{HF_MOE_OP}: argument '{name}' must be a bool, got {flag!r}")
        self.is_transposed = is_transposed
        self.is_concatenated = is_concatenated

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, is_transposed={self.is_transposed}, is_concatenated={self.is_concatenated}"

    def hf_shapes(self, num_local_experts: int) -> dict[str, tuple[int, ...]]:
        """``{argument: shape}`` of the expert weights as transformers stores them."""
        hidden, inter = self.hidden_size, self.intermediate_size
        rows = moe_math.w13_rows(self.activation, inter)
        flip = (lambda a, b: (num_local_experts, b, a)) if self.is_transposed else (
            lambda a, b: (num_local_experts, a, b))
        return {"gate_up_proj": flip(rows, hidden), "down_proj": flip(hidden, inter),
                "gate_up_proj_bias": (num_local_experts, rows), "down_proj_bias": (num_local_experts, hidden)}

    def check_inputs(self, hidden_states: Any, router_logits: Any = None, gate_up_proj: Any = None,
                     down_proj: Any = None, gate_up_proj_bias: Any = None, down_proj_bias: Any = None,
                     e_score_correction_bias: Any = None, expert_map: Any = None) -> None:
        op = HF_MOE_OP
        if frontend_of(router_logits) is not None and dtype_name(router_logits) in _ROUTING_IDS:
            raise TypeError(f"{op}: argument 'router_logits' has dtype {dtype_name(router_logits)}; expected float "
                            f"logits [tokens, {self.num_experts}]. transformers' experts call (hidden_states, "
                            f"topk_ids, topk_weights), the engine's TransformersFusedMoE.forward, is "
                            f"op.routed(hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj, ...)")
        fe = self._check_hf_experts(hidden_states, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias,
                                    expert_map)
        self._check_router_inputs(hidden_states, fe, router_logits, e_score_correction_bias,
                                  biases={"gate_up_proj_bias": gate_up_proj_bias, "down_proj_bias": down_proj_bias})

    def _check_hf_experts(self, hidden_states: Any, gate_up_proj: Any, down_proj: Any, gate_up_proj_bias: Any,
                          down_proj_bias: Any, expert_map: Any) -> str:
        """``hidden_states`` and the experts as transformers stores them; returns the frontend."""
        op = HF_MOE_OP
        _require(op, "hidden_states", hidden_states)
        fe = check_array(op, "hidden_states", hidden_states, min_ndim=2)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{op}: argument 'hidden_states' has shape {tuple(hidden_states.shape)}; expected "
                             f"[tokens, {self.hidden_size}]")
        for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            _require(op, name, w)
            check_optional_like(op, name, w, "hidden_states", hidden_states, fe, shape=tuple(w.shape),
                                same_dtype=True)
            if w.ndim != 3:
                raise ValueError(f"{op}: argument '{name}' must be 3-D [experts, ...], got shape {tuple(w.shape)}")
        local = gate_up_proj.shape[0]
        layout = f"is_transposed={self.is_transposed}, activation={self.activation!r}"
        shapes = self.hf_shapes(local)
        arrays = {"gate_up_proj": gate_up_proj, "down_proj": down_proj, "gate_up_proj_bias": gate_up_proj_bias,
                  "down_proj_bias": down_proj_bias}
        for name in ("gate_up_proj", "down_proj"):
            if tuple(arrays[name].shape) != shapes[name]:
                raise ValueError(f"{op}: argument '{name}' has shape {tuple(arrays[name].shape)}; expected "
                                 f"{shapes[name]} (hidden_size={self.hidden_size}, intermediate_size="
                                 f"{self.intermediate_size}, {local} experts as 'gate_up_proj' holds; {layout})")
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            check_optional_like(op, name, arrays[name], "hidden_states", hidden_states, fe, shape=shapes[name])
        _check_expert_map(op, hidden_states, fe, expert_map, local, self.num_experts, weights_name="gate_up_proj")
        return fe

    def routed(self, hidden_states: Any, topk_ids: Any, topk_weights: Any, gate_up_proj: Any, down_proj: Any,
               gate_up_proj_bias: Any = None, down_proj_bias: Any = None, expert_map: Any = None) -> Any:
        """transformers' experts call with the routing done, the engine's
        ``TransformersFusedMoE.forward(hidden_states, topk_ids, topk_weights)``, then the weights as
        transformers stores them -> ``[T, H]`` in hidden_states' dtype. Its router chose
        ``topk_ids`` ``[T, k]`` (int32/int64) and their ``topk_weights`` ``[T, k]``, used as given (no
        renormalisation, no scaling: as the engine's custom routing function); as the engine, the ids
        become int32 and the weights float32 (copies unless they already are). The experts are
        ``unquantized_fused_moe`` (``self.quant_method``, dispatched on its own)."""
        op = HF_MOE_OP
        fe = self._check_hf_experts(hidden_states, gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias,
                                    expert_map)
        if self.has_bias and (gate_up_proj_bias is None or down_proj_bias is None):
            raise ValueError(f"{op}: has_bias=True needs 'gate_up_proj_bias' and 'down_proj_bias'")
        check_array(op, "topk_ids", topk_ids, min_ndim=2, dtypes=_ROUTING_IDS)
        check_array(op, "topk_weights", topk_weights, min_ndim=2)
        for name, a in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if a.ndim != 2 or a.shape[0] != hidden_states.shape[0]:
                raise ValueError(f"{op}: argument '{name}' has shape {tuple(a.shape)}; expected "
                                 f"[{hidden_states.shape[0]}, top_k]")
        check_optional_like(op, "topk_weights", topk_weights, "hidden_states", hidden_states, fe,
                            shape=tuple(topk_ids.shape))
        xp = array_namespace(hidden_states)
        weights = self.engine_weights(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias)
        return self.quant_method(hidden_states, xp.astype(topk_weights, xp.float32), xp.astype(topk_ids, xp.int32),
                                 *weights, expert_map)

    def engine_weights(self, gate_up_proj: Any, down_proj: Any, gate_up_proj_bias: Any = None,
                       down_proj_bias: Any = None) -> tuple[Any, Any, Any, Any]:
        """``(w13, w2, w13_bias, w2_bias)`` for the kernels (``hf_to_engine`` with this op's layout)."""
        return hf_to_engine(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias, activation=self.activation,
                            is_transposed=self.is_transposed, is_concatenated=self.is_concatenated)

    def forward_native(self, hidden_states: Any, router_logits: Any, gate_up_proj: Any, down_proj: Any,
                       gate_up_proj_bias: Any = None, down_proj_bias: Any = None, e_score_correction_bias: Any = None,
                       expert_map: Any = None) -> Any:
        weights = self.engine_weights(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias)
        return super().forward_native(hidden_states, router_logits, *weights, e_score_correction_bias, expert_map)

    def forward_tpu(self, hidden_states: Any, router_logits: Any, gate_up_proj: Any, down_proj: Any,
                    gate_up_proj_bias: Any = None, down_proj_bias: Any = None, e_score_correction_bias: Any = None,
                    expert_map: Any = None) -> Any:
        weights = self.engine_weights(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias)
        return super().forward_tpu(hidden_states, router_logits, *weights, e_score_correction_bias, expert_map)

    def forward_cuda(self, hidden_states: Any, router_logits: Any, gate_up_proj: Any, down_proj: Any,
                     gate_up_proj_bias: Any = None, down_proj_bias: Any = None, e_score_correction_bias: Any = None,
                     expert_map: Any = None) -> Any:
        weights = self.engine_weights(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias)
        return super().forward_cuda(hidden_states, router_logits, *weights, e_score_correction_bias, expert_map)

    def forward_cpu(self, hidden_states: Any, router_logits: Any, gate_up_proj: Any, down_proj: Any,
                    gate_up_proj_bias: Any = None, down_proj_bias: Any = None, e_score_correction_bias: Any = None,
                    expert_map: Any = None) -> Any:
        weights = self.engine_weights(gate_up_proj, down_proj, gate_up_proj_bias, down_proj_bias)
        return super().forward_cpu(hidden_states, router_logits, *weights, e_score_correction_bias, expert_map)


def check_cases():
    """One tiny gpt-oss-shaped problem (transposed, interleaved, biased weights: the layout with
    views to give the kernels), shapes ``(tokens, top_k, hidden)``, 4 experts of intermediate 64."""
    from dualop.testing import OpCase, normal

    experts, inter = 4, 64

    def make_inputs(shape, rng):
        tokens, _, hidden = shape
        rows = 2 * inter
        return (normal((tokens, hidden), rng), normal((tokens, experts), rng, 2.0),
                normal((experts, hidden, rows), rng, hidden ** -0.5), normal((experts, inter, hidden), rng, inter ** -0.5),
                normal((experts, rows), rng, 0.1), normal((experts, hidden), rng, 0.1), None, None)

    return [OpCase(HF_MOE_OP, f"{HF_MOE_OP}[gpt_oss,E4,I64]",
                   lambda s: TransformersFusedMoE(experts, s[1], s[2], inter, activation="swigluoai", has_bias=True,
                                                  is_transposed=True, is_concatenated=False),
                   make_inputs, ((0, 2, 128), (1, 1, 200), (7, 2, 256)))]


# ----------------------------------------------------------------- loading a block's weights once

_HF_ARRAYS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "e_score_correction_bias")


def _find(state: dict, prefix: str, name: str) -> tuple[str | None, Any]:
    """The one entry of ``state`` under ``prefix`` named ``name`` (as a whole key or its last part)."""
    keys = [k for k in state if k.startswith(prefix) and (k == prefix + name or k.endswith("." + name))]
    if len(keys) > 1:
        raise ValueError(f"{HF_MOE_OP}: several entries named {name!r} under prefix {prefix!r}: {keys}; "
                         f"pass the prefix of one MoE block")
    return (keys[0], state[keys[0]]) if keys else (None, None)


def hf_expert_arrays(source: Any, *, prefix: str = "") -> tuple[dict[str, Any], dict[str, bool]]:
    """The expert tensors of a transformers MoE block (``{name: array}``, ``_HF_ARRAYS`` names
    present; ``up_proj`` is returned as ``gate_up_proj``), and the layout flags its experts module
    carries (``is_transposed``/``is_concatenated``, set by transformers' ``use_experts_implementation``;
    none for a state dict). ``source``: the block (``MixtralSparseMoeBlock``, ``DeepseekV3MoE``,
    ``GptOssMLP``, ...), its ``experts`` module, or a state dict (``prefix`` selects one block)."""
    flags: dict[str, bool] = {}
    if hasattr(source, "state_dict") and callable(source.state_dict):
        experts = getattr(source, "experts", source)
        for flag in ("is_transposed", "is_concatenated"):
            if isinstance(getattr(experts, flag, None), bool):
                flags[flag] = getattr(experts, flag)
        state = source.state_dict()
    elif hasattr(source, "keys"):
        state = dict(source)
    else:
        raise TypeError(f"{HF_MOE_OP}: expected a transformers MoE block (nn.Module) or a state dict, "
                        f"got {type(source).__module__}.{type(source).__qualname__}")
    found = {}
    for name in _HF_ARRAYS:
        key, value = _find(state, prefix, name)
        if key is None and name == "gate_up_proj":
            key, value = _find(state, prefix, "up_proj")  # experts with no gate (relu2)
        if key is not None:
            found[name] = value
    for name in ("gate_up_proj", "down_proj"):
        if name not in found:
            raise ValueError(f"{HF_MOE_OP}: no {name!r} under prefix {prefix!r} in the given weights "
                             f"(entries: {sorted(state)[:8]}{' ...' if len(state) > 8 else ''})")
    return found, flags


def engine_weights_from_hf(op: TransformersFusedMoE | FusedMoE, source: Any, *, prefix: str = "",
                           is_transposed: bool | None = None, is_concatenated: bool | None = None,
                           expert_map: Any = None) -> dict[str, Any]:
    """The engine-layout weights a ``FusedMoE`` layer holds (``w13_weight``, ``w2_weight``, and
    ``w13_bias``/``w2_bias``/``e_score_correction_bias`` when the block has them), from a
    transformers MoE block (see ``hf_expert_arrays``), in the block's own array type and dtype.

    Layout flags not given come from the experts module; for a state dict ``is_transposed`` is read
    off the shapes (an error when hidden == rows leaves it open) and ``is_concatenated`` is
    transformers' default, True, except for ``swigluoai``, where models differ (gpt-oss
    interleaves, so it must be given). With ``expert_map`` (``[num_experts]`` ints, concrete), only
    the local experts are kept, in local order.
    """
    import numpy as np

    name = HF_MOE_OP
    arrays, flags = hf_expert_arrays(source, prefix=prefix)
    hidden, inter = op.hidden_size, op.intermediate_size
    rows = moe_math.w13_rows(op.activation, inter)
    gate_up = arrays["gate_up_proj"]
    if len(gate_up.shape) != 3 or gate_up.shape[0] != op.num_experts:
        raise ValueError(f"{name}: the block's gate_up_proj has shape {tuple(gate_up.shape)}; expected "
                         f"{op.num_experts} experts of [{rows}, {hidden}] or [{hidden}, {rows}]")
    if is_transposed is None:
        is_transposed = flags.get("is_transposed")
    if is_transposed is None:
        if rows == hidden:
            raise ValueError(f"{name}: cannot tell from the shapes whether gate_up_proj {tuple(gate_up.shape)} is "
                             f"transposed (hidden == {rows} rows); pass is_transposed")
        is_transposed = tuple(gate_up.shape[1:]) == (hidden, rows)
    if is_concatenated is None:
        is_concatenated = flags.get("is_concatenated")
    if is_concatenated is None:
        if op.activation == "swigluoai":
            raise ValueError(f"{name}: pass is_concatenated for swigluoai experts given as a state dict "
                             f"(gpt-oss interleaves gate and up: is_concatenated=False)")
        is_concatenated = True
    layout = TransformersFusedMoE(op.num_experts, op.top_k, hidden, inter, activation=op.activation,
                                  has_bias=op.has_bias, is_transposed=is_transposed,
                                  is_concatenated=is_concatenated)
    shapes = layout.hf_shapes(op.num_experts)
    for arg in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if arg in arrays and tuple(arrays[arg].shape) != shapes[arg]:
            raise ValueError(f"{name}: the block's {arg} has shape {tuple(arrays[arg].shape)}; expected "
                             f"{shapes[arg]} (is_transposed={is_transposed}, activation={op.activation!r})")
    has_bias = "gate_up_proj_bias" in arrays and "down_proj_bias" in arrays
    if has_bias != op.has_bias:
        raise ValueError(f"{name}: the block {'has' if has_bias else 'has no'} expert biases but the layer was "
                         f"built with has_bias={op.has_bias}")
    w13, w2, b13, b2 = layout.engine_weights(arrays["gate_up_proj"], arrays["down_proj"],
                                             arrays.get("gate_up_proj_bias"), arrays.get("down_proj_bias"))
    out = {"w13_weight": w13, "w2_weight": w2}
    if has_bias:
        out.update(w13_bias=b13, w2_bias=b2)
    if expert_map is not None:
        if hasattr(expert_map, "detach"):  # a torch tensor, possibly on a GPU
            expert_map = expert_map.detach().cpu()
        mapping = np.asarray(expert_map).astype(np.int64)
        local_to_global = np.argsort(np.where(mapping < 0, len(mapping), mapping), kind="stable")
        local_to_global = local_to_global[: int((mapping >= 0).sum())]
        xp = array_namespace(w13)
        index = xp.asarray(local_to_global, like=w13, dtype=xp.int32)
        out = {k: xp.take(v, index, axis=0) for k, v in out.items()}
    if "e_score_correction_bias" in arrays:
        out["e_score_correction_bias"] = arrays["e_score_correction_bias"]
    return out


# --- spec: what dualop compile builds (check_cases above) ----------------------------------


def _transformers_fused_moe_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, experts, top_k, hidden, inter = shape
    return (InputSpec((tokens, hidden), None), InputSpec((tokens, experts), None),
            InputSpec((experts, hidden, 2 * inter), None), InputSpec((experts, inter, hidden), None),
            InputSpec((experts, 2 * inter), None), InputSpec((experts, hidden), None), None, None)


def _transformers_fused_moe_op(shape: tuple[int, ...]):
    from dualop.ops import TransformersFusedMoE

    tokens, experts, top_k, hidden, inter = shape
    return TransformersFusedMoE(experts, top_k, hidden, inter, activation="swigluoai", has_bias=True,
                                is_transposed=True, is_concatenated=False)


def serving():
    """gpt-oss-20b's experts as transformers stores them, (tokens, experts, top_k, hidden,
    intermediate): 32 experts of 2880 -> 2880, top-4, swigluoai with biases, gate_up_proj [E, H, 2I]
    interleaved and down_proj [E, I, H] (the transposed layout, so the program holds the transposes
    XLA makes of them); a 16-token decode batch and an 8192-token prefill, in bfloat16."""
    label = "transformers_fused_moe[gpt_oss,E4,I64]"
    return {"transformers_fused_moe": Serving(((16, 32, 4, 2880, 2880), (8192, 32, 4, 2880, 2880)),
                                              _transformers_fused_moe_inputs, {label: _transformers_fused_moe_op},
                                              ("bfloat16",), (label,))}

# jax arrays on the CPU and GPUs: XLA's own kernels (dot, ragged_dot) are the platform path
JAX_XLA = {("jax", "cpu"): "forward_cpu", ("jax", "cuda"): "forward_cuda"}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"transformers_fused_moe": {"traits": {"case_shapes_only", "contraction"}, "kernel_in_native_cells": JAX_XLA}}
