"""PLaMo 2's Mamba mixer: ``Plamo2MambaMixer`` (registered ``plamo2_mamba_mixer``), the reference
engine's ``Plamo2MambaMixer`` math with its weights as explicit arguments and the two state caches
of ``mamba_mixer2`` (``conv_state [S, I, K - 1]``, ``ssm_state [S, H, P, N]``) as the serving batch
of ``dualop.ops.ssm_batch`` describes.

``op = Plamo2MambaMixer(hidden_size, ssm_state_size, conv_kernel_size, num_heads, head_dim,
time_step_rank=None, rms_norm_eps=1e-6, chunk_size=256)`` (``I = num_heads * head_dim``; the
time-step rank defaults to the engine's ``max(64, hidden_size // 16)``);
``out, conv_state, ssm_state = op(hidden_states [T, Hd], in_proj_weight [2I, Hd], conv_weight [I, K],
bcdt_proj_weight [2N + R, I], dt_proj_weight [H, R], dt_bias [H], A_log [H], D [H],
dt_norm_weight [R], B_norm_weight [N], C_norm_weight [N], out_proj_weight [Hd, I], conv_state=None,
ssm_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None)``.

The math, per packed token (the sequences of ``cu_seqlens`` never mix):

1. ``gate, x = in_proj(h)``: the first I rows of ``in_proj_weight`` give the gate, the next I give x
   (the engine's merged order; the checkpoint interleaves them per head, which the layers'
   ``load_state_dict`` undoes);
2. ``x = silu(causal_conv1d(x))`` (no bias) over each sequence, continuing from its ``conv_state``;
3. ``B, C, t = bcdt_proj(x)`` split ``[N, N, R]``; each RMS-normalised over its last dim times its
   weight (``B_norm_weight``, ``C_norm_weight``, ``dt_norm_weight``; eps ``rms_norm_eps``);
4. ``dt = dt_proj(t)`` (``[H]`` per token; ``dt_bias`` and the softplus are the scan's);
5. ``y = ssd(x [T, H, P], dt, A = -exp(A_log), B, C [T, 1, N] (one group), D, z = gate)``
   continuing from its ``ssm_state`` slot (``y ⊙ silu(gate)`` inside; no output norm);
6. ``out = out_proj(y)``.

Rounding (``forward_native``): each matmul multiplies float32 operands at full precision and rounds
once to ``hidden_states``' dtype, as a vendor GEMM with float32 accumulation does; the conv and the
scan compute in float32 and round their outputs once (``dualop.kernels.ssm_math``); the norms are
the engine's RMSNorm (normalised in float32, rounded, then times the weight). A padding sequence
(slot -1) gives zero outputs and writes neither state.

The platform methods (``forward_cpu``/``forward_cuda``/``forward_tpu``, one body) run the
projections with the linear op's vendor GEMM (``dualop.ops._mixer``) and call the kernel ops
``CausalConv1d`` (``dualop.ops.causal_conv1d``) and ``SSDChunkScan`` (``dualop.ops.ssd``), which
dispatch to their own kernels (the conv's weight in the tokens' dtype). Every argument, both caches
included, is checked before either cache is written (``check_inputs``, ``ssm_batch``): a refused
call leaves both as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.kernels import cost as cost_model
from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.norm_math import NormSpec, rms_normalize
from dualop.ops._checks import check_array, check_optional_like, check_positive_int
from dualop.ops._mixer import MixerPlatformMethods, check_not_engine_mixer_call, mixer_batches, project, projection
from dualop.ops.causal_conv1d import CausalConv1d
from dualop.ops.ssd import SSDChunkScan
from dualop.ops.ssm_batch import SSMBatch, fresh_equal_sequences
from dualop.spec import BenchCase, InputSpec, Serving
from dualop.spec import float32_normal as _normal

__all__ = ["Plamo2MambaMixer"]

_OP = "plamo2_mamba_mixer"
# The weight arguments in call order (all required: PLaMo 2 has no optional parameter).
_WEIGHTS = ("in_proj_weight", "conv_weight", "bcdt_proj_weight", "dt_proj_weight", "dt_bias", "A_log", "D",
            "dt_norm_weight", "B_norm_weight", "C_norm_weight", "out_proj_weight")


# The checkpoint's key of each weight argument (PLaMo 2's own names, as the engine's loader reads
# them: it renames the norms and A_log to its modules but loads the same tensors).
CHECKPOINT_KEYS = {
    "in_proj_weight": "in_proj.weight", "conv_weight": "conv1d.weight", "bcdt_proj_weight": "bcdt_proj.weight",
    "dt_proj_weight": "dt_proj.weight", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
    "dt_norm_weight": "dt_norm_weight", "B_norm_weight": "B_norm_weight", "C_norm_weight": "C_norm_weight",
    "out_proj_weight": "out_proj.weight",
}


def in_proj_from_checkpoint(weight: Any, num_heads: int) -> Any:
    """The checkpoint's ``in_proj.weight`` ``[2I, Hd]`` (per head: P gate rows, then P x rows) in
    the op's order (all gate rows, then all x rows), as the engine's loader reorders it. Works on
    torch, numpy and jax arrays."""
    rows, hidden = weight.shape
    return weight.reshape(num_heads, 2, rows // (2 * num_heads), hidden).swapaxes(0, 1).reshape(rows, hidden)


def in_proj_to_checkpoint(weight: Any, num_heads: int) -> Any:
    """The inverse of ``in_proj_from_checkpoint``: the op's order back to the checkpoint's."""
    rows, hidden = weight.shape
    return weight.reshape(2, num_heads, rows // (2 * num_heads), hidden).swapaxes(0, 1).reshape(rows, hidden)


@CustomOp.register(_OP)
class Plamo2MambaMixer(MixerPlatformMethods, CustomOp):
    """PLaMo 2's Mamba-2 mixer over packed sequences with conv and SSM state caches (see the module
    docstring for the call, the math and where it rounds)."""

    # torch updates the given caches in place (torch.library declares them; backends/torch/library.py)
    mutates_args: ClassVar[tuple[str, ...]] = ("conv_state", "ssm_state")
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "conv_state", "ssm_state")

    def __init__(
        self,
        hidden_size: int,
        ssm_state_size: int,
        conv_kernel_size: int,
        num_heads: int,
        head_dim: int,
        time_step_rank: int | None = None,
        rms_norm_eps: float = 1e-6,
        chunk_size: int = 256,
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = check_positive_int(_OP, "hidden_size", hidden_size)
        self.ssm_state_size = check_positive_int(_OP, "ssm_state_size", ssm_state_size)
        self.conv_kernel_size = check_positive_int(_OP, "conv_kernel_size", conv_kernel_size)
        self.num_heads = check_positive_int(_OP, "num_heads", num_heads)
        self.head_dim = check_positive_int(_OP, "head_dim", head_dim)
        if time_step_rank is None:
            time_step_rank = max(64, hidden_size // 16)  # the engine's rule
        self.time_step_rank = check_positive_int(_OP, "time_step_rank", time_step_rank)
        self.chunk_size = check_positive_int(_OP, "chunk_size", chunk_size)
        if isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, (int, float)) or not rms_norm_eps >= 0:
            raise ValueError(f"{_OP}: rms_norm_eps must be a non-negative float, got {rms_norm_eps!r}")
        self.rms_norm_eps = float(rms_norm_eps)
        self.intermediate_size = self.num_heads * self.head_dim
        self.norm_spec = NormSpec(eps=self.rms_norm_eps)
        self._kernel_op_instances: tuple[Any, Any] | None = None
        i, h, n, r = self.intermediate_size, self.hidden_size, self.ssm_state_size, self.time_step_rank
        # the projections (dualop.ops._mixer); PLaMo 2's have no biases (dt_bias is the scan's)
        self.in_proj = projection(h, 2 * i)
        self.bcdt_proj = projection(i, 2 * n + r)
        self.dt_proj = projection(r, self.num_heads)
        self.out_proj = projection(i, h)

    # -- shapes and checks ---------------------------------------------------------------------------

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One slot of the conv cache: the last ``K - 1`` conv inputs of each of the I channels
        (the engine's Mamba-2 layout with no B/C groups in the conv)."""
        return (self.intermediate_size, self.conv_kernel_size - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """One slot of the SSM cache: ``[H, P, N]``."""
        return (self.num_heads, self.head_dim, self.ssm_state_size)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight argument's shape, in call order."""
        i, hd, k, r, n, h = (self.intermediate_size, self.hidden_size, self.conv_kernel_size, self.time_step_rank,
                             self.ssm_state_size, self.num_heads)
        return {
            "in_proj_weight": (2 * i, hd), "conv_weight": (i, k), "bcdt_proj_weight": (2 * n + r, i),
            "dt_proj_weight": (h, r), "dt_bias": (h,), "A_log": (h,), "D": (h,), "dt_norm_weight": (r,),
            "B_norm_weight": (n,), "C_norm_weight": (n,), "out_proj_weight": (hd, i),
        }

    def _batches(self, hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                 has_initial_state) -> tuple[SSMBatch, SSMBatch]:
        """Both caches validated against the layer and against each other: one serving batch."""
        return mixer_batches(_OP, hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                             has_initial_state, self.conv_state_shape, self.ssm_state_shape)

    def check_inputs(self, hidden_states: Any, in_proj_weight: Any = None, conv_weight: Any = None,
                     bcdt_proj_weight: Any = None, dt_proj_weight: Any = None, dt_bias: Any = None,
                     A_log: Any = None, D: Any = None, dt_norm_weight: Any = None, B_norm_weight: Any = None,
                     C_norm_weight: Any = None, out_proj_weight: Any = None, conv_state: Any = None,
                     ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                     has_initial_state: Any = None) -> None:
        fe = check_array(_OP, "hidden_states", hidden_states, min_ndim=2)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{_OP}: argument 'hidden_states' has shape {tuple(hidden_states.shape)}; expected "
                             f"[tokens, hidden_size={self.hidden_size}]")
        given = dict(zip(_WEIGHTS, (in_proj_weight, conv_weight, bcdt_proj_weight, dt_proj_weight, dt_bias, A_log, D,
                                    dt_norm_weight, B_norm_weight, C_norm_weight, out_proj_weight)))
        shapes = self.weight_shapes()
        check_not_engine_mixer_call(_OP, "Plamo2MambaMixer", hidden_states, in_proj_weight, shapes["in_proj_weight"])
        for name, shape in shapes.items():
            if given[name] is None:
                raise ValueError(f"{_OP}: argument '{name}' is required (shape {shape})")
            check_optional_like(_OP, name, given[name], "hidden_states", hidden_states, fe, shape=shape)
        self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state)
        for name, cache in (("conv_state", conv_state), ("ssm_state", ssm_state)):
            if cache is not None:  # the same device as the tokens (the shape was checked above)
                check_optional_like(_OP, name, cache, "hidden_states", hidden_states, fe, shape=tuple(cache.shape))

    # -- the shared steps ----------------------------------------------------------------------------

    def _ssm_parameters(self, xp, method, x, bcdt_proj_weight, dt_proj_weight, dt_norm_weight, B_norm_weight,
                        C_norm_weight):
        """Steps 3 and 4: ``bcdt_proj``, the split ``[N, N, R]``, the three norms, ``dt_proj``."""
        n = self.ssm_state_size
        bcdt = project(self.bcdt_proj, method, x, bcdt_proj_weight)
        b, c, t = bcdt[:, :n], bcdt[:, n:2 * n], bcdt[:, 2 * n:]

        def norm(v, weight):
            return rms_normalize(xp, xp.astype(v, xp.float32), weight, self.norm_spec, v.dtype)

        b, c, t = norm(b, B_norm_weight), norm(c, C_norm_weight), norm(t, dt_norm_weight)
        return b, c, project(self.dt_proj, method, t, dt_proj_weight)

    def _heads(self, v: Any) -> Any:
        """``[T, I]`` -> ``[T, H, P]`` (head h owns channels ``h·P : (h + 1)·P``)."""
        return v.reshape(v.shape[0], self.num_heads, self.head_dim)

    # -- the native body -----------------------------------------------------------------------------

    def forward_native(self, hidden_states: Any, in_proj_weight: Any, conv_weight: Any, bcdt_proj_weight: Any,
                       dt_proj_weight: Any, dt_bias: Any, A_log: Any, D: Any, dt_norm_weight: Any,
                       B_norm_weight: Any, C_norm_weight: Any, out_proj_weight: Any, conv_state: Any = None,
                       ssm_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                       has_initial_state: Any = None) -> tuple[Any, Any, Any]:
        """The references of ``dualop.kernels.ssm_math`` composed with float32 matmuls and the
        norms (nothing of dualop's kernels runs: see the module docstring for where it rounds)."""
        xp = array_namespace(hidden_states)
        conv_b, ssm_b = self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                                      has_initial_state)
        i, tokens = self.intermediate_size, hidden_states.shape[0]
        projected = project(self.in_proj, "forward_native", hidden_states, in_proj_weight)
        gate, x = projected[:, :i], projected[:, i:]
        x, new_conv = ssm_math.causal_conv1d_reference(
            xp, x, conv_weight, None, conv_b.state, conv_b.cu_seqlens, conv_b.state_indices,
            conv_b.has_initial_state, "silu")
        b, c, dt = self._ssm_parameters(xp, "forward_native", x, bcdt_proj_weight, dt_proj_weight, dt_norm_weight,
                                        B_norm_weight, C_norm_weight)
        a = -xp.exp(xp.astype(A_log, xp.float32))
        y, new_ssm = ssm_math.ssd_reference(
            xp, self._heads(x), dt, a, b[:, None, :], c[:, None, :], D, self._heads(gate), dt_bias, ssm_b.state,
            ssm_b.cu_seqlens, ssm_b.state_indices, ssm_b.has_initial_state, delta_softplus=True)
        return project(self.out_proj, "forward_native", y.reshape(tokens, i), out_proj_weight), new_conv, new_ssm

    # -- the platform body ---------------------------------------------------------------------------

    def _kernel_ops(self) -> tuple[Any, Any]:
        """This mixer's ``CausalConv1d`` and ``SSDChunkScan`` instances (made on first use)."""
        if self._kernel_op_instances is None:
            conv = CausalConv1d(self.intermediate_size, self.conv_kernel_size, activation="silu",
                                enforce_enable=self.enforce_enable)
            scan = SSDChunkScan(self.num_heads, self.head_dim, self.ssm_state_size, n_groups=1,
                                chunk_size=self.chunk_size, delta_softplus=True,
                                enforce_enable=self.enforce_enable)
            self._kernel_op_instances = (conv, scan)
        return self._kernel_op_instances

    def _forward_kernels(self, method, hidden_states, in_proj_weight, conv_weight, bcdt_proj_weight, dt_proj_weight, dt_bias,
                         A_log, D, dt_norm_weight, B_norm_weight, C_norm_weight, out_proj_weight, conv_state=None,
                         ssm_state=None, cu_seqlens=None, state_indices=None, has_initial_state=None):
        """The platform ``method``: the projections' vendor GEMMs (``dualop.ops._mixer``) around the
        kernel ops (each dispatches to its own kernel; decode, T == B, takes their step kernels)."""
        xp = array_namespace(hidden_states)
        conv_op, scan_op = self._kernel_ops()
        i, tokens = self.intermediate_size, hidden_states.shape[0]
        projected = project(self.in_proj, method, hidden_states, in_proj_weight)
        gate, x = projected[:, :i], projected[:, i:]
        if conv_weight.dtype != x.dtype:  # the conv kernels take x's dtype (as the projections cast theirs)
            conv_weight = xp.astype(conv_weight, x.dtype)
        x, new_conv = conv_op(x, conv_weight, None, conv_state, cu_seqlens, state_indices, has_initial_state)
        b, c, dt = self._ssm_parameters(xp, method, x, bcdt_proj_weight, dt_proj_weight, dt_norm_weight,
                                        B_norm_weight, C_norm_weight)
        a = -xp.exp(xp.astype(A_log, xp.float32))
        y, new_ssm = scan_op(self._heads(x), dt, a, b[:, None, :], c[:, None, :], D, self._heads(gate), dt_bias,
                             ssm_state, cu_seqlens, state_indices, has_initial_state)
        return project(self.out_proj, method, y.reshape(tokens, i), out_proj_weight), new_conv, new_ssm

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"ssm_state_size={self.ssm_state_size}, conv_kernel_size={self.conv_kernel_size}, "
                f"time_step_rank={self.time_step_rank}, chunk_size={self.chunk_size}")


