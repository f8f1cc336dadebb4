"""flax.nnx layers over dualop ops, with the reference serving engine's constructor signatures.

Twin of ``dualop.torch.layers``: each layer owns its parameters (``nnx.Param``) and calls the op,
so the config, the platform path (Pallas on TPU) and its gradient rule apply unchanged; the
layers work under ``nnx.jit`` / ``jax.jit``, ``vmap`` and ``grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from dualop import ops

__all__ = [
    "OpLayer",
    "RMSNorm",
    "GemmaRMSNorm",
    "RMSNormGated",
    "XIELU",
]


class OpLayer(nnx.Module):
    """An nnx.Module around a parameterless op: ``__call__(*args)`` calls it."""

    op_class: type = ops.SiluAndMul

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.op = self.op_class(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)


def _op_layer(op_class: type) -> type:
    """A layer class named like ``op_class`` that builds and calls it."""
    doc = f"Layer over :class:`dualop.ops.{op_class.__name__}`. " + (op_class.__doc__ or "")
    return type(op_class.__name__, (OpLayer,), {"op_class": op_class, "__doc__": doc, "__module__": __name__})


for _op_class in ops.PARAMETERLESS_OPS:
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)


class RMSNorm(nnx.Module):
    """``RMSNorm(hidden_size, eps=1e-6, var_hidden_size=None, has_weight=True, dtype=None)``;
    ``__call__(x, residual=None)`` returns ``out`` or ``(out, x + residual)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        var_hidden_size: int | None = None,
        has_weight: bool = True,
        dtype: Any = None,
    ) -> None:
        self.op = ops.RMSNorm(hidden_size, eps, var_hidden_size=var_hidden_size, has_weight=has_weight)
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype or jnp.float32)) if has_weight else None

    def __call__(self, x, residual=None):
        return self.op(x, None if self.weight is None else self.weight[...], residual)


class GemmaRMSNorm(nnx.Module):
    """``GemmaRMSNorm(hidden_size, eps=1e-6, dtype=None)``: scales by ``1 + weight`` (weight starts at
    zeros); ``__call__(x, residual=None)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Any = None) -> None:
        self.op = ops.GemmaRMSNorm(hidden_size, eps)
        self.weight = nnx.Param(jnp.zeros((hidden_size,), dtype or jnp.float32))

    def __call__(self, x, residual=None):
        return self.op(x, self.weight[...], residual)


class RMSNormGated(nnx.Module):
    """``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=False, dtype=None)``;
    ``__call__(x, z=None)``. Weight starts at ones."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = False,
        dtype: Any = None,
    ) -> None:
        self.op = ops.RMSNormGated(hidden_size, eps, group_size=group_size, norm_before_gate=norm_before_gate)
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype or jnp.float32))

    def __call__(self, x, z=None):
        return self.op(x, self.weight[...], z)


class XIELU(nnx.Module):
    """``XIELU(alpha_p_init=0.8, alpha_n_init=0.8, beta=0.5, eps=-1e-6, dtype=None)``: owns the raw
    ``alpha_p``/``alpha_n`` parameters (shape (1,)), initialised as the reference engine does."""

    def __init__(
        self,
        alpha_p_init: float = 0.8,
        alpha_n_init: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        dtype: Any = None,
    ) -> None:
        self.op = ops.XIELU(alpha_p_init, alpha_n_init, beta, eps)
        alpha_p, alpha_n = self.op.initial_parameters()
        self.alpha_p = nnx.Param(jnp.asarray([alpha_p], dtype or jnp.float32))
        self.alpha_n = nnx.Param(jnp.asarray([alpha_n], dtype or jnp.float32))

    def __call__(self, x):
        return self.op(x, self.alpha_p[...], self.alpha_n[...])


class MMEncoderAttention(OpLayer):
    """``MMEncoderAttention(num_heads, head_size, scale=None, num_kv_heads=None)``; ``__call__(query,
    key, value, cu_seqlens=None, max_seqlen=None)``: the vision encoder's attention (no parameters;
    the projections around it are the model's)."""

    op_class = ops.MMEncoderAttention


__all__.append("MMEncoderAttention")


class RelPosAttention(nnx.Module):
    """Twin of ``dualop.torch.layers.RelPosAttention``: ``qkv_weight [3 dim, dim]``, ``qkv_bias``,
    ``proj_weight [dim, dim]``, ``proj_bias`` and, with ``use_rel_pos``, ``rel_pos_h`` / ``rel_pos_w``
    as ``nnx.Param``s (weights normal(0, 0.02) from ``rngs``, default ``nnx.Rngs(0)``; biases zero;
    tables zero, or with ``rel_pos_zero_init=False`` a normal of std 0.02 truncated at +-2, as torch's
    ``trunc_normal_``);
    ``__call__(x [B, H, W, dim])``; ``load_state_dict`` takes transformers' ``SamVisionAttention``
    state dict."""

    # this layer's parameter -> the SamVisionAttention state-dict key
    _HF_KEYS = {"qkv_weight": "qkv.weight", "qkv_bias": "qkv.bias", "proj_weight": "proj.weight",
                "proj_bias": "proj.bias", "rel_pos_h": "rel_pos_h", "rel_pos_w": "rel_pos_w"}

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, use_rel_pos: bool = False,
                 rel_pos_zero_init: bool = True, input_size: tuple[int, int] | None = None, *,
                 params_dtype: Any = None, rngs: nnx.Rngs | None = None) -> None:
        import jax

        self.op = ops.RelPosAttention(dim, num_heads, qkv_bias, use_rel_pos, rel_pos_zero_init, input_size)
        dtype = params_dtype or jnp.float32
        rngs = rngs if rngs is not None else nnx.Rngs(0)

        def normal(shape):
            return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))

        self.qkv_weight = normal((3 * dim, dim))
        self.qkv_bias = nnx.Param(jnp.zeros((3 * dim,), dtype)) if qkv_bias else None
        self.proj_weight = normal((dim, dim))
        self.proj_bias = nnx.Param(jnp.zeros((dim,), dtype))

        def table(shape):
            if rel_pos_zero_init:
                return nnx.Param(jnp.zeros(shape, dtype))
            # torch's trunc_normal_(std=0.02) (SAM's): bounds at +-2 absolute, i.e. +-100 std
            values = 0.02 * jax.random.truncated_normal(rngs.params(), -100.0, 100.0, shape, jnp.float32)
            return nnx.Param(values.astype(dtype))

        shapes = self.op.table_shapes()
        self.rel_pos_h, self.rel_pos_w = (None, None) if shapes is None else (table(shapes[0]), table(shapes[1]))

    def __call__(self, x):
        p = {name: None if getattr(self, name) is None else getattr(self, name)[...] for name in self._HF_KEYS}
        return self.op(x, p["qkv_weight"], p["qkv_bias"], p["proj_weight"], p["proj_bias"], p["rel_pos_h"],
                       p["rel_pos_w"])

    def load_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """Load ``SamVisionAttention``'s state dict (keys as ``_HF_KEYS``, shapes as they are)."""
        _load_checkpoint_params(self, state_dict, prefix, self._HF_KEYS.items())


