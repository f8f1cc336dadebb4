"""Triton kernels for CUDA and ROCm, launched on torch tensors.

On a machine with no GPU, Triton's interpreter runs them on CPU tensors. Triton decides between
compiler and interpreter when each ``@triton.jit`` function is *defined*, its own standard library
(``tl.sum``, ...) included. So this package turns the interpreter on (``TRITON_INTERPRET=1``)
before any kernel module is imported if no GPU is visible, and refuses to run half-interpreted if
triton was imported before that (set ``TRITON_INTERPRET=1`` in the environment, or import
``dualop.kernels.cuda`` before torch_xla, which imports triton). Set ``TRITON_INTERPRET=0`` to
refuse the interpreter.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["interpreting", "GpuTarget", "GPU_TARGETS", "compile_target", "gpu_target"]


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU Triton compiles for: ``backend`` ``cuda`` (``arch`` the compute capability as an int,
    90 for sm_90) or ``hip`` (``arch`` the gfx name), and the warp size."""

    backend: str
    arch: Any
    warp_size: int

    @property
    def name(self) -> str:
        return f"sm{self.arch}" if self.backend == "cuda" else str(self.arch)


# The GPU targets ``dualop compile`` knows by name.
GPU_TARGETS = {
    "sm80": GpuTarget("cuda", 80, 32),
    "sm89": GpuTarget("cuda", 89, 32),
    "sm90": GpuTarget("cuda", 90, 32),
    "sm100": GpuTarget("cuda", 100, 32),
    "gfx942": GpuTarget("hip", "gfx942", 64),
    "gfx950": GpuTarget("hip", "gfx950", 64),
}

# The GPU kernels are being built for ahead of time (``dualop compile``), or None.
_compile_target: contextvars.ContextVar[GpuTarget | None] = contextvars.ContextVar("dualop_gpu_target", default=None)


@contextlib.contextmanager
def compile_target(target: GpuTarget) -> Iterator[GpuTarget]:
    """Launch wrappers inside this block describe launches for ``target`` (``dualop compile``)."""
    token = _compile_target.set(target)
    try:
        yield target
    finally:
        _compile_target.reset(token)


def gpu_target(device: Any = None) -> GpuTarget | None:
    """The GPU a Triton kernel is for: the ``compile_target`` if one is active, else the GPU that
    holds ``device`` (a torch device), else None (Triton's interpreter on the CPU)."""
    target = _compile_target.get()
    if target is not None:
        return target
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return GpuTarget("hip", str(getattr(props, "gcnArchName", "")).split(":")[0], 64)
    return GpuTarget("cuda", props.major * 10 + props.minor, 32)


def _use_interpreter_without_gpu() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_interpreter_consistent() -> None:
    if not interpreting() or sys.modules.get("triton.language") is None:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.sum, InterpretedFunction):
        raise RuntimeError(
            "dualop: triton was imported before TRITON_INTERPRET=1 was set, so its standard library "
            "is compiled-mode and cannot run in the interpreter. Set TRITON_INTERPRET=1 in the "
            "environment before starting Python (or import dualop.kernels.cuda before torch_xla)."
        )


_use_interpreter_without_gpu()
_check_interpreter_consistent()
