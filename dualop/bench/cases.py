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

__all__ = ["BenchCase", "CASES", "DEFAULT_CASES", "ITEMSIZE", "select_cases", "rows_of"]

# The dtypes the bench runs, and their bytes per element (for the cost model, without a framework).
ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows of a row-wise op: the product of every dim but the last."""
    return math.prod(shape[:-1])


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One way to call one op.

    label: the name in tables and ``--ops`` (``rms_norm[residual]``); op_name: the registered op's
    name (``--ops`` matches either). make_op(hidden): the op for inputs whose last dim is
    ``hidden``. make_inputs(shape, rng): float32 numpy positional arguments. cost(op, shape,
    itemsize): the kernel's cost model for one call. torch_builtin(op) / jax_handwritten(op): the
    peer's function, called with the same arguments as the op, or None when there is none.
    default: run when ``--ops`` is not given. shape_of: see ``input_shape``. matrix: the flops
    are matmuls on the matrix units (the roofline then takes the device's 16-bit matrix peak for
    16-bit inputs, rather than its float32 vector peak).
    """

    label: str
    op_name: str
    make_op: Callable[[int], Any]
    make_inputs: Callable[[tuple[int, ...], np.random.Generator], tuple]
    cost: Callable[[Any, tuple[int, ...], int], KernelCost]
    torch_builtin: Callable[[Any], Callable[..., Any]] | None = None
    jax_handwritten: Callable[[Any], Callable[..., Any]] | None = None
    default: bool = True
    shape_of: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None
    matrix: bool = False

    def input_shape(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this case runs for a bench size (``small``, ``RxC``, ...): the size itself,
        the shape of x, for row-wise ops; ``shape_of(size)`` for a case whose inputs are not rows
        (attention over a paged cache), whose ``make_inputs`` and cost read that shape."""
        return tuple(self.shape_of(tuple(size))) if self.shape_of is not None else tuple(size)

    def kernel_cost(self, shape: tuple[int, ...], dtype: str) -> KernelCost:
        """The cost model's numbers for one call on ``x`` of ``shape`` in ``dtype``."""
        return self.cost(self.make_op(shape[-1]), tuple(shape), ITEMSIZE[dtype])

    def bytes_moved(self, shape: tuple[int, ...], itemsize: int) -> int:
        """Bytes one call must move: every input read once, every output written once."""
        return self.cost(self.make_op(shape[-1]), tuple(shape), itemsize).bytes_accessed

    def inputs(self, shape: tuple[int, ...], dtype: str, frontend: str, rng: np.random.Generator) -> tuple:
        """The positional arguments as ``frontend`` arrays in ``dtype``."""
        from dualop.testing import to_frontend

        return tuple(to_frontend(a, frontend, dtype) for a in self.make_inputs(tuple(shape), rng))


# --- inputs ------------------------------------------------------------------------------------


def _normal(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    out = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        out *= np.float32(scale)
    return out


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
    (float32 until the second matmul); its bfloat16 timings are in BENCHMARKS.md."""
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


# --- logits processor (issue 11) -------------------------------------------------------------------
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


# --- vocab_parallel_embedding: the token embedding gather (issue 11) --------------------------------
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


# --- selective_scan: Mamba-1's scan core (issue 12) -------------------------------------------------
# The bench size (R, I) is R tokens over I channels with N = 16 (Mamba-1's state size; Falcon-Mamba-7B
# and Jamba have I = 8192, so pass a smaller I on this host, e.g. ``--sizes 1024x512``): a prefill of
# R tokens as one sequence (``[prefill1]``) or eight equal ones (``[prefill8]``), and a decode step
# of R sequences (``[decode]``, ``--sizes 64x512``). Every sequence starts fresh (no initial state)
# and writes its slot: torch updates the cache in place, and the bench compares each call's output
# with forward_native's on the same inputs, so repeated calls must not change them. Peers: a
# torch loop like transformers' MambaMixer.slow_forward (its scan is inline there, so it cannot be
# called on its own: exp(Δ A) and Δ B x for a whole sequence first, then the token loop), a jax
# ``lax.scan`` over the packed tokens, and torch.compile of the native body (a Python token loop:
# slow to compile at long T). Not run by default.
SCAN_STATE = 16
_SCAN_SEQS = {"prefill1": 1, "prefill8": 8, "decode": None}


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
    return make_scan_inputs((tokens, dim, SCAN_STATE, seqs), rng, seq_lens=lens, slots=np.arange(seqs),
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