__all__.append("RelPosAttention")
# --- rope: the engine's rotary layers hold no parameters (the cos/sin cache lives in the op, built
# once in float32 and kept per device and dtype), so each is the op behind the layer interface.
for _op_class in (ops.RotaryEmbedding, ops.DualChunkRotaryEmbedding, ops.ApplyRotaryEmb):
    globals()[_op_class.__name__] = _op_layer(_op_class)
    __all__.append(_op_class.__name__)


# --- mixture of experts: the layer owns the experts' weights (engine layout) and calls fused_moe ---
def _as_jax(value: Any, dtype: Any):
    """A jax array of ``value`` (a jax or numpy array, or a torch tensor: via float32 numpy, which
    holds every 16-bit value exactly) in ``dtype``."""
    import numpy as np

    if type(value).__module__.startswith("torch"):
        value = value.detach().float().cpu().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    return jnp.asarray(np.asarray(value) if not isinstance(value, jnp.ndarray) else value, dtype)


def _load_checkpoint_params(layer: nnx.Module, state_dict: Any, prefix: str, pairs: Iterable[tuple[str, str]],
                            adapt: Callable[[str, Any], Any] | None = None) -> None:
    """Load a transformers module's ``state_dict`` into ``layer``: each (parameter name, checkpoint
    key) of ``pairs`` gives the parameter ``adapt(name, value)`` (a layout change; default as it is).
    Every parameter the layer has must be there with its shape, and a key for one it was built
    without is an error; all are checked before any is written, so a refused state dict leaves the
    layer as it was."""
    cls, loaded = type(layer).__name__, []
    for name, hf_key in pairs:
        param, key = getattr(layer, name), prefix + hf_key
        value = state_dict.get(key)
        if param is None:
            if value is not None:
                raise ValueError(f"{cls}.load_state_dict: '{key}' given but the layer has no {name}")
            continue
        if value is None:
            raise ValueError(f"{cls}.load_state_dict: '{key}' is missing")
        value = adapt(name, value) if adapt is not None else value
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{cls}.load_state_dict: '{key}' has shape {tuple(value.shape)}; expected "
                             f"{tuple(param.shape)}")
        loaded.append((param, value))
    for param, value in loaded:
        param[...] = _as_jax(value, param.dtype)


class FusedMoE(nnx.Module):
    """``FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize=True,
    use_grouped_topk=False, num_expert_group=None, topk_group=None, scoring_func="softmax",
    routed_scaling_factor=1.0, activation="silu", apply_router_weight_on_input=False,
    has_bias=False, params_dtype=None, expert_map=None, e_score_correction_bias=None)``;
    ``__call__(hidden_states [..., H], router_logits [..., E])`` -> ``[..., H]``.

    Twin of ``dualop.torch.layers.FusedMoE``: the expert weights are jax arrays held as attributes
    (``UnquantizedFusedMoEMethod.create_weights``; zeros, float32 unless ``params_dtype``), part of
    the module's state (``nnx.split``) but not ``nnx.Param``s, so ``nnx.grad`` leaves them alone
    (frozen, as the torch layer's). ``load_hf_experts`` fills them from a transformers MoE block.
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
        params_dtype: Any = None,
        expert_map: Any = None,
        e_score_correction_bias: Any = None,
    ) -> None:
        self.op = ops.FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, use_grouped_topk,
                               num_expert_group, topk_group, scoring_func, routed_scaling_factor, activation,
                               apply_router_weight_on_input, has_bias)
        self.expert_map = None if expert_map is None else _as_jax(expert_map, jnp.int32)
        self.num_local_experts = num_experts if expert_map is None else int((self.expert_map >= 0).sum())
        self.op.quant_method.create_weights(self, self.num_local_experts, hidden_size, intermediate_size,
                                            params_dtype or jnp.float32, has_bias)
        self.e_score_correction_bias = (None if e_score_correction_bias is None
                                        else _as_jax(e_score_correction_bias, jnp.float32))

    def __call__(self, hidden_states, router_logits):
        shape = hidden_states.shape
        out = self.op(hidden_states.reshape(-1, shape[-1]), router_logits.reshape(-1, router_logits.shape[-1]),
                      self.w13_weight, self.w2_weight, getattr(self, "w13_bias", None), getattr(self, "w2_bias", None),
                      self.e_score_correction_bias, self.expert_map)
        return out.reshape(shape)

    def load_hf_experts(self, source: Any, *, prefix: str = "", is_transposed: bool | None = None,
                        is_concatenated: bool | None = None) -> FusedMoE:
        """Fill the weights from a transformers MoE block, its ``experts`` module or a state dict of
        torch tensors, numpy or jax arrays (see the torch layer's ``load_hf_experts``). Returns self."""
        import numpy as np

        from dualop.ops.moe_transformers import engine_weights_from_hf

        if not hasattr(source, "state_dict") and hasattr(source, "keys"):  # numpy entries: as jax arrays
            source = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in source.items()}
        loaded = engine_weights_from_hf(self.op, source, prefix=prefix, is_transposed=is_transposed,
                                        is_concatenated=is_concatenated, expert_map=self.expert_map)
        for name, value in loaded.items():
            current = getattr(self, name, None)
            # nnx.data: the correction bias may replace a None, which nnx holds as static
            setattr(self, name, nnx.data(_as_jax(value, jnp.float32 if current is None else current.dtype)))
        return self


