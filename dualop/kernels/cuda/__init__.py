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

import os
import sys

__all__ = ["interpreting"]


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
