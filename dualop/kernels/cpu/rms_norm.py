"""RMS norm and the gated group RMS norm on the CPU for torch tensors (kernels: ``csrc/rms_norm.cc``)."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.kernels.norm_math import NormSpec
from dualop.kernels.cpu.abi import MAX_DIMS, c_function
from dualop.kernels.cpu.torch_ops import TorchOperator

_C_RMS_NORM = c_function(
    "int dualop_rms_norm(const DualopArray* x, const DualopArray* residual, const DualopArray* weight, "
    "const DualopArray* out, const DualopArray* residual_out, float eps, float weight_offset, int weight_mode, "
    "int threads)"
)
_C_RMS_NORM_GATED = c_function(
    "int dualop_rms_norm_gated(const DualopArray* x, const DualopArray* z, const DualopArray* weight, "
    "const DualopArray* out, int64_t group, float eps, int norm_before_gate, int cast_before_weight, int threads)"
)

__all__ = ["FAST_RMS_NORM", "fast_constants", "rms_norm", "rms_norm_gated", "supports"]

_NO_WEIGHT, _WEIGHT_AFTER_CAST, _WEIGHT_IN_F32 = 0, 1, 2
_KERNEL_WEIGHT_DTYPES: tuple = ()  # torch's float32, bfloat16, float16, set on the first call

# The torch operator in front of dualop_rms_norm (csrc/torch/ops.cc): called as
# FAST_RMS_NORM.get()(x, weight, residual, out, residual_out, *fast_constants(hidden_size, spec)),
# it returns (out, residual_out), or (None, None) for a call it does not take.
FAST_RMS_NORM = TorchOperator("rms_norm")


def fast_constants(hidden_size: int, spec: NormSpec) -> tuple[int, float, float, int]:
    """The operator's arguments after the tensors, for a norm of ``hidden_size`` and ``spec``."""
    return hidden_size, spec.eps, spec.weight_offset, _WEIGHT_IN_F32 if spec.weight_in_f32 else _WEIGHT_AFTER_CAST


def _rows(t: Any) -> Any:
    """``t`` as an array argument: itself up to ``MAX_DIMS`` dimensions (the kernels read any rank
    as ``[rows, hidden]``), else viewed as ``[rows, hidden]``."""
    return t if t is None or t.ndim <= MAX_DIMS else t.view(-1, t.shape[-1])


def covers(spec: NormSpec) -> str | None:
    """None if the kernel computes this variant (whatever the input), else why not."""
    if spec.var_size is not None:
        return "var_hidden_size < hidden_size (the statistic over a prefix) has no C++ CPU kernel"
    return None


def supports(x: Any, weight: Any, residual: Any, spec: NormSpec) -> str | None:
    """None if the kernel takes these arguments, else why not."""
    why = covers(spec)
    if why is not None:
        return why
    if dtype_code(x) is None:
        return f"dtype {x.dtype} on {x.device} has no CPU kernel"
    if residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape):
        return "residual must match x in dtype and shape"
    if weight is not None and weight.device.type != "cpu":
        return "weight is not on the CPU"
    return None


def _written(given: Any, like: Any) -> Any:
    """Where the kernel writes a result: the given output when the kernel can write it (row-major),
    else a new array (copied into the given one afterwards)."""
    import torch

    return given if given is not None and given.is_contiguous() else torch.empty_like(like)


def rms_norm(x: Any, weight: Any = None, residual: Any = None, *, spec: NormSpec = NormSpec(), out: Any = None,
             residual_out: Any = None) -> Any:
    """``rms_normalize`` of ``x`` (plus ``residual``) with ``weight``; returns ``out`` or ``(out, x + residual)``,
    written into the given ``out`` / ``residual_out`` when given (which may be ``x`` / ``residual``:
    each row is read before it is written)."""
    global _KERNEL_WEIGHT_DTYPES
    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    if not _KERNEL_WEIGHT_DTYPES:
        import torch

        _KERNEL_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
    why = supports(x, weight, residual, spec)
    if why is not None:
        raise NotImplementedError(why)
    given = (out, residual_out)
    x = x.contiguous()
    out = _written(out, x)
    residual_out = None
    if residual is not None:
        residual = residual.contiguous()
        residual_out = _written(given[1], x)
    if weight is None:
        mode, w = _NO_WEIGHT, None
    else:  # any float dtype: the kernel reads it as float32, the offset added
        w = weight if weight.dtype in _KERNEL_WEIGHT_DTYPES and weight.is_contiguous() else weight.float().contiguous()
        mode = _WEIGHT_IN_F32 if spec.weight_in_f32 else _WEIGHT_AFTER_CAST
    if x.numel():
        status = _C_RMS_NORM(
            x=_rows(x), residual=_rows(residual), weight=w, out=_rows(out), residual_out=_rows(residual_out),
            eps=spec.eps, weight_offset=spec.weight_offset, weight_mode=mode, threads=threads_for(x.numel()),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_rms_norm returned {status}")
    results = (out,) if residual is None else (out, residual_out)
    results = tuple(result if target is None else target if result is target else target.copy_(result)
                    for result, target in zip(results, given))  # copy_: a given output the kernel could not write
    return results[0] if residual is None else results


def rms_norm_gated(x: Any, weight: Any, z: Any = None, *, group_size: int, eps: float, norm_before_gate: bool,
                   cast_before_weight: bool) -> Any:
    """``RMSNormGated``'s formula (``dualop/ops/gated_norm.py``) in one pass over each row: the
    gate, each group's statistic, the cast, the weight and the output."""
    import torch

    code = dtype_code(x)
    if code is None:
        raise NotImplementedError(f"dtype {x.dtype} on {x.device} has no CPU kernel")
    x = x.contiguous()
    z = None if z is None else z.contiguous()
    w = weight.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    if x.numel():
        status = _C_RMS_NORM_GATED(
            x=_rows(x), z=_rows(z), weight=w, out=_rows(out), group=group_size,
            eps=eps, norm_before_gate=int(norm_before_gate), cast_before_weight=int(cast_before_weight),
            threads=threads_for(x.numel()),
        )
        if status != 0:
            raise NotImplementedError(f"dualop_rms_norm_gated returned {status}")
    return out
