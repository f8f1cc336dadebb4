"""Mamba-1's selective scan on the CPU for torch tensors (kernel: ``csrc/selective_scan.cc``).

The C++ loop runs one (sequence, block of channels) per work item, so the same call serves a
prefill and a decode step (T == B: one token per item). It reads each sequence's starting state
from its cache slot and writes the final state back there, in place, in the cache's dtype (at a
decode step the state is most of the bytes: a gather, select and scatter around the loop were
half its time). Here: Δ and the float32 side inputs.
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
    state_code = dtype_code(state)
    if state_code is None:
        raise NotImplementedError(f"selective_scan: a {state.dtype} state cache on {state.device} has no CPU kernel")
    xp = array_namespace(x)
    cache = state if state.is_contiguous() else state.contiguous()  # written back below when a copy
    slots = state_indices.to(torch.int32).contiguous()
    has_init = has_initial_state.to(torch.uint8).contiguous()
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
        code, state_code, pointer(x), pointer(delta), pointer(z), *map(pointer, side), pointer(cache),
        pointer(slots), pointer(has_init), pointer(cu), pointer(y), dim, n, cu.shape[0] - 1,
        threads_for(tokens * dim * n))
    if status != 0:
        raise RuntimeError(f"selective_scan: the CPU kernel returned {status}")
    if cache is not state:
        state.copy_(cache)
    return y, state
