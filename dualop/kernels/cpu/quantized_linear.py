"""Linear layers on quantized weights on the CPU for torch tensors (kernel: ``csrc/quantized_linear.cc``):
``y = x @ W^T + bias`` for a ``QuantizedWeight``'s arrays (schemes: ``ops/quantized_weight.py``; their
math: ``kernels/quant_math.py``; the reference: ``ops/linear.py`` ``_native_gemm``). Same contract as
the Pallas and Triton quantized GEMMs.

Why a kernel of its own: decode on the CPU is weight-bandwidth bound, so an 8-bit weight read as it
is stored moves half the bytes of the bfloat16 weight oneDNN multiplies, and a 4-bit one a quarter,
provided nothing widens the whole weight first. The kernel decodes the codes tile by tile in
registers into exact bfloat16 numbers (int8 / int4 codes, e4m3 values), multiplies them with
bfloat16 x on AVX512-BF16 (float32 sums; float32 and float16 x: float32 FMAs) and scales each scale
group's partial sum; zero points are taken off with the group's sum of x. int8 W8A8 quantizes x
per row (or by the static scale) exactly as ``quantize_activations`` and multiplies the codes on
AVX512-VNNI into int32. fp8 W8A8 quantizes x to e4m3 codes as ``quant_fp8``'s native body does
(per tensor, per row, or per row and block[1] columns for block weights), runs the codes (exact
bfloat16 numbers, for any x dtype) on the weight-only tiles, and scales each scale block's partial
sum by the weight's scale times x's. Hosts without those instructions (or group sizes not a
multiple of 32) run the kernel's portable path: a weight row dequantised (W8A8: decoded) to float32
at a time.

Covered: weight-only int8 (tensor, channel, group, block; zero points except with blocks), fp8
e4m3fn (tensor, channel, block), int4 / int8 ``packed`` (group, channel; zero points), int4 ``awq``;
int8 W8A8 (tensor, channel, block; dynamic or static); fp8 W8A8 (tensor, channel, block; dynamic
or static). Declined (``supports`` says why): x of other dtypes; fp8 block W8A8 whose K is not a
multiple of block[1] (the op rejects it too); AWQ with N not a multiple of 8.
"""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.abi import array_arg, c_function

__all__ = ["PreparedWeight", "prepare", "quantized_matmul", "supports"]

_C_QUANTIZED_LINEAR = c_function(
    "int dualop_quantized_linear(const DualopArray* x, const DualopArray* codes, const DualopArray* scale, "
    "const DualopArray* zero_point, const DualopArray* bias, const DualopArray* out, int format, int zero_kind, "
    "int64_t group_n, int64_t group_k, int threads)"
)
_C_QUANTIZED_LINEAR_AWQ = c_function(
    "int dualop_quantized_linear_awq(const DualopArray* x, const DualopArray* codes, const DualopArray* scale, "
    "const DualopArray* zero_point, const DualopArray* bias, const DualopArray* out, int64_t group_k, int threads)"
)
_C_QUANTIZED_LINEAR_W8A8 = c_function(
    "int dualop_quantized_linear_w8a8(const DualopArray* x, const DualopArray* codes, const DualopArray* scale, "
    "const DualopArray* input_scale, const DualopArray* bias, const DualopArray* out, int format, int64_t group_n, "
    "int64_t group_k, int threads)"
)
_C_QUANTIZED_LINEAR_FP8_W8A8 = c_function(
    "int dualop_quantized_linear_fp8_w8a8(const DualopArray* x, const DualopArray* codes, const DualopArray* scale, "
    "const DualopArray* input_scale, const DualopArray* bias, const DualopArray* out, int x_groups, int64_t group_n, "
    "int64_t group_k, int threads)"
)

