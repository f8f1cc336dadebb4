"""The array namespace frontend-neutral op bodies use, for torch tensors.

Each backend module exposes the same names with the same meaning (the shape of the Python array
API, plus the few functions it lacks); ``backends/xla/array_api.py`` is the jax twin.
"""

from __future__ import annotations

import torch

name = "torch"

float32 = torch.float32
float16 = torch.float16
bfloat16 = torch.bfloat16


def astype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def mean(x: torch.Tensor, axis: int = -1, keepdims: bool = False) -> torch.Tensor:
    return torch.mean(x, dim=axis, keepdim=keepdims)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


def erf(x: torch.Tensor) -> torch.Tensor:
    return torch.erf(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


def maximum(x: torch.Tensor, y) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        return torch.clamp(x, min=y)
    return torch.maximum(x, y)


def where(cond: torch.Tensor, x, y) -> torch.Tensor:
    return torch.where(cond, x, y)
