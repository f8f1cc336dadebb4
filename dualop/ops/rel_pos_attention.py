"""SAM-style encoder attention with decomposed relative positions: ``RelPosAttention`` (registered
``rel_pos_attention``), the reference serving engine's layer of DeepSeek-OCR's SAM image encoder and
transformers' ``SamVisionAttention``.

``op = RelPosAttention(dim, num_heads=8, qkv_bias=True, use_rel_pos=False, rel_pos_zero_init=True,
input_size=None)``;
``out = op(x [B, H, W, dim], qkv_weight [3 dim, dim], qkv_bias [3 dim] | None, proj_weight [dim, dim],
proj_bias [dim], rel_pos_h=None [2 input_size[0] - 1, head_dim], rel_pos_w=None [2 input_size[1] - 1,
head_dim])`` -> ``[B, H, W, dim]``:

    q, k, v = split(x @ qkv_weight.T + qkv_bias)          # per head, head_dim = dim / num_heads
    logits[(h, w), (h', w')] = scale q . k + q . Rh[h, h'] + q . Rw[w, w']
    out = proj(softmax(logits) @ v)

with ``scale = head_dim ** -0.5`` and the relative-position terms only when ``use_rel_pos`` (the
unscaled query against the tables). ``Rh[h, h'] = T_h[h - h' + H - 1]``, where ``T_h`` is
``rel_pos_h`` linearly resized (align_corners=False, as ``F.interpolate`` does) to ``2 H - 1`` rows:
the table is used as it is when H equals ``input_size[0]`` and interpolated otherwise (a window
size or image size other than the table's), likewise ``Rw`` along W.

``qkv_bias`` is required with ``qkv_bias=True`` and must be None otherwise; ``proj_bias`` is
required (the engine's and transformers' ``proj`` Linear has one); the tables are required with
``use_rel_pos=True`` and must be None otherwise. Every array has ``x``'s dtype. Everything is
computed in float32, one cast of the output to ``x``'s dtype. ``rel_pos_zero_init`` only concerns
the layers' initial tables (``dualop.torch.layers.RelPosAttention``); the op holds no parameters.

The kernels (Pallas on TPU, Triton on GPUs, C++ on the CPU) run the attention as a flash loop over
(query tile x key tile) with an online softmax; the per-query decomposed terms ``q . Rh[h]`` ([S, H])
and ``q . Rw[w]`` ([S, W]) come from the vendor GEMM beside the projections (``rel_pos_terms``), and
each tile forms its [tile, tile] bias from them, so the S x S bias is never stored.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.kernels.rel_pos_math import project_out, project_qkv, rel_pos_terms
from dualop.ops._checks import check_array, check_optional_like, check_positive_int, decline_if_recording
from dualop.platforms import frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["RelPosAttention"]

OP = "rel_pos_attention"
_PALLAS = KernelRef("dualop.kernels.pallas.rel_pos_attention", "rel_pos_attention")
_TRITON = KernelRef("dualop.kernels.cuda.rel_pos_attention", "rel_pos_attention")
_CPU = KernelRef("dualop.kernels.cpu.rel_pos_attention", "rel_pos_attention")


def rel_pos_attention_cost(batch: int, height: int, width: int, dim: int, num_heads: int, use_rel_pos: bool,
                           itemsize: int) -> KernelCost:
    """One call: the two projections (2 x 4 dim² flops per token), ``q . k`` and ``P @ V`` (4 S² dim
    per image), with relative positions the decomposed terms (2 S (H + W) dim) and two adds per
    logit; one exp per logit. Bytes: x, the weights and the output once."""
    s = height * width
    tokens = batch * s
    flops = 8 * tokens * dim * dim + 4 * batch * s * s * dim
    if use_rel_pos:
        flops += 2 * tokens * (height + width) * dim + 2 * batch * num_heads * s * s
    weights = 4 * dim * dim + 4 * dim + (2 * (height + width) * dim // num_heads if use_rel_pos else 0)
    return KernelCost(flops=flops, transcendentals=batch * num_heads * s * s,
                      bytes_accessed=(2 * tokens * dim + weights) * itemsize)


@CustomOp.register(OP)
class RelPosAttention(CustomOp):
    """Multi-head attention over an image grid with decomposed relative positions (see the module
    docstring for the contract)."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = True, use_rel_pos: bool = False,
                 rel_pos_zero_init: bool = True, input_size: tuple[int, int] | None = None, *,
                 enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        check_positive_int(OP, "dim", dim)
        check_positive_int(OP, "num_heads", num_heads)
        if dim % num_heads:
            raise ValueError(f"{OP}: dim={dim} must be a multiple of num_heads={num_heads}")
        for name, flag in (("qkv_bias", qkv_bias), ("use_rel_pos", use_rel_pos),
                           ("rel_pos_zero_init", rel_pos_zero_init)):
            if not isinstance(flag, bool):
                raise TypeError(f"{OP}: {name} must be a bool, got {flag!r}")
        if input_size is not None:
            if not isinstance(input_size, (tuple, list)) or len(input_size) != 2:
                raise ValueError(f"{OP}: input_size must be None or (height, width), got {input_size!r}")
            input_size = (check_positive_int(OP, "input_size[0]", input_size[0]),
                          check_positive_int(OP, "input_size[1]", input_size[1]))
        if use_rel_pos and input_size is None:
            raise ValueError(f"{OP}: use_rel_pos=True needs input_size (height, width): the tables' sizes")
        self.dim = int(dim)
        self.num_heads = int(num_heads)
        self.head_dim = self.dim // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv_bias = qkv_bias
        self.use_rel_pos = use_rel_pos
        self.rel_pos_zero_init = rel_pos_zero_init
        self.input_size = input_size

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, qkv_bias={self.qkv_bias}, "
                f"use_rel_pos={self.use_rel_pos}, input_size={self.input_size}")

    def table_shapes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The shapes of ``rel_pos_h`` and ``rel_pos_w`` (None without relative positions)."""
        if not self.use_rel_pos:
            return None
        return tuple((2 * size - 1, self.head_dim) for size in self.input_size)

    def check_inputs(self, x: Any, qkv_weight: Any = None, qkv_bias: Any = None, proj_weight: Any = None,
                     proj_bias: Any = None, rel_pos_h: Any = None, rel_pos_w: Any = None) -> None:
        fe = check_array(OP, "x", x, min_ndim=4)
        dim = self.dim
        if x.ndim != 4 or x.shape[-1] != dim:
            raise ValueError(f"{OP}: argument 'x' has shape {tuple(x.shape)}; expected [B, H, W, {dim}]")
        for name, value, shape in (("qkv_weight", qkv_weight, (3 * dim, dim)), ("proj_weight", proj_weight, (dim, dim)),
                                   ("proj_bias", proj_bias, (dim,))):
            if value is None:
                raise TypeError(f"{OP}: argument '{name}' is required; expected an array of shape {shape}")
            check_optional_like(OP, name, value, "x", x, fe, shape=shape, same_dtype=True)
        if (qkv_bias is None) == self.qkv_bias:
            want = "is required (qkv_bias=True)" if self.qkv_bias else "must be None (qkv_bias=False)"
            raise ValueError(f"{OP}: argument 'qkv_bias' {want}; expected shape {(3 * dim,)}")
        check_optional_like(OP, "qkv_bias", qkv_bias, "x", x, fe, shape=(3 * dim,), same_dtype=True)
        shapes = self.table_shapes()
        for i, (name, value) in enumerate((("rel_pos_h", rel_pos_h), ("rel_pos_w", rel_pos_w))):
            if shapes is None:
                if value is not None:
                    raise ValueError(f"{OP}: argument '{name}' must be None (use_rel_pos=False)")
                continue
            if value is None:
                raise ValueError(f"{OP}: argument '{name}' is required (use_rel_pos=True); expected shape {shapes[i]}")
            check_optional_like(OP, name, value, "x", x, fe, shape=shapes[i], same_dtype=True)

    def forward_native(self, x: Any, qkv_weight: Any, qkv_bias: Any = None, proj_weight: Any = None,
                       proj_bias: Any = None, rel_pos_h: Any = None, rel_pos_w: Any = None) -> Any:
        xp = array_namespace(x)
        b, hh, ww, _ = x.shape
        s = hh * ww
        if b * s == 0:
            return x * 0  # nothing to attend; a new array, as every other call returns
        q, k, v = project_qkv(xp, x, qkv_weight, qkv_bias, self.num_heads)
        logits = xp.einsum("bnsd,bntd->bnst", q, k) * self.scale
        if self.use_rel_pos:
            rel_h, rel_w = rel_pos_terms(xp, q, rel_pos_h, rel_pos_w, hh, ww)
            n = self.num_heads
            logits = (logits.reshape(b, n, s, hh, ww) + rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, n, s, s)
        p = xp.exp(logits - xp.amax(logits, axis=-1, keepdims=True))
        attended = xp.einsum("bnst,bntd->bnsd", p, v) / xp.sum(p, axis=-1, keepdims=True)
        return project_out(xp, attended, proj_weight, proj_bias, x)

    def _static(self) -> dict[str, Any]:
        return dict(num_heads=self.num_heads, scale=self.scale)

    def forward_tpu(self, x: Any, qkv_weight: Any, qkv_bias: Any = None, proj_weight: Any = None,
                    proj_bias: Any = None, rel_pos_h: Any = None, rel_pos_w: Any = None) -> Any:
        return call_jax_function(frontend_of(x), _PALLAS, x, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                 rel_pos_h, rel_pos_w, native=self.forward_native, **self._static())

    def forward_cuda(self, x: Any, qkv_weight: Any, qkv_bias: Any = None, proj_weight: Any = None,
                     proj_bias: Any = None, rel_pos_h: Any = None, rel_pos_w: Any = None) -> Any:
        return call_triton(frontend_of(x), _TRITON, x, qkv_weight, qkv_bias, proj_weight, proj_bias, rel_pos_h,
                           rel_pos_w, **self._static())

    def forward_cpu(self, x: Any, qkv_weight: Any, qkv_bias: Any = None, proj_weight: Any = None,
                    proj_bias: Any = None, rel_pos_h: Any = None, rel_pos_w: Any = None) -> Any:
        decline_if_recording(OP, x, qkv_weight, qkv_bias, proj_weight, proj_bias, rel_pos_h, rel_pos_w)
        return _CPU(x, qkv_weight, qkv_bias, proj_weight, proj_bias, rel_pos_h, rel_pos_w, **self._static())


# --- check cases -----------------------------------------------------------------------------------

# (B, H, W, dim) per case. Without relative positions: no image, one token, a ragged grid. With them
# (tables for a 4 x 4 input): the table's own size, a larger grid (tables interpolated up) and a
# smaller one (down); and a 8 x 8 table at 4 heads of 16 without a qkv bias, at its size and at 7 x 20
# (down along H, up along W; 140 tokens: more than one key block in every kernel).
# x's [B, H, W, dim] (trait image_grid): no image, a one-token image, images off any tile multiple.
_PLAIN_SHAPES = ((0, 4, 4, 32), (1, 1, 1, 32), (2, 3, 5, 32))
_REL_POS_SHAPES = ((1, 4, 4, 32), (2, 6, 5, 32), (1, 3, 3, 32))
_WIDE_SHAPES = ((1, 8, 8, 64), (1, 7, 20, 64))


def check_cases():
    """The shapes and inputs ``dualop check`` and the tests run this op with."""
    from dualop.testing import OpCase, normal

    def make_op(heads: int, qkv_bias: bool, input_size):
        return lambda shape: RelPosAttention(shape[-1], heads, qkv_bias=qkv_bias, use_rel_pos=input_size is not None,
                                             input_size=input_size)

    def inputs(heads: int, qkv_bias: bool, input_size):
        def make(shape, rng):
            dim = shape[-1]
            scale = dim ** -0.5
            tables = ((None, None) if input_size is None else
                      tuple(normal((2 * size - 1, dim // heads), rng, 0.5) for size in input_size))
            return (normal(shape, rng), normal((3 * dim, dim), rng, scale),
                    normal((3 * dim,), rng, 0.5) if qkv_bias else None, normal((dim, dim), rng, scale),
                    normal((dim,), rng, 0.5), *tables)

        return make

    variants = (("rel_pos_attention", 2, True, None, _PLAIN_SHAPES),
                ("rel_pos_attention[rel_pos]", 2, True, (4, 4), _REL_POS_SHAPES),
                ("rel_pos_attention[rel_pos,no_qkv_bias]", 4, False, (8, 8), _WIDE_SHAPES))
    return [OpCase(OP, label, make_op(heads, bias, size), inputs(heads, bias, size), shapes)
            for label, heads, bias, size, shapes in variants]


# --- spec: what dualop compile builds and dualop bench times ------------------------------------

# DeepSeek-OCR's SAM ViT-B encoder (dim 768, 12 heads of 64) at 1024 px: 16 x 16 patches give a
# 64 x 64 grid, attended in 14 x 14 windows (the grid padded to 70 x 70: 25 windows per image) by
# most blocks and globally by a few, each with tables for its own input size.
_SAM_DIM, _SAM_HEADS, _SAM_WINDOW, _SAM_GRID = 768, 12, 14, 64


def _serving_inputs(shape: tuple[int, ...]) -> tuple:
    b, hh, ww, dim, heads, table = shape
    d = dim // heads
    return (InputSpec((b, hh, ww, dim), None), InputSpec((3 * dim, dim), None), InputSpec((3 * dim,), None),
            InputSpec((dim, dim), None), InputSpec((dim,), None), InputSpec((2 * table - 1, d), None),
            InputSpec((2 * table - 1, d), None))


def _serving_op(shape: tuple[int, ...]) -> RelPosAttention:
    _, _, _, dim, heads, table = shape
    return RelPosAttention(dim, heads, use_rel_pos=True, input_size=(table, table))


def serving():
    """(B, H, W, dim, heads, table side): SAM ViT-B's windowed blocks (25 windows of 14 x 14) and its
    global blocks (64 x 64), one 1024 px image."""
    return {OP: Serving(((25, _SAM_WINDOW, _SAM_WINDOW, _SAM_DIM, _SAM_HEADS, _SAM_WINDOW),
                         (1, _SAM_GRID, _SAM_GRID, _SAM_DIM, _SAM_HEADS, _SAM_GRID)),
                        _serving_inputs, {"rel_pos_attention[rel_pos]": _serving_op}, cases=("rel_pos_attention[rel_pos]",))}


def _bench_shape(size: tuple[int, ...]) -> tuple[int, ...]:
    """A bench size (tokens, dim) as 14 x 14 windows: (windows, 14, 14, dim)."""
    tokens, dim = size
    return (max(1, tokens // (_SAM_WINDOW * _SAM_WINDOW)), _SAM_WINDOW, _SAM_WINDOW, dim)


def _bench_op(dim: int) -> RelPosAttention:
    heads = dim // 64 if dim % 64 == 0 else 1
    return RelPosAttention(dim, heads, use_rel_pos=True, input_size=(_SAM_WINDOW, _SAM_WINDOW))


def _bench_inputs(shape, rng):
    dim = shape[-1]
    d = _bench_op(dim).head_dim
    normal = lambda s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
    table = 2 * _SAM_WINDOW - 1
    return (normal(shape), normal((3 * dim, dim), dim ** -0.5), normal((3 * dim,), 0.5), normal((dim, dim), dim ** -0.5),
            normal((dim,), 0.5), normal((table, d), 0.5), normal((table, d), 0.5))


def _bench_cost(op, shape, itemsize) -> KernelCost:
    b, hh, ww, dim = shape
    return rel_pos_attention_cost(b, hh, ww, dim, op.num_heads, op.use_rel_pos, itemsize)


def _torch_sdpa(op):
    """What the engine's own layer does: the decomposed bias as SDPA's float mask, in x's dtype (in
    bfloat16 the bias and SDPA's scores round where the native body keeps float32, so this peer
    leaves the bfloat16 tolerance: its record there is an error, as expected)."""
    import torch.nn.functional as F

    def run(x, qkv_weight, qkv_bias, proj_weight, proj_bias, rel_pos_h, rel_pos_w):
        from dualop.backends.torch import array_api as xp

        b, hh, ww, dim = x.shape
        s, n = hh * ww, op.num_heads
        qkv = F.linear(x, qkv_weight, qkv_bias).reshape(b, s, 3, n, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        rel_h, rel_w = rel_pos_terms(xp, q.float(), rel_pos_h, rel_pos_w, hh, ww)
        bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, n, s, s).to(x.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return F.linear(out.transpose(1, 2).reshape(b, hh, ww, dim), proj_weight, proj_bias)

    return run


def _jax_native(op):
    import jax

    return jax.jit(op.forward_native)


def bench_cases():
    """Not run by default: 14 x 14 windows with relative positions, against SDPA with the bias as
    its mask (torch) and the native body under jit (jax); ask with ``--ops rel_pos_attention``."""
    return [BenchCase(OP, OP, _bench_op, _bench_inputs, _bench_cost, _torch_sdpa, _jax_native, default=False,
                      shape_of=_bench_shape, matrix=True)]


# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
# structured_inputs: an image grid, its projections and tables, not rows of one hidden size; and the
# logits are quadratic in x (both q and k project it), so at the property sweep's large magnitudes
# (1e3: logits near 1e5) any two float32 softmaxes disagree by their rounding. Its own tests plant
# non-finite values per kernel cell (tests/ops/test_rel_pos_attention.py).
CASE_NOTES = {OP: {"traits": {"structured_inputs", "contraction", "image_grid"}}}