# csrc/quantized_linear.cc's code formats (rows of K) and zero-point storage kinds.
_INT8, _FP8, _INT4_PACKED, _INT8_PACKED = 0, 1, 2, 3
_NO_ZERO, _ZERO_INT8, _ZERO_INT32, _ZERO_PACKED4, _ZERO_PACKED8 = 0, 1, 2, 3, 4
# fp8 W8A8's scales of x: one for the tensor, one per row, one per row and K-block.
_X_PER_TENSOR, _X_PER_ROW, _X_PER_BLOCK = 0, 1, 2
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def supports(quant: Any, n: int, k: int, dtype_name: str) -> str | None:
    """None if ``quantized_matmul`` takes scheme ``quant`` (a ``WeightQuant``) for an ``[n, k]``
    weight and x of ``dtype_name``, else why not."""
    if dtype_name not in _FLOAT_DTYPES:
        return f"x of {dtype_name}: the C++ GEMM takes float32, bfloat16 or float16 activations"
    if quant.codes == "fp8" and quant.activations != "none" and quant.strategy == "block" and k % quant.block[1]:
        return f"{k} input features do not split into the {quant.block[1]}-column groups W8A8 quantizes x in"
    if quant.layout == "awq" and n % 8:
        return f"AWQ packs 8 output features a word; {n} is not a multiple of 8"
    return None


def _scale_grid(quant: Any, n: int, k: int) -> tuple[int, int]:
    """(group_n, group_k): the weight rows and columns one scale covers."""
    if quant.strategy == "tensor":
        return max(n, 1), max(k, 1)
    if quant.strategy == "channel":
        return 1, max(k, 1)
    if quant.strategy == "group":
        return 1, quant.group_size
    return quant.block


def _bytes(t: Any) -> Any:
    """A 1-byte tensor (int8, float8) as uint8, the kernels' byte arrays."""
    import torch

    return t.contiguous().view(torch.uint8)


def _zero_point(quant: Any, zero_point: Any, rows: int) -> tuple[Any, int]:
    """The zero points as the kernel's 2-D array and its storage kind."""
    import torch

    if zero_point is None:
        return None, _NO_ZERO
    zp = zero_point.contiguous()
    if quant.layout == "packed":
        return zp.reshape(zp.shape[0], -1), (_ZERO_PACKED4 if quant.bits == 4 else _ZERO_PACKED8)
    zp = zp.reshape(rows, -1)
    if zp.dtype == torch.int8:
        return _bytes(zp), _ZERO_INT8
    return zp, _ZERO_INT32


