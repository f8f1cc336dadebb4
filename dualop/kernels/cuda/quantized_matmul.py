"""Linear layers on quantized weights as Triton kernels: the quantized linear ops' CUDA/ROCm GEMM,
``y = x @ W^T + bias`` for a ``QuantizedWeight`` (schemes: ``ops/quantized_weight.py``; their math:
``kernels/quant_math.py``; the reference: ``ops/linear.py`` ``_native_gemm``). Same contract as
the Pallas and C++ quantized GEMMs.

One GEMM kernel (``_gemm_kernel``), specialised by constexprs, over ``BLOCK_M x BLOCK_N`` output
tiles (grouped along M so neighbouring programs share weight tiles in L2), stepping through K in
``BLOCK_K`` tiles with float32 accumulation (int32 for int8 x int8):

- W8A8 (``activations`` dynamic / static): ``x`` is quantized first, exactly as the native body
  does. fp8 by ``quant_fp8``'s kernel (per ``block[1]`` columns of a token for block weights, else
  per token or per tensor), which writes the bytes itself, bit for bit those of the native cast,
  so it runs on every GPU; int8 by ``_quant_int8_kernel`` (per token or static, rounding half to
  even). The GEMM then multiplies CODES: int8 x int8 into int32; fp8 x fp8 with ``tl.dot`` on fp8
  operands where the GPU has it (CUDA sm_89+), elsewhere both decoded to bfloat16 (every e4m3
  value is one; exact) and multiplied in float32. A K tile's partial sum is scaled by
  ``x_scale[m, kb] * w_scale[nb, kb]`` where scales change along K (block weights, the engine's
  ``w8a8_block_fp8`` matmul); per-tensor / per-channel / per-token scales multiply the finished sum.
- Weight-only: each weight tile is decoded in registers (fp8 bytes to values; int8; 4/8-bit codes
  unpacked from int32 words with shifts and masks; zero points subtracted) into small integers or
  fp8 values, all exact in x's dtype, multiplied with the x tile, and the partial sum scaled by
  its group's (block's) scales; per-tensor / per-channel scales after the loop. The float weight
  is never materialised, not even a tile of it in float32 times its scale.

A K tile never straddles a scale group: ``BLOCK_K`` divides the group (block) size, which must be
a multiple of 16, ``tl.dot``'s smallest K (``supports``).

fp8 codes are read as bytes and decoded by bit arithmetic (``_fp8_value``): weights are always
float8_e4m3fn (also on ROCm, where they are converted as e4m3fn, never reinterpreted as fnuz);
activations are quantized to the format the op asks for (``fp8_dtype``/``fp8_max``, ``quant_fp8``'s
keywords: float8_e4m3fnuz with max 224 on MI300-class GPUs, as the native body there).

Only when interpreting: 16-bit dot operands are upcast to float32 (the interpreter misreads
bfloat16 ``tl.dot``; exact) and bfloat16 output casts round to nearest even, as a GPU does.
The reduction loop runs to the constexpr K (one per layer), which Triton 3.5's interpreter needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import gpu_target, interpreting
from dualop.kernels.cuda import quant_fp8 as fp8_quant
from dualop.kernels.cuda.common import _dot, cast_out, needs_exact_bf16, rows_view

__all__ = ["quantized_matmul", "supports", "block_sizes", "GemmBlocks"]

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FP8_FORMATS = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 224.0}
_MIN_DOT_K = 16  # tl.dot's smallest K: scale groups must be multiples of it

# What the GEMM's left operand holds (A_KIND) and how the weight is stored (W_FORMAT).
_A_FLOAT, _A_FP8, _A_INT8 = 0, 1, 2
_W_FP8, _W_INT8, _W_PACKED, _W_AWQ = 0, 1, 2, 3
# Weight scales (W_SCALE): one scalar, one per output column, or per (column group, K group) tile.
_S_TENSOR, _S_COLUMN, _S_TILE = 0, 1, 2
# x scales (A_SCALE): none (weight-only), one scalar, one per row, one per (row, K group).
_X_NONE, _X_SCALAR, _X_ROW, _X_ROW_GROUP = 0, 1, 2, 3
# Zero points (ZERO): none, as stored (scale's shape), packed along N (compressed-tensors), AWQ's.
_Z_NONE, _Z_PLAIN, _Z_PACKED, _Z_AWQ = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class GemmBlocks:
    """Tile sizes and launch options of one GEMM launch."""

    m: int
    n: int
    k: int
    warps: int
    stages: int


def block_sizes(rows: int, dot_bytes: int, k_group: int, *, w8a8: bool, hip: bool = False) -> GemmBlocks:
    """The tiles for ``rows`` rows of x, ``tl.dot`` operands of ``dot_bytes`` bytes (1: fp8 or
    int8 codes; 2: 16-bit, also fp8 codes decoded to bfloat16; 4: float32) and scale groups of
    ``k_group`` columns along K (0: none). Decode-sized batches (<= 16 rows) take 16-row tiles (a
    bigger tile is mostly padding) and four pipeline stages (the weight stream is the cost); up to
    128 rows 64 x 128 tiles; beyond, W8A8 128 x 128 with eight warps. Weight-only prefill stays
    at 64 x 128: its per-group partial sum beside the accumulator and the unpacked tile spilled at
    128 x 128 (255 registers, sm_90, per ``dualop compile``). K steps of 128 for 1-byte operands,
    64 for 16-bit (the decoded fp8 fallback spilled at 128 on sm_80), 32 for float32, cut to the
    largest power of two dividing ``k_group``. ROCm (``hip``): two stages (MI300's 64 KiB of LDS;
    Triton's AMD default)."""
    if rows <= 16:
        m, n, warps, stages = 16, 64, 4, 4
    elif rows <= 128 or not w8a8:
        m, n, warps, stages = 64, 128, 4, 3
    else:
        m, n, warps, stages = 128, 128, 8, 3
    k = {1: 128, 2: 64}.get(dot_bytes, 32)
    if k_group:
        k = min(k, k_group & -k_group)
    return GemmBlocks(m, n, k, warps, 2 if hip else stages)


# ----------------------------------------------------------------------------------- decoding


@triton.jit
def _fp8_value(byte, FNUZ: tl.constexpr):
    """The float32 values of float8_e4m3fn bytes (float8_e4m3fnuz if ``FNUZ``), exact. The byte's
    7 magnitude bits, placed as a float16's exponent and top mantissa bits, make a float16 of the
    right significand (subnormals included) 2**8 (fnuz: 2**7) too small; NaN bytes (fn 0x7f/0xff,
    fnuz 0x80) become NaN. No float8 type is needed, so any GPU (and the interpreter) runs it."""
    b = byte.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    v = half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    if FNUZ:
        return tl.where(b == 0x80, float("nan"), v * 128.0)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v * 256.0)


