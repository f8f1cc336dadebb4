"""nn.Module layers over dualop ops, with the reference serving engine's constructor signatures.

Each layer owns its parameters (a norm's weight) and calls the op in ``forward``; the op's
dispatch (config, platform path, fallbacks) and its torch.compile support apply unchanged.
Parameterless ops are wrapped by ``OpLayer`` so they can sit in an ``nn.Sequential``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dualop import ops

__all__ = [
    "OpLayer",
    "RMSNorm",
    "GemmaRMSNorm",
    "RMSNormGated",
    "XIELU",
]


class OpLayer(nn.Module):
    """An nn.Module around a parameterless op: ``forward(*args)`` calls it."""

    op_class: type = ops.SiluAndMul

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.op = self.op_class(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


def _op_layer(op_class: type) -> type:
    """A layer class named like ``op_class`` that builds and calls it."""
    doc = f"Layer over :class:`dualop.ops.{op_class.__name__}`. " + (op_class.__doc__ or "")
    return type(op_class.__name__, (OpLayer,), {"op_class": op_class, "__doc__": doc, "__module__": __name__})


for _op_class in ops.PARAMETERLESS_OPS:
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)


class RMSNorm(nn.Module):
    """``RMSNorm(hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None)``;
    ``forward(x, residual=None)`` returns ``out`` or ``(out, x + residual)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = ops.RMSNorm(hidden_size, eps, var_hidden_size=var_hidden_size, has_weight=has_weight)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if has_weight else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.op(x, self.weight, residual)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class GemmaRMSNorm(nn.Module):
    """``GemmaRMSNorm(hidden_size, eps=1e-6, dtype=None)``: scales by ``1 + weight`` (weight starts at
    zeros, as the reference engine's); ``forward(x, residual=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.op = ops.GemmaRMSNorm(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.op(x, self.weight, residual)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class RMSNormGated(nn.Module):
    """``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, dtype=None)``;
    ``forward(x, z=None)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = ops.RMSNormGated(hidden_size, eps, group_size=group_size, norm_before_gate=norm_before_gate)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return self.op(x, self.weight, z)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class XIELU(nn.Module):
    """``XIELU(alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6, dtype=None)``: owns the raw
    ``alpha_p``/``alpha_n`` parameters (shape (1,)), initialised as the reference engine does."""

    def __init__(
        self,
        alpha_p_init: float = 0.8,
        alpha_n_init: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = ops.XIELU(alpha_p_init, alpha_n_init, beta, eps)
        alpha_p, alpha_n = self.op.initial_parameters()
        self.alpha_p = nn.Parameter(torch.tensor([alpha_p], dtype=dtype or torch.float32))
        self.alpha_n = nn.Parameter(torch.tensor([alpha_n], dtype=dtype or torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.alpha_p, self.alpha_n)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class MMEncoderAttention(OpLayer):
    """``MMEncoderAttention(num_heads, head_size, scale=None, num_kv_heads=None)``; ``forward(query,
    key, value, cu_seqlens=None, max_seqlen=None)``: the vision encoder's attention (no parameters;
    the projections around it are the model's)."""

    op_class = ops.MMEncoderAttention


__all__.append("MMEncoderAttention")


class RelPosAttention(nn.Module):
    """SAM's image-encoder attention with decomposed relative positions
    (:class:`dualop.ops.RelPosAttention`), with the engine's signature ``RelPosAttention(dim,
    num_heads=8, qkv_bias=True, use_rel_pos=False, rel_pos_zero_init=True, input_size=None)``;
    ``forward(x [B, H, W, dim])``. Its parameters are named and shaped as transformers'
    ``SamVisionAttention`` (``qkv`` and ``proj`` Linears, ``rel_pos_h`` / ``rel_pos_w`` tables with
    ``use_rel_pos``), so that module's state dict loads as is. The tables start at zeros, or with
    ``rel_pos_zero_init=False`` at ``trunc_normal_(std=0.02)`` (detectron2's ViTDet, where the flag
    comes from; the engine's layer always starts at zeros)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, use_rel_pos: bool = False,
                 rel_pos_zero_init: bool = True, input_size: tuple[int, int] | None = None, *,
                 params_dtype: Any = None) -> None:
        super().__init__()
        self.op = ops.RelPosAttention(dim, num_heads, qkv_bias, use_rel_pos, rel_pos_zero_init, input_size)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, dtype=params_dtype)
        self.proj = nn.Linear(dim, dim, dtype=params_dtype)
        self.rel_pos_h = self.rel_pos_w = None
        shapes = self.op.table_shapes()
        if shapes is not None:
            self.rel_pos_h, self.rel_pos_w = (nn.Parameter(torch.zeros(shape, dtype=params_dtype)) for shape in shapes)
            if not rel_pos_zero_init:
                for table in (self.rel_pos_h, self.rel_pos_w):
                    nn.init.trunc_normal_(table, std=0.02)

    def forward(self, x: Any) -> Any:
        return self.op(x, self.qkv.weight, self.qkv.bias, self.proj.weight, self.proj.bias, self.rel_pos_h,
                       self.rel_pos_w)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__.append("RelPosAttention")


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (:class:`dualop.ops.MultiHeadLatentAttention`: the
    same constructor, plus ``params_dtype``), called as the engine calls it:
    ``layer(positions [T], hidden_states [T, hidden_size])`` -> ``[T, hidden_size]``.

    Owns the weights under transformers' ``DeepseekV3Attention`` names (``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj`` or, with ``q_lora_rank`` None, ``q_proj``;
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, each ``.weight``; at
    tp > 1 this rank's shard), so that module's state dict loads as is; keep them in the
    activations' dtype. The paged latent cache is ``layer.kv_cache`` (``[num_pages, page_size,
    kv_lora_rank + qk_rope_head_dim]``, bound by the caller, updated in place) and the batch
    metadata comes from ``dualop.torch.forward_context`` (``slot_mapping``, ``kv_lens``,
    ``page_indices``, ``cu_q_lens``, ``num_seqs``: the op's arguments). With no context set the
    tokens are one new sequence, attended causally, and no cache is kept."""

    def __init__(self, hidden_size: int, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, q_lora_rank: int | None, kv_lora_rank: int, rope: Any, eps: float = 1e-6,
                 tp: Any = None, *, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.op = ops.MultiHeadLatentAttention(hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim,
                                               v_head_dim, q_lora_rank, kv_lora_rank, rope, eps, tp)
        self.kv_cache: torch.Tensor | None = None
        for name, shape in self.op.weight_shapes().items():
            holder = (_NormWeight(shape[0], params_dtype) if name.endswith("layernorm")
                      else nn.Linear(shape[1], shape[0], bias=False, dtype=params_dtype))
            setattr(self, name, holder)

    def forward(self, positions: Any, hidden_states: Any) -> Any:
        from dualop.torch.forward_context import get_forward_context

        name = self.op.name
        weights = {key: getattr(self, key).weight for key in self.op.weight_shapes()}
        context = get_forward_context()
        if context is None:
            if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 2:
                raise TypeError(f"{name}: argument 'hidden_states' must be a torch tensor [tokens, "
                                f"{self.op.hidden_size}], got {type(hidden_states).__qualname__}"
                                f"{tuple(getattr(hidden_states, 'shape', ()))}")
            tokens, device = hidden_states.shape[0], hidden_states.device
            width = self.op.kv_lora_rank + self.op.qk_rope_head_dim

            def ints(*values):
                return torch.tensor(values, dtype=torch.int32, device=device)

            cache = hidden_states.new_zeros((1, max(tokens, 1), width))
            out, _ = self.op(positions, hidden_states, weights, cache, torch.arange(tokens, dtype=torch.int32,
                             device=device), ints(tokens), ints(0).reshape(1, 1), ints(0, tokens), ints(1))
            return out
        bound = self.kv_cache
        if not isinstance(bound, torch.Tensor):
            raise ValueError(f"{name}: a forward context is set but 'kv_cache' is {type(bound).__qualname__}; bind "
                             f"layer.kv_cache = latent_pages [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] "
                             f"before the engine's call")
        out, cache = self.op(positions, hidden_states, weights, bound, **context.paged(name))
        if cache is not bound:
            bound.copy_(cache)
        return out

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__.append("MultiHeadLatentAttention")
# --- rope: the engine's rotary layers hold no parameters (the cos/sin cache lives in the op, built
# once in float32 and kept per device and dtype), so each is the op behind the layer interface.
for _op_class in (ops.RotaryEmbedding, ops.DualChunkRotaryEmbedding, ops.ApplyRotaryEmb):
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)


# --- mixture of experts: the layer owns the experts' weights (engine layout) and calls fused_moe ---
class FusedMoE(nn.Module):
    """``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=True,
    use_grouped_topk=False, num_expert_group=None, topk_group=None, scoring_func="softmax",
    routed_scaling_factor=1.0, activation="silu", apply_router_weight_on_input=False,
    has_bias=False, params_dtype=None, expert_map=None, e_score_correction_bias=None)``;
    ``forward(hidden_states [..., H], router_logits [..., E])`` -> ``[..., H]``.

    The weights are ``UnquantizedFusedMoEMethod.create_weights``' (``w13_weight``, ``w2_weight``,
    with ``has_bias`` ``w13_bias``/``w2_bias``; zeros, frozen), holding only the local experts when
    ``expert_map`` (``[num_experts]``: local index or -1) is given. ``e_score_correction_bias``
    (``[num_experts]``, DeepSeek-V3's router bias) is a float32 buffer when given or loaded.
    ``load_hf_experts`` fills them from a transformers MoE block as it stores them.
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
        params_dtype: torch.dtype | None = None,
        expert_map: Any = None,
        e_score_correction_bias: Any = None,
    ) -> None:
        super().__init__()
        self.op = ops.FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, use_grouped_topk,
                               num_expert_group, topk_group, scoring_func, routed_scaling_factor, activation,
                               apply_router_weight_on_input, has_bias)
        local = num_experts
        if expert_map is not None:
            expert_map = torch.as_tensor(expert_map, dtype=torch.int32)
            local = int((expert_map >= 0).sum())
        self.register_buffer("expert_map", expert_map)
        self.num_local_experts = local
        self.op.quant_method.create_weights(self, local, hidden_size, intermediate_size,
                                            params_dtype or torch.get_default_dtype(), has_bias)
        if e_score_correction_bias is not None:
            e_score_correction_bias = torch.as_tensor(e_score_correction_bias, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", e_score_correction_bias)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        out = self.op(hidden_states.reshape(-1, shape[-1]), router_logits.reshape(-1, router_logits.shape[-1]),
                      self.w13_weight, self.w2_weight, getattr(self, "w13_bias", None), getattr(self, "w2_bias", None),
                      self.e_score_correction_bias, self.expert_map)
        return out.reshape(shape)

    @torch.no_grad()
    def load_hf_experts(self, source: Any, *, prefix: str = "", is_transposed: bool | None = None,
                        is_concatenated: bool | None = None) -> FusedMoE:
        """Fill the weights from a transformers MoE block (``MixtralSparseMoeBlock``,
        ``Qwen3MoeSparseMoeBlock``, ``DeepseekV3MoE``, ``GptOssMLP``, ...), its ``experts`` module or
        a state dict, as transformers stores them (``ops.moe_transformers.engine_weights_from_hf``
        says how the layout is told); the router's ``e_score_correction_bias`` too when it has one.
        The router's own weight stays with the model (this layer takes the logits). Returns self."""
        from dualop.ops.moe_transformers import engine_weights_from_hf

        loaded = engine_weights_from_hf(self.op, source, prefix=prefix, is_transposed=is_transposed,
                                        is_concatenated=is_concatenated, expert_map=self.expert_map)
        for name, value in loaded.items():
            current = getattr(self, name, None)
            if current is None:  # the correction bias, first loaded
                self.e_score_correction_bias = value.detach().to(self.w13_weight.device, torch.float32).clone()
            else:
                current.copy_(value.detach().to(device=current.device, dtype=current.dtype))
        return self

    def extra_repr(self) -> str:
        return f"{self.op.extra_repr()}, num_local_experts={self.num_local_experts}"


__all__.append("FusedMoE")


# --- tensor-parallel linear ---------------------------------------------------------


class _ParallelLinear(nn.Module):
    """A linear layer holding THIS rank's shard of its weight (and bias): the engine's classes.

    Built with the op's constructor arguments (``tp=None``: the current group,
    ``dualop.torch.parallel.init_tensor_parallel_group``); ``forward(x)`` returns what the op
    returns (``(output, output_bias)`` with ``return_bias``). ``weight_loader(param, loaded_weight,
    loaded_shard_id=None)`` takes the FULL checkpoint tensor (for merged / QKV layers, one output's
    or q/k/v's full tensor with its shard id, or the whole fused one with None) and copies this
    rank's rows into ``param``; the layout is the op's ``checkpoint_layout``. Parameters start at
    zeros, in ``params_dtype`` (default: torch's default dtype)."""

    op_class: type = ops.ColumnParallelLinear

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.op = self.op_class(*args, **kwargs)
        dtype = self.op.params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.zeros(self.op.output_size_per_partition, self.op.input_size_per_partition,
                                               dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if self.op.has_bias:
            self.bias = nn.Parameter(torch.zeros(self.op.bias_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @property
    def tp(self):
        return self.op.tp

    def forward(self, x: torch.Tensor):
        return self.op(x, self.weight, self.bias)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
        """Copy this rank's part of the full checkpoint tensor ``loaded_weight`` into ``param``."""
        name = next((n for n, p in self.named_parameters(recurse=False) if p is param), None)
        if name is None:
            raise ValueError(f"{type(self).__name__}.weight_loader: param is not a parameter of this layer")
        full, dim, copies = self.op.checkpoint_layout(name, loaded_shard_id)
        loaded_weight = torch.as_tensor(loaded_weight)
        if tuple(loaded_weight.shape) != full:
            part = "" if loaded_shard_id is None else f" (loaded_shard_id {loaded_shard_id!r})"
            raise ValueError(f"{type(self).__name__}.weight_loader: {name!r}{part} got shape "
                             f"{tuple(loaded_weight.shape)}; expected the full checkpoint shape {full}")
        loaded_weight = loaded_weight.to(device=param.device, dtype=param.dtype)
        if dim is None:
            param.copy_(loaded_weight)
            return
        for c in copies:
            n = c.src_stop - c.src_start
            param.narrow(dim, c.dst_start, n).copy_(loaded_weight.narrow(dim, c.src_start, n))

    def extra_repr(self) -> str:
        return self.op.extra_repr()


def _parallel_linear(op_class: type, doc: str) -> type:
    return type(op_class.__name__, (_ParallelLinear,), {"op_class": op_class, "__module__": __name__,
                                                         "__doc__": f"{doc} Over :class:`dualop.ops.{op_class.__name__}`."})


ReplicatedLinear = _parallel_linear(
    ops.ReplicatedLinear, "``ReplicatedLinear(input_size, output_size, bias=True, skip_bias_add=False, "
    "params_dtype=None, *, return_bias=True, disable_tp=False, tp=None)``: the whole weight on every rank.")
ColumnParallelLinear = _parallel_linear(
    ops.ColumnParallelLinear, "``ColumnParallelLinear(input_size, output_size, bias=True, gather_output=False, "
    "skip_bias_add=False, params_dtype=None, *, return_bias=True, disable_tp=False, tp=None)``: output columns "
    "split over the ranks.")
MergedColumnParallelLinear = _parallel_linear(
    ops.MergedColumnParallelLinear, "``MergedColumnParallelLinear(input_size, output_sizes, bias=True, "
    "gather_output=False, skip_bias_add=False, params_dtype=None, *, ...)``: several outputs (gate, up) "
    "side by side, each split over the ranks; ``loaded_shard_id`` is the output's index.")
QKVParallelLinear = _parallel_linear(
    ops.QKVParallelLinear, "``QKVParallelLinear(hidden_size, head_size, total_num_heads, total_num_kv_heads=None, "
    "bias=True, skip_bias_add=False, params_dtype=None, *, ...)``: q, k, v heads per rank (kv heads replicated "
    "when tp >= their number); ``loaded_shard_id`` is 'q', 'k' or 'v'.")
RowParallelLinear = _parallel_linear(
    ops.RowParallelLinear, "``RowParallelLinear(input_size, output_size, bias=True, input_is_parallel=True, "
    "skip_bias_add=False, params_dtype=None, reduce_results=True, *, ...)``: input rows split over the ranks, "
    "partial sums all-reduced.")

__all__ += ["ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
            "RowParallelLinear"]

# --- the logits processor (parameterless; the LM head's weight comes with the call) -------
class LogitsProcessor(nn.Module):
    """The engine's ``LogitsProcessor(vocab_size, org_vocab_size=None, scale=1.0,
    logits_as_input=False, soft_cap=None)`` (plus ``padding_size=64`` and ``tp=None``: the current
    tensor-parallel group). ``forward(lm_head, hidden_states, embedding_bias=None)``: ``lm_head`` is
    the LM-head layer (anything with a ``weight``: ``ParallelLMHead``, ``nn.Linear``) or its weight,
    this rank's vocabulary-parallel shard; returns the gathered logits ``[..., org_vocab_size]``
    (see :class:`dualop.ops.LogitsProcessor`). With ``logits_as_input`` ``lm_head`` may be None."""

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0,
                 logits_as_input: bool = False, soft_cap: float | None = None, *, padding_size: int = 64,
                 tp: Any = None) -> None:
        super().__init__()
        self.op = ops.LogitsProcessor(vocab_size, org_vocab_size, scale, logits_as_input, soft_cap,
                                      padding_size=padding_size, tp=tp)

    def forward(self, lm_head: Any, hidden_states: torch.Tensor,
                embedding_bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = lm_head if lm_head is None or isinstance(lm_head, torch.Tensor) else lm_head.weight
        if weight is None and self.op.logits_as_input:
            weight = hidden_states  # read only for its frontend (the op's docstring)
        return self.op(weight, hidden_states, embedding_bias)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__.append("LogitsProcessor")


class _ConvLayer(nn.Module):
    """The engine's ConvLayerBase as an nn.Module: ``weight`` ``[out, in / groups, *kernel]`` and
    ``bias`` ``[out]`` (or None) as parameters, initialised as torch.nn.ConvNd's, so a torch Conv
    state dict (``weight``, ``bias``) loads as it is; ``forward(x)`` calls the op."""

    op_class: type

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: int | tuple[int, ...] | str = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.op = self.op_class(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                                padding_mode)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.op.weight_shape, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_channels, dtype=dtype)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """torch.nn.ConvNd's initialisation: both uniform in ±1/sqrt(fan_in) (its kaiming_uniform
        with a = sqrt(5))."""
        import math

        bound = 1 / math.sqrt(math.prod(self.op.weight_shape[1:]))
        for param in (self.weight, self.bias):
            if param is not None:
                param.uniform_(-bound, bound)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
        """Copy a checkpoint tensor (the whole parameter: convolutions are not sharded) into ``param``."""
        name = next((n for n, p in self.named_parameters(recurse=False) if p is param), "?")
        if loaded_shard_id is not None:
            raise ValueError(f"{type(self).__name__}.weight_loader: '{name}' is not sharded; got shard id "
                             f"{loaded_shard_id!r}")
        if tuple(loaded_weight.shape) != tuple(param.shape):
            raise ValueError(f"{type(self).__name__}.weight_loader: '{name}' has shape {tuple(param.shape)}; the "
                             f"checkpoint tensor has shape {tuple(loaded_weight.shape)}")
        param.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class Conv2dLayer(_ConvLayer):
    """``Conv2dLayer(in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
    bias=True, padding_mode="zeros", params_dtype=None)``; ``forward(x [N, C, H, W])``."""

    op_class = ops.Conv2dLayer


class Conv3dLayer(_ConvLayer):
    """``Conv3dLayer(...)`` as Conv2dLayer, on x ``[N, C, D, H, W]`` (Qwen2.5-VL's patch embed)."""

    op_class = ops.Conv3dLayer


__all__ += ["Conv2dLayer", "Conv3dLayer"]


# --- tensor-parallel vocabulary embedding and LM head ----------------------------------


class VocabParallelEmbedding(nn.Module):
    """``VocabParallelEmbedding(num_embeddings, embedding_dim, params_dtype=None,
    org_num_embeddings=None, padding_size=64, tp=None)``; ``forward(input_ids)`` -> ``[..., D]``.

    Holds THIS rank's ``[num_embeddings_per_partition, embedding_dim]`` rows of the padded table
    (``dualop.ops.embedding``; padding rows zero) as ``weight``; ``tp`` None: the current group
    (``dualop.torch.parallel.init_tensor_parallel_group``). ``weight_loader(param, full)`` takes the
    full checkpoint table (``[org_num_embeddings, D]`` as the engine's checkpoints hold it, or
    ``[num_embeddings, D]`` with the added rows) and keeps this rank's rows."""

    op_class: type = ops.VocabParallelEmbedding

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None,
                 org_num_embeddings: int | None = None, padding_size: int = 64, tp: Any = None) -> None:
        super().__init__()
        self.op = self._make_op(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp)
        self.tp = self.op.tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = self.op.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=params_dtype or torch.get_default_dtype()))
        self.weight.weight_loader = self.weight_loader

    def _make_op(self, num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp):
        # params_dtype stays with the layer (the op does not use it, and a dtype object would keep
        # torch.compile from rebuilding the op from its constructor call)
        return self.op_class(num_embeddings, embedding_dim, None, org_num_embeddings, padding_size, tp)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None) -> None:
        """Copy this rank's rows of the full checkpoint tensor ``loaded_weight`` into ``param``."""
        from dualop.ops.embedding import checkpoint_row_segments

        name = next((n for n, p in self.named_parameters() if p is param), "weight")
        layer = type(self).__name__
        if loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(f"{layer}.weight_loader: the full tensor for parameter {name!r} has shape "
                             f"{tuple(loaded_weight.shape)}; expected ({self.op.org_vocab_size}"
                             f"{''.join(f', {d}' for d in param.shape[1:])}) or ({self.num_embeddings}"
                             f"{''.join(f', {d}' for d in param.shape[1:])})")
        segments = checkpoint_row_segments(self.op.shard(), loaded_weight.shape[0], layer=layer, param=name,
                                           trailing=tuple(param.shape[1:]))
        param.zero_()
        for dst, src, count in segments:
            param[dst:dst + count].copy_(loaded_weight[src:src + count])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.op(input_ids, self.weight)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


