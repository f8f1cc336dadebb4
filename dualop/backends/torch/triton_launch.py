"""Launch a Triton kernel (``kernels/cuda``) on the caller's arrays.

torch tensors on a CUDA/ROCm device launch directly; CPU tensors launch under Triton's
interpreter when it is on (``TRITON_INTERPRET=1``, set automatically on a machine with no GPU).
Inside ``dualop.kernels.cuda.compile_target`` (``dualop compile``), ``meta`` tensors are accepted
too: the launch is captured and compiled for that target, never run.
JAX callers would need jax-triton, which this build does not wire: the launch raises
NotImplementedError and the dispatcher reports a fallback to ``forward_native``.
"""

from __future__ import annotations

from typing import Any

from dualop.kernels.registry import KernelRef

__all__ = ["call_triton"]


def call_triton(frontend: str, kernel: KernelRef, *arrays: Any, **static: Any) -> Any:
    if frontend != "torch":
        raise NotImplementedError(
            f"Triton kernels launch on torch CUDA/ROCm tensors; {frontend} arrays would need jax-triton"
        )
    fn = kernel.resolve()  # imports dualop.kernels.cuda, which picks the interpreter if no GPU
    from dualop.kernels.cuda import gpu_target, interpreting

    x = arrays[0]
    capturing = x.device.type == "meta" and gpu_target() is not None
    if x.device.type != "cuda" and not interpreting() and not capturing:
        raise NotImplementedError(
            f"a Triton kernel needs a GPU tensor (got one on {x.device}); "
            "set TRITON_INTERPRET=1 to run it in Triton's CPU interpreter"
        )
    return fn(*arrays, **static)
