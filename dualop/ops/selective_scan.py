"""Mamba-1's selective scan over packed sequences with a state cache: ``SelectiveScan``
(registered ``selective_scan``), the engine's ``selective_scan_fn`` / ``selective_state_update``.

``op = SelectiveScan(dim, state_size, delta_softplus=True)``;
``y, ssm_state = op(x, dt, A, B, C, D=None, z=None, dt_bias=None, ssm_state=None, cu_seqlens=None,
state_indices=None, has_initial_state=None)``.

- ``x``, ``dt``, ``z``: ``[T, I]`` (I = ``dim``), float32/bfloat16/float16, one dtype.
- ``A``: ``[I, N]`` float32 (N = ``state_size``; ``-exp(A_log)``); ``B``, ``C``: ``[T, N]``, x's dtype
  or float32; ``D``, ``dt_bias``: ``[I]``, any float dtype.
- ``ssm_state``: the cache ``[S, I, N]``; ``cu_seqlens`` / ``state_indices`` / ``has_initial_state``:
  the serving batch (``dualop/ops/ssm_batch.py``; decode is T == B, one token per sequence).

The math (``ssm_math.selective_scan_reference``, the native body): with ``Δ = dt + dt_bias`` (then
softplus), ``h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t``, ``y_t = h_t C_t + D ⊙ x_t``, times
``silu(z_t)`` when z is given; float32 throughout, y in x's dtype, states in the cache's dtype.
torch updates the cache in place and returns it; jax returns a new one.

Kernels: Pallas (``kernels/pallas/selective_scan.py``: a chunked sequential scan, the state in
VMEM), Triton (``kernels/cuda/selective_scan.py``: one program per channel block and sequence),
and on the torch CPU a C++ kernel (``kernels/cpu/csrc/selective_scan.cc``: OpenMP over channel
blocks, the state of a block in registers/L1 across a sequence). Each has a prefill kernel and a
decode step kernel (T == B).

Strided inputs: the Triton kernel takes the row and channel strides of x, dt, z, B, C and the
cache's strides (the cache is written in place where it lies) and makes A, D, dt_bias contiguous
(small); the C++ wrapper makes every input contiguous (a strided cache is updated through a
contiguous copy written back); ``ssm_batch`` hands every kernel contiguous int32 metadata; jax
arrays have no strides. Bad traced metadata is read as ``ssm_batch`` says, the same on every path,
and every kernel clamps the indices it reads from it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels import cost as cost_model
from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import (
    check_array, check_optional_like, check_positive_int, decline_if_recording, dtype_name,
)
from dualop.ops.ssm_batch import SSMBatch, ssm_batch
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["SelectiveScan"]

_OP = "selective_scan"
_PALLAS_SELECTIVE_SCAN = KernelRef("dualop.kernels.pallas.selective_scan", "selective_scan")
_TRITON_SELECTIVE_SCAN = KernelRef("dualop.kernels.cuda.selective_scan", "selective_scan")
_F32 = frozenset({"float32"})


def _is_fake(x: Any) -> bool:
    """A torch FakeTensor (the fake kernel's input under torch.compile and opcheck)."""
    if frontend_of(x) != "torch":
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


@CustomOp.register("selective_scan")
class SelectiveScan(CustomOp):
    """Mamba-1's selective scan with serving state (see the module docstring)."""

    # torch updates the given cache in place (torch.library declares it; backends/torch/library.py)
    mutates_args: ClassVar[tuple[str, ...]] = ("ssm_state",)
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "ssm_state")

    def __init__(self, dim: int, state_size: int, delta_softplus: bool = True, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        check_positive_int(_OP, "dim", dim)
        check_positive_int(_OP, "state_size", state_size)
        if not isinstance(delta_softplus, bool):
            raise TypeError(f"{_OP}: delta_softplus must be a bool, got {delta_softplus!r}")
        self.dim = dim
        self.state_size = state_size
        self.delta_softplus = delta_softplus

    def extra_repr(self) -> str:
        return f"dim={self.dim}, state_size={self.state_size}, delta_softplus={self.delta_softplus}"

    def _batch(self, x, cu_seqlens, state_indices, has_initial_state, ssm_state) -> SSMBatch:
        return ssm_batch(_OP, x, cu_seqlens, state_indices, has_initial_state, ssm_state, "ssm_state",
                         (self.dim, self.state_size))

    def check_inputs(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                     dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                     has_initial_state: Any = None) -> None:
        fe = check_array(_OP, "x", x, min_ndim=2)
        tokens, dim, n = x.shape[0], self.dim, self.state_size
        if x.ndim != 2 or x.shape[1] != dim:
            raise ValueError(f"{_OP}: argument 'x' has shape {tuple(x.shape)}; expected [tokens, {dim}]")
        for name, value in (("dt", dt), ("A", A), ("B", B), ("C", C)):
            if value is None:
                raise ValueError(f"{_OP}: argument '{name}' is required")
        check_optional_like(_OP, "dt", dt, "x", x, fe, same_dtype=True)
        check_optional_like(_OP, "A", A, "x", x, fe, shape=(dim, n), dtypes=_F32)
        for name, value in (("B", B), ("C", C)):
            check_optional_like(_OP, name, value, "x", x, fe, shape=(tokens, n))
            if dtype_name(value) not in (dtype_name(x), "float32"):
                raise TypeError(f"{_OP}: argument '{name}' has dtype {dtype_name(value)}; expected "
                                f"{dtype_name(x)} (the dtype of 'x') or float32")
        check_optional_like(_OP, "D", D, "x", x, fe, shape=(dim,))
        check_optional_like(_OP, "z", z, "x", x, fe, same_dtype=True)
        check_optional_like(_OP, "dt_bias", dt_bias, "x", x, fe, shape=(dim,))
        if ssm_state is not None:
            # device and frontend here; its shape [slots, I, N] and dtype in ssm_batch
            check_optional_like(_OP, "ssm_state", ssm_state, "x", x, fe, shape=tuple(getattr(ssm_state, "shape", ())))
        self._batch(x, cu_seqlens, state_indices, has_initial_state, ssm_state)

    def forward_native(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                       dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                       has_initial_state: Any = None) -> tuple[Any, Any]:
        xp = array_namespace(x)
        batch = self._batch(x, cu_seqlens, state_indices, has_initial_state, ssm_state)
        if _is_fake(x):  # torch.compile's fake kernel: shapes only (the token loop reads values)
            return xp.astype(x * 0, x.dtype), batch.state
        return ssm_math.selective_scan_reference(
            xp, x, dt, A, B, C, D, z, dt_bias, batch.state, batch.cu_seqlens, batch.state_indices,
            batch.has_initial_state, self.delta_softplus)


    def forward_cpu(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                    dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                    has_initial_state: Any = None) -> tuple[Any, Any]:
        """torch on the CPU: the C++ kernel (no backward: declines while autograd records)."""
        from dualop.kernels.cpu.selective_scan import selective_scan

        decline_if_recording(_OP, x, dt, A, B, C, D, z, dt_bias, ssm_state)
        batch = self._batch(x, cu_seqlens, state_indices, has_initial_state, ssm_state)
        return selective_scan(x, dt, A, B, C, D, z, dt_bias, batch.state, batch.cu_seqlens, batch.state_indices,
                              batch.has_initial_state, delta_softplus=self.delta_softplus)

    def forward_cuda(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                     dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                     has_initial_state: Any = None) -> tuple[Any, Any]:
        if frontend_of(x) == "torch":  # the Triton kernels have no backward either
            decline_if_recording(_OP, x, dt, A, B, C, D, z, dt_bias, ssm_state)
        batch = self._batch(x, cu_seqlens, state_indices, has_initial_state, ssm_state)
        return call_triton(frontend_of(x), _TRITON_SELECTIVE_SCAN, x, dt, A, B, C, D, z, dt_bias, batch.state,
                           batch.cu_seqlens, batch.state_indices, batch.has_initial_state,
                           delta_softplus=self.delta_softplus, decode=batch.decode)

    def forward_tpu(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                    dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                    has_initial_state: Any = None) -> tuple[Any, Any]:
        """The Pallas kernels; torch frontends get the new cache written back into ``ssm_state``
        (``copy_``), so torch callers see the update in place on every device."""
        fe = frontend_of(x)
        batch = self._batch(x, cu_seqlens, state_indices, has_initial_state, ssm_state)
        y, state = call_jax_function(fe, _PALLAS_SELECTIVE_SCAN, x, dt, A, B, C, D, z, dt_bias, batch.state,
                               batch.cu_seqlens, batch.state_indices, batch.has_initial_state,
                               native=self.forward_native, delta_softplus=self.delta_softplus, decode=batch.decode)
        if ssm_state is not None and family_of(fe) == "torch":
            ssm_state.copy_(state)
            return y, ssm_state
        return y, state


def make_scan_inputs(shape, rng, *, seq_lens=None, slots=None, has_initial=None, padding=(), cache=True):
    """Numpy inputs of one selective-scan call: ``shape = (T, B, I, N)`` (B sequences of random
    lengths summing to T unless ``seq_lens``), a cache of ``B + 2`` slots holding random states,
    the sequences in shuffled slots, ``has_initial`` (default alternating) and sequences listed in
    ``padding`` given slot -1. A is ``-exp`` of small logs; dt around softplus' knee. Without
    ``cache``: no cache and no ``has_initial_state`` (fresh states returned), slots ``0 .. B-1``."""
    import numpy as np

    from dualop.testing import Pinned, normal

    tokens, num_seqs, dim, n = shape
    if seq_lens is None:
        cuts = np.sort(rng.choice(np.arange(1, tokens), num_seqs - 1, replace=False)) if num_seqs > 1 else []
        seq_lens = np.diff(np.concatenate([[0], cuts, [tokens]]))
    cu = np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)
    slot_count = num_seqs + 2 if cache else num_seqs
    if slots is None:
        slots = rng.permutation(slot_count)[:num_seqs]
    slots = np.asarray(slots, np.int32).copy()
    for b in padding:
        slots[b] = -1
    if has_initial is None:
        has_initial = np.arange(num_seqs) % 2 == 0
    a = -np.exp(rng.uniform(-1.0, 1.0, (dim, n))).astype(np.float32)
    return (
        normal((tokens, dim), rng), normal((tokens, dim), rng, 0.5) - 1.0, Pinned(a, "float32"),
        normal((tokens, n), rng), normal((tokens, n), rng), normal((dim,), rng), normal((tokens, dim), rng),
        normal((dim,), rng, 0.5), normal((slot_count, dim, n), rng, 0.5) if cache else None, Pinned(cu, "int32"),
        Pinned(slots, "int32"), Pinned(np.asarray(has_initial, bool), "bool") if cache else None,
    )