class PreparedWeight:
    """A quantized weight's side of the C++ GEMM's call, packed once (``prepare``): the entry
    point, the weight's arrays as packed ``DualopArray``s and the scheme's integers, so that a
    call (a decode step's linear layer) packs only x, the bias and the output. It holds the arrays
    it packed, so their data pointers stay valid and a change made in place is seen. ``copied``:
    some array was not row-major and was copied to be packed (the copy is not the weight's own
    memory, so a caller should not keep this object past the call)."""

    __slots__ = ("quant", "n", "k", "copied", "_fn", "_weight_args", "_ints", "_held")

    def __init__(self, codes: Any, scale: Any, zero_point: Any, input_scale: Any, *, quant: Any, n: int, k: int):
        load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
        self.quant, self.n, self.k = quant, n, k
        group_n, group_k = _scale_grid(quant, n, k)
        scale2 = scale.contiguous().reshape(scale.shape[0] if scale.ndim == 2 else 1, -1)
        if quant.layout == "awq":
            entry, a, b, c = _C_QUANTIZED_LINEAR_AWQ, codes.contiguous(), scale2, zero_point.contiguous()
            ints: tuple[int, ...] = (quant.group_size,)
        else:
            if quant.layout == "packed":
                fmt, a = (_INT4_PACKED if quant.bits == 4 else _INT8_PACKED), codes.contiguous()
            else:
                fmt, a = (_FP8 if quant.codes == "fp8" else _INT8), _bytes(codes)
            b = scale2
            if quant.activations != "none" and quant.codes == "fp8":
                static = quant.activations == "static"
                x_groups = (_X_PER_TENSOR if static or quant.strategy == "tensor" else
                            _X_PER_BLOCK if quant.strategy == "block" else _X_PER_ROW)
                entry, c = _C_QUANTIZED_LINEAR_FP8_W8A8, input_scale.contiguous().reshape(1) if static else None
                ints = (x_groups, group_n, group_k)
            elif quant.activations != "none":
                entry = _C_QUANTIZED_LINEAR_W8A8
                c = None if input_scale is None else input_scale.contiguous().reshape(1)
                ints = (fmt, group_n, group_k)
            else:
                c, zero_kind = _zero_point(quant, zero_point, scale2.shape[0])
                entry, ints = _C_QUANTIZED_LINEAR, (fmt, zero_kind, group_n, group_k)
        held = (a, b, c)
        # every one of these entry points takes (x, three weight arrays, bias, out, integers..., threads)
        self._fn = entry.c_function.positional()
        self._weight_args = tuple(None if t is None else array_arg(t) for t in held)
        self._ints, self._held = ints, held
        self.copied = any(t is not None and not t.is_contiguous() for t in (codes, scale, zero_point, input_scale))

    def __call__(self, x: Any, bias: Any = None, threads: int | None = None) -> Any:
        """``y [..., n] = x @ W^T (+ bias)`` in x's dtype on ``threads`` threads (default torch's);
        ``NotImplementedError`` for an x dtype ``supports`` declines."""
        import torch

        if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
            raise NotImplementedError(supports(self.quant, self.n, self.k, str(x.dtype).removeprefix("torch.")))
        n, k = self.n, self.k
        lead = tuple(x.shape[:-1])
        if x.numel() == 0:  # no rows (nothing to compute) or K = 0 (the bias alone)
            y = torch.zeros((*lead, n), dtype=torch.float32)
            return (y if bias is None else y + bias.float()).to(x.dtype)
        rows = (x if x.ndim == 2 else x.reshape(-1, k)).contiguous()
        out = torch.empty((rows.shape[0], n), dtype=x.dtype)
        status = self._fn(array_arg(rows), *self._weight_args, None if bias is None else array_arg(bias.contiguous()),
                          array_arg(out), *self._ints, torch.get_num_threads() if threads is None else threads)
        if status != 0:
            raise NotImplementedError(f"dualop_quantized_linear returned {status}")
        return out if x.ndim == 2 else out.reshape(*lead, n)


def prepare(codes: Any, scale: Any, zero_point: Any = None, input_scale: Any = None, *, quant: Any, n: int,
            k: int) -> PreparedWeight:
    """The weight side of ``quantized_matmul`` packed once (``PreparedWeight``), for a caller that
    multiplies the same weight many times; ``NotImplementedError`` for a scheme ``supports``
    declines (any x dtype it takes)."""
    why = supports(quant, n, k, "bfloat16")
    if why is not None:
        raise NotImplementedError(why)
    return PreparedWeight(codes, scale, zero_point, input_scale, quant=quant, n=n, k=k)


def quantized_matmul(x: Any, codes: Any, scale: Any, zero_point: Any = None, input_scale: Any = None,
                     bias: Any = None, *, quant: Any, n: int, k: int, threads: int | None = None) -> Any:
    """``y [..., n] = x @ W^T (+ bias)`` in x's dtype, W the ``[n, k]`` weight of scheme ``quant``
    (its arrays as a ``QuantizedWeight`` holds them), on ``threads`` threads (default torch's).
    The input is assumed valid (the op checks it); ``NotImplementedError`` for a scheme
    ``supports`` declines."""
    why = supports(quant, n, k, str(x.dtype).removeprefix("torch."))
    if why is not None:
        raise NotImplementedError(why)
    return prepare(codes, scale, zero_point, input_scale, quant=quant, n=n, k=k)(x, bias, threads)
