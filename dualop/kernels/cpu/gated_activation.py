"""Gated activations on the CPU for torch tensors (kernel: ``csrc/gated_activation.cc``)."""

from __future__ import annotations

import functools
from typing import Any

from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.kernels.gate_math import ACTIVATIONS, GateSpec
from dualop.kernels.cpu.abi import MAX_DIMS, c_function
from dualop.kernels.cpu.torch_ops import TorchOperator

_C_GATED_TABLE = c_function(
    "int dualop_gated_table(const DualopArray* table, const DualopArray* x, const DualopArray* out, "
    "int act_on_first, int threads)"
)
_C_GATED_TABLE_PAYS = c_function("int dualop_gated_table_pays(int activation, int dtype, int64_t gates)")
_C_GATED_ACTIVATION = c_function(
    "int dualop_gated_activation(const DualopArray* x, const DualopArray* out, int activation, int act_on_first, "
    "int threads)"
)

__all__ = ["FAST_GATED_ACTIVATION", "fast_arguments", "gated_activation", "supports"]

_ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

# The torch operator in front of the two entry points (csrc/torch/ops.cc): called as
# FAST_GATED_ACTIVATION.get()(x, table, out, *fast_arguments(spec)[1:]) with the table of x's dtype
# (fast_arguments(spec)[0], by dtype) for 16-bit x, it returns the result, or None for a call it
# does not take.
FAST_GATED_ACTIVATION = TorchOperator("gated_activation")


def fast_arguments(spec: GateSpec) -> tuple[Any, int, bool]:
    """``(table by 16-bit dtype, activation code, act on first)`` of the operator for a gate the
    kernel covers (``covers``)."""
    import torch

    tables = {dtype: _activation_table(spec.activation, dtype) for dtype in (torch.bfloat16, torch.float16)}
    return tables, _ACTIVATION_CODES[spec.activation], spec.act_on == "first"


@functools.lru_cache(maxsize=None)
def _activation_table(activation: str, dtype: Any) -> Any:
    """act(g) in float32 for every bit pattern g of a 16-bit dtype, computed by the native formula
    (``gate_math``) with torch, so the kernel's act(gate) is the native body's."""
    import torch

    from dualop.backends import array_namespace

    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    gates = torch.roll(gates, -(2**15)).view(dtype).to(torch.float32)  # index i holds bit pattern i
    return ACTIVATIONS[activation](array_namespace(gates), gates).contiguous()


def covers(spec: GateSpec) -> str | None:
    """None if the kernel computes this gate (whatever the input), else why not."""
    if spec.activation not in _ACTIVATION_CODES:
        return f"the C++ CPU kernel has no {spec.activation} gate"
    if spec.interleaved:
        return "the C++ CPU kernel has no interleaved gate/up layout"
    if spec.sparsity:
        return "the C++ CPU kernel has no activation-sparsity gate (it needs row statistics)"
    return None


def supports(x: Any, spec: GateSpec) -> str | None:
    """None if the kernel takes this input and gate, else why not."""
    why = covers(spec)
    if why is not None:
        return why
    if dtype_code(x) is None:
        return f"dtype {x.dtype} on {x.device} has no CPU kernel"
    return None


def gated_activation(x: Any, *, spec: GateSpec = GateSpec(), out: Any = None) -> Any:
    """``act(gate) * up`` over the two halves of ``x``'s last dim; returns shape ``(..., d)``,
    written into ``out`` when given."""
    import torch

    load()  # KernelUnavailable (the call declines) before any work if the library cannot be built
    why = supports(x, spec)
    if why is not None:
        raise NotImplementedError(why)
    d = x.shape[-1] // 2
    x = x.contiguous()
    given = out
    if out is None or not out.is_contiguous():
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel():
        first, threads = spec.act_on == "first", threads_for(x.numel())
        # the kernels read any rank as rows; an array argument has at most MAX_DIMS dimensions
        rows_in, rows_out = (x, out) if x.ndim <= MAX_DIMS else (x.view(-1, 2 * d), out.view(-1, d))
        code = _ACTIVATION_CODES[spec.activation]
        if _C_GATED_TABLE_PAYS(activation=code, dtype=dtype_code(x), gates=out.numel()):
            status = _C_GATED_TABLE(
                table=_activation_table(spec.activation, x.dtype), x=rows_in, out=rows_out, act_on_first=first,
                threads=threads,
            )
        else:
            status = _C_GATED_ACTIVATION(x=rows_in, out=rows_out, activation=code, act_on_first=first,
                                         threads=threads)
        if status != 0:
            raise NotImplementedError(f"dualop_gated_activation returned {status}")
    return out if given is None or given is out else given.copy_(out)