# The widths of the check cases' shapes ``(tokens, sequences, hidden, heads, head_dim, state, rank)``
# (conv kernel 4): a single token, packed prefill, a decode step (one token per sequence).
CHECK_SHAPES = ((1, 1, 16, 2, 8, 4, 8), (9, 3, 24, 3, 8, 8, 8), (16, 16, 32, 4, 8, 8, 16), (37, 4, 40, 4, 16, 16, 8))
# The cells' shapes (every cell interprets the conv and SSD kernels per shape): one token, a packed
# prefill across a chunk boundary (chunk 8), a decode step; tests/ops/test_plamo2.py runs all of the above.
CHECK_CASE_SHAPES = (CHECK_SHAPES[0], CHECK_SHAPES[1], (6, 6, 32, 4, 8, 8, 16))


def check_case_inputs(shape: tuple[int, ...], rng: Any) -> tuple:
    """One packed batch for ``shape`` (see ``CHECK_SHAPES``): sequences of random lengths in shuffled
    slots of caches with one spare slot (random contents), one sequence continuing from its cached
    state, and (with two or more) one padding sequence. Weights at PLaMo 2-like scales."""
    import numpy as np

    from dualop.testing import Pinned, normal

    tokens, seqs, hidden, heads, head_dim, state, rank = shape
    inner, kernel = heads * head_dim, 4
    cuts = np.sort(rng.choice(np.arange(1, tokens), seqs - 1, replace=False)) if seqs > 1 else []
    cu = np.array([0, *cuts, tokens], np.int32)
    slots = rng.permutation(seqs + 1)[:seqs].astype(np.int32)
    if seqs > 1:
        slots[rng.integers(seqs)] = -1
    init = np.zeros(seqs, bool)
    init[rng.integers(seqs)] = True
    return (
        normal((tokens, hidden), rng), normal((2 * inner, hidden), rng, hidden ** -0.5),
        normal((inner, kernel), rng, 0.5), normal((2 * state + rank, inner), rng, inner ** -0.5),
        normal((heads, rank), rng, rank ** -0.5), normal((heads,), rng, 0.5) - 1.0,
        np.log(np.arange(1, heads + 1, dtype=np.float32)) + 0.1 * normal((heads,), rng),
        1 + 0.1 * normal((heads,), rng), 1 + 0.2 * normal((rank,), rng), 1 + 0.2 * normal((state,), rng),
        1 + 0.2 * normal((state,), rng), normal((hidden, inner), rng, inner ** -0.5),
        normal((seqs + 1, inner, kernel - 1), rng), normal((seqs + 1, heads, head_dim, state), rng, 0.5),
        Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(init, "bool"),
    )


