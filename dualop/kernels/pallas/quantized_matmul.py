"""The linear layers' GEMM on quantized weights as a Pallas TPU kernel: ``y = x @ W.T (+ bias)``
with ``W`` kept as its checkpoint's codes and scales (``dualop.ops.quantized_weight``), equal to the
linear ops' reference ``_native_gemm`` within the tolerance table.

Grid ``(token blocks, output blocks, input blocks)``, the input axis innermost and sequential: each
step multiplies an ``x`` tile ``[tm, tk]`` by a weight tile of ``tn`` rows and ``tk`` input columns
on the MXU into a ``[tm, tn]`` accumulator in VMEM scratch; the last input step applies the
per-channel scales, adds the bias in float32 and casts once. Tiles: ``MatmulBlocks``, from a table by
TPU generation and token count (``matmul_blocks``), narrowed to the shape and to VMEM.

Schemes (``supports`` says which; everything else declines to the native body). What enters the
MXU is exact in its dtype (``_compute_dtype``): ``x`` (bfloat16, else float32) or its W8A8 codes,
and the weight's codes (int4: code minus zero point, an integer of at most 4 bits), never a code
times its scale. Scales weight float32 results instead: per-channel ones the accumulator in the
epilogue, group and block ones each K group's partial sum (``[tm, tn]`` times one scale row), so no
dequantised weight is rounded to bfloat16 (the reference dequantises in float32).

- **W8A8** (``activations`` dynamic or static): ``x`` is quantized in the wrapper (``[M, K]`` is
  small) exactly as ``quantize_activations`` does (int8: ``max|x| / 127`` per token, round half to
  even, clip; fp8: ``quant_fp8_reference``, bit for bit the native ``quantize_fp8_native``, in
  groups of ``block[1]`` columns for block weights). The GEMM runs on the codes: int8 x int8 with
  int32 accumulation; fp8 x fp8 with float32 accumulation, on tpu7x's fp8 MXU (its LLO shows
  ``matmul_data_format<e4m3b>``), as bfloat16 (exact) on v5e and v6e. ``x_scale * w_scale``
  weights each partial sum of a scale block: per token and per channel in the epilogue, per
  (token, K block) x (N block, K block) for block weights.
- **Weight-only fp8 / int8** (plain ``[N, K]`` codes; per tensor, per channel, groups or blocks):
  the code tile is widened to the compute dtype and multiplied with ``x``.
- **int4 W4A16, ``packed``** (compressed-tensors: 8 codes per int32 word along K, stored + 8; group
  or channel scales, optional zero points packed along N): the word tile is transposed in VMEM to
  ``[tk / 8, tn]``; for each K group (per channel: each 1024 columns) its 8 nibbles are masked and
  shifted out, the zero point subtracted, and the planes stacked into a ``[g, tn]`` tile. Stacking
  puts the group's input column ``8 w + i`` at row ``i * g / 8 + w``; the wrapper permutes ``x``'s
  columns the same way within each group, so no lane shuffle is needed.
- **int4 W4A16, ``awq``** (AWQ's GEMM layout: words ``[K, N / 8]`` along the output dim, nibble
  order ``AWQ_NIBBLE_OF``, unsigned codes and zero points, scales ``[K / g, N]``): the word tile
  ``[tk, tn / 8]`` is already K-major. Nibble plane ``j`` (output features ``8 w + j``) of each K
  group, minus its zero points, is its own ``[tm, g] x [g, tn / 8]`` dot into plane ``j`` of an
  ``[8, tm, tn / 8]`` accumulator. The kernel writes ``y`` as those planes (``[8, M, N / 8]``) and
  the wrapper interleaves them back into ``[M, N]``: one more pass over the output, small next to
  the weight at decode.

Scales and zero points are reshaped in the wrapper into float32 rows the kernel reads per output
block: ``[1, N]`` per channel (one value broadcast per tensor), ``[K / g, N]`` per K group (block
scales repeated over their ``block[0]`` rows, packed zero points unpacked), AWQ's as ``[8, K / g,
N / 8]`` nibble planes (the bias too, ``[8, 1, N / 8]``). These are ``1 / g`` of the weight's
elements; the weight itself is read once per token block, as stored.

float16 ``x`` (Mosaic has no float16 vectors: "Invalid vector type for load" on v5e) enters and
leaves the kernel as float32, cast once to float16 after it. Interpret mode (no TPU) runs the
operands a TPU does (bfloat16 and fp8 dots into float32 run on XLA:CPU in jax 0.7 and 0.10), so
the tests see what a TPU rounds.

Compiled here with libtpu's compile-only v5e, v6e and tpu7x (bfloat16 x; tokens x K x N of 16 x
8192 x 1280, 8192 x 8192 x 7168, 1 x 7168 x 4608, 8192 x 2304 x 7168) for int4 groups of 128
(symmetric, zero points), AWQ groups of 128, fp8 128x128 blocks (W8A8 and weight-only) and int8
W8A8 per channel, plus fp8 W8A8 per channel and static per tensor on v6e and tpu7x; on v5e and
tpu7x also int4 groups of 32 and per channel with zero points, AWQ groups of 32 and 64, and
float32 and float16 x; ragged shapes (N 40 / 200 / 1000, K 196 / 200 / 1000 / 2052) on v5e. Not
run on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.backends.xla import array_api as xp
from dualop.kernels import quant_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.pallas.common import compiler_params, cost_estimate, current_generation, tpu_jit, vmem_spec
from dualop.kernels.pallas.quant_fp8 import quant_fp8_reference

__all__ = ["quantized_matmul", "supports", "quantized_matmul_cost", "MatmulBlocks", "matmul_blocks"]

_LANE = 128
_INT8_MAX = 127.0
_X_DTYPES = ("float32", "bfloat16", "float16")
# Generations whose MXU multiplies float8_e4m3fn operands (fp8 W8A8 dots run on the codes there).
_FP8_MXU_GENERATIONS = ("tpu7x",)
_PACKED_ROW_BLOCK = 8 * _LANE  # input columns unpacked at a time for per-channel packed int4


# ---------------------------------------------------------------------------------- the scheme


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the kernel does for one scheme (static).

    ``x_codes``: x enters as ``int8`` / ``fp8`` codes (W8A8) or ``None`` (as it is); ``x_scale``:
    ``row`` (one per token, epilogue), ``kblock`` (one per token and K group) or ``None``;
    ``w_scale``: ``row`` (one per output channel, epilogue) or ``kblock`` (one per K group and
    channel); ``group``: input columns per K group; ``packing``: int4 words along ``k``
    (compressed-tensors) or ``n`` (AWQ), else None; ``zero``: zero points (``row`` or ``kblock``,
    as the scale)."""

    x_codes: str | None
    x_scale: str | None
    w_scale: str
    group: int | None
    packing: str | None
    zero: str | None

    @property
    def int_dot(self) -> bool:
        return self.x_codes == "int8"


