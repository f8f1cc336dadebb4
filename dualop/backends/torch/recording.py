"""Whether torch autograd records a call: the C++ CPU kernels have no backward, so they decline
(``NotImplementedError``) and dispatch runs the differentiable native body, saying why."""

from __future__ import annotations

from typing import Any

__all__ = ["decline_if_recording", "records_grad"]


def records_grad(*tensors: Any) -> bool:
    """Whether torch autograd is recording for any of these (then CPU kernels, which have no
    backward, step aside for the differentiable native body)."""
    import torch

    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decline_if_recording(op: str, *tensors: Any) -> None:
    """Raise NotImplementedError (dispatch then runs the differentiable native body and reports
    why) when torch autograd is recording for any of ``tensors``: the C++ CPU kernels have no
    backward."""
    if records_grad(*tensors):
        raise NotImplementedError(f"{op}: autograd is recording and the C++ CPU kernel has no backward")
