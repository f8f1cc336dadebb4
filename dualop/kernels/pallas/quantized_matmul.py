"""The linear layers' GEMM on quantized weights as a Pallas TPU kernel: ``y = x @ W.T (+ bias)``
with ``W`` kept as its checkpoint's codes and scales (``dualop.ops.quantized_weight``), equal to the
linear ops' reference ``_native_gemm`` within the tolerance table.

Grid ``(token blocks, output blocks, input blocks)``, the input axis innermost and sequential: each
step multiplies an ``x`` tile ``[tm, tk]`` by a weight tile of ``tn`` rows and ``tk`` input columns
on the MXU into a ``[tm, tn]`` accumulator in VMEM scratch; the last input step applies the
per-channel scales, adds the bias in float32 and casts once. Tiles: ``MatmulBlocks``, from a table by
TPU generation and token count (``matmul_blocks``), narrowed to the shape and to VMEM.

Schemes (``supports`` says which; everything else declines to the native body):

- **W8A8** (``activations`` dynamic or static): ``x`` is quantized in the wrapper (``[M, K]`` is
  small) exactly as ``quantize_activations`` does (int8: ``max|x| / 127`` per token, round half to
  even, clip; fp8: ``quant_fp8_reference``, bit for bit the native ``quantize_fp8_native``, in
  groups of ``block[1]`` columns for block weights). The GEMM runs on the codes: int8 x int8 with
  int32 accumulation, fp8 codes as bfloat16 (exact) with float32 accumulation (v5e and v6e have no
  fp8 MXU), and ``x_scale * w_scale`` weights each partial sum of a scale block: per token and per
  channel in the epilogue, per (token, K block) x (N block, K block) for block weights.
- **Weight-only fp8 / int8** (plain ``[N, K]`` codes; per tensor, per channel, groups or blocks):
  the code tile is widened to the compute dtype (bfloat16 for bfloat16 ``x``, else float32: codes
  are exact in both) and multiplied with ``x``; per-channel scales weight the accumulator in the
  epilogue, group and block scales each K group's partial sum (``[tm, tn]`` times one scale row).
- **int4 W4A16, ``packed``** (compressed-tensors: 8 codes per int32 word along K, stored + 8; group
  or channel scales, optional zero points packed along N): the word tile is transposed in VMEM to
  ``[tk / 8, tn]``, its 8 nibbles are shifted and masked out, dequantised (``(code - zero) *
  scale``, group scales and zeros broadcast along sublanes) to the compute dtype and stacked into a
  ``[tk, tn]`` tile. Stacking nibble planes puts input column ``8 w + i`` of the tile at row ``i *
  tk / 8 + w``; the wrapper permutes ``x``'s columns the same way, so no lane shuffle is needed.

Scales and zero points are reshaped in the wrapper into rows the kernel reads per output block:
``[1, N]`` per channel (one value broadcast per tensor), ``[K / g, N]`` per K group (block scales
repeated over their ``block[0]`` rows, packed zero points unpacked), float32. These are ``1 / g`` of
the weight's elements; the weight itself is read once per token block, as stored.

float16 ``x`` (Mosaic has no float16 vectors: "Invalid vector type for load" on v5e) enters and
leaves the kernel as float32, cast once to float16 after it. Interpret mode (no TPU): XLA:CPU in jax
0.7 has no bfloat16 x bfloat16 -> float32 dot, so operands are widened to float32 there (16-bit
products are exact in float32: the same sums).

Compiled here with libtpu's compile-only v5e, v6e and tpu7x (bfloat16 x; tokens x K x N of 16 x
8192 x 1280, 8192 x 8192 x 7168, 16 x 3584 x 8192, 1 x 7168 x 2112) for every scheme above; float32
and float16 x on v5e and tpu7x; ragged shapes (N 40 / 200 / 1000, K 196 / 200 / 1000) on v5e. Not run on
a TPU.
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


# ---------------------------------------------------------------------------------- the scheme


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the kernel does for one scheme (static).

    ``x_codes``: x enters as ``int8`` / ``fp8`` codes (W8A8) or ``None`` (as it is); ``x_scale``:
    ``row`` (one per token, epilogue), ``kblock`` (one per token and K group) or ``None``;
    ``w_scale``: ``row`` (one per output channel, epilogue) or ``kblock`` (one per K group and
    channel); ``group``: input columns per K group; ``int4``: packed words; ``zero``: zero points
    (``row`` or ``kblock``, as the scale)."""

    x_codes: str | None
    x_scale: str | None
    w_scale: str
    group: int | None
    int4: bool
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
    return _Plan(x_codes, x_scale, w_scale, group, quant.codes == "int4", zero)


