"""dualop inside vLLM: the ``dualop`` plugin of vLLM's ``vllm.general_plugins`` entry points.

Installed means active, as vLLM's plugins are; ``VLLM_PLUGINS`` filters plugins by name (``dualop``).
vLLM calls ``register()`` in each of its processes; it registers, through vLLM's own
``CustomOp.register_oot``, a replacement for every vLLM op class in ``REPLACEMENTS``. A replacement
subclasses vLLM's class, so its parameters and buffers stay the ones vLLM's loader fills, and sends
every forward method (``forward_native`` and each platform's) to the dualop op of the same
registered name with the same arrays: dualop's dispatch and its ``custom_ops`` config
(``DUALOP_CUSTOM_OPS``) then decide which of dualop's kernels runs, and vLLM's ``custom_ops`` (by
vLLM's registered names, restored after ``register_oot`` renames the class) still decides whether
vLLM calls its platform method or its native one.

An instance dualop cannot serve keeps vLLM's own methods, and the plugin logs why once per class:
a constructor argument dualop's op does not take, or a rope whose cos/sin table differs from
vLLM's. ``replaced()`` and ``not_replaced()`` say what happened in this process.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["register", "REPLACEMENTS", "KEPT_BY_VLLM", "replaced", "not_replaced", "Replacement"]

_LOG = logging.getLogger("dualop.vllm")

# The forward methods vLLM's CustomOp dispatches to (its platform detector picks one per process).
FORWARD_METHODS = ("forward_native", "forward_cpu", "forward_cuda", "forward_hip", "forward_xpu", "forward_tpu",
                   "forward_oot")

# vLLM constructor arguments with no bearing on the op's result, dropped when dualop's op lacks them:
# whether vLLM compiles its own native body, when it builds its rope table, the weights' storage dtype
# and device, the layer's name in vLLM's model.
_VLLM_ONLY_ARGS = frozenset({"compile_native", "init_cache", "dtype", "params_dtype", "device", "prefix"})


def _norm_call(module: Any, op: Any, x: Any, residual: Any = None) -> Any:
    """With a residual, in place as vLLM's own CPU and CUDA paths are (its fused add-norm may
    overwrite ``x`` and ``residual``)."""
    weight = module.weight if getattr(module, "has_weight", True) else None
    if residual is None:
        return op(x, weight)
    return op(x, weight, residual, out=x, residual_out=residual)


def _activation_call(module: Any, op: Any, x: Any) -> Any:
    return op(x)


def _rope_call(module: Any, op: Any, positions: Any, query: Any, key: Any = None) -> Any:
    """In place, as vLLM's own CPU and CUDA ropes rotate query and key."""
    return op(positions, query, key, query_out=query, key_out=key)


def _gated_norm_call(module: Any, op: Any, x: Any, gate: Any) -> Any:
    return op(x, gate, module.weight)


def _norm_gate_call(module: Any, op: Any, x: Any, z: Any = None) -> Any:
    return op(x, module.weight, z)


def _with_weights_call(module: Any, op: Any, x: Any) -> Any:
    return op(x, module.weight, module.bias)


def _encoder_attention_call(module: Any, op: Any, query: Any, key: Any, value: Any, cu_seqlens: Any = None,
                            max_seqlen: Any = None, sequence_lengths: Any = None) -> Any:
    """``sequence_lengths`` is only for vLLM's FlashInfer backend: ``cu_seqlens`` says the same."""
    return op(query, key, value, cu_seqlens, max_seqlen)


def _quant_fp8_build(dualop_cls: type, module: Any, args: tuple, kwargs: dict) -> tuple[Any | None, str | None]:
    """vLLM's ``GroupShape`` is a named tuple of its own: dualop's op takes it as a plain (row, col)."""
    return _dualop_twin(type(module).vllm_class, dualop_cls, args, kwargs, convert={"group_shape": tuple})


def _quant_fp8_call(module: Any, op: Any, x: Any, scale: Any = None, scale_ub: Any = None,
                    use_triton: bool = False) -> Any:
    return op(x, scale, scale_ub)


