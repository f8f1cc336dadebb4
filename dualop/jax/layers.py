"""flax.nnx layers over dualop ops, with the reference serving engine's constructor signatures.

Twin of ``dualop.torch.layers``: each layer owns its parameters (``nnx.Param``) and calls the op,
so the config, the platform path (Pallas on TPU) and its gradient rule apply unchanged; the
layers work under ``nnx.jit`` / ``jax.jit``, ``vmap`` and ``grad``.
"""

from __future__ import annotations

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


# --- tensor-parallel vocabulary embedding and LM head (issue 11) ----------------------------------


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