def supports(quant, n: int, k: int, dtype_name: str) -> str | None:
    """None if ``quantized_matmul`` takes scheme ``quant`` for an ``[n, k]`` weight and ``x`` of
    ``dtype_name``; else why not (one line)."""
    if dtype_name not in _X_DTYPES:
        return f"x of {dtype_name}: the kernel takes {', '.join(_X_DTYPES)}"
    if quant.layout == "awq":
        return "AWQ's words along the output dim are not unpacked by this kernel (only compressed-tensors' along K)"
    if quant.layout == "packed" and quant.codes != "int4":
        return f"{quant.codes} codes packed in int32 words: only int4 is unpacked by this kernel"
    if quant.layout == "plain" and not quant.symmetric:
        return "zero points on plain 8-bit codes are not applied by this kernel"
    if quant.codes == "fp8" and quant.strategy == "block" and quant.activations == "static":
        return "a static activation scale with per-group activation quantization has no definition here"
    plan = _plan(quant)
    if plan.group is not None and plan.group < k:
        if plan.int4 and plan.group % 8:
            return f"int4 groups of {plan.group}: the kernel needs a multiple of 8 (whole words)"
        if not plan.int4 and plan.group % _LANE:
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
# fed 1024-wide output tiles.
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
    accumulator, the widened weight tile and the float32 partial sums, padded to (8, 128) tiles."""
    tm, tn, tk = _pad(b.tokens, 32), _pad(b.out, _LANE), _pad(b.depth, _LANE)
    w_tile = tn * tk // 2 if plan.int4 else tn * tk
    widened = tn * tk * (6 if plan.int4 else 4)  # int4: float32 planes and the stacked 16-bit tile
    rows = 2 * _pad(n_groups if plan.w_scale == "kblock" else 1, 8) * tn * 4 * (2 if plan.zero else 1)
    x_scale = 2 * tm * _pad(n_groups, _LANE) * 4 if plan.x_scale else 0
    return (2 * tm * tk * x_bytes + 2 * w_tile + widened + rows + x_scale + 2 * tm * tn * out_bytes
            + 2 * tm * tn * 4 + 2 * 8 * tn * 4)


def _depth_unit(plan: _Plan) -> int:
    """Input columns a K tile is a multiple of: whole lanes of the weight tile (of words, for int4)
    holding whole K groups."""
    unit = 8 * _LANE if plan.int4 else _LANE
    return unit * plan.group // math.gcd(unit, plan.group) if plan.group else unit


def _fit_depth(k: int, want: int, unit: int) -> int:
    """The largest multiple of ``unit`` up to ``want`` dividing ``k``, else all of ``k``."""
    fits = [d for d in range(unit, min(want, k) + 1, unit) if k % d == 0]
    return fits[-1] if fits else k


def _fit_out(n: int, want: int) -> int:
    """All of ``n`` below one lane tile; else the widest multiple of 128 up to ``want`` dividing
    ``n``, or (no divisor) the widest one up to ``n``: the ragged last block is masked."""
    if n <= _LANE:
        return n
    cands = list(range(_LANE, min(want, _pad(n, _LANE)) + 1, _LANE))
    dividing = [c for c in cands if n % c == 0]
    return dividing[-1] if dividing else max(c for c in cands if c <= n)


def _fit_tokens(m: int, want: int) -> int:
    return m if m <= want else max(32, want // 32 * 32)


def matmul_blocks(m: int, n: int, k: int, quant, x_dtype, blocks: MatmulBlocks | None = None) -> MatmulBlocks:
    """The tile for ``m`` tokens of an ``[n, k]`` weight of scheme ``quant`` on the current TPU
    generation (``blocks``: the tile asked for instead of the table's), narrowed to the shape and
    until a step's estimate fits half the generation's default scoped VMEM (``compiler_params``
    keeps twice the estimate as the limit: Mosaic's own temporaries come on top)."""
    plan = _plan(quant)
    kp = _packed_k(k) if plan.int4 else k
    unit = _depth_unit(plan)
    if blocks is None:
        decode_max, decode, prefill = _BLOCK_TABLE.get(current_generation(), _DEFAULT_BLOCKS)
        blocks = decode if m <= decode_max else prefill
    x_bytes = 1 if plan.x_codes else jnp.dtype(x_dtype).itemsize
    out_bytes = jnp.dtype(x_dtype).itemsize
    n_groups = -(-kp // plan.group) if plan.group else 1
    want = blocks
    while True:
        b = MatmulBlocks(_fit_tokens(m, want.tokens), _fit_out(n, want.out), _fit_depth(kp, want.depth, unit))
        if _step_vmem(b, plan, x_bytes, out_bytes, n_groups) <= vmem_spec().scoped_default // 2:
            return b
        if want.depth // 2 >= unit and b.depth > unit:
            want = dataclasses.replace(want, depth=want.depth // 2)
        elif want.out // 2 >= _LANE and b.out > _LANE:
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
    each K group's partial sums (group and block scales) and the dequantisation of int4 codes."""
    code_bytes = n * _packed_k(k) // 2 if quant.codes == "int4" else n * k
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


def _int4_tile(words, rows, zeros, *, plan: _Plan, depth: int, compute):
    """Packed int4 ``words [tn, depth / 8]`` as the dequantised ``[depth, tn]`` tile in nibble-plane
    order (row ``i * depth / 8 + w`` is input column ``8 w + i``). ``rows`` / ``zeros``: this
    tile's group scales and zero points ``[groups, tn]`` (group scaling), or per channel ``[1, tn]``
    zero points (the scale then waits for the epilogue)."""
    planes_t = words.T  # [depth / 8, tn]: one lane per output feature
    n_words = planes_t.shape[0]
    if plan.w_scale == "kblock":
        per = plan.group // 8  # words of a group in one nibble plane

        def expand(r):
            g = r.shape[0]
            full = jnp.broadcast_to(r[:, None, :], (g, per, r.shape[1])).reshape(g * per, r.shape[1])
            return full if g * per == n_words else full[:n_words]

        scale, zero = expand(rows), (expand(zeros) if zeros is not None else None)
    else:
        scale, zero = None, zeros
    planes = []
    for i in range(8):
        code = (((planes_t >> (4 * i)) & 15) - 8).astype(jnp.float32)
        if zero is not None:
            code = code - zero
        if scale is not None:
            code = code * scale
        planes.append(code.astype(compute))
    return jnp.concatenate(planes, axis=0)


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
    if plan.int4:
        if plan.w_scale == "kblock":
            n_groups = -(-depth // plan.group)
            start = k * n_groups if k_steps > 1 else 0
            rows = ws_ref[pl.ds(start, n_groups), :]
            zeros = z_ref[pl.ds(start, n_groups), :] if plan.zero else None
        else:
            rows, zeros = None, (z_ref[...] if plan.zero else None)
        w = _int4_tile(w_ref[...], rows, zeros, plan=plan, depth=depth, compute=compute)
        acc_ref[...] += _dot(x, w, transposed=False, acc_dtype=acc_dtype, precision=precision)
    elif plan.w_scale == "kblock":
        w = w_ref[...]
        w = w if plan.int_dot else w.astype(compute)
        g = plan.group
        n_groups = -(-depth // g)
        xs_all = xs_ref[...] if plan.x_scale == "kblock" else None
        total = acc_ref[...]
        for s in range(n_groups):
            cols = slice(s * g, min((s + 1) * g, depth))
            part = _dot(x[:, cols], w[:, cols], transposed=True, acc_dtype=acc_dtype, precision=precision)
            part = part.astype(jnp.float32)
            row = k * n_groups + s if k_steps > 1 else s
            part = part * ws_ref[pl.ds(row, 1), :]
            if xs_all is not None:  # this group's column of the (token, K group) scales
                lane = jax.lax.broadcasted_iota(jnp.int32, xs_all.shape, 1)
                part = part * jnp.sum(jnp.where(lane == row, xs_all, 0.0), axis=1, keepdims=True)
            total = total + part
        acc_ref[...] = total
    else:
        w = w_ref[...]
        w = w if plan.int_dot else w.astype(compute)
        acc_ref[...] += _dot(x, w, transposed=True, acc_dtype=acc_dtype, precision=precision)

    @pl.when(k == k_steps - 1)
    def _epilogue():
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
    channel / tensor, ``[K groups, N]`` per group or block."""
    s = scale.astype(jnp.float32)
    zero = None
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


def _permute_nibble_planes(x2, depth: int):
    """``x``'s columns in the order the int4 tile stacks its nibble planes (within each K tile of
    ``depth`` columns, column ``8 w + i`` moves to ``i * depth / 8 + w``)."""
    m, kp = x2.shape
    return x2.reshape(m, kp // depth, depth // 8, 8).swapaxes(2, 3).reshape(m, kp)


@tpu_jit(static_argnames=("quant", "n", "k", "interpret", "blocks"))
def quantized_matmul(x, codes, scale, zero_point=None, input_scale=None, bias=None, *, quant, n: int, k: int,
                     interpret=False, blocks: MatmulBlocks | None = None):
    """``x [..., K] @ W.T (+ bias)`` in ``x``'s dtype for the ``[n, k]`` weight ``W`` of scheme
    ``quant`` held as ``codes``, ``scale``, ``zero_point`` and ``input_scale`` (a
    ``QuantizedWeight``'s arrays). ``blocks``: the tile to use instead of the table's (tests force
    several K steps and ragged output blocks with it)."""
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
    if plan.int4:
        kp = _packed_k(k)
        if kp != k:
            x_in = jnp.pad(x_in, ((0, 0), (0, kp - k)))
        x_in = _permute_nibble_planes(x_in, tk)
        w_spec = pl.BlockSpec((tn, tk // 8), lambda i, j, kk: (j, kk))
    else:
        kp = k
        w_spec = pl.BlockSpec((tn, tk), lambda i, j, kk: (j, kk))
    k_steps = kp // tk
    operands += [x_in, codes]
    in_specs += [pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)), w_spec]
    if x_scale is not None:
        operands.append(x_scale)
        in_specs.append(pl.BlockSpec((tm, x_scale.shape[1]), lambda i, j, kk: (i, 0)))
    rows, zero = _scale_rows(scale, zero_point, quant, n, k)
    row_spec = pl.BlockSpec((rows.shape[0], tn), lambda i, j, kk: (0, j))
    operands.append(rows)
    in_specs.append(row_spec)
    if zero is not None:
        operands.append(zero)
        in_specs.append(row_spec)
    if bias is not None:
        operands.append(bias.reshape(1, n).astype(io_dtype))
        in_specs.append(pl.BlockSpec((1, tn), lambda i, j, kk: (0, j)))

    interpreting = interpret is not False
    if plan.int_dot:
        compute = jnp.int8
    elif interpreting or io_dtype != jnp.bfloat16:
        compute = jnp.float32
    else:
        compute = jnp.bfloat16
    precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
    n_groups = -(-kp // plan.group) if plan.group else 1
    vmem = _step_vmem(b, plan, 1 if plan.x_codes else io_dtype.itemsize, io_dtype.itemsize, n_groups)
    acc_dtype = jnp.int32 if plan.int_dot and plan.w_scale == "row" else jnp.float32
    kernel = functools.partial(_kernel, plan=plan, depth=tk, has_bias=bias is not None, compute=compute,
                               precision=precision, k_steps=k_steps)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, tm), pl.cdiv(n, tn), k_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), io_dtype),
        scratch_shapes=[pltpu.VMEM((tm, tn), acc_dtype)],
        compiler_params=compiler_params(3, vmem_bytes=vmem, semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(quantized_matmul_cost(m, n, k, quant, dtype.itemsize, bias is not None)),
        interpret=interpret,
        name="dualop_quantized_matmul",
    )(*operands)
    return out.astype(dtype).reshape(*lead, n)
