"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a paged latent cache: the kernel op
``ragged_paged_mla_attention``, the cache write ``concat_and_cache_mla`` (the reference engine's
name) and the layer ``multi_head_latent_attention``.

MLA caches one latent row per token, ``[kv_c | k_pe]`` (``L = kv_lora_rank`` normed channels, then
``R = qk_rope_head_dim`` roped ones), shared by every head: ``latent_pages [num_pages, page_size,
L + R]``, paged with the ragged metadata of ``ragged_paged_attention`` (``kv_lens``,
``page_indices``, ``cu_q_lens``, ``num_seqs``; a sequence's queries are its last positions).

``RaggedPagedMLAAttention(kv_lora_rank)``: ``out = op(q_latent, latent_pages, kv_lens,
page_indices, cu_q_lens, num_seqs, *, sm_scale=1.0)``, the absorbed form (MQA over the latent):
``q_latent [T, H, L + R]`` is the query with its first ``qk_nope`` channels already multiplied by
W_UK (giving L channels), then its R rope channels; score = ``q_latent . row`` (all L + R channels)
``* sm_scale`` in float32, causal as ``ragged_paged_attention``, softmax in float32, out
``[T, H, L] = probs . row[:L]`` cast once to q's dtype; rows past ``cu_q_lens[num_seqs[0]]`` are
zeros. The cache is in q's dtype, or float8 (float8_e4m3fn, float8_e5m2: the engine's fp8 MLA
cache, ``concat_and_cache_mla``'s codes with one scale) read as ``code * k_scale`` in float32
(``k_scale``: a Python number, the engine's ``layer._k_scale_float``; None is 1.0). Non-finite values as ``ragged_paged_attention``'s: a NaN or inf in sequence i's queries or
cached rows reaches only sequence i's rows; rows past ``kv_len`` never reach any output, on every
path. Paths: Pallas (``kernels/pallas/ragged_paged_mla_attention.py``: heads folded into the
rows of one MXU product, pages streamed from HBM by DMA), Triton
(``kernels/cuda/ragged_paged_mla_attention.py``), torch CPU (``forward_cpu``: float32 GEMMs on each
sequence's gathered rows). Metadata is validated before any kernel where its values are visible
and clamped where not, exactly as ``ragged_paged_attention`` (``ops/attention.py``).

``ConcatAndCacheMLA()``: ``latent_pages = op(kv_c [T, L], k_pe [T, R], latent_pages,
slot_mapping, *, kv_cache_dtype="auto", scale=None)`` writes row ``[kv_c | k_pe]`` of token t
(an fp8 cache: its codes under ``scale``, ``reshape_and_cache``'s rule and arguments with
``k_scale = v_scale = scale``) at slot ``slot_mapping[t]`` (page
``slot // page_size``, offset ``slot % page_size``; negative slots skipped), torch in place, jax
a new array (donate it under jit), like ``reshape_and_cache``, whose kernels it runs: the latent
row is a K/V pair of one head of ``(L + R) / 2`` channels (K = its first half, V = its second), so
the cache viewed as ``[num_pages, page_size, 2, (L + R) / 2]`` is exactly ``reshape_and_cache``'s
layout. A kernel of its own would only save concatenating the step's new rows (``T x (L + R)``,
small next to the cache), so it has none; odd ``L + R`` runs the native body (said why).

``MultiHeadLatentAttention`` (the layer): see its docstring. Its ``positions`` are refused outside
the rope's table (``[0, max_position_embeddings)``) where their values can be read, before any
projection or cache write.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels.kv_cache_math import FP8_KV_FORMATS, fp8_kv_format
from dualop.kernels.paged_attention_math import DEFAULT_MASK_VALUE
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import (
    check_array, check_optional_like, check_positive_int, check_writable_cache, concrete_values,
    decline_if_recording,
)
from dualop.ops.attention import (
    FLOATS, RaggedPagedAttention, _as_cache_dtype, _gatherable, check_metadata_shapes, check_metadata_values,
    paged_batch, row_sequences,
)
from dualop.ops.kv_cache import (
    _CACHE_DTYPES, ReshapeAndCache, _as_array, _bytes, cache_rows, check_kv_scale, inverse_scale_operand, last_writes,
    scales_as_tensors,
)
from dualop.ops.layernorm import RMSNorm
from dualop.ops.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from dualop.ops.rotary import RotaryEmbedding
from dualop.parallel import TensorParallel, current_tensor_parallel, divide
from dualop.platforms import family_of, frontend_of
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["RaggedPagedMLAAttention", "ConcatAndCacheMLA", "MultiHeadLatentAttention", "MLA_WEIGHT_NAMES"]

OP = "ragged_paged_mla_attention"
CACHE_OP = "concat_and_cache_mla"
LAYER_OP = "multi_head_latent_attention"

_PALLAS_MLA = KernelRef("dualop.kernels.pallas.ragged_paged_mla_attention", "ragged_paged_mla_attention")
_TRITON_MLA = KernelRef("dualop.kernels.cuda.ragged_paged_mla_attention", "ragged_paged_mla_attention")
_CPU_MLA = KernelRef("dualop.kernels.cpu.ragged_paged_mla_attention", "ragged_paged_mla_attention")
_PALLAS_CACHE = KernelRef("dualop.kernels.pallas.reshape_and_cache", "reshape_and_cache")
_TRITON_CACHE = KernelRef("dualop.kernels.cuda.reshape_and_cache", "reshape_and_cache")


def _check_sm_scale(op: str, sm_scale: Any) -> None:
    """The softmax scale: a finite number > 0 (NaN, inf or a sign flip would make every score so)."""
    if (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale)
            or sm_scale <= 0):
        raise ValueError(f"{op}: option 'sm_scale' must be a positive, finite float, got {sm_scale!r}")


def _check_k_scale(op: str, k_scale: Any) -> None:
    """An fp8 cache's scale: None (1.0) or a positive, finite Python number (the kernels bake it in)."""
    if k_scale is not None and (isinstance(k_scale, bool) or not isinstance(k_scale, (int, float))
                                or not math.isfinite(k_scale) or k_scale <= 0):
        raise ValueError(f"{op}: option 'k_scale' must be None or a positive, finite float (the engine's "
                         f"layer._k_scale_float), got {k_scale!r}")


def _fp8_cache(pages: Any) -> bool:
    return frontend_of(pages) is not None and fp8_kv_format(pages.dtype) is not None


@CustomOp.register(OP)
class RaggedPagedMLAAttention(CustomOp):
    """Absorbed MLA (MQA over the latent rows) of a ragged batch over a paged latent cache; see the
    module docstring. ``kv_lora_rank`` is L: the output's width and the channels that serve as V.
    JAX arrays on a GPU run the native body (no jax-triton)."""

    def __init__(self, kv_lora_rank: int, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.kv_lora_rank = check_positive_int(OP, "kv_lora_rank", kv_lora_rank)

    def extra_repr(self) -> str:
        return f"kv_lora_rank={self.kv_lora_rank}"

    def check_inputs(self, q_latent: Any = None, latent_pages: Any = None, kv_lens: Any = None,
                     page_indices: Any = None, cu_q_lens: Any = None, num_seqs: Any = None, *,
                     sm_scale: float = 1.0, k_scale: float | None = None) -> None:
        for name, value in dict(q_latent=q_latent, latent_pages=latent_pages, kv_lens=kv_lens,
                                page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs).items():
            if value is None:
                raise TypeError(f"{OP}: argument '{name}' is required")
        fe = check_array(OP, "q_latent", q_latent, min_ndim=3)
        if q_latent.ndim != 3:
            raise ValueError(f"{OP}: argument 'q_latent' must be [num_tokens, num_heads, kv_lora_rank + rope_dim], "
                             f"got shape {tuple(q_latent.shape)}")
        num_tokens, heads, width = q_latent.shape
        if width <= self.kv_lora_rank:
            raise ValueError(f"{OP}: argument 'q_latent' has {width} channels; expected kv_lora_rank "
                             f"({self.kv_lora_rank}) + rope channels (at least one)")
        if heads == 0:
            raise ValueError(f"{OP}: argument 'q_latent' has 0 heads; expected at least 1")
        fp8 = _fp8_cache(latent_pages)
        check_optional_like(OP, "latent_pages", latent_pages, "q_latent", q_latent, fe,
                            shape=tuple(getattr(latent_pages, "shape", ())), same_dtype=not fp8,
                            dtypes=frozenset(FP8_KV_FORMATS) if fp8 else FLOATS)
        if latent_pages.ndim != 3 or latent_pages.shape[2] != width:
            raise ValueError(f"{OP}: argument 'latent_pages' must be [num_pages, page_size, {width}] (q_latent's "
                             f"channels), got shape {tuple(latent_pages.shape)}")
        num_pages, page_size, _ = latent_pages.shape
        if page_size == 0:
            raise ValueError(f"{OP}: argument 'latent_pages' has page_size 0; expected at least 1")
        check_metadata_shapes(OP, q_latent, fe, kv_lens, page_indices, cu_q_lens, num_seqs, q_name="q_latent")
        _check_sm_scale(OP, sm_scale)
        _check_k_scale(OP, k_scale)
        check_metadata_values(OP, num_tokens, num_pages, page_size, kv_lens, page_indices, cu_q_lens, num_seqs)

    def forward_native(self, q_latent: Any, latent_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                       num_seqs: Any, *, sm_scale: float = 1.0, k_scale: float | None = None) -> Any:
        """``ragged_paged_attention``'s reference rule (``row_sequences``: each row gathers its
        sequence's pages, ``T * pages_per_seq * page_size`` rows; a reference, not a serving path)
        with one shared latent head; rows past ``kv_len`` are zeroed (stale data never counts); an
        fp8 row is ``code * k_scale`` in float32."""
        xp = array_namespace(q_latent)
        num_tokens, heads, width = q_latent.shape
        num_pages, page_size, _ = latent_pages.shape
        span = page_indices.shape[1] * page_size
        valid, kv_len, position, pages, _ = row_sequences(xp, q_latent, num_pages, page_size, kv_lens, page_indices,
                                                          cu_q_lens, num_seqs)
        kv_pos = xp.arange(span, q_latent)[None, :]
        cached = kv_pos < kv_len[:, None]  # [T, span]
        rows = _as_cache_dtype(xp.take(_gatherable(latent_pages), pages, axis=0), latent_pages)
        rows = xp.astype(rows.reshape((num_tokens, span, width)), xp.float32)
        rows = xp.where(cached[:, :, None], rows if k_scale is None else rows * k_scale, 0.0)
        scores = xp.einsum("thd,tld->thl", xp.astype(q_latent, xp.float32), rows) * sm_scale
        allowed = (kv_pos <= position[:, None]) & cached
        scores = xp.where(allowed[:, None, :], scores, DEFAULT_MASK_VALUE)
        scores = xp.exp(scores - xp.amax(scores, axis=-1, keepdims=True))
        probs = scores / xp.sum(scores, axis=-1, keepdims=True)
        out = xp.einsum("thl,tlc->thc", probs, rows[:, :, : self.kv_lora_rank])
        out = xp.where(valid[:, None, None], out, 0.0)
        return xp.astype(out, q_latent.dtype)

    def forward_tpu(self, q_latent: Any, latent_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                    num_seqs: Any, *, sm_scale: float = 1.0, k_scale: float | None = None) -> Any:
        k_scale = None if k_scale is None else float(k_scale)
        return call_jax_function(frontend_of(q_latent), _PALLAS_MLA, q_latent, latent_pages, kv_lens, page_indices,
                           cu_q_lens, num_seqs, native=_NativeMLA(self, sm_scale, k_scale),
                           kv_lora_rank=self.kv_lora_rank, sm_scale=float(sm_scale), k_scale=k_scale)

    def forward_cuda(self, q_latent: Any, latent_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                     num_seqs: Any, *, sm_scale: float = 1.0, k_scale: float | None = None) -> Any:
        return call_triton(frontend_of(q_latent), _TRITON_MLA, q_latent, latent_pages, kv_lens, page_indices,
                           cu_q_lens, num_seqs, kv_lora_rank=self.kv_lora_rank, sm_scale=float(sm_scale),
                           k_scale=None if k_scale is None else float(k_scale))

    def forward_cpu(self, q_latent: Any, latent_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                    num_seqs: Any, *, sm_scale: float = 1.0, k_scale: float | None = None) -> Any:
        """torch on the CPU: float32 GEMMs (oneDNN/MKL) per sequence on its gathered latent rows,
        decodes batched (``kernels/cpu/ragged_paged_mla_attention.py``). Every head reads the same
        row, so the work is GEMM-shaped (2H flops per cached element) and a BLAS GEMM beats a row
        loop; docs/BENCHMARKS.md has the measurement. Declines while autograd records."""
        decline_if_recording(OP, q_latent, latent_pages)
        return _CPU_MLA(q_latent, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                        kv_lora_rank=self.kv_lora_rank, sm_scale=float(sm_scale),
                        k_scale=None if k_scale is None else float(k_scale))


class _NativeMLA:
    """``forward_native`` with ``sm_scale`` and ``k_scale`` bound: the backward pass of the Pallas path."""

    def __init__(self, op: RaggedPagedMLAAttention, sm_scale: float, k_scale: float | None) -> None:
        self.op, self.sm_scale, self.k_scale = op, sm_scale, k_scale

    def __call__(self, *arrays: Any) -> Any:
        return self.op.forward_native(*arrays, sm_scale=self.sm_scale, k_scale=self.k_scale)


# --- the cache write ------------------------------------------------------------------------------


def _as_kv_pair(xp: Any, kv_c: Any, k_pe: Any, latent_pages: Any) -> tuple[Any, Any, Any]:
    """The latent rows and cache in ``reshape_and_cache``'s layout: key = first half of each row,
    value = second half (``[T, 1, W]``), cache ``[num_pages, page_size, 2, W]``, W = (L + R) / 2."""
    row = xp.concat([kv_c, xp.astype(k_pe, kv_c.dtype)], axis=-1)
    half = row.shape[-1] // 2
    key = row[:, None, :half]
    value = row[:, None, half:]
    num_pages, page_size, width = latent_pages.shape
    return key, value, xp.reshape(latent_pages, (num_pages, page_size, 2, half))


@CustomOp.register(CACHE_OP)
class ConcatAndCacheMLA(CustomOp):
    """Write ``[kv_c | k_pe]`` rows into the paged latent cache (see the module docstring)."""

    mutates_args: ClassVar[tuple[str, ...]] = ("latent_pages",)

    def __init__(self, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self._kv_write = ReshapeAndCache(enforce_enable=enforce_enable)

    def check_inputs(self, kv_c: Any, k_pe: Any = None, latent_pages: Any = None, slot_mapping: Any = None, *,
                     kv_cache_dtype: str = "auto", scale: Any = None) -> None:
        op = CACHE_OP
        fe = check_array(op, "kv_c", kv_c, min_ndim=2)
        if kv_c.ndim != 2:
            raise ValueError(f"{op}: argument 'kv_c' must be [tokens, kv_lora_rank], got shape {tuple(kv_c.shape)}")
        tokens, latent = kv_c.shape
        if k_pe is None:
            raise ValueError(f"{op}: argument 'k_pe' is required ([{tokens}, rope_dim])")
        check_optional_like(op, "k_pe", k_pe, "kv_c", kv_c, fe, shape=tuple(getattr(k_pe, "shape", ())),
                            same_dtype=True)
        if k_pe.ndim != 2 or k_pe.shape[0] != tokens:
            raise ValueError(f"{op}: argument 'k_pe' must be [{tokens}, rope_dim] (one row per token of 'kv_c'), "
                             f"got shape {tuple(k_pe.shape)}")
        if latent_pages is None:
            raise ValueError(f"{op}: argument 'latent_pages' is required")
        check_array(op, "latent_pages", latent_pages, min_ndim=3, dtypes=_CACHE_DTYPES)
        width = latent + k_pe.shape[1]
        if latent_pages.ndim != 3 or latent_pages.shape[2] != width:
            raise ValueError(f"{op}: argument 'latent_pages' must be [num_pages, page_size, {width}] "
                             f"(kv_lora_rank + rope_dim), got shape {tuple(latent_pages.shape)}")
        wanted = ReshapeAndCache._cache_dtype(op, kv_cache_dtype, latent_pages, "latent_pages")
        check_optional_like(op, "latent_pages", latent_pages, "kv_c", kv_c, fe, shape=tuple(latent_pages.shape),
                            same_dtype=wanted is None, dtypes=_CACHE_DTYPES)
        check_kv_scale(op, "scale", scale, "kv_c", kv_c, fe)
        check_writable_cache(op, "latent_pages", latent_pages)
        num_pages, page_size, _ = latent_pages.shape
        ReshapeAndCache._check_slot_mapping(op, slot_mapping, kv_c, fe, tokens, num_pages * page_size)

    def library_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The schema types the scale as a tensor (a Python number: one float32 element on kv_c's device)."""
        return args, scales_as_tensors(kwargs, args[0] if args else kwargs.get("kv_c"), ("scale",))

    def forward_native(self, kv_c: Any, k_pe: Any, latent_pages: Any, slot_mapping: Any, *,
                       kv_cache_dtype: str = "auto", scale: Any = None) -> Any:
        xp = array_namespace(latent_pages)
        slot_mapping = last_writes(slot_mapping)  # two tokens with one slot: the last wins (reshape_and_cache's rule)
        num_pages, page_size, _ = latent_pages.shape
        kv_c, k_pe = cache_rows(xp, kv_c, k_pe, latent_pages, scale, scale)  # an fp8 cache's codes
        row = xp.concat([_bytes(kv_c), _bytes(k_pe)], axis=-1)
        keep = (slot_mapping >= 0) & (slot_mapping < num_pages * page_size)
        index = (slot_mapping // page_size, slot_mapping % page_size)
        written = xp.set_at_dropping(_bytes(latent_pages), index, row, keep)
        return latent_pages if frontend_of(latent_pages) == "torch" else written

    @staticmethod
    def _pair(kv_c: Any, k_pe: Any, latent_pages: Any) -> tuple[Any, Any, Any]:
        if latent_pages.shape[2] % 2:
            raise NotImplementedError(f"{CACHE_OP}: reshape_and_cache's kernels take the latent row as two halves; "
                                      f"kv_lora_rank + rope_dim = {latent_pages.shape[2]} is odd")
        return _as_kv_pair(array_namespace(kv_c), kv_c, k_pe, latent_pages)

    def forward_cpu(self, kv_c: Any, k_pe: Any, latent_pages: Any, slot_mapping: Any, *,
                    kv_cache_dtype: str = "auto", scale: Any = None) -> Any:
        """torch on the CPU: ``reshape_and_cache``'s ``index_copy_`` on the cache viewed as K/V pairs."""
        if not latent_pages.is_contiguous():
            raise NotImplementedError(f"{CACHE_OP}: the CPU path views the cache flat and needs it contiguous")
        key, value, view = self._pair(kv_c, k_pe, latent_pages)
        self._kv_write.forward_cpu(key, value, view, slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=scale,
                                   v_scale=scale)
        return latent_pages

    @staticmethod
    def _inverses(xp: Any, latent_pages: Any, scale: Any, like: Any) -> dict[str, Any]:
        """An fp8 cache's inverse scale as ``reshape_and_cache``'s kernels take it (both halves one scale)."""
        if fp8_kv_format(latent_pages.dtype) is None:
            return {}
        inverse = _as_array(xp, inverse_scale_operand(xp, scale), like)
        return dict(k_inverse=inverse, v_inverse=inverse)

    def forward_cuda(self, kv_c: Any, k_pe: Any, latent_pages: Any, slot_mapping: Any, *,
                     kv_cache_dtype: str = "auto", scale: Any = None) -> Any:
        """``reshape_and_cache``'s Triton kernel on the cache viewed as K/V pairs (in place)."""
        fe = frontend_of(kv_c)
        if fe == "torch" and not latent_pages.is_contiguous():
            raise NotImplementedError(f"{CACHE_OP}: the Triton path views the cache as K/V pairs and needs it "
                                      "contiguous")
        key, value, view = self._pair(kv_c, k_pe, latent_pages)
        inverses = self._inverses(array_namespace(kv_c), latent_pages, scale, kv_c) if fe == "torch" else {}
        call_triton(fe, _TRITON_CACHE, key, value, view, last_writes(slot_mapping), **inverses)
        return latent_pages

    def forward_tpu(self, kv_c: Any, k_pe: Any, latent_pages: Any, slot_mapping: Any, *,
                    kv_cache_dtype: str = "auto", scale: Any = None) -> Any:
        """``reshape_and_cache``'s Pallas kernel (per-token DMAs into the aliased HBM cache); torch
        frontends get the result written back into ``latent_pages`` (``copy_``)."""
        fe = frontend_of(kv_c)
        key, value, view = self._pair(kv_c, k_pe, latent_pages)
        inverses = self._inverses(array_namespace(kv_c), latent_pages, scale, kv_c).values()
        new = call_jax_function(fe, _PALLAS_CACHE, key, value, view, last_writes(slot_mapping),
                                *inverses).reshape(latent_pages.shape)
        if family_of(fe) == "torch":
            latent_pages.copy_(new)
            return latent_pages
        return new


# --- the layer --------------------------------------------------------------------------------------

# The Hugging Face DeepSeek-V3 names of one layer's ``self_attn`` weights (torch Linear layout
# [out, in]; the norms' weights [dim]); ``q_a_*`` / ``q_b_proj`` with a q_lora_rank, else ``q_proj``.
MLA_WEIGHT_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                    "kv_b_proj", "o_proj")
MODES = ("auto", "absorbed", "expanded")


def _positive(name: str, value: Any) -> int:
    return check_positive_int(LAYER_OP, name, value)


@CustomOp.register(LAYER_OP)
class MultiHeadLatentAttention(CustomOp):
    """DeepSeek-V2/V3 multi-head latent attention over a paged latent cache, one tensor-parallel rank.

    ``MultiHeadLatentAttention(hidden_size, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim, q_lora_rank, kv_lora_rank, rope, eps=1e-6, tp=None)``; ``out, latent_pages =
    op(positions, hidden_states, weights, latent_pages, slot_mapping, kv_lens, page_indices,
    cu_q_lens, num_seqs, *, mode="auto", kv_cache_dtype="auto", k_scale=None)``.

    - ``positions`` int ``[T]``, ``hidden_states`` ``[T, hidden_size]``; ``latent_pages``
      ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` in hidden_states' dtype, or an
      fp8 cache (``kv_cache_dtype`` "fp8" / "fp8_e4m3" / "fp8_e5m2", the engine's fp8 MLA cache):
      codes under one Python-number ``k_scale`` (None is 1.0), written by ``concat_and_cache_mla``
      and read as ``code * k_scale`` by the attention (the expanded form dequantises the rows it
      gathers to hidden_states' dtype before ``kv_b_proj``, as the engine's prefill does);
      ``slot_mapping`` ``[T]`` (this step's tokens' cache slots, -1 skips); the ragged metadata of
      ``ragged_paged_attention`` describing the batch after this step's tokens are cached
      (``kv_lens`` include them). ``scale`` is the softmax scale (DeepSeek's with YaRN:
      ``qk_head_dim ** -0.5 * mscale(factor, mscale_all_dim) ** 2``); ``rope`` a ``RotaryEmbedding``
      of head size and rotary dim ``qk_rope_head_dim`` (``get_rope(..., rope_type 'deepseek_yarn',
      is_neox_style=False)`` for DeepSeek, whose rope pairs are interleaved).
    - ``weights``: a dict with transformers' ``DeepseekV3Attention`` names (``MLA_WEIGHT_NAMES``):
      ``q_a_proj`` ``[q_lora_rank, hidden]``, ``q_a_layernorm`` ``[q_lora_rank]``, ``q_b_proj``
      ``[H/tp * (nope + rope), q_lora_rank]`` (or ``q_proj`` ``[H/tp * (nope + rope), hidden]``
      when ``q_lora_rank`` is None), ``kv_a_proj_with_mqa`` ``[L + R, hidden]``, ``kv_a_layernorm``
      ``[L]``, ``kv_b_proj`` ``[H/tp * (nope + v), L]``, ``o_proj`` ``[hidden, H/tp * v]``; at tp > 1
      this rank's shard (q_b_proj / q_proj / kv_b_proj rows of its heads, o_proj columns of its
      heads, the rest whole), in hidden_states' dtype.
    - Steps: q = q_b_proj(rms_norm(q_a_proj(x))) (or q_proj(x)), split per head into q_nope and
      q_pe; kv_c, k_pe = kv_a_proj_with_mqa(x); kv_c = rms_norm(kv_c); rope on q_pe and k_pe;
      ``concat_and_cache_mla``; attention; ``o_proj`` (row-parallel: all-reduced over ``tp``).
    - ``mode``: ``"absorbed"``: q_nope . W_UK -> q_latent, ``ragged_paged_mla_attention``, then
      . W_UV per head (reads L + R per cached token: decode's form). ``"expanded"``: the batch's
      cached latent rows (its sequences' pages) go through kv_b_proj into per-head K = [k_nope |
      k_pe] and V, then ``ragged_paged_attention`` on them (prefill's form: the GEMMs run once per
      token, not per query row). ``"auto"``: expanded when every sequence is prefill-only (q_len ==
      kv_len, values read where visible), else absorbed (also under ``jax.jit`` and on lazy
      devices, where the metadata cannot be read: absorbed is right for every batch).

    Math as the ops it calls: projections rounded once to x's dtype (the linear ops), norms, rope,
    softmax in float32; the absorption products in float32, rounded once. The native body runs
    every step's ``forward_native`` (frontend-neutral, traceable under ``jax.jit``); the platform
    methods call each op, which dispatches to its own kernel.
    """

    mutates_args: ClassVar[tuple[str, ...]] = ("latent_pages",)
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "latent_pages")

    def __init__(self, hidden_size: int, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, q_lora_rank: int | None, kv_lora_rank: int, rope: RotaryEmbedding,
                 eps: float = 1e-6, tp: TensorParallel | None = None, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = _positive("hidden_size", hidden_size)
        self.num_heads = _positive("num_heads", num_heads)
        self.qk_nope_head_dim = _positive("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = _positive("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = _positive("v_head_dim", v_head_dim)
        self.q_lora_rank = None if q_lora_rank is None else _positive("q_lora_rank", q_lora_rank)
        self.kv_lora_rank = _positive("kv_lora_rank", kv_lora_rank)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"{LAYER_OP}: argument 'scale' must be a positive float, got {scale!r}")
        self.scale = float(scale)
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"{LAYER_OP}: argument 'rope' must be a dualop RotaryEmbedding (e.g. from get_rope), "
                            f"got {type(rope).__qualname__}")
        if rope.head_size != qk_rope_head_dim or rope.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"{LAYER_OP}: argument 'rope' has head_size {rope.head_size} and rotary_dim "
                             f"{rope.rotary_dim}; expected both qk_rope_head_dim = {qk_rope_head_dim}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 or not math.isfinite(eps):
            raise ValueError(f"{LAYER_OP}: argument 'eps' must be a positive, finite float, got {eps!r}")
        if tp is not None and not isinstance(tp, TensorParallel):
            raise TypeError(f"{LAYER_OP}: argument 'tp' must be a dualop.parallel.TensorParallel or None, "
                            f"got {type(tp).__qualname__}")
        self.tp = tp or current_tensor_parallel()
        self.eps = float(eps)
        self.rope = rope
        self.local_heads = divide(self.num_heads, self.tp.size, op=LAYER_OP, what="argument 'num_heads'")
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        one = TensorParallel()
        kw = dict(bias=False, return_bias=False, enforce_enable=enforce_enable)
        heads = self.num_heads
        if self.q_lora_rank is not None:
            self.q_a_proj = ReplicatedLinear(hidden_size, self.q_lora_rank, tp=one, **kw)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=self.eps, enforce_enable=enforce_enable)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * self.qk_head_dim, tp=self.tp, **kw)
        else:
            self.q_proj = ColumnParallelLinear(hidden_size, heads * self.qk_head_dim, tp=self.tp, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, tp=one,
                                                   **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=self.eps, enforce_enable=enforce_enable)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim),
                                              tp=self.tp, **kw)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden_size, input_is_parallel=True,
                                        reduce_results=True, tp=self.tp, **kw)
        self.cache_write = ConcatAndCacheMLA(enforce_enable=enforce_enable)
        self.mla = RaggedPagedMLAAttention(self.kv_lora_rank, enforce_enable=enforce_enable)
        self.rpa = RaggedPagedAttention(enforce_enable=enforce_enable)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}, tp_size={self.tp.size}")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape each entry of ``weights`` must have on this rank."""
        h, hidden, lat = self.local_heads, self.hidden_size, self.kv_lora_rank
        shapes = {"kv_a_proj_with_mqa": (lat + self.qk_rope_head_dim, hidden), "kv_a_layernorm": (lat,),
                  "kv_b_proj": (h * (self.qk_nope_head_dim + self.v_head_dim), lat),
                  "o_proj": (hidden, h * self.v_head_dim)}
        if self.q_lora_rank is None:
            shapes["q_proj"] = (h * self.qk_head_dim, hidden)
        else:
            shapes.update(q_a_proj=(self.q_lora_rank, hidden), q_a_layernorm=(self.q_lora_rank,),
                          q_b_proj=(h * self.qk_head_dim, self.q_lora_rank))
        return shapes

    # -- validation -------------------------------------------------------------------------------

    def check_inputs(self, positions: Any = None, hidden_states: Any = None, weights: Any = None,
                     latent_pages: Any = None, slot_mapping: Any = None, kv_lens: Any = None, page_indices: Any = None,
                     cu_q_lens: Any = None, num_seqs: Any = None, *, mode: str = "auto",
                     kv_cache_dtype: str = "auto", k_scale: float | None = None) -> None:
        op = LAYER_OP
        for name, value in dict(positions=positions, hidden_states=hidden_states, weights=weights,
                                latent_pages=latent_pages, slot_mapping=slot_mapping, kv_lens=kv_lens,
                                page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs).items():
            if value is None:
                engine = ("; the engine's call mla(positions, hidden_states) finds the weights in its module and the "
                          "cache and batch metadata in its forward context, which are arguments here" if
                          name == "weights" else "")
                raise TypeError(f"{op}: argument '{name}' is required{engine}")
        if mode not in MODES:
            raise ValueError(f"{op}: option 'mode' must be one of {MODES}, got {mode!r}")
        fe = check_array(op, "hidden_states", hidden_states, min_ndim=2)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{op}: argument 'hidden_states' must be [tokens, {self.hidden_size}], got shape "
                             f"{tuple(hidden_states.shape)}")
        tokens = hidden_states.shape[0]
        check_optional_like(op, "positions", positions, "hidden_states", hidden_states, fe, shape=(tokens,),
                            dtypes=frozenset({"int32", "int64"}))
        self._check_positions(positions)
        if not isinstance(weights, dict):
            raise TypeError(f"{op}: argument 'weights' must be a dict of arrays named as transformers' "
                            f"DeepseekV3Attention ({', '.join(MLA_WEIGHT_NAMES)}), got {type(weights).__qualname__}")
        shapes = self.weight_shapes()
        missing = [k for k in shapes if k not in weights]
        extra = [k for k in weights if k not in shapes]
        if missing or extra:
            raise ValueError(f"{op}: argument 'weights' has keys {sorted(weights)}; expected exactly {sorted(shapes)}"
                             f" (missing {missing}, unexpected {extra}; q_lora_rank={self.q_lora_rank})")
        for key, shape in shapes.items():
            check_optional_like(op, f"weights['{key}']", weights[key], "hidden_states", hidden_states, fe,
                                shape=shape, same_dtype=True)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        check_array(op, "latent_pages", latent_pages, min_ndim=3, dtypes=_CACHE_DTYPES)
        fp8 = ReshapeAndCache._cache_dtype(op, kv_cache_dtype, latent_pages, "latent_pages") is not None
        check_optional_like(op, "latent_pages", latent_pages, "hidden_states", hidden_states, fe,
                            shape=tuple(latent_pages.shape), same_dtype=not fp8, dtypes=_CACHE_DTYPES)
        _check_k_scale(op, k_scale)
        if latent_pages.ndim != 3 or latent_pages.shape[2] != width or latent_pages.shape[1] == 0:
            raise ValueError(f"{op}: argument 'latent_pages' must be [num_pages, page_size, {width}] (kv_lora_rank + "
                             f"qk_rope_head_dim), got shape {tuple(latent_pages.shape)}")
        num_pages, page_size, _ = latent_pages.shape
        ReshapeAndCache._check_slot_mapping(op, slot_mapping, hidden_states, fe, tokens, num_pages * page_size)
        check_metadata_shapes(op, hidden_states, fe, kv_lens, page_indices, cu_q_lens, num_seqs,
                              q_name="hidden_states")
        check_metadata_values(op, tokens, num_pages, page_size, kv_lens, page_indices, cu_q_lens, num_seqs)

    def _check_positions(self, positions: Any) -> None:
        """Positions in the rope's table, where their values can be read: the native body gathers
        them clamped (a position out of range would rotate by the table's last row, silently) and
        the platform paths would refuse them only in the rope op, after the projections."""
        from dualop.ops._checks import checked_before, remember_checked

        limit = self.rope.cache_positions
        if checked_before("positions", (positions,), (limit,)):
            return  # the same positions, checked by the previous layer
        values = concrete_values(positions)
        if values is None or not values.size:
            return
        lo, hi = int(values.min()), int(values.max())
        if lo < 0 or hi >= limit:
            raise ValueError(f"{LAYER_OP}: argument 'positions' holds values in [{lo}, {hi}]; expected 0 <= position "
                             f"< {limit} (the rope's max_position_embeddings)")
        remember_checked("positions", (positions,), (limit,))

    # -- the computation --------------------------------------------------------------------------

    def forward_native(self, positions: Any, hidden_states: Any, weights: Any, latent_pages: Any, slot_mapping: Any,
                       kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any, *,
                       mode: str = "auto", kv_cache_dtype: str = "auto",
                       k_scale: float | None = None) -> tuple[Any, Any]:
        return self._forward(True, positions, hidden_states, weights, latent_pages, slot_mapping, kv_lens,
                             page_indices, cu_q_lens, num_seqs, mode, kv_cache_dtype, k_scale)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """torch on the CPU: each step's op on its CPU path (``F.linear``, the C++ norm and rope
        kernels, the cache write, the MLA or paged attention CPU path)."""
        return self._forward(False, *args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """torch on a GPU: cuBLAS GEMMs and each op's Triton kernel."""
        return self._forward(False, *args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """On a TPU (jax, torch_xla, torchax): XLA's dot and each op's Pallas kernel."""
        return self._forward(False, *args, **kwargs)

    def _forward(self, native: bool, positions: Any, hidden_states: Any, weights: Any, latent_pages: Any,
                 slot_mapping: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
                 mode: str = "auto", kv_cache_dtype: str = "auto", k_scale: float | None = None) -> tuple[Any, Any]:
        def call(op):
            return op.forward_native if native else op

        xp = array_namespace(hidden_states)
        w, x = weights, hidden_states
        tokens, heads = x.shape[0], self.local_heads
        nope, rope_dim, lat = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is not None:
            q = call(self.q_a_proj)(x, w["q_a_proj"])
            q = call(self.q_a_layernorm)(q, w["q_a_layernorm"])
            q = call(self.q_b_proj)(q, w["q_b_proj"])
        else:
            q = call(self.q_proj)(x, w["q_proj"])
        q = xp.reshape(q, (tokens, heads, self.qk_head_dim))
        q_nope, q_pe = q[:, :, :nope], q[:, :, nope:]
        kv = call(self.kv_a_proj_with_mqa)(x, w["kv_a_proj_with_mqa"])
        kv_c = call(self.kv_a_layernorm)(kv[:, :lat], w["kv_a_layernorm"])
        q_pe, k_pe = call(self.rope)(positions, q_pe, xp.reshape(kv[:, lat:], (tokens, 1, rope_dim)))
        # an fp8 cache's one scale (None: a cache in hidden_states' dtype)
        cache_scale = None if kv_cache_dtype == "auto" else 1.0 if k_scale is None else float(k_scale)
        fp8 = {} if cache_scale is None else {"kv_cache_dtype": kv_cache_dtype, "scale": cache_scale}
        latent_pages = call(self.cache_write)(kv_c, xp.reshape(k_pe, (tokens, rope_dim)), latent_pages, slot_mapping,
                                              **fp8)
        if mode == "expanded" or (mode == "auto" and _prefill_only(kv_lens, cu_q_lens, num_seqs)):
            attn = self._expanded(call, xp, w, q_nope, q_pe, latent_pages, kv_lens, page_indices, cu_q_lens,
                                  num_seqs, cache_scale)
        else:
            attn = self._absorbed(call, native, xp, w, q_nope, q_pe, latent_pages, kv_lens, page_indices,
                                  cu_q_lens, num_seqs, cache_scale)
        out = call(self.o_proj)(xp.reshape(attn, (tokens, heads * self.v_head_dim)), w["o_proj"])
        return out, latent_pages

    def _kv_b(self, xp: Any, w: Any) -> tuple[Any, Any]:
        """W_UK ``[H, nope, L]`` and W_UV ``[H, v, L]`` of this rank's heads (views of kv_b_proj)."""
        kv_b = xp.reshape(w["kv_b_proj"], (self.local_heads, self.qk_nope_head_dim + self.v_head_dim,
                                           self.kv_lora_rank))
        return kv_b[:, : self.qk_nope_head_dim], kv_b[:, self.qk_nope_head_dim:]

    def _absorbed(self, call, native: bool, xp: Any, w: Any, q_nope: Any, q_pe: Any, latent_pages: Any, kv_lens: Any,
                  page_indices: Any, cu_q_lens: Any, num_seqs: Any, cache_scale: float | None) -> Any:
        w_uk, w_uv = self._kv_b(xp, w)
        q_latent = _product(xp, native, "thn,hnl->thl", q_nope, w_uk)
        q_latent = xp.concat([q_latent, q_pe], axis=-1)
        o_latent = call(self.mla)(q_latent, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=self.scale, **({} if cache_scale is None else {"k_scale": cache_scale}))
        return _product(xp, native, "thl,hvl->thv", o_latent, w_uv)

    def _expanded(self, call, xp: Any, w: Any, q_nope: Any, q_pe: Any, latent_pages: Any, kv_lens: Any,
                  page_indices: Any, cu_q_lens: Any, num_seqs: Any, cache_scale: float | None) -> Any:
        """K and V of every position of the batch's pages (kv_b_proj once per cached row), laid out
        as a paged K/V cache of their own (one page per page-table entry, the table renumbered),
        then ``ragged_paged_attention`` with q = [q_nope | q_pe]; V zero-padded to K's width. An fp8
        cache's gathered rows are dequantised (``code * k_scale`` in float32, rounded once to q's
        dtype) first."""
        heads, nope, rope_dim, v_dim = self.local_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        num_pages, page_size, _ = latent_pages.shape
        max_seqs, pages_per_seq = page_indices.shape
        n = max_seqs * pages_per_seq
        table = xp.clip(xp.reshape(page_indices, (n,)), 0, num_pages - 1)
        rows = xp.reshape(xp.take(latent_pages, table, axis=0), (n * page_size, self.kv_lora_rank + rope_dim))
        if cache_scale is not None:
            rows = xp.astype(xp.astype(rows, xp.float32) * cache_scale, q_nope.dtype)
        kv = xp.reshape(call(self.kv_b_proj)(rows[:, : self.kv_lora_rank], w["kv_b_proj"]),
                        (n * page_size, heads, nope + v_dim))
        width = max(nope + rope_dim, v_dim)
        zeros = xp.zeros((n * page_size, heads, width), kv)
        k_pe = xp.reshape(rows[:, self.kv_lora_rank:], (n * page_size, 1, rope_dim))
        k = xp.concat([kv[:, :, :nope], zeros[:, :, :rope_dim] + k_pe, zeros[:, :, : width - nope - rope_dim]], -1)
        v = xp.concat([kv[:, :, nope:], zeros[:, :, : width - v_dim]], axis=-1)
        kv_pages = xp.reshape(xp.stack([k, v], axis=2), (n, page_size, 2 * heads, width))
        own_table = xp.astype(xp.reshape(xp.arange(n, page_indices), (max_seqs, pages_per_seq)), page_indices.dtype)
        q = xp.concat([q_nope, q_pe, xp.zeros((q_nope.shape[0], heads, width - nope - rope_dim), q_nope)], axis=-1)
        out = call(self.rpa)(q, kv_pages, kv_lens, own_table, cu_q_lens, num_seqs, sm_scale=self.scale)
        return out[:, :, :v_dim]


def _product(xp: Any, native: bool, subscripts: str, a: Any, b: Any) -> Any:
    """A per-head product (W_UK absorption, W_UV expansion) summed in float32, cast once to a's
    dtype: float32 operands in the native body; on the platform paths the operands' own dtype with
    float32 accumulation (XLA's ``preferred_element_type``; torch's matmul accumulates in float32).
    XLA:CPU (a TPU path interpreted on a CPU host) has no 16-bit x 16-bit -> float32 dot ("Unsupported
    element type for DotThunk"), so there the operands are upcast first, as ``kernels/xla/linear``
    does: products of 16-bit values are exact in float32, so the sums are the same ones."""
    if native or xp.name == "torch":
        return xp.astype(xp.einsum(subscripts, xp.astype(a, xp.float32), xp.astype(b, xp.float32)), a.dtype)
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "cpu":
        return jnp.einsum(subscripts, a.astype(jnp.float32), b.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST).astype(a.dtype)
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _prefill_only(kv_lens: Any, cu_q_lens: Any, num_seqs: Any) -> bool:
    """Whether every sequence of the batch is prefill-only (q_len == kv_len), where the metadata's
    values can be read without a trace or a device sync of a lazy graph; False otherwise."""
    values = [concrete_values(a) for a in (kv_lens, cu_q_lens, num_seqs)]
    if any(v is None for v in values):
        return False
    lens, cu, count = values
    n = int(count[0])
    q_lens = cu[1: n + 1].astype("int64") - cu[:n].astype("int64")
    return n > 0 and bool((q_lens == lens[:n]).all())


# --- check cases ---------------------------------------------------------------------------------

# (q_len, kv_len) per sequence: decode, prefill, a later chunk of a prompt, an empty sequence, decode.
_MIXED = ((1, 9), (3, 3), (4, 21), (0, 6), (1, 40))


def mla_batch(rng, q_lens, kv_lens, *, num_tokens: int, heads: int, latent: int, rope_dim: int, page_size: int,
              max_seqs: int | None = None):
    """A ragged MLA batch as numpy (float32 q_latent and latent pages, int32 metadata): the pages of
    ``paged_batch`` (random order, spare and padding entries) with one latent head of L + R."""
    q, pages, *meta = paged_batch(rng, q_lens, kv_lens, num_tokens=num_tokens, num_q_heads=heads, num_kv_heads=1,
                                  head_dim=latent + rope_dim, page_size=page_size, max_seqs=max_seqs)
    return (q, pages[:, :, 0], *meta)


def check_cases():
    """Small mixed batches for every cell (interpreters included): ``shape`` is q_latent's
    ``(T, H, L + R)`` with R = 8 (L = D - 8); pages of 16 tokens (the sublane tile of 16-bit caches);
    padding rows and a padding sequence. The cache write: ``(T, R, L)`` (tokens, rope dim,
    kv_lora_rank; a cache of ``2T + 3`` slots in pages of 4, a fifth of the slots -1)."""
    import numpy as np

    from dualop.testing import OpCase, Pinned, normal

    rope_dim = 8

    def attention_inputs(shape, rng):
        tokens, heads, width = shape
        q_lens, kv_lens, used = [], [], 0
        for q_len, kv_len in _MIXED:
            if used + q_len > tokens:
                break
            q_lens.append(q_len)
            kv_lens.append(kv_len)
            used += q_len
        q, pages, *meta = mla_batch(rng, q_lens, kv_lens, num_tokens=tokens, heads=heads, latent=width - rope_dim,
                                    rope_dim=rope_dim, page_size=16, max_seqs=len(q_lens) + 1)
        return (q * 0.5, pages, *(Pinned(a, "int32") for a in meta))

    def attention_op(shape):
        return RaggedPagedMLAAttention(shape[2] - rope_dim)

    def cache_inputs(shape, rng):
        tokens, rope, latent = shape
        page_size = 4
        num_pages = -(-(2 * tokens + 3) // page_size)
        slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
        slots[rng.random(tokens) < 0.2] = -1
        return (normal((tokens, latent), rng), normal((tokens, rope), rng),
                normal((num_pages, page_size, latent + rope), rng), Pinned(slots, "int32"))

    def fp8_attention_inputs(shape, rng):
        """The same batch over a float8_e4m3fn cache of codes about 20 in magnitude."""
        q, pages, *meta = attention_inputs(shape, rng)
        return (q, Pinned(pages * 20.0, "float8_e4m3fn"), *meta)

    def fp8_cache_inputs(shape, rng):
        kv_c, k_pe, pages, slots = cache_inputs(shape, rng)
        return (kv_c, k_pe, Pinned(pages * 20.0, "float8_e4m3fn"), slots)

    attention_shapes = ((0, 4, 40), (1, 1, 40), (9, 4, 72), (12, 16, 136))
    cache_shapes = ((0, 8, 32), (1, 1, 31), (7, 16, 64), (5, 8, 24))
    return [
        OpCase(OP, f"{OP}[mixed]", attention_op, attention_inputs, attention_shapes, options={"sm_scale": 0.2}),
        OpCase(OP, f"{OP}[float8_e4m3fn,k_scale]", attention_op, fp8_attention_inputs, attention_shapes,
               options={"sm_scale": 0.2, "k_scale": 0.043}),  # a scale off the powers of two
        OpCase(CACHE_OP, CACHE_OP, lambda s: ConcatAndCacheMLA(), cache_inputs, cache_shapes),
        OpCase(CACHE_OP, f"{CACHE_OP}[fp8]", lambda s: ConcatAndCacheMLA(), fp8_cache_inputs, cache_shapes,
               options={"kv_cache_dtype": "fp8", "scale": 0.0371}),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- multi-head latent attention: absorbed decode over a paged latent cache ------------------------
# Shape (num_seqs, kv_len, L + R): one query row per sequence (decode), every sequence kv_len tokens
# long, DeepSeek-V3's latent (L = 512, R = 64) and 16 heads (128 over tp 8), pages of 16 tokens in
# random order. A bench size (R, C) maps to R // 128 sequences of C // 4 tokens (small: 32 x 1024).
_MLA_HEADS, _MLA_LATENT, _MLA_ROPE, _MLA_PAGE = 16, 512, 64, 16


def _mla_decode_shape(size: tuple[int, ...]) -> tuple[int, int, int]:
    rows, cols = size[0], size[-1]
    return (max(1, rows // 128), max(_MLA_PAGE, cols // 4 // _MLA_PAGE * _MLA_PAGE), _MLA_LATENT + _MLA_ROPE)


def _mla_op(width: int):
    from dualop.ops import RaggedPagedMLAAttention

    return RaggedPagedMLAAttention(_MLA_LATENT)


def _mla_decode_inputs(shape, rng):
    from dualop.ops.mla import mla_batch
    from dualop.testing import Pinned

    num_seqs, kv_len, width = shape
    q, pages, *meta = mla_batch(rng, [1] * num_seqs, [kv_len] * num_seqs, num_tokens=num_seqs, heads=_MLA_HEADS,
                                latent=_MLA_LATENT, rope_dim=width - _MLA_LATENT, page_size=_MLA_PAGE)
    # the op's default sm_scale is 1: scale q instead (DeepSeek's is (128 + 64) ** -0.5 times mscale squared)
    return (q * np.float32(width ** -0.5), pages, *(Pinned(a, "int32") for a in meta))


def _mla_decode_cost(op, shape, itemsize) -> KernelCost:
    num_seqs, kv_len, width = shape
    return cost_model.ragged_paged_mla_attention_cost(num_seqs, num_seqs * kv_len, num_seqs * kv_len, _MLA_HEADS,
                                                      _MLA_LATENT, width - _MLA_LATENT, itemsize)


def _torch_mla_sdpa(op):
    """What a torch user writes: gather each sequence's pages, then SDPA with one KV head (K = the
    whole latent row, V = its first L channels; ``enable_gqa``), a length mask and scale 1, in
    float32 (SDPA's bfloat16 CPU kernel rounds the probabilities), one cast back."""
    import torch
    import torch.nn.functional as F

    def decode(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        seqs, pages_per_seq = page_indices.shape
        _, page_size, width = pages.shape
        rows = pages[page_indices].reshape(seqs, 1, pages_per_seq * page_size, width).float()
        mask = torch.arange(pages_per_seq * page_size) < kv_lens[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None].float(), rows, rows[..., :_MLA_LATENT],
                                             attn_mask=mask[:, None, None], scale=1.0, enable_gqa=True)
        return out[:, :, 0].to(q.dtype)

    return decode


def _jax_mla_decode(op):
    """A hand-written jax.numpy decode: gather pages per sequence, float32 scores and softmax, one cast."""
    import jax
    import jax.numpy as jnp

    def decode(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        seqs, pages_per_seq = page_indices.shape
        _, page_size, width = pages.shape
        span = pages_per_seq * page_size
        rows = pages[page_indices].reshape(seqs, span, width).astype(jnp.float32)
        scores = jnp.einsum("shd,sld->shl", q.astype(jnp.float32), rows)
        scores = jnp.where((jnp.arange(span) < kv_lens[:, None])[:, None], scores, -jnp.inf)
        out = jnp.einsum("shl,slc->shc", jax.nn.softmax(scores, axis=-1), rows[..., :_MLA_LATENT])
        return out.astype(q.dtype)

    return decode


def _serving_mla_inputs(shape: tuple[int, ...], cache_dtype: str | None = None) -> tuple:
    tokens, seqs, pages, page_size, pages_per_seq, heads, latent, rope = shape
    return (
        InputSpec((tokens, heads, latent + rope), None),
        InputSpec((pages, page_size, latent + rope), cache_dtype),
        InputSpec((seqs,), "int32"),
        InputSpec((seqs, pages_per_seq), "int32"),
        InputSpec((seqs + 1,), "int32"),
        InputSpec((1,), "int32"),
    )


def _serving_mla_op(shape: tuple[int, ...]):
    from dualop.ops import RaggedPagedMLAAttention

    return RaggedPagedMLAAttention(shape[6])


def _concat_and_cache_mla_inputs(shape: tuple[int, ...], cache_dtype: str | None = None) -> tuple:
    tokens, rope, latent, pages, page_size = shape
    return (InputSpec((tokens, latent), None), InputSpec((tokens, rope), None),
            InputSpec((pages, page_size, latent + rope), cache_dtype), InputSpec((tokens,), "int32"))


def bench_cases():
    """Not run by default: MLA decode over a paged latent cache against gathered rows then SDPA
    (torch) and a hand-written jax.numpy decode."""
    return [BenchCase("ragged_paged_mla_attention[decode]", "ragged_paged_mla_attention", _mla_op,
                      _mla_decode_inputs, _mla_decode_cost, _torch_mla_sdpa, _jax_mla_decode, default=False,
                      shape_of=_mla_decode_shape, matrix=True)]


def serving():
    """ragged_paged_mla_attention: (T, num_seqs, num_pages, page_size, pages_per_seq, H, L, R). A
    decode step of 256 sequences and a mixed step of 2048 tokens over 256 sequences, 16 heads per
    chip (tp 8 of DeepSeek-V3's 128) with 64-token pages, and one chip holding all 128 heads with
    16-token pages; sequences up to 4096 positions. concat_and_cache_mla: (tokens, rope,
    kv_lora_rank, num_pages, page_size), a 2048-token step into a cache of 4096 pages of 64 tokens
    (reshape_and_cache's kernels on K/V halves of 288 channels). Each with its cache in bfloat16 and
    in float8_e4m3fn (the engine's fp8 MLA cache). bfloat16 only: the serving dtype (the check
    shapes build float32)."""
    bf16 = ("bfloat16",)
    fp8 = "float8_e4m3fn"
    return {
        "ragged_paged_mla_attention": Serving(
            ((256, 256, 4096, 64, 64, 16, 512, 64), (2048, 256, 4096, 64, 64, 16, 512, 64),
             (256, 256, 16384, 16, 256, 128, 512, 64)),
            {f"{OP}[mixed]": _serving_mla_inputs, f"{OP}[{fp8},k_scale]": lambda s: _serving_mla_inputs(s, fp8)},
            {f"{OP}[mixed]": _serving_mla_op, f"{OP}[{fp8},k_scale]": _serving_mla_op}, bf16),
        "concat_and_cache_mla": Serving(
            ((2048, 64, 512, 4096, 64),),
            {CACHE_OP: _concat_and_cache_mla_inputs, f"{CACHE_OP}[fp8]": lambda s: _concat_and_cache_mla_inputs(s, fp8)},
            dtypes=bf16),
    }

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"concat_and_cache_mla": {"traits": {"case_shapes_only"}},
              # attention over a paged cache, as ragged_paged_attention's: left to tests/ops/test_mla.py
              "ragged_paged_mla_attention": {"traits": {"structured_inputs"}},
              "concat_and_cache_mla[fp8]": {"traits": {"fp8_inputs", "not_differentiable"}},
              "ragged_paged_mla_attention[float8_e4m3fn,k_scale]": {"traits": {"fp8_inputs"}}}