def check_cases():
    """Small packed batches of ``CHECK_CASE_SHAPES`` (``check_case_inputs``)."""
    from dualop.testing import OpCase

    def make_op(shape):
        _, _, hidden, heads, head_dim, state, rank = shape
        return Plamo2MambaMixer(hidden, state, 4, heads, head_dim, time_step_rank=rank, chunk_size=8)

    return [OpCase(_OP, _OP, make_op, check_case_inputs, CHECK_CASE_SHAPES)]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- plamo2_mamba_mixer: PLaMo 2's Mamba mixer over packed sequences ---------------------
# The bench size (tokens, hidden) runs ``tokens`` packed into eight equal sequences (fewer tokens:
# one token each, a decode step), each in its own slot of the two state caches: ``1024x4096`` is the
# issue's prefill of eight sequences. (One case only: each case costs ~50 s of jit compiles in
# tests/infra/test_bench.py's agreement sweep; one-sequence prefill and the 64-sequence decode are the
# same case with ``_plamo2_shape(lambda tokens: 1)`` / ``(lambda tokens: tokens)``.) Widths from
# hidden as PLaMo 2-8B's (hidden 4096: 64 heads of 128, d_state 64, conv 4, time-step rank 256):
# ``hidden // 64`` heads of 128, d_state 64, rank ``max(64, hidden // 16)``. The sequences start
# from zeros (``has_initial_state`` False: repeated calls then compute the same thing; a step from
# a cached state costs the same). Peers: transformers' own Mamba-2 functions in PLaMo 2's wiring
# (``causal_conv1d_fn``/``_update`` and ``mamba2_chunk_scan``/``mamba2_selective_state_update``,
# their torch fallbacks; PLaMo 2 itself is not in transformers) and a hand-written jax version
# (``vmap`` over the sequences of a ``lax.scan`` over their tokens). Not run by default; ask with
# ``--ops plamo2_mamba_mixer --sizes 1024x4096``.
PLAMO2_HEAD_DIM, PLAMO2_STATE, PLAMO2_CONV = 128, 64, 4


