"""The Mamba-1 mixer (Mamba, Jamba, Falcon-Mamba): ``MambaMixer`` (registered ``mamba_mixer``),
the reference engine's ``MambaMixer`` math with its weights as explicit arguments and its two state
caches as the serving batch of ``dualop.ops.ssm_batch`` describes.

``op = MambaMixer(hidden_size, ssm_state_size, conv_kernel_size, intermediate_size, time_step_rank,
use_conv_bias=True, use_bias=False, use_rms_norm=False, rms_norm_eps=1e-6, activation="silu")``;
``out, conv_state, ssm_state = op(hidden_states [T, Hd], in_proj_weight [2I, Hd], conv_weight [I, K],
conv_bias [I] | None, x_proj_weight [R + 2N, I], dt_proj_weight [I, R], dt_proj_bias [I], A_log [I, N],
D [I], out_proj_weight [Hd, I], in_proj_bias=None, out_proj_bias=None, dt_norm_weight=None,
b_norm_weight=None, c_norm_weight=None, conv_state=None [S, I, K - 1], ssm_state=None [S, I, N],
cu_seqlens=None, state_indices=None, has_initial_state=None)``.

The math, per packed token (the sequences of ``cu_seqlens`` never mix):

1. ``x, z = in_proj(h)`` (the first I rows of ``in_proj_weight`` give x, the next I the gate z);
2. ``x = act(causal_conv1d(x))`` over each sequence, continuing from its ``conv_state`` slot;
3. ``dt, B, C = x_proj(x)`` split ``[R, N, N]``; with ``use_rms_norm`` each is RMS-normalised over
   its last dim (Jamba: times ``dt/b/c_norm_weight``; Falcon-Mamba: no weights, pass None);
4. ``dt = dt_proj_weight @ dt`` (the bias is not added here: the scan adds ``dt_proj_bias`` and
   takes the softplus, as the engine's ``delta_softplus``);
5. ``y = selective_scan(x, dt, A = -exp(A_log), B, C, D, z)`` continuing from its ``ssm_state``
   slot (``y ⊙ silu(z)`` inside);
6. ``out = out_proj(y)``.

Rounding (``forward_native``): every matmul multiplies float32 operands at full precision and
rounds its result once to ``hidden_states``' dtype, as a vendor GEMM with float32 accumulation
does (in_proj, x_proj, dt_proj, out_proj); the conv and the scan compute in float32 and round their
outputs once to that dtype (``dualop.kernels.ssm_math``); the norms follow the engine's RMSNorm
(``norm_math``: normalised in float32, rounded, then times the weight). So in float32 nothing
rounds between steps, and in bfloat16 the steps round where the engine's do. A padding sequence
(slot -1) gives zero outputs (``out_proj_bias`` included) and writes neither state.

The platform methods (``forward_cpu``/``forward_cuda``/``forward_tpu``, one body) run the
projections with the linear op's vendor GEMM (``dualop.ops._mixer``) and call the kernel ops
``CausalConv1d`` (``dualop.ops.causal_conv1d``) and ``SelectiveScan`` (``dualop.ops.selective_scan``),
which dispatch to their own kernels; the conv's weight and the projections' biases go to the
kernels in the tokens' dtype. Every argument, both caches included, is checked before either
cache is written (``check_inputs``, ``ssm_batch``): a refused call leaves both as they were.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.norm_math import NormSpec, rms_normalize
from dualop.ops._checks import check_array, check_optional_like, check_positive_int
from dualop.ops._mixer import MixerPlatformMethods, check_not_engine_mixer_call, mixer_batches, project, projection
from dualop.ops.causal_conv1d import CausalConv1d
from dualop.ops.selective_scan import SelectiveScan
from dualop.ops.ssm_batch import SSMBatch
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["MambaMixer"]

_OP = "mamba_mixer"


def _as_dtype(xp, a: Any, dtype: Any) -> Any:
    """``a`` in ``dtype`` (None stays None)."""
    return a if a is None or a.dtype == dtype else xp.astype(a, dtype)


@CustomOp.register(_OP)
class MambaMixer(MixerPlatformMethods, CustomOp):
    """The Mamba-1 mixer over packed sequences with conv and SSM state caches (see the module
    docstring for the call, the math and where it rounds)."""

    # torch updates the given caches in place (torch.library declares them; backends/torch/library.py)
    mutates_args: ClassVar[tuple[str, ...]] = ("conv_state", "ssm_state")
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "conv_state", "ssm_state")

    def __init__(
        self,
        hidden_size: int,
        ssm_state_size: int,
        conv_kernel_size: int,
        intermediate_size: int,
        time_step_rank: int,
        use_conv_bias: bool = True,
        use_bias: bool = False,
        use_rms_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        activation: str | None = "silu",
        *,
        enforce_enable: bool = False,
    ) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.hidden_size = check_positive_int(_OP, "hidden_size", hidden_size)
        self.ssm_state_size = check_positive_int(_OP, "ssm_state_size", ssm_state_size)
        self.conv_kernel_size = check_positive_int(_OP, "conv_kernel_size", conv_kernel_size)
        self.intermediate_size = check_positive_int(_OP, "intermediate_size", intermediate_size)
        self.time_step_rank = check_positive_int(_OP, "time_step_rank", time_step_rank)
        if activation not in ("silu", None):
            raise ValueError(f"{_OP}: activation must be 'silu' or None, got {activation!r}")
        if isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, (int, float)) or not rms_norm_eps >= 0:
            raise ValueError(f"{_OP}: rms_norm_eps must be a non-negative float, got {rms_norm_eps!r}")
        self.use_conv_bias, self.use_bias, self.use_rms_norm = bool(use_conv_bias), bool(use_bias), bool(use_rms_norm)
        self.rms_norm_eps = float(rms_norm_eps)
        self.activation = activation
        self.norm_spec = NormSpec(eps=self.rms_norm_eps)
        self._kernel_op_instances: tuple[Any, Any] | None = None
        i, h, r, n = self.intermediate_size, self.hidden_size, self.time_step_rank, self.ssm_state_size
        # the projections (dualop.ops._mixer); dt_proj's bias is added inside the scan
        self.in_proj = projection(h, 2 * i, bias=self.use_bias)
        self.x_proj = projection(i, r + 2 * n)
        self.dt_proj = projection(r, i)
        self.out_proj = projection(i, h, bias=self.use_bias)

    # -- shapes and checks ---------------------------------------------------------------------------

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One slot of the conv cache: the last ``K - 1`` conv inputs of each channel."""
        return (self.intermediate_size, self.conv_kernel_size - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int]:
        """One slot of the SSM cache: ``[I, N]``."""
        return (self.intermediate_size, self.ssm_state_size)

    def _weight_shapes(self) -> dict[str, tuple[int, ...]]:
        i, h, k, r, n = (self.intermediate_size, self.hidden_size, self.conv_kernel_size, self.time_step_rank,
                         self.ssm_state_size)
        return {
            "in_proj_weight": (2 * i, h), "conv_weight": (i, k), "x_proj_weight": (r + 2 * n, i),
            "dt_proj_weight": (i, r), "dt_proj_bias": (i,), "A_log": (i, n), "D": (i,), "out_proj_weight": (h, i),
        }

    def _batches(self, hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                 has_initial_state) -> tuple[SSMBatch, SSMBatch]:
        """Both caches validated against the layer and against each other: one serving batch."""
        return mixer_batches(_OP, hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                             has_initial_state, self.conv_state_shape, self.ssm_state_shape)

    def check_inputs(self, hidden_states: Any, in_proj_weight: Any = None, conv_weight: Any = None,
                     conv_bias: Any = None, x_proj_weight: Any = None, dt_proj_weight: Any = None,
                     dt_proj_bias: Any = None, A_log: Any = None, D: Any = None,
                     out_proj_weight: Any = None, in_proj_bias: Any = None, out_proj_bias: Any = None,
                     dt_norm_weight: Any = None, b_norm_weight: Any = None, c_norm_weight: Any = None,
                     conv_state: Any = None, ssm_state: Any = None, cu_seqlens: Any = None,
                     state_indices: Any = None, has_initial_state: Any = None) -> None:
        fe = check_array(_OP, "hidden_states", hidden_states, min_ndim=2)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{_OP}: argument 'hidden_states' has shape {tuple(hidden_states.shape)}; expected "
                             f"[tokens, hidden_size={self.hidden_size}]")
        shapes = self._weight_shapes()
        check_not_engine_mixer_call(_OP, "MambaMixer", hidden_states, in_proj_weight, shapes["in_proj_weight"])
        given = {"in_proj_weight": in_proj_weight, "conv_weight": conv_weight, "x_proj_weight": x_proj_weight,
                 "dt_proj_weight": dt_proj_weight, "dt_proj_bias": dt_proj_bias, "A_log": A_log, "D": D,
                 "out_proj_weight": out_proj_weight}
        for name, shape in shapes.items():
            if given[name] is None:
                raise ValueError(f"{_OP}: argument '{name}' is required (shape {shape})")
            check_optional_like(_OP, name, given[name], "hidden_states", hidden_states, fe, shape=shape)
        i, h, n, r = self.intermediate_size, self.hidden_size, self.ssm_state_size, self.time_step_rank
        optional = (
            ("conv_bias", conv_bias, (i,), self.use_conv_bias, "use_conv_bias"),
            ("in_proj_bias", in_proj_bias, (2 * i,), self.use_bias, "use_bias"),
            ("out_proj_bias", out_proj_bias, (h,), self.use_bias, "use_bias"),
        )
        for name, value, shape, wanted, flag in optional:
            if wanted and value is None:
                raise ValueError(f"{_OP}: argument '{name}' is required (shape {shape}) for an op built with {flag}=True")
            if not wanted and value is not None:
                raise ValueError(f"{_OP}: argument '{name}' must be None for an op built with {flag}=False")
            check_optional_like(_OP, name, value, "hidden_states", hidden_states, fe, shape=shape)
        norms = {"dt_norm_weight": (dt_norm_weight, (r,)), "b_norm_weight": (b_norm_weight, (n,)),
                 "c_norm_weight": (c_norm_weight, (n,))}
        present = [name for name, (value, _) in norms.items() if value is not None]
        if present and not self.use_rms_norm:
            raise ValueError(f"{_OP}: argument '{present[0]}' must be None for an op built with use_rms_norm=False")
        if present and len(present) != len(norms):
            missing = next(name for name in norms if name not in present)
            raise ValueError(f"{_OP}: argument '{missing}' is None but '{present[0]}' is given; pass the three "
                             f"norm weights together (Jamba) or none (Falcon-Mamba's weightless norms)")
        for name, (value, shape) in norms.items():
            check_optional_like(_OP, name, value, "hidden_states", hidden_states, fe, shape=shape)
        self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state)
        for name, cache in (("conv_state", conv_state), ("ssm_state", ssm_state)):
            if cache is not None:  # the same device as the tokens (the shape was checked above)
                check_optional_like(_OP, name, cache, "hidden_states", hidden_states, fe, shape=tuple(cache.shape))

    # -- the shared steps ----------------------------------------------------------------------------

    def _norm(self, xp, v: Any, weight: Any) -> Any:
        return rms_normalize(xp, xp.astype(v, xp.float32), weight, self.norm_spec, v.dtype)

    def _dt_b_c(self, xp, method, x, x_proj_weight, dt_proj_weight, dt_norm_weight, b_norm_weight, c_norm_weight):
        """Steps 3 and 4: ``x_proj``, the split, the optional norms, ``dt_proj`` (no bias)."""
        r, n = self.time_step_rank, self.ssm_state_size
        dbc = project(self.x_proj, method, x, x_proj_weight)
        dt, b, c = dbc[:, :r], dbc[:, r:r + n], dbc[:, r + n:]
        if self.use_rms_norm:
            dt = self._norm(xp, dt, dt_norm_weight)
            b = self._norm(xp, b, b_norm_weight)
            c = self._norm(xp, c, c_norm_weight)
        return project(self.dt_proj, method, dt, dt_proj_weight), b, c

    @staticmethod
    def _zero_padding_tokens(xp, out: Any, batch: SSMBatch) -> Any:
        """Tokens of padding sequences (and tokens no sequence owns) give zeros (only
        ``out_proj_bias`` could make them nonzero)."""
        seq = ssm_math.sequence_layout(xp, batch.cu_seqlens, batch.num_tokens)[0]
        keep = ssm_math.token_keep(xp, batch.state_indices, seq)
        return xp.where(keep[:, None], out, 0.0)

    # -- the native body -----------------------------------------------------------------------------

    def forward_native(self, hidden_states: Any, in_proj_weight: Any, conv_weight: Any, conv_bias: Any | None,
                       x_proj_weight: Any, dt_proj_weight: Any, dt_proj_bias: Any, A_log: Any, D: Any,
                       out_proj_weight: Any, in_proj_bias: Any = None, out_proj_bias: Any = None,
                       dt_norm_weight: Any = None, b_norm_weight: Any = None, c_norm_weight: Any = None,
                       conv_state: Any = None, ssm_state: Any = None, cu_seqlens: Any = None,
                       state_indices: Any = None, has_initial_state: Any = None) -> tuple[Any, Any, Any]:
        """The references of ``dualop.kernels.ssm_math`` composed with float32 matmuls (nothing of
        dualop's kernels runs: see the module docstring for where it rounds)."""
        xp = array_namespace(hidden_states)
        conv_b, ssm_b = self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                                      has_initial_state)
        i = self.intermediate_size
        xz = project(self.in_proj, "forward_native", hidden_states, in_proj_weight, in_proj_bias)
        x, z = xz[:, :i], xz[:, i:]
        x, new_conv = ssm_math.causal_conv1d_reference(
            xp, x, conv_weight, conv_bias, conv_b.state, conv_b.cu_seqlens, conv_b.state_indices,
            conv_b.has_initial_state, self.activation)
        dt, b, c = self._dt_b_c(xp, "forward_native", x, x_proj_weight, dt_proj_weight, dt_norm_weight,
                                b_norm_weight, c_norm_weight)
        a = -xp.exp(xp.astype(A_log, xp.float32))
        y, new_ssm = ssm_math.selective_scan_reference(
            xp, x, dt, a, b, c, D, z, dt_proj_bias, ssm_b.state, ssm_b.cu_seqlens, ssm_b.state_indices,
            ssm_b.has_initial_state, delta_softplus=True)
        out = project(self.out_proj, "forward_native", y, out_proj_weight, out_proj_bias)
        if out_proj_bias is not None:
            out = self._zero_padding_tokens(xp, out, ssm_b)
        return out, new_conv, new_ssm

    # -- the platform body ---------------------------------------------------------------------------

    def _kernel_ops(self) -> tuple[Any, Any]:
        """This mixer's ``CausalConv1d`` and ``SelectiveScan`` instances (made on first use)."""
        if self._kernel_op_instances is None:
            conv = CausalConv1d(self.intermediate_size, self.conv_kernel_size, activation=self.activation,
                                enforce_enable=self.enforce_enable)
            scan = SelectiveScan(self.intermediate_size, self.ssm_state_size, delta_softplus=True,
                                 enforce_enable=self.enforce_enable)
            self._kernel_op_instances = (conv, scan)
        return self._kernel_op_instances

    def _forward_kernels(self, method, hidden_states, in_proj_weight, conv_weight, conv_bias, x_proj_weight, dt_proj_weight,
                         dt_proj_bias, A_log, D, out_proj_weight, in_proj_bias=None, out_proj_bias=None,
                         dt_norm_weight=None, b_norm_weight=None, c_norm_weight=None, conv_state=None, ssm_state=None,
                         cu_seqlens=None, state_indices=None, has_initial_state=None):
        """The platform ``method``: the projections' vendor GEMMs (``dualop.ops._mixer``) around the
        kernel ops (each dispatches to its own kernel; decode, T == B, takes their step kernels)."""
        xp = array_namespace(hidden_states)
        conv_op, scan_op = self._kernel_ops()
        i = self.intermediate_size
        # the kernels take operands of the tokens' dtype (a weight of another is cast, as the
        # projections' are): every argument checked passes them, before any cache is written
        in_proj_bias, out_proj_bias, conv_weight, conv_bias = (
            _as_dtype(xp, a, hidden_states.dtype) for a in (in_proj_bias, out_proj_bias, conv_weight, conv_bias))
        xz = project(self.in_proj, method, hidden_states, in_proj_weight, in_proj_bias)
        x, z = xz[:, :i], xz[:, i:]
        x, new_conv = conv_op(x, conv_weight, conv_bias, conv_state, cu_seqlens, state_indices, has_initial_state)
        dt, b, c = self._dt_b_c(xp, method, x, x_proj_weight, dt_proj_weight, dt_norm_weight, b_norm_weight,
                                c_norm_weight)
        a = -xp.exp(xp.astype(A_log, xp.float32))
        y, new_ssm = scan_op(x, dt, a, b, c, D, z, dt_proj_bias, ssm_state, cu_seqlens, state_indices,
                             has_initial_state)
        out = project(self.out_proj, method, y, out_proj_weight, out_proj_bias)
        if out_proj_bias is not None:
            _, ssm_b = self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                                     has_initial_state)
            out = self._zero_padding_tokens(xp, out, ssm_b)
        return out, new_conv, new_ssm

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"ssm_state_size={self.ssm_state_size}, conv_kernel_size={self.conv_kernel_size}, "
                f"time_step_rank={self.time_step_rank}, use_rms_norm={self.use_rms_norm}")