def _plan(quant) -> _Plan:
    kblock = quant.strategy in ("group", "block")
    group = quant.group_size if quant.strategy == "group" else quant.block[1] if quant.strategy == "block" else None
    w_scale = "kblock" if kblock else "row"
    if quant.activations == "none":
        x_codes = x_scale = None
    else:
        x_codes = quant.codes
        x_scale = "kblock" if quant.codes == "fp8" and quant.strategy == "block" else "row"
    zero = None if quant.symmetric else w_scale
    packing = {"packed": "k", "awq": "n"}.get(quant.layout) if quant.codes == "int4" else None
    return _Plan(x_codes, x_scale, w_scale, group, packing, zero)


def supports(quant, n: int, k: int, dtype_name: str) -> str | None:
    """None if ``quantized_matmul`` takes scheme ``quant`` for an ``[n, k]`` weight and ``x`` of
    ``dtype_name``; else why not (one line)."""
    if dtype_name not in _X_DTYPES:
        return f"x of {dtype_name}: the kernel takes {', '.join(_X_DTYPES)}"
    if quant.layout == "packed" and quant.codes != "int4":
        return f"{quant.codes} codes packed in int32 words: only int4 is unpacked by this kernel"
    if quant.layout == "plain" and not quant.symmetric:
        return "zero points on plain 8-bit codes are not applied by this kernel"
    if quant.codes == "fp8" and quant.strategy == "block" and quant.activations == "static":
        return "a static activation scale with per-group activation quantization has no definition here"
    plan = _plan(quant)
    if plan.group is not None and plan.group < k:
        if plan.packing == "k" and plan.group % 8:
            return f"int4 groups of {plan.group}: the kernel needs a multiple of 8 (whole words)"
        if plan.packing is None and plan.group % _LANE:
            return (f"K groups of {plan.group} columns: the kernel scales partial sums of 128-lane-aligned groups "
                    "(a multiple of 128, or one group over all of K)")
    return None


