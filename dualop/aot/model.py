"""``dualop compile --model``: a whole model's JAX serving step built for a multi-chip TPU slice
with the real compiler, weights as shapes only (never materialised).

The step is the one ``dualop.models`` runs (``CausalLM.forward`` under ``shard_map`` over a
one-axis mesh, every op on its TPU path: Pallas kernels lowered for the chip): one mixed batch
of ``num_seqs`` sequences and ``num_tokens`` tokens over the paged KV cache. Parameters, caches
and the batch are ``jax.ShapeDtypeStruct``s carrying their ``NamedSharding`` on the topology's
compile-only devices. Reported per device, from the compiler's own memory analysis: the
arguments (weights + KV cache + batch), the temporaries, the outputs not aliased to inputs, their
sum against the chip's HBM, and the collectives per step (``collectives.py``). A model that does
not fit is reported as not fitting, not as a pass.

Shapes (``MODEL_SHAPES``) are the published configs' (Llama-3-8B, Qwen3-30B-A3B); ``layers``
builds fewer layers of the same width (a quicker check of the same per-layer program).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dualop.aot.result import first_line

__all__ = ["MODEL_SHAPES", "MODEL_TARGETS", "HBM_BYTES", "ModelBuild", "compile_model", "judge_fit",
           "format_model_builds"]

GiB = 1024 ** 3
# Per-chip HBM (published): v5e 16 GiB, v6e 32 GiB, v5p 95 GiB, v4 32 GiB, TPU7x 192 GiB.
HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB, "tpu7x": 192 * GiB}

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3.1-8B's config.json
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE,
                      tie_word_embeddings=False, eos_token_id=128001),
    # Qwen/Qwen3-30B-A3B's config.json
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          tie_word_embeddings=False, eos_token_id=151645),
}
# (topology, tensor-parallel size): the slices the issue names.
MODEL_TARGETS = (("v5e:2x2", 4), ("v6e:2x4", 8))


@dataclasses.dataclass
class ModelBuild:
    """One model step built for one slice: ``status`` ok / does-not-fit / refused / unavailable."""

    model: str
    target: str
    tp: int
    layers: int
    num_tokens: int
    num_seqs: int
    kv_tokens: int
    status: str
    message: str = ""
    seconds: float = 0.0
    weight_bytes: int = 0  # per device, the parameters' shards
    kv_cache_bytes: int = 0  # per device
    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0  # not aliased to an input (the donated caches are)
    hbm_bytes: int = 0
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    declined: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes


def _per_device_bytes(struct: Any) -> int:
    import numpy as np

    shard = struct.sharding.shard_shape(struct.shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(struct.dtype).itemsize


def compile_model(name: str, target: str, tp: int, *, layers: int | None = None, num_tokens: int = 512,
                  num_seqs: int = 64, max_model_len: int = 2048, page_size: int = 64,
                  dtype: str = "bfloat16") -> ModelBuild:
    """Build ``MODEL_SHAPES[name]``'s serving step for ``target`` (a topology, e.g. ``v5e:2x2``) at
    tensor-parallel size ``tp``: a mixed batch of ``num_tokens`` tokens over ``num_seqs`` sequences,
    a KV cache of ``num_seqs * max_model_len`` tokens in pages of ``page_size``."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from dualop import OpsConfig, override_platform, set_config
    from dualop.aot import tpu
    from dualop.custom_op import clear_dispatch_report, dispatch_report
    from dualop.kernels.pallas.common import compile_target
    from dualop.models import ARCHITECTURES
    from dualop.models.engine import ServingConfig
    from dualop.models.frontends import JaxFrontend

    if name not in MODEL_SHAPES:
        raise ValueError(f"dualop compile --model: unknown model {name!r}; expected one of {', '.join(MODEL_SHAPES)}")
    config = dict(MODEL_SHAPES[name])
    if layers is not None:
        config["num_hidden_layers"] = layers
    generation = target.partition(":")[0]
    build = ModelBuild(name, target, tp, config["num_hidden_layers"], num_tokens, num_seqs, num_seqs * max_model_len,
                       status="ok", hbm_bytes=HBM_BYTES.get(generation, 0))
    start = time.perf_counter()
    try:
        devices = tpu.topology_devices(target)
    except Exception as err:  # libtpu does not know this topology
        build.status, build.message = "unavailable", f"topology {target}: {first_line(err)}"
        return build
    if tp > len(devices):
        raise ValueError(f"dualop compile --model: tp={tp} needs {tp} chips; {target} has {len(devices)}")
    import importlib

    module, cls = ARCHITECTURES[config["architectures"][0]].split(":")
    model_class = getattr(importlib.import_module(module), cls)
    frontend = JaxFrontend(tp, devices=devices)
    serving = ServingConfig(max_model_len=max_model_len, max_num_seqs=num_seqs, max_num_batched_tokens=num_tokens,
                            page_size=page_size)
    model = model_class.abstract(config, frontend, dtype, serving)
    mesh = frontend.mesh

    def sharded(shape, split_dim, dt):
        spec = frontend._spec(len(shape), split_dim)
        return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dt) if dt != "bfloat16" else jax.numpy.bfloat16,
                                    sharding=NamedSharding(mesh, spec))

    params = {}
    for p in model.plan:  # each rank's shape from the plan itself, on abstract checkpoint tensors
        full = {t: jax.ShapeDtypeStruct(s, jax.numpy.bfloat16) for t, s in p.expected.items()}
        local = jax.eval_shape(lambda tensors, p=p: p.build(tensors.__getitem__, 0), full)
        shape = list(local.shape)
        if p.split_dim is not None:
            shape[p.split_dim] *= tp
        params[p.name] = sharded(shape, p.split_dim, "float32" if model.keep_float32(p.name) else dtype)
    caches = []
    for c in model.cache_specs:
        shape = list(c.shape)
        if c.split_dim is not None:
            shape[c.split_dim] *= tp
        caches.append(sharded(shape, c.split_dim, c.dtype))
    batch_shapes = dict(input_ids=(num_tokens,), positions=(num_tokens,), slot_mapping=(num_tokens,),
                        kv_lens=(num_seqs,), page_indices=(num_seqs, serving.pages_per_seq),
                        cu_q_lens=(num_seqs + 1,), num_seqs=(1,), logits_indices=(num_seqs,))
    if model.has_state_cache:
        batch_shapes.update(state_indices=(num_seqs,), has_initial_state=(num_seqs,))
    batch = {k: sharded(s, None, "int32") for k, s in batch_shapes.items()}
    build.weight_bytes = sum(_per_device_bytes(v) for v in params.values())
    build.kv_cache_bytes = sum(_per_device_bytes(v) for v in caches)

    def on_tpu_paths(params, batch, caches):
        with override_platform("tpu"), set_config(OpsConfig(["all"])):
            return model.forward(params, batch, caches)

    step = frontend.sharded_step(on_tpu_paths, {p.name: p.split_dim for p in model.plan},
                                 {k: len(v.shape) for k, v in params.items()}, model.cache_specs, list(batch))
    clear_dispatch_report()
    try:
        with compile_target(generation):
            lowered = step.trace(params, batch, caches).lower()
            compiled, hlo = tpu.compile_reading_hlo(lowered)
    except Exception as err:  # the compiler's refusal (an HBM overflow is one)
        build.status, build.message = "refused", first_line(err)
        if "RESOURCE_EXHAUSTED" in str(err) or "Ran out of memory" in str(err):
            build.status = "does-not-fit"
    else:
        from dualop.aot.collectives import collectives, summarize

        stats = compiled.memory_analysis()
        build.argument_bytes = int(stats.argument_size_in_bytes)
        build.temp_bytes = int(stats.temp_size_in_bytes)
        build.output_bytes = max(0, int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes))
        build.collectives = summarize([c for module in hlo for c in collectives(module)])
        judge_fit(build)
    build.declined = sorted({f"{r['op']}: {r['reason']}" for r in dispatch_report() if "declined" in r["reason"]})
    build.seconds = time.perf_counter() - start
    return build