# Check shapes (T, B, I, N): one token, a packed prefill with a padding sequence and a decode batch
# (T == B, the step kernels); small and few, for the interpreters (one long prefill per kernel runs
# in tests/ops/test_selective_scan.py).
CHECK_SHAPES = ((1, 1, 24, 4), (12, 3, 40, 8), (4, 4, 24, 4))


def check_cases():
    """The serving call with every optional input (D, z, dt_bias, the packed batch with a padding
    sequence) but the cache: the fresh final states are returned. The cache is updated in place on
    torch, which the torch.library op (tests/sweeps/test_torch_library.py's opcheck) cannot declare yet
    for an op that also returns outputs; the cache paths are tested in tests/ops/test_selective_scan.py."""
    from dualop.testing import OpCase

    def make_inputs(shape, rng):
        return make_scan_inputs(shape, rng, padding=(1,) if shape[1] > 1 else (), cache=False)

    return [OpCase(_OP, _OP, lambda s: SelectiveScan(s[2], s[3]), make_inputs, CHECK_SHAPES)]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- selective_scan: Mamba-1's scan core -------------------------------------------------
# The bench size (R, I) is R tokens over I channels with N = 16 (Mamba-1's state size; Falcon-Mamba-7B
# and Jamba have I = 8192, so pass a smaller I on this host, e.g. ``--sizes 1024x512``): a prefill of
# R tokens as one sequence (``[prefill]``) or eight equal ones (``[prefill_8seq]``), and a decode step
# of R sequences (``[decode]``, ``--sizes 64x512``). Every sequence starts fresh (no initial state)
# and writes its slot: torch updates the cache in place, and the bench compares each call's output
# with forward_native's on the same inputs, so repeated calls must not change them. Peers: a
# torch loop like transformers' MambaMixer.slow_forward (its scan is inline there, so it cannot be
# called on its own: exp(Δ A) and Δ B x for a whole sequence first, then the token loop), a jax
# ``lax.scan`` over the packed tokens, and torch.compile of the native body (a Python token loop:
# slow to compile at long T). Not run by default.
SCAN_STATE = 16


