"""Mamba-1's selective scan on the CPU for torch tensors (kernel: ``csrc/selective_scan.cc``).

The C++ loop runs one (sequence, block of channels) per work item, so the same call serves a
prefill and a decode step (T == B: one token per item). Here: the float32 side inputs, each
sequence's initial state gathered from the cache (``ssm_math.initial_states``), and the final
states written back into the cache in place (``ssm_math.store_states``).
"""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.kernels import ssm_math
from dualop.kernels.cpu import load
from dualop.kernels.cpu.common import dtype_code, pointer, threads_for

__all__ = ["selective_scan", "MAX_STATE"]

MAX_STATE = 256  # csrc/selective_scan.cc's kScanMaxState


def _f32(t: Any | None) -> Any | None:
    import torch

    return None if t is None else t.to(torch.float32).contiguous()


def selective_scan(x, dt, A, B, C, D, z, dt_bias, state, cu_seqlens, state_indices, has_initial_state, *,
                   delta_softplus: bool) -> tuple[Any, Any]:
    """``(y [T, I], state)``: the scan of a validated serving batch; ``state`` (the cache, or the
    fresh zeros of ``ssm_batch``) is updated in place and returned."""
    import torch

    code = dtype_code(x)
    if code is None:
        raise NotImplementedError(f"selective_scan: dtype {x.dtype} on {x.device} has no CPU kernel")
    tokens, dim = x.shape
    n = A.shape[1]
    if n > MAX_STATE:
        raise NotImplementedError(f"selective_scan: the CPU kernel holds states up to {MAX_STATE} wide, got {n}")
    xp = array_namespace(x)
    init = ssm_math.initial_states(xp, state, state_indices, has_initial_state).contiguous()
    finals = torch.empty_like(init)
    keep = (state_indices >= 0).to(torch.uint8).contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    x, dt = x.contiguous(), dt.contiguous()
    z = None if z is None else z.contiguous()
    y = torch.empty_like(x)
    if tokens == 0:
        return y, state
    # Δ by torch's vectorised softplus (the native body's own formula); libm's scalar log1p/exp
    # per (token, channel) inside the loop measured slower than this one extra pass
    delta = ssm_math.process_dt(xp, dt, dt_bias, delta_softplus).contiguous()
    side = [_f32(t) for t in (A, B, C, D)]  # float32 copies, alive through the call
    status = load().dualop_selective_scan(
        code, pointer(x), pointer(delta), pointer(z), *map(pointer, side), pointer(init), pointer(finals),
        pointer(cu), pointer(keep), pointer(y), dim, n, cu.shape[0] - 1, threads_for(tokens * dim * n))
    if status != 0:
        raise RuntimeError(f"selective_scan: the CPU kernel returned {status}")
    return y, ssm_math.store_states(xp, state, state_indices, finals)