def judge_fit(build: ModelBuild) -> ModelBuild:
    """Mark a built step that needs more than its chip's HBM per device as ``does-not-fit``."""
    if build.status == "ok" and build.hbm_bytes and build.total_bytes > build.hbm_bytes:
        build.status = "does-not-fit"
        build.message = (f"needs {build.total_bytes / GiB:.2f} GiB per chip; a {build.target.partition(':')[0]} chip "
                         f"has {build.hbm_bytes / GiB:.0f} GiB")
    return build


def format_model_builds(builds: list[ModelBuild]) -> str:
    from dualop.aot.collectives import describe
    from dualop.bench.report import table

    def gib(n: int) -> str:
        return f"{n / GiB:.2f}" if n else "-"  # "-": the compiler gave no analysis (it refused the program)

    rows = [{"model": f"{b.model} ({b.layers} layers)", "slice": f"{b.target} tp{b.tp}",
             "step": f"{b.num_tokens} tok / {b.num_seqs} seq", "status": b.status,
             "weights GiB": gib(b.weight_bytes), "kv cache GiB": gib(b.kv_cache_bytes),
             "args GiB": gib(b.argument_bytes), "temp GiB": gib(b.temp_bytes), "out GiB": gib(b.output_bytes),
             "total / HBM GiB": f"{gib(b.total_bytes)} / {b.hbm_bytes / GiB:.0f}", "s": f"{b.seconds:.0f}"}
            for b in builds]
    parts = [table(rows, list(rows[0]) if rows else [])]
    for b in builds:
        lines = [f"{b.model} on {b.target} tp{b.tp}: {b.message or b.status}"]
        if b.collectives:
            lines.append("  collectives per step: " + describe(b.collectives))
        for d in b.declined:
            lines.append(f"  native body where a kernel declined: {d}")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