__all__.append("FusedMoE")


# --- tensor-parallel linear ---------------------------------------------------------


def _split_spec(ndim: int, split_dim: int | None, axis: Any, n: int):
    """``PartitionSpec`` with ``axis`` at ``split_dim`` (replicated when None or one shard)."""
    from jax.sharding import PartitionSpec

    if split_dim is None or n == 1:
        return PartitionSpec()
    parts = [None] * ndim
    parts[split_dim % ndim] = axis
    return PartitionSpec(*parts)


def linear_specs(op: Any, axis: Any, x_ndim: int = 2) -> dict[str, Any]:
    """The ``PartitionSpec``s of a linear op's global arrays over ``axis`` (``op.tp.size`` shards):
    ``x``, ``weight``, ``bias``, ``output`` and ``output_bias`` (see ``_ParallelLinear``)."""
    from jax.sharding import PartitionSpec

    n = op.tp.size
    row = isinstance(op, ops.RowParallelLinear)
    if row:
        out = PartitionSpec() if op.reduce_results or n == 1 else PartitionSpec(axis)
    else:
        out = _split_spec(x_ndim, None if getattr(op, "gather_output", True) else -1, axis, n)
    return {"x": _split_spec(x_ndim, -1 if row and op.input_is_parallel else None, axis, n),
            "weight": _split_spec(2, op.weight_split_dim, axis, n),
            "bias": _split_spec(1, 0 if op.bias_split else None, axis, n),
            "output": out}