@triton.jit
def _unpack_rows(words, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS // per_word, COLS]`` int32 words, each holding ``per_word = 32 // BITS`` codes of
    consecutive rows (code i in bits ``BITS*i ..``), as unsigned codes ``[ROWS, COLS]``."""
    PER_WORD: tl.constexpr = 32 // BITS
    shifts = tl.arange(0, PER_WORD) * BITS
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (ROWS, COLS))


@triton.jit
def _awq_slot(j):
    """The nibble holding AWQ's code ``j`` (0..7) of a word: ``AWQ_NIBBLE_OF`` = 0 4 1 5 2 6 3 7."""
    return (j >> 1) + 4 * (j & 1)


@triton.jit
def _weight_tile(codes_ptr, k0, col0, ks, cols, k_ok, col_ok, codes_stride, n_words,
                 W_FORMAT: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` weight codes at rows ``ks`` (K, from ``k0``) and columns ``cols``
    (N, from ``col0``): fp8 bytes (uint8), int8, or int32 codes (signed for the packed layout,
    unsigned for AWQ's)."""
    if W_FORMAT == 2:  # packed along K: codes [N, words], 32 // BITS codes a word, stored unsigned
        PER_WORD: tl.constexpr = 32 // BITS
        word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
        words = tl.load(codes_ptr + cols.to(tl.int64)[None, :] * codes_stride + word[:, None],
                        mask=(word < n_words)[:, None] & col_ok[None, :], other=0)
        return _unpack_rows(words, BITS, BLOCK_K, BLOCK_N) - (1 << (BITS - 1))
    elif W_FORMAT == 3:  # AWQ: codes [K, N / 8], words along N
        word = col0 // 8 + tl.arange(0, BLOCK_N // 8)
        words = tl.load(codes_ptr + ks.to(tl.int64)[:, None] * codes_stride + word[None, :],
                        mask=k_ok[:, None] & (word < n_words)[None, :], other=0)
        shifts = _awq_slot(tl.arange(0, 8)) * 4
        return tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
    else:  # plain [N, K]: fp8 bytes or int8
        return tl.load(codes_ptr + cols.to(tl.int64)[None, :] * codes_stride + ks[:, None],
                       mask=k_ok[:, None] & col_ok[None, :], other=0)


@triton.jit
def _zero_points(zero_ptr, scale_rows, cols, col_ok, group, zero_stride_n, zero_stride_k,
                 ZERO: tl.constexpr, BITS: tl.constexpr):
    """This K group's zero point of each column (int32; signed as the packed codes, unsigned as AWQ's)."""
    if ZERO == 1:  # stored like the scales
        z = tl.load(zero_ptr + scale_rows * zero_stride_n + group * zero_stride_k, mask=col_ok, other=0)
        return z.to(tl.int32)
    elif ZERO == 2:  # compressed-tensors: packed along N, 32 // BITS a word, stored unsigned
        PER_WORD: tl.constexpr = 32 // BITS
        word = tl.load(zero_ptr + (scale_rows // PER_WORD) * zero_stride_n + group * zero_stride_k, mask=col_ok,
                       other=0)
        return ((word >> ((scale_rows % PER_WORD) * BITS)) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
    else:  # AWQ: [K / g, N / 8], AWQ's nibble order, unsigned
        word = tl.load(zero_ptr + group * zero_stride_k + cols // 8, mask=col_ok, other=0)
        return (word >> (_awq_slot(cols % 8) * 4)) & 0xF


# --------------------------------------------------------------------------------------- GEMM


@triton.jit
def _gemm_kernel(
    a_ptr, codes_ptr, w_scale_ptr, zero_ptr, a_scale_ptr, bias_ptr, out_ptr,
    rows, n, a_stride, codes_stride, n_words, w_scale_stride_n, w_scale_stride_k, zero_stride_n, zero_stride_k,
    a_scale_stride, out_stride,
    K: tl.constexpr, A_KIND: tl.constexpr, A_FNUZ: tl.constexpr, FP8_DOT: tl.constexpr,
    W_FORMAT: tl.constexpr, BITS: tl.constexpr, W_SCALE: tl.constexpr, SCALE_N: tl.constexpr,
    GROUP_K: tl.constexpr, ZERO: tl.constexpr, A_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    # Programs walk GROUP_M row tiles per column tile, so a wave reuses the same weight tiles.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rws = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rws < rows
    col_ok = cols < n
    a_rows = a_ptr + rws.to(tl.int64)[:, None] * a_stride
    # the scale row of each column: its block row (block weights), itself, or 0 (per tensor)
    if SCALE_N == 0:
        scale_rows = tl.zeros([BLOCK_N], dtype=tl.int32)
    else:
        scale_rows = cols // SCALE_N
    # Partial sums scaled per K tile need a float accumulator; otherwise int8 x int8 stays int32.
    INT_ACC: tl.constexpr = A_KIND == 2 and W_SCALE != 2 and A_SCALE != 3
    if INT_ACC:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ZERO != 0 and W_SCALE != 2:  # one zero point per column for all of K
        zero = _zero_points(zero_ptr, scale_rows, cols, col_ok, 0, zero_stride_n, zero_stride_k, ZERO, BITS)

    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        group = k0 // GROUP_K
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = _weight_tile(codes_ptr, k0, pid_n * BLOCK_N, ks, cols, k_ok, col_ok, codes_stride, n_words,
                         W_FORMAT, BITS, BLOCK_K, BLOCK_N)
        if A_KIND == 2:  # int8 codes x int8 codes
            part = tl.dot(a, w.to(tl.int8), out_dtype=tl.int32)
        elif A_KIND == 1:  # fp8 codes x fp8 codes
            if FP8_DOT:  # bytes loaded, bitcast: the interpreter cannot fill masked fp8 loads
                part = tl.dot(a.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True))
            else:
                a = _fp8_value(a, A_FNUZ).to(tl.bfloat16)
                w = _fp8_value(w, False).to(tl.bfloat16)
                part = _dot(a, w, DOT_PRECISION, DOT_UPCAST)
        else:  # x itself times the decoded tile, exact in x's dtype
            if W_FORMAT == 0:
                w = _fp8_value(w, False)
            elif ZERO != 0:
                if W_SCALE == 2:
                    zero = _zero_points(zero_ptr, scale_rows, cols, col_ok, group, zero_stride_n, zero_stride_k,
                                        ZERO, BITS)
                w = w.to(tl.int32) - zero[None, :]
            # through float32: the interpreter's int -> bfloat16 cast is wrong (3.5, 3.9); exact either way
            part = _dot(a, w.to(tl.float32).to(a.dtype), DOT_PRECISION, DOT_UPCAST)
        if INT_ACC:
            acc += part
        else:
            part = part.to(tl.float32)
            if W_SCALE == 2:
                ws = tl.load(w_scale_ptr + scale_rows * w_scale_stride_n + group * w_scale_stride_k, mask=col_ok,
                             other=0.0).to(tl.float32)
                part = part * ws[None, :]
            if A_SCALE == 3:
                xs = tl.load(a_scale_ptr + rws * a_scale_stride + group, mask=row_ok, other=0.0)
                part = part * xs[:, None]
            acc += part

    y = acc.to(tl.float32)
    if A_SCALE == 1:
        y = y * tl.load(a_scale_ptr)
    elif A_SCALE == 2:
        y = y * tl.load(a_scale_ptr + rws * a_scale_stride, mask=row_ok, other=0.0)[:, None]
    if W_SCALE == 0:
        y = y * tl.load(w_scale_ptr).to(tl.float32)
    elif W_SCALE == 1:
        y = y * tl.load(w_scale_ptr + scale_rows * w_scale_stride_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rws.to(tl.int64)[:, None] * out_stride + cols[None, :], cast_out(y, out_ptr, EXACT_BF16),
             mask=row_ok[:, None] & col_ok[None, :])


# ------------------------------------------------------------------------- activation quantisation


@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, x_stride, q_stride,
                       K: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """One row of x to int8 codes and its float32 scale, as the native body: ``scale = amax / 127``
    (1 for an all-zero row) or the static one; ``codes = clip(round_half_even(x / scale))``, both
    divisions correctly rounded. Where the native row comes out all NaN (a NaN in x; dynamically,
    an infinite amax: 0 * inf), the stored scale is NaN, so the GEMM's row is too."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    amax = 0.0
    has_nan = 0
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        has_nan = tl.maximum(has_nan, tl.max((v != v).to(tl.int32), axis=0))
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
    if STATIC:
        scale = tl.load(in_scale_ptr)
        bad = has_nan > 0
    else:
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, 127.0), 1.0)
        bad = (has_nan > 0) | (amax == float("inf"))
    tl.store(s_ptr + row, tl.where(bad, float("nan"), scale))
    for c0 in range(0, K, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < K
        v = tl.math.div_rn(tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32), scale)
        v = tl.minimum(tl.maximum(v, -128.0), 127.0)  # clip, then round: the same, the bounds being integers
        v = tl.where(v != v, 0.0, v)
        v = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds to an integer, ties to even
        tl.store(q_ptr + row * q_stride + cols, v.to(tl.int8), mask=mask)


def _quantize_int8(x2: torch.Tensor, input_scale: torch.Tensor | None):
    """``(codes int8 [M, K], scale float32 [M])`` of x's rows (dynamic, or ``input_scale``)."""
    rows, k = x2.shape
    codes = torch.empty((rows, k), dtype=torch.int8, device=x2.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=x2.device)
    static = input_scale is not None
    in_scale = input_scale.to(torch.float32).reshape(1).contiguous() if static else scale
    block = min(triton.next_power_of_2(k), 4096)
    _quant_int8_kernel[(rows,)](x2, codes, scale, in_scale, x2.stride(0), codes.stride(0),
                                K=k, STATIC=static, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    return codes, scale


def _quantize_fp8(x2: torch.Tensor, quant: Any, input_scale: torch.Tensor | None, fp8_dtype: str, fp8_max: float):
    """``(codes [M, K] as uint8 bytes of fp8_dtype, scale float32, A_SCALE mode)`` by ``quant_fp8``'s
    kernel: per (token, ``block[1]`` columns) for block weights, per tensor when static or for
    tensor-scaled weights, else per token. The kernel writes the bytes itself (``EXACT_FP8``):
    the native cast's bytes on any GPU, sm_80 included."""
    rows, k = x2.shape
    dev = x2.device
    static = quant.activations == "static"
    if quant.strategy == "block":
        width, mode, x_scale = quant.block[1], fp8_quant._DYNAMIC, _X_ROW_GROUP
    elif static:
        width, mode, x_scale = k, fp8_quant._STATIC_SCALAR, _X_SCALAR
    elif quant.strategy == "tensor":
        width, mode, x_scale = k, fp8_quant._FROM_AMAX, _X_SCALAR
    else:
        width, mode, x_scale = k, fp8_quant._DYNAMIC, _X_ROW
    n_groups = k // width
    codes = torch.empty((rows, k), dtype=torch.uint8, device=dev)
    amax = torch.zeros(1, dtype=torch.float32, device=dev)
    if mode == fp8_quant._STATIC_SCALAR:
        scale = input_scale.to(torch.float32).reshape(1).contiguous()
    else:
        scale = torch.empty((1,) if x_scale == _X_SCALAR else (rows, n_groups), dtype=torch.float32, device=dev)
    if mode == fp8_quant._FROM_AMAX:
        block_a = min(triton.next_power_of_2(k), fp8_quant._CHUNK)
        fp8_quant._amax_kernel[(rows, triton.cdiv(k, block_a))](
            x2, amax, x2.stride(0), k, BLOCK=block_a, num_warps=min(max(block_a // 256, 1), 8))
    single = width <= fp8_quant.MAX_SINGLE_PASS
    block = triton.next_power_of_2(width) if single else fp8_quant._CHUNK
    fp8_quant._quant_kernel[(rows, n_groups)](
        x2, codes, scale, amax, amax, x2.stride(0), codes.stride(0), width, n_groups,
        MODE=mode, HAS_UB=False, BLOCK=block, N_CHUNKS=triton.cdiv(width, block), EXACT_FP8=True,
        FP8_MAX=fp8_max, MIN_SCALE=1.0 / (fp8_max * 512.0), FNUZ=fp8_dtype == "float8_e4m3fnuz",
        num_warps=min(max(block // 256, 1), 16),
    )
    return codes, scale, x_scale


# ----------------------------------------------------------------------------------- wrapper


def supports(quant: Any, n: int, k: int, dtype_name: str) -> str | None:
    """None if ``quantized_matmul`` takes scheme ``quant`` for an ``[n, k]`` weight and x of
    ``dtype_name``, else why not."""
    if dtype_name not in _FLOAT_DTYPES:
        return f"x of {dtype_name}: the GEMM takes float32, bfloat16 or float16 activations"
    if n < 1 or k < 1:
        return f"an empty weight ({n}x{k})"
    group = {"group": quant.group_size, "block": quant.block[1] if quant.block else 0}.get(quant.strategy, 0)
    if group and group % _MIN_DOT_K:
        return (f"scale groups of {group} columns: K tiles must not straddle a group, and tl.dot takes K tiles of "
                f"at least {_MIN_DOT_K} (a multiple of {_MIN_DOT_K} is needed)")
    if quant.activations != "none" and quant.strategy == "block" and k % quant.block[1]:
        return f"W8A8 block scales: {k} input features do not split into activation groups of {quant.block[1]}"
    return None


def _fp8_dot_default(device: Any, fp8_dtype: str) -> bool:
    """fp8 operands for ``tl.dot``: CUDA sm_89+ (e4m3fn activations). ROCm multiplies decoded
    bfloat16: MI300's fp8 is fnuz, which cannot hold the e4m3fn weights (|w| up to 448)."""
    target = gpu_target(device)
    return (target is not None and target.backend == "cuda" and int(target.arch) >= 89
            and fp8_dtype == "float8_e4m3fn")


def _default_fp8_dtype(device: Any) -> str:
    """The activations' fp8 format when the op gives none: fnuz on gfx94x (MI300), as ``fp8_format``."""
    target = gpu_target(device)
    hip94 = target is not None and target.backend == "hip" and str(target.arch).startswith("gfx94")
    return "float8_e4m3fnuz" if hip94 else "float8_e4m3fn"


def quantized_matmul(x, codes, scale, zero_point=None, input_scale=None, bias=None, *, quant, n, k,
                     fp8_dtype: str | None = None, fp8_max: float | None = None, fp8_dot: bool | None = None):
    """``y [..., n] = x @ W^T (+ bias)`` in x's dtype, W the ``[n, k]`` weight of scheme ``quant``
    (a ``WeightQuant``; its arrays as a ``QuantizedWeight`` holds them). W8A8 fp8 activations are
    quantized to ``fp8_dtype`` clipped to ``fp8_max`` (``quant_fp8``'s keywords; default: the
    target's, fnuz/224 on gfx94x, else e4m3fn/448). ``fp8_dot`` forces (True) or forbids (False)
    fp8 ``tl.dot`` operands; default: CUDA sm_89+. The input is assumed valid (the op checks it)."""
    lead = tuple(x.shape[:-1])
    out = torch.empty((*lead, n), dtype=x.dtype, device=x.device)
    x2 = rows_view(x)
    rows = x2.shape[0]
    if rows == 0:
        return out
    out2 = out.view(rows, n)
    target = gpu_target(x.device)
    hip = target is not None and target.backend == "hip"
    fp8_dtype = fp8_dtype or _default_fp8_dtype(x.device)
    fp8_max = fp8_max if fp8_max is not None else _FP8_FORMATS[fp8_dtype]
    w8a8 = quant.activations != "none"
    fp8_dot = bool(fp8_dot) if fp8_dot is not None else _fp8_dot_default(x.device, fp8_dtype)

    # the left operand: x itself, or its codes and scales
    a_scale = scale  # a placeholder pointer where there is none
    x_scale_mode, a_scale_stride = _X_NONE, 0
    if w8a8 and quant.codes == "int8":
        a, a_scale = _quantize_int8(x2, input_scale if quant.activations == "static" else None)
        a_kind, x_scale_mode, a_scale_stride = _A_INT8, _X_ROW, 1
    elif w8a8:
        a, a_scale, x_scale_mode = _quantize_fp8(x2, quant, input_scale, fp8_dtype, fp8_max)
        a_kind = _A_FP8
        a_scale_stride = a_scale.stride(0) if x_scale_mode == _X_ROW_GROUP else 1
    else:
        a, a_kind = x2, _A_FLOAT

    # the weight: its storage, scales and zero points
    if quant.layout == "packed":
        w_format, bits = _W_PACKED, quant.bits
    elif quant.layout == "awq":
        w_format, bits = _W_AWQ, 4
    else:
        w_format, bits = (_W_FP8, 8) if quant.codes == "fp8" else (_W_INT8, 8)
    codes = codes.contiguous()
    w = codes.view(torch.uint8) if w_format == _W_FP8 else codes
    n_words = codes.shape[1]
    if quant.strategy == "tensor":
        w_scale, scale_n, group_k = _S_TENSOR, 0, k
    elif quant.strategy == "channel":
        w_scale, scale_n, group_k = _S_COLUMN, 1, k
    elif quant.strategy == "block":
        w_scale, (scale_n, group_k) = _S_TILE, quant.block
    else:
        w_scale, scale_n, group_k = _S_TILE, 1, quant.group_size
    if quant.layout == "awq":  # scales [K / g, N]
        s_stride_n, s_stride_k = scale.stride(1), scale.stride(0)
    else:
        s_stride_n = scale.stride(0) if scale.ndim == 2 else 0
        s_stride_k = scale.stride(1) if scale.ndim == 2 else 0
    zero_mode, z_stride_n, z_stride_k = _Z_NONE, 0, 0
    if zero_point is not None:
        zero_point = zero_point.contiguous()
        zero_mode = {"plain": _Z_PLAIN, "packed": _Z_PACKED, "awq": _Z_AWQ}[quant.layout]
        if quant.layout == "awq":
            z_stride_k = zero_point.stride(0)
        elif zero_point.ndim == 2:
            z_stride_n, z_stride_k = zero_point.stride(0), zero_point.stride(1)

    dot_bytes = x.element_size() if a_kind == _A_FLOAT else (2 if a_kind == _A_FP8 and not fp8_dot else 1)
    blocks = block_sizes(rows, dot_bytes, group_k if w_scale == _S_TILE else 0, w8a8=w8a8, hip=hip)
    grid = (triton.cdiv(rows, blocks.m) * triton.cdiv(n, blocks.n),)
    _gemm_kernel[grid](
        a, w, scale, scale if zero_point is None else zero_point, a_scale, out2 if bias is None else bias, out2,
        rows, n, a.stride(0), codes.stride(0), n_words, s_stride_n, s_stride_k, z_stride_n, z_stride_k,
        a_scale_stride, out2.stride(0),
        K=k, A_KIND=a_kind, A_FNUZ=fp8_dtype == "float8_e4m3fnuz", FP8_DOT=fp8_dot and a_kind == _A_FP8,
        W_FORMAT=w_format, BITS=bits, W_SCALE=w_scale, SCALE_N=scale_n, GROUP_K=group_k, ZERO=zero_mode,
        A_SCALE=x_scale_mode, HAS_BIAS=bias is not None,
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, GROUP_M=8,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 and a_kind == _A_FLOAT else "tf32",
        DOT_UPCAST=interpreting() and (a_kind == _A_FP8 or x.dtype != torch.float32),
        EXACT_BF16=needs_exact_bf16(x.dtype), num_warps=blocks.warps, num_stages=blocks.stages,
    )
    return out
