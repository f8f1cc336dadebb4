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
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp, Serves
from dualop.kernels import cost as cost_model
from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import (
    check_array, check_optional_like, check_positive_int, decline_if_recording,
)
from dualop.ops.ssm_batch import SSMBatch, fresh_equal_sequences, random_serving_batch, ssm_batch
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["SSDChunkScan"]

OP = "ssd_chunk_scan"
_PALLAS_SSD = KernelRef("dualop.kernels.pallas.ssd", "ssd_chunk_scan")
_TRITON_SSD = KernelRef("dualop.kernels.cuda.ssd", "ssd_chunk_scan")
_CPU_SSD = KernelRef("dualop.kernels.cpu.ssd", "ssd_chunk_scan")
_XLA_SSD = KernelRef("dualop.kernels.xla.ssd", "ssd_chunk_scan")


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

    # jax arrays on the CPU and GPUs take the chunked form in jax.numpy (kernels/xla/ssd); torch_xla
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
        ``jax.numpy`` (``kernels/xla/ssd.py``)."""
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
        (``kernels/xla/ssd.py``; a Triton launch would need jax-triton)."""
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

        y, new_state = call_jax_function(fe, _PALLAS_SSD, *args, native=native, **self._static)
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


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- ssd_chunk_scan: Mamba-2's SSD scan core ---------------------------------------------
# The bench size (tokens, sequences) is a serving batch of equal-length sequences: ``1024x1`` and
# ``1024x8`` prefills, ``64x64`` a decode step (each sequence continuing from its cached state).
# Widths are Mamba-2's head layout scaled to this host: 16 heads of 64 in 2 groups of state 64
# (Nemotron-H-8B has 128 heads, 8 groups of 128), chunks of 256. Peers: transformers'
# ``mamba2_chunk_scan`` (the chunked scan its Mamba2Mixer's torch path runs) on the sequences as a
# batch, and a hand-written jax chunked version of the same math. In 16-bit dtypes transformers adds
# dt_bias, takes the softplus and clamps in the input dtype (dt rounded before the float32 scan; the
# native body widens dt first, as the engine's kernels do), so the bench's check reports it outside
# the bfloat16 tolerance (an error record, not timed; tests/infra/test_bench.py expects it).
SSD_BENCH_WIDTHS = dict(heads=16, head_dim=64, state=64, groups=2, chunk=256)


def _ssd_op(_dim: int):
    from dualop.ops import SSDChunkScan

    w = SSD_BENCH_WIDTHS
    return SSDChunkScan(w["heads"], w["head_dim"], w["state"], w["groups"], chunk_size=w["chunk"])


def _ssd_shape(size: tuple[int, ...]) -> tuple[int, ...]:
    w = SSD_BENCH_WIDTHS
    # more sequences than tokens cannot be: a size such as 8x64 (the every-case sweep's) is 8 tokens
    # as a decode step of 8 sequences
    return (size[0], min(size[1], size[0]), w["heads"], w["head_dim"], w["state"], w["groups"])


def _ssd_bench_inputs(shape, rng):
    """The check case's generator with equal-length sequences, no padding slot, no z. Every
    sequence starts from zeros (``has_initial_state`` False) so that repeated timed calls, which
    update the cache in place on torch, all compute the same outputs; a cached start costs the
    same work (one more read of each state)."""
    from dualop.ops.ssd import make_ssd_inputs

    tokens, seqs = shape[0], shape[1]
    arrays = list(make_ssd_inputs(shape, rng, padding=False))
    arrays[6] = None  # no z gate (transformers' scan has none)
    arrays[9:12] = fresh_equal_sequences(tokens, seqs)
    return tuple(arrays)


def _ssd_cost(op, shape, itemsize) -> KernelCost:
    tokens, seqs, heads, head_dim, state, groups = shape
    return cost_model.ssd_chunk_scan_cost(tokens, heads, head_dim, state, groups, seqs,
                                          min(op.chunk_size, tokens), itemsize)


def _transformers_ssd(op):
    """transformers' chunked scan on the equal-length sequences as a [B, L] batch."""
    import torch
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        seqs = state_indices.shape[0]
        batched = [t.reshape(seqs, -1, *t.shape[1:]) for t in (x, dt, B, C)]
        y, finals = mamba2_chunk_scan(*batched[:2], A, *batched[2:], op.chunk_size, D=D, dt_bias=dt_bias,
                                      initial_states=torch.where(has_initial_state[:, None, None, None],
                                                                 ssm_state[state_indices.long()], 0.0),
                                      dt_softplus=op.delta_softplus,
                                      dt_limit=op.dt_limit, return_final_states=True)
        ssm_state[state_indices.long()] = finals.to(ssm_state.dtype)
        return y.reshape(x.shape).to(x.dtype), ssm_state

    return scan