def parallel_linear(op: Any, mesh: Any, axis: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    """Run a linear op built with ``tp=AxisTensorParallel(axis, n)`` on global arrays laid out as
    ``linear_specs`` says, under ``shard_map`` over ``mesh`` (the op makes its own collectives).
    Returns what the op returns, as global arrays; a row op without ``reduce_results`` keeps the
    ranks' partial sums on a leading axis of size n."""
    if op.tp.size == 1 or mesh is None:
        return op(x, weight, bias)
    from dualop.jax.parallel import shard_map

    specs = linear_specs(op, axis, x.ndim)
    unreduced = isinstance(op, ops.RowParallelLinear) and not op.reduce_results
    returns_bias = op.return_bias and op.skip_bias_add and bias is not None

    def per_rank(x, weight, bias):
        out = op(x, weight, bias)
        y, out_bias = out if op.return_bias else (out, None)
        if unreduced:
            y = y[None]  # this rank's partial sum, on the leading rank axis
        return (y, out_bias) if returns_bias else y

    out_specs = (specs["output"], specs["bias"]) if returns_bias else specs["output"]
    in_specs = (specs["x"], specs["weight"], None if bias is None else specs["bias"])
    result = shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(x, weight, bias)
    if not op.return_bias:
        return result
    return result if returns_bias else (result, None)


class _ParallelLinear(nnx.Module):
    """A linear layer over a ``tp`` axis of a ``jax.sharding.Mesh``: the engine's classes.

    Built with the op's constructor arguments plus ``mesh=None, axis="tp"`` (None: one device).
    Each parameter is ONE global array laid out rank-major (block r along its split dim is rank r's
    shard, fused merged / QKV rows included) and placed with ``NamedSharding(mesh, PartitionSpec(...
    axis ...))``. ``__call__(x)`` runs the op under ``shard_map`` with ``AxisTensorParallel(axis,
    n)``, so each device computes its shard and the op's own collectives (``psum`` / ``all_gather``)
    do the rest (``dualop.jax.parallel`` says why shard_map). ``x`` is the whole input, except for
    ``RowParallelLinear(input_is_parallel=True)``, whose ``x`` is split over the axis on its last
    dim. Outputs are whole arrays, but the column layer's without ``gather_output`` (split on the
    last dim) and the row layer's without ``reduce_results``, which keeps the ranks' partial sums
    on a leading axis of size n (their sum is the output).

    ``weight_loader(param_name, loaded_weight, loaded_shard_id=None)``: the FULL checkpoint tensor
    (a jax or numpy array or a torch tensor; see the torch layer) in, every rank's rows placed."""

    op_class: type = ops.ColumnParallelLinear

    def __init__(self, *args: Any, mesh: Any = None, axis: str = "tp", **kwargs: Any) -> None:
        from dualop.jax.parallel import AxisTensorParallel, axis_size
        from dualop.parallel import TensorParallel

        name = self.op_class.__name__
        if "tp" in kwargs:
            raise TypeError(f"{name}: the jax layer takes mesh= and axis=, not tp=")
        n = 1 if mesh is None else axis_size(mesh, axis, op=name)
        replicated = self.op_class is ops.ReplicatedLinear
        tp = AxisTensorParallel(axis, n) if n > 1 and not replicated else TensorParallel()
        self.op = self.op_class(*args, tp=tp, **kwargs)
        self.mesh, self.axis, self.n = mesh, axis, self.op.tp.size
        dtype = self.op.params_dtype or jnp.float32
        op = self.op
        weight_shape = [op.output_size_per_partition, op.input_size_per_partition]
        if op.weight_split_dim is not None:
            weight_shape[op.weight_split_dim] *= self.n
        self.weight = nnx.Param(self._place(jnp.zeros(tuple(weight_shape), dtype), self._weight_spec()))
        bias_size = op.bias_size * (self.n if op.bias_split else 1)
        self.bias = (nnx.Param(self._place(jnp.zeros((bias_size,), dtype), self._bias_spec())) if op.has_bias
                     else None)

    def _weight_spec(self):
        return _split_spec(2, self.op.weight_split_dim, self.axis, self.n)

    def _bias_spec(self):
        return _split_spec(1, 0 if self.op.bias_split else None, self.axis, self.n)

    def _place(self, value, spec):
        if self.mesh is None:
            return value
        import jax
        from jax.sharding import NamedSharding

        return jax.device_put(value, NamedSharding(self.mesh, spec))

    def __call__(self, x):
        return parallel_linear(self.op, self.mesh, self.axis, x, self.weight[...],
                               None if self.bias is None else self.bias[...])

    # -- loading ----------------------------------------------------------------------------------

    def weight_loader(self, param_name: str, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        """Place every rank's part of the full checkpoint tensor ``loaded_weight`` into ``param_name``
        ("weight" or "bias"), rank-major."""
        import numpy as np

        name = type(self).__name__
        full, dim, _ = self.op.checkpoint_layout(param_name, loaded_shard_id, rank=0)
        loaded = np.asarray(_as_jax(loaded_weight, jnp.float32))
        if loaded.shape != full:
            part = "" if loaded_shard_id is None else f" (loaded_shard_id {loaded_shard_id!r})"
            raise ValueError(f"{name}.weight_loader: {param_name!r}{part} got shape {loaded.shape}; expected the "
                             f"full checkpoint shape {full}")
        param = getattr(self, param_name)
        value = np.array(param[...].astype(jnp.float32))
        if dim is None:
            value[...] = loaded
        else:
            per_rank = value.shape[dim] // self.n
            for rank in range(self.n):
                for c in self.op.checkpoint_layout(param_name, loaded_shard_id, rank=rank)[2]:
                    dst = [slice(None)] * value.ndim
                    src = [slice(None)] * value.ndim
                    start = rank * per_rank + c.dst_start
                    dst[dim] = slice(start, start + c.src_stop - c.src_start)
                    src[dim] = slice(c.src_start, c.src_stop)
                    value[tuple(dst)] = loaded[tuple(src)]
        spec = self._weight_spec() if param_name == "weight" else self._bias_spec()
        param.value = self._place(jnp.asarray(value, param[...].dtype), spec)


def _parallel_linear(op_class: type, doc: str) -> type:
    return type(op_class.__name__, (_ParallelLinear,), {"op_class": op_class, "__module__": __name__,
                                                         "__doc__": f"{doc} Over :class:`dualop.ops.{op_class.__name__}`."})


ReplicatedLinear = _parallel_linear(
    ops.ReplicatedLinear, "``ReplicatedLinear(input_size, output_size, bias=True, skip_bias_add=False, "
    "params_dtype=None, *, return_bias=True, mesh=None, axis='tp')``: the whole weight on every device.")
ColumnParallelLinear = _parallel_linear(
    ops.ColumnParallelLinear, "``ColumnParallelLinear(input_size, output_size, bias=True, gather_output=False, "
    "skip_bias_add=False, params_dtype=None, *, return_bias=True, disable_tp=False, mesh=None, axis='tp')``.")
MergedColumnParallelLinear = _parallel_linear(
    ops.MergedColumnParallelLinear, "``MergedColumnParallelLinear(input_size, output_sizes, bias=True, "
    "gather_output=False, skip_bias_add=False, params_dtype=None, *, ..., mesh=None, axis='tp')``; "
    "``loaded_shard_id`` is the output's index.")
QKVParallelLinear = _parallel_linear(
    ops.QKVParallelLinear, "``QKVParallelLinear(hidden_size, head_size, total_num_heads, total_num_kv_heads=None, "
    "bias=True, skip_bias_add=False, params_dtype=None, *, ..., mesh=None, axis='tp')``; ``loaded_shard_id`` "
    "is 'q', 'k' or 'v'.")
RowParallelLinear = _parallel_linear(
    ops.RowParallelLinear, "``RowParallelLinear(input_size, output_size, bias=True, input_is_parallel=True, "
    "skip_bias_add=False, params_dtype=None, reduce_results=True, *, ..., mesh=None, axis='tp')``.")

__all__ += ["ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
            "RowParallelLinear", "linear_specs", "parallel_linear"]


# --- the logits processor (parameterless; the LM head's weight comes with the call) -------
class LogitsProcessor(nnx.Module):
    """The engine's ``LogitsProcessor(vocab_size, org_vocab_size=None, scale=1.0,
    logits_as_input=False, soft_cap=None)`` plus ``padding_size=64``, ``mesh=None``, ``axis="tp"``.
    ``__call__(lm_head, hidden_states, embedding_bias=None)``: ``lm_head`` is the LM-head layer
    (anything with a ``weight``) or its weight. With a mesh the weight (and bias) are global arrays
    laid out rank-major along the vocabulary (shard r = rank r's ``vocab_shard`` rows) and the
    hidden states are replicated; each rank's logits are computed under ``shard_map`` and
    all-gathered over ``axis`` (see :class:`dualop.ops.LogitsProcessor`); the result is replicated.
    Without a mesh: one device."""

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0,
                 logits_as_input: bool = False, soft_cap: float | None = None, *, padding_size: int = 64,
                 mesh: Any = None, axis: str = "tp") -> None:
        from dualop.jax.parallel import AxisTensorParallel, axis_size
        from dualop.parallel import TensorParallel

        tp = TensorParallel() if mesh is None else AxisTensorParallel(axis, axis_size(mesh, axis, op="LogitsProcessor"))
        self.op = ops.LogitsProcessor(vocab_size, org_vocab_size, scale, logits_as_input, soft_cap,
                                      padding_size=padding_size, tp=tp)
        self.mesh, self.axis = mesh, axis

    def __call__(self, lm_head: Any, hidden_states: Any, embedding_bias: Any = None) -> Any:
        weight = lm_head if lm_head is None or hasattr(lm_head, "shape") else lm_head.weight
        weight = getattr(weight, "value", weight)  # an nnx.Param
        if weight is None and self.op.logits_as_input:
            weight = hidden_states  # read only for its frontend (the op's docstring)
        if self.mesh is None or self.op.logits_as_input:  # logits given whole: no collective to make
            return self.op(weight, hidden_states, embedding_bias)
        from jax.sharding import PartitionSpec as P

        from dualop.jax.parallel import shard_map

        op, vocab = self.op, P(self.axis)
        args, specs = [weight, hidden_states], [P(self.axis, None), P()]
        if embedding_bias is not None:
            args.append(embedding_bias)
            specs.append(vocab)
        return shard_map(lambda *a: op(*a), mesh=self.mesh, in_specs=tuple(specs), out_specs=P())(*args)

    def extra_repr(self) -> str:
        return self.op.extra_repr()


__all__.append("LogitsProcessor")


class _ConvLayer(nnx.Module):
    """Twin of ``dualop.torch.layers.Conv2dLayer``/``Conv3dLayer``: ``weight`` ``[out, in / groups,
    *kernel]`` and ``bias`` ``[out]`` (or None) as ``nnx.Param``s in torch's layout, initialised
    as torch.nn.ConvNd's (uniform in ±1/sqrt(fan_in), from ``rngs``; default ``nnx.Rngs(0)``);
    ``__call__(x)`` calls the op; ``load_state_dict`` takes a torch Conv state dict."""

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
        params_dtype: Any = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        import math

        import jax

        self.op = self.op_class(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                                padding_mode)
        dtype = params_dtype or jnp.float32
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        bound = 1 / math.sqrt(math.prod(self.op.weight_shape[1:]))

        def uniform(shape):
            return jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound).astype(dtype)

        self.weight = nnx.Param(uniform(self.op.weight_shape))
        self.bias = nnx.Param(uniform((out_channels,))) if bias else None

    def __call__(self, x):
        return self.op(x, self.weight[...], None if self.bias is None else self.bias[...])

    def weight_loader(self, param_name: str, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        """Set parameter ``param_name`` (``weight`` or ``bias``) from a whole checkpoint tensor
        (torch, numpy or jax), kept in the parameter's dtype."""
        layer = type(self).__name__
        param = getattr(self, param_name, None) if param_name in ("weight", "bias") else None
        if param is None:
            raise ValueError(f"{layer}.weight_loader: no parameter {param_name!r}; expected "
                             f"{['weight', 'bias'] if self.bias is not None else ['weight']}")
        if loaded_shard_id is not None:
            raise ValueError(f"{layer}.weight_loader: '{param_name}' is not sharded; got shard id {loaded_shard_id!r}")
        if tuple(loaded_weight.shape) != tuple(param.shape):
            raise ValueError(f"{layer}.weight_loader: '{param_name}' has shape {tuple(param.shape)}; the checkpoint "
                             f"tensor has shape {tuple(loaded_weight.shape)}")
        param[...] = _as_jax(loaded_weight, param.dtype)

    def load_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """Load a torch Conv module's state dict (``prefix + "weight"``, ``prefix + "bias"``)."""
        for name in ("weight", "bias"):
            key = prefix + name
            if getattr(self, name) is None:
                if key in state_dict:
                    raise ValueError(f"{type(self).__name__}.load_state_dict: '{key}' given but the layer has no bias")
                continue
            if key not in state_dict:
                raise ValueError(f"{type(self).__name__}.load_state_dict: '{key}' is missing")
            self.weight_loader(name, state_dict[key])


class Conv2dLayer(_ConvLayer):
    """``Conv2dLayer(in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
    bias=True, padding_mode="zeros", params_dtype=None, rngs=None)``; ``__call__(x [N, C, H, W])``."""

    op_class = ops.Conv2dLayer


class Conv3dLayer(_ConvLayer):
    """``Conv3dLayer(...)`` as Conv2dLayer, on x ``[N, C, D, H, W]`` (Qwen2.5-VL's patch embed)."""

    op_class = ops.Conv3dLayer


__all__ += ["Conv2dLayer", "Conv3dLayer"]


# --- tensor-parallel vocabulary embedding and LM head ----------------------------------


class VocabParallelEmbedding(nnx.Module):
    """``VocabParallelEmbedding(num_embeddings, embedding_dim, params_dtype=None,
    org_num_embeddings=None, padding_size=64, mesh=None, axis="tp")``; ``__call__(input_ids)`` ->
    ``[..., D]``. Twin of ``dualop.torch.layers.VocabParallelEmbedding``.

    ``weight`` is ONE global ``[tp * num_embeddings_per_partition, D]`` array, rank-major (rows
    ``[r * P, (r + 1) * P)`` are rank r's padded shard), placed with ``NamedSharding(mesh,
    P(axis, None))``; ``__call__`` runs the op per rank under ``shard_map`` (ids replicated, the
    op's ``psum`` over ``axis`` inside). ``mesh`` None: one device, the op called directly.
    ``weight_loader(param_name, full)``: the full checkpoint table, laid out here."""

    op_class: type = ops.VocabParallelEmbedding

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Any = None,
                 org_num_embeddings: int | None = None, padding_size: int = 64, mesh: Any = None,
                 axis: str = "tp") -> None:
        self.mesh, self.axis = mesh, axis
        self.op = self._make_op(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size,
                                _tensor_parallel(mesh, axis, self.op_class.name))
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = self.op.num_embeddings_per_partition
        rows = self.op.tp.size * self.num_embeddings_per_partition
        self.weight = nnx.Param(self._place(jnp.zeros((rows, embedding_dim), params_dtype or jnp.float32)))

    def _make_op(self, num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp):
        # params_dtype stays with the layer (the op does not use it, and a dtype object would keep
        # torch.compile from rebuilding the op from its constructor call)
        return self.op_class(num_embeddings, embedding_dim, None, org_num_embeddings, padding_size, tp)

    def _place(self, array):
        """``array`` split over the mesh axis on its first (vocabulary) dim; as is without a mesh."""
        if self.mesh is None:
            return array
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        spec = PartitionSpec(self.axis, *([None] * (array.ndim - 1)))
        return jax.device_put(array, NamedSharding(self.mesh, spec))

    def weight_loader(self, param_name: str, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        """Lay the full checkpoint tensor (``[org_num_embeddings, ...]`` or ``[num_embeddings, ...]``)
        out rank-major into parameter ``param_name`` (``"weight"``, or the LM head's ``"bias"``)."""
        import numpy as np

        from dualop.ops.embedding import checkpoint_row_segments

        layer = type(self).__name__
        param = getattr(self, param_name, None)
        if not isinstance(param, nnx.Param):
            raise ValueError(f"{layer}.weight_loader: no parameter {param_name!r}")
        current = param[...]
        full = np.asarray(_as_jax(loaded_weight, jnp.float32))
        per_rank = self.num_embeddings_per_partition
        if full.shape[1:] != current.shape[1:]:
            trailing = "".join(f", {d}" for d in current.shape[1:])
            raise ValueError(f"{layer}.weight_loader: the full tensor for parameter {param_name!r} has shape "
                             f"{full.shape}; expected ({self.op.org_vocab_size}{trailing}) or "
                             f"({self.num_embeddings}{trailing})")
        laid_out = np.zeros(current.shape, np.float32)
        for rank in range(self.op.tp.size):
            segments = checkpoint_row_segments(self.op.shard(rank), full.shape[0], layer=layer, param=param_name,
                                               trailing=tuple(current.shape[1:]))
            for dst, src, count in segments:
                laid_out[rank * per_rank + dst:rank * per_rank + dst + count] = full[src:src + count]
        param.value = self._place(jnp.asarray(laid_out, current.dtype))

    def _per_rank(self, fn, input_ids, *arrays):
        """``fn(input_ids, *shards)`` on each rank (``shard_map``; ids replicated), or directly."""
        if self.mesh is None:
            return fn(input_ids, *arrays)
        from jax.sharding import PartitionSpec

        from dualop.jax.parallel import shard_map

        specs = tuple(PartitionSpec(self.axis, *([None] * (a.ndim - 1))) for a in arrays)
        return shard_map(fn, mesh=self.mesh, in_specs=(PartitionSpec(), *specs), out_specs=PartitionSpec())(
            input_ids, *arrays)

    def __call__(self, input_ids):
        return self._per_rank(self.op, input_ids, self.weight[...])


def _tensor_parallel(mesh: Any, axis: str, op: str):
    """The ``TensorParallel`` of a layer: one device without a mesh, else ``axis`` of it."""
    from dualop.jax.parallel import AxisTensorParallel, axis_size
    from dualop.parallel import TensorParallel

    if mesh is None:
        return TensorParallel()
    return AxisTensorParallel(axis, axis_size(mesh, axis, op=op))


class ParallelLMHead(VocabParallelEmbedding):
    """``ParallelLMHead(num_embeddings, embedding_dim, bias=False, params_dtype=None,
    org_num_embeddings=None, padding_size=64, mesh=None, axis="tp")``: the embedding's global
    rank-major weight (and a ``bias`` the same way when ``bias``) for the logits processor; calling
    it raises, as in the engine. ``tie_weights(embed_tokens)`` shares the embedding's ``nnx.Param``."""

    op_class: type = ops.ParallelLMHead

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, params_dtype: Any = None,
                 org_num_embeddings: int | None = None, padding_size: int = 64, mesh: Any = None,
                 axis: str = "tp") -> None:
        self._has_bias = bool(bias)
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, mesh, axis)
        rows = self.op.tp.size * self.num_embeddings_per_partition
        self.bias = nnx.Param(self._place(jnp.zeros((rows,), self.weight.dtype))) if bias else None

    def _make_op(self, num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp):
        return self.op_class(num_embeddings, embedding_dim, self._has_bias, None, org_num_embeddings,
                             padding_size, tp)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Use ``embed_tokens``' weight ``nnx.Param`` as this head's (the same object); returns self."""
        if tuple(embed_tokens.weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"ParallelLMHead.tie_weights: the embedding's weight is {tuple(embed_tokens.weight.shape)}; "
                             f"expected {tuple(self.weight.shape)}")
        self.weight = embed_tokens.weight
        return self


__all__ += ["VocabParallelEmbedding", "ParallelLMHead"]


# --- LFM2's short convolution ------------------------------------------------------------
class ShortConv(nnx.Module):
    """Twin of ``dualop.torch.layers.ShortConv``: ``in_proj_weight [3 Hd, Hd]``, ``conv_weight
    [Hd, L]``, ``out_proj_weight [Hd, Hd]`` (and, with ``bias``, their biases) as ``nnx.Param``s
    (normal(0, 0.02) from ``rngs``, default ``nnx.Rngs(0)``; biases zero); ``__call__(hidden_states,
    conv_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None) -> (out,
    conv_state)``; ``load_state_dict`` takes transformers' ``Lfm2ShortConv`` state dict."""

    # this layer's parameter -> (the Lfm2ShortConv state-dict key, how to reshape it)
    _HF_KEYS = {"in_proj_weight": "in_proj.weight", "conv_weight": "conv.weight", "out_proj_weight": "out_proj.weight",
                "in_proj_bias": "in_proj.bias", "conv_bias": "conv.bias", "out_proj_bias": "out_proj.bias"}

    def __init__(self, hidden_size: int, conv_kernel: int, bias: bool = False, *, params_dtype: Any = None,
                 rngs: nnx.Rngs | None = None) -> None:
        import jax

        self.op = ops.ShortConv(hidden_size, conv_kernel, bias)
        dtype = params_dtype or jnp.float32
        rngs = rngs if rngs is not None else nnx.Rngs(0)

        def normal(shape):
            return (0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)

        hd = hidden_size
        self.in_proj_weight = nnx.Param(normal((3 * hd, hd)))
        self.conv_weight = nnx.Param(normal((hd, conv_kernel)))
        self.out_proj_weight = nnx.Param(normal((hd, hd)))
        zeros = lambda n: nnx.Param(jnp.zeros((n,), dtype)) if bias else None  # noqa: E731
        self.in_proj_bias, self.conv_bias, self.out_proj_bias = zeros(3 * hd), zeros(hd), zeros(hd)

    def __call__(self, hidden_states, conv_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None):
        p = {name: None if getattr(self, name) is None else getattr(self, name)[...] for name in self._HF_KEYS}
        return self.op(hidden_states, p["in_proj_weight"], p["conv_weight"], p["out_proj_weight"], p["conv_bias"],
                       conv_state, cu_seqlens, state_indices, has_initial_state, p["in_proj_bias"], p["out_proj_bias"])

    def load_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """Load ``Lfm2ShortConv``'s state dict (its conv weight ``[Hd, 1, L]`` becomes ``[Hd, L]``)."""
        _load_checkpoint_params(self, state_dict, prefix, self._HF_KEYS.items(),
                                lambda name, value: value.reshape(value.shape[0], -1) if name == "conv_weight" else value)


