"""The kernel variants ``dualop compile`` builds: every op case x dtype x non-empty shape that
``dualop check`` runs, plus the shapes an LLM server would call each op family with.

A variant carries abstract inputs (``InputSpec``: shape and dtype), never data, so a serving
shape of 8192 x 57344 costs nothing to describe. Check shapes take their inputs from the case's own
``make_inputs``; serving shapes scale the inputs of the case's first 2-D check shape (an input
shaped like x becomes the serving shape, one shaped like x's last dim becomes the serving hidden
size, a small fixed input such as a (1,) scale is kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from dualop import testing
from dualop.spec import InputSpec, Serving, collect

__all__ = ["InputSpec", "Variant", "SERVING_SHAPES", "SERVING_INPUTS", "servings", "variants_for", "check_dtypes"]

# Prefill of 8192 tokens and a 16-token decode batch at the widths of Llama-3-70B (hidden 8192,
# intermediate 28672) and Llama-3-405B (hidden 16384, intermediate 53248). Gated activations take
# gate and up side by side (2 x intermediate); fp8 quantisation sees both the attention input
# (hidden) and the down projection's input (intermediate).
_NORM = ((8192, 8192), (16, 16384))
_GATED = ((8192, 2 * 28672), (16, 2 * 53248))
_POINTWISE = ((8192, 28672), (16, 53248))
SERVING_SHAPES: dict[str, tuple[tuple[int, ...], ...]] = {
    "rms_norm": _NORM,
    "gemma_rms_norm": _NORM,
    "rms_norm_gated": _NORM,
    "silu_and_mul": _GATED,
    "mul_and_silu": _GATED,
    "gelu_and_mul": _GATED,
    "gelu_and_mul_sparse": _GATED,
    "fatrelu_and_mul": _GATED,
    "swigluoai_and_mul": _GATED,
    "gelu_new": _POINTWISE,
    "gelu_fast": _POINTWISE,
    "quick_gelu": _POINTWISE,
    "relu2": _POINTWISE,
    "xielu": _POINTWISE,
    "quant_fp8": ((8192, 8192), (16, 53248)),
    # reshape_and_cache: (tokens, num_kv_heads, head_dim, num_pages, page_size), see SERVING_INPUTS
    "reshape_and_cache": ((2048, 8, 128, 2048, 16), (2048, 8, 128, 2048, 128)),
    # rope: Llama-3-70B (64 query heads, 8 KV heads, head 128) for the text ropes, prefill 8192 and
    # a 16-token decode batch; the Qwen2.5-VL vision encoder (4096 patches, 16 heads, head 80).
    "rotary_embedding": ((8192, 64 * 128), (16, 64 * 128)),
    "dual_chunk_rotary_embedding": ((8192, 64 * 128), (16, 64 * 128)),
    "apply_rotary_emb": ((4096, 16, 80),),
}


def _grouped_rms_norm_gated(shape):
    from dualop.ops import RMSNormGated

    return RMSNormGated(shape[-1], group_size=shape[-1] // 8)  # Mamba-2 style: 8 groups


# Ops whose inputs are not row-shaped (attention over a paged cache, rope's positions, ...): how to
# describe their serving inputs. ``SERVING_INPUTS[op](shape)`` returns the op's positional arguments
# as InputSpecs (dtype None: the variant's dtype), scalars or None, for one entry of
# ``SERVING_SHAPES[op]``, whose tuple then means whatever that op's function says.
SERVING_INPUTS: dict[str, Callable[[tuple[int, ...]], tuple]] = {}


def _reshape_and_cache_inputs(shape):
    """A step's tokens written into a paged cache of ``num_pages`` pages (Llama-3-70B's 8 KV heads of 128)."""
    tokens, heads, head_dim, num_pages, page_size = shape
    kv = InputSpec((tokens, heads, head_dim), None)
    return (kv, kv, InputSpec((num_pages, page_size, 2 * heads, head_dim), None), InputSpec((tokens,), "int32"))


SERVING_INPUTS["reshape_and_cache"] = _reshape_and_cache_inputs

# Cases whose ``make_op`` only knows its check shapes: how to build the op at a serving shape.
_SERVING_MAKE_OP: dict[str, Callable[[tuple[int, ...]], Any]] = {
    "rms_norm_gated[z,group]": _grouped_rms_norm_gated,
}


# --- rope: (tokens, query width) -> positions, query and key of Llama-3-70B's attention ------------
_ROPE_HEAD, _ROPE_KV_HEADS, _ROPE_MAX_POSITION = 128, 8, 8192


def _rope_inputs(shape, *, offsets: bool = False):
    tokens, width = shape
    positions = InputSpec((tokens,), "int32")
    args = (positions, InputSpec((tokens, width), None), InputSpec((tokens, _ROPE_KV_HEADS * _ROPE_HEAD), None))
    return (*args, positions) if offsets else args


def _vision_rope_inputs(shape):
    seq, heads, head_size = shape
    return (InputSpec(shape, None), InputSpec((seq, head_size // 2), None), InputSpec((seq, head_size // 2), None))


def _serving_rope(case_label: str):
    def make(shape):
        from dualop.ops import DualChunkRotaryEmbedding, RotaryEmbedding

        neox = "gptj" not in case_label
        rotary_dim = _ROPE_HEAD * 3 // 4 if "partial" in case_label else _ROPE_HEAD
        if case_label.startswith("dual_chunk"):  # Qwen2.5-1M style chunks, at this cache's length
            return DualChunkRotaryEmbedding(_ROPE_HEAD, rotary_dim, _ROPE_MAX_POSITION, 1e6, neox, None, 2048, 256)
        return RotaryEmbedding(_ROPE_HEAD, rotary_dim, _ROPE_MAX_POSITION, 500000.0, neox)

    return make


SERVING_INPUTS.update({
    "rotary_embedding": _rope_inputs,
    "dual_chunk_rotary_embedding": lambda shape: _rope_inputs(shape, offsets=True),
    "apply_rotary_emb": _vision_rope_inputs,
})
_SERVING_MAKE_OP.update({
    label: _serving_rope(label)
    for label in ("rotary_embedding[neox,d64]", "rotary_embedding[gptj,d80,partial]",
                  "rotary_embedding[neox,d80,no_key]", "dual_chunk_rotary_embedding[neox,d64,partial]")
})


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel build: an op case at one dtype and shape. ``inputs`` are the op's positional
    arguments as ``InputSpec``s (None for an absent optional one)."""

    case: testing.OpCase
    dtype: str
    shape: tuple[int, ...]
    serving: bool
    inputs: tuple[InputSpec | None, ...]

    @property
    def key(self) -> tuple[str, str, tuple[int, ...]]:
        return (self.case.label, self.dtype, self.shape)

    def make_op(self):
        make = servings().get(self.case.op, _NO_SERVING).make_op.get(self.case.label) if self.serving else None
        return (make or self.case.make_op)(self.shape)


