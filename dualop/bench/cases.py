"""What ``dualop bench`` times: one ``BenchCase`` per way of calling an op, with the peers a user
would pick instead of dualop (a torch built-in, a hand-written ``jax.numpy`` function).

A case's ``shape`` is always the shape of the main input ``x``: ``(N, hidden)`` for a norm,
``(N, 2d)`` for a gated activation (whose output is ``(N, d)``). Its bytes and flops come from the
kernel's own cost model (``dualop/kernels/cost.py``), so measured GB/s and the device roofline
predictions count the same bytes. Importing this module imports neither torch nor jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.spec import ITEMSIZE, BenchCase, collect, rows_of

__all__ = ["BenchCase", "CASES", "DEFAULT_CASES", "ITEMSIZE", "case_listing", "select_cases", "rows_of"]

# --- inputs ------------------------------------------------------------------------------------


from dualop.spec import float32_normal as _normal  # noqa: E402


def _norm_inputs(residual: bool) -> Callable[[tuple[int, ...], np.random.Generator], tuple]:
    """x (scale 3), a weight around 1, and a residual when asked (as the op's own check cases)."""

    def make(shape, rng):
        x = _normal(shape, rng, 3.0)
        w = 1.0 + _normal(shape[-1:], rng, 0.5)
        return (x, w, _normal(shape, rng)) if residual else (x, w)

    return make


def _x_only(shape, rng):
    return (_normal(shape, rng, 3.0),)


# --- costs -------------------------------------------------------------------------------------


def _norm_cost(residual: bool) -> Callable[[Any, tuple[int, ...], int], KernelCost]:
    def cost(op, shape, itemsize):
        return cost_model.rms_norm_cost(rows_of(shape), shape[-1], itemsize, True, residual)

    return cost


def _gated_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.gated_activation_cost(rows_of(shape), shape[-1] // 2, itemsize, op.spec)


def _pointwise_cost(activation: str) -> Callable[[Any, tuple[int, ...], int], KernelCost]:
    def cost(op, shape, itemsize):
        return cost_model.pointwise_activation_cost(math.prod(shape), itemsize, activation)

    return cost


# --- ops ---------------------------------------------------------------------------------------


def _rms_norm(hidden: int):
    from dualop.ops import RMSNorm

    return RMSNorm(hidden)


def _gemma_rms_norm(hidden: int):
    from dualop.ops import GemmaRMSNorm

    return GemmaRMSNorm(hidden)


def _parameterless(cls_name: str, *args: Any) -> Callable[[int], Any]:
    def make(hidden: int):
        import dualop.ops

        return getattr(dualop.ops, cls_name)(*args)

    return make


# --- torch built-ins: what a user calls instead (torch.nn.functional) ---------------------------


def _torch_rms_norm(residual: bool):
    def builtin(op):
        import torch.nn.functional as F

        shape, eps = (op.hidden_size,), op.eps
        if not residual:
            return lambda x, w: F.rms_norm(x, shape, w, eps)

        def fused(x, w, r):
            s = x + r
            return F.rms_norm(s, shape, w, eps), s

        return fused

    return builtin


def _torch_gemma_rms_norm(op):
    import torch.nn.functional as F

    shape, eps = (op.hidden_size,), op.eps

    def gemma(x, w):
        return (F.rms_norm(x.float(), shape, None, eps) * (1.0 + w.float())).to(x.dtype)

    return gemma


def _torch_gated(activation: str, act_on_first: bool = True, **kw: Any):
    def builtin(op):
        import torch.nn.functional as F

        act = getattr(F, activation)

        def gated(x):
            d = x.shape[-1] // 2
            a, b = x[..., :d], x[..., d:]
            return act(a, **kw) * b if act_on_first else a * act(b, **kw)

        return gated

    return builtin


def _torch_gelu_new(op):
    import torch.nn.functional as F

    return lambda x: F.gelu(x, approximate="tanh")


def _torch_relu2(op):
    import torch
    import torch.nn.functional as F

    return lambda x: torch.square(F.relu(x))


# --- hand-written jax.numpy: what a user writes (upcast to float32, compute, cast back) ----------


def _jax_rms_norm(residual: bool, gemma: bool = False):
    """Llama's RMSNorm (round to x's dtype, then times the weight), or Gemma's (times 1 + weight in
    float32, one cast); with a residual, the float32 sum is normalised and returned cast."""

    def handwritten(op):
        import jax
        import jax.numpy as jnp

        eps = op.eps

        def normalise(xf, w, dtype):
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            if gemma:
                return (y * (1.0 + w.astype(jnp.float32))).astype(dtype)
            return y.astype(dtype) * w

        if not residual:
            return lambda x, w: normalise(x.astype(jnp.float32), w, x.dtype)

        def fused(x, w, r):
            s = x.astype(jnp.float32) + r.astype(jnp.float32)
            return normalise(s, w, x.dtype), s.astype(x.dtype)

        return fused

    return handwritten


def _jax_gated(act_name: str, act_on_first: bool = True, **kw: Any):
    def handwritten(op):
        import jax
        import jax.numpy as jnp

        act = getattr(jax.nn, act_name)

        def gated(x):
            d = x.shape[-1] // 2
            xf = x.astype(jnp.float32)
            a, b = xf[..., :d], xf[..., d:]
            return (act(a, **kw) * b if act_on_first else a * act(b, **kw)).astype(x.dtype)

        return gated

    return handwritten


def _jax_pointwise(body: Callable[[Any, Any], Any]):
    """``body(jax, xf)`` on the float32 upcast of x, cast back."""

    def handwritten(op):
        import jax
        import jax.numpy as jnp

        return lambda x: body(jax, x.astype(jnp.float32)).astype(x.dtype)

    return handwritten


# --- ragged paged attention: decode over a paged KV cache ----------------------------------------
# Shape (num_seqs, kv_len, 2 * Hkv * D): one query row per sequence (decode), every sequence kv_len
# tokens long, Hkv = 8 KV heads of D = 128 (Llama-3-70B's), Hq = 32, pages of 16 tokens in random
# order. The last two dims are the K/V rows the op must read, so the copy roofline copies exactly
# those bytes. A bench size (R, C) maps to R // 128 sequences of C // 4 tokens (small: 32 x 1024).
_RPA_HEAD_DIM, _RPA_GROUP, _RPA_PAGE = 128, 4, 16


def _rpa_decode_shape(size: tuple[int, ...]) -> tuple[int, int, int]:
    rows, cols = size[0], size[-1]
    return (max(1, rows // 128), max(_RPA_PAGE, cols // 4 // _RPA_PAGE * _RPA_PAGE), 2 * 8 * _RPA_HEAD_DIM)


def _rpa_heads(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(Hq, Hkv, D) of a decode shape."""
    num_kv_heads = shape[2] // (2 * _RPA_HEAD_DIM)
    return _RPA_GROUP * num_kv_heads, num_kv_heads, _RPA_HEAD_DIM


def _rpa_decode_inputs(shape, rng):
    from dualop.ops.attention import paged_batch
    from dualop.testing import Pinned

    num_seqs, kv_len, _ = shape
    num_q_heads, num_kv_heads, head_dim = _rpa_heads(shape)
    arrays = paged_batch(rng, [1] * num_seqs, [kv_len] * num_seqs, num_tokens=num_seqs, num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=_RPA_PAGE, spare_pages=0,
                         q_scale=head_dim ** -0.5)  # the op's default sm_scale is 1: scale q instead
    return (*arrays[:2], *(Pinned(a, "int32") for a in arrays[2:]))


def _rpa_decode_cost(op, shape, itemsize) -> KernelCost:
    num_seqs, kv_len, _ = shape
    num_q_heads, num_kv_heads, head_dim = _rpa_heads(shape)
    return cost_model.ragged_paged_attention_cost(num_seqs, num_seqs * kv_len, num_seqs * kv_len, num_q_heads,
                                                  num_kv_heads, head_dim, itemsize)


def _torch_gather_sdpa(op):
    """What a torch user writes for a decode batch: gather each sequence's pages, then SDPA with a
    length mask (GQA by ``enable_gqa``) and the op's default ``sm_scale`` 1, in float32 (SDPA's
    bfloat16 CPU kernel rounds the probabilities to bfloat16, outside the tolerance table), one
    cast back."""
    import torch
    import torch.nn.functional as F

    def decode(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        num_seqs_, pages_per_seq = page_indices.shape
        _, page_size, combined, head_dim = kv_pages.shape
        kv = kv_pages[page_indices].reshape(num_seqs_, pages_per_seq * page_size, combined, head_dim).float()
        k, v = kv[:, :, 0::2].transpose(1, 2), kv[:, :, 1::2].transpose(1, 2)
        mask = torch.arange(pages_per_seq * page_size) < kv_lens[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None].float(), k, v, attn_mask=mask[:, None, None], scale=1.0,
                                             enable_gqa=True)  # the op's default sm_scale
        return out[:, :, 0].to(q.dtype)

    return decode


def _jax_paged_decode(op):
    """A hand-written jax.numpy decode: gather pages per sequence, float32 softmax, one cast."""
    import jax
    import jax.numpy as jnp

    def decode(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        num_seqs_, pages_per_seq = page_indices.shape
        _, page_size, combined, head_dim = kv_pages.shape
        num_kv_heads, span = combined // 2, pages_per_seq * page_size
        kv = kv_pages[page_indices].reshape(num_seqs_, span, combined, head_dim).astype(jnp.float32)
        qf = q.astype(jnp.float32).reshape(num_seqs_, num_kv_heads, -1, head_dim)
        scores = jnp.einsum("skgd,slkd->skgl", qf, kv[:, :, 0::2])
        scores = jnp.where((jnp.arange(span) < kv_lens[:, None])[:, None, None], scores, -jnp.inf)
        out = jnp.einsum("skgl,slkd->skgd", jax.nn.softmax(scores, axis=-1), kv[:, :, 1::2])
        return out.reshape(q.shape).astype(q.dtype)

    return decode
# --- rope: x is the query (tokens, heads * 128) of a Llama-style attention with 8 query heads per
# KV head; positions span an 8192-token cache. torch has no built-in rope: its peer is
# torch.compile of the native body (the bench's torch-compile impl).
_ROPE_HEAD, _ROPE_GROUP, _ROPE_POSITIONS = 128, 8, 8192


def _rope(hidden: int):
    from dualop.ops import RotaryEmbedding

    head = _rope_head(hidden)
    return RotaryEmbedding(head, head, _ROPE_POSITIONS, 500000.0, True)


def _rope_head(hidden: int) -> int:
    """Llama's head size 128 when x holds whole heads of it, else one head as wide as x."""
    return _ROPE_HEAD if hidden % _ROPE_HEAD == 0 else hidden


def _rope_key_width(hidden: int) -> int:
    """The key's width: GQA with 8 query heads per KV head, at least one head."""
    head = _rope_head(hidden)
    return max(head, hidden // _ROPE_GROUP // head * head)


def _rope_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, hidden = shape
    positions = Pinned(rng.integers(0, _ROPE_POSITIONS, tokens).astype(np.int32), "int32")
    return (positions, _normal(shape, rng), _normal((tokens, _rope_key_width(hidden)), rng))


def _rope_cost(op, shape, itemsize) -> KernelCost:
    tokens, hidden = shape
    heads = (hidden + _rope_key_width(hidden)) // op.head_size
    return cost_model.rotary_cost(tokens, heads, op.head_size, op.rotary_dim, itemsize)


def _jax_rope(op):
    """What a jax user writes: gather cos/sin rows of a float32 table, rotate halves in float32."""
    import jax.numpy as jnp

    table = jnp.asarray(op.cos_sin_cache)
    half, head = op.rotary_dim // 2, op.head_size

    def rope(positions, query, key):
        cos, sin = jnp.split(table[positions], 2, axis=-1)
        cos, sin = cos.astype(query.dtype).astype(jnp.float32)[:, None], sin.astype(query.dtype).astype(jnp.float32)[:, None]

        def rotate(x):
            xf = x.reshape(x.shape[0], -1, head).astype(jnp.float32)
            x1, x2 = xf[..., :half], xf[..., half:]
            return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype).reshape(x.shape)

        return rotate(query), rotate(key)

    return rope


CASES: tuple[BenchCase, ...] = (
    BenchCase("rms_norm", "rms_norm", _rms_norm, _norm_inputs(False), _norm_cost(False),
              _torch_rms_norm(False), _jax_rms_norm(False)),
    BenchCase("rms_norm[residual]", "rms_norm", _rms_norm, _norm_inputs(True), _norm_cost(True),
              _torch_rms_norm(True), _jax_rms_norm(True)),
    BenchCase("gemma_rms_norm", "gemma_rms_norm", _gemma_rms_norm, _norm_inputs(False), _norm_cost(False),
              _torch_gemma_rms_norm, _jax_rms_norm(False, gemma=True)),
    BenchCase("silu_and_mul", "silu_and_mul", _parameterless("SiluAndMul"), _x_only, _gated_cost,
              _torch_gated("silu"), _jax_gated("silu")),
    BenchCase("gelu_and_mul", "gelu_and_mul", _parameterless("GeluAndMul"), _x_only, _gated_cost,
              _torch_gated("gelu"), _jax_gated("gelu", approximate=False)),
    # not run by default; ask with --ops
    BenchCase("mul_and_silu", "mul_and_silu", _parameterless("MulAndSilu"), _x_only, _gated_cost,
              _torch_gated("silu", act_on_first=False), _jax_gated("silu", act_on_first=False), default=False),
    BenchCase("gelu_tanh_and_mul", "gelu_and_mul", _parameterless("GeluAndMul", "tanh"), _x_only, _gated_cost,
              _torch_gated("gelu", approximate="tanh"), _jax_gated("gelu", approximate=True), default=False),
    BenchCase("gelu_new", "gelu_new", _parameterless("NewGELU"), _x_only, _pointwise_cost("gelu_new"),
              _torch_gelu_new, _jax_pointwise(lambda jax, x: jax.nn.gelu(x, approximate=True)), default=False),
    BenchCase("quick_gelu", "quick_gelu", _parameterless("QuickGELU"), _x_only, _pointwise_cost("quick_gelu"),
              None, _jax_pointwise(lambda jax, x: x * jax.nn.sigmoid(1.702 * x)), default=False),
    BenchCase("relu2", "relu2", _parameterless("ReLUSquaredActivation"), _x_only, _pointwise_cost("relu2"),
              _torch_relu2, _jax_pointwise(lambda jax, x: jax.numpy.square(jax.nn.relu(x))), default=False),
    BenchCase("ragged_paged_attention[decode]", "ragged_paged_attention", _parameterless("RaggedPagedAttention"),
              _rpa_decode_inputs, _rpa_decode_cost, _torch_gather_sdpa, _jax_paged_decode, default=False,
              shape_of=_rpa_decode_shape),
    BenchCase("rotary_embedding", "rotary_embedding", _rope, _rope_inputs, _rope_cost, None, _jax_rope,
              default=False),
)
# --- mm_encoder_attn: a ViT's attention over packed images ---------------------------------------
# The bench shape (tokens, hidden) is a packed batch of images, ``hidden = heads x 80`` (Qwen2.5-VL's
# vision tower: 16 heads of 80 at hidden 1280; one head of ``hidden`` when 80 does not divide it),
# each image ``ENCODER_IMAGE_TOKENS`` patches long (the last one shorter), as ``cu_seqlens``. Not run by default: its cost grows with tokens x image
# size, not with the row sizes the other cases use; ask with ``--ops mm_encoder_attn --sizes 1024x1280``.
ENCODER_HEAD_SIZE = 80
ENCODER_IMAGE_TOKENS = 256


def _encoder_segments(tokens: int) -> list[int]:
    full, rest = divmod(tokens, ENCODER_IMAGE_TOKENS)
    return [ENCODER_IMAGE_TOKENS] * full + ([rest] if rest else [])


def _encoder_attention(hidden: int):
    from dualop.ops import MMEncoderAttention

    head_size = ENCODER_HEAD_SIZE if hidden % ENCODER_HEAD_SIZE == 0 else hidden
    return MMEncoderAttention(hidden // head_size, head_size)


def _encoder_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, hidden = shape
    cu = np.cumsum([0, *_encoder_segments(tokens)]).astype(np.int32)
    x = [_normal((1, tokens, hidden), rng) for _ in range(3)]
    return (*x, Pinned(cu, "int32"), None)


def _encoder_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.encoder_attention_cost(_encoder_segments(shape[0]), op.num_heads, op.num_kv_heads,
                                             op.head_size, itemsize)


def _torch_encoder_attention(op):
    """What a user writes: ``F.scaled_dot_product_attention`` per image, in the input dtype."""
    import torch
    import torch.nn.functional as F

    h, hkv, d = op.num_heads, op.num_kv_heads, op.head_size

    def sdpa(q, k, v, cu_seqlens, max_seqlen=None):
        s = q.shape[1]
        qh, kh, vh = (t.reshape(s, n, d).transpose(0, 1) for t, n in ((q, h), (k, hkv), (v, hkv)))
        bounds = cu_seqlens.tolist()
        outs = [F.scaled_dot_product_attention(qh[:, a:b], kh[:, a:b], vh[:, a:b], scale=op.scale,
                                               enable_gqa=h != hkv) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(q.shape)

    return sdpa


def _jax_encoder_attention(op):
    """What a user writes in jax.numpy: float32 logits over the packed sequence with a
    block-diagonal mask from the segment ids, softmax, ``P @ V``, one cast."""
    import jax
    import jax.numpy as jnp

    h, hkv, d = op.num_heads, op.num_kv_heads, op.head_size

    def attention(q, k, v, cu_seqlens, max_seqlen=None):
        s = q.shape[1]
        seg = jnp.searchsorted(cu_seqlens[1:], jnp.arange(s), side="right")
        qf = q.reshape(s, hkv, h // hkv, d).astype(jnp.float32)
        kf, vf = (t.reshape(s, hkv, d).astype(jnp.float32) for t in (k, v))
        logits = jnp.einsum("qkgd,tkd->kgqt", qf, kf) * op.scale
        logits = jnp.where(seg[:, None] == seg[None, :], logits, -jnp.inf)
        out = jnp.einsum("kgqt,tkd->qkgd", jax.nn.softmax(logits, axis=-1), vf)
        return out.reshape(q.shape).astype(q.dtype)

    return attention


CASES = (*CASES, BenchCase("mm_encoder_attn", "mm_encoder_attn", _encoder_attention, _encoder_inputs, _encoder_cost,
                           _torch_encoder_attention, _jax_encoder_attention, default=False))


# --- mixture of experts ------------------------------------------------------------------------
# ``fused_moe`` (routing + experts) on x of (tokens, hidden), with the expert count, top-k and the
# intermediate size per hidden size of two model families: Mixtral (8 experts, top-2, I = 3.5 H)
# and Qwen3-MoE (top-8, I = 0.375 H; 64 experts here, half of Qwen3-30B-A3B's 128). Pass sizes
# (``--sizes 1x1024,64x1024,512x1024``): the default sizes are for row-wise ops.
MOE_FAMILIES: dict[str, tuple[int, int, float]] = {"mixtral": (8, 2, 3.5), "qwen3": (64, 8, 0.375)}


def _moe_op(family: str) -> Callable[[int], Any]:
    def make(hidden: int):
        from dualop.ops import FusedMoE

        experts, top_k, ratio = MOE_FAMILIES[family]
        return FusedMoE(experts, top_k, hidden, max(1, round(hidden * ratio)), renormalize=True)

    return make


def _moe_inputs(family: str) -> Callable[[tuple[int, ...], np.random.Generator], tuple]:
    def make(shape, rng):
        tokens, hidden = shape
        experts, _, ratio = MOE_FAMILIES[family]
        inter = max(1, round(hidden * ratio))
        return (_normal(shape, rng), _normal((tokens, experts), rng, 2.0),
                _normal((experts, 2 * inter, hidden), rng, hidden ** -0.5),
                _normal((experts, hidden, inter), rng, inter ** -0.5))

    return make


def _moe_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.fused_moe_cost(shape[0], op.top_k, op.num_experts, shape[1], op.intermediate_size, itemsize)


def _torch_moe(op):
    """transformers' own experts (``MixtralExperts``, the module Mixtral's sparse block calls; its
    eager implementation) after the router's softmax and top-k. Run in float32: in bfloat16 the
    block rounds the intermediate to bfloat16 and so computes a different value from the op's
    (float32 until the second matmul); its bfloat16 timings are in docs/BENCHMARKS.md."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=op.hidden_size, intermediate_size=op.intermediate_size,
                           num_local_experts=op.num_experts, num_experts_per_tok=op.top_k)
    config._experts_implementation = "eager"
    experts = MixtralExperts(config).requires_grad_(False)

    def moe(hidden_states, router_logits, w13, w2):
        # top-k as a stable sort: equal scores (frequent with 16-bit logits) go to the lower expert
        # index, the op's rule (torch.topk leaves their order unspecified)
        weights, ids = torch.sort(torch.softmax(router_logits.float(), dim=-1), dim=-1, descending=True, stable=True)
        weights, ids = weights[:, :op.top_k], ids[:, :op.top_k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        experts.gate_up_proj.data, experts.down_proj.data = w13.float(), w2.float()
        return experts(hidden_states.float(), ids, weights).to(hidden_states.dtype)

    return moe


def _jax_moe(op):
    """What a user writes with ``jax.lax.ragged_dot``: softmax and top-k, the routed rows sorted by
    expert, both projections as ragged matmuls with float32 accumulation (the second in float32,
    so the intermediate is not rounded), a scatter-add of the weighted rows."""
    import jax
    import jax.numpy as jnp

    f32, top_k, num_experts = jnp.float32, op.top_k, op.num_experts

    def moe(hidden_states, router_logits, w13, w2):
        weights, ids = jax.lax.top_k(jax.nn.softmax(router_logits.astype(f32), axis=-1), top_k)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        order = jnp.argsort(ids.reshape(-1), stable=True)
        sizes = jnp.bincount(ids.reshape(-1), length=num_experts).astype(jnp.int32)
        token = order // top_k
        h = jax.lax.ragged_dot(hidden_states[token], jnp.swapaxes(w13, 1, 2), sizes, preferred_element_type=f32)
        inter = w2.shape[2]
        a = jax.nn.silu(h[:, :inter]) * h[:, inter:]
        y = jax.lax.ragged_dot(a, jnp.swapaxes(w2, 1, 2).astype(f32), sizes, preferred_element_type=f32)
        out = jnp.zeros(hidden_states.shape, f32).at[token].add(y * weights.reshape(-1)[order, None])
        return out.astype(hidden_states.dtype)

    return moe


CASES = (*CASES, *(BenchCase(f"fused_moe[{family}]", "fused_moe", _moe_op(family), _moe_inputs(family), _moe_cost,
                             _torch_moe, _jax_moe, default=False, matrix=True) for family in MOE_FAMILIES))


# --- linear: x (tokens, hidden) times a square weight (hidden -> hidden), no bias ------------------
# The vendor GEMM is the path (F.linear on the CPU; XLA's dot for jax); the peers are F.linear
# itself, torch.compile of the native body (the bench's torch-compile impl) and a hand-written
# jnp.dot. Not run by default (a 4096-wide GEMM is seconds on 2 cores); the shapes are
# Llama-8B-ish: ``--ops column_parallel_linear --sizes 16x4096,256x2048``.


def _linear_op(op_name: str) -> Callable[[int], Any]:
    def make(hidden: int):
        from dualop import ops
        from dualop.parallel import TensorParallel

        cls = {"replicated_linear": ops.ReplicatedLinear, "column_parallel_linear": ops.ColumnParallelLinear,
               "row_parallel_linear": ops.RowParallelLinear}[op_name]
        return cls(hidden, hidden, bias=False, return_bias=False, tp=TensorParallel())

    return make


def _linear_inputs(shape, rng):
    hidden = shape[-1]
    return (_normal(shape, rng), _normal((hidden, hidden), rng, hidden ** -0.5))


def _linear_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.linear_cost(rows_of(shape), op.input_size, op.output_size, itemsize, False)


def _torch_linear(op):
    import torch.nn.functional as F

    return lambda x, w: F.linear(x, w)


def _jax_linear(op):
    """What a jax user writes: ``jnp.dot(x, w.T)``."""
    import jax.numpy as jnp

    return lambda x, w: jnp.dot(x, w.T)


CASES = (*CASES, *(BenchCase(op_name, op_name, _linear_op(op_name), _linear_inputs, _linear_cost, _torch_linear,
                             _jax_linear, default=False, matrix=True)
                   for op_name in ("column_parallel_linear", "row_parallel_linear", "replicated_linear")))


DEFAULT_CASES: tuple[str, ...] = tuple(c.label for c in CASES if c.default)


def case_listing(names: Iterable[str] | None = None, sizes: Iterable[tuple[int, int]] = ()) -> list[str]:
    """``dualop bench --list``: one sorted line per (case, size, dtype): whether it runs by
    default, its peers, the op it builds, the shape it runs and its cost model's numbers (what the
    roofline divides)."""
    from dualop.testing import listing_text

    cases = CASES if names is None else select_cases(names)
    lines = []
    for c in cases:
        peers = ",".join(p for p, fn in (("torch", c.torch_builtin), ("jax", c.jax_handwritten)) if fn) or "none"
        for size in sizes:
            shape = c.input_shape(tuple(size))
            op = listing_text(c.make_op(shape[-1]))
            for dtype in sorted(ITEMSIZE):
                cost = c.kernel_cost(shape, dtype)
                lines.append(f"{c.label} | op {c.op_name} | {'default' if c.default else 'on request'} | peers {peers} | "
                             f"{'matrix' if c.matrix else 'vector'} | size {tuple(size)} -> shape {shape} | {dtype} | "
                             f"{op} | bytes {cost.bytes_accessed} flops {cost.flops} "
                             f"transcendentals {cost.transcendentals}")
    return sorted(lines)


def select_cases(names: Iterable[str] | None = None) -> list[BenchCase]:
    """The cases whose label or registered op name is in ``names`` (the default cases for None).

    Raises ValueError naming every name that matches no case, and the valid ones.
    """
    if names is None:
        return [c for c in CASES if c.default]
    if isinstance(names, str):
        raise TypeError(f"ops must be a list of names, got the string {names!r}")
    wanted = list(names)
    unknown = [n for n in wanted if not any(n in (c.label, c.op_name) for c in CASES)]
    if unknown:
        valid = sorted({c.label for c in CASES} | {c.op_name for c in CASES})
        raise ValueError(f"--ops: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    return [c for c in CASES if c.label in wanted or c.op_name in wanted]


# --- logits processor -------------------------------------------------------------------
# The LM head's logits with Gemma-2's final soft cap (30) on hidden states of (tokens, hidden): a
# 32000-token vocabulary (Llama-2 / Mistral; pass smaller hidden sizes on a small host), decode
# ``--sizes 16x4096`` and prefill ``512x4096``. The weight read dominates decode (the roofline's
# bytes are the weight's); peers: F.linear then the cap in float32 (torch), a dot with float32
# accumulation then the cap (jax), and torch.compile of the native body (the bench's torch-compile).
LOGITS_VOCAB, LOGITS_SOFT_CAP = 32000, 30.0


def _logits_processor(hidden: int):
    from dualop.ops import LogitsProcessor

    return LogitsProcessor(LOGITS_VOCAB, soft_cap=LOGITS_SOFT_CAP)


def _logits_inputs(shape, rng):
    from dualop.parallel import pad_vocab_size

    hidden = shape[-1]
    weight = _normal((pad_vocab_size(LOGITS_VOCAB), hidden), rng, 3.0 / hidden ** 0.5)
    weight[LOGITS_VOCAB:] = 0.0  # the padding rows of the vocabulary-parallel layout
    return (weight, _normal(shape, rng))


def _logits_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.logits_processor_cost(rows_of(shape), shape[-1], op.org_vocab_size, itemsize, False, True)


def _torch_logits(op):
    import torch
    import torch.nn.functional as F

    cap, vocab = op.soft_cap, op.org_vocab_size

    def logits(weight, hidden_states):
        y = F.linear(hidden_states, weight[:vocab]).float()
        return (torch.tanh(y / cap) * cap).to(hidden_states.dtype)

    return logits


def _jax_logits(op):
    import jax
    import jax.numpy as jnp

    cap, vocab = op.soft_cap, op.org_vocab_size

    def logits(weight, hidden_states):
        y = jax.lax.dot_general(hidden_states, weight[:vocab], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return (jnp.tanh(y / cap) * cap).astype(hidden_states.dtype)

    return logits


CASES = (*CASES, BenchCase("logits_processor[soft_cap]", "logits_processor", _logits_processor, _logits_inputs,
                           _logits_cost, _torch_logits, _jax_logits, default=False, matrix=True))


# --- patch embeddings (conv2d / conv3d) ------------------------------------------------------------
# x is a batch of images (or Qwen2.5-VL's patches) for a size ROWSxCOLS: ROWS items, COLS ignored.
# Qwen2.5-VL's vision tower: Conv3d(3, 1280, (2, 14, 14), stride = kernel, no bias) on x [L, 3, 2, 14,
# 14], one patch per item (``--sizes 1024x1280``); a CLIP-like ViT-B/16: Conv2d(3, 768, 16, stride
# 16) on [N, 3, 224, 224] (``--sizes 1x768``). Peers: F.conv3d / F.conv2d, and the jax user's
# ``lax.conv_general_dilated`` (float32 accumulation, one cast).
PATCH_EMBEDS: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...], bool]] = {
    # label: (in_channels, out_channels, kernel, item spatial size, bias)
    "conv3d[qwen2.5-vl]": (3, 1280, (2, 14, 14), (2, 14, 14), False),
    "conv2d[clip-b16]": (3, 768, (16, 16), (224, 224), True),
}


def _patch_embed(label: str) -> Callable[[int], Any]:
    def make(_hidden: int):
        from dualop.ops import Conv2dLayer, Conv3dLayer

        c, out, kernel, _, bias = PATCH_EMBEDS[label]
        return (Conv2dLayer if len(kernel) == 2 else Conv3dLayer)(c, out, kernel, stride=kernel, bias=bias)

    return make


def _patch_embed_shape(label: str) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    c, _, _, spatial, _ = PATCH_EMBEDS[label]
    return lambda size: (size[0], c, *spatial)


def _patch_embed_inputs(shape, rng):
    label = next(k for k, v in PATCH_EMBEDS.items() if len(v[2]) == len(shape) - 2)
    c, out, kernel, _, bias = PATCH_EMBEDS[label]
    fan_in = c * math.prod(kernel)
    w = _normal((out, c, *kernel), rng, fan_in ** -0.5)
    return (_normal(shape, rng), w, _normal((out,), rng) if bias else None)


def _patch_embed_cost(op, shape, itemsize) -> KernelCost:
    patches = shape[0] * math.prod(s // k for s, k in zip(shape[2:], op.kernel_size))
    return cost_model.patch_embed_cost(patches, op.patch_size, op.out_channels, itemsize, op.has_bias,
                                       math.prod(shape))


def _torch_conv(op):
    """torch's own strided convolution (oneDNN / cuDNN)."""
    import torch.nn.functional as F

    conv = F.conv2d if op.num_dim == 2 else F.conv3d
    return lambda x, weight, bias=None: conv(x, weight, bias, op.stride)


def _jax_conv(op):
    """What a jax user writes (flax's Conv does the same): ``lax.conv_general_dilated`` in NCHW with
    float32 accumulation, the bias, one cast."""
    import jax
    import jax.numpy as jnp

    spec = ("NCHW", "OIHW", "NCHW") if op.num_dim == 2 else ("NCDHW", "OIDHW", "NCDHW")

    def conv(x, weight, bias=None):
        y = jax.lax.conv_general_dilated(x, weight, op.stride, "VALID", dimension_numbers=spec,
                                         preferred_element_type=jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32).reshape(-1, *(1,) * op.num_dim)
        return y.astype(x.dtype)

    return conv


CASES = (*CASES, *(BenchCase(label, label.split("[")[0], _patch_embed(label), _patch_embed_inputs, _patch_embed_cost,
                             _torch_conv, _jax_conv, default=False, shape_of=_patch_embed_shape(label), matrix=True)
                   for label in PATCH_EMBEDS))


# --- vocab_parallel_embedding: the token embedding gather --------------------------------
# The bench size (tokens, D) is the ids' count and the embedding dim over Llama-3's vocabulary of
# 128256 rows (one device: the whole padded table): ``64xD`` is a decode step, ``4096xD`` a prefill
# (Llama-3-8B's D is 4096; the table then takes 1 GiB in bfloat16, 2 GiB in float32, so smoke runs
# here use a smaller D). Peers: ``F.embedding`` and ``jnp.take`` on the same table.
EMBEDDING_VOCAB = 128256


def _vocab_embedding(dim: int):
    from dualop.ops import VocabParallelEmbedding

    return VocabParallelEmbedding(EMBEDDING_VOCAB, dim)


def _vocab_embedding_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, dim = shape
    ids = Pinned(rng.integers(0, EMBEDDING_VOCAB, tokens).astype(np.int32), "int32")
    return (ids, rng.standard_normal((EMBEDDING_VOCAB, dim), dtype=np.float32))


def _vocab_embedding_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.embedding_gather_cost(shape[0], shape[1], itemsize)


def _torch_embedding(op):
    import torch.nn.functional as F

    return lambda input_ids, weight: F.embedding(input_ids, weight)


def _jax_take(op):
    import jax.numpy as jnp

    return lambda input_ids, weight: jnp.take(weight, input_ids, axis=0)


CASES = (*CASES, BenchCase("vocab_parallel_embedding", "vocab_parallel_embedding", _vocab_embedding,
                           _vocab_embedding_inputs, _vocab_embedding_cost, _torch_embedding, _jax_take, default=False))


# --- causal_conv1d: the Mamba / LFM2 short convolution over packed sequences ------------
# The bench size (tokens, D) is x's shape at kernel width 4; the case fixes how the tokens are
# split: one sequence, eight, or one token per sequence (a decode step; ``64xD``: 64 sequences).
# Every sequence is new (no initial state), so repeated calls on the same inputs give the same
# outputs and final states (the torch cache is updated in place). Peers: transformers-style
# grouped ``F.conv1d`` over the sequences behind their histories (torch), a ``lax.scan`` over the
# tokens under jit (jax), and torch.compile of the native body (the bench's torch-compile impl).
_CONV_WIDTH = 4


def _causal_conv1d(dim: int):
    from dualop.ops import CausalConv1d

    return CausalConv1d(dim, _CONV_WIDTH)


def _fresh_equal_sequences(tokens: int, seqs: int) -> tuple:
    """Serving metadata of ``seqs`` new sequences of equal length packed in ``tokens`` (slot b for
    sequence b, no initial state): ``(cu_seqlens, state_indices, has_initial_state)``, pinned."""
    from dualop.testing import Pinned

    if seqs < 1 or tokens % seqs:
        raise ValueError(f"bench: {tokens} tokens do not split into {seqs} equal sequences")
    return (Pinned(np.arange(0, tokens + 1, tokens // seqs, dtype=np.int32), "int32"),
            Pinned(np.arange(seqs, dtype=np.int32), "int32"), Pinned(np.zeros(seqs, bool), "bool"))


def _conv_sequences(split: str, tokens: int) -> int:
    return {"prefill": 1, "prefill_8seq": min(8, tokens), "decode": tokens}[split]


def _causal_conv1d_inputs(split: str):
    def make(shape, rng):
        from dualop.ops.ssm_batch import random_serving_batch
        from dualop.testing import Pinned

        tokens, dim = shape
        cu, slots, _, num_slots = random_serving_batch(tokens, _conv_sequences(split, tokens), rng, padding=False)
        return (rng.standard_normal((tokens, dim), dtype=np.float32),
                0.5 * rng.standard_normal((dim, _CONV_WIDTH), dtype=np.float32),
                rng.standard_normal(dim, dtype=np.float32),
                np.zeros((num_slots, dim, _CONV_WIDTH - 1), np.float32),
                Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(np.zeros(len(slots), bool), "bool"))

    return make


def _causal_conv1d_cost(split: str):
    def cost(op, shape, itemsize) -> KernelCost:
        return cost_model.causal_conv1d_cost(shape[0], shape[1], _conv_sequences(split, shape[0]), _CONV_WIDTH,
                                             itemsize, True)

    return cost


def _torch_grouped_conv1d(op):
    from dualop.kernels.cpu.causal_conv1d import causal_conv1d_grouped_conv

    def run(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        return causal_conv1d_grouped_conv(x, weight, bias, conv_state, cu_seqlens, state_indices,
                                          has_initial_state, activation=op.activation)

    return run


def _jax_conv_scan(op):
    import jax

    from dualop.backends.xla import array_api
    from dualop.kernels import ssm_math

    @jax.jit
    def run(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        return ssm_math.causal_conv1d_reference(array_api, x, weight, bias, conv_state, cu_seqlens, state_indices,
                                                has_initial_state, op.activation)

    return run


CASES = (*CASES, *(
    BenchCase(f"causal_conv1d[{split}]", "causal_conv1d", _causal_conv1d, _causal_conv1d_inputs(split),
              _causal_conv1d_cost(split), _torch_grouped_conv1d, _jax_conv_scan, default=False)
    for split in ("prefill", "prefill_8seq", "decode")))


# --- short_conv: LFM2's gated short convolution block -----------------------------------
# The bench size (tokens, hidden) at LFM2's conv width 3, no biases: ``[prefill_8seq]`` packs the
# tokens into eight equal sequences, ``[decode]`` is one token per sequence (``64xH``: 64 sequences).
# Every sequence starts fresh (no initial state; the torch cache is updated in place, so repeated
# calls compute the same thing). Peers: transformers' Lfm2ShortConv math written out in torch (its
# slow path: in_proj, chunk into B, C, x, ``B * x``, a depthwise ``F.conv1d`` with ``L - 1`` zeros
# of padding cut back to the sequence, ``C *``, out_proj) on the equal-length sequences as a batch,
# in float32 like the op, and the native body under jit for jax.
_SHORT_CONV_WIDTH = 3


def _short_conv(hidden: int):
    from dualop.ops import ShortConv

    return ShortConv(hidden, _SHORT_CONV_WIDTH)


def _short_conv_inputs(split: str):
    def make(shape, rng):
        tokens, hidden = shape
        seqs = _conv_sequences(split, tokens)
        scale = hidden ** -0.5
        return (rng.standard_normal((tokens, hidden), dtype=np.float32),
                scale * rng.standard_normal((3 * hidden, hidden), dtype=np.float32),
                0.5 * rng.standard_normal((hidden, _SHORT_CONV_WIDTH), dtype=np.float32),
                scale * rng.standard_normal((hidden, hidden), dtype=np.float32),
                None, np.zeros((seqs, hidden, _SHORT_CONV_WIDTH - 1), np.float32),
                *_fresh_equal_sequences(tokens, seqs))

    return make


def _short_conv_cost(split: str):
    def cost(op, shape, itemsize) -> KernelCost:
        return cost_model.short_conv_cost(shape[0], shape[1], _conv_sequences(split, shape[0]),
                                          _SHORT_CONV_WIDTH, itemsize)

    return cost


def _torch_lfm2_short_conv(op):
    """transformers' Lfm2ShortConv slow path in float32 over equal-length sequences as a batch."""
    import torch
    import torch.nn.functional as F

    width = op.conv_kernel

    def run(h, in_w, conv_w, out_w, conv_bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        f32 = torch.float32
        seqs, hidden = state_indices.shape[0], h.shape[1]
        bcx = F.linear(h.to(f32), in_w.to(f32)).view(seqs, -1, 3 * hidden).transpose(1, 2)  # [B, 3H, L]
        b, c, x = bcx.chunk(3, dim=1)
        bx = b * x
        length = bx.shape[-1]
        conv = F.conv1d(bx, conv_w.to(f32)[:, None], padding=width - 1, groups=hidden)[..., :length]
        out = F.linear((c * conv).transpose(1, 2).reshape(-1, hidden), out_w.to(f32))
        history = F.pad(bx, (width - 1, 0))[..., -(width - 1):]  # the last L - 1 inputs, zeros before
        conv_state[state_indices.long()] = history.to(conv_state.dtype)
        return out.to(h.dtype), conv_state

    return run


def _jax_short_conv(op):
    import jax

    return jax.jit(op.forward_native)


CASES = (*CASES, *(
    BenchCase(f"short_conv[{split}]", "short_conv", _short_conv, _short_conv_inputs(split),
              _short_conv_cost(split), _torch_lfm2_short_conv, _jax_short_conv, default=False, matrix=True)
    for split in ("prefill_8seq", "decode")))


# --- mixer2_gated_rms_norm: the Mamba-2 mixers' output norm -------------------------------
# The bench size (rows, hidden) in 8 groups (Nemotron-H-8B: hidden 8192 over 8 groups), gate like x,
# the weight in x's dtype. Peers: transformers' NemotronHRMSNormGated (the weight set to the call's)
# and the same math in jax.numpy under jit.
_GATED_NORM_GROUPS = 8


def _mixer2_gated_norm(hidden: int):
    from dualop.ops import Mixer2RMSNormGated

    return Mixer2RMSNormGated(hidden, _GATED_NORM_GROUPS if hidden % _GATED_NORM_GROUPS == 0 else 1)


def _mixer2_gated_norm_inputs(shape, rng):
    rows, hidden = shape
    return (rng.standard_normal((rows, hidden), dtype=np.float32),
            rng.standard_normal((rows, hidden), dtype=np.float32),
            1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32))


def _mixer2_gated_norm_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.rms_norm_gated_cost(shape[0], shape[1], op.group_size, itemsize, itemsize, True)


def _torch_nemotron_h_gated_norm(op):
    import torch
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    norm = NemotronHRMSNormGated(op.hidden_size, group_size=op.group_size, eps=op.eps)

    def run(x, gate, weight):
        with torch.no_grad():
            norm.weight.data = weight
            return norm(x, gate)

    return run


def _jax_gated_norm(op):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(x, gate, weight):
        h = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        g = h.reshape(*h.shape[:-1], -1, op.group_size)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + op.eps)
        return weight * g.reshape(h.shape).astype(x.dtype)

    return run


CASES = (*CASES, BenchCase("mixer2_gated_rms_norm", "mixer2_gated_rms_norm", _mixer2_gated_norm,
                           _mixer2_gated_norm_inputs, _mixer2_gated_norm_cost, _torch_nemotron_h_gated_norm,
                           _jax_gated_norm, default=False))


# --- mamba_mixer, the Mamba-1 mixer at the mixer level -----------------------------------
# A Mamba layer of hidden H (I = 2H, N 16, K 4, R = ceil(H / 16), conv bias, no norms) over packed
# sequences with caches of one slot per sequence: ``--sizes 1024x1024`` is a prefill of 1024 tokens
# (one sequence, or eight of 128: the [prefill_8seq] case), ``64x1024`` with the [decode] case a step of
# 64 one-token sequences. Every sequence starts from zeros (the caches are updated in place, so a call
# that read them would not repeat itself); each call writes both states. Peers (returning the output
# and the final states): transformers' MambaMixer (torch; the equal-length sequences as one batch) and
# a hand-written jax lax.scan rounding where the native body does. In 16-bit dtypes transformers rounds
# at other points (the SSM state to the input dtype before its product with C, the D skip in the input
# dtype), so the bench's correctness check reports it outside the bfloat16 tolerance (an error record,
# not timed; tests/test_bench.py expects exactly those): a 16-bit comparison with it is by hand.
_MAMBA_SEQS = {"prefill": 1, "prefill_8seq": 8, "decode": 0}  # 0: one token per sequence


def _mamba_shape(kind: str):
    def shape_of(size):
        tokens, hidden = size[0], size[-1]
        seqs = _MAMBA_SEQS[kind] or tokens
        if tokens % seqs:
            raise ValueError(f"mamba_mixer[{kind}]: {tokens} tokens do not split into {seqs} equal sequences")
        return (tokens, seqs, hidden)

    return shape_of


def _mamba_dims(hidden: int) -> tuple[int, int, int, int]:
    """(intermediate, state, kernel, rank) of the bench's layer of width ``hidden``."""
    return 2 * hidden, 16, 4, -(-hidden // 16)


def _mamba_mixer(hidden: int):
    from dualop.ops import MambaMixer

    inner, state, kernel, rank = _mamba_dims(hidden)
    return MambaMixer(hidden, state, kernel, inner, rank)


def _mamba_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, seqs, hidden = shape
    inner, state, kernel, rank = _mamba_dims(hidden)

    def normal(shape_, scale):
        return (rng.standard_normal(shape_) * scale).astype(np.float32)

    a_log = np.log(np.broadcast_to(np.arange(1, state + 1, dtype=np.float32), (inner, state))).copy()
    return (normal((tokens, hidden), 1.0), normal((2 * inner, hidden), hidden ** -0.5), normal((inner, kernel), 0.5),
            normal((inner,), 0.1), normal((rank + 2 * state, inner), inner ** -0.5), normal((inner, rank), rank ** -0.5),
            normal((inner,), 0.5) - 1.0, a_log, np.ones(inner, np.float32), normal((hidden, inner), inner ** -0.5),
            None, None, None, None, None,
            normal((seqs, inner, kernel - 1), 1.0), normal((seqs, inner, state), 0.5),
            Pinned(np.arange(seqs + 1, dtype=np.int32) * (tokens // seqs), "int32"),
            Pinned(np.arange(seqs, dtype=np.int32), "int32"), Pinned(np.zeros(seqs, bool), "bool"))


def _mamba_cost(op, shape, itemsize) -> KernelCost:
    """The four projections' GEMMs, the conv and the scan (about 6 flops per state element per
    token), one exp per state element and the softplus and two SiLUs per channel; the weights, the
    tokens in and out, and each sequence's states read and written once."""
    tokens, seqs, hidden = shape
    inner, state, kernel, rank = _mamba_dims(hidden)
    gemm = 2 * tokens * (hidden * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * hidden)
    flops = gemm + tokens * inner * (2 * kernel + 6 * state + 10)
    weights = (2 * inner * hidden + inner * (kernel + 1) + (rank + 2 * state) * inner + inner * (rank + 1)
               + inner * (state + 1) + hidden * inner) * itemsize
    states = 2 * seqs * inner * (kernel - 1 + state) * itemsize
    return KernelCost(flops=flops, transcendentals=tokens * inner * (state + 3),
                      bytes_accessed=weights + 2 * tokens * hidden * itemsize + states)


def _transformers_mamba(op):
    """transformers' MambaMixer with the op's weights (loaded on the first call) on the packed tokens
    as a batch of equal-length sequences from zero states, with a fresh cache for the final states."""
    import torch
    from transformers import DynamicCache, MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer as HFMambaMixer

    cfg = MambaConfig(hidden_size=op.hidden_size, state_size=op.ssm_state_size, conv_kernel=op.conv_kernel_size,
                      intermediate_size=op.intermediate_size, time_step_rank=op.time_step_rank, num_hidden_layers=1)
    held: dict[str, Any] = {}

    def mixer(hidden_states, in_proj_weight, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias,
              A_log, D, out_proj_weight, in_proj_bias=None, out_proj_bias=None, dt_norm_weight=None,
              b_norm_weight=None, c_norm_weight=None, conv_state=None, ssm_state=None, cu_seqlens=None,
              state_indices=None, has_initial_state=None):
        if "module" not in held:
            module = HFMambaMixer(cfg, layer_idx=0, initialize_mixer_weights=False).eval()
            weights = {"in_proj.weight": in_proj_weight, "conv1d.weight": conv_weight[:, None, :],
                       "conv1d.bias": conv_bias, "x_proj.weight": x_proj_weight, "dt_proj.weight": dt_proj_weight,
                       "dt_proj.bias": dt_proj_bias, "A_log": A_log, "D": D, "out_proj.weight": out_proj_weight}
            module.load_state_dict({k: v.detach() for k, v in weights.items()})
            held["module"] = module.to(device=hidden_states.device, dtype=hidden_states.dtype)
        seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
        batch = hidden_states.reshape(seqs, -1, hidden_states.shape[-1])
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            out = held["module"](batch, cache_params=cache)
        conv = cache.get_conv_state(0, state_idx=0)[:, :, 1:]  # it keeps K inputs, the op K - 1
        return out.reshape(hidden_states.shape), conv, cache.get_recurrent_state(0, state_idx=0)

    return mixer


def _jax_mamba(op):
    """What a user writes in jax: the projections as float32-accumulating dots, then one lax.scan
    over the packed tokens for the conv and one for the SSM state, each reset at a sequence's start
    from its cached state, the final states written into new caches."""
    import jax
    import jax.numpy as jnp

    i_size, n, k, r = op.intermediate_size, op.ssm_state_size, op.conv_kernel_size, op.time_step_rank

    def dot(x, w):  # float32 accumulation, rounded to the tokens' dtype (as the native body rounds)
        return jnp.einsum("tk,nk->tn", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

    def mixer(h, in_w, conv_w, conv_b, x_w, dt_w, dt_b, A_log, D, out_w, in_b=None, out_b=None, dt_nw=None,
              b_nw=None, c_nw=None, conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None,
              has_initial_state=None):
        tokens = h.shape[0]
        xz = dot(h, in_w)
        x, z = xz[:, :i_size].astype(jnp.float32), xz[:, i_size:].astype(jnp.float32)
        seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(tokens), side="right")
        first = jnp.arange(tokens) == cu_seqlens[seq]
        init = has_initial_state[seq][:, None, None]
        conv0 = jnp.where(init, conv_state[state_indices[seq]].astype(jnp.float32), 0.0)
        ssm0 = jnp.where(init, ssm_state[state_indices[seq]].astype(jnp.float32), 0.0)
        a = -jnp.exp(A_log.astype(jnp.float32))
        wc, bc = conv_w.astype(jnp.float32), conv_b.astype(jnp.float32)

        def conv_step(window, inputs):
            x_t, f, w0 = inputs
            window = jnp.concatenate([jnp.where(f, w0, window), x_t[:, None]], axis=1)
            y = jnp.sum(window * wc, axis=1) + bc
            return window[:, 1:], y * jax.nn.sigmoid(y)

        _, xc = jax.lax.scan(conv_step, jnp.zeros((i_size, k - 1), jnp.float32), (x, first, conv0))
        xc = xc.astype(h.dtype).astype(jnp.float32)
        dbc = dot(xc.astype(h.dtype), x_w)
        dt = jax.nn.softplus(dot(dbc[:, :r], dt_w).astype(jnp.float32) + dt_b.astype(jnp.float32))
        b, c = dbc[:, r:r + n].astype(jnp.float32), dbc[:, r + n:].astype(jnp.float32)

        def scan_step(s, inputs):
            d_t, x_t, b_t, c_t, f, s0 = inputs
            s = jnp.exp(d_t[:, None] * a) * jnp.where(f, s0, s) + (d_t * x_t)[:, None] * b_t[None, :]
            return s, s @ c_t

        last = jnp.arange(tokens) == cu_seqlens[seq + 1] - 1

        def scan_step(carry, inputs):
            s, finals = carry
            d_t, x_t, b_t, c_t, f, l_t, q, s0 = inputs
            s = jnp.exp(d_t[:, None] * a) * jnp.where(f, s0, s) + (d_t * x_t)[:, None] * b_t[None, :]
            finals = finals.at[q].set(jnp.where(l_t, s, finals[q]))
            return (s, finals), s @ c_t

        finals0 = jnp.zeros((cu_seqlens.shape[0] - 1, i_size, n), jnp.float32)
        (_, finals), y = jax.lax.scan(scan_step, (jnp.zeros((i_size, n), jnp.float32), finals0),
                                      (dt, xc, b, c, first, last, seq, ssm0))
        y = (y + D.astype(jnp.float32) * xc) * jax.nn.silu(z)
        out = dot(y.astype(h.dtype), out_w)
        # each sequence's last K - 1 conv inputs (zeros before its start: it started from zeros)
        ends = cu_seqlens[1:]
        rows = ends[:, None] - (k - 1) + jnp.arange(k - 1)[None, :]  # [B, K - 1]
        window = jnp.where((rows >= cu_seqlens[:-1, None])[..., None], x[jnp.maximum(rows, 0)], 0.0)
        new_conv = conv_state.at[state_indices].set(jnp.swapaxes(window, 1, 2).astype(conv_state.dtype))
        new_ssm = ssm_state.at[state_indices].set(finals.astype(ssm_state.dtype))
        return out, new_conv, new_ssm

    return mixer


CASES = (*CASES, *(BenchCase(f"mamba_mixer[{kind}]", "mamba_mixer", _mamba_mixer, _mamba_inputs, _mamba_cost,
                             _transformers_mamba, _jax_mamba, default=False, shape_of=_mamba_shape(kind),
                             matrix=True)
                   for kind in _MAMBA_SEQS))


# --- mamba_mixer2: the Mamba-2 mixer -------------------------------------------------------
# The bench size is (tokens, hidden): the mixer has intermediate 2 x hidden in heads of 64, 8 groups
# (1 when the heads do not split into 8), state 128, kernel 4 (Nemotron-H-8B at hidden 4096). Three
# cases: the tokens as a prefill of one sequence, of eight equal ones, and as a decode step (one
# token per sequence); the sizes are ``1024x4096`` for the prefills and ``64x4096`` for the
# decode step. Every sequence starts from a fresh state (no cache given: the op returns the final
# states). Peers: transformers'
# Mamba-2 torch path (its causal_conv1d_fn and mamba2_chunk_scan fallbacks and MambaRMSNormGated,
# equal-length sequences as one batch), torch.compile of the native body (the bench's own), and for
# jax the native body under jit (a lax.scan over tokens). Not run by default (the native body loops
# over tokens in Python for torch): ``--ops mamba_mixer2 --sizes 1024x256``.
_MIXER2_MODES = ("prefill", "prefill_8seq", "decode")


def _mixer2_seqs(mode: str, tokens: int) -> int:
    return {"prefill": 1, "prefill_8seq": 8, "decode": tokens}[mode]


def _mixer2_op(hidden: int):
    from dualop.ops import MambaMixer2

    heads = 2 * hidden // 64
    return MambaMixer2(hidden, 128, 4, 2 * hidden, True, False, n_groups=8 if heads % 8 == 0 else 1,
                       num_heads=heads, head_dim=64)


def _mixer2_inputs(mode: str):
    def make(shape, rng):
        from dualop.ops.mamba_mixer2 import mixer_case_inputs

        tokens, seqs = shape[0], _mixer2_seqs(mode, shape[0])
        if tokens % seqs:
            raise ValueError(f"mamba_mixer2[{mode}]: {tokens} tokens do not split into {seqs} equal sequences")
        return mixer_case_inputs(_mixer2_op(shape[-1]), tokens, rng, (tokens // seqs,) * seqs)

    return make


def _mixer2_cost(mode: str):
    """The GEMMs, the conv, the scan (about 6 flops per state element per token) and the norm; bytes:
    the weights, x and out, and each sequence's final states written in float32."""

    def cost(op, shape, itemsize) -> KernelCost:
        return _mixer2_call_cost(op, shape, itemsize, _mixer2_seqs(mode, shape[0]))

    return cost


def _mixer2_call_cost(op, shape, itemsize, seqs: int) -> KernelCost:
    tokens, hidden = shape
    inter, heads = op.intermediate_size, op.num_heads
    states = op.num_heads * op.head_dim * op.ssm_state_size + op.conv_dim * (op.conv_kernel_size - 1)
    flops = (2 * tokens * hidden * (op.projection_size + inter) + 2 * tokens * op.conv_dim * op.conv_kernel_size
             + 6 * tokens * heads * op.head_dim * op.ssm_state_size + 6 * tokens * inter)
    weights = sum(math.prod(s) for s in op.parameter_shapes().values())
    return KernelCost(flops=flops, transcendentals=tokens * (op.conv_dim + 2 * heads + inter),
                      bytes_accessed=(weights + 2 * tokens * hidden) * itemsize + 4 * seqs * states)


def _transformers_mixer2(op):
    """transformers' Mamba-2 torch path (its causal_conv1d_fn and mamba2_chunk_scan fallbacks, its
    MambaRMSNormGated) over the batch's equal-length sequences, returning what the op returns (out,
    the conv states, the SSD states in float32). The conv and the scan run on float32 copies and
    their outputs are cast to x's dtype, where the engine's kernels round them (transformers' own
    16-bit path keeps the scan in float32 through the norm and rounds elsewhere, so its 16-bit
    results differ from the engine's by more than the tolerance table)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.mamba2 import modeling_mamba2 as hf

    inter, conv_dim, heads = op.intermediate_size, op.conv_dim, op.num_heads
    gn, k = op.n_groups * op.ssm_state_size, op.conv_kernel_size
    norm = hf.MambaRMSNormGated(inter, inter // op.n_groups, op.norm.eps)

    def run(x, w_in, w_conv, b_conv, dt_bias, a_log, d, w_norm, w_out, b_in, b_out, conv_state, ssm_state, cu):
        seqs, f32 = cu.shape[0] - 1, torch.float32
        length = x.shape[0] // seqs
        z, xbc, dt = F.linear(x, w_in, b_in).view(seqs, length, -1).split([inter, conv_dim, heads], dim=-1)
        xbc = xbc.transpose(1, 2).float()
        conv_out = F.pad(xbc, (max(0, k - 1 - length), 0))[..., -(k - 1):]
        bias = None if b_conv is None else b_conv.float()
        xbc = hf.causal_conv1d_fn(xbc, w_conv.float(), bias, activation=op.activation).to(x.dtype).transpose(1, 2)
        xs, b, c = (t.float() for t in xbc.split([inter, gn, gn], dim=-1))
        y, final = hf.mamba2_chunk_scan(
            xs.reshape(seqs, length, heads, op.head_dim), dt.float(), -torch.exp(a_log.float()),
            b.reshape(seqs, length, op.n_groups, -1), c.reshape(seqs, length, op.n_groups, -1),
            chunk_size=op.chunk_size, D=d.to(f32), dt_bias=dt_bias.to(f32), dt_softplus=True,
            dt_limit=op.time_step_limit, return_final_states=True)
        norm.weight.data = w_norm
        y = norm(y.reshape(seqs, length, inter).to(x.dtype), z)
        return F.linear(y, w_out, b_out).reshape(x.shape[0], -1), conv_out, final.float()

    return run


def _jax_mixer2(op):
    return op.forward_native


CASES = (*CASES, *(BenchCase(f"mamba_mixer2[{mode}]", "mamba_mixer2", _mixer2_op, _mixer2_inputs(mode),
                             _mixer2_cost(mode),
                             _transformers_mixer2, _jax_mixer2, default=False, matrix=True)
                   for mode in _MIXER2_MODES))


# --- plamo2_mamba_mixer: PLaMo 2's Mamba mixer over packed sequences ---------------------
# The bench size (tokens, hidden) runs ``tokens`` packed into eight equal sequences (fewer tokens:
# one token each, a decode step), each in its own slot of the two state caches: ``1024x4096`` is the
# issue's prefill of eight sequences. (One case only: each case costs ~50 s of jit compiles in
# tests/test_bench.py's agreement sweep; one-sequence prefill and the 64-sequence decode are the
# same case with ``_plamo2_shape(lambda tokens: 1)`` / ``(lambda tokens: tokens)``.) Widths from
# hidden as PLaMo 2-8B's (hidden 4096: 64 heads of 128, d_state 64, conv 4, time-step rank 256):
# ``hidden // 64`` heads of 128, d_state 64, rank ``max(64, hidden // 16)``. The sequences start
# from zeros (``has_initial_state`` False: repeated calls then compute the same thing; a step from
# a cached state costs the same). Peers: transformers' own Mamba-2 functions in PLaMo 2's wiring
# (``causal_conv1d_fn``/``_update`` and ``mamba2_chunk_scan``/``mamba2_selective_state_update``,
# their torch fallbacks; PLaMo 2 itself is not in transformers) and a hand-written jax version
# (``vmap`` over the sequences of a ``lax.scan`` over their tokens). Not run by default; ask with
# ``--ops plamo2_mamba_mixer --sizes 1024x4096``.
PLAMO2_HEAD_DIM, PLAMO2_STATE, PLAMO2_CONV = 128, 64, 4


def _plamo2_widths(hidden: int) -> tuple[int, int, int]:
    """(heads, head_dim, rank) for a hidden size, as PLaMo 2-8B's."""
    return max(1, hidden // 64), PLAMO2_HEAD_DIM, max(64, hidden // 16)


def _plamo2(hidden: int):
    from dualop.ops import Plamo2MambaMixer

    heads, head_dim, rank = _plamo2_widths(hidden)
    return Plamo2MambaMixer(hidden, PLAMO2_STATE, PLAMO2_CONV, heads, head_dim, time_step_rank=rank)


def _plamo2_shape(seqs_of: Callable[[int], int]):
    def shape_of(size: tuple[int, ...]) -> tuple[int, ...]:
        tokens, hidden = size
        return (tokens, seqs_of(tokens), hidden)

    return shape_of


def _plamo2_inputs(shape, rng):
    tokens, seqs, hidden = shape
    heads, head_dim, rank = _plamo2_widths(hidden)
    inner, n = heads * head_dim, PLAMO2_STATE
    return (
        _normal((tokens, hidden), rng), _normal((2 * inner, hidden), rng, hidden ** -0.5),
        _normal((inner, PLAMO2_CONV), rng, 0.5), _normal((2 * n + rank, inner), rng, inner ** -0.5),
        _normal((heads, rank), rng, rank ** -0.5), _normal((heads,), rng, 0.5) - 1.0,
        np.log(np.arange(1, heads + 1, dtype=np.float32)), 1.0 + _normal((heads,), rng, 0.1),
        1.0 + _normal((rank,), rng, 0.2), 1.0 + _normal((n,), rng, 0.2), 1.0 + _normal((n,), rng, 0.2),
        _normal((hidden, inner), rng, inner ** -0.5),
        np.zeros((seqs, inner, PLAMO2_CONV - 1), np.float32), np.zeros((seqs, heads, head_dim, n), np.float32),
        *_fresh_equal_sequences(tokens, seqs),
    )


def _plamo2_cost(op, shape, itemsize) -> KernelCost:
    tokens, seqs, hidden = shape
    return cost_model.plamo2_mamba_mixer_cost(tokens, seqs, hidden, op.num_heads, op.head_dim, op.ssm_state_size,
                                              op.time_step_rank, op.conv_kernel_size, itemsize)


def _torch_transformers_plamo2(op):
    """The mixer from transformers' Mamba-2 functions (equal-length sequences; a decode step when
    each has one token), called with the op's arguments; caches updated in place. The functions
    get float32 operands and their results are rounded where the op rounds (after the conv, the
    norms, each matmul and the gated scan), so 16-bit runs compare too."""
    import torch
    import torch.nn.functional as F
    from transformers.models.mamba2 import modeling_mamba2 as m2

    heads, head_dim, n, eps, inner = op.num_heads, op.head_dim, op.ssm_state_size, op.rms_norm_eps, op.intermediate_size

    def mixer(h, w_in, w_conv, w_bcdt, w_dt, dt_bias, a_log, d, w_dtn, w_bn, w_cn, w_out, conv_cache, ssm_cache,
              cu_seqlens, state_indices, has_initial_state):
        dtype, f32 = h.dtype, torch.float32
        batch = state_indices.shape[0]
        length = h.shape[0] // batch
        slots = state_indices.long()
        keep = has_initial_state[:, None, None]
        conv = torch.where(keep, conv_cache[slots], 0).float()
        ssm = torch.where(keep[..., None], ssm_cache[slots], 0).float()
        proj = F.linear(h, w_in).reshape(batch, length, 2 * inner)
        gate, x = proj[..., :inner].float(), proj[..., inner:].float()
        if length == 1:
            xc = m2.causal_conv1d_update(x.transpose(1, 2), conv, w_conv.float(), None, activation="silu")
        else:
            full = torch.cat([conv, x.transpose(1, 2)], dim=2)
            xc = m2.causal_conv1d_fn(full, w_conv.float(), None, activation="silu")[:, :, -length:]
            conv = full[:, :, -(w_conv.shape[1] - 1):]
        xc = xc.transpose(1, 2).to(dtype)
        bcdt = F.linear(xc, w_bcdt)

        def norm(v, w):
            return (F.rms_norm(v.float(), (v.shape[-1],), None, eps).to(dtype).float() * w.float()).to(dtype)

        bv, cv = norm(bcdt[..., :n], w_bn).float(), norm(bcdt[..., n:2 * n], w_cn).float()
        dt = F.linear(norm(bcdt[..., 2 * n:], w_dtn), w_dt).float()
        a, xf = -torch.exp(a_log.float()), xc.float()
        if length == 1:
            y = m2.mamba2_selective_state_update(
                ssm, xf[:, 0].reshape(batch, heads, head_dim), dt[:, 0, :, None].expand(-1, -1, head_dim),
                a[:, None, None].expand(-1, head_dim, n), bv[:, 0, None], cv[:, 0, None],
                D=d.float()[:, None].expand(-1, head_dim), dt_bias=dt_bias.float()[:, None].expand(-1, head_dim),
                dt_softplus=True, z=gate[:, 0].reshape(batch, heads, head_dim))
        else:
            y, ssm = m2.mamba2_chunk_scan(
                xf.reshape(batch, length, heads, head_dim), dt, a, bv[:, :, None], cv[:, :, None],
                chunk_size=op.chunk_size, D=d.float(), dt_bias=dt_bias.float(), initial_states=ssm, dt_softplus=True,
                return_final_states=True)
            y = y.reshape(batch, length, inner) * F.silu(gate)
        conv_cache[slots] = conv.to(conv_cache.dtype)
        ssm_cache[slots] = ssm.to(ssm_cache.dtype)
        return F.linear(y.reshape(h.shape[0], inner).to(dtype), w_out), conv_cache, ssm_cache

    return mixer


def _jax_plamo2(op):
    """Hand-written jax: equal-length sequences, ``vmap`` over them of a ``lax.scan`` over tokens."""
    import jax
    import jax.numpy as jnp

    heads, head_dim, n, eps, inner = op.num_heads, op.head_dim, op.ssm_state_size, op.rms_norm_eps, op.intermediate_size
    f32 = jnp.float32

    def mixer(h, w_in, w_conv, w_bcdt, w_dt, dt_bias, a_log, d, w_dtn, w_bn, w_cn, w_out, conv_cache, ssm_cache,
              cu_seqlens, state_indices, has_initial_state):
        dtype, tokens = h.dtype, h.shape[0]
        batch = state_indices.shape[0]
        length, width = tokens // batch, w_conv.shape[1]

        def mm(v, w):
            return jnp.dot(v, w.T.astype(v.dtype), preferred_element_type=f32).astype(dtype)

        def rms(v, w):
            vf = v.astype(f32)
            normed = (vf * jax.lax.rsqrt(jnp.mean(vf * vf, axis=-1, keepdims=True) + eps)).astype(dtype)
            return (normed.astype(f32) * w.astype(f32)).astype(dtype)

        proj = mm(h, w_in)
        gate, x = proj[:, :inner], proj[:, inner:]
        conv0 = jnp.where(has_initial_state[:, None, None], conv_cache[state_indices], 0).astype(f32)
        ssm0 = jnp.where(has_initial_state[:, None, None, None], ssm_cache[state_indices], 0).astype(f32)
        full = jnp.concatenate([conv0.transpose(0, 2, 1), x.reshape(batch, length, inner).astype(f32)], axis=1)
        xc = sum(full[:, k:k + length] * w_conv[:, k].astype(f32) for k in range(width))
        xc = jax.nn.silu(xc).astype(dtype).reshape(tokens, inner)
        bcdt = mm(xc, w_bcdt)
        bv, cv = rms(bcdt[:, :n], w_bn).astype(f32), rms(bcdt[:, n:2 * n], w_cn).astype(f32)
        delta = jax.nn.softplus(mm(rms(bcdt[:, 2 * n:], w_dtn), w_dt).astype(f32) + dt_bias.astype(f32))
        a = -jnp.exp(a_log.astype(f32))
        xh = xc.astype(f32).reshape(batch, length, heads, head_dim)

        def sequence(state, xs, ds, bs, cs):
            def step(s, inputs):
                x_t, d_t, b_t, c_t = inputs
                s = jnp.exp(d_t * a)[:, None, None] * s + (d_t[:, None] * x_t)[:, :, None] * b_t
                return s, jnp.einsum("hpn,n->hp", s, c_t)

            return jax.lax.scan(step, state, (xs, ds, bs, cs))

        final, ys = jax.vmap(sequence)(ssm0, xh, delta.reshape(batch, length, heads), bv.reshape(batch, length, n),
                                       cv.reshape(batch, length, n))
        gf = gate.astype(f32).reshape(batch, length, heads, head_dim)
        y = (ys + d.astype(f32)[:, None] * xh) * jax.nn.silu(gf)
        out = mm(y.reshape(tokens, inner).astype(dtype), w_out)
        last_inputs = full[:, -(width - 1):].transpose(0, 2, 1)
        conv_cache = conv_cache.at[state_indices].set(last_inputs.astype(conv_cache.dtype))
        ssm_cache = ssm_cache.at[state_indices].set(final.astype(ssm_cache.dtype))
        return out, conv_cache, ssm_cache

    return mixer


CASES = (*CASES, BenchCase("plamo2_mamba_mixer[prefill_8seq]", "plamo2_mamba_mixer", _plamo2, _plamo2_inputs, _plamo2_cost,
                           _torch_transformers_plamo2, _jax_plamo2, default=False,
                           shape_of=_plamo2_shape(lambda tokens: min(8, tokens)), matrix=True))


# --- selective_scan: Mamba-1's scan core -------------------------------------------------
# The bench size (R, I) is R tokens over I channels with N = 16 (Mamba-1's state size; Falcon-Mamba-7B
# and Jamba have I = 8192, so pass a smaller I on this host, e.g. ``--sizes 1024x512``): a prefill of
# R tokens as one sequence (``[prefill]``) or eight equal ones (``[prefill_8seq]``), and a decode step
# of R sequences (``[decode]``, ``--sizes 64x512``). Every sequence starts fresh (no initial state)
# and writes its slot: torch updates the cache in place, and the bench compares each call's output
# with forward_native's on the same inputs, so repeated calls must not change them. Peers: a
# torch loop like transformers' MambaMixer.slow_forward (its scan is inline there, so it cannot be
# called on its own: exp(Δ A) and Δ B x for a whole sequence first, then the token loop), a jax
# ``lax.scan`` over the packed tokens, and torch.compile of the native body (a Python token loop:
# slow to compile at long T). Not run by default.
SCAN_STATE = 16
_SCAN_SEQS = {"prefill": 1, "prefill_8seq": 8, "decode": None}


def _scan_shape(kind: str):
    def shape_of(size):
        tokens, dim = size
        return (tokens, _SCAN_SEQS[kind] or tokens, dim)

    return shape_of


def _scan_op(dim: int):
    from dualop.ops import SelectiveScan

    return SelectiveScan(dim, SCAN_STATE)


def _scan_inputs(shape, rng):
    from dualop.ops.selective_scan import make_scan_inputs

    tokens, seqs, dim = shape
    lens = np.full(seqs, tokens // seqs)
    lens[-1] += tokens - lens.sum()
    return make_scan_inputs((tokens, seqs, dim, SCAN_STATE), rng, seq_lens=lens, slots=np.arange(seqs),
                            has_initial=np.zeros(seqs, bool))


def _scan_cost(op, shape, itemsize) -> KernelCost:
    tokens, seqs, dim = shape
    return cost_model.selective_scan_cost(tokens, dim, op.state_size, seqs, itemsize)


def _torch_scan_loop(op):
    """transformers' slow_forward scan per sequence, then the cache write."""
    import torch
    import torch.nn.functional as F

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        f32 = torch.float32
        delta = F.softplus(dt.to(f32) + dt_bias.to(f32))
        ys = []
        bounds = cu_seqlens.tolist()
        for b, slot in enumerate(state_indices.tolist()):
            lo, hi = bounds[b], bounds[b + 1]
            h = ssm_state[slot].to(f32) if bool(has_initial_state[b]) else x.new_zeros(A.shape, dtype=f32)
            d = delta[lo:hi]
            decay = torch.exp(d[:, :, None] * A[None])  # [L, I, N]
            inject = (d * x[lo:hi].to(f32))[:, :, None] * B[lo:hi, None, :].to(f32)
            rows = []
            for t in range(hi - lo):
                h = decay[t] * h + inject[t]
                rows.append(h @ C[lo + t].to(f32))
            ssm_state[slot] = h.to(ssm_state.dtype)
            ys.append(torch.stack(rows))
        y = torch.cat(ys) + x.to(f32) * D.to(f32)
        return (y * F.silu(z.to(f32))).to(x.dtype), ssm_state

    return scan


def _jax_scan(op):
    """A ``lax.scan`` over the packed tokens, restarting the state at each sequence's first token."""
    import jax
    import jax.numpy as jnp

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        f32 = jnp.float32
        tokens = x.shape[0]
        seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(tokens), side="right")
        first = jnp.arange(tokens) == cu_seqlens[seq]
        init = jnp.where(has_initial_state[:, None, None], ssm_state[state_indices].astype(f32), 0.0)
        delta = jax.nn.softplus(dt.astype(f32) + dt_bias.astype(f32))

        last = jnp.arange(tokens) == cu_seqlens[seq + 1] - 1

        def step(carry, inputs):
            h, finals = carry
            s, f, e, d, xt, bt, ct = inputs
            h = jnp.where(f, init[s], h)
            h = jnp.exp(d[:, None] * A) * h + (d * xt)[:, None] * bt[None, :]
            finals = jnp.where(e, finals.at[s].set(h), finals)
            return (h, finals), h @ ct

        (_, finals), ys = jax.lax.scan(step, (jnp.zeros(A.shape, f32), init),
                                       (seq, first, last, delta, x.astype(f32), B.astype(f32), C.astype(f32)))
        cache = ssm_state.at[state_indices].set(finals.astype(ssm_state.dtype))
        y = (ys + x.astype(f32) * D.astype(f32)) * jax.nn.silu(z.astype(f32))
        return y.astype(x.dtype), cache

    return jax.jit(scan)


CASES = (*CASES, *(BenchCase(f"selective_scan[{kind}]", "selective_scan", _scan_op, _scan_inputs, _scan_cost,
                             _torch_scan_loop, _jax_scan, default=False, shape_of=_scan_shape(kind))
                   for kind in _SCAN_SEQS))


# --- ssd_chunk_scan: Mamba-2's SSD scan core ---------------------------------------------
# The bench size (tokens, sequences) is a serving batch of equal-length sequences: ``1024x1`` and
# ``1024x8`` prefills, ``64x64`` a decode step (each sequence continuing from its cached state).
# Widths are Mamba-2's head layout scaled to this host: 16 heads of 64 in 2 groups of state 64
# (Nemotron-H-8B has 128 heads, 8 groups of 128), chunks of 256. Peers: transformers'
# ``mamba2_chunk_scan`` (the chunked scan its Mamba2Mixer's torch path runs) on the sequences as a
# batch, and a hand-written jax chunked version of the same math. In 16-bit dtypes transformers adds
# dt_bias, takes the softplus and clamps in the input dtype (dt rounded before the float32 scan; the
# native body widens dt first, as the engine's kernels do), so the bench's check reports it outside
# the bfloat16 tolerance (an error record, not timed; tests/test_bench.py expects it).
SSD_BENCH_WIDTHS = dict(heads=16, head_dim=64, state=64, groups=2, chunk=256)


def _ssd_op(_dim: int):
    from dualop.ops import SSDChunkScan

    w = SSD_BENCH_WIDTHS
    return SSDChunkScan(w["heads"], w["head_dim"], w["state"], w["groups"], chunk_size=w["chunk"])


def _ssd_shape(size: tuple[int, ...]) -> tuple[int, ...]:
    w = SSD_BENCH_WIDTHS
    # more sequences than tokens cannot be: a size such as 8x64 (the every-case sweep's) is 8 tokens
    # as a decode step of 8 sequences
    return (size[0], min(size[1], size[0]), w["heads"], w["head_dim"], w["state"], w["groups"])


def _ssd_bench_inputs(shape, rng):
    """The check case's generator with equal-length sequences, no padding slot, no z. Every
    sequence starts from zeros (``has_initial_state`` False) so that repeated timed calls, which
    update the cache in place on torch, all compute the same outputs; a cached start costs the
    same work (one more read of each state)."""
    from dualop.ops.ssd import make_ssd_inputs

    tokens, seqs = shape[0], shape[1]
    arrays = list(make_ssd_inputs(shape, rng, padding=False))
    arrays[6] = None  # no z gate (transformers' scan has none)
    arrays[9:12] = _fresh_equal_sequences(tokens, seqs)
    return tuple(arrays)


def _ssd_cost(op, shape, itemsize) -> KernelCost:
    tokens, seqs, heads, head_dim, state, groups = shape
    return cost_model.ssd_chunk_scan_cost(tokens, heads, head_dim, state, groups, seqs,
                                          min(op.chunk_size, tokens), itemsize)


def _transformers_ssd(op):
    """transformers' chunked scan on the equal-length sequences as a [B, L] batch."""
    import torch
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        seqs = state_indices.shape[0]
        batched = [t.reshape(seqs, -1, *t.shape[1:]) for t in (x, dt, B, C)]
        y, finals = mamba2_chunk_scan(*batched[:2], A, *batched[2:], op.chunk_size, D=D, dt_bias=dt_bias,
                                      initial_states=torch.where(has_initial_state[:, None, None, None],
                                                                 ssm_state[state_indices.long()], 0.0),
                                      dt_softplus=op.delta_softplus,
                                      dt_limit=op.dt_limit, return_final_states=True)
        ssm_state[state_indices.long()] = finals.to(ssm_state.dtype)
        return y.reshape(x.shape).to(x.dtype), ssm_state

    return scan


def _jax_ssd(op):
    """A hand-written jax chunked SSD (the Mamba-2 paper's minimal form) over the equal-length
    sequences as a batch: intra-chunk masked C Bᵀ, chunk states, a scan over chunks, outputs
    from the carried states."""
    import jax
    import jax.numpy as jnp

    def segsum(a):  # [..., L] -> [..., L, L]: sum of a over (s, t], -inf above the diagonal
        length = a.shape[-1]
        mask = jnp.tril(jnp.ones((length, length), bool), -1)
        seg = jnp.cumsum(jnp.where(mask, a[..., :, None], 0.0), axis=-2)
        return jnp.where(jnp.tril(jnp.ones((length, length), bool)), seg, -jnp.inf)

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        seqs, heads = state_indices.shape[0], x.shape[1]
        rep = heads // B.shape[1]
        f32 = jnp.float32
        delta = jax.nn.softplus(dt.astype(f32) + dt_bias.astype(f32))
        delta = jnp.clip(delta, *op.dt_limit)
        chunk = min(op.chunk_size, x.shape[0] // seqs)

        def chunks(t):  # [T, ...] -> [B, c, L, ...]
            return t.reshape(seqs, -1, chunk, *t.shape[1:])

        xs = chunks(x.astype(f32) * delta[..., None])
        da = chunks(delta * A).transpose(0, 1, 3, 2)  # [B, c, H, L]
        bs = chunks(jnp.repeat(B.astype(f32), rep, axis=1))
        cs = chunks(jnp.repeat(C.astype(f32), rep, axis=1))
        cum = jnp.cumsum(da, axis=-1)
        y_diag = jnp.einsum("bclhn,bcshn,bchls,bcshp->bclhp", cs, bs, jnp.exp(segsum(da)), xs)
        decay_states = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(da, -1), axis=-1), -1) - da)  # over (l, L)
        states = jnp.einsum("bclhn,bchl,bclhp->bchpn", bs, decay_states, xs)

        def step(h, inputs):
            s, total = inputs
            return jnp.exp(total)[..., None, None] * h + s, h

        h0 = jnp.where(has_initial_state[:, None, None, None], ssm_state[state_indices].astype(f32), 0.0)
        final, entering = jax.lax.scan(step, h0, (states.transpose(1, 0, 2, 3, 4),
                                                   cum[..., -1].transpose(1, 0, 2)))
        y_off = jnp.einsum("bclhn,cbhpn,bchl->bclhp", cs, entering, jnp.exp(cum))
        y = (y_diag + y_off).reshape(x.shape) + D.astype(f32)[:, None] * x.astype(f32)
        return y.astype(x.dtype), ssm_state.at[state_indices].set(final.astype(ssm_state.dtype))

    return scan


CASES = (*CASES, BenchCase("ssd_chunk_scan", "ssd_chunk_scan", _ssd_op, _ssd_bench_inputs, _ssd_cost,
                           _transformers_ssd, _jax_ssd, default=False, shape_of=_ssd_shape, matrix=True))


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


CASES = (*CASES, BenchCase("ragged_paged_mla_attention[decode]", "ragged_paged_mla_attention", _mla_op,
                           _mla_decode_inputs, _mla_decode_cost, _torch_mla_sdpa, _jax_mla_decode, default=False,
                           shape_of=_mla_decode_shape, matrix=True))


# Cases an op module declares (its ``bench_cases()``) replace the ones above with the same label.
_LISTED_HERE = CASES


def _all_cases() -> tuple[BenchCase, ...]:
    declared = collect("bench_cases")
    labels = {c.label for c in declared}
    return (*(c for c in _LISTED_HERE if c.label not in labels), *declared)


CASES = _all_cases()
DEFAULT_CASES = tuple(c.label for c in CASES if c.default)