__all__.append("ShortConv")


# --- the Mamba-1 mixer -----------------------------------------------------------------


class MambaMixer(nnx.Module):
    """Twin of ``dualop.torch.layers.MambaMixer`` (same constructor, ``params_dtype`` a jax dtype and
    ``rngs`` for the projections' init, default ``nnx.Rngs(0)``); ``__call__(hidden_states,
    conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None)``
    -> ``(out, conv_state, ssm_state)`` (new caches: jax arrays are immutable; donate the old ones
    under ``jit``). The weights are ``nnx.Param``s in the op's layout (``conv_weight`` ``[I, K]``);
    ``load_state_dict`` takes a transformers mixer's state dict (torch, numpy or jax values)."""

    # transformers' key -> this layer's parameter
    _HF_KEYS = {
        "in_proj.weight": "in_proj_weight", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv_weight",
        "conv1d.bias": "conv_bias", "x_proj.weight": "x_proj_weight", "dt_proj.weight": "dt_proj_weight",
        "dt_proj.bias": "dt_proj_bias", "A_log": "A_log", "D": "D", "out_proj.weight": "out_proj_weight",
        "out_proj.bias": "out_proj_bias", "dt_layernorm.weight": "dt_norm_weight",
        "b_layernorm.weight": "b_norm_weight", "c_layernorm.weight": "c_norm_weight",
    }

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, intermediate_size: int,
                 time_step_rank: int, use_conv_bias: bool = True, use_bias: bool = False, use_rms_norm: bool = False,
                 rms_norm_has_weight: bool = True, rms_norm_eps: float = 1e-6, activation: str | None = "silu",
                 params_dtype: Any = None, *, rngs: nnx.Rngs | None = None) -> None:
        import jax

        self.op = ops.MambaMixer(hidden_size, ssm_state_size, conv_kernel_size, intermediate_size, time_step_rank,
                                 use_conv_bias, use_bias, use_rms_norm, rms_norm_eps, activation)
        dtype = params_dtype or jnp.float32
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        i, n, r, h, k = intermediate_size, ssm_state_size, time_step_rank, hidden_size, conv_kernel_size

        def uniform(shape, fan_in):
            bound = 1 / fan_in ** 0.5
            return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound).astype(dtype))

        def const(value):
            return nnx.Param(jnp.asarray(value, jnp.float32).astype(dtype))

        self.in_proj_weight = uniform((2 * i, h), h)
        self.in_proj_bias = const(jnp.zeros(2 * i)) if use_bias else None
        self.conv_weight = uniform((i, k), k)
        self.conv_bias = const(jnp.zeros(i)) if use_conv_bias else None
        self.x_proj_weight = uniform((r + 2 * n, i), i)
        self.dt_proj_weight = uniform((i, r), r)
        self.dt_proj_bias = const(jnp.zeros(i))
        self.A_log = const(jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (i, n))))
        self.D = const(jnp.ones(i))
        self.out_proj_weight = uniform((h, i), i)
        self.out_proj_bias = const(jnp.zeros(h)) if use_bias else None
        with_norms = use_rms_norm and rms_norm_has_weight
        self.dt_norm_weight = const(jnp.ones(r)) if with_norms else None
        self.b_norm_weight = const(jnp.ones(n)) if with_norms else None
        self.c_norm_weight = const(jnp.ones(n)) if with_norms else None

    def _value(self, name: str):
        param = getattr(self, name)
        return None if param is None else param[...]

    def __call__(self, hidden_states, conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None,
                 has_initial_state=None):
        names = ("in_proj_weight", "conv_weight", "conv_bias", "x_proj_weight", "dt_proj_weight", "dt_proj_bias",
                 "A_log", "D", "out_proj_weight", "in_proj_bias", "out_proj_bias", "dt_norm_weight",
                 "b_norm_weight", "c_norm_weight")
        return self.op(hidden_states, *(self._value(n) for n in names), conv_state, ssm_state, cu_seqlens,
                       state_indices, has_initial_state)

    def load_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """Load a transformers mixer's state dict: every parameter this layer has must be there, and
        nothing it lacks (a bias or norm weight the layer was built without is an error)."""
        # transformers' depthwise Conv1d weight [I, 1, K] is the op's [I, K]
        _load_checkpoint_params(self, state_dict, prefix, ((name, key) for key, name in self._HF_KEYS.items()),
                                lambda name, value: value[:, 0, :] if name == "conv_weight" and value.ndim == 3 else value)