_SCAN_SEQS = {"prefill": 1, "prefill_8seq": 8, "decode": None}


def _scan_shape(kind: str):
    def shape_of(size):
        tokens, dim = size
        return (tokens, _SCAN_SEQS[kind] or tokens, dim)

    return shape_of


def _scan_op(dim: int):
    from dualop.ops import SelectiveScan

    return SelectiveScan(dim, SCAN_STATE)


def _scan_inputs(shape, rng):
    from dualop.ops.selective_scan import make_scan_inputs

    tokens, seqs, dim = shape
    lens = np.full(seqs, tokens // seqs)
    lens[-1] += tokens - lens.sum()
    return make_scan_inputs((tokens, seqs, dim, SCAN_STATE), rng, seq_lens=lens, slots=np.arange(seqs),
                            has_initial=np.zeros(seqs, bool))


def _scan_cost(op, shape, itemsize) -> KernelCost:
    tokens, seqs, dim = shape
    return cost_model.selective_scan_cost(tokens, dim, op.state_size, seqs, itemsize)


def _torch_scan_loop(op):
    """transformers' slow_forward scan per sequence, then the cache write."""
    import torch
    import torch.nn.functional as F

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        f32 = torch.float32
        delta = F.softplus(dt.to(f32) + dt_bias.to(f32))
        ys = []
        bounds = cu_seqlens.tolist()
        for b, slot in enumerate(state_indices.tolist()):
            lo, hi = bounds[b], bounds[b + 1]
            h = ssm_state[slot].to(f32) if bool(has_initial_state[b]) else x.new_zeros(A.shape, dtype=f32)
            d = delta[lo:hi]
            decay = torch.exp(d[:, :, None] * A[None])  # [L, I, N]
            inject = (d * x[lo:hi].to(f32))[:, :, None] * B[lo:hi, None, :].to(f32)
            rows = []
            for t in range(hi - lo):
                h = decay[t] * h + inject[t]
                rows.append(h @ C[lo + t].to(f32))
            ssm_state[slot] = h.to(ssm_state.dtype)
            ys.append(torch.stack(rows))
        y = torch.cat(ys) + x.to(f32) * D.to(f32)
        return (y * F.silu(z.to(f32))).to(x.dtype), ssm_state

    return scan


def _jax_scan(op):
    """A ``lax.scan`` over the packed tokens, restarting the state at each sequence's first token."""
    import jax
    import jax.numpy as jnp

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        f32 = jnp.float32
        tokens = x.shape[0]
        seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(tokens), side="right")
        first = jnp.arange(tokens) == cu_seqlens[seq]
        init = jnp.where(has_initial_state[:, None, None], ssm_state[state_indices].astype(f32), 0.0)
        delta = jax.nn.softplus(dt.astype(f32) + dt_bias.astype(f32))

        last = jnp.arange(tokens) == cu_seqlens[seq + 1] - 1

        def step(carry, inputs):
            h, finals = carry
            s, f, e, d, xt, bt, ct = inputs
            h = jnp.where(f, init[s], h)
            h = jnp.exp(d[:, None] * A) * h + (d * xt)[:, None] * bt[None, :]
            finals = jnp.where(e, finals.at[s].set(h), finals)
            return (h, finals), h @ ct

        (_, finals), ys = jax.lax.scan(step, (jnp.zeros(A.shape, f32), init),
                                       (seq, first, last, delta, x.astype(f32), B.astype(f32), C.astype(f32)))
        cache = ssm_state.at[state_indices].set(finals.astype(ssm_state.dtype))
        y = (ys + x.astype(f32) * D.astype(f32)) * jax.nn.silu(z.astype(f32))
        return y.astype(x.dtype), cache

    return jax.jit(scan)


