"""Sharded layers for ``dualop compile``: whole layers split over a multi-chip TPU topology (kernels
and collectives), built with the real XLA:TPU compiler on compile-only devices.

A target ``<generation>:<topology>`` (``v5e:2x2``, ``v6e:2x4``: any name libtpu resolves) builds
every ``SHARDED_LAYERS`` entry on a mesh over all the topology's chips; plain generation targets
(``v5e``) build the per-chip op variants as before, so the default targets do not build these.
Each layer has small shapes (always; seconds each) and model-size shapes (``dualop compile
--sharded-serving``; minutes, more so while a kernel declines and the layer's native body, dense
over the experts, is built instead).
A layer traces with the TPU paths dispatched (``override_platform("tpu")``, every op enabled), so
its Pallas kernels lower for the chip; where a kernel declined, the layer is built with that op's
native body and the row's message says which op declined and why. Each row also lists the
collectives XLA:TPU left in the compiled program (``collectives.py``: kind, count, operand and
result bytes per device; ``format_collectives`` in ``dualop.aot`` prints them), whatever the layer.

A layer: ``ShardedLayer(label, op, shapes, serving_shapes, build)``; ``build(mesh, shape, dtype)`` returns
``(fn, args)`` where ``args`` are ``jax.ShapeDtypeStruct``s carrying their ``NamedSharding`` on
``mesh`` (or None). Tensor-parallel layers add entries the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from dualop.aot.result import KernelResult, first_line

__all__ = ["ShardedLayer", "SHARDED_LAYERS", "is_sharded_target", "layers_for", "compile_layer"]


@dataclasses.dataclass(frozen=True)
class ShardedLayer:
    """A layer to build on a whole topology; ``op`` is the registered op ``--ops`` selects it by."""

    label: str
    op: str
    shapes: tuple[tuple[int, ...], ...]  # small: always built (seconds each)
    serving_shapes: tuple[tuple[int, ...], ...]  # model sizes: with ``--sharded-serving`` (minutes)
    build: Callable[[Any, tuple[int, ...], str], tuple[Callable, tuple]]


SHARDED_LAYERS: list[ShardedLayer] = []


def is_sharded_target(target: str) -> bool:
    """``<generation>:<topology>`` with a known generation (``v6e:2x4``)."""
    from dualop.aot.tpu import TOPOLOGIES

    generation, _, topology = target.partition(":")
    return generation in TOPOLOGIES and bool(topology)


def layers_for(ops: list[str] | None) -> list[ShardedLayer]:
    return [layer for layer in SHARDED_LAYERS if not ops or layer.op in ops or layer.label in ops]


def _declines() -> list[str]:
    from dualop import dispatch_report

    return [f"{r['op']}: {r['reason']}" for r in dispatch_report() if "declined" in r["reason"]]


def compile_layer(layer: ShardedLayer, shape: tuple[int, ...], dtype: str, target: str) -> KernelResult:
    """Build ``layer`` at ``shape`` and ``dtype`` on every chip of ``target``'s topology."""
    import numpy as np
    from jax.sharding import Mesh

    from dualop import OpsConfig, override_platform, set_config
    from dualop.custom_op import clear_dispatch_report
    from dualop.aot import tpu

    start = time.perf_counter()
    generation = target.partition(":")[0]
    try:
        devices = tpu.topology_devices(target)
    except Exception as err:  # libtpu does not know this topology
        return KernelResult(status="unavailable", message=f"topology {target}: {first_line(err)}")
    mesh = Mesh(np.array(devices), ("x",))
    fn, args = layer.build(mesh, shape, dtype)

    def on_tpu_paths(*a):
        with override_platform("tpu"), set_config(OpsConfig(["all"])):
            return fn(*a)

    clear_dispatch_report()
    result = tpu.build(on_tpu_paths, args, generation, read_collectives=True)
    declined = _declines()
    if declined and result.status == "ok":
        result.message = "built with native bodies where kernels declined: " + "; ".join(dict.fromkeys(declined))
    result.seconds = time.perf_counter() - start
    return result


# --- expert parallelism -----------------------------------------------------------------------
# (tokens, num_experts, top_k, hidden, intermediate, capacity factor; 0 = psum over all tokens).
# A small layer (64 experts of 1024 -> 512, top-8: 256 tokens all-to-all at twice the balanced
# capacity, 16 tokens psum) checks the collectives and kernels in seconds; DeepSeek-V3's MoE (256
# experts of 7168 -> 2048, top-8, grouped sigmoid routing) is the model size: an 8192-token prefill
# dispatched all-to-all with 1.25x the balanced capacity and a 16-token decode combined with psum.
_EP_A2A, _EP_A2A_SERVING = ((256, 64, 8, 1024, 512, 2),), ((8192, 256, 8, 7168, 2048, 1.25),)
_EP_PSUM, _EP_PSUM_SERVING = ((16, 64, 8, 1024, 512, 0),), ((16, 256, 8, 7168, 2048, 0),)