__all__.append("MambaMixer")


# --- the Mamba-2 mixer -----------------------------------------------------------------------


class MambaMixer2(nnx.Module):
    """Twin of ``dualop.torch.layers.MambaMixer2``: the op's weight arguments as ``nnx.Param``s
    (zeros, ``A_log = log(1..H)``, ``D`` and ``norm_weight`` ones), ``load_hf_state_dict`` for a
    transformers Mamba-2 mixer's state dict (torch, numpy or jax values), ``__call__(hidden_states,
    conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None)
    -> (out, conv_state, ssm_state)`` (new caches: jax arrays are immutable)."""

    def __init__(self, *args: Any, dtype: Any = None, **kwargs: Any) -> None:
        self.op = ops.MambaMixer2(*args, **kwargs)
        dtype = dtype or jnp.float32
        for name, shape in self.op.parameter_shapes().items():
            if name == "A_log":
                value = jnp.log(jnp.arange(1, shape[0] + 1, dtype=jnp.float32))
            else:
                value = jnp.ones(shape) if name in ("D", "norm_weight") else jnp.zeros(shape)
            setattr(self, name, nnx.Param(value.astype(dtype)))

    def load_hf_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """As the torch layer's: every parameter from ``prefix + <transformers name>``."""
        from dualop.ops.mamba_mixer2 import HF_PARAMETER_NAMES

        names = self.op.parameter_shapes()
        wanted = {prefix + hf: ours for hf, ours in HF_PARAMETER_NAMES.items() if ours in names}
        given = {k for k in state_dict if k.startswith(prefix)}
        if missing := sorted(set(wanted) - given):
            raise ValueError(f"MambaMixer2.load_hf_state_dict: missing {missing}")
        if extra := sorted(given - set(wanted)):
            raise ValueError(f"MambaMixer2.load_hf_state_dict: unexpected {extra} (bias flags of the config?)")
        for key, name in wanted.items():
            param = getattr(self, name)
            value = _as_jax(state_dict[key], param.dtype)
            value = value[:, 0] if name == "conv_weight" and value.ndim == 3 else value
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"MambaMixer2.load_hf_state_dict: {key!r} has shape {tuple(value.shape)}; "
                                 f"expected {tuple(param.shape)}")
            param[...] = value

    def __call__(self, hidden_states, conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None,
                 has_initial_state=None):
        p = {name: getattr(self, name)[...] for name in self.op.parameter_shapes()}
        return self.op(hidden_states, p["in_proj_weight"], p["conv_weight"], p.get("conv_bias"), p["dt_bias"],
                       p["A_log"], p["D"], p.get("norm_weight"), p["out_proj_weight"], p.get("in_proj_bias"),
                       p.get("out_proj_bias"), conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state)


