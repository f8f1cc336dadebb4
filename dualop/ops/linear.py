"""Linear ops of the reference serving engine, per tensor-parallel rank: ``replicated_linear``,
``column_parallel_linear`` (with its fused layouts ``MergedColumnParallelLinear`` and
``QKVParallelLinear``) and ``row_parallel_linear``.

``op(x, weight, bias=None)`` runs on THIS rank's shards (``weight``: ``[out_per_rank,
in_per_rank]``, torch layout; ``bias``: this rank's, or the whole bias for row-parallel) and makes
the engine's collectives through ``op.tp`` (a ``dualop.parallel.TensorParallel``): the column
op all-gathers its output when ``gather_output``, the row op all-reduces when ``reduce_results``
(adding the bias to rank 0's partial sum only, as the engine does). With ``return_bias`` (the
default) the result is ``(output, output_bias)``, ``output_bias`` being the bias when
``skip_bias_add`` (the caller adds it later) and None otherwise.

The math, ``x @ weight.T + bias``: every product of the inputs' dtype summed in float32, the bias
added in float32, one cast to ``x``'s dtype (``forward_native`` upcasts the operands and multiplies
in float32 at full precision: the reference). The platform paths are the vendor GEMM, never a
GEMM written here:

- torch on the CPU / CUDA / ROCm: ``F.linear`` (one addmm: oneDNN / cuBLAS / hipBLASLt on the
  operands' own dtype, the bias in the GEMM's epilogue); on the CPU a weight its owner packed for
  oneDNN (``kernels/cpu/linear.py``; ``dualop.models`` packs its models' linear weights) takes
  oneDNN's GEMM on the packed layout, with no per-call reorder;
- on a TPU (jax, torch_xla, torchax, torch_tpu arrays, through the Pallas bridge) and for jax
  arrays on a GPU: ``kernels/xla/linear``, ``jax.lax.dot_general`` on the operands' own dtype with
  float32 accumulation (``preferred_element_type``), the bias added in float32 (XLA fuses it into
  the dot's output fusion), then the cast. For 16-bit inputs that is one pass of the matrix unit,
  where the native body's float32 operands take several (that, and not a GEMM of its own, is why
  the TPU path is a path: the cells check it against the native body); float32 inputs ask for full
  precision (XLA:TPU would otherwise multiply them in one bfloat16 pass).

The shard arithmetic of the fused layouts (which rows of a full checkpoint tensor each rank keeps,
and where they go in its fused weight) is here once, as ``shard_copies``: the torch and jax layers'
``weight_loader``s both read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import ALL_FRONTENDS, CustomOp, Serves
from dualop.kernels.cpu.linear import matmul as packed_matmul, unpacked
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, dtype_name
from dualop.ops.quantized_weight import QuantizedWeight, WeightQuant, quantize_activations
from dualop.parallel import TensorParallel, current_tensor_parallel, divide, qkv_layout
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving, float32_normal as _normal, rows_of

_XLA_LINEAR = KernelRef("dualop.kernels.xla.linear", "linear")
# The quantized GEMMs, one per platform, each with its ``supports(quant, n, k, dtype) -> reason | None``.
_QUANTIZED_KERNELS = {
    "pallas": "dualop.kernels.pallas.quantized_matmul",
    "triton": "dualop.kernels.cuda.quantized_matmul",
    "cpu": "dualop.kernels.cpu.quantized_linear",
    "xla": "dualop.kernels.xla.quantized_linear",
}
_CPU_PREPARE = KernelRef(_QUANTIZED_KERNELS["cpu"], "prepare")
_QUANTIZED = {name: (KernelRef(module, "quantized_matmul" if name != "xla" else "quantized_linear"),
                     KernelRef(module, "supports")) for name, module in _QUANTIZED_KERNELS.items()}

__all__ = [
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "ShardCopy",
    "packed_weight",
]


@dataclasses.dataclass(frozen=True)
class ShardCopy:
    """Rows ``[src_start, src_stop)`` of a loaded checkpoint tensor (along the split dim) go to
    ``[dst_start, dst_start + src_stop - src_start)`` of a rank's parameter."""

    src_start: int
    src_stop: int
    dst_start: int


