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

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.kernels import ssm_math
from dualop.kernels.norm_math import NormSpec, rms_normalize
from dualop.ops._checks import check_array, check_optional_like, check_positive_int
from dualop.ops._mixer import MixerPlatformMethods, mixer_batches, project, projection
from dualop.ops.causal_conv1d import CausalConv1d
from dualop.ops.selective_scan import SelectiveScan
from dualop.ops.ssm_batch import SSMBatch

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

    def check_inputs(self, hidden_states: Any, in_proj_weight: Any, conv_weight: Any, conv_bias: Any,
                     x_proj_weight: Any, dt_proj_weight: Any, dt_proj_bias: Any, A_log: Any, D: Any,
                     out_proj_weight: Any, in_proj_bias: Any = None, out_proj_bias: Any = None,
                     dt_norm_weight: Any = None, b_norm_weight: Any = None, c_norm_weight: Any = None,
                     conv_state: Any = None, ssm_state: Any = None, cu_seqlens: Any = None,
                     state_indices: Any = None, has_initial_state: Any = None) -> None:
        fe = check_array(_OP, "hidden_states", hidden_states, min_ndim=2)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{_OP}: argument 'hidden_states' has shape {tuple(hidden_states.shape)}; expected "
                             f"[tokens, hidden_size={self.hidden_size}]")
        given = {"in_proj_weight": in_proj_weight, "conv_weight": conv_weight, "x_proj_weight": x_proj_weight,
                 "dt_proj_weight": dt_proj_weight, "dt_proj_bias": dt_proj_bias, "A_log": A_log, "D": D,
                 "out_proj_weight": out_proj_weight}
        for name, shape in self._weight_shapes().items():
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
# token blocks are tests/test_selective_scan.py's and tests/test_causal_conv1d.py's).
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