# ---------------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
    """One grid step's tile: ``tokens`` rows of x, ``out`` weight rows (output features) and
    ``depth`` input features (weight columns; for packed int4, 8 per int32 word)."""

    tokens: int
    out: int
    depth: int


# Per generation: (the largest token count served as one decode block, its blocks; prefill blocks).
# Decode is bound by the weight's bytes: deep, wide weight tiles (1-2 MiB a step) keep each step's
# DMA long against the per-step overhead; prefill re-reads the weight once per token block, so tall
# token blocks (512: about the MXU's ridge point on v5e) with the 256-wide MXUs of v6e and tpu7x
# fed 1024-wide output tiles. AWQ tiles take a quarter of ``out`` as int32 words (each of a word's
# 8 nibble planes is its own dot of that width: 128 lanes on v5e, 256 on v6e and tpu7x).
_BLOCK_TABLE = {
    "v5e": (128, MatmulBlocks(128, 512, 2048), MatmulBlocks(512, 512, 1024)),
    "v6e": (128, MatmulBlocks(128, 1024, 2048), MatmulBlocks(512, 1024, 1024)),
    "tpu7x": (128, MatmulBlocks(128, 1024, 2048), MatmulBlocks(512, 1024, 1024)),
}
# v4, v5p, an unknown chip, interpret mode: smaller tiles every generation takes.
_DEFAULT_BLOCKS = (128, MatmulBlocks(128, 512, 1024), MatmulBlocks(256, 512, 512))


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def _step_vmem(b: MatmulBlocks, plan: _Plan, x_bytes: int, out_bytes: int, n_groups: int) -> int:
    """Estimated VMEM of one grid step: double-buffered x, weight, scale rows and output tiles, the
    accumulator, the widened weight tile (int4: the transposed words and one K group's planes) and
    the float32 partial sums, padded to (8, 128) tiles."""
    tm, tn, tk = _pad(b.tokens, 32), _pad(b.out, _LANE), _pad(b.depth, _LANE)
    group = min(plan.group or (_PACKED_ROW_BLOCK if plan.packing == "k" else tk), tk)
    if plan.packing == "k":
        w_tile, widened = tn * tk // 2, tn * tk // 2 + group * tn * 10  # words.T; f32 planes, 16-bit tile
    elif plan.packing == "n":
        w_tile, widened = tn * tk // 2, group * tn // 8 * 10  # one nibble plane of one group
    else:
        w_tile, widened = tn * tk, tn * tk * 4
    rows = 2 * _pad(n_groups if plan.w_scale == "kblock" else 1, 8) * tn * 4 * (2 if plan.zero else 1)
    x_scale = 2 * tm * _pad(n_groups, _LANE) * 4 if plan.x_scale else 0
    return (2 * tm * tk * x_bytes + 2 * w_tile + widened + rows + x_scale + 2 * tm * tn * out_bytes
            + 2 * tm * tn * 4 + 2 * 8 * tn * 4)