def _ep_layer(mode: str):
    def build(mesh, shape, dtype):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from dualop.jax.expert_parallel import expert_parallel_moe
        from dualop.ops import FusedMoE

        tokens, experts, top_k, hidden, inter, factor = shape
        n = mesh.shape["x"]
        deepseek = experts == 256
        op = (FusedMoE(experts, top_k, hidden, inter, use_grouped_topk=True, num_expert_group=8, topk_group=4,
                       scoring_func="sigmoid", routed_scaling_factor=2.5) if deepseek
              else FusedMoE(experts, top_k, hidden, inter))
        capacity = math.ceil(factor * (tokens // n) * top_k / n) if mode == "all_to_all" else None
        token_spec = PartitionSpec("x") if mode == "all_to_all" else PartitionSpec()

        def spec(shp, part, dt=dtype):
            return jax.ShapeDtypeStruct(shp, jnp.dtype(dt), sharding=NamedSharding(mesh, part))

        args = (spec((tokens, hidden), token_spec), spec((tokens, experts), token_spec),
                spec((experts, 2 * inter, hidden), PartitionSpec("x")), spec((experts, hidden, inter), PartitionSpec("x")),
                None, None, spec((experts,), PartitionSpec(), "float32") if deepseek else None)

        def fn(x, logits, w13, w2, b13, b2, correction):
            return expert_parallel_moe(mesh, "x", x, logits, w13, w2, b13, b2, correction, op=op, mode=mode,
                                       capacity=capacity)

        return fn, args

    return build


SHARDED_LAYERS += [
    ShardedLayer("fused_moe[ep,all_to_all]", "fused_moe", _EP_A2A, _EP_A2A_SERVING, _ep_layer("all_to_all")),
    ShardedLayer("fused_moe[ep,psum]", "fused_moe", _EP_PSUM, _EP_PSUM_SERVING, _ep_layer("psum")),
]


# --- tensor-parallel linear ----------------------------------------------------------
# Llama-3-70B's projections over the whole topology (tp = every chip): the fused QKV (hidden 8192 ->
# (64 + 2 * 8) heads of 128; 8 kv heads split, or replicated past 8 chips), the merged gate_up
# (8192 -> 2 * 28672), both column-parallel without a gather, and the row-parallel o_proj (8192 ->
# 8192) and down (28672 -> 8192) with their all-reduce; a 16-token decode batch and an 8192-token
# prefill. The small shapes keep the same structure (8 q heads / 2 kv heads of 64, widths 512-1024).
_QKV, _QKV_SERVING = ((16, 512, 8, 2, 64),), ((16, 8192, 64, 8, 128), (8192, 8192, 64, 8, 128))
_GATE_UP, _GATE_UP_SERVING = ((16, 512, 1024),), ((16, 8192, 28672), (8192, 8192, 28672))
_O_PROJ, _O_PROJ_SERVING = ((16, 512, 512),), ((16, 8192, 8192), (8192, 8192, 8192))
_DOWN, _DOWN_SERVING = ((16, 1024, 512),), ((16, 28672, 8192), (8192, 28672, 8192))
# A column-parallel layer that all-gathers its output (``gather_output=True``: the full output on
# every chip), Llama-3-70B's up projection width.
_GATHER, _GATHER_SERVING = ((16, 512, 1024),), ((16, 8192, 28672), (8192, 8192, 28672))


def _tp_linear_layer(kind: str):
    """``build`` of one tensor-parallel projection (``dualop.jax.layers.parallel_linear``, the jax
    layers' own call) on a mesh axis "x" over every chip; no biases (Llama)."""

    def build(mesh, shape, dtype):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding

        from dualop import ops
        from dualop.jax.layers import linear_specs, parallel_linear
        from dualop.jax.parallel import AxisTensorParallel

        tp = AxisTensorParallel("x", mesh.shape["x"])
        if kind == "qkv":
            tokens, hidden, heads, kv_heads, head = shape
            op = ops.QKVParallelLinear(hidden, head, heads, kv_heads, bias=False, tp=tp)
        elif kind == "gather":
            tokens, in_size, out_size = shape
            op = ops.ColumnParallelLinear(in_size, out_size, bias=False, gather_output=True, tp=tp)
        elif kind == "gate_up":
            tokens, hidden, inter = shape
            op = ops.MergedColumnParallelLinear(hidden, [inter, inter], bias=False, tp=tp)
        else:
            tokens, in_size, out_size = shape
            op = ops.RowParallelLinear(in_size, out_size, bias=False, tp=tp)
        specs = linear_specs(op, "x")
        weight_shape = [op.output_size_per_partition, op.input_size_per_partition]
        weight_shape[op.weight_split_dim] *= tp.size  # the rank-major global weight

        def spec(shp, part):
            return jax.ShapeDtypeStruct(shp, jnp.dtype(dtype), sharding=NamedSharding(mesh, part))

        args = (spec((tokens, op.input_size), specs["x"]), spec(tuple(weight_shape), specs["weight"]))

        def fn(x, weight):
            return parallel_linear(op, mesh, "x", x, weight)[0]

        return fn, args

    return build


SHARDED_LAYERS += [
    ShardedLayer("column_parallel_linear[qkv]", "column_parallel_linear", _QKV, _QKV_SERVING, _tp_linear_layer("qkv")),
    ShardedLayer("column_parallel_linear[gate_up]", "column_parallel_linear", _GATE_UP, _GATE_UP_SERVING,
                 _tp_linear_layer("gate_up")),
    ShardedLayer("column_parallel_linear[gather]", "column_parallel_linear", _GATHER, _GATHER_SERVING,
                 _tp_linear_layer("gather")),
    ShardedLayer("row_parallel_linear[o_proj]", "row_parallel_linear", _O_PROJ, _O_PROJ_SERVING,
                 _tp_linear_layer("row")),
    ShardedLayer("row_parallel_linear[down]", "row_parallel_linear", _DOWN, _DOWN_SERVING, _tp_linear_layer("row")),
]


# --- tensor-parallel logits processor ------------------------------------------------------
# (tokens, hidden, vocab): the LM head's rows sharded over every chip of the topology (4 on v5e:2x2,
# 8 on v6e:2x4), each chip's logits computed by the fused kernel (soft cap 30, Gemma-2's) and
# all-gathered along the vocabulary. Small: a 32000 vocabulary at hidden 1024; serving: Llama-3-70B's
# width (hidden 8192, vocab 128256) at decode and prefill, and Gemma-2-27B's decode (4608, 256000).
_TP_LOGITS, _TP_LOGITS_SERVING = ((16, 1024, 32000),), ((16, 8192, 128256), (8192, 8192, 128256), (16, 4608, 256000))


def _tp_logits_layer(mesh, shape, dtype):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dualop.jax.layers import LogitsProcessor
    from dualop.parallel import vocab_shard

    tokens, hidden, vocab = shape
    n = mesh.shape["x"]
    layer = LogitsProcessor(vocab, soft_cap=30.0, mesh=mesh, axis="x")
    rows = vocab_shard(vocab, None, 64, n, 0, op="logits_processor").num_embeddings_per_partition

    def spec(shape, part):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, part))

    args = (spec((n * rows, hidden), PartitionSpec("x")), spec((tokens, hidden), PartitionSpec()))
    return (lambda weight, hidden_states: layer(weight, hidden_states)), args