def _jax_ssd(op):
    """A hand-written jax chunked SSD (the Mamba-2 paper's minimal form) over the equal-length
    sequences as a batch: intra-chunk masked C Bᵀ, chunk states, a scan over chunks, outputs
    from the carried states."""
    import jax
    import jax.numpy as jnp

    def segsum(a):  # [..., L] -> [..., L, L]: sum of a over (s, t], -inf above the diagonal
        length = a.shape[-1]
        mask = jnp.tril(jnp.ones((length, length), bool), -1)
        seg = jnp.cumsum(jnp.where(mask, a[..., :, None], 0.0), axis=-2)
        return jnp.where(jnp.tril(jnp.ones((length, length), bool)), seg, -jnp.inf)

    def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state):
        seqs, heads = state_indices.shape[0], x.shape[1]
        rep = heads // B.shape[1]
        f32 = jnp.float32
        delta = jax.nn.softplus(dt.astype(f32) + dt_bias.astype(f32))
        delta = jnp.clip(delta, *op.dt_limit)
        chunk = min(op.chunk_size, x.shape[0] // seqs)

        def chunks(t):  # [T, ...] -> [B, c, L, ...]
            return t.reshape(seqs, -1, chunk, *t.shape[1:])

        xs = chunks(x.astype(f32) * delta[..., None])
        da = chunks(delta * A).transpose(0, 1, 3, 2)  # [B, c, H, L]
        bs = chunks(jnp.repeat(B.astype(f32), rep, axis=1))
        cs = chunks(jnp.repeat(C.astype(f32), rep, axis=1))
        cum = jnp.cumsum(da, axis=-1)
        y_diag = jnp.einsum("bclhn,bcshn,bchls,bcshp->bclhp", cs, bs, jnp.exp(segsum(da)), xs)
        decay_states = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(da, -1), axis=-1), -1) - da)  # over (l, L)
        states = jnp.einsum("bclhn,bchl,bclhp->bchpn", bs, decay_states, xs)

        def step(h, inputs):
            s, total = inputs
            return jnp.exp(total)[..., None, None] * h + s, h

        h0 = jnp.where(has_initial_state[:, None, None, None], ssm_state[state_indices].astype(f32), 0.0)
        final, entering = jax.lax.scan(step, h0, (states.transpose(1, 0, 2, 3, 4),
                                                   cum[..., -1].transpose(1, 0, 2)))
        y_off = jnp.einsum("bclhn,cbhpn,bchl->bclhp", cs, entering, jnp.exp(cum))
        y = (y_diag + y_off).reshape(x.shape) + D.astype(f32)[:, None] * x.astype(f32)
        return y.astype(x.dtype), ssm_state.at[state_indices].set(final.astype(ssm_state.dtype))

    return scan


def _serving_ssd_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, heads, seqs, head_dim, state, groups = shape
    x = InputSpec((tokens, heads, head_dim), None)
    bc = InputSpec((tokens, groups, state), None)
    return (x, InputSpec((tokens, heads), None), InputSpec((heads,), "float32"), bc, bc, InputSpec((heads,), None), x,
            InputSpec((heads,), None), InputSpec((2 * seqs + 1, heads, head_dim, state), "float32"),
            InputSpec((seqs + 1,), "int32"), InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"))


def _serving_ssd_op(shape: tuple[int, ...]):
    from dualop.ops import SSDChunkScan

    return SSDChunkScan(shape[1], shape[3], shape[4], shape[5], chunk_size=256)


def bench_cases():
    """Not run by default: against transformers' chunked SSD (torch) and a hand-written jax scan."""
    return [BenchCase("ssd_chunk_scan", "ssd_chunk_scan", _ssd_op, _ssd_bench_inputs, _ssd_cost,
                      _transformers_ssd, _jax_ssd, default=False, shape_of=_ssd_shape, matrix=True)]


def serving():
    """(tokens, heads, sequences, head_dim, state, groups): Nemotron-H-8B's Mamba-2 scan (128 heads of
    64, 8 groups of state 128, chunks of 256), a 1024-token prefill of one and of eight sequences and
    a 64-sequence decode step over a float32 cache of 2B + 1 slots; and one group of state 128 under
    64 heads of 128 (a Falcon-H1-like layout) at prefill."""
    shapes = ((1024, 128, 1, 64, 128, 8), (1024, 128, 8, 64, 128, 8), (64, 128, 64, 64, 128, 8),
              (1024, 64, 8, 128, 128, 1))
    return {"ssd_chunk_scan": Serving(shapes, _serving_ssd_inputs, {"ssd_chunk_scan": _serving_ssd_op})}

# jax arrays on the CPU and GPUs: XLA's own kernels (dot, ragged_dot) are the platform path
JAX_XLA = {("jax", "cpu"): "forward_cpu", ("jax", "cuda"): "forward_cuda"}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"ssd_chunk_scan": {"traits": {"case_shapes_only", "contraction", "widens_nonfinite", "packed_sequences"},
                    "kernel_in_native_cells": JAX_XLA}}