# The widths of the check cases' shapes ``(tokens, sequences, hidden, intermediate, state)``: the
# conv kernel is 4 and the time-step rank ceil(hidden / 16), as Mamba's configs derive it. Few
# tokens: every cell interprets the two kernels per shape (long prefills that cross the kernels'
# token blocks are tests/ops/test_selective_scan.py's and tests/ops/test_causal_conv1d.py's).
CHECK_SHAPES = ((1, 1, 16, 32, 4), (9, 3, 24, 40, 8), (6, 6, 40, 72, 16))


def check_cases():
    """Small packed batches: sequences of random lengths in shuffled slots of caches with one spare
    slot (random contents), one sequence continuing from its cached state, and (with two or more)
    one padding sequence; ``(6, 6, ...)`` is a decode step (one token per sequence). Variants:
    Mamba (conv bias), Jamba (dt/B/C norm weights), Falcon-Mamba (weightless norms) with the
    projections' biases."""
    import numpy as np

    from dualop.testing import OpCase, Pinned, normal

    def make_op(variant):
        def make(shape):
            _, _, hidden, inner, state = shape
            return MambaMixer(hidden, state, 4, inner, -(-hidden // 16), use_bias=variant == "falcon",
                              use_rms_norm=variant != "mamba")

        return make

    def make_inputs(variant):
        def make(shape, rng):
            tokens, seqs, hidden, inner, state = shape
            rank, kernel = -(-hidden // 16), 4
            cuts = np.sort(rng.choice(np.arange(1, tokens), seqs - 1, replace=False)) if seqs > 1 else []
            cu = np.array([0, *cuts, tokens], np.int32)
            slots = rng.permutation(seqs + 1)[:seqs].astype(np.int32)
            if seqs > 1:
                slots[rng.integers(seqs)] = -1
            init = np.zeros(seqs, bool)
            init[rng.integers(seqs)] = True
            a_log = np.log(np.broadcast_to(np.arange(1, state + 1, dtype=np.float32), (inner, state))).copy()
            norms = ((1 + 0.2 * normal((rank,), rng), 1 + 0.2 * normal((state,), rng), 1 + 0.2 * normal((state,), rng))
                     if variant == "jamba" else (None, None, None))
            bias = variant == "falcon"
            return (
                normal((tokens, hidden), rng), normal((2 * inner, hidden), rng, hidden ** -0.5),
                normal((inner, kernel), rng, 0.5), normal((inner,), rng, 0.1),
                normal((rank + 2 * state, inner), rng, inner ** -0.5), normal((inner, rank), rng, rank ** -0.5),
                normal((inner,), rng, 0.5) - 1.0, a_log + 0.1 * normal((inner, state), rng), 1 + 0.1 * normal((inner,), rng),
                normal((hidden, inner), rng, inner ** -0.5),
                normal((2 * inner,), rng, 0.1) if bias else None, normal((hidden,), rng, 0.1) if bias else None,
                *norms,
                normal((seqs + 1, inner, kernel - 1), rng), normal((seqs + 1, inner, state), rng, 0.5),
                Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(init, "bool"),
            )

        return make

    # The variants change the mixer's own math around the kernels (norms, biases), which a packed
    # prefill exercises; the one-token and decode batches, which pick the kernels' other paths,
    # run once (every cell interprets the conv and scan kernels per shape).
    prefill = tuple(s for s in CHECK_SHAPES if s[0] > s[1] > 1)
    return [OpCase(_OP, f"{_OP}{label}", make_op(variant), make_inputs(variant), shapes)
            for variant, label, shapes in (("mamba", "", CHECK_SHAPES), ("jamba", "[jamba]", prefill),
                                           ("falcon", "[falcon_mamba,bias]", prefill))]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- mamba_mixer, the Mamba-1 mixer at the mixer level -----------------------------------
# A Mamba layer of hidden H (I = 2H, N 16, K 4, R = ceil(H / 16), conv bias, no norms) over packed
# sequences with caches of one slot per sequence: ``--sizes 1024x1024`` is a prefill of 1024 tokens
# (one sequence, or eight of 128: the [prefill_8seq] case), ``64x1024`` with the [decode] case a step of
# 64 one-token sequences. Every sequence starts from zeros (the caches are updated in place, so a call
# that read them would not repeat itself); each call writes both states. Peers (returning the output
# and the final states): transformers' MambaMixer (torch; the equal-length sequences as one batch) and
# a hand-written jax lax.scan rounding where the native body does. In 16-bit dtypes transformers rounds
# at other points (the SSM state to the input dtype before its product with C, the D skip in the input
# dtype), so the bench's correctness check reports it outside the bfloat16 tolerance (an error record,
# not timed; tests/infra/test_bench.py expects exactly those): a 16-bit comparison with it is by hand.
_MAMBA_SEQS = {"prefill": 1, "prefill_8seq": 8, "decode": 0}  # 0: one token per sequence


def _mamba_shape(kind: str):
    def shape_of(size):
        tokens, hidden = size[0], size[-1]
        seqs = _MAMBA_SEQS[kind] or tokens
        if tokens % seqs:
            raise ValueError(f"mamba_mixer[{kind}]: {tokens} tokens do not split into {seqs} equal sequences")
        return (tokens, seqs, hidden)

    return shape_of


def _mamba_dims(hidden: int) -> tuple[int, int, int, int]:
    """(intermediate, state, kernel, rank) of the bench's layer of width ``hidden``."""
    return 2 * hidden, 16, 4, -(-hidden // 16)


def _mamba_mixer(hidden: int):
    from dualop.ops import MambaMixer

    inner, state, kernel, rank = _mamba_dims(hidden)
    return MambaMixer(hidden, state, kernel, inner, rank)


def _mamba_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, seqs, hidden = shape
    inner, state, kernel, rank = _mamba_dims(hidden)

    def normal(shape_, scale):
        return (rng.standard_normal(shape_) * scale).astype(np.float32)

    a_log = np.log(np.broadcast_to(np.arange(1, state + 1, dtype=np.float32), (inner, state))).copy()
    return (normal((tokens, hidden), 1.0), normal((2 * inner, hidden), hidden ** -0.5), normal((inner, kernel), 0.5),
            normal((inner,), 0.1), normal((rank + 2 * state, inner), inner ** -0.5), normal((inner, rank), rank ** -0.5),
            normal((inner,), 0.5) - 1.0, a_log, np.ones(inner, np.float32), normal((hidden, inner), inner ** -0.5),
            None, None, None, None, None,
            normal((seqs, inner, kernel - 1), 1.0), normal((seqs, inner, state), 0.5),
            Pinned(np.arange(seqs + 1, dtype=np.int32) * (tokens // seqs), "int32"),
            Pinned(np.arange(seqs, dtype=np.int32), "int32"), Pinned(np.zeros(seqs, bool), "bool"))


def _mamba_cost(op, shape, itemsize) -> KernelCost:
    """The four projections' GEMMs, the conv and the scan (about 6 flops per state element per
    token), one exp per state element and the softplus and two SiLUs per channel; the weights, the
    tokens in and out, and each sequence's states read and written once."""
    tokens, seqs, hidden = shape
    inner, state, kernel, rank = _mamba_dims(hidden)
    gemm = 2 * tokens * (hidden * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * hidden)
    flops = gemm + tokens * inner * (2 * kernel + 6 * state + 10)
    weights = (2 * inner * hidden + inner * (kernel + 1) + (rank + 2 * state) * inner + inner * (rank + 1)
               + inner * (state + 1) + hidden * inner) * itemsize
    states = 2 * seqs * inner * (kernel - 1 + state) * itemsize
    return KernelCost(flops=flops, transcendentals=tokens * inner * (state + 3),
                      bytes_accessed=weights + 2 * tokens * hidden * itemsize + states)


def _transformers_mamba(op):
    """transformers' MambaMixer with the op's weights (loaded on the first call) on the packed tokens
    as a batch of equal-length sequences from zero states, with a fresh cache for the final states."""
    import torch
    from transformers import DynamicCache, MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer as HFMambaMixer

    cfg = MambaConfig(hidden_size=op.hidden_size, state_size=op.ssm_state_size, conv_kernel=op.conv_kernel_size,
                      intermediate_size=op.intermediate_size, time_step_rank=op.time_step_rank, num_hidden_layers=1)
    held: dict[str, Any] = {}

    def mixer(hidden_states, in_proj_weight, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias,
              A_log, D, out_proj_weight, in_proj_bias=None, out_proj_bias=None, dt_norm_weight=None,
              b_norm_weight=None, c_norm_weight=None, conv_state=None, ssm_state=None, cu_seqlens=None,
              state_indices=None, has_initial_state=None):
        if "module" not in held:
            module = HFMambaMixer(cfg, layer_idx=0, initialize_mixer_weights=False).eval()
            weights = {"in_proj.weight": in_proj_weight, "conv1d.weight": conv_weight[:, None, :],
                       "conv1d.bias": conv_bias, "x_proj.weight": x_proj_weight, "dt_proj.weight": dt_proj_weight,
                       "dt_proj.bias": dt_proj_bias, "A_log": A_log, "D": D, "out_proj.weight": out_proj_weight}
            module.load_state_dict({k: v.detach() for k, v in weights.items()})
            held["module"] = module.to(device=hidden_states.device, dtype=hidden_states.dtype)
        seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
        batch = hidden_states.reshape(seqs, -1, hidden_states.shape[-1])
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            out = held["module"](batch, cache_params=cache)
        conv = cache.get_conv_state(0, state_idx=0)[:, :, 1:]  # it keeps K inputs, the op K - 1
        return out.reshape(hidden_states.shape), conv, cache.get_recurrent_state(0, state_idx=0)

    return mixer


def _jax_mamba(op):
    """What a user writes in jax: the projections as float32-accumulating dots, then one lax.scan
    over the packed tokens for the conv and one for the SSM state, each reset at a sequence's start
    from its cached state, the final states written into new caches."""
    import jax
    import jax.numpy as jnp

    i_size, n, k, r = op.intermediate_size, op.ssm_state_size, op.conv_kernel_size, op.time_step_rank

    def dot(x, w):  # float32 accumulation, rounded to the tokens' dtype (as the native body rounds)
        return jnp.einsum("tk,nk->tn", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

    def mixer(h, in_w, conv_w, conv_b, x_w, dt_w, dt_b, A_log, D, out_w, in_b=None, out_b=None, dt_nw=None,
              b_nw=None, c_nw=None, conv_state=None, ssm_state=None, cu_seqlens=None, state_indices=None,
              has_initial_state=None):
        tokens = h.shape[0]
        xz = dot(h, in_w)
        x, z = xz[:, :i_size].astype(jnp.float32), xz[:, i_size:].astype(jnp.float32)
        seq = jnp.searchsorted(cu_seqlens[1:], jnp.arange(tokens), side="right")
        first = jnp.arange(tokens) == cu_seqlens[seq]
        init = has_initial_state[seq][:, None, None]
        conv0 = jnp.where(init, conv_state[state_indices[seq]].astype(jnp.float32), 0.0)
        ssm0 = jnp.where(init, ssm_state[state_indices[seq]].astype(jnp.float32), 0.0)
        a = -jnp.exp(A_log.astype(jnp.float32))
        wc, bc = conv_w.astype(jnp.float32), conv_b.astype(jnp.float32)

        def conv_step(window, inputs):
            x_t, f, w0 = inputs
            window = jnp.concatenate([jnp.where(f, w0, window), x_t[:, None]], axis=1)
            y = jnp.sum(window * wc, axis=1) + bc
            return window[:, 1:], y * jax.nn.sigmoid(y)

        _, xc = jax.lax.scan(conv_step, jnp.zeros((i_size, k - 1), jnp.float32), (x, first, conv0))
        xc = xc.astype(h.dtype).astype(jnp.float32)
        dbc = dot(xc.astype(h.dtype), x_w)
        dt = jax.nn.softplus(dot(dbc[:, :r], dt_w).astype(jnp.float32) + dt_b.astype(jnp.float32))
        b, c = dbc[:, r:r + n].astype(jnp.float32), dbc[:, r + n:].astype(jnp.float32)

        def scan_step(s, inputs):
            d_t, x_t, b_t, c_t, f, s0 = inputs
            s = jnp.exp(d_t[:, None] * a) * jnp.where(f, s0, s) + (d_t * x_t)[:, None] * b_t[None, :]
            return s, s @ c_t

        last = jnp.arange(tokens) == cu_seqlens[seq + 1] - 1

        def scan_step(carry, inputs):
            s, finals = carry
            d_t, x_t, b_t, c_t, f, l_t, q, s0 = inputs
            s = jnp.exp(d_t[:, None] * a) * jnp.where(f, s0, s) + (d_t * x_t)[:, None] * b_t[None, :]
            finals = finals.at[q].set(jnp.where(l_t, s, finals[q]))
            return (s, finals), s @ c_t

        finals0 = jnp.zeros((cu_seqlens.shape[0] - 1, i_size, n), jnp.float32)
        (_, finals), y = jax.lax.scan(scan_step, (jnp.zeros((i_size, n), jnp.float32), finals0),
                                      (dt, xc, b, c, first, last, seq, ssm0))
        y = (y + D.astype(jnp.float32) * xc) * jax.nn.silu(z)
        out = dot(y.astype(h.dtype), out_w)
        # each sequence's last K - 1 conv inputs (zeros before its start: it started from zeros)
        ends = cu_seqlens[1:]
        rows = ends[:, None] - (k - 1) + jnp.arange(k - 1)[None, :]  # [B, K - 1]
        window = jnp.where((rows >= cu_seqlens[:-1, None])[..., None], x[jnp.maximum(rows, 0)], 0.0)
        new_conv = conv_state.at[state_indices].set(jnp.swapaxes(window, 1, 2).astype(conv_state.dtype))
        new_ssm = ssm_state.at[state_indices].set(finals.astype(ssm_state.dtype))
        return out, new_conv, new_ssm

    return mixer


# --- mamba_mixer: (tokens, sequences, hidden, intermediate, state), as its check cases -----
# Falcon-Mamba-7B / Jamba's Mamba layers (hidden 4096, I 8192, N 16, K 4, R 256) with Jamba's dt/B/C
# norms: an 8192-token prefill of 8 sequences and a 64-sequence decode step, over a 256-slot cache.
_MAMBA_MIXER_SLOTS = 256


def _mamba_mixer_inputs(shape: tuple[int, ...]) -> tuple:
    """The op's positional arguments (Jamba's: conv bias and norm weights, no projection biases)."""
    tokens, seqs, hidden, inner, state = shape
    rank, kernel = -(-hidden // 16), 4
    w = InputSpec
    return (
        w((tokens, hidden), None), w((2 * inner, hidden), None), w((inner, kernel), None), w((inner,), None),
        w((rank + 2 * state, inner), None), w((inner, rank), None), w((inner,), None), w((inner, state), None),
        w((inner,), None), w((hidden, inner), None), None, None,
        w((rank,), None), w((state,), None), w((state,), None),
        w((_MAMBA_MIXER_SLOTS, inner, kernel - 1), None), w((_MAMBA_MIXER_SLOTS, inner, state), None),
        w((seqs + 1,), "int32"), w((seqs,), "int32"), w((seqs,), "bool"),
    )


def bench_cases():
    """Not run by default: against transformers' MambaMixer slow path (torch) and a hand-written jax mixer."""
    return [BenchCase(f"mamba_mixer[{kind}]", "mamba_mixer", _mamba_mixer, _mamba_inputs, _mamba_cost,
                      _transformers_mamba, _jax_mamba, default=False, shape_of=_mamba_shape(kind), matrix=True)
            for kind in _MAMBA_SEQS]


def serving():
    """(tokens, sequences, hidden, intermediate, state), as the check cases: Falcon-Mamba-7B /
    Jamba's Mamba layers (hidden 4096, I 8192, N 16, K 4, R 256) with Jamba's dt/B/C norms, an
    8192-token prefill of 8 sequences and a 64-sequence decode step over a 256-slot cache. bfloat16
    only: a mixer at serving size is its GEMMs around its kernel ops, whose own entries build the
    kernels in float32 at serving shapes."""
    return {"mamba_mixer": Serving(((8192, 8, 4096, 8192, 16), (64, 64, 4096, 8192, 16)), _mamba_mixer_inputs,
                                   dtypes=("bfloat16",), cases=("mamba_mixer[jamba]",))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"mamba_mixer": {"traits": {"structured_inputs", "widens_nonfinite", "packed_sequences", "mixer",
                                    "not_differentiable"}}}
