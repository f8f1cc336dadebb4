"""Mamba-2's SSD scan over packed sequences with a state cache: ``SSDChunkScan`` (registered
``ssd_chunk_scan``), the scan core of the Mamba-2 mixers (Mamba-2, Bamba, Nemotron-H, Falcon-H1,
Zamba2).

``op(x [T, H, P], dt [T, H], A [H] float32, B [T, G, N], C [T, G, N], D=None [H] or [H, P],
z=None [T, H, P], dt_bias=None [H], ssm_state=None [S, H, P, N], cu_seqlens=None,
state_indices=None, has_initial_state=None) -> (y [T, H, P], ssm_state)``: the recurrence of
``ssm_math.ssd_reference`` (the native body) under the serving contract of ``ssm_batch``. The
kernels compute it in the chunked state-space-duality form (matmuls within chunks of
``chunk_size`` tokens, a recurrence between them); results do not depend on ``chunk_size``.

Strided inputs: the Triton and torch CPU kernels make x, B and C contiguous and gather and scatter
the cache with torch indexing (any strides, in place); ``ssm_batch`` hands every kernel contiguous
int32 metadata; jax arrays have no strides. Within a chunk, other sequences' operands are selected
away rather than multiplied by a zero mask, so a non-finite input reaches only its own sequence.
Bad traced metadata is read as ``ssm_batch`` says, the same on every path, and every kernel clamps
the indices it reads from it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.pallas_bridge import call_pallas
from dualop.custom_op import CustomOp, Serves
from dualop.kernels import ssm_math
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import (
    check_array, check_optional_like, check_positive_int, decline_if_recording,
)
from dualop.ops.ssm_batch import SSMBatch, random_serving_batch, ssm_batch
from dualop.platforms import family_of, frontend_of

__all__ = ["SSDChunkScan"]

OP = "ssd_chunk_scan"
_PALLAS_SSD = KernelRef("dualop.kernels.pallas.ssd", "ssd_chunk_scan")
_TRITON_SSD = KernelRef("dualop.kernels.cuda.ssd", "ssd_chunk_scan")
_CPU_SSD = KernelRef("dualop.kernels.cpu.ssd", "ssd_chunk_scan")
_XLA_SSD = KernelRef("dualop.kernels.xla_ssd", "ssd_chunk_scan")


@CustomOp.register(OP)
class SSDChunkScan(CustomOp):
    """Mamba-2's selective state-space scan with a scalar decay per head (see the module docstring).

    ``A`` is the per-head decay (``-exp(A_log)``, float32); ``Δ = dt + dt_bias``, softplus'd when
    ``delta_softplus``, clamped to ``dt_limit``; head ``h`` reads B and C of group ``h // (H / G)``.
    """

    # torch updates the given cache in place (torch.library declares it; backends/torch/library.py)
    mutates_args: ClassVar[tuple[str, ...]] = ("ssm_state",)
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "ssm_state")

    def __init__(self, num_heads: int, head_dim: int, state_size: int, n_groups: int = 1, chunk_size: int = 256,
                 delta_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, float("inf")), *,
                 enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("state_size", state_size),
                            ("n_groups", n_groups), ("chunk_size", chunk_size)):
            check_positive_int(OP, name, value)
        if num_heads % n_groups:
            raise ValueError(f"{OP}: n_groups={n_groups} must divide num_heads={num_heads}")
        if not isinstance(delta_softplus, bool):
            raise TypeError(f"{OP}: delta_softplus must be a bool, got {delta_softplus!r}")
        limit = tuple(dt_limit) if isinstance(dt_limit, (tuple, list)) else None
        if limit is None or len(limit) != 2 or not all(isinstance(v, (int, float)) for v in limit) \
                or not 0.0 <= limit[0] <= limit[1]:
            raise ValueError(f"{OP}: dt_limit must be (low, high) with 0 <= low <= high, got {dt_limit!r}")
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.n_groups, self.chunk_size = n_groups, chunk_size
        self.delta_softplus = delta_softplus
        self.dt_limit = (float(limit[0]), float(limit[1]))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, state_size={self.state_size}, "
                f"n_groups={self.n_groups}, chunk_size={self.chunk_size}, delta_softplus={self.delta_softplus}, "
                f"dt_limit={self.dt_limit}")

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    def _batch(self, x, ssm_state, cu_seqlens, state_indices, has_initial_state) -> SSMBatch:
        return ssm_batch(OP, x, cu_seqlens, state_indices, has_initial_state, ssm_state, "ssm_state",
                         self.state_shape)

    def check_inputs(self, x: Any, dt: Any = None, A: Any = None, B: Any = None, C: Any = None, D: Any = None,
                     z: Any = None, dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None,
                     state_indices: Any = None, has_initial_state: Any = None) -> None:
        fe = check_array(OP, "x", x)
        heads, head_dim, state, groups = self.num_heads, self.head_dim, self.state_size, self.n_groups
        if x.ndim != 3 or tuple(x.shape[1:]) != (heads, head_dim):
            raise ValueError(f"{OP}: argument 'x' has shape {tuple(x.shape)}; expected [tokens, {heads}, {head_dim}] "
                             f"(num_heads, head_dim)")
        tokens = x.shape[0]
        for name, value, shape in (("dt", dt, (tokens, heads)), ("A", A, (heads,)), ("B", B, (tokens, groups, state)),
                                   ("C", C, (tokens, groups, state))):
            if value is None:
                raise TypeError(f"{OP}: argument '{name}' is required; expected an array of shape {list(shape)}")
            check_optional_like(OP, name, value, "x", x, fe, shape=shape)
        if B.shape[1] != groups or heads % B.shape[1]:
            raise ValueError(f"{OP}: {heads} heads do not divide into the {B.shape[1]} groups of 'B'")
        check_optional_like(OP, "C", C, "B", B, fe, same_dtype=True)
        d_shape = tuple(getattr(D, "shape", ()))
        check_optional_like(OP, "D", D, "x", x, fe, shape=d_shape)
        if D is not None and d_shape not in ((heads,), (heads, head_dim)):
            raise ValueError(f"{OP}: argument 'D' has shape {d_shape}; expected ({heads},) or ({heads}, {head_dim})")
        check_optional_like(OP, "z", z, "x", x, fe, same_dtype=True)
        check_optional_like(OP, "dt_bias", dt_bias, "x", x, fe, shape=(heads,))
        self._batch(x, ssm_state, cu_seqlens, state_indices, has_initial_state)

    def forward_native(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                       dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                       has_initial_state: Any = None) -> tuple[Any, Any]:
        batch = self._batch(x, ssm_state, cu_seqlens, state_indices, has_initial_state)
        return ssm_math.ssd_reference(
            array_namespace(x), x, dt, A, B, C, D, z, dt_bias, batch.state, batch.cu_seqlens, batch.state_indices,
            batch.has_initial_state, self.delta_softplus, self.dt_limit)

    # jax arrays on the CPU and GPUs take the chunked form in jax.numpy (kernels/xla_ssd); torch_xla
    # and torchax tensors have no CPU or GPU path (they reach XLA through the TPU bridge).
    serves = {m: Serves(("torch", "jax"), "no CPU kernel for {frontend} arrays: XLA compiles the native body")
              for m in ("forward_cpu", "forward_cuda", "forward_hip")}

    def _kernel_args(self, x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        batch = self._batch(x, ssm_state, cu_seqlens, state_indices, has_initial_state)
        return (x, dt, A, B, C, D, z, dt_bias, batch.state, batch.cu_seqlens, batch.state_indices,
                batch.has_initial_state)

    @property
    def _static(self) -> dict[str, Any]:
        return dict(chunk_size=self.chunk_size, delta_softplus=self.delta_softplus, dt_limit=self.dt_limit)

    def forward_cpu(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                    dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                    has_initial_state: Any = None) -> tuple[Any, Any]:
        """torch on the CPU: the chunked form as batched torch matmuls (``kernels/cpu/ssd.py``);
        while autograd records, the native recurrence runs (its gradients are the reference's: the
        chunked form's differ by more than the 16-bit tolerance). jax arrays: the chunked form in
        ``jax.numpy`` (``kernels/xla_ssd.py``)."""
        args = self._kernel_args(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices,
                                 has_initial_state)
        if frontend_of(x) == "jax":
            return _XLA_SSD.resolve()(*args, **self._static)
        decline_if_recording(OP, x, dt, A, B, C, D, z, dt_bias)
        return _CPU_SSD.resolve()(*args, **self._static)

    def forward_cuda(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                     dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                     has_initial_state: Any = None) -> tuple[Any, Any]:
        """torch on a GPU: the Triton kernels; jax arrays: the chunked form in ``jax.numpy``
        (``kernels/xla_ssd.py``; a Triton launch would need jax-triton)."""
        args = self._kernel_args(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices,
                                 has_initial_state)
        if frontend_of(x) == "jax":
            return _XLA_SSD.resolve()(*args, **self._static)
        return call_triton(frontend_of(x), _TRITON_SSD, *args, **self._static)

    def forward_tpu(self, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any = None, z: Any = None,
                    dt_bias: Any = None, ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                    has_initial_state: Any = None) -> tuple[Any, Any]:
        """The Pallas kernels (the decode step when T == B); torch frontends get the new cache
        written back into ``ssm_state`` (``copy_``), so they see the update in place."""
        fe = frontend_of(x)
        args = self._kernel_args(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices,
                                 has_initial_state)

        def native(*arrays):
            return ssm_math.ssd_reference(array_namespace(arrays[0]), *arrays, self.delta_softplus, self.dt_limit)

        y, new_state = call_pallas(fe, _PALLAS_SSD, *args, native=native, **self._static)
        if family_of(fe) == "torch" and ssm_state is not None:
            ssm_state.copy_(new_state)
            return y, ssm_state
        return y, new_state


def make_ssd_inputs(shape: tuple[int, ...], rng, *, per_channel_d: bool = False, padding: bool = True) -> tuple:
    """Numpy inputs for a ``(tokens, sequences, heads, head_dim, state, groups)`` serving batch:
    moderate step sizes, decays ``A`` in [-2, -0.5], a cache of ``2B + 1`` slots."""
    import numpy as np

    from dualop.testing import Pinned, normal

    tokens, sequences, heads, head_dim, state, groups = shape
    cu, slots, init, num_slots = random_serving_batch(tokens, sequences, rng, padding=padding)
    a = -rng.uniform(0.5, 2.0, heads).astype(np.float32)
    return (
        normal((tokens, heads, head_dim), rng), normal((tokens, heads), rng, 0.5), Pinned(a, "float32"),
        normal((tokens, groups, state), rng, 0.5), normal((tokens, groups, state), rng, 0.5),
        normal((heads, head_dim) if per_channel_d else (heads,), rng), normal((tokens, heads, head_dim), rng),
        normal((heads,), rng, 0.5), normal((num_slots, heads, head_dim, state), rng),
        Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(init, "bool"),
    )


# (tokens, sequences, heads, head_dim, state, groups): one token; a decode step (T == B) with a
# padding slot; packed prefills whose sequences the 8-token chunks of the check op split.
CHECK_SHAPES = ((1, 1, 2, 8, 8, 1), (5, 5, 4, 8, 16, 2), (29, 3, 4, 16, 8, 2))
CHECK_CHUNK = 8


def check_cases():
    """Serving batches over a cache of ``2B + 1`` slots (untouched slots must stay as they were),
    chunks of 8 tokens so chunk boundaries fall inside sequences."""
    from dualop.testing import OpCase

    def make_op(shape):
        return SSDChunkScan(shape[2], shape[3], shape[4], shape[5], chunk_size=CHECK_CHUNK, dt_limit=(0.0, 4.0))

    return [OpCase(OP, OP, make_op, make_ssd_inputs, CHECK_SHAPES)]
