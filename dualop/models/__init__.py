"""Whole models from dualop's ops, in both frontends: ``from_pretrained(path, frontend, dtype, tp)``.

A model is one forward written against dualop's ops (``dualop.models.<family>``), the parameters
read from a local transformers checkpoint directory (``config.json`` + safetensors) and a serving
loop over a paged KV cache (``dualop.models.engine``)::

    model = dualop.models.from_pretrained("/path/to/checkpoint", frontend="jax")
    logits = model.logits([1, 2, 3])               # [3, vocab], a jax array
    tokens = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # greedy, continuous batching

Families: ``llama`` (Llama, Qwen2, Qwen3, Qwen3-MoE), ``bamba`` (Bamba: Mamba-2 and attention
layers over state caches and the paged KV cache), ``nemotron_h`` (Nemotron-H's mamba, attention and
MLP blocks); ``ARCHITECTURES`` maps config.json's architecture to its class.

Importing this package imports neither torch nor jax; ``from_pretrained`` imports the frontend's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from dualop.models.checkpoint import Checkpoint, CheckpointError
from dualop.models.engine import CausalLM, ServingConfig, StepStats

__all__ = ["from_pretrained", "ARCHITECTURES", "CausalLM", "ServingConfig", "StepStats", "CheckpointError"]

# architecture (config.json's "architectures"[0]) -> "module:class"
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "dualop.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "dualop.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "dualop.models.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "dualop.models.llama:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "dualop.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "dualop.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    "BambaForCausalLM": "dualop.models.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": "dualop.models.nemotron_h:NemotronHForCausalLM",
}

_DTYPES = ("float32", "bfloat16", "float16")


def _dtype_name(dtype: Any, config: dict[str, Any]) -> str:
    if dtype is None:
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"from_pretrained: dtype must be one of {', '.join(_DTYPES)} (or None: the config's), "
                         f"got {dtype!r}")
    return name


def from_pretrained(path: str | os.PathLike, frontend: str = "torch", dtype: Any = None, tp: int = 1, *,
                    max_model_len: int = 512, max_num_seqs: int = 8, max_num_batched_tokens: int = 256,
                    page_size: int = 16, kv_cache_dtype: str = "auto", progress: Callable[[str], None] | None = None,
                    weight_only: bool = False) -> CausalLM:
    """The model in the checkpoint directory ``path``, built from dualop ops in ``frontend``
    ("torch" or "jax"), its parameters in ``dtype`` (None: the config's), sharded over ``tp``
    ranks (torch: call in each of ``tp`` processes of an initialised torch.distributed group;
    jax: a mesh over the first ``tp`` devices). ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens`` and ``page_size`` size the caches and the batch (``ServingConfig``);
    ``kv_cache_dtype`` is the paged KV cache's dtype by the engine's name: "auto" (the model's),
    "fp8" or "fp8_e4m3" (float8_e4m3fn), "fp8_e5m2" (float8_e5m2), with the checkpoint's per-layer
    ``k_scale`` / ``v_scale`` where it has them, else 1.0 (``dualop.models.engine``).
    ``progress(name)`` is called after each parameter is loaded.

    Quantized checkpoints (``fp8``, ``compressed-tensors``, ``awq``: ``dualop.models.quantized``)
    load with their linear weights kept quantized (``dualop.ops.QuantizedWeight``), ``tp=1``; their
    activations are quantized as the checkpoint says (W8A8), or not at all with ``weight_only``
    (what hardware without 8-bit matrix units runs, and transformers' CPU loading computes).

    Errors (``ValueError``, nothing loaded): an architecture not in ``ARCHITECTURES``, a quantized
    checkpoint dualop cannot follow (a ``quant_method`` outside ``SUPPORTED_METHODS``, a tensor
    that does not fit its config, tensors of a quantized dtype without one, a quantized layer the
    model reads no linear weight from, tensor parallelism), a missing tensor or one of the wrong
    shape (``CheckpointError`` lists them), a bad option."""
    import importlib

    from dualop.models.frontends import make_frontend
    from dualop.platforms import keep_tpu_runtimes_off_without_tpu

    keep_tpu_runtimes_off_without_tpu()  # as the dualop command: no libtpu start-up noise on a host with no TPU

    ckpt = Checkpoint(path)
    arch = (ckpt.config.get("architectures") or ["?"])[0]
    target = ARCHITECTURES.get(arch)
    if target is None:
        raise ValueError(f"from_pretrained: architecture {arch!r} (config.json of {ckpt.path!r}) is not supported; "
                         f"supported: {', '.join(sorted(ARCHITECTURES))}")
    serving = ServingConfig(max_model_len, max_num_seqs, max_num_batched_tokens, page_size, kv_cache_dtype)
    dtype_name = _dtype_name(dtype, ckpt.config)
    fe = make_frontend(frontend, tp)
    module, cls = target.split(":")
    model_class = getattr(importlib.import_module(module), cls)
    if not isinstance(weight_only, bool):
        raise TypeError(f"from_pretrained: weight_only must be a bool, got {weight_only!r}")
    return model_class(ckpt, fe, dtype_name, serving, progress, weight_only=weight_only)