def check_dtypes(dtypes: list[str] | None) -> list[str]:
    dtypes = list(dtypes or ("float32", "bfloat16"))
    unknown = [d for d in dtypes if d not in testing.DTYPES]
    if unknown:
        raise ValueError(f"dualop compile: unknown dtype(s) {unknown}; expected some of {list(testing.DTYPES)}")
    return dtypes


def _templates(arrays: tuple) -> tuple:
    """Numpy inputs from ``make_inputs`` as InputSpecs; dtype None means "the variant's dtype"
    (a ``Pinned`` input keeps its own)."""
    out = []
    for a in arrays:
        if a is None or isinstance(a, (bool, int, float)):
            out.append(a)
        elif isinstance(a, testing.Pinned):
            out.append(InputSpec(tuple(a.array.shape), a.dtype))
        else:
            out.append(InputSpec(tuple(np.shape(a)), None))
    return tuple(out)


def _scaled(case: testing.OpCase, probe: tuple[int, ...], probe_inputs: tuple, shape: tuple[int, ...]) -> tuple:
    """The probe shape's inputs re-shaped for ``shape`` (see the module docstring)."""
    out = []
    for i, spec in enumerate(probe_inputs):
        if not isinstance(spec, InputSpec):
            out.append(spec)
        elif spec.shape == probe:
            out.append(InputSpec(shape, spec.dtype))
        elif spec.shape == probe[-1:]:
            out.append(InputSpec(shape[-1:], spec.dtype))
        elif int(np.prod(spec.shape)) <= 1:
            out.append(spec)
        else:
            raise ValueError(
                f"dualop compile: cannot scale input {i} of case {case.label} (shape {spec.shape} at check "
                f"shape {probe}) to the serving shape {shape}"
            )
    return tuple(out)


def _serving_specs(case: testing.OpCase, shapes: list, templates: dict, shape: tuple[int, ...]) -> tuple:
    """A serving shape's inputs: the op's own ``SERVING_INPUTS`` function, else the case's first
    2-D check shape scaled up."""
    describe = servings()[case.op].inputs
    if describe is not None:
        return tuple(describe(shape))
    probe = next((s for s in shapes if len(s) == 2), None)
    if probe is None:
        raise ValueError(
            f"dualop compile: case {case.label} has no 2-D check shape to scale to {shape}; "
            f"give its Serving an inputs function"
        )
    return _scaled(case, probe, templates[probe], shape)


