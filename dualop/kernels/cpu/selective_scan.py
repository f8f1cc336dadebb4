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

from dualop.kernels.cpu.common import dtype_code, threads_for
from dualop.kernels.cpu.abi import c_function

_C_SELECTIVE_SCAN = c_function(
    "int dualop_selective_scan(const DualopArray* x, const DualopArray* delta, const DualopArray* z, "
    "const DualopArray* A, const DualopArray* B, const DualopArray* C, const DualopArray* D, "
    "const DualopArray* cache, const DualopArray* slots, const DualopArray* has_init, const DualopArray* cu, "
    "const DualopArray* y, int threads)"
)

__all__ = ["selective_scan", "scan_channels", "MAX_STATE"]

MAX_STATE = 256  # csrc/selective_scan.cc's kScanMaxState


def _f32(t: Any | None) -> Any | None:
    import torch

    return None if t is None else t.to(torch.float32).contiguous()


def selective_scan(x, dt, A, B, C, D, z, dt_bias, state, cu_seqlens, state_indices, has_initial_state, *,
                   delta_softplus: bool) -> tuple[Any, Any]:
    """``(y [T, I], state)``: the scan of a validated serving batch; ``state`` (the cache, or the
    fresh zeros of ``ssm_batch``) is updated in place and returned."""
    if x.shape[0] == 0:
        return x.new_empty(x.shape), state
    # Δ by torch's vectorised softplus (the native body's own formula); libm's scalar log1p/exp
    # per (token, channel) inside the loop measured slower than this one extra pass
    delta = ssm_math.process_dt(array_namespace(x), dt, dt_bias, delta_softplus)
    return scan_channels("selective_scan", x, delta, A, B, C, D, z, state, cu_seqlens, state_indices,
                         has_initial_state)


def scan_channels(op: str, x, delta, A, B, C, D, z, state, cu_seqlens, state_indices,
                  has_initial_state) -> tuple[Any, Any]:
    """The C++ loop over channels with a per-channel state ``[N]``: x, z ``[T, I]``; Δ ``[T, I]``
    (float32, processed); A ``[I, N]``; B, C ``[T, N]`` or ``[T, G, N]`` (channel i reads group
    ``i // (I / G)``); D ``[I]``; ``state`` ``[S, I, N]`` in any float dtype, updated in place.
    ``y = (h C + D x) * silu(z)`` in x's dtype, zero for padding sequences and for tokens past
    ``cu_seqlens[B]``; all inputs are made contiguous (the loop reads unit strides). Also Mamba-2's SSD
    decode step, its heads' P channels each (``kernels/cpu/ssd.py``)."""
    import torch

    code, state_code = dtype_code(x), dtype_code(state)
    if code is None or state_code is None:
        raise NotImplementedError(f"{op}: x of {x.dtype} and a {state.dtype} state cache on {state.device}: "
                                  "no CPU kernel")
    tokens, dim = x.shape
    n = A.shape[1]
    if n > MAX_STATE:
        raise NotImplementedError(f"{op}: the CPU kernel holds states up to {MAX_STATE} wide, got {n}")
    cache = state if state.is_contiguous() else state.contiguous()  # written back below when a copy
    # The C++ loop reads tokens cu[s] .. cu[s + 1] and writes slot slots[s] unchecked: bad metadata
    # (traced, or a direct call) is read as the native body reads it, every index in bounds.
    cu, slots = ssm_math.sanitize_metadata(array_namespace(x), cu_seqlens, state_indices, tokens, state.shape[0])
    slots, cu = slots.contiguous(), cu.contiguous()
    has_init = has_initial_state.to(torch.uint8).contiguous()
    x, delta = x.contiguous(), delta.to(torch.float32).contiguous()
    z = None if z is None else z.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    owned = int(cu[-1])
    if owned < tokens:  # tokens no sequence owns: zeros (the loop never reaches them)
        y[owned:] = 0
    a32, b32, c32, d32 = (_f32(t) for t in (A, B, C, D))  # float32 copies, alive through the call
    status = _C_SELECTIVE_SCAN(
        x=x, delta=delta, z=z, A=a32, B=b32, C=c32, D=d32, cache=cache, slots=slots, has_init=has_init, cu=cu, y=y,
        threads=threads_for(tokens * dim * n),
    )
    if status != 0:
        raise RuntimeError(f"{op}: the CPU scan kernel returned {status}")
    if cache is not state:
        state.copy_(cache)
    return y, state