__all__ += ["MambaMixer2"]


# --- PLaMo 2's Mamba mixer ------------------------------------------------------------


class Plamo2MambaMixer(nnx.Module):
    """Twin of ``dualop.torch.layers.Plamo2MambaMixer`` (same constructor, ``params_dtype`` a jax
    dtype and ``rngs`` for the projections' init, default ``nnx.Rngs(0)``); ``__call__(hidden_states,
    conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None)``
    -> ``(out, conv_state, ssm_state)`` (new caches: jax arrays are immutable; donate the old ones
    under ``jit``). The weights are ``nnx.Param``s named as the op's arguments, in its layout
    (``in_proj_weight`` gate rows then x rows, ``conv_weight`` ``[I, K]``); ``load_state_dict``
    takes a PLaMo 2 checkpoint's mixer weights (torch, numpy or jax values) under their own keys."""

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, num_heads: int, head_dim: int,
                 time_step_rank: int | None = None, rms_norm_eps: float = 1e-6, chunk_size: int = 256,
                 params_dtype: Any = None, *, rngs: nnx.Rngs | None = None) -> None:
        import jax

        self.op = ops.Plamo2MambaMixer(hidden_size, ssm_state_size, conv_kernel_size, num_heads, head_dim,
                                       time_step_rank, rms_norm_eps, chunk_size)
        dtype = params_dtype or jnp.float32
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        i, n, r, h, k = self.op.intermediate_size, ssm_state_size, self.op.time_step_rank, num_heads, conv_kernel_size

        def uniform(shape, fan_in):
            bound = 1 / fan_in ** 0.5
            return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound).astype(dtype))

        def const(value):
            return nnx.Param(jnp.asarray(value, jnp.float32).astype(dtype))

        self.in_proj_weight = uniform((2 * i, hidden_size), hidden_size)
        self.conv_weight = uniform((i, k), k)
        self.bcdt_proj_weight = uniform((2 * n + r, i), i)
        self.dt_proj_weight = uniform((h, r), r)
        self.dt_bias = const(jnp.ones(h))
        self.A_log = const(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)))
        self.D = const(jnp.ones(h))
        self.dt_norm_weight = const(jnp.ones(r))
        self.B_norm_weight = const(jnp.ones(n))
        self.C_norm_weight = const(jnp.ones(n))
        self.out_proj_weight = uniform((hidden_size, i), i)

    def __call__(self, hidden_states, conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None,
                 has_initial_state=None):
        weights = (getattr(self, name)[...] for name in ops.plamo2.CHECKPOINT_KEYS)
        return self.op(hidden_states, *weights, conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state)

    def load_state_dict(self, state_dict: Any, prefix: str = "") -> None:
        """Load a PLaMo 2 checkpoint's mixer weights (keys ``prefix + in_proj.weight``, ...): every
        weight must be there, with the checkpoint's shape; ``in_proj.weight`` is reordered from the
        checkpoint's per-head interleaving as the engine's loader does."""
        layer = type(self).__name__
        for name, key in ops.plamo2.CHECKPOINT_KEYS.items():
            param, value = getattr(self, name), state_dict.get(prefix + key)
            if value is None:
                raise ValueError(f"{layer}.load_state_dict: '{prefix + key}' is missing")
            value = _as_jax(value, param.dtype)
            if name == "conv_weight" and value.ndim == 3 and value.shape[1] == 1:
                value = value[:, 0, :]  # the checkpoint's depthwise Conv1d weight [I, 1, K]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{layer}.load_state_dict: '{prefix + key}' has shape {tuple(value.shape)}; expected "
                                 f"{tuple(param.shape)}")
            if name == "in_proj_weight":
                value = ops.plamo2.in_proj_from_checkpoint(value, self.op.num_heads)
            param[...] = value


__all__.append("Plamo2MambaMixer")