def _check_positive(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{op}: argument {name!r} must be a positive int, got {value!r}")
    return value


def _rank_slice(x: Any, rank: Any, size: int, axis: int = -1) -> Any:
    """Block ``rank`` of ``size`` equal blocks of ``x`` along ``axis`` (``rank`` an int, or a traced
    ``axis_index`` inside ``shard_map``)."""
    axis %= x.ndim
    if isinstance(rank, int):
        index = [slice(None)] * x.ndim
        index[axis] = slice(rank * size, (rank + 1) * size)
        return x[tuple(index)]
    import jax

    return jax.lax.dynamic_slice_in_dim(x, rank * size, size, axis=axis)


def _native_gemm(x: Any, weight: Any, bias: Any = None) -> Any:
    """The reference GEMM: operands upcast to float32, multiplied at full float32 precision, the
    bias added in float32, one cast to ``x``'s dtype. A ``QuantizedWeight`` is dequantised by its
    scheme's definition, and ``x`` first quantized as the scheme's W8A8 GEMM quantizes it
    (``quantize_activations``; weight-only schemes take ``x`` as it is)."""
    xp = array_namespace(x)
    if isinstance(weight, QuantizedWeight):
        xf, wf = quantize_activations(x, weight), weight.dequantize()
    else:
        weight = unpacked(weight)  # a weight packed for oneDNN by its owner: its plain values
        xf, wf = xp.astype(x, xp.float32), xp.astype(weight, xp.float32)
    y = xp.einsum("...k,nk->...n", xf, wf)
    if bias is not None:
        y = y + xp.astype(bias, xp.float32)
    return xp.astype(y, x.dtype)


def _quantized_kernel(platform: str, x: Any, weight: QuantizedWeight) -> tuple[KernelRef, dict[str, Any]]:
    """``platform``'s quantized GEMM and its static arguments for ``weight``, or
    ``NotImplementedError`` with the kernel's reason where it does not take the scheme."""
    kernel, supports = _QUANTIZED[platform]
    n, k = weight.shape
    why = supports(weight.quant, n, k, dtype_name(x))
    if why is not None:
        raise NotImplementedError(f"the {platform} quantized GEMM does not take {weight.quant.describe()} "
                                  f"weights of {x.dtype}: {why}")
    return kernel, {"quant": weight.quant, "n": n, "k": k}


def _quantized_arrays(weight: QuantizedWeight, bias: Any) -> tuple[Any, ...]:
    return weight.codes, weight.scale, weight.zero_point, weight.input_scale, bias


def _xla_quantized_linear(x: Any, weight: QuantizedWeight, bias: Any, interpret: bool) -> Any:
    """jax arrays off the TPU with a quantized weight: ``kernels/xla/quantized_linear``, XLA's dots
    on the codes (the weight stays quantized; the scales weight the partial sums)."""
    kernel, static = _quantized_kernel("xla", x, weight)
    return kernel(x, *_quantized_arrays(weight, bias), interpret=interpret, **static)


def _jax_gpu_linear(x: Any, weight: Any, bias: Any) -> Any:
    """jax arrays on a GPU: XLA's dot (cuBLAS); a CPU backend standing in upcasts (see the kernel)."""
    import jax

    interpret = jax.default_backend() == "cpu"
    if isinstance(weight, QuantizedWeight):
        return _xla_quantized_linear(x, weight, bias, interpret)
    return _XLA_LINEAR(x, weight, bias, interpret=interpret)


def packed_weight(weight: Any) -> Any:
    """A linear weight its owner will not change, packed once for the platform GEMM where that is
    faster: a CPU torch tensor of a dtype oneDNN takes is reordered into oneDNN's layout
    (``kernels/cpu/linear.py``; about twice ``F.linear``'s speed at decode batch sizes); anything
    else is returned as it is. The linear ops and the LM head take the result where they take the
    weight. ``DUALOP_CPU_PACKED_WEIGHTS=0`` leaves every weight as it is."""
    import os

    from dualop.kernels.cpu import linear

    if os.environ.get("DUALOP_CPU_PACKED_WEIGHTS", "1") == "0" or linear.packable(weight) is not None:
        return weight
    return linear.pack(weight)


def _torch_linear(x: Any, weight: Any, bias: Any) -> Any:
    """``F.linear``, or oneDNN's GEMM on a weight its owner packed (``kernels/cpu/linear.py``)."""
    return packed_matmul(x, weight, bias)


def _torch_gpu_linear(x: Any, weight: Any, bias: Any) -> Any:
    """torch on a GPU: ``F.linear`` (cuBLAS / hipBLASLt); a quantized weight the Triton quantized
    GEMM (``kernels/cuda/quantized_matmul``)."""
    if isinstance(weight, QuantizedWeight):
        kernel, static = _quantized_kernel("triton", x, weight)
        if weight.quant.codes == "fp8" and weight.quant.activations != "none":  # x's fp8 format: the platform's
            from dualop.ops.quantization import fp8_format

            fmt = fp8_format(x)
            static.update(fp8_dtype=fmt.dtype, fp8_max=fmt.max)
        return call_triton(frontend_of(x), kernel, x, *_quantized_arrays(weight, bias), **static)
    return _torch_linear(x, weight, bias)


def _torch_cpu_linear(x: Any, weight: Any, bias: Any) -> Any:
    """torch on the CPU: a quantized weight through the C++ quantized GEMM
    (``kernels/cpu/quantized_linear``: the codes dequantised tile by tile), or, where that is
    unavailable, int8 weight-only per-channel weights through torch's own int8 GEMM
    (``torch._weight_int8pack_mm``); a float weight as ``_torch_linear``."""
    if not isinstance(weight, QuantizedWeight):
        return _torch_linear(x, weight, bias)
    try:
        _quantized_kernel("cpu", x, weight)  # NotImplementedError where the kernel does not take the scheme
        return weight.derived("cpu", lambda: _cpu_prepared(weight))(x, bias)
    except NotImplementedError:  # the scheme is not the C++ GEMM's, or the C++ kernels are unavailable
        q = weight.quant
        if (q.codes, q.strategy, q.layout, q.symmetric, q.activations) != ("int8", "channel", "plain", True, "none"):
            raise
    import torch

    lead, k = x.shape[:-1], x.shape[-1]
    if x.numel() == 0:  # torch's int8 GEMM refuses an empty x
        return x.new_zeros((*lead, weight.shape[0]))
    y = torch._weight_int8pack_mm(x.reshape(-1, k).contiguous(), weight.codes, weight.scale.reshape(-1).to(x.dtype))
    y = y.reshape(*lead, y.shape[-1])
    return y if bias is None else (y.float() + bias.float()).to(x.dtype)


def _cpu_prepared(weight: QuantizedWeight) -> tuple[Any, bool]:
    """The C++ GEMM's call with ``weight``'s arguments packed once (``kernels/cpu/quantized_linear``
    ``prepare``; a decode step's linear layer then packs only x), and whether to keep it."""
    n, k = weight.shape
    prepared = _CPU_PREPARE(weight.codes, weight.scale, weight.zero_point, weight.input_scale, quant=weight.quant,
                            n=n, k=k)
    return prepared, not prepared.copied


class _Linear(CustomOp):
    """Shared body: input checks, the per-rank GEMM and the collectives (``_finish``, the one place
    they are made). Subclasses set the per-rank sizes and the bias / collective rules."""

    op_label: str | None = None  # the name errors give (default: the registered name)

    @property
    def _op(self) -> str:
        return self.op_label or type(self).name

    input_size: int
    output_size: int
    input_size_per_partition: int
    output_size_per_partition: int
    bias_size: int  # the bias this op takes: the rank's columns, or the whole (row-parallel)

    def _setup(self, op: str, input_size: Any, output_size: Any, bias: bool, skip_bias_add: bool, params_dtype: Any,
               return_bias: bool, disable_tp: bool, tp: TensorParallel | None) -> None:
        self.input_size = _check_positive(op, "input_size", input_size)
        self.output_size = _check_positive(op, "output_size", output_size)
        if tp is not None and not isinstance(tp, TensorParallel):
            raise TypeError(f"{op}: argument 'tp' must be a dualop.parallel.TensorParallel or None, "
                            f"got {type(tp).__qualname__}")
        self.disable_tp = bool(disable_tp)
        self.tp = TensorParallel() if self.disable_tp else (tp or current_tensor_parallel())
        self.has_bias, self.skip_bias_add = bool(bias), bool(skip_bias_add)
        self.params_dtype, self.return_bias = params_dtype, bool(return_bias)

    # -- checks -------------------------------------------------------------------------------

    @property
    def x_features(self) -> int:
        """The last dim ``x`` must have on this rank."""
        return self.input_size_per_partition

    def check_inputs(self, x: Any, weight: Any = None, bias: Any = None) -> None:
        op = self._op
        fe = check_array(op, "x", x)
        if x.shape[-1] != self.x_features:
            raise ValueError(f"{op}: argument 'x' has last dim {x.shape[-1]}; expected {self.x_features} "
                             f"(input features on this rank: {self._x_features_why()})")
        if weight is None:
            raise ValueError(f"{op}: argument 'weight' is required (shape "
                             f"({self.output_size_per_partition}, {self.input_size_per_partition}))")
        if isinstance(weight, QuantizedWeight):
            weight.check(op, "weight", x, fe, (self.output_size_per_partition, self.input_size_per_partition))
        else:
            check_optional_like(op, "weight", weight, "x", x, fe, same_dtype=True,
                                shape=(self.output_size_per_partition, self.input_size_per_partition))
        if bias is not None and not self.has_bias:
            raise ValueError(f"{op}: argument 'bias' must be None for an op built with bias=False")
        check_optional_like(op, "bias", bias, "x", x, fe, same_dtype=True, shape=(self.bias_size,))

    def _x_features_why(self) -> str:
        return f"input_size={self.input_size}"

    # -- the computation ------------------------------------------------------------------------

    def _gemm_bias(self, bias: Any) -> Any:
        """The bias the GEMM adds (None: none): the engine adds it unless ``skip_bias_add``."""
        return None if self.skip_bias_add else bias

    def _local_input(self, x: Any) -> Any:
        return x

    def _collect(self, y: Any) -> Any:
        """The collective after the per-rank GEMM (identity here)."""
        return y

    def _apply(self, gemm: Any, x: Any, weight: Any, bias: Any) -> Any:
        """Every platform path: this rank's input, its GEMM, then ``_finish``."""
        return self._finish(gemm(self._local_input(x), weight, self._gemm_bias(bias)), bias)

    def _finish(self, y: Any, bias: Any) -> Any:
        """The engine's collective on the GEMM's output, then its ``(output, output_bias)``."""
        y = self._collect(y)
        if not self.return_bias:
            return y
        return y, (bias if self.skip_bias_add else None)

    def forward_native(self, x: Any, weight: Any, bias: Any = None) -> Any | tuple[Any, Any | None]:
        """The reference (``_native_gemm``) between the same input slicing and collectives."""
        return self._apply(_native_gemm, x, weight, bias)

    # F.linear serves torch tensors on the CPU (the default); on a GPU, jax arrays take XLA's dot
    # and the torch-API tensors F.linear.
    serves = {"forward_cuda": Serves(ALL_FRONTENDS), "forward_hip": Serves(ALL_FRONTENDS),
              "forward_cpu": Serves(("torch", "jax"), "no CPU GEMM for {frontend} arrays: XLA compiles the native body")}

    def forward_cpu(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """torch on the CPU: ``F.linear`` (oneDNN / MKL addmm, the bias in its epilogue), quantized
        weights the C++ quantized GEMM (``_torch_cpu_linear``); jax arrays with a quantized weight:
        XLA's dots on its codes (``kernels/xla/quantized_linear``)."""
        if frontend_of(x) == "jax":
            if not isinstance(weight, QuantizedWeight):
                raise NotImplementedError("no CPU kernel for jax arrays: XLA compiles the native body (of a float "
                                          "weight; a quantized one takes XLA's dots on its codes)")
            return self._apply(lambda x, w, b: _xla_quantized_linear(x, w, b, True), x, weight, bias)
        return self._apply(_torch_cpu_linear, x, weight, bias)

    def forward_cuda(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """torch on a GPU: ``F.linear`` (cuBLAS / hipBLASLt), quantized weights the Triton quantized
        GEMM; jax arrays: XLA's dot (cuBLAS)."""
        return self._apply(_jax_gpu_linear if family_of(frontend_of(x)) == "jax" else _torch_gpu_linear, x, weight,
                           bias)

    def forward_tpu(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """On a TPU: XLA's dot on the operands' dtype with float32 accumulation
        (``kernels/xla/linear``), reached from jax, torch_xla, torchax and torch_tpu through the
        Pallas bridge (jax gets the native body's gradient)."""

        def gemm(x, weight, bias):
            if isinstance(weight, QuantizedWeight):
                kernel, static = _quantized_kernel("pallas", x, weight)
                return call_jax_function(frontend_of(x), kernel, x, *_quantized_arrays(weight, bias), **static)
            return call_jax_function(frontend_of(x), _XLA_LINEAR, x, weight, bias, native=_native_gemm)

        return self._apply(gemm, x, weight, bias)

    # -- checkpoint layout ----------------------------------------------------------------------

    weight_split_dim: int | None = 0  # the dim of the weight split over ranks (None: replicated)
    bias_split: bool = True  # whether the bias is split over ranks like the weight's rows

    def full_size(self, shard_id: Any = None) -> int:
        """The size, along the split dim, of the full checkpoint tensor ``weight_loader`` takes."""
        if shard_id is not None:
            raise ValueError(f"{self._op}: loaded_shard_id must be None for {type(self).__name__}, "
                             f"got {shard_id!r}")
        return self.output_size if self.weight_split_dim == 0 else self.input_size

    def shard_copies(self, shard_id: Any = None, rank: int | None = None) -> list[ShardCopy]:
        """Which rows of the full checkpoint tensor (``shard_id`` says which part, None: all) rank
        ``rank`` (default: this op's) keeps, and where in its parameter (along the split dim)."""
        rank = self._layout_rank(rank)
        size = self.full_size(shard_id) // self.tp.size
        return [ShardCopy(rank * size, (rank + 1) * size, 0)]

    def checkpoint_layout(self, param: str, shard_id: Any = None,
                          rank: int | None = None) -> tuple[tuple[int, ...], int | None, list[ShardCopy]]:
        """What a ``weight_loader`` does with a full checkpoint tensor for ``param`` ("weight" or
        "bias"): ``(the full shape it must have, the dim split over ranks or None when the rank
        keeps it whole, the copies into rank ``rank``'s parameter along that dim)``."""
        if param not in ("weight", "bias"):
            raise ValueError(f"{self._op}: no parameter {param!r}; expected 'weight' or 'bias'")
        if param == "bias" and not self.has_bias:
            raise ValueError(f"{self._op}: built with bias=False, so it has no 'bias' to load")
        dim = self.weight_split_dim if param == "weight" else (0 if self.bias_split else None)
        full = self.full_size(shard_id)
        if param == "weight":
            shape = (self.output_size, full) if dim == 1 else (full, self.input_size)
        else:
            shape = (full if dim == 0 else self.output_size,)
        copies = self.shard_copies(shard_id, rank) if dim is not None else [ShardCopy(0, shape[0], 0)]
        return shape, dim, copies

    def _layout_rank(self, rank: int | None) -> int:
        rank = self.tp.rank if rank is None else rank
        if not isinstance(rank, int) or not 0 <= rank < self.tp.size:
            raise ValueError(f"{self._op}: rank {rank!r} is outside [0, {self.tp.size}) (pass an int rank "
                             "when the op's tp is traced)")
        return rank

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, bias={self.has_bias}, "
                f"tp_size={self.tp.size}")


@CustomOp.register("replicated_linear")
class ReplicatedLinear(_Linear):
    """The engine's ``ReplicatedLinear``: the whole weight ``[output_size, input_size]`` on every rank,
    no collective. ``op(x, weight, bias=None)``."""

    weight_split_dim = None
    bias_split = False

    def __init__(self, input_size: int, output_size: int, bias: bool = True, skip_bias_add: bool = False,
                 params_dtype: Any = None, *, return_bias: bool = True, disable_tp: bool = False,
                 tp: TensorParallel | None = None, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self._setup("replicated_linear", input_size, output_size, bias, skip_bias_add, params_dtype, return_bias,
                    disable_tp, tp)
        self.input_size_per_partition, self.output_size_per_partition = self.input_size, self.output_size
        self.bias_size = self.output_size

    def shard_copies(self, shard_id: Any = None, rank: int | None = None) -> list[ShardCopy]:
        return [ShardCopy(0, self.full_size(shard_id), 0)]

    def full_size(self, shard_id: Any = None) -> int:
        super().full_size(shard_id)  # checks shard_id
        return self.output_size


@CustomOp.register("column_parallel_linear")
class ColumnParallelLinear(_Linear):
    """The engine's ``ColumnParallelLinear``: ``Y = X A`` with ``A``'s output columns split over the
    ranks (weight ``[output_size / tp, input_size]``, bias ``[output_size / tp]``); each rank gets
    ``Y``'s columns, all-gathered when ``gather_output``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: Any = None, *, return_bias: bool = True,
                 disable_tp: bool = False, tp: TensorParallel | None = None, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self._setup(self._op, input_size, output_size, bias, skip_bias_add, params_dtype, return_bias,
                    disable_tp, tp)
        self.gather_output = bool(gather_output)
        self.input_size_per_partition = self.input_size
        self.output_size_per_partition = self._output_per_partition()
        self.bias_size = self.output_size_per_partition

    def _output_per_partition(self) -> int:
        return divide(self.output_size, self.tp.size, op=self._op, what="argument 'output_size'")

    def _collect(self, y: Any) -> Any:
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gather_output={self.gather_output}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """The engine's ``MergedColumnParallelLinear(input_size, output_sizes, ...)``: several column-
    parallel outputs (gate and up) in one GEMM. Each rank's weight is its shard of every output,
    side by side: ``[out_0 / tp | out_1 / tp | ...]`` rows. ``loaded_shard_id`` k loads output k."""

    op_label = "merged_column_parallel_linear"

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: Any = None, *, return_bias: bool = True,
                 disable_tp: bool = False, tp: TensorParallel | None = None, enforce_enable: bool = False) -> None:
        op = self._op
        if not isinstance(output_sizes, (list, tuple)) or not output_sizes:
            raise ValueError(f"{op}: argument 'output_sizes' must be a non-empty list of ints, got {output_sizes!r}")
        self.output_sizes = [_check_positive(op, "output_sizes", s) for s in output_sizes]
        super().__init__(input_size, sum(self.output_sizes), bias, gather_output, skip_bias_add, params_dtype,
                         return_bias=return_bias, disable_tp=disable_tp, tp=tp, enforce_enable=enforce_enable)
        for k, s in enumerate(self.output_sizes):
            divide(s, self.tp.size, op=op, what=f"output_sizes[{k}]")

    def full_size(self, shard_id: Any = None) -> int:
        if shard_id is None:
            return self.output_size
        if isinstance(shard_id, bool) or not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self._op}: loaded_shard_id must be None or an int in "
                             f"[0, {len(self.output_sizes)}), got {shard_id!r}")
        return self.output_sizes[shard_id]

    def shard_copies(self, shard_id: Any = None, rank: int | None = None) -> list[ShardCopy]:
        rank, n = self._layout_rank(rank), self.tp.size
        self.full_size(shard_id)
        copies, src, dst = [], 0, 0
        for k, s in enumerate(self.output_sizes):
            per = s // n
            if shard_id is None or shard_id == k:
                start = (src if shard_id is None else 0) + rank * per
                copies.append(ShardCopy(start, start + per, dst))
            src, dst = src + s, dst + per
        return copies

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, output_sizes={self.output_sizes}"


class QKVParallelLinear(ColumnParallelLinear):
    """The engine's ``QKVParallelLinear(hidden_size, head_size, total_num_heads,
    total_num_kv_heads=None, ...)``: q, k and v projections in one column-parallel GEMM. Each rank's
    weight rows are ``[its q heads | its k heads | its v heads]`` (``dualop.parallel.qkv_layout``:
    kv heads split over the ranks, or each replicated on ``tp / total_num_kv_heads`` ranks when
    tp >= their number). ``loaded_shard_id`` "q", "k" or "v" loads that projection."""

    op_label = "qkv_parallel_linear"

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = True, skip_bias_add: bool = False, params_dtype: Any = None, *,
                 return_bias: bool = True, disable_tp: bool = False, tp: TensorParallel | None = None,
                 enforce_enable: bool = False) -> None:
        op = self._op
        self.hidden_size = _check_positive(op, "hidden_size", hidden_size)
        self.head_size = _check_positive(op, "head_size", head_size)
        self.total_num_heads = _check_positive(op, "total_num_heads", total_num_heads)
        self.total_num_kv_heads = _check_positive(
            op, "total_num_kv_heads", total_num_heads if total_num_kv_heads is None else total_num_kv_heads)
        output_size = (self.total_num_heads + 2 * self.total_num_kv_heads) * self.head_size
        super().__init__(hidden_size, output_size, bias, False, skip_bias_add, params_dtype, return_bias=return_bias,
                         disable_tp=disable_tp, tp=tp, enforce_enable=enforce_enable)

    def layout(self, rank: int):
        """Rank ``rank``'s ``dualop.parallel.QKVLayout``."""
        return qkv_layout(self.total_num_heads, self.total_num_kv_heads, self.head_size, self.tp.size, rank,
                          op=self._op)

    def _output_per_partition(self) -> int:
        return self.layout(0).output_size_per_partition  # checks the head counts against tp

    @property
    def num_heads(self) -> int:
        return self.layout(0).num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.layout(0).num_kv_heads

    def full_size(self, shard_id: Any = None) -> int:
        heads = {None: self.total_num_heads + 2 * self.total_num_kv_heads, "q": self.total_num_heads,
                 "k": self.total_num_kv_heads, "v": self.total_num_kv_heads}
        if shard_id not in heads or isinstance(shard_id, bool):
            raise ValueError(f"{self._op}: loaded_shard_id must be None, 'q', 'k' or 'v', got {shard_id!r}")
        return heads[shard_id] * self.head_size

    def shard_copies(self, shard_id: Any = None, rank: int | None = None) -> list[ShardCopy]:
        layout, d = self.layout(self._layout_rank(rank)), self.head_size
        self.full_size(shard_id)
        # (part, its first row in the fused checkpoint, first head this rank keeps, heads it keeps)
        parts = (("q", 0, layout.q_head_start, layout.num_heads),
                 ("k", self.total_num_heads * d, layout.kv_head_start, layout.num_kv_heads),
                 ("v", (self.total_num_heads + self.total_num_kv_heads) * d, layout.kv_head_start,
                  layout.num_kv_heads))
        copies, dst = [], 0
        for part, offset, head, count in parts:
            if shard_id is None or shard_id == part:
                start = (offset if shard_id is None else 0) + head * d
                copies.append(ShardCopy(start, start + count * d, dst))
            dst += count * d
        return copies

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, head_size={self.head_size}, total_num_heads={self.total_num_heads}, "
                f"total_num_kv_heads={self.total_num_kv_heads}, tp_size={self.tp.size}")


@CustomOp.register("row_parallel_linear")
class RowParallelLinear(_Linear):
    """The engine's ``RowParallelLinear``: ``Y = X A`` with ``A``'s input rows split over the ranks
    (weight ``[output_size, input_size / tp]``, bias ``[output_size]`` whole). ``x`` is this rank's
    slice of the input (``input_is_parallel``) or the whole input, which the op slices. Rank 0 adds
    the bias to its partial sum; the partial sums are all-reduced when ``reduce_results``."""

    weight_split_dim = 1
    bias_split = False

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, params_dtype: Any = None, reduce_results: bool = True, *,
                 return_bias: bool = True, disable_tp: bool = False, tp: TensorParallel | None = None,
                 enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = "row_parallel_linear"
        self._setup(op, input_size, output_size, bias, skip_bias_add, params_dtype, return_bias, disable_tp, tp)
        self.input_is_parallel, self.reduce_results = bool(input_is_parallel), bool(reduce_results)
        if not self.reduce_results and self.has_bias and not self.skip_bias_add:
            raise ValueError(f"{op}: When not reduce the results, adding bias to the results can lead to incorrect "
                             "results (build it with reduce_results=True, skip_bias_add=True or bias=False)")
        self.input_size_per_partition = divide(self.input_size, self.tp.size, op=op, what="argument 'input_size'")
        self.output_size_per_partition = self.bias_size = self.output_size

    @property
    def x_features(self) -> int:
        return self.input_size_per_partition if self.input_is_parallel else self.input_size

    def _x_features_why(self) -> str:
        if self.input_is_parallel:
            return f"input_is_parallel, input_size={self.input_size} / tp {self.tp.size}"
        return f"input_is_parallel=False, the whole input_size={self.input_size}"

    def _local_input(self, x: Any) -> Any:
        if self.input_is_parallel or self.tp.size == 1:
            return x
        return _rank_slice(x, self.tp.rank, self.input_size_per_partition)

    def _gemm_bias(self, bias: Any) -> Any:
        """Rank 0's partial sum carries the bias (the engine's ``bias_ = None if tp_rank > 0``)."""
        if bias is None or self.skip_bias_add:
            return None
        rank = self.tp.rank
        if isinstance(rank, int):
            return bias if rank == 0 else None
        return array_namespace(bias).where(rank == 0, bias, 0)  # traced rank (shard_map)

    def _collect(self, y: Any) -> Any:
        return self.tp.all_reduce(y) if self.reduce_results else y

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, input_is_parallel={self.input_is_parallel}, "
                f"reduce_results={self.reduce_results}")


def check_cases():
    """Tiny shapes (zero tokens, one token, ragged, 3-D): the GEMM is the vendor's, so these check
    the paths' plumbing (bias placement, output tuple, dtype), not tiling. ``skip_bias_add`` (the
    bias passed through, not computed) is tests/ops/test_linear.py's, shared by every path."""
    from dualop.testing import OpCase, normal

    shapes = ((0, 32), (1, 32), (5, 32), (2, 3, 40))

    def inputs(out: int, bias: bool, in_scale: int = 1):
        def make(shape, rng):
            k = shape[-1] // in_scale
            return (normal(shape, rng), normal((out, k), rng, k ** -0.5), normal((out,), rng) if bias else None)

        return make

    return [*_float_cases(OpCase, normal, shapes, inputs), *_quantized_cases(OpCase)]


def _float_cases(OpCase, normal, shapes, inputs):
    return [
        OpCase("replicated_linear", "replicated_linear", lambda s: ReplicatedLinear(s[-1], 48, bias=False),
               inputs(48, False), shapes),
        OpCase("replicated_linear", "replicated_linear[bias,no_return_bias]",
               lambda s: ReplicatedLinear(s[-1], 48, return_bias=False), inputs(48, True), shapes),
        OpCase("column_parallel_linear", "column_parallel_linear[bias]", lambda s: ColumnParallelLinear(s[-1], 48),
               inputs(48, True), shapes),
        OpCase("column_parallel_linear", "merged_column_parallel_linear[bias]",
               lambda s: MergedColumnParallelLinear(s[-1], [24, 40]), inputs(64, True), shapes),
        OpCase("column_parallel_linear", "qkv_parallel_linear[gqa]",
               lambda s: QKVParallelLinear(s[-1], 8, 4, 2, bias=False), inputs(64, False), shapes),
        OpCase("row_parallel_linear", "row_parallel_linear[bias]", lambda s: RowParallelLinear(s[-1], 48),
               inputs(48, True), shapes),
    ]


# The quantized check cases: (label, op, WeightQuant arguments, output features, bias). Output
# features off every tile (40, 72) and a partial last scale block (fp8: 40 = 32 + 8 rows).
_QUANTIZED_CASES = (
    ("replicated_linear[int8_w8a8]", "replicated_linear",
     dict(codes="int8", strategy="channel", activations="dynamic"), 40, False),
    ("replicated_linear[int8_channel]", "replicated_linear", dict(codes="int8", strategy="channel"), 40, False),
    ("replicated_linear[fp8_block_w8a8]", "replicated_linear",
     dict(codes="fp8", strategy="block", block=(32, 128), activations="dynamic"), 40, False),
    ("column_parallel_linear[fp8_block,bias]", "column_parallel_linear",
     dict(codes="fp8", strategy="block", block=(32, 128)), 40, True),
    ("replicated_linear[fp8_tensor_static]", "replicated_linear",
     dict(codes="fp8", strategy="tensor", activations="static"), 40, False),
    ("replicated_linear[int4_g64]", "replicated_linear",
     dict(codes="int4", strategy="group", group_size=64, layout="packed"), 40, False),
    ("row_parallel_linear[int4_g32_zero,bias]", "row_parallel_linear",
     dict(codes="int4", strategy="group", group_size=32, symmetric=False, layout="packed"), 72, True),
    ("column_parallel_linear[awq_g64]", "column_parallel_linear",
     dict(codes="int4", strategy="group", group_size=64, symmetric=False, layout="awq"), 72, False),
)


def random_quantized_weight(quant: WeightQuant, n: int, k: int, rng: Any) -> QuantizedWeight:
    """A ``QuantizedWeight`` of numpy arrays (``Pinned`` to their stored dtypes) for an ``[n, k]``
    weight of scheme ``quant``: codes over their whole range, scales that keep ``x @ w.T`` near
    unit size, zero points and a static input scale where the scheme has them."""
    import numpy as np

    from dualop.kernels import quant_math
    from dualop.testing import Pinned

    def uniform(shape, lo, hi, dtype="float32"):
        return Pinned(rng.uniform(lo, hi, shape).astype(np.float32), dtype)

    spread = 1.0 / math.sqrt(k)
    if quant.codes == "fp8":
        # small integers times powers of two: every value exact in float8_e4m3fn (|value| <= 256)
        values = rng.integers(-16, 17, (n, k)) * 2.0 ** rng.integers(-3, 5, (n, k))
        codes, unit = Pinned(values.astype(np.float32), "float8_e4m3fn"), spread / 64
    elif quant.codes == "int8":
        codes, unit = Pinned(rng.integers(-128, 128, (n, k)).astype(np.float32), "int8"), spread / 64
    else:
        unsigned = rng.integers(0, 16, (k, n) if quant.layout == "awq" else (n, k))
        codes, unit = Pinned(quant_math.pack_int32(unsigned, 4, 1, quant_math.AWQ_NIBBLE_OF if quant.layout == "awq"
                                                   else None), "int32"), spread / 4
    scale_shape = quant.scale_shape(n, k)
    scale = uniform(scale_shape, 0.5 * unit, 1.5 * unit, "float16" if quant.layout == "awq" else "float32")
    zero = None
    if not quant.symmetric:
        unsigned = rng.integers(0, 16, scale_shape)
        zero = Pinned(quant_math.pack_int32(unsigned, 4, 1 if quant.layout == "awq" else 0,
                                            quant_math.AWQ_NIBBLE_OF if quant.layout == "awq" else None), "int32")
    input_scale = uniform((1,), 0.01, 0.02) if quant.activations == "static" else None
    return QuantizedWeight(quant, codes, scale, zero, input_scale, shape=(n, k))


def _quantized_cases(OpCase):
    from dualop.testing import normal

    makers = {"replicated_linear": ReplicatedLinear, "column_parallel_linear": ColumnParallelLinear,
              "row_parallel_linear": RowParallelLinear}

    def case(label, op_name, scheme, out, bias):
        quant = WeightQuant(**scheme)

        def make_op(shape):
            return makers[op_name](shape[-1], out, bias=bias, return_bias=False)

        def make_inputs(shape, rng):
            weight = random_quantized_weight(quant, out, shape[-1], rng)
            return normal(shape, rng), weight, normal((out,), rng) if bias else None

        # a hidden size off the 128 lanes (a partial last block), except where x is quantized in
        # groups of 128 (fp8 block W8A8), which must be whole
        wide = 256 if quant.strategy == "block" and quant.activations != "none" else 192
        return OpCase(op_name, label, make_op, make_inputs, ((0, 256), (1, 256), (2, 3, wide)),
                      traits={"contraction", "not_differentiable", "untyped_inputs"},
                      kernel_in_native_cells={("jax", "cpu"): "forward_cpu"})

    return [case(*spec) for spec in _QUANTIZED_CASES]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


def _bench_linear_op(op_name: str) -> Callable[[int], Any]:
    def make(hidden: int):
        from dualop import ops
        from dualop.parallel import TensorParallel

        cls = {"replicated_linear": ops.ReplicatedLinear, "column_parallel_linear": ops.ColumnParallelLinear,
               "row_parallel_linear": ops.RowParallelLinear}[op_name]
        return cls(hidden, hidden, bias=False, return_bias=False, tp=TensorParallel())

    return make


def _bench_linear_inputs(shape, rng):
    hidden = shape[-1]
    return (_normal(shape, rng), _normal((hidden, hidden), rng, hidden ** -0.5))


def _bench_linear_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.linear_cost(rows_of(shape), op.input_size, op.output_size, itemsize, False)


def _torch_linear_peer(op):
    import torch.nn.functional as F

    return lambda x, w: F.linear(x, w)


def _jax_linear_peer(op):
    """What a jax user writes: ``jnp.dot(x, w.T)``."""
    import jax.numpy as jnp

    return lambda x, w: jnp.dot(x, w.T)


def _serving_linear_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, in_size, out_size = shape
    return (InputSpec((tokens, in_size), None), InputSpec((out_size, in_size), None), None)  # Llama: no bias


def _serving_linear_op(op_name: str):
    def make(shape: tuple[int, ...]):
        from dualop import ops

        tokens, in_size, out_size = shape
        cls = {"replicated_linear": ops.ReplicatedLinear, "column_parallel_linear": ops.ColumnParallelLinear,
               "row_parallel_linear": ops.RowParallelLinear}[op_name]
        return cls(in_size, out_size, bias=False)

    return make


_LINEAR_OPS = ("column_parallel_linear", "row_parallel_linear", "replicated_linear")


def bench_cases():
    """Not run by default (a 4096-wide GEMM is seconds on 2 cores): x (tokens, hidden) times a square
    weight, no bias, against F.linear and a hand-written jnp.dot; the vendor GEMM is the path."""
    floats = [BenchCase(op_name, op_name, _bench_linear_op(op_name), _bench_linear_inputs, _bench_linear_cost,
                        _torch_linear_peer, _jax_linear_peer, default=False, matrix=True)
              for op_name in _LINEAR_OPS]
    return floats + [BenchCase(label, "replicated_linear", _bench_linear_op("replicated_linear"),
                               _bench_quantized_inputs(quant), _bench_quantized_cost(quant),
                               _torch_quantized_peer(quant), _jax_quantized_peer, default=False, matrix=True)
                     for label, quant in _QUANTIZED_BENCH.items()]


# Quantized bench cases (not run by default): a square weight in each scheme checkpoints ship.
_QUANTIZED_BENCH = {
    "replicated_linear[int8_channel]": WeightQuant("int8", "channel"),
    "replicated_linear[int8_w8a8]": WeightQuant("int8", "channel", activations="dynamic"),
    "replicated_linear[fp8_block]": WeightQuant("fp8", "block", block=(128, 128)),
    "replicated_linear[fp8_block_w8a8]": WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"),
    "replicated_linear[int4_g128]": WeightQuant("int4", "group", group_size=128, layout="packed"),
    "replicated_linear[awq_g128]": WeightQuant("int4", "group", group_size=128, symmetric=False, layout="awq"),
}


def _bench_quant_for(quant: WeightQuant, hidden: int) -> WeightQuant:
    """``quant`` for a ``hidden``-wide weight: groups and blocks of 128 narrowed to ``hidden`` when it
    is smaller (the bench's small sizes)."""
    if quant.strategy == "group" and quant.group_size > hidden:
        return dataclasses.replace(quant, group_size=hidden)
    if quant.strategy == "block" and max(quant.block) > hidden:
        return dataclasses.replace(quant, block=(min(quant.block[0], hidden), min(quant.block[1], hidden)))
    return quant


def _bench_quantized_inputs(quant: WeightQuant):
    def make(shape, rng):
        hidden = shape[-1]
        return _normal(shape, rng), random_quantized_weight(_bench_quant_for(quant, hidden), hidden, hidden, rng)

    return make


def _bench_quantized_cost(quant: WeightQuant):
    """Read x, the codes and scales (and zero points) once, write the output."""
    def cost(op, shape, itemsize) -> KernelCost:
        n, k, tokens = op.output_size, op.input_size, rows_of(shape)
        quant_here = _bench_quant_for(quant, k)
        weight_bytes = math.prod(quant_here.codes_shape(n, k)) * (4 if quant.layout != "plain" else 1)
        weight_bytes += 4 * math.prod(quant_here.scale_shape(n, k))
        weight_bytes += 4 * math.prod(quant_here.zero_point_shape(n, k) or (0,))
        return KernelCost(flops=2 * tokens * n * k, transcendentals=0,
                          bytes_accessed=(tokens * k + tokens * n) * itemsize + weight_bytes)

    return cost


def _torch_quantized_peer(quant: WeightQuant):
    """torch's own quantized CPU GEMMs where the scheme is theirs: ``_weight_int8pack_mm`` for int8
    per channel, ``_weight_int4pack_mm_for_cpu`` for symmetric int4 groups (the weight converted
    once to its packed form outside the timing), ``_int_mm`` (int8 x int8 -> int32) for
    int8 W8A8 after quantizing x per token as the scheme does; else ``F.linear`` on the weight
    dequantised once to x's dtype (serving the float checkpoint; in 16-bit dtypes it rounds the
    weight, so it leaves the tolerance there), after quantizing x for W8A8."""
    def peer(op):
        import torch

        prepared: dict[int, Any] = {}

        def once(weight, make):
            key = id(weight)
            if key not in prepared:
                prepared.clear()
                prepared[key] = make()
            return prepared[key]

        if (quant.codes, quant.strategy, quant.activations) == ("int8", "channel", "none"):
            return lambda x, w: torch._weight_int8pack_mm(x, w.codes, w.scale.reshape(-1).to(x.dtype))
        if (quant.codes, quant.layout, quant.symmetric) == ("int4", "packed", True):
            def int4(x, w):
                packed, scales = once(w, lambda: _torch_int4_form(w))
                return torch._weight_int4pack_mm_for_cpu(x, packed, w.quant.group_size, scales.to(x.dtype))

            return int4
        if (quant.codes, quant.strategy, quant.activations) == ("int8", "channel", "dynamic"):
            def int8_w8a8(x, w):
                xf = x.float()
                amax = xf.abs().amax(-1, keepdim=True)
                xs = torch.where(amax > 0, amax / 127.0, 1.0)
                xq = torch.clamp(torch.round(xf / xs), -128, 127).to(torch.int8)
                codes_t = once(w, lambda: w.codes.t().contiguous())
                return (torch._int_mm(xq, codes_t).float() * xs * w.scale.reshape(-1).float()).to(x.dtype)

            return int8_w8a8

        def dequantised(x, w):
            xq = quantize_activations(x, w).to(x.dtype) if quant.activations != "none" else x
            return torch.nn.functional.linear(xq, once(w, lambda: w.dequantize(x.dtype)))

        return dequantised

    return peer


def _torch_int4_form(weight: QuantizedWeight) -> tuple[Any, Any]:
    """A symmetric packed int4 weight in torch's CPU int4 GEMM form: the unsigned codes packed by
    ``torch._convert_weight_to_int4pack_for_cpu`` and ``[K / g, N, 2]`` (scale, offset) pairs, its
    ``(code - 8) * scale + offset`` rule with offset 0."""
    import torch

    from dualop.kernels import quant_math

    n, k = weight.shape
    unsigned = quant_math.unpack_int32(torch, weight.codes, 4, k) + 8
    packed = torch._convert_weight_to_int4pack_for_cpu(unsigned.to(torch.int32), 1)
    scale = weight.scale.float().t().contiguous()
    return packed, torch.stack([scale, torch.zeros_like(scale)], dim=-1)


def _jax_quantized_peer(op):
    """What a jax user writes: the weight dequantised inside ``jit`` (XLA fuses it into the dot),
    in float32 (the scales' precision), after quantizing x for W8A8."""
    import jax.numpy as jnp

    return lambda x, w: jnp.dot(quantize_activations(x, w), w.dequantize().T).astype(x.dtype)


def serving():
    """(tokens, input features, output features) of one chip's shard. Llama-3-70B at tp 8: the fused
    QKV ((64 + 2 * 8) * 128 / 8 = 1280 rows) and merged gate_up (2 * 28672 / 8 = 7168 rows) shards
    of column_parallel_linear, o_proj (8192 / 8 = 1024 -> 8192) and down (28672 / 8 = 3584 -> 8192)
    of row_parallel_linear, and a whole 8192 x 8192 replicated projection; a 16-token decode batch
    and an 8192-token prefill, in bfloat16 (the served dtype)."""
    shapes = {
        "replicated_linear": ((16, 8192, 8192), (8192, 8192, 8192)),
        "column_parallel_linear": ((16, 8192, 1280), (8192, 8192, 1280), (16, 8192, 7168), (8192, 8192, 7168)),
        "row_parallel_linear": ((16, 1024, 8192), (8192, 1024, 8192), (16, 3584, 8192), (8192, 3584, 8192)),
    }
    cases = {"replicated_linear": "replicated_linear", "column_parallel_linear": "column_parallel_linear[bias]",
             "row_parallel_linear": "row_parallel_linear[bias]"}
    servings = {op: Serving(shapes[op], _serving_linear_inputs, {cases[op]: _serving_linear_op(op)}, ("bfloat16",),
                            (cases[op],))
                for op in _LINEAR_OPS}
    quantized = servings["replicated_linear"]
    servings["replicated_linear"] = dataclasses.replace(
        quantized, shapes=quantized.shapes + _QUANTIZED_SERVING_SHAPES,
        inputs={cases["replicated_linear"]: _serving_linear_inputs,
                **{label: _serving_quantized_inputs(quant) for label, quant in _QUANTIZED_SERVING.items()}},
        make_op={**quantized.make_op, **{label: _serving_linear_op("replicated_linear") for label in _QUANTIZED_SERVING}},
        cases=(*quantized.cases, *_QUANTIZED_SERVING))
    return servings


# Quantized serving builds: the schemes checkpoints ship (DeepSeek-V3's 128x128 fp8 blocks, W8A8 int8,
# W4A16 int4 in groups of 128), per the check case they stand for; at the replicated shapes above
# and DeepSeek-V3's dense MLP at tp 8 (gate_up 7168 -> 4608 for one token, down 2304 -> 7168 for 8192).
_QUANTIZED_SERVING = {
    "replicated_linear[int8_w8a8]": WeightQuant("int8", "channel", activations="dynamic"),
    "replicated_linear[fp8_block_w8a8]": WeightQuant("fp8", "block", block=(128, 128), activations="dynamic"),
    "replicated_linear[int4_g64]": WeightQuant("int4", "group", group_size=128, layout="packed"),
}
_QUANTIZED_SERVING_SHAPES = ((1, 7168, 4608), (8192, 2304, 7168))


def _serving_quantized_inputs(quant: WeightQuant):
    def inputs(shape: tuple[int, ...]) -> tuple:
        tokens, in_size, out_size = shape
        spec = {name: InputSpec(shape, dtype) for name, shape, dtype in (
            ("codes", quant.codes_shape(out_size, in_size), quant.codes_dtype()),
            ("scale", quant.scale_shape(out_size, in_size), "float32"),
            ("zero_point", quant.zero_point_shape(out_size, in_size), "int32")) if shape is not None}
        weight = QuantizedWeight(quant, spec["codes"], spec["scale"], spec.get("zero_point"), shape=(out_size, in_size))
        return InputSpec((tokens, in_size), None), weight, None

    return inputs

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {op: {"traits": {"contraction"}, "kernel_in_native_cells": {("jax", "cuda"): "forward_cuda"}}
              for op in ("replicated_linear", "column_parallel_linear", "row_parallel_linear")}