def variants_for(ops: list[str] | None, dtypes: list[str], serving_dtypes: list[str] | None = None) -> list[Variant]:
    """Every (case, dtype, shape) to build, check shapes first, without duplicates; serving shapes
    only in ``serving_dtypes`` (default: every one of ``dtypes``)."""
    testing.check_op_names(ops, "dualop compile")
    rng = np.random.default_rng(0)
    variants: dict[tuple, Variant] = {}
    for case in testing.cases_for(ops):
        shapes = [tuple(s) for s in case.shapes if s and s[0] > 0]
        templates = {s: _templates(case.make_inputs(s, rng)) for s in shapes}
        declared = servings().get(case.op, _NO_SERVING)
        serving = [tuple(s) for s in declared.shapes if tuple(s) not in templates]
        if case.label not in (declared.cases or (case.label,)):
            serving = []
        for dtype in dtypes:
            served = serving if dtype in (declared.dtypes or (dtype,)) else []
            if serving_dtypes is not None and dtype not in serving_dtypes:
                served = []
            for shape in shapes + served:
                is_serving = shape not in templates
                specs = _serving_specs(case, shapes, templates, shape) if is_serving else templates[shape]
                specs = tuple(
                    InputSpec(s.shape, s.dtype or dtype) if isinstance(s, InputSpec) else s for s in specs
                )
                v = Variant(case, dtype, shape, is_serving, specs)
                variants.setdefault(v.key, v)
    return list(variants.values())


# --- mm_encoder_attn: (B, S, heads, head size, packed segments; 0 = none) -------------------------
# Qwen2.5-VL's vision tower (16 heads of 80; 4096 patches packed as 16 windows of 256 via
# cu_seqlens), SigLIP-so400m at 384 px (16 heads of 72, 729 patches) and SigLIP at 512 px (16
# heads of 64, 1024 patches), a batch of 8 images each.
SERVING_SHAPES["mm_encoder_attn"] = ((1, 4096, 16, 80, 16), (8, 729, 16, 72, 0), (8, 1024, 16, 64, 0))