SHARDED_LAYERS += [
    ShardedLayer("logits_processor[tp,soft_cap]", "logits_processor", _TP_LOGITS, _TP_LOGITS_SERVING,
                 _tp_logits_layer),
]


# --- tensor-parallel vocabulary embedding ---------------------------------------------------------
# (tokens, num_embeddings, org_num_embeddings, embedding_dim): the table's padded rows split over
# the "x" axis (rank-major, as dualop.jax.layers.VocabParallelEmbedding holds it), ids replicated,
# each chip's Pallas gather of its rows, then one all-reduce. Small: the engine docstring's
# vocabulary (1010 + 16 added ids: 1024 base + 64 added rows), D 256; serving: Llama-3-70B's vocab
# 128256 at hidden 8192, a 16-token decode batch and an 8192-token prefill.
_VOCAB_SMALL = ((64, 1026, 1010, 256),)
_VOCAB_SERVING = ((16, 128256, 128256, 8192), (8192, 128256, 128256, 8192))


def _vocab_embedding_layer(mesh, shape, dtype):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dualop.jax.parallel import AxisTensorParallel, shard_map
    from dualop.ops import VocabParallelEmbedding

    tokens, vocab, org, dim = shape
    op = VocabParallelEmbedding(vocab, dim, org_num_embeddings=org, tp=AxisTensorParallel("x", mesh.shape["x"]))
    rows = mesh.shape["x"] * op.num_embeddings_per_partition
    args = (jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec())),
            jax.ShapeDtypeStruct((rows, dim), jnp.dtype(dtype), sharding=NamedSharding(mesh, PartitionSpec("x", None))))
    fn = shard_map(op, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("x", None)), out_specs=PartitionSpec())
    return fn, args


SHARDED_LAYERS += [
    ShardedLayer("vocab_parallel_embedding[tp]", "vocab_parallel_embedding", _VOCAB_SMALL, _VOCAB_SERVING,
                 _vocab_embedding_layer),
]