class ParallelLMHead(VocabParallelEmbedding):
    """``ParallelLMHead(num_embeddings, embedding_dim, bias=False, params_dtype=None,
    org_num_embeddings=None, padding_size=64, tp=None)``: the embedding's weight layout (this rank's
    padded rows, rank-major) for the output projection, plus a ``[num_embeddings_per_partition]``
    ``bias`` shard when ``bias``. No forward (as the engine's): pass ``weight`` to the logits
    processor. ``tie_weights(embed_tokens)`` shares the embedding's parameter."""

    op_class: type = ops.ParallelLMHead

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None, org_num_embeddings: int | None = None,
                 padding_size: int = 64, tp: Any = None) -> None:
        self._bias = bool(bias)
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _make_op(self, num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp):
        return self.op_class(num_embeddings, embedding_dim, self._bias, None, org_num_embeddings,
                             padding_size, tp)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Use ``embed_tokens``' weight parameter as this head's (the same object); returns self."""
        if tuple(embed_tokens.weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"ParallelLMHead.tie_weights: the embedding's weight shard is "
                             f"{tuple(embed_tokens.weight.shape)}; expected {tuple(self.weight.shape)}")
        self.weight = embed_tokens.weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.op(input_ids, self.weight)  # raises: the LM head is applied by the logits processor


__all__ += ["VocabParallelEmbedding", "ParallelLMHead"]


# --- the stateful mixers: dualop's call and the engine's --------------------------------------


def _is_output_buffer(value: Any, hidden_states: Any) -> bool:
    """Whether a mixer's second positional argument is the engine's ``output`` buffer (shaped as
    ``hidden_states``; a conv cache is ``[slots, channels, K-1]``, never that shape)."""
    return (isinstance(value, torch.Tensor) and isinstance(hidden_states, torch.Tensor)
            and value.shape == hidden_states.shape)


class _MixerLayer(nn.Module):
    """A state-space mixer layer, called either way:

    - dualop's: ``layer(hidden_states, <caches>, cu_seqlens=None, state_indices=None,
      has_initial_state=None)`` -> ``(out, *caches)``, as the op (see ``run``);
    - the engine's: ``layer(hidden_states, output)`` -> None: the batch metadata from
      ``dualop.torch.forward_context``, the caches from ``layer.kv_cache`` (a tuple, bound by the
      caller as the engine binds its own; updated in place), the result written into ``output``.
      With no forward context set: one new sequence, no cache (a bound one is left untouched)."""

    cache_names: tuple[str, ...] = ("conv_state", "ssm_state")

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache: tuple[torch.Tensor, ...] | None = None

    def run(self, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError  # every mixer layer below defines its dualop call

    def forward(self, hidden_states: Any, *args: Any, output: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if output is None and args and _is_output_buffer(args[0], hidden_states):
            output, args = args[0], args[1:]
        if output is None:
            return self.run(hidden_states, *args, **kwargs)
        self._engine_call(hidden_states, output, args, kwargs)
        return None

    def _engine_call(self, hidden_states: Any, output: Any, args: tuple, kwargs: dict) -> None:
        from dualop.torch.forward_context import get_forward_context

        op = self.op.name
        if args or kwargs:
            raise TypeError(f"{op}: the engine's call mixer(hidden_states, output) takes nothing more here, got "
                            f"{len(args)} more positional and {sorted(kwargs)} keyword argument(s) (the engine's "
                            f"optional mup_vector is not supported); dualop's call passes caches and metadata instead")
        if not isinstance(output, torch.Tensor) or not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"{op}: the engine's call takes torch tensors 'hidden_states' and 'output', got "
                            f"{type(hidden_states).__qualname__} and {type(output).__qualname__}")
        if (output.shape, output.dtype, output.device) != (hidden_states.shape, hidden_states.dtype,
                                                           hidden_states.device):
            raise ValueError(f"{op}: argument 'output' must be shaped, typed and placed as 'hidden_states' "
                             f"{tuple(hidden_states.shape)} {hidden_states.dtype} on {hidden_states.device}; got "
                             f"{tuple(output.shape)} {output.dtype} on {output.device}")
        context = get_forward_context()
        caches: tuple[Any, ...] = (None,) * len(self.cache_names)
        metadata: dict[str, Any] = {}
        if context is not None:
            bound = self.kv_cache
            if not isinstance(bound, (tuple, list)) or len(bound) != len(self.cache_names):
                raise ValueError(f"{op}: a forward context is set but 'kv_cache' is {type(bound).__qualname__}; "
                                 f"bind layer.kv_cache = ({', '.join(self.cache_names)}) before the engine's call")
            caches, metadata = tuple(bound), context.ssm()
        result = self.run(hidden_states, *caches, **metadata)
        for cache, updated in zip(caches, result[1:]):
            if cache is not None and updated is not cache:
                cache.copy_(updated)
        output.copy_(result[0])


# --- LFM2's short convolution ------------------------------------------------------------
class ShortConv(_MixerLayer):
    """LFM2's ShortConv mixer (:class:`dualop.ops.ShortConv`) over packed tokens. Its parameters are
    named and shaped as transformers' ``Lfm2ShortConv`` (``in_proj``, ``out_proj`` Linears and the
    depthwise ``conv`` with weight ``[Hd, 1, L]``), so that module's state dict loads as is.
    ``layer(hidden_states [T, Hd], conv_state=None, cu_seqlens=None, state_indices=None,
    has_initial_state=None) -> (out, conv_state)`` (serving metadata as ``dualop.ops.ssm_batch``),
    or the engine's ``layer(hidden_states, output)`` with ``kv_cache = (conv_state,)``."""

    cache_names = ("conv_state",)

    def __init__(self, hidden_size: int, conv_kernel: int, bias: bool = False, *, params_dtype: Any = None) -> None:
        super().__init__()
        self.op = ops.ShortConv(hidden_size, conv_kernel, bias)
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias, dtype=params_dtype)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias, dtype=params_dtype)
        self.conv = nn.Conv1d(hidden_size, hidden_size, conv_kernel, groups=hidden_size, bias=bias,
                              padding=conv_kernel - 1, dtype=params_dtype)

    def run(self, hidden_states: Any, conv_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
            has_initial_state: Any = None) -> Any:
        return self.op(hidden_states, self.in_proj.weight, self.conv.weight[:, 0], self.out_proj.weight,
                       self.conv.bias, conv_state, cu_seqlens, state_indices, has_initial_state,
                       self.in_proj.bias, self.out_proj.bias)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__.append("ShortConv")