def _selective_scan_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, dim, n = shape
    rows, states = InputSpec((tokens, dim), None), InputSpec((tokens, n), None)
    channel = InputSpec((dim,), None)
    return (rows, rows, InputSpec((dim, n), "float32"), states, states, channel, rows, channel,
            InputSpec((2 * seqs, dim, n), "float32"), InputSpec((seqs + 1,), "int32"), InputSpec((seqs,), "int32"),
            InputSpec((seqs,), "bool"))


def bench_cases():
    """Not run by default: against a per-token loop (torch) and a lax.scan (jax)."""
    return [BenchCase(f"selective_scan[{kind}]", "selective_scan", _scan_op, _scan_inputs, _scan_cost,
                      _torch_scan_loop, _jax_scan, default=False, shape_of=_scan_shape(kind))
            for kind in _SCAN_SEQS]


def serving():
    """(tokens, sequences, I, N), as the check shapes: Falcon-Mamba-7B / Jamba's Mamba-1 layer (I 8192,
    N 16), a prefill of 8192 tokens packed as 8 sequences and a decode step of 64 sequences; a
    float32 state cache of 2 slots per sequence."""
    return {"selective_scan": Serving(((8192, 8, 8192, 16), (64, 64, 8192, 16)), _selective_scan_inputs)}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"selective_scan": {"traits": {"case_shapes_only", "contraction", "packed_sequences"}}}
