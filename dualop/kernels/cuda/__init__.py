"""Triton kernels for CUDA and ROCm, launched on torch tensors.

On a machine with no GPU, Triton's interpreter runs them on CPU tensors. The interpreter is chosen
when a ``@triton.jit`` function is defined, so this package turns it on before any kernel module
is imported if no GPU is visible (``TRITON_INTERPRET=1``; set it to 0 yourself to refuse).
"""

from __future__ import annotations

import os


def _use_interpreter_without_gpu() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_use_interpreter_without_gpu()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