# --- the Mamba-1 mixer -----------------------------------------------------------------


class _NormWeight(nn.Module):
    """Holds one norm weight as ``weight`` (so the state dict keys are transformers' own)."""

    def __init__(self, size: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))


class MambaMixer(_MixerLayer):
    """``MambaMixer(hidden_size, ssm_state_size, conv_kernel_size, intermediate_size, time_step_rank,
    use_conv_bias=True, use_bias=False, use_rms_norm=False, rms_norm_has_weight=True,
    rms_norm_eps=1e-6, activation="silu", params_dtype=None)``;
    ``layer(hidden_states [T, Hd], conv_state=None, ssm_state=None, cu_seqlens=None,
    state_indices=None, has_initial_state=None)`` -> ``(out [T, Hd], conv_state, ssm_state)``.

    Owns the weights under transformers' names (``in_proj``, ``conv1d`` with its ``[I, 1, K]``
    weight, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``, and with ``use_rms_norm`` and
    ``rms_norm_has_weight`` Jamba's ``dt/b/c_layernorm``), so ``load_state_dict`` takes a
    transformers ``MambaMixer`` / ``JambaMambaMixer`` / ``FalconMambaMixer`` state dict as is
    (Falcon-Mamba: ``rms_norm_has_weight=False``, its norms have no weights). Called as the op
    (caches and batch metadata as arguments, ``dualop.ops.mamba_mixer``) or as the engine calls it,
    ``layer(hidden_states, output)`` with ``kv_cache = (conv_state, ssm_state)`` bound.
    Initialised as transformers does without its random dt: A = 1..N per channel, D = 1."""

    op_class: type = ops.MambaMixer

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, intermediate_size: int,
                 time_step_rank: int, use_conv_bias: bool = True, use_bias: bool = False, use_rms_norm: bool = False,
                 rms_norm_has_weight: bool = True, rms_norm_eps: float = 1e-6, activation: str | None = "silu",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.op = self.op_class(hidden_size, ssm_state_size, conv_kernel_size, intermediate_size, time_step_rank,
                                use_conv_bias, use_bias, use_rms_norm, rms_norm_eps, activation)
        i, n, r = intermediate_size, ssm_state_size, time_step_rank
        kw = {"dtype": params_dtype}
        self.in_proj = nn.Linear(hidden_size, 2 * i, bias=use_bias, **kw)
        self.conv1d = nn.Conv1d(i, i, conv_kernel_size, groups=i, padding=conv_kernel_size - 1, bias=use_conv_bias,
                                **kw)
        self.x_proj = nn.Linear(i, r + 2 * n, bias=False, **kw)
        self.dt_proj = nn.Linear(r, i, bias=True, **kw)
        a = torch.arange(1, n + 1, dtype=torch.float32).expand(i, n)
        self.A_log = nn.Parameter(torch.log(a).to(params_dtype or torch.get_default_dtype()))
        self.D = nn.Parameter(torch.ones(i, **kw))
        self.out_proj = nn.Linear(i, hidden_size, bias=use_bias, **kw)
        self.has_norm_weights = bool(use_rms_norm and rms_norm_has_weight)
        if self.has_norm_weights:
            self.dt_layernorm = _NormWeight(r, params_dtype)
            self.b_layernorm = _NormWeight(n, params_dtype)
            self.c_layernorm = _NormWeight(n, params_dtype)

    def run(self, hidden_states: torch.Tensor, conv_state: torch.Tensor | None = None,
            ssm_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
            state_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None):
        norms = ((self.dt_layernorm.weight, self.b_layernorm.weight, self.c_layernorm.weight)
                 if self.has_norm_weights else (None, None, None))
        return self.op(hidden_states, self.in_proj.weight, self.conv1d.weight[:, 0, :], self.conv1d.bias,
                       self.x_proj.weight, self.dt_proj.weight, self.dt_proj.bias, self.A_log, self.D,
                       self.out_proj.weight, self.in_proj.bias, self.out_proj.bias, *norms, conv_state, ssm_state,
                       cu_seqlens, state_indices, has_initial_state)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__ += ["MambaMixer"]


