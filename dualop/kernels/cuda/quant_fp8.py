"""FP8 input quantisation as Triton kernels: the ``quant_fp8`` op's CUDA/ROCm path. Same contract
as ``kernels/pallas/quant_fp8.py``, in the format the op asks for (``ops/quantization.py``
``fp8_format``): float8_e4m3fn (``tl.float8e4nv``, max 448) or, on ROCm MI300-class GPUs,
float8_e4m3fnuz (``tl.float8e4b8``: exponent bias 8, NaN 0x80, no -0; max 224).

One program per (row, column group), where a column group is the whole row (per tensor, per token)
or ``g`` columns. A dynamic per-token/group program finds its group's amax, stores its scale and
quantises, holding the group in registers when it fits (``MAX_SINGLE_PASS``) and otherwise reading
it twice in constexpr-count chunks. Per tensor, dynamic: phase 1 (``_amax_kernel``) folds block
maxima into one float32 with ``atomic_max`` (|x| >= 0, so float ordering is integer ordering),
phase 2 is the quantise kernel, which derives the scale from that amax (program (0, 0) stores it).
``scale = div_rn(amax, max)`` and ``x_q = fp8(clip(x * div_rn(1, scale)))``: correctly rounded
divisions (a GPU's ``/`` may approximate), so results match the other backends bit for bit.

GPUs convert float32 -> e4m3 with round-to-nearest-even (``cvt.rn.satfinite``). Triton's CPU
interpreter does not (it dropped the exponent carry: 31.6 became 16, not 32); when interpreting,
values are rounded onto the e4m3 grid here and the kernel writes the bytes itself
(``EXACT_FP8``), for both formats, so the interpreter's own fp8 casts are never used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import interpreting
from dualop.kernels.cuda.common import rows_view

__all__ = ["quant_fp8", "MAX_SINGLE_PASS"]

# The output formats this kernel writes, by torch dtype name.
_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz}
MAX_SINGLE_PASS = 8192
_CHUNK = 4096

# scale modes of _quant_kernel
_DYNAMIC, _STATIC_SCALAR, _STATIC_PER_GROUP, _FROM_AMAX = 0, 1, 2, 3


@triton.jit
def _round_to_e4m3(y, FNUZ: tl.constexpr):
    """float32 ``y`` (|y| <= the format's max) rounded to the nearest e4m3fn (e4m3fnuz if ``FNUZ``)
    value, ties to even, in float32. Normals keep 3 mantissa bits in both formats; below the
    smallest normal (2**-6, fnuz 2**-7) values are multiples of 2**-9 (fnuz 2**-10)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000  # keep 3 mantissa bits
    a = mag.to(tl.float32, bitcast=True)
    if FNUZ:
        sub = ((a + 8192.0) - 8192.0).to(tl.uint32, bitcast=True)  # multiples of 2**-10
        r = tl.where(a >= 0.0078125, normal, sub)
    else:
        sub = ((a + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)  # multiples of 2**-9
        r = tl.where(a >= 0.015625, normal, sub)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_byte(y, FNUZ: tl.constexpr):
    """The float8_e4m3fn (float8_e4m3fnuz if ``FNUZ``) bit pattern of ``y`` (float32, already on
    that grid or NaN), as uint8. fnuz: exponent bias 8, NaN is 0x80 and zero has no sign.

    The Triton interpreter's float32 -> float8 cast is wrong near binade edges and maps NaN to a
    finite value, so when interpreting the kernel writes the bytes itself (into a uint8 view)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    a = tl.where(y != y, 0.0, mag.to(tl.float32, bitcast=True))  # NaN's byte is set below
    if FNUZ:
        exp = (mag >> 23).to(tl.int32) - 127 + 8
        normal = ((exp.to(tl.uint32) << 3) | ((mag >> 20) & 0x7)) & 0x7F
        subnormal = (a * 1024.0).to(tl.uint32)  # 0..7 multiples of 2**-10
        byte = tl.where(a >= 0.0078125, normal, subnormal)
        byte = tl.where(byte == 0, byte, byte | sign)  # 0x80 would be NaN: no -0
        byte = tl.where(y != y, 0x80, byte)
    else:
        exp = (mag >> 23).to(tl.int32) - 127 + 7
        normal = ((exp.to(tl.uint32) << 3) | ((mag >> 20) & 0x7)) & 0x7F
        subnormal = (a * 512.0).to(tl.uint32)  # 0..7 multiples of 2**-9
        byte = tl.where(a >= 0.015625, normal, subnormal)
        byte = tl.where(y != y, 0x7F, byte) | sign
    return byte.to(tl.uint8)


@triton.jit
def _abs_max(x):
    """max(|x|) over a block, NaN if any element is NaN (tl.max, like fmax, would skip it; torch's
    amax propagates it)."""
    has_nan = tl.max((x != x).to(tl.int32), axis=0)
    return tl.where(has_nan > 0, float("nan"), tl.max(tl.abs(x), axis=0))


@triton.jit
def _keep_nan(a, b):
    """``b``, unless ``a`` is NaN: min/max/clamp below must propagate NaN as torch does."""
    return tl.where(a != a, a, b)


@triton.jit
def _quantise(x, inv_scale, q_ptr, EXACT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FNUZ: tl.constexpr):
    v = x * inv_scale
    y = _keep_nan(v, tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX))
    if EXACT_FP8:  # q_ptr is a uint8 view of the output (see _e4m3_byte)
        return _e4m3_byte(_keep_nan(y, _round_to_e4m3(y, FNUZ)), FNUZ)
    return y.to(q_ptr.dtype.element_ty)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, x_row_stride, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, _abs_max(x))  # a NaN (positive after abs) wins atomic_max too


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, ub_ptr, amax_ptr,
    x_row_stride, q_row_stride, width, n_groups,
    MODE: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr,
    EXACT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, FNUZ: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    x_grp = x_ptr + row * x_row_stride + group * width
    q_grp = q_ptr + row * q_row_stride + group * width
    s_idx = row * n_groups + group
    if MODE == 0:  # dynamic: this group's amax -> scale
        if N_CHUNKS == 1:
            cols = tl.arange(0, BLOCK)
            x = tl.load(x_grp + cols, mask=cols < width, other=0.0).to(tl.float32)
            amax = _abs_max(x)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for chunk in range(N_CHUNKS):
                cols = chunk * BLOCK + tl.arange(0, BLOCK)
                v = tl.abs(tl.load(x_grp + cols, mask=cols < width, other=0.0).to(tl.float32))
                acc = _keep_nan(v, _keep_nan(acc, tl.maximum(acc, v)))
            amax = _abs_max(acc)
        if HAS_UB:
            amax = _keep_nan(amax, tl.minimum(amax, tl.load(ub_ptr)))
        scale = _keep_nan(amax, tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE))
        tl.store(s_ptr + s_idx, scale)
    elif MODE == 1:  # static per tensor
        scale = tl.load(s_ptr)
    elif MODE == 2:  # static per token / group
        scale = tl.load(s_ptr + s_idx)
    else:  # dynamic per tensor, phase 2: the global amax is in amax_ptr
        amax = tl.load(amax_ptr)
        scale = _keep_nan(amax, tl.maximum(tl.math.div_rn(amax, FP8_MAX), MIN_SCALE))
        tl.store(s_ptr, scale, mask=s_idx == 0)
    inv_scale = tl.math.div_rn(1.0, scale)
    if MODE == 0 and N_CHUNKS == 1:
        tl.store(q_grp + cols, _quantise(x, inv_scale, q_ptr, EXACT_FP8, FP8_MAX, FNUZ), mask=cols < width)
    else:
        for chunk in range(N_CHUNKS):
            cols = chunk * BLOCK + tl.arange(0, BLOCK)
            mask = cols < width
            x = tl.load(x_grp + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_grp + cols, _quantise(x, inv_scale, q_ptr, EXACT_FP8, FP8_MAX, FNUZ), mask=mask)


def quant_fp8(
    x: torch.Tensor,
    scale: torch.Tensor | None = None,
    scale_ub: torch.Tensor | None = None,
    *,
    granularity: str = "tensor",
    group_size: int = 0,
    fp8_dtype: str = "float8_e4m3fn",
    fp8_max: float = 448.0,
    max_single_pass: int = MAX_SINGLE_PASS,
    chunk: int = _CHUNK,
):
    """Quantise ``x`` to ``fp8_dtype`` (float8_e4m3fn or float8_e4m3fnuz), clipping to
    ``+-fp8_max`` (the op's ``fp8_format`` gives both); returns ``(x_q, scale)`` (new tensors;
    scale shapes as in ``ops/quantization.py``). ``max_single_pass``/``chunk`` let tests force the
    chunked path."""
    if granularity not in ("tensor", "token", "group"):
        raise ValueError(f"quant_fp8: granularity {granularity!r} is not 'tensor', 'token' or 'group'")
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"quant_fp8: fp8_dtype {fp8_dtype!r} is not one of {sorted(_FP8_DTYPES)}")
    min_scale = 1.0 / (fp8_max * 512.0)
    shape, hidden = x.shape, x.shape[-1]
    lead = tuple(shape[:-1])
    width = group_size if granularity == "group" else hidden
    n_groups = hidden // width
    x2 = rows_view(x)
    rows = x2.shape[0]
    dev = x.device
    q = torch.empty((rows, hidden), dtype=_FP8_DTYPES[fp8_dtype], device=dev)
    if granularity == "tensor":
        scale_shape = (1,)
    else:
        scale_shape = (*lead, n_groups)
    amax = torch.zeros(1, dtype=torch.float32, device=dev)  # also a placeholder pointer
    if scale is None:
        mode = _FROM_AMAX if granularity == "tensor" else _DYNAMIC
        out_scale = torch.empty(scale_shape, dtype=torch.float32, device=dev)
        if granularity == "tensor" and rows == 0:
            out_scale.fill_(min_scale)  # amax of nothing is 0
    else:
        mode = _STATIC_SCALAR if granularity == "tensor" else _STATIC_PER_GROUP
        out_scale = scale.to(torch.float32).reshape(scale_shape).contiguous()
    ub = scale_ub.to(torch.float32).reshape(1).contiguous() if scale_ub is not None else amax
    if rows > 0:
        if mode == _FROM_AMAX:
            block_a = min(triton.next_power_of_2(hidden), _CHUNK)
            _amax_kernel[(rows, triton.cdiv(hidden, block_a))](
                x2, amax, x2.stride(0), hidden, BLOCK=block_a, num_warps=min(max(block_a // 256, 1), 8)
            )
        single = width <= max_single_pass
        block = triton.next_power_of_2(width) if single else chunk
        exact = interpreting()
        _quant_kernel[(rows, n_groups)](
            x2, q.view(torch.uint8) if exact else q, out_scale, ub, amax,
            x2.stride(0), q.stride(0), width, n_groups,
            MODE=mode, HAS_UB=scale_ub is not None, BLOCK=block, N_CHUNKS=triton.cdiv(width, block),
            EXACT_FP8=exact, FP8_MAX=fp8_max, MIN_SCALE=min_scale, FNUZ=fp8_dtype == "float8_e4m3fnuz",
            num_warps=min(max(block // 256, 1), 16),
        )
    return q.reshape(shape), out_scale