def _depth_unit(plan: _Plan) -> int:
    """Input columns a K tile is a multiple of: whole lanes of the weight tile (of words, for
    packed int4) holding whole K groups."""
    unit = 8 * _LANE if plan.packing == "k" else _LANE
    return unit * plan.group // math.gcd(unit, plan.group) if plan.group else unit


def _fit_depth(k: int, want: int, unit: int) -> int:
    """The largest multiple of ``unit`` up to ``want`` dividing ``k``, else all of ``k``."""
    fits = [d for d in range(unit, min(want, k) + 1, unit) if k % d == 0]
    return fits[-1] if fits else k


def _fit_lanes(n: int, want: int) -> int:
    """All of ``n`` below one lane tile; else the widest multiple of 128 up to ``want`` dividing
    ``n``, or (no divisor) the widest one up to ``n``: the ragged last block is masked."""
    if n <= _LANE:
        return n
    cands = list(range(_LANE, min(want, _pad(n, _LANE)) + 1, _LANE))
    dividing = [c for c in cands if n % c == 0]
    return dividing[-1] if dividing else max(c for c in cands if c <= n)


def _fit_out(plan: _Plan, n: int, want: int) -> int:
    """Output features of a tile: lanes of the output (AWQ: 8 per word lane, a quarter of ``want``
    as words)."""
    if plan.packing == "n":
        return 8 * _fit_lanes(n // 8, max(_LANE, want // 4))
    return _fit_lanes(n, want)


def _fit_tokens(m: int, want: int) -> int:
    return m if m <= want else max(32, want // 32 * 32)


def matmul_blocks(m: int, n: int, k: int, quant, x_dtype, blocks: MatmulBlocks | None = None) -> MatmulBlocks:
    """The tile for ``m`` tokens of an ``[n, k]`` weight of scheme ``quant`` on the current TPU
    generation (``blocks``: the tile asked for instead of the table's), narrowed to the shape and
    until a step's estimate fits half the generation's default scoped VMEM (``compiler_params``
    keeps twice the estimate as the limit: Mosaic's own temporaries come on top)."""
    plan = _plan(quant)
    kp = _packed_k(k) if plan.packing == "k" else k
    unit = _depth_unit(plan)
    min_out = 8 * _LANE if plan.packing == "n" else _LANE
    if blocks is None:
        decode_max, decode, prefill = _BLOCK_TABLE.get(current_generation(), _DEFAULT_BLOCKS)
        blocks = decode if m <= decode_max else prefill
    x_bytes = 1 if plan.x_codes else jnp.dtype(x_dtype).itemsize
    out_bytes = jnp.dtype(x_dtype).itemsize
    n_groups = -(-kp // plan.group) if plan.group else 1
    want = blocks
    while True:
        b = MatmulBlocks(_fit_tokens(m, want.tokens), _fit_out(plan, n, want.out), _fit_depth(kp, want.depth, unit))
        if _step_vmem(b, plan, x_bytes, out_bytes, n_groups) <= vmem_spec().scoped_default // 2:
            return b
        if want.depth // 2 >= unit and b.depth > unit:
            want = dataclasses.replace(want, depth=want.depth // 2)
        elif want.out // 2 >= _LANE and b.out > min_out:
            want = dataclasses.replace(want, out=want.out // 2)
        elif want.tokens // 2 >= 32 and b.tokens > 32:
            want = dataclasses.replace(want, tokens=want.tokens // 2)
        else:
            return b


def _packed_k(k: int) -> int:
    """Input columns of a packed int4 weight: ``k`` up to whole 8-code words."""
    return _pad(k, 8)


# ---------------------------------------------------------------------------------- cost


def quantized_matmul_cost(tokens: int, n: int, k: int, quant, x_itemsize: int, has_bias: bool) -> KernelCost:
    """Read x, the codes, scales and zero points once and write y once (the weight as stored: one
    byte a code, half a byte for int4); ``2 M N K`` flops on the matrix unit, plus the scaling of
    each K group's partial sums (group and block scales) and the unpacking of int4 codes."""
    code_bytes = math.prod(quant.codes_shape(n, k)) * 4 if quant.codes == "int4" else n * k
    scales = math.prod(quant.scale_shape(n, k))
    zeros = 0 if quant.symmetric else math.prod(quant.zero_point_shape(n, k))
    groups = -(-k // quant.group_size) if quant.strategy == "group" else -(-k // quant.block[1]) \
        if quant.strategy == "block" else 1
    reads = tokens * k * x_itemsize + code_bytes + 4 * (scales + zeros) + (n * x_itemsize if has_bias else 0)
    flops = 2 * tokens * n * k + 2 * tokens * n * groups + (4 * n * k if quant.codes == "int4" else 0)
    return KernelCost(flops=flops, transcendentals=0, bytes_accessed=reads + tokens * n * x_itemsize)


# ---------------------------------------------------------------------------------- kernel


def _dot(a, b, *, transposed: bool, acc_dtype, precision):
    """``a @ b.T`` (``transposed``: b is ``[n, k]``) or ``a @ b`` with ``acc_dtype`` accumulation."""
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc_dtype)


def _nibble(words, slot: int):
    """Nibble ``slot`` of int32 ``words`` as int32 0..15: masked first, then shifted logically, so
    the top nibble of a negative word comes out unsigned (``quant_math._codes``' order)."""
    mask = ((15 << (4 * slot)) + 2**31) % 2**32 - 2**31  # as a signed int32
    masked = words & mask
    return jax.lax.shift_right_logical(masked, jnp.int32(4 * slot)) if slot else masked


def _tile_groups(plan: _Plan, depth: int) -> list[tuple[int, int]]:
    """``(first column, columns)`` of each K group a ``depth``-deep tile holds (the last one maybe
    partial: only a tile spanning all of K ends off a group). Per-channel packed int4 tiles are
    unpacked in blocks of 1024 columns (128 lanes of words) to bound the widened planes; other
    per-channel tiles, and a group covering the tile, are one block."""
    if plan.w_scale == "kblock":
        block = plan.group
    else:
        block = _PACKED_ROW_BLOCK if plan.packing == "k" else depth
    return [(s, min(block, depth - s)) for s in range(0, depth, block)]


def _kpacked_block(words_t, zero, *, compute):
    """Packed int4 words ``[size / 8, tn]`` (transposed: one lane per output feature) of one K
    block as the ``[size, tn]`` tile of ``code - zero`` in nibble-plane order (row ``i * size / 8
    + w`` is the block's input column ``8 w + i``): integers of at most 4 bits, exact in the
    compute dtype. ``zero``: the block's zero points ``[1, tn]`` (signed, as the codes) or None."""
    planes = []
    for i in range(8):
        code = (_nibble(words_t, i) - 8).astype(jnp.float32)
        planes.append(code if zero is None else code - zero)
    return jnp.concatenate(planes, axis=0).astype(compute)


def _kernel(*refs, plan: _Plan, depth: int, has_bias: bool, compute, precision, k_steps: int):
    it = iter(refs)
    x_ref, w_ref = next(it), next(it)
    xs_ref = next(it) if plan.x_scale else None
    ws_ref = next(it)
    z_ref = next(it) if plan.zero else None
    b_ref = next(it) if has_bias else None
    o_ref, acc_ref = next(it), next(it)
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    if plan.int_dot:
        acc_dtype = jnp.int32
    else:
        acc_dtype = jnp.float32
        x = x.astype(compute)
    dot = functools.partial(_dot, acc_dtype=acc_dtype, precision=precision)
    groups = _tile_groups(plan, depth)

    def group_row(s: int):
        """This step's ``s``-th K group's row of the scales and zero points."""
        return k * len(groups) + s if k_steps > 1 else s

    if plan.packing == "k":
        words_t = w_ref[...].T  # [depth / 8, tn]
        total = acc_ref[...]
        for s, (first, size) in enumerate(groups):
            if plan.w_scale == "kblock":
                zero = z_ref[pl.ds(group_row(s), 1), :] if plan.zero else None
            else:
                zero = z_ref[...] if plan.zero else None
            tile = _kpacked_block(words_t[first // 8:(first + size) // 8], zero, compute=compute)
            part = dot(x[:, first:first + size], tile, transposed=False)
            if plan.w_scale == "kblock":
                part = part * ws_ref[pl.ds(group_row(s), 1), :]
            total = total + part
        acc_ref[...] = total
    elif plan.packing == "n":  # acc [8, tm, tw]: nibble plane j holds output features 8 w + j
        for j, slot in enumerate(quant_math.AWQ_NIBBLE_OF):
            total = acc_ref[j]
            for s, (first, size) in enumerate(groups):
                code = _nibble(w_ref[first:first + size, :], slot).astype(jnp.float32)
                code = code - z_ref[j, pl.ds(group_row(s), 1), :]
                part = dot(x[:, first:first + size], code.astype(compute), transposed=False)
                total = total + part * ws_ref[j, pl.ds(group_row(s), 1), :]
            acc_ref[j] = total
    elif plan.w_scale == "kblock":
        w = w_ref[...]
        w = w if plan.int_dot else w.astype(compute)
        xs_all = xs_ref[...] if plan.x_scale == "kblock" else None
        total = acc_ref[...]
        for s, (first, size) in enumerate(groups):
            part = dot(x[:, first:first + size], w[:, first:first + size], transposed=True).astype(jnp.float32)
            row = group_row(s)
            part = part * ws_ref[pl.ds(row, 1), :]
            if xs_all is not None:  # this group's column of the (token, K group) scales
                lane = jax.lax.broadcasted_iota(jnp.int32, xs_all.shape, 1)
                part = part * jnp.sum(jnp.where(lane == row, xs_all, 0.0), axis=1, keepdims=True)
            total = total + part
        acc_ref[...] = total
    else:
        w = w_ref[...]
        w = w if plan.int_dot else w.astype(compute)
        acc_ref[...] += dot(x, w, transposed=True)

    @pl.when(k == k_steps - 1)
    def _epilogue():
        if plan.packing == "n":  # group scales applied; the bias, its features in the planes' order
            for j in range(8):
                y = acc_ref[j] + (b_ref[j].astype(jnp.float32) if has_bias else 0.0)
                o_ref[j] = y.astype(o_ref.dtype)
            return
        y = acc_ref[...].astype(jnp.float32)
        if plan.w_scale == "row":
            y = y * ws_ref[...]
        if plan.x_scale == "row":
            y = y * xs_ref[...]
        if has_bias:
            y = y + b_ref[...].astype(jnp.float32)
        o_ref[...] = y.astype(o_ref.dtype)


# ---------------------------------------------------------------------------------- wrapper


def _quantize_x(x2, input_scale, quant):
    """``x [M, K]`` as the W8A8 GEMM's codes and float32 scales (``quantize_activations``' rules):
    ``[M, 1]`` per token / tensor, ``[M, K / block[1]]`` per group."""
    m = x2.shape[0]
    static = quant.activations == "static"
    if quant.codes == "int8":
        xf = x2.astype(jnp.float32)
        if static:
            scale = input_scale.astype(jnp.float32).reshape(1, 1)
        else:
            amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
            scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
        codes = jnp.clip(jnp.round(xf / scale), -_INT8_MAX - 1, _INT8_MAX).astype(jnp.int8)
        return codes, jnp.broadcast_to(scale, (m, 1))
    if quant.strategy == "block":
        return quant_fp8_reference(x2, granularity="group", group_size=quant.block[1])
    if static or quant.strategy == "tensor":
        codes, scale = quant_fp8_reference(x2, input_scale if static else None, granularity="tensor")
        return codes, jnp.broadcast_to(scale.reshape(1, 1), (m, 1))
    codes, scale = quant_fp8_reference(x2, granularity="token")
    return codes, scale.reshape(m, 1)


def _scale_rows(scale, zero_point, quant, n: int, k: int):
    """Weight scales (and zero points) as float32 rows over the output features: ``[1, N]`` per
    channel / tensor, ``[K groups, N]`` per group or block; AWQ's as ``[8, K groups, N / 8]``
    nibble planes (plane ``j``, lane ``w``: feature ``8 w + j``), zero points unsigned."""
    s = scale.astype(jnp.float32)
    zero = None
    if quant.layout == "awq":
        planes = lambda rows: rows.reshape(rows.shape[0], n // 8, 8).transpose(2, 0, 1)  # noqa: E731
        return planes(s), planes(quant_math.unpack_awq(xp, zero_point).astype(jnp.float32))
    if quant.strategy == "tensor":
        rows = jnp.broadcast_to(s.reshape(1, 1), (1, n))
    elif quant.strategy == "channel":
        rows = s.reshape(1, n)
    elif quant.strategy == "block":
        rows = jnp.repeat(s.T, quant.block[0], axis=1)[:, :n]
    else:
        rows = s.T
    if zero_point is not None:  # packed along N: unpack to signed codes, [groups, N]
        zero = quant_math.unpack_int32(xp, zero_point.T, 4, n).astype(jnp.float32)
    return rows, zero


def _permute_nibble_planes(x2, block: int):
    """``x``'s columns in the order the packed int4 tile stacks its nibble planes: within each
    ``block`` of columns (the last one maybe shorter, a whole number of words), column ``8 w + i``
    moves to ``i * block / 8 + w``."""
    m, kp = x2.shape

    def permute(part, size):
        return part.reshape(m, -1, size // 8, 8).swapaxes(2, 3).reshape(m, -1)

    whole = kp // block * block
    parts = [permute(x2[:, :whole], block)] if whole else []
    if whole < kp:
        parts.append(permute(x2[:, whole:], kp - whole))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _compute_dtype(plan: _Plan, io_dtype, fp8_mxu: bool):
    """The dtype both dot operands enter the MXU in: int8 for int8 W8A8; for fp8 W8A8 the fp8
    codes themselves where the MXU takes them (``fp8_mxu``), else bfloat16 (exact); otherwise
    ``x``'s, bfloat16 or float32 (every weight code, and int4 code minus zero point, is exact in
    both)."""
    if plan.int_dot:
        return jnp.dtype(jnp.int8)
    if plan.x_codes == "fp8":
        return jnp.dtype(jnp.float8_e4m3fn if fp8_mxu else jnp.bfloat16)
    return jnp.dtype(jnp.bfloat16 if io_dtype == jnp.bfloat16 else jnp.float32)


@tpu_jit(static_argnames=("quant", "n", "k", "interpret", "blocks", "fp8_mxu"))
def quantized_matmul(x, codes, scale, zero_point=None, input_scale=None, bias=None, *, quant, n: int, k: int,
                     interpret=False, blocks: MatmulBlocks | None = None, fp8_mxu: bool | None = None):
    """``x [..., K] @ W.T (+ bias)`` in ``x``'s dtype for the ``[n, k]`` weight ``W`` of scheme
    ``quant`` held as ``codes``, ``scale``, ``zero_point`` and ``input_scale`` (a
    ``QuantizedWeight``'s arrays). ``blocks``: the tile to use instead of the table's (tests force
    several K steps and ragged output blocks with it); ``fp8_mxu``: fp8 W8A8 dots on the fp8
    codes (default: on generations with an fp8 MXU, ``_FP8_MXU_GENERATIONS``)."""
    lead, dtype = x.shape[:-1], x.dtype
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return jnp.zeros((*lead, n), dtype)
    plan = _plan(quant)
    # Mosaic has no float16 vectors: float16 x (exact in float32) enters and leaves as float32,
    # cast once to float16 after the kernel.
    io_dtype = jnp.dtype(jnp.float32) if dtype == jnp.float16 else dtype
    b = matmul_blocks(m, n, k, quant, io_dtype, blocks)
    tm, tn, tk = b.tokens, b.out, b.depth

    operands, in_specs = [], []
    if plan.x_codes:
        x_in, x_scale = _quantize_x(x2, input_scale, quant)
    else:
        x_in, x_scale = x2.astype(io_dtype), None
    kp = k
    if plan.packing == "k":
        kp = _packed_k(k)
        if kp != k:
            x_in = jnp.pad(x_in, ((0, 0), (0, kp - k)))
        x_in = _permute_nibble_planes(x_in, _tile_groups(plan, tk)[0][1])
        w_spec = pl.BlockSpec((tn, tk // 8), lambda i, j, kk: (j, kk))
    elif plan.packing == "n":
        w_spec = pl.BlockSpec((tk, tn // 8), lambda i, j, kk: (kk, j))
    else:
        w_spec = pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk))
    k_steps = kp // tk
    operands += [x_in, codes]
    in_specs += [pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)), w_spec]
    if x_scale is not None:
        operands.append(x_scale)
        in_specs.append(pl.BlockSpec((tm, x_scale.shape[1]), lambda i, j, kk: (i, 0)))
    rows, zero = _scale_rows(scale, zero_point, quant, n, k)
    if plan.packing == "n":
        row_spec = pl.BlockSpec((8, rows.shape[1], tn // 8), lambda i, j, kk: (0, 0, j))
    else:
        row_spec = pl.BlockSpec((rows.shape[0], tn), lambda i, j, kk: (0, j))
    operands.append(rows)
    in_specs.append(row_spec)
    if zero is not None:
        operands.append(zero)
        in_specs.append(row_spec)
    if bias is not None:
        if plan.packing == "n":
            operands.append(bias.astype(io_dtype).reshape(n // 8, 8).T.reshape(8, 1, n // 8))
            in_specs.append(pl.BlockSpec((8, 1, tn // 8), lambda i, j, kk: (0, 0, j)))
        else:
            operands.append(bias.reshape(1, n).astype(io_dtype))
            in_specs.append(pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)))
    if plan.packing == "n":  # the 8 nibble planes' outputs, interleaved back into features below
        out_shape, out_spec = (8, m, n // 8), pl.BlockSpec((8, tm, tn // 8), lambda i, j, kk: (0, i, j))
        grid, acc_shape = (pl.cdiv(m, tm), pl.cdiv(n // 8, tn // 8), k_steps), (8, tm, tn // 8)
    else:
        out_shape, out_spec = (m, n), pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j))
        grid, acc_shape = (pl.cdiv(m, tm), pl.cdiv(n, tn), k_steps), (tm, tn)

    if fp8_mxu is None:
        fp8_mxu = current_generation() in _FP8_MXU_GENERATIONS
    compute = _compute_dtype(plan, io_dtype, fp8_mxu)
    precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
    n_groups = -(-kp // plan.group) if plan.group else 1
    vmem = _step_vmem(b, plan, 1 if plan.x_codes else io_dtype.itemsize, io_dtype.itemsize, n_groups)
    acc_dtype = jnp.int32 if plan.int_dot and plan.w_scale == "row" else jnp.float32
    kernel = functools.partial(_kernel, plan=plan, depth=tk, has_bias=bias is not None, compute=compute,
                               precision=precision, k_steps=k_steps)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, io_dtype),
        scratch_shapes=[pltpu.VMEM(acc_shape, acc_dtype)],
        compiler_params=compiler_params(3, vmem_bytes=vmem, semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(quantized_matmul_cost(m, n, k, quant, dtype.itemsize, bias is not None)),
        interpret=interpret,
        name="dualop_quantized_matmul",
    )(*operands)
    if plan.packing == "n":
        out = out.transpose(1, 2, 0).reshape(m, n)
    return out.astype(dtype).reshape(*lead, n)