# --- the Mamba-2 mixer -----------------------------------------------------------------------


class MambaMixer2(_MixerLayer):
    """Layer over :class:`dualop.ops.MambaMixer2` (the constructor's arguments, plus ``dtype``).

    Parameters named like the op's weight arguments (``in_proj_weight``, ``conv_weight`` [C, K],
    ``dt_bias``, ``A_log``, ``D``, ``norm_weight``, ``out_proj_weight``, the optional biases); they
    start at zeros except ``A_log = log(1..H)``, ``D`` and ``norm_weight`` at ones: load a
    checkpoint with ``load_hf_state_dict`` (transformers' ``Mamba2Mixer`` names).
    ``layer(hidden_states [T, hidden], conv_state=None, ssm_state=None, cu_seqlens=None,
    state_indices=None, has_initial_state=None) -> (out, conv_state, ssm_state)``, or the engine's
    ``layer(hidden_states, output)`` with ``kv_cache = (conv_state, ssm_state)`` bound."""

    def __init__(self, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.op = ops.MambaMixer2(*args, **kwargs)
        for name, shape in self.op.parameter_shapes().items():
            value = torch.zeros(shape, dtype=dtype)
            if name == "A_log":
                value = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32)).to(value.dtype)
            elif name in ("D", "norm_weight"):
                value.fill_(1.0)
            self.register_parameter(name, nn.Parameter(value))

    def load_hf_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """Copy a transformers Mamba-2 mixer's state dict (``prefix + "in_proj.weight"``, ...) into
        the parameters, in their dtype; every parameter must be there, and nothing unexpected."""
        from dualop.ops.mamba_mixer2 import HF_PARAMETER_NAMES

        wanted = {prefix + hf: ours for hf, ours in HF_PARAMETER_NAMES.items() if hasattr(self, ours)}
        given = {k for k in state_dict if k.startswith(prefix)}
        if missing := sorted(set(wanted) - given):
            raise ValueError(f"MambaMixer2.load_hf_state_dict: missing {missing}")
        if extra := sorted(given - set(wanted)):
            raise ValueError(f"MambaMixer2.load_hf_state_dict: unexpected {extra} (bias flags of the config?)")
        with torch.no_grad():
            for key, name in wanted.items():
                param, value = getattr(self, name), state_dict[key]
                value = value[:, 0] if name == "conv_weight" and value.ndim == 3 else value
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"MambaMixer2.load_hf_state_dict: {key!r} has shape {tuple(value.shape)}; "
                                     f"expected {tuple(param.shape)}")
                param.copy_(value)

    def run(self, hidden_states: torch.Tensor, conv_state: torch.Tensor | None = None,
            ssm_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
            state_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None):
        params = {name: getattr(self, name) for name in self.op.parameter_shapes()}
        return self.op(hidden_states, params["in_proj_weight"], params["conv_weight"], params.get("conv_bias"),
                       params["dt_bias"], params["A_log"], params["D"], params.get("norm_weight"),
                       params["out_proj_weight"], params.get("in_proj_bias"), params.get("out_proj_bias"),
                       conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__ += ["MambaMixer2"]


# --- PLaMo 2's Mamba mixer ------------------------------------------------------------


class Plamo2MambaMixer(_MixerLayer):
    """``Plamo2MambaMixer(hidden_size, ssm_state_size, conv_kernel_size, num_heads, head_dim,
    time_step_rank=None, rms_norm_eps=1e-6, chunk_size=256, params_dtype=None)``;
    ``layer(hidden_states [T, Hd], conv_state=None, ssm_state=None, cu_seqlens=None,
    state_indices=None, has_initial_state=None)`` -> ``(out [T, Hd], conv_state, ssm_state)``.

    Owns the weights under the PLaMo 2 checkpoint's names (``in_proj``, ``conv1d`` with its
    ``[I, 1, K]`` weight, ``bcdt_proj``, ``dt_proj``, ``dt_bias``, ``A_log``, ``D``,
    ``dt_norm_weight``, ``B_norm_weight``, ``C_norm_weight``, ``out_proj``), so ``load_state_dict``
    takes a checkpoint's mixer weights as they are. ``in_proj.weight`` is kept in the op's order
    (gate rows, then x rows): a load hook reorders the checkpoint's per-head interleaving as the
    engine's loader does, and ``state_dict`` gives the checkpoint's order back. Called as the op
    (caches and batch metadata as arguments, ``dualop.ops.plamo2``) or as the engine calls it,
    ``layer(hidden_states, output)`` with ``kv_cache = (conv_state, ssm_state)`` bound.
    Initialised with A = -(1..H), D = 1, dt_bias = 1 and unit norm weights."""

    op_class: type = ops.Plamo2MambaMixer

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, num_heads: int, head_dim: int,
                 time_step_rank: int | None = None, rms_norm_eps: float = 1e-6, chunk_size: int = 256,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.op = self.op_class(hidden_size, ssm_state_size, conv_kernel_size, num_heads, head_dim, time_step_rank,
                                rms_norm_eps, chunk_size)
        i, n, r, h = self.op.intermediate_size, ssm_state_size, self.op.time_step_rank, num_heads
        kw = {"dtype": params_dtype}
        self.in_proj = nn.Linear(hidden_size, 2 * i, bias=False, **kw)
        self.conv1d = nn.Conv1d(i, i, conv_kernel_size, groups=i, bias=False, **kw)
        self.bcdt_proj = nn.Linear(i, 2 * n + r, bias=False, **kw)
        self.dt_proj = nn.Linear(r, h, bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.ones(h, **kw))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)).to(
            params_dtype or torch.get_default_dtype()))
        self.D = nn.Parameter(torch.ones(h, **kw))
        self.dt_norm_weight = nn.Parameter(torch.ones(r, **kw))
        self.B_norm_weight = nn.Parameter(torch.ones(n, **kw))
        self.C_norm_weight = nn.Parameter(torch.ones(n, **kw))
        self.out_proj = nn.Linear(i, hidden_size, bias=False, **kw)
        self.register_load_state_dict_pre_hook(self._in_proj_from_checkpoint)
        self.register_state_dict_post_hook(self._in_proj_to_checkpoint)

    @staticmethod
    def _in_proj_from_checkpoint(module, state_dict, prefix, *_) -> None:
        key = prefix + "in_proj.weight"  # a wrong shape is left to load_state_dict's own error
        if key in state_dict and tuple(state_dict[key].shape) == tuple(module.in_proj.weight.shape):
            state_dict[key] = ops.plamo2.in_proj_from_checkpoint(state_dict[key], module.op.num_heads)

    @staticmethod
    def _in_proj_to_checkpoint(module, state_dict, prefix, *_) -> None:
        key = prefix + "in_proj.weight"
        state_dict[key] = ops.plamo2.in_proj_to_checkpoint(state_dict[key], module.op.num_heads)

    def run(self, hidden_states: torch.Tensor, conv_state: torch.Tensor | None = None,
            ssm_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
            state_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None):
        return self.op(hidden_states, self.in_proj.weight, self.conv1d.weight[:, 0, :], self.bcdt_proj.weight,
                       self.dt_proj.weight, self.dt_bias, self.A_log, self.D, self.dt_norm_weight, self.B_norm_weight,
                       self.C_norm_weight, self.out_proj.weight, conv_state, ssm_state, cu_seqlens, state_indices,
                       has_initial_state)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__ += ["Plamo2MambaMixer"]