def _encoder_attention_inputs(shape: tuple[int, ...]) -> tuple:
    b, s, heads, head_size, segments = shape
    x = InputSpec((b, s, heads * head_size), None)
    cu = InputSpec((segments + 1,), "int32") if segments else None
    return (x, x, x, cu, s // segments if segments else None)


def _encoder_attention_op(shape: tuple[int, ...]):
    from dualop.ops import MMEncoderAttention

    return MMEncoderAttention(shape[2], shape[3])


SERVING_INPUTS["mm_encoder_attn"] = _encoder_attention_inputs
_SERVING_MAKE_OP.update({
    label: _encoder_attention_op
    for label in ("mm_encoder_attn", "mm_encoder_attn[gqa,bshd]", "mm_encoder_attn[cu_seqlens]")
})


# ragged_paged_attention: (T, num_seqs, num_pages, page_size, pages_per_seq, Hq, Hkv, D). One mixed
# serving step of 2048 query tokens over 256 sequences (prefill chunks and many decodes) and a
# 2048-page cache, Llama-3-8B heads (32 / 8, d 128) at pages of 16 and 128 tokens, then head dims
# 64 and 256 (Gemma: 16 / 8 heads); pages_per_seq bounds a sequence at 2048 (4096) positions.
SERVING_SHAPES["ragged_paged_attention"] = (
    (2048, 256, 2048, 16, 128, 32, 8, 128),
    (2048, 256, 2048, 128, 32, 32, 8, 128),
    (2048, 256, 2048, 16, 128, 32, 8, 64),
    (2048, 256, 2048, 16, 128, 16, 8, 256),
)


def _ragged_paged_attention_inputs(shape: tuple[int, ...]) -> tuple:
    """q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs for one SERVING_SHAPES entry."""
    tokens, seqs, pages, page_size, pages_per_seq, q_heads, kv_heads, head_dim = shape
    return (
        InputSpec((tokens, q_heads, head_dim), None),
        InputSpec((pages, page_size, 2 * kv_heads, head_dim), None),
        InputSpec((seqs,), "int32"),
        InputSpec((seqs, pages_per_seq), "int32"),
        InputSpec((seqs + 1,), "int32"),
        InputSpec((1,), "int32"),
    )


SERVING_INPUTS["ragged_paged_attention"] = _ragged_paged_attention_inputs


# --- mixture of experts ---------------------------------------------------------------------------
# fused_moe / unquantized_fused_moe: (tokens, E_global, top_k, hidden, intermediate, E_local). One
# chip's experts: DeepSeek-V3 (256 experts of 7168 -> 2048, top-8, grouped sigmoid routing) with
# experts spread over 8 chips (32 local, the rest masked by expert_map), and Qwen3-235B-A22B (128
# experts of 4096 -> 1536, top-8, softmax) whole; a 16-token decode batch and an 8192-token prefill.
_MOE_SERVING = (
    (16, 256, 8, 7168, 2048, 32), (8192, 256, 8, 7168, 2048, 32),
    (16, 128, 8, 4096, 1536, 128), (8192, 128, 8, 4096, 1536, 128),
)
SERVING_SHAPES["fused_moe"] = _MOE_SERVING
# The experts op runs the same kernels as fused_moe (which builds them at every serving shape above):
# one decode step of DeepSeek-V3's expert-parallel slice (the expert_map variant) is enough here.
SERVING_SHAPES["unquantized_fused_moe"] = _MOE_SERVING[:1]
# grouped_topk: (tokens, num_experts, num_expert_group, topk_group, top_k): DeepSeek-V3's router
# (8 groups, best 4, correction bias) and Qwen3-235B's plain softmax top-8.
SERVING_SHAPES["grouped_topk"] = ((16, 256, 8, 4, 8), (8192, 256, 8, 4, 8), (16, 128, 0, 0, 8), (8192, 128, 0, 0, 8))

# Ops whose serving shapes are built in these dtypes only: MoE models are served in 16-bit (a float32
# DeepSeek-V3 or Qwen3-235B layer is not a shape anyone serves), and each MoE build at 8192 tokens
# costs the compilers tens of seconds.
SERVING_DTYPES: dict[str, tuple[str, ...]] = {
    op: ("bfloat16",) for op in ("fused_moe", "unquantized_fused_moe", "grouped_topk", "transformers_fused_moe",
                                 "modular_fused_moe")
}
# The Mamba mixers likewise: a mixer at serving size is its GEMMs around its kernel ops, whose own
# entries (causal_conv1d, selective_scan, ssd_chunk_scan, mixer2_gated_rms_norm) build the kernels in
# float32 at serving shapes; a float32 Nemotron-H mixer at 8192 tokens took XLA:TPU over a minute.
SERVING_DTYPES.update({op: ("bfloat16",) for op in ("mamba_mixer", "mamba_mixer2", "plamo2_mamba_mixer")})

# Ops whose serving shapes are built for these case labels only (one model-shaped op each, not
# every check variant again at full size).
SERVING_CASES: dict[str, tuple[str, ...]] = {
    "fused_moe": ("fused_moe[silu,E8,I128]",),
    "unquantized_fused_moe": ("unquantized_fused_moe[gelu,expert_map,E8,I128]",),
    "grouped_topk": ("grouped_topk[softmax,k2]",),
}
# ragged_paged_attention's serving shapes for two of its three check variants: the scales of
# [k_scale,v_scale] are two multiplies on the same blocks (its check shapes still build), while the
# window, soft cap and mask value add code paths; a build at these shapes costs seconds each.
SERVING_CASES["ragged_paged_attention"] = ("ragged_paged_attention[mixed,gqa2]",
                                           "ragged_paged_attention[gqa4,window,soft_cap,mask_value]")


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


SERVING_INPUTS.update({"fused_moe": _fused_moe_inputs, "unquantized_fused_moe": _experts_inputs,
                       "grouped_topk": _grouped_topk_inputs})
_SERVING_MAKE_OP.update({"fused_moe[silu,E8,I128]": _fused_moe_op,
                         "unquantized_fused_moe[gelu,expert_map,E8,I128]": _experts_op,
                         "grouped_topk[softmax,k2]": _grouped_topk_op})


# --- transformers_fused_moe: gpt-oss-20b's experts as transformers stores them --------------------
# (tokens, experts, top_k, hidden, intermediate): 32 experts of 2880 -> 2880, top-4, swigluoai with
# biases, gate_up_proj [E, H, 2I] interleaved and down_proj [E, I, H] (the transposed layout, so the
# program holds the transposes XLA makes of them); a 16-token decode batch and an 8192-token prefill.
SERVING_SHAPES["transformers_fused_moe"] = ((16, 32, 4, 2880, 2880), (8192, 32, 4, 2880, 2880))
SERVING_CASES["transformers_fused_moe"] = ("transformers_fused_moe[gpt_oss,E4,I64]",)


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


SERVING_INPUTS["transformers_fused_moe"] = _transformers_fused_moe_inputs
_SERVING_MAKE_OP["transformers_fused_moe[gpt_oss,E4,I64]"] = _transformers_fused_moe_op

# modular_fused_moe: the experts of unquantized_fused_moe between a single-device prepare and
# finalize, at the same model shapes (one case).
SERVING_SHAPES["modular_fused_moe"] = _MOE_SERVING[2:3]  # Qwen3-235B decode; fused_moe builds the rest
SERVING_CASES["modular_fused_moe"] = ("modular_fused_moe[silu,expert_map,E8,I64]",)


def _modular_experts_op(shape: tuple[int, ...]):
    from dualop.ops import FusedMoEModularMethod

    return FusedMoEModularMethod()


SERVING_INPUTS["modular_fused_moe"] = _experts_inputs
_SERVING_MAKE_OP["modular_fused_moe[silu,expert_map,E8,I64]"] = _modular_experts_op


# --- linear: (tokens, input features, output features) of one chip's shard ------------------------
# Llama-3-70B at tp 8: the fused QKV ((64 + 2 * 8) * 128 / 8 = 1280 rows) and merged gate_up
# (2 * 28672 / 8 = 7168 rows) shards of column_parallel_linear, o_proj (8192 / 8 = 1024 -> 8192)
# and down (28672 / 8 = 3584 -> 8192) of row_parallel_linear, and a whole 8192 x 8192 replicated
# projection; a 16-token decode batch and an 8192-token prefill, in bfloat16 (the served dtype).
SERVING_SHAPES.update({
    "replicated_linear": ((16, 8192, 8192), (8192, 8192, 8192)),
    "column_parallel_linear": ((16, 8192, 1280), (8192, 8192, 1280), (16, 8192, 7168), (8192, 8192, 7168)),
    "row_parallel_linear": ((16, 1024, 8192), (8192, 1024, 8192), (16, 3584, 8192), (8192, 3584, 8192)),
})
SERVING_DTYPES.update({op: ("bfloat16",) for op in ("replicated_linear", "column_parallel_linear",
                                                     "row_parallel_linear")})
SERVING_CASES.update({"replicated_linear": ("replicated_linear",),
                      "column_parallel_linear": ("column_parallel_linear[bias]",),
                      "row_parallel_linear": ("row_parallel_linear[bias]",)})


def _linear_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, in_size, out_size = shape
    return (InputSpec((tokens, in_size), None), InputSpec((out_size, in_size), None), None)  # Llama: no bias


def _linear_op(op_name: str):
    def make(shape: tuple[int, ...]):
        from dualop import ops

        tokens, in_size, out_size = shape
        cls = {"replicated_linear": ops.ReplicatedLinear, "column_parallel_linear": ops.ColumnParallelLinear,
               "row_parallel_linear": ops.RowParallelLinear}[op_name]
        return cls(in_size, out_size, bias=False)

    return make


SERVING_INPUTS.update({op: _linear_inputs for op in ("replicated_linear", "column_parallel_linear",
                                                     "row_parallel_linear")})
_SERVING_MAKE_OP.update({label: _linear_op(op) for op, labels in SERVING_CASES.items() if op.endswith("_linear")
                         for label in labels})


# --- logits_processor: (tokens, hidden, vocab) ---------------------------------------------------
# One chip's whole LM head with the fused soft cap of Gemma-2 (30): Gemma-2-27B (hidden 4608, vocab
# 256000) and Llama-3-70B's width (hidden 8192, vocab 128256; Llama itself has no cap, and its plain
# logits decline to XLA's dot, so the cap stands for any epilogue at that width); a 16-token decode
# batch and an 8192-token prefill, in bfloat16 (a float32 LM head at these sizes is not served).
SERVING_SHAPES["logits_processor"] = ((16, 8192, 128256), (8192, 8192, 128256), (16, 4608, 256000),
                                      (8192, 4608, 256000))
SERVING_CASES["logits_processor"] = ("logits_processor[soft_cap]",)
SERVING_DTYPES["logits_processor"] = ("bfloat16",)


def _logits_processor_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, hidden, vocab = shape
    from dualop.parallel import pad_vocab_size

    return (InputSpec((pad_vocab_size(vocab, 64), hidden), None), InputSpec((tokens, hidden), None), None)


def _logits_processor_op(shape: tuple[int, ...]):
    from dualop.ops import LogitsProcessor

    return LogitsProcessor(shape[2], soft_cap=30.0)


SERVING_INPUTS["logits_processor"] = _logits_processor_inputs
_SERVING_MAKE_OP["logits_processor[soft_cap]"] = _logits_processor_op


# --- conv2d / conv3d: the vision encoders' patch embeddings ----------------------------------------
# (N, C, *spatial, out_channels, *kernel) for x [N, C, *spatial] and a kernel equal to the stride:
# Qwen2.5-VL's Conv3d(3, 1280, (2, 14, 14), bias=False) on 16384 patches, one per item as its vision
# tower calls it ([L, 3, 2, 14, 14]); SigLIP-so400m's Conv2d(3, 1152, 14, stride 14) on a batch of 8
# 384 x 384 images (27 x 27 patches; the last 6 pixel rows and columns fill no patch). The fast path
# is a reshape and XLA's dot; vision encoders are served in 16-bit.
SERVING_SHAPES["conv3d"] = ((16384, 3, 2, 14, 14, 1280, 2, 14, 14),)
SERVING_SHAPES["conv2d"] = ((8, 3, 384, 384, 1152, 14, 14),)
SERVING_CASES.update({"conv2d": ("conv2d[patch]",), "conv3d": ("conv3d[patch]",)})
SERVING_DTYPES.update({"conv2d": ("bfloat16",), "conv3d": ("bfloat16",)})


def _patch_embed_parts(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """x's shape, out_channels and the kernel of one conv SERVING_SHAPES entry."""
    num_dim = (len(shape) - 3) // 2
    return shape[:num_dim + 2], shape[num_dim + 2], shape[num_dim + 3:]


def _patch_embed_inputs(shape: tuple[int, ...]) -> tuple:
    x_shape, out_channels, kernel = _patch_embed_parts(shape)
    bias = InputSpec((out_channels,), None) if len(kernel) == 2 else None
    return (InputSpec(x_shape, None), InputSpec((out_channels, x_shape[1], *kernel), None), bias)


def _patch_embed_op(shape: tuple[int, ...]):
    from dualop.ops import Conv2dLayer, Conv3dLayer

    x_shape, out_channels, kernel = _patch_embed_parts(shape)
    cls = Conv2dLayer if len(kernel) == 2 else Conv3dLayer
    return cls(x_shape[1], out_channels, kernel, stride=kernel, bias=len(kernel) == 2)  # Qwen2.5-VL's has none


SERVING_INPUTS.update({"conv2d": _patch_embed_inputs, "conv3d": _patch_embed_inputs})
_SERVING_MAKE_OP.update({"conv2d[patch]": _patch_embed_op, "conv3d[patch]": _patch_embed_op})


# --- vocab_parallel_embedding: (tokens, num_embeddings, org_num_embeddings, embedding_dim) ---------
# Llama-3-70B's table (vocab 128256, hidden 8192) at one device: a 16-token decode batch and an
# 8192-token prefill; the ids are int32, the table this rank's padded rows.
SERVING_SHAPES["vocab_parallel_embedding"] = ((16, 128256, 128256, 8192), (8192, 128256, 128256, 8192))


def _vocab_embedding_inputs(shape: tuple[int, ...]) -> tuple:
    from dualop.parallel import vocab_shard

    tokens, vocab, org, dim = shape
    rows = vocab_shard(vocab, org).num_embeddings_per_partition
    return (InputSpec((tokens,), "int32"), InputSpec((rows, dim), None))


SERVING_INPUTS["vocab_parallel_embedding"] = _vocab_embedding_inputs


# --- causal_conv1d: (tokens, sequences, dim), as its check shapes ------------------------------------------------------
# Mamba conv widths at kernel size 4: Falcon-Mamba-7B / Jamba's intermediate 8192 and Nemotron-H-8B's
# Mamba-2 conv input I + 2GN = 8192 + 2 * 8 * 128; a 1024-token prefill of one and of eight
# sequences and a 64-sequence decode step, over a 256-slot state cache.
SERVING_SHAPES["causal_conv1d"] = tuple((tokens, seqs, dim) for dim in (8192, 8192 + 2 * 8 * 128)
                                        for tokens, seqs in ((1024, 1), (1024, 8), (64, 64)))
SERVING_CASES["causal_conv1d"] = ("causal_conv1d",)
_CONV_SLOTS, _CONV_KERNEL = 256, 4


def _causal_conv1d_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, dim = shape
    return (InputSpec((tokens, dim), None), InputSpec((dim, _CONV_KERNEL), None), InputSpec((dim,), None),
            InputSpec((_CONV_SLOTS, dim, _CONV_KERNEL - 1), None), InputSpec((seqs + 1,), "int32"),
            InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"))


SERVING_INPUTS["causal_conv1d"] = _causal_conv1d_inputs

# short_conv: (tokens, sequences, hidden) at LFM2-1.2B's width (hidden 2048, conv_L_cache 3, no
# biases): the same prefill and decode batches as causal_conv1d.
SERVING_SHAPES["short_conv"] = ((1024, 1, 2048), (1024, 8, 2048), (64, 64, 2048))
SERVING_CASES["short_conv"] = ("short_conv",)
_SHORT_CONV_KERNEL = 3


def _short_conv_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, hidden = shape
    return (InputSpec((tokens, hidden), None), InputSpec((3 * hidden, hidden), None),
            InputSpec((hidden, _SHORT_CONV_KERNEL), None), InputSpec((hidden, hidden), None), None,
            InputSpec((_CONV_SLOTS, hidden, _SHORT_CONV_KERNEL - 1), None), InputSpec((seqs + 1,), "int32"),
            InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"), None, None)


SERVING_INPUTS["short_conv"] = _short_conv_inputs


# --- mamba_mixer: (tokens, sequences, hidden, intermediate, state), as its check cases -----
# Falcon-Mamba-7B / Jamba's Mamba layers (hidden 4096, I 8192, N 16, K 4, R 256) with Jamba's dt/B/C
# norms: an 8192-token prefill of 8 sequences and a 64-sequence decode step, over a 256-slot cache.
_MAMBA_MIXER_SLOTS = 256
SERVING_SHAPES["mamba_mixer"] = ((8192, 8, 4096, 8192, 16), (64, 64, 4096, 8192, 16))
SERVING_CASES["mamba_mixer"] = ("mamba_mixer[jamba]",)


def _mamba_mixer_inputs(shape: tuple[int, ...]) -> tuple:
    """The op's positional arguments (Jamba's: conv bias and norm weights, no projection biases)."""
    tokens, seqs, hidden, inner, state = shape
    rank, kernel = -(-hidden // 16), 4
    w = InputSpec
    return (
        w((tokens, hidden), None), w((2 * inner, hidden), None), w((inner, kernel), None), w((inner,), None),
        w((rank + 2 * state, inner), None), w((inner, rank), None), w((inner,), None), w((inner, state), None),
        w((inner,), None), w((hidden, inner), None), None, None,
        w((rank,), None), w((state,), None), w((state,), None),
        w((_MAMBA_MIXER_SLOTS, inner, kernel - 1), None), w((_MAMBA_MIXER_SLOTS, inner, state), None),
        w((seqs + 1,), "int32"), w((seqs,), "int32"), w((seqs,), "bool"),
    )


SERVING_INPUTS["mamba_mixer"] = _mamba_mixer_inputs


# --- the Mamba-2 mixer (mamba_mixer2 module) ------------------------------------------------
# mixer2_gated_rms_norm: Nemotron-H-8B's mixer output (intermediate 8192, 8 groups; one group for
# Mamba-2 / Bamba), an 8192-token prefill and a 64-sequence decode step.
SERVING_SHAPES["mixer2_gated_rms_norm"] = ((8192, 8192), (64, 8192))


def _mixer2_norm_op(shape: tuple[int, ...]):
    from dualop.ops import Mixer2RMSNormGated

    return Mixer2RMSNormGated(shape[-1], 8)


_SERVING_MAKE_OP["mixer2_gated_rms_norm[groups]"] = _mixer2_norm_op

# mamba_mixer2: (tokens, sequences) at Nemotron-H-8B's widths (hidden 4096, intermediate 8192,
# 128 heads of 64 in 8 groups of state 128, kernel 4): an 8192-token prefill of 8 sequences and a
# 64-sequence decode step, no caches (fresh states).
SERVING_SHAPES["mamba_mixer2"] = ((8192, 8), (64, 64))
_NEMOTRON_H_8B_MIXER = dict(hidden_size=4096, ssm_state_size=128, conv_kernel_size=4, intermediate_size=8192,
                            use_conv_bias=True, use_bias=False, n_groups=8, num_heads=128, head_dim=64)


def _mamba_mixer2_op(shape: tuple[int, ...]):
    from dualop.ops import MambaMixer2

    return MambaMixer2(**_NEMOTRON_H_8B_MIXER)


def _mamba_mixer2_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs = shape
    op = _mamba_mixer2_op(shape)
    weights = {name: InputSpec(s, None) for name, s in op.parameter_shapes().items()}
    return (InputSpec((tokens, op.hidden_size), None), weights["in_proj_weight"], weights["conv_weight"],
            weights.get("conv_bias"), weights["dt_bias"], weights["A_log"], weights["D"], weights.get("norm_weight"),
            weights["out_proj_weight"], None, None, None, None, InputSpec((seqs + 1,), "int32"))


SERVING_INPUTS["mamba_mixer2"] = _mamba_mixer2_inputs
_SERVING_MAKE_OP["mamba_mixer2"] = _mamba_mixer2_op


# --- plamo2_mamba_mixer: (tokens, sequences, hidden, heads, head_dim, state, time-step rank) ------
# The check cases' shape layout (so the case's make_op builds the serving op too, with the SSD chunk
# of 256): PLaMo 2-8B-like widths (hidden 4096, 64 Mamba heads of 128, d_state 64, conv 4, rank
# max(64, 4096 // 16) = 256); a 1024-token prefill of one and of eight sequences and a 64-sequence
# decode step, over a 256-slot state cache.
SERVING_SHAPES["plamo2_mamba_mixer"] = tuple((tokens, seqs, 4096, 64, 128, 64, 256)
                                             for tokens, seqs in ((1024, 1), (1024, 8), (64, 64)))
_PLAMO2_SLOTS, _PLAMO2_CONV = 256, 4


def _plamo2_mamba_mixer_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, hidden, heads, head_dim, state, rank = shape
    inner = heads * head_dim
    weights = ((2 * inner, hidden), (inner, _PLAMO2_CONV), (2 * state + rank, inner), (heads, rank), (heads,),
               (heads,), (heads,), (rank,), (state,), (state,), (hidden, inner))
    return (InputSpec((tokens, hidden), None), *(InputSpec(w, None) for w in weights),
            InputSpec((_PLAMO2_SLOTS, inner, _PLAMO2_CONV - 1), None),
            InputSpec((_PLAMO2_SLOTS, heads, head_dim, state), None), InputSpec((seqs + 1,), "int32"),
            InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"))


def _plamo2_mamba_mixer_op(shape: tuple[int, ...]):
    from dualop.ops import Plamo2MambaMixer

    _, _, hidden, heads, head_dim, state, rank = shape
    return Plamo2MambaMixer(hidden, state, _PLAMO2_CONV, heads, head_dim, time_step_rank=rank, chunk_size=256)


SERVING_INPUTS["plamo2_mamba_mixer"] = _plamo2_mamba_mixer_inputs
_SERVING_MAKE_OP["plamo2_mamba_mixer"] = _plamo2_mamba_mixer_op


# --- selective_scan: (tokens, sequences, I, N), as its check shapes --------------------------------------------------
# Falcon-Mamba-7B / Jamba's Mamba-1 layer (I 8192, N 16): a prefill of 8192 tokens packed as 8
# sequences and a decode step of 64 sequences; a float32 state cache of 2 slots per sequence.
SERVING_SHAPES["selective_scan"] = ((8192, 8, 8192, 16), (64, 64, 8192, 16))


def _selective_scan_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, dim, n = shape
    rows, states = InputSpec((tokens, dim), None), InputSpec((tokens, n), None)
    channel = InputSpec((dim,), None)
    return (rows, rows, InputSpec((dim, n), "float32"), states, states, channel, rows, channel,
            InputSpec((2 * seqs, dim, n), "float32"), InputSpec((seqs + 1,), "int32"), InputSpec((seqs,), "int32"),
            InputSpec((seqs,), "bool"))


SERVING_INPUTS["selective_scan"] = _selective_scan_inputs


# --- ssd_chunk_scan: (tokens, heads, sequences, head_dim, state, groups) --------------------------
# Nemotron-H-8B's Mamba-2 scan (128 heads of 64, 8 groups of state 128, chunks of 256): a 1024-token
# prefill of one and of eight sequences and a 64-sequence decode step, over a float32 cache of
# 2B + 1 slots; and one group of state 128 under 64 heads of 128 (a Falcon-H1-like layout) at prefill.
SERVING_SHAPES["ssd_chunk_scan"] = (
    (1024, 128, 1, 64, 128, 8), (1024, 128, 8, 64, 128, 8), (64, 128, 64, 64, 128, 8), (1024, 64, 8, 128, 128, 1),
)


def _ssd_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, heads, seqs, head_dim, state, groups = shape
    x = InputSpec((tokens, heads, head_dim), None)
    bc = InputSpec((tokens, groups, state), None)
    return (x, InputSpec((tokens, heads), None), InputSpec((heads,), "float32"), bc, bc, InputSpec((heads,), None), x,
            InputSpec((heads,), None), InputSpec((2 * seqs + 1, heads, head_dim, state), "float32"),
            InputSpec((seqs + 1,), "int32"), InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"))


def _ssd_op(shape: tuple[int, ...]):
    from dualop.ops import SSDChunkScan

    return SSDChunkScan(shape[1], shape[3], shape[4], shape[5], chunk_size=256)


SERVING_INPUTS["ssd_chunk_scan"] = _ssd_inputs
_SERVING_MAKE_OP["ssd_chunk_scan"] = _ssd_op


# --- multi-head latent attention (DeepSeek-V3: kv_lora_rank 512, rope 64, 128 heads) -------------
# ragged_paged_mla_attention: (T, num_seqs, num_pages, page_size, pages_per_seq, H, L, R). A decode
# step of 256 sequences and a mixed step of 2048 tokens over 256 sequences, 16 heads per chip (tp 8
# of DeepSeek-V3's 128) with 64-token pages, and one chip holding all 128 heads with 16-token pages;
# sequences up to 4096 positions. bfloat16 only: the serving dtype (the check shapes build float32).
SERVING_SHAPES["ragged_paged_mla_attention"] = (
    (256, 256, 4096, 64, 64, 16, 512, 64),
    (2048, 256, 4096, 64, 64, 16, 512, 64),
    (256, 256, 16384, 16, 256, 128, 512, 64),
)
SERVING_DTYPES["ragged_paged_mla_attention"] = ("bfloat16",)


def _mla_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, pages, page_size, pages_per_seq, heads, latent, rope = shape
    return (
        InputSpec((tokens, heads, latent + rope), None),
        InputSpec((pages, page_size, latent + rope), None),
        InputSpec((seqs,), "int32"),
        InputSpec((seqs, pages_per_seq), "int32"),
        InputSpec((seqs + 1,), "int32"),
        InputSpec((1,), "int32"),
    )


def _mla_op(shape: tuple[int, ...]):
    from dualop.ops import RaggedPagedMLAAttention

    return RaggedPagedMLAAttention(shape[6])


SERVING_INPUTS["ragged_paged_mla_attention"] = _mla_inputs
_SERVING_MAKE_OP["ragged_paged_mla_attention[mixed]"] = _mla_op

# concat_and_cache_mla: (tokens, rope, kv_lora_rank, num_pages, page_size): a 2048-token step into a
# cache of 4096 pages of 64 tokens (reshape_and_cache's kernels on K/V halves of 288 channels).
SERVING_SHAPES["concat_and_cache_mla"] = ((2048, 64, 512, 4096, 64),)
SERVING_DTYPES["concat_and_cache_mla"] = ("bfloat16",)


def _concat_and_cache_mla_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, rope, latent, pages, page_size = shape
    return (InputSpec((tokens, latent), None), InputSpec((tokens, rope), None),
            InputSpec((pages, page_size, latent + rope), None), InputSpec((tokens,), "int32"))


SERVING_INPUTS["concat_and_cache_mla"] = _concat_and_cache_mla_inputs


_NO_SERVING = Serving(())
_SERVINGS: dict[str, Serving] = {}


def servings() -> dict[str, Serving]:
    """Every op's serving shapes: what its module declares (``serving()``), else the tables above."""
    if not _SERVINGS:
        for op, shapes in SERVING_SHAPES.items():
            _SERVINGS[op] = Serving(
                tuple(shapes), SERVING_INPUTS.get(op),
                _SERVING_MAKE_OP,
                SERVING_DTYPES.get(op), SERVING_CASES.get(op))
        _SERVINGS.update(collect("serving"))
    return _SERVINGS