def _plamo2_widths(hidden: int) -> tuple[int, int, int]:
    """(heads, head_dim, rank) for a hidden size, as PLaMo 2-8B's."""
    return max(1, hidden // 64), PLAMO2_HEAD_DIM, max(64, hidden // 16)


def _plamo2(hidden: int):
    from dualop.ops import Plamo2MambaMixer

    heads, head_dim, rank = _plamo2_widths(hidden)
    return Plamo2MambaMixer(hidden, PLAMO2_STATE, PLAMO2_CONV, heads, head_dim, time_step_rank=rank)


def _plamo2_shape(seqs_of: Callable[[int], int]):
    def shape_of(size: tuple[int, ...]) -> tuple[int, ...]:
        tokens, hidden = size
        return (tokens, seqs_of(tokens), hidden)

    return shape_of


def _plamo2_inputs(shape, rng):
    tokens, seqs, hidden = shape
    heads, head_dim, rank = _plamo2_widths(hidden)
    inner, n = heads * head_dim, PLAMO2_STATE
    return (
        _normal((tokens, hidden), rng), _normal((2 * inner, hidden), rng, hidden ** -0.5),
        _normal((inner, PLAMO2_CONV), rng, 0.5), _normal((2 * n + rank, inner), rng, inner ** -0.5),
        _normal((heads, rank), rng, rank ** -0.5), _normal((heads,), rng, 0.5) - 1.0,
        np.log(np.arange(1, heads + 1, dtype=np.float32)), 1.0 + _normal((heads,), rng, 0.1),
        1.0 + _normal((rank,), rng, 0.2), 1.0 + _normal((n,), rng, 0.2), 1.0 + _normal((n,), rng, 0.2),
        _normal((hidden, inner), rng, inner ** -0.5),
        np.zeros((seqs, inner, PLAMO2_CONV - 1), np.float32), np.zeros((seqs, heads, head_dim, n), np.float32),
        *fresh_equal_sequences(tokens, seqs),
    )


def _plamo2_cost(op, shape, itemsize) -> KernelCost:
    tokens, seqs, hidden = shape
    return cost_model.plamo2_mamba_mixer_cost(tokens, seqs, hidden, op.num_heads, op.head_dim, op.ssm_state_size,
                                              op.time_step_rank, op.conv_kernel_size, itemsize)


def _torch_transformers_plamo2(op):
    """The mixer from transformers' Mamba-2 functions (equal-length sequences; a decode step when
    each has one token), called with the op's arguments; caches updated in place. The functions
    get float32 operands and their results are rounded where the op rounds (after the conv, the
    norms, each matmul and the gated scan), so 16-bit runs compare too."""
    import torch
    import torch.nn.functional as F
    from transformers.models.mamba2 import modeling_mamba2 as m2

    heads, head_dim, n, eps, inner = op.num_heads, op.head_dim, op.ssm_state_size, op.rms_norm_eps, op.intermediate_size

    def mixer(h, w_in, w_conv, w_bcdt, w_dt, dt_bias, a_log, d, w_dtn, w_bn, w_cn, w_out, conv_cache, ssm_cache,
              cu_seqlens, state_indices, has_initial_state):
        dtype, f32 = h.dtype, torch.float32
        batch = state_indices.shape[0]
        length = h.shape[0] // batch
        slots = state_indices.long()
        keep = has_initial_state[:, None, None]
        conv = torch.where(keep, conv_cache[slots], 0).float()
        ssm = torch.where(keep[..., None], ssm_cache[slots], 0).float()
        proj = F.linear(h, w_in).reshape(batch, length, 2 * inner)
        gate, x = proj[..., :inner].float(), proj[..., inner:].float()
        if length == 1:
            xc = m2.causal_conv1d_update(x.transpose(1, 2), conv, w_conv.float(), None, activation="silu")
        else:
            full = torch.cat([conv, x.transpose(1, 2)], dim=2)
            xc = m2.causal_conv1d_fn(full, w_conv.float(), None, activation="silu")[:, :, -length:]
            conv = full[:, :, -(w_conv.shape[1] - 1):]
        xc = xc.transpose(1, 2).to(dtype)
        bcdt = F.linear(xc, w_bcdt)

        def norm(v, w):
            return (F.rms_norm(v.float(), (v.shape[-1],), None, eps).to(dtype).float() * w.float()).to(dtype)

        bv, cv = norm(bcdt[..., :n], w_bn).float(), norm(bcdt[..., n:2 * n], w_cn).float()
        dt = F.linear(norm(bcdt[..., 2 * n:], w_dtn), w_dt).float()
        a, xf = -torch.exp(a_log.float()), xc.float()
        if length == 1:
            y = m2.mamba2_selective_state_update(
                ssm, xf[:, 0].reshape(batch, heads, head_dim), dt[:, 0, :, None].expand(-1, -1, head_dim),
                a[:, None, None].expand(-1, head_dim, n), bv[:, 0, None], cv[:, 0, None],
                D=d.float()[:, None].expand(-1, head_dim), dt_bias=dt_bias.float()[:, None].expand(-1, head_dim),
                dt_softplus=True, z=gate[:, 0].reshape(batch, heads, head_dim))
        else:
            y, ssm = m2.mamba2_chunk_scan(
                xf.reshape(batch, length, heads, head_dim), dt, a, bv[:, :, None], cv[:, :, None],
                chunk_size=op.chunk_size, D=d.float(), dt_bias=dt_bias.float(), initial_states=ssm, dt_softplus=True,
                return_final_states=True)
            y = y.reshape(batch, length, inner) * F.silu(gate)
        conv_cache[slots] = conv.to(conv_cache.dtype)
        ssm_cache[slots] = ssm.to(ssm_cache.dtype)
        return F.linear(y.reshape(h.shape[0], inner).to(dtype), w_out), conv_cache, ssm_cache

    return mixer


def _jax_plamo2(op):
    """Hand-written jax: equal-length sequences, ``vmap`` over them of a ``lax.scan`` over tokens."""
    import jax
    import jax.numpy as jnp

    heads, head_dim, n, eps, inner = op.num_heads, op.head_dim, op.ssm_state_size, op.rms_norm_eps, op.intermediate_size
    f32 = jnp.float32

    def mixer(h, w_in, w_conv, w_bcdt, w_dt, dt_bias, a_log, d, w_dtn, w_bn, w_cn, w_out, conv_cache, ssm_cache,
              cu_seqlens, state_indices, has_initial_state):
        dtype, tokens = h.dtype, h.shape[0]
        batch = state_indices.shape[0]
        length, width = tokens // batch, w_conv.shape[1]

        def mm(v, w):
            return jnp.dot(v, w.T.astype(v.dtype), preferred_element_type=f32).astype(dtype)

        def rms(v, w):
            vf = v.astype(f32)
            normed = (vf * jax.lax.rsqrt(jnp.mean(vf * vf, axis=-1, keepdims=True) + eps)).astype(dtype)
            return (normed.astype(f32) * w.astype(f32)).astype(dtype)

        proj = mm(h, w_in)
        gate, x = proj[:, :inner], proj[:, inner:]
        conv0 = jnp.where(has_initial_state[:, None, None], conv_cache[state_indices], 0).astype(f32)
        ssm0 = jnp.where(has_initial_state[:, None, None, None], ssm_cache[state_indices], 0).astype(f32)
        full = jnp.concatenate([conv0.transpose(0, 2, 1), x.reshape(batch, length, inner).astype(f32)], axis=1)
        xc = sum(full[:, k:k + length] * w_conv[:, k].astype(f32) for k in range(width))
        xc = jax.nn.silu(xc).astype(dtype).reshape(tokens, inner)
        bcdt = mm(xc, w_bcdt)
        bv, cv = rms(bcdt[:, :n], w_bn).astype(f32), rms(bcdt[:, n:2 * n], w_cn).astype(f32)
        delta = jax.nn.softplus(mm(rms(bcdt[:, 2 * n:], w_dtn), w_dt).astype(f32) + dt_bias.astype(f32))
        a = -jnp.exp(a_log.astype(f32))
        xh = xc.astype(f32).reshape(batch, length, heads, head_dim)

        def sequence(state, xs, ds, bs, cs):
            def step(s, inputs):
                x_t, d_t, b_t, c_t = inputs
                s = jnp.exp(d_t * a)[:, None, None] * s + (d_t[:, None] * x_t)[:, :, None] * b_t
                return s, jnp.einsum("hpn,n->hp", s, c_t)

            return jax.lax.scan(step, state, (xs, ds, bs, cs))

        final, ys = jax.vmap(sequence)(ssm0, xh, delta.reshape(batch, length, heads), bv.reshape(batch, length, n),
                                       cv.reshape(batch, length, n))
        gf = gate.astype(f32).reshape(batch, length, heads, head_dim)
        y = (ys + d.astype(f32)[:, None] * xh) * jax.nn.silu(gf)
        out = mm(y.reshape(tokens, inner).astype(dtype), w_out)
        last_inputs = full[:, -(width - 1):].transpose(0, 2, 1)
        conv_cache = conv_cache.at[state_indices].set(last_inputs.astype(conv_cache.dtype))
        ssm_cache = ssm_cache.at[state_indices].set(final.astype(ssm_cache.dtype))
        return out, conv_cache, ssm_cache

    return mixer


_PLAMO2_SLOTS, _PLAMO2_CONV = 256, 4


def _plamo2_mamba_mixer_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, hidden, heads, head_dim, state, rank = shape
    inner = heads * head_dim
    weights = ((2 * inner, hidden), (inner, _PLAMO2_CONV), (2 * state + rank, inner), (heads, rank), (heads,),
               (heads,), (heads,), (rank,), (state,), (state,), (hidden, inner))
    return (InputSpec((tokens, hidden), None), *(InputSpec(w, None) for w in weights),
            InputSpec((_PLAMO2_SLOTS, inner, _PLAMO2_CONV - 1), None),
            InputSpec((_PLAMO2_SLOTS, heads, head_dim, state), None), InputSpec((seqs + 1,), "int32"),
            InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"))


def _plamo2_mamba_mixer_op(shape: tuple[int, ...]):
    from dualop.ops import Plamo2MambaMixer

    _, _, hidden, heads, head_dim, state, rank = shape
    return Plamo2MambaMixer(hidden, state, _PLAMO2_CONV, heads, head_dim, time_step_rank=rank, chunk_size=256)


def bench_cases():
    """Not run by default: against transformers' PLaMo 2 mixer math (torch) and a hand-written jax mixer."""
    return [BenchCase("plamo2_mamba_mixer[prefill_8seq]", "plamo2_mamba_mixer", _plamo2, _plamo2_inputs, _plamo2_cost,
                      _torch_transformers_plamo2, _jax_plamo2, default=False,
                      shape_of=_plamo2_shape(lambda tokens: min(8, tokens)), matrix=True)]


def serving():
    """(tokens, sequences, hidden, heads, head_dim, state, time-step rank), the check cases' layout
    (so the case's make_op builds the serving op too, with the SSD chunk of 256): PLaMo 2-8B-like
    widths (hidden 4096, 64 Mamba heads of 128, d_state 64, conv 4, rank max(64, 4096 // 16) = 256);
    a 1024-token prefill of one and of eight sequences and a 64-sequence decode step, over a
    256-slot state cache; bfloat16 only, as the other mixers."""
    shapes = tuple((tokens, seqs, 4096, 64, 128, 64, 256) for tokens, seqs in ((1024, 1), (1024, 8), (64, 64)))
    return {"plamo2_mamba_mixer": Serving(shapes, _plamo2_mamba_mixer_inputs,
                                          {"plamo2_mamba_mixer": _plamo2_mamba_mixer_op}, ("bfloat16",))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"plamo2_mamba_mixer": {"traits": {"structured_inputs", "widens_nonfinite", "packed_sequences", "mixer"}}}