def _passthrough_call(module: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def _tensor_parallel(module: Any, op: Any) -> str | None:
    """dualop's op reduces over its own tensor-parallel group, not vLLM's."""
    size = getattr(module, "tp_size", 1)
    return f"it is sharded over vLLM's {size} tensor-parallel ranks" if size > 1 else None


def _rope_table_differs(module: Any, op: Any) -> str | None:
    """vLLM's cos/sin table against dualop's (built from the same constructor arguments): a
    difference means the two classes disagree on the scaling, so vLLM's methods stay."""
    import numpy as np

    theirs = getattr(module, "cos_sin_cache", None)
    if theirs is None:
        return "vLLM built no cos_sin_cache (init_cache=False)"
    theirs = theirs.detach().float().cpu().numpy()
    ours = np.asarray(op.cos_sin_cache, dtype=np.float32)
    if theirs.shape != ours.shape:
        return f"its cos/sin table is {theirs.shape}, dualop's {ours.shape}"
    # float32 tables of the same formula differ by float32 rounding of angles up to max_position
    # radians (~1e-5 at 256); a different scaling differs by far more
    tolerance = 1e-4 if module.cos_sin_cache.dtype.itemsize >= 4 else 1e-2
    worst = float(np.max(np.abs(theirs - ours))) if theirs.size else 0.0
    if worst > tolerance:
        return f"its cos/sin table differs from dualop's by {worst:.3g} (> {tolerance})"
    return None


# --- the routed experts -----------------------------------------------------------------------

# vLLM's MoEActivation values dualop's experts compute the same way (gate * act(up), gate first).
_EXPERT_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _experts_build(dualop_cls: type, module: Any, args: tuple, kwargs: dict) -> tuple[Any | None, str | None]:
    """dualop's experts for vLLM's unquantized method, from its ``FusedMoEConfig``: unquantized,
    bias-free experts with an activation dualop computes the same way."""
    moe = module.moe
    activation = getattr(moe.activation, "value", moe.activation)
    if activation not in _EXPERT_ACTIVATIONS:
        return None, f"its activation {activation!r} is not one dualop's experts compute as vLLM does {_EXPERT_ACTIVATIONS}"
    if moe.has_bias or getattr(moe, "is_lora_enabled", False):
        return None, "it has expert biases or LoRA, which this replacement does not carry"
    return dualop_cls(activation=activation), None


def _experts_call(module: Any, op: Any, layer: Any, x: Any, topk_weights: Any, topk_ids: Any,
                  shared_experts: Any = None, shared_experts_input: Any = None) -> Any:
    if shared_experts is not None:  # vLLM passes them only to a kernel that overlaps them (ours does not)
        raise TypeError(f"{op.name}: vLLM passed shared experts to overlap; dualop's experts do not overlap them "
                        f"(mk_can_overlap_shared_experts is False)")
    if bool(getattr(layer, "apply_router_weight_on_input", False)) != op.apply_router_weight_on_input:
        op = module._dualop_op = type(op)(activation=op.activation,
                                         apply_router_weight_on_input=layer.apply_router_weight_on_input)
    if str(topk_ids.dtype) != "torch.int32":  # vLLM's router may give int64 ids; dualop's experts take int32
        topk_ids = topk_ids.int()
    return op.apply(layer, x, topk_weights, topk_ids)


def _experts_keep_loaded_weights(vllm_cls: type) -> Callable[[Any, Any], None]:
    """``process_weights_after_loading`` of the replaced method: dualop reads the experts' weights as
    loaded (``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``), so vLLM's repacking for its own
    kernel (the CPU build prepacks them) is skipped where dualop serves the layer."""

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        if self.__dict__.get("_dualop_op") is None:
            return vllm_cls.process_weights_after_loading(self, layer)
        return super(vllm_cls, self).process_weights_after_loading(layer)

    return process_weights_after_loading


# --- the linear layers (vLLM PluggableLayers) -------------------------------------------------------


def _linear_build(dualop_cls: type, module: Any, args: tuple, kwargs: dict) -> tuple[Any | None, str | None]:
    """dualop's linear op of the same family, on one rank, for an unquantized vLLM linear layer that
    is not sharded; where it serves, the layer keeps its loaded weight (see ``_keep_loaded_weight``)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = module.quant_method
    if type(method) is not UnquantizedLinearMethod:
        return None, f"its weights are quantized ({type(method).__name__}); dualop's linear ops take unquantized ones"
    if module.tp_size > 1:
        return None, f"it is sharded over vLLM's {module.tp_size} tensor-parallel ranks"
    out_features, in_features = module.weight.shape
    common = dict(bias=module.bias is not None, skip_bias_add=module.skip_bias_add, return_bias=module.return_bias,
                  disable_tp=True)  # one rank (a constructor argument torch.compile's opaque op can carry)
    extra = {"reduce_results": module.reduce_results} if hasattr(module, "reduce_results") else {}
    try:
        op = dualop_cls(in_features, out_features, **common, **extra)
    except (TypeError, ValueError) as err:
        return None, f"dualop.ops.{dualop_cls.__name__} refuses it: {err}"
    _keep_loaded_weight(method)
    return op, None


_KEEPING: dict[type, type] = {}


def _keep_loaded_weight(method: Any) -> None:
    """vLLM's CPU build repacks a linear layer's weight for its own GEMM after loading and drops the
    weight; dualop's op reads the weight as loaded, so the layer's method skips that step."""
    cls = type(method)
    if cls not in _KEEPING:
        _KEEPING[cls] = type(f"DualopKept{cls.__name__}", (cls,), {
            "process_weights_after_loading": lambda self, layer: None, "__module__": __name__,
            "__doc__": f"vLLM's {cls.__name__}, keeping the weight as loaded (dualop's linear op reads it)."})
    method.__class__ = _KEEPING[cls]


def _linear_call(module: Any, op: Any, x: Any) -> Any:
    return op(x, module.weight, module.bias)


# --- the vocabulary embedding and the logits processor -----------------------------------------------


def _embedding_build(dualop_cls: type, module: Any, args: tuple, kwargs: dict) -> tuple[Any | None, str | None]:
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if type(module.quant_method) is not UnquantizedEmbeddingMethod:
        return None, f"its weights are quantized ({type(module.quant_method).__name__})"
    if module.tp_size > 1:
        return None, f"it is sharded over vLLM's {module.tp_size} tensor-parallel ranks"
    try:
        op = dualop_cls(module.num_embeddings, module.embedding_dim, org_num_embeddings=module.org_vocab_size,
                        padding_size=module.padding_size)
        op.check_inputs(module.weight.new_zeros((1,), dtype=torch.int32), module.weight)
    except (TypeError, ValueError) as err:  # a padded vocabulary laid out otherwise than dualop's
        return None, f"dualop.ops.{dualop_cls.__name__} refuses it: {err}"
    return op, None


def _embedding_call(module: Any, op: Any, input_: Any) -> Any:
    return op(input_, module.weight)


def _logits_call(module: Any, op: Any, lm_head: Any, hidden_states: Any, embedding_bias: Any = None,
                 skip_gather: bool = False) -> Any:
    """dualop's logits processor with the LM head's weight, where the head is one unquantized rank
    and the hidden states are in the head's dtype; else vLLM's own forward (said once)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    why = None
    if type(getattr(lm_head, "quant_method", None)) is not UnquantizedEmbeddingMethod:
        why = "its LM head is quantized"
    elif getattr(lm_head, "tp_size", 1) > 1 or skip_gather:
        why = "its LM head is sharded over vLLM's tensor-parallel ranks"
    elif getattr(module, "head_dtype", None) not in (None, hidden_states.dtype) or lm_head.weight.dtype != hidden_states.dtype:
        why = "its LM head computes in another dtype than the hidden states"
    if why is not None:
        _decline(type(module).vllm_class.__name__, why)
        return type(module).vllm_class.forward(module, lm_head, hidden_states, embedding_bias, skip_gather)
    if op.padding_size != lm_head.padding_size:
        op = module._dualop_op = type(op)(op.vocab_size, op.org_vocab_size, op.scale, op.logits_as_input, op.soft_cap,
                                          padding_size=lm_head.padding_size)
    return op(lm_head.weight, hidden_states, embedding_bias)


# --- the Mamba-2 mixer's conv and scan core ------------------------------------------------------------


def _mamba2_build(dualop_cls: type, module: Any, args: tuple, kwargs: dict) -> tuple[Any | None, str | None]:
    """dualop's ``causal_conv1d`` and ``ssd_chunk_scan`` for vLLM's ``MambaMixer2`` core (its
    projections and gated norm are replaced on their own): one rank, no speculative decoding or
    ReplaySSM, an activation dualop's conv takes."""
    import dualop.ops

    if module.tp_size > 1:
        return None, f"it is sharded over vLLM's {module.tp_size} tensor-parallel ranks"
    if module.num_spec > 0 or getattr(module, "use_replayssm", False):
        return None, "speculative decoding (ReplaySSM or draft tokens) is not in dualop's serving contract"
    if module.activation not in ("silu", None):
        return None, f"its conv activation {module.activation!r} is not one dualop's causal_conv1d takes"
    conv = dualop.ops.CausalConv1d(module.tped_conv_size, module.conv_kernel_size, module.activation)
    scan = dualop_cls(module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups)
    return (conv, scan), None


def _vllm_mixer_batch(module: Any) -> tuple[Any, ...] | None:
    """vLLM's batch for a state-space layer, from its forward context, as dualop's serving batch:
    ``(tokens, cu_seqlens, state_indices, has_initial_state)`` over vLLM's decodes (one token each)
    then prefills; None where vLLM's own code must run (its profiling run: no metadata; prefix-caching
    checkpoints; speculative decoding's several tokens or state slots per decode), said once."""
    import torch
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    metadata = metadata.get(module.prefix) if isinstance(metadata, dict) else None
    if metadata is None:
        return None
    decode_slots = metadata.state_indices_tensor_d
    if (getattr(metadata, "checkpoint_chunk_idx", None) is not None
            or getattr(metadata, "num_accepted_tokens", None) is not None
            or (decode_slots is not None and decode_slots.ndim == 2 and decode_slots.shape[-1] != 1)):
        _decline(type(module).vllm_class.__name__, "a batch with prefix-caching checkpoints or speculative decoding: "
                                                   "vLLM's own code runs for it")
        return None
    num_decodes, num_prefills = metadata.num_decode_tokens, metadata.num_prefills
    device = metadata.query_start_loc_p.device if metadata.query_start_loc_p is not None else decode_slots.device
    cu, slots, initial = [torch.arange(num_decodes, dtype=torch.int32, device=device)], [], []
    if num_decodes:
        slots.append(decode_slots.reshape(num_decodes, -1)[:, 0])
        initial.append(torch.ones(num_decodes, dtype=torch.bool, device=device))
    if num_prefills:
        cu.append(metadata.query_start_loc_p.to(torch.int32) + num_decodes)
        slots.append(metadata.state_indices_tensor_p[:num_prefills])
        has_initial = metadata.has_initial_states_p
        initial.append(torch.zeros(num_prefills, dtype=torch.bool, device=device) if has_initial is None
                       else has_initial[:num_prefills])
    else:
        cu.append(torch.tensor([num_decodes], dtype=torch.int32, device=device))
    tokens = num_decodes + metadata.num_prefill_tokens
    return tokens, torch.cat(cu), torch.cat(slots).to(torch.int32), torch.cat(initial)


def _conv_cache(module: Any, channels: int) -> Any:
    """vLLM's conv cache as ``[S, C, K-1]``: its DS layout is that, its SD layout ``[S, K-1, C]``."""
    cache = module.kv_cache[0]
    return cache if cache.shape[1] == channels else cache.transpose(-1, -2)


def _mamba2_core(module: Any, ops: Any, projected_states: Any, output: Any) -> None:
    """vLLM's ``conv_ssm_forward(projected_states, output)`` on dualop's conv and scan: the batch
    from vLLM's forward context (``_vllm_mixer_batch``), the conv and SSM caches vLLM allocated
    (updated in place), the scan's output written into ``output``."""
    import torch

    batch = _vllm_mixer_batch(module)
    if batch is None:
        return type(module).vllm_class.conv_ssm_forward(module, projected_states, output)
    tokens, cu_seqlens, state_indices, has_initial_state = batch
    conv_op, scan_op = ops
    x_bc, dt = torch.split(projected_states[:tokens, module.tped_intermediate_size:],
                           [module.tped_conv_size, module.tped_dt_size], dim=-1)
    conv_state = _conv_cache(module, module.tped_conv_size)
    x_bc, conv_out = conv_op(x_bc, module.conv_weights, module.conv1d.bias, conv_state.contiguous(), cu_seqlens,
                             state_indices, has_initial_state)
    conv_state.copy_(conv_out)
    hidden, B, C = module.split_hidden_states_B_C_fn(x_bc)
    heads, groups = module.num_heads // module.tp_size, module.n_groups // module.tp_size
    ssm_state = module.kv_cache[1]
    y, ssm_out = scan_op(hidden.reshape(tokens, heads, module.head_dim), dt, module.A,
                         B.reshape(tokens, groups, -1), C.reshape(tokens, groups, -1), module.D, None, module.dt_bias,
                         ssm_state, cu_seqlens, state_indices, has_initial_state)
    if ssm_out is not ssm_state:
        ssm_state.copy_(ssm_out)
    output[:tokens].copy_(y.reshape(tokens, -1))


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One vLLM op class dualop replaces: ``vllm_module.vllm_class`` (the ``register_oot`` key is
    the class name), served by ``dualop.ops.<dualop_class>``, built from the same constructor
    arguments unless ``build(dualop_cls, module, args, kwargs) -> (op, why not)`` says how;
    ``call(module, op, *args, **kwargs)`` maps vLLM's forward arguments onto the op's;
    ``declines(module, op)`` says why an instance keeps vLLM's methods (None: it does not);
    ``methods(vllm_cls)`` gives further methods of the replacement by name; ``routes`` are the
    methods sent to dualop (a ``CustomOp``'s forward methods; a ``PluggableLayer``'s ``forward``)."""

    vllm_module: str
    vllm_class: str
    dualop_class: str
    call: Callable[..., Any]
    declines: Callable[[Any, Any], str | None] | None = None
    build: Callable[..., tuple[Any | None, str | None]] | None = None
    methods: Callable[[type], dict[str, Callable[..., Any]]] | None = None
    routes: tuple[str, ...] = FORWARD_METHODS


_LAYERS = "vllm.model_executor.layers"
_ROPE = f"{_LAYERS}.rotary_embedding"

REPLACEMENTS: tuple[Replacement, ...] = (
    Replacement(f"{_LAYERS}.layernorm", "RMSNorm", "RMSNorm", _norm_call),
    Replacement(f"{_LAYERS}.layernorm", "GemmaRMSNorm", "GemmaRMSNorm", _norm_call),
    Replacement(f"{_LAYERS}.mamba.mamba_mixer2", "Mixer2RMSNormGated", "Mixer2RMSNormGated", _gated_norm_call,
                _tensor_parallel),
    Replacement(f"{_LAYERS}.layernorm", "RMSNormGated", "RMSNormGated", _norm_gate_call),
    Replacement(f"{_LAYERS}.conv", "Conv2dLayer", "Conv2dLayer", _with_weights_call),
    Replacement(f"{_LAYERS}.conv", "Conv3dLayer", "Conv3dLayer", _with_weights_call),
    Replacement(f"{_LAYERS}.fused_moe.router.grouped_topk_router", "GroupedTopk", "GroupedTopk", _passthrough_call),
    Replacement(f"{_ROPE}.common", "ApplyRotaryEmb", "ApplyRotaryEmb", _passthrough_call),
    Replacement(f"{_LAYERS}.attention.mm_encoder_attention", "MMEncoderAttention", "MMEncoderAttention",
                _encoder_attention_call),
    Replacement(f"{_LAYERS}.quantization.input_quant_fp8", "QuantFP8", "QuantFP8", _quant_fp8_call,
                build=_quant_fp8_build),
    *(Replacement(f"{_LAYERS}.activation", name, name, _activation_call) for name in (
        "SiluAndMul", "MulAndSilu", "GeluAndMul", "GeluAndMulSparse", "GELU", "GELUTanh", "NewGELU", "FastGELU",
        "QuickGELU",
        "ReLUSquaredActivation", "SwigluOAIAndMul", "FatreluAndMul", "SiluAndMulWithClamp", "SwigluStepAndMul",
        "SituAndMul")),
    *(Replacement(_ROPE, name, name, _rope_call, _rope_table_differs) for name in (
        "RotaryEmbedding", "LinearScalingRotaryEmbedding", "NTKScalingRotaryEmbedding",
        "DynamicNTKScalingRotaryEmbedding", "DynamicNTKAlphaRotaryEmbedding", "YaRNScalingRotaryEmbedding",
        "DeepseekScalingRotaryEmbedding", "Llama3RotaryEmbedding", "Phi3LongRoPEScaledRotaryEmbedding")),
    *(Replacement(f"{_LAYERS}.linear", name, dualop_name, _linear_call, build=_linear_build, routes=("forward",))
      for name, dualop_name in (("ReplicatedLinear", "ReplicatedLinear"), ("ColumnParallelLinear", "ColumnParallelLinear"),
                                ("MergedColumnParallelLinear", "ColumnParallelLinear"),
                                ("QKVParallelLinear", "ColumnParallelLinear"), ("RowParallelLinear", "RowParallelLinear"))),
    Replacement(f"{_LAYERS}.mamba.mamba_mixer2", "MambaMixer2", "SSDChunkScan", _mamba2_core, build=_mamba2_build,
                routes=("conv_ssm_forward",)),
    Replacement(f"{_LAYERS}.vocab_parallel_embedding", "VocabParallelEmbedding", "VocabParallelEmbedding",
                _embedding_call, build=_embedding_build, routes=("forward",)),
    Replacement(f"{_LAYERS}.logits_processor", "LogitsProcessor", "LogitsProcessor", _logits_call, routes=("forward",)),
    Replacement(f"{_LAYERS}.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod",
                "UnquantizedFusedMoEMethod", _experts_call, build=_experts_build,
                methods=lambda vllm_cls: {"process_weights_after_loading": _experts_keep_loaded_weights(vllm_cls)}),
)

# vLLM classes of dualop's op families the plugin leaves to vLLM, and why (logged once by register()).
KEPT_BY_VLLM: dict[str, str] = {
    "MambaMixer": "the Mamba-1 mixer's core is not adapted to vLLM's forward context yet",
    "Plamo2MambaMixer": "PLaMo 2's mixer core is not adapted to vLLM's forward context yet",
    "ShortConv": "LFM2's short conv has no reference run here (vLLM 0.32's LFM2 does not reproduce "
                 "transformers' tokens on a tiny checkpoint, plugin or not)",
    "DualChunkRotaryEmbedding": "not adapted yet",
    "MRotaryEmbedding": "the multimodal ropes take vLLM's own position layout; not adapted yet",
    "XIELU": "not adapted yet",
    "Attention": "dualop's paged attention is slower than vLLM's CPU attention: not registered as a backend "
                 "(docs/vllm.md, Attention)",
}

_replaced: dict[str, type] = {}
_not_replaced: dict[str, str] = {}


def replaced() -> dict[str, type]:
    """vLLM class name -> the replacement class registered in this process."""
    return dict(_replaced)


def not_replaced() -> dict[str, str]:
    """vLLM class name -> why it (or an instance of it) kept vLLM's own methods in this process."""
    return dict(_not_replaced)


def _decline(name: str, why: str) -> None:
    if name not in _not_replaced:
        _not_replaced[name] = why
        _LOG.warning("dualop: vLLM's %s keeps its own methods: %s", name, why)


def _dualop_twin(vllm_cls: type, dualop_cls: type, args: tuple, kwargs: dict,
                 convert: dict[str, Callable[[Any], Any]] | None = None) -> tuple[Any | None, str | None]:
    """dualop's op built from the arguments vLLM's class was built with (``convert`` maps a value of
    vLLM's own type to one dualop's op takes), or (None, why not)."""
    signature = inspect.signature(vllm_cls.__init__)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as err:
        return None, f"its constructor arguments do not bind ({err})"
    bound.apply_defaults()
    given = dict(list(bound.arguments.items())[1:])
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            given.update(given.pop(name, {}))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and given.pop(name, ()):
            return None, "it was built with extra positional arguments"
    accepted = inspect.signature(dualop_cls.__init__).parameters
    call_kwargs = {}
    for name, value in given.items():
        if name in accepted:
            call_kwargs[name] = (convert or {}).get(name, lambda v: v)(value)
        elif name in _VLLM_ONLY_ARGS:
            continue
        elif name in signature.parameters and value == signature.parameters[name].default:
            continue
        else:
            return None, f"its argument {name}={value!r} has no counterpart in dualop.ops.{dualop_cls.__name__}"
    try:
        return dualop_cls(**call_kwargs), None
    except (TypeError, ValueError) as err:
        return None, f"dualop.ops.{dualop_cls.__name__} refuses its arguments: {err}"


def _forward_method(method: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        op = self.__dict__.get("_dualop_op")
        if op is None:  # an instance dualop does not serve: vLLM's own method
            return getattr(type(self).vllm_class, method)(self, *args, **kwargs)
        return call(self, op, *args, **kwargs)

    forward.__name__ = method
    forward.__doc__ = f"dualop's op (its dispatch picks the kernel); vLLM's own {method} where dualop declines."
    return forward


def _make_replacement(spec: Replacement, vllm_cls: type, dualop_cls: type) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_cls.__init__(self, *args, **kwargs)
        if spec.build is not None:
            op, why = spec.build(dualop_cls, self, args, kwargs)
        else:
            op, why = _dualop_twin(vllm_cls, dualop_cls, args, kwargs)
        if op is not None and spec.declines is not None:
            why = spec.declines(self, op)
            op = None if why else op
        if op is None:
            _decline(spec.vllm_class, why or "dualop declined it")
        self._dualop_op = op

    namespace: dict[str, Any] = {"__init__": __init__, "vllm_class": vllm_cls, "dualop_class": dualop_cls,
                                 "__module__": __name__,
                                 "__doc__": f"vLLM's {spec.vllm_class} served by dualop.ops.{dualop_cls.__name__}."}
    for method in spec.routes:
        namespace[method] = _forward_method(method, spec.call)
    if spec.methods is not None:
        namespace.update(spec.methods(vllm_cls))
    return type(f"Dualop{spec.vllm_class}", (vllm_cls,), namespace)


def register() -> None:
    """vLLM's plugin entry point: register the replacements (idempotent; vLLM calls it in every
    process). A class vLLM lacks, or one another plugin replaced first, is left alone and said so."""
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot

    import dualop.ops

    for spec in REPLACEMENTS:
        if spec.vllm_class in _replaced:
            continue
        if spec.vllm_class in op_registry_oot:
            _decline(spec.vllm_class, f"another out-of-tree class ({op_registry_oot[spec.vllm_class].__qualname__}) "
                                      f"replaces it already")
            continue
        try:
            vllm_cls = getattr(importlib.import_module(spec.vllm_module), spec.vllm_class)
        except (ImportError, AttributeError) as err:
            _decline(spec.vllm_class, f"this vLLM has no {spec.vllm_module}.{spec.vllm_class} ({err})")
            continue
        replacement = _make_replacement(spec, vllm_cls, getattr(dualop.ops, spec.dualop_class))
        registered_name = getattr(vllm_cls, "name", None)
        registry = CustomOp if issubclass(vllm_cls, CustomOp) else PluggableLayer
        registry.register_oot(replacement, name=spec.vllm_class)
        if registered_name is not None:
            replacement.name = registered_name  # register_oot renamed it; vLLM's custom_ops use this name
        _replaced[spec.vllm_class] = replacement
    if not getattr(register, "_said", False):
        register._said = True  # type: ignore[attr-defined]
        _LOG.info("dualop: %d vLLM op classes served by dualop; left to vLLM: %s", len(_replaced),
                  "; ".join(f"{name} ({why})" for name, why in KEPT_BY_VLLM.items()))
