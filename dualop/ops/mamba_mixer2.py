"""The Mamba-2 mixer of the reference serving engine (Mamba-2, Bamba, Nemotron-H, Falcon-H1, Zamba2):
its gated output norm ``mixer2_gated_rms_norm`` and the whole mixer ``mamba_mixer2``.

The norm runs per tensor-parallel rank as the engine's does (``tp``, a
``dualop.parallel.TensorParallel``; default the current group, with the collectives its groups
need); the mixer runs on one rank (the interface's signature has no ``tp``; the engine's head /
group sharding of its weights is not here yet).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.custom_op import ALL_FRONTENDS, CustomOp, Serves
from dualop.kernels import cost as cost_model
from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost
from dualop.ops._checks import check_array, check_finite_float, check_optional_like, check_positive_int
from dualop.ops._mixer import MixerPlatformMethods, check_not_engine_mixer_call, mixer_batches, project, projection
from dualop.ops.gated_norm import RMSNormGated
from dualop.parallel import TensorParallel, current_tensor_parallel, divide
from dualop.platforms import frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["Mixer2RMSNormGated", "MambaMixer2"]


def _check_tp(op: str, tp: Any) -> TensorParallel:
    if tp is not None and not isinstance(tp, TensorParallel):
        raise TypeError(f"{op}: argument 'tp' must be a dualop.parallel.TensorParallel or None, "
                        f"got {type(tp).__qualname__}")
    return tp or current_tensor_parallel()


def _rank_block(x: Any, rank: Any, size: int) -> Any:
    """Block ``rank`` (an int, or a traced ``axis_index``) of ``x``'s last dim, ``size`` wide."""
    if isinstance(rank, int):
        return x[..., rank * size:(rank + 1) * size]
    import jax

    return jax.lax.dynamic_slice_in_dim(x, rank * size, size, axis=x.ndim - 1)


# How the groups of the norm fall on the tensor-parallel ranks (the engine's three cases).
_LOCAL = "local"  # one rank, or whole groups on every rank: no collective
_ALL_REDUCE = "all_reduce"  # one group split over the ranks: the sums of squares are all-reduced
_ALL_GATHER = "all_gather"  # groups cut by rank boundaries: gather, normalise, keep the rank's part


@CustomOp.register("mixer2_gated_rms_norm")
class Mixer2RMSNormGated(CustomOp):
    """The Mamba-2 mixers' output norm on one tensor-parallel rank.

    ``op(x, gate, weight=None)``: ``x`` and ``gate`` ``(..., full_hidden_size / tp)`` of one dtype,
    ``weight`` the rank's ``(full_hidden_size / tp,)`` (required when ``use_rms_norm``, else None).
    In float32: ``h = x * silu(gate)``; without ``use_rms_norm`` that is the result (in ``x``'s
    dtype). Else every group of ``full_hidden_size / full_n_groups`` features of the FULL hidden
    dim is scaled by ``rsqrt(mean(h**2) + eps)``, the result cast to ``x``'s dtype and then
    multiplied by ``weight`` (``weight * h.to(dtype)``: cast, then weight), rounded to ``x``'s dtype.

    Over ``tp`` ranks (the engine's cases): one group -> each rank sums its squares and the sums
    are all-reduced; ``tp`` divides the groups -> each rank holds whole groups, no collective;
    otherwise the gated input is all-gathered, normalised whole and the rank keeps its slice.
    The kernels (the ``rms_norm_gated`` kernels with their cast-before-weight flag) run the
    no-collective case; the others decline to the native body (its collectives included).
    """

    def __init__(self, full_hidden_size: int, full_n_groups: int, use_rms_norm: bool = True, eps: float = 1e-6,
                 tp: TensorParallel | None = None, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = "mixer2_gated_rms_norm"
        self.full_hidden_size = check_positive_int(op, "full_hidden_size", full_hidden_size)
        self.full_n_groups = check_positive_int(op, "full_n_groups", full_n_groups)
        self.group_size = divide(full_hidden_size, full_n_groups, op=op,
                                 what=f"argument 'full_hidden_size' ({full_hidden_size}) over full_n_groups")
        if not isinstance(use_rms_norm, bool):
            raise TypeError(f"{op}: argument 'use_rms_norm' must be a bool, got {use_rms_norm!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"{op}: argument 'eps' must be a non-negative float, got {eps!r}")
        self.use_rms_norm, self.eps = use_rms_norm, float(eps)
        self.tp = _check_tp(op, tp)
        self.hidden_size = divide(full_hidden_size, self.tp.size, op=op, what="argument 'full_hidden_size'")
        if self.tp.size == 1 or (full_n_groups > 1 and full_n_groups % self.tp.size == 0):
            self.tp_mode = _LOCAL
        else:
            self.tp_mode = _ALL_REDUCE if full_n_groups == 1 else _ALL_GATHER
        # the kernels' op: the rank's features in whole groups (the no-collective case)
        local_group = self.group_size if self.tp_mode == _LOCAL else self.hidden_size
        self._norm = RMSNormGated(self.hidden_size, self.eps, group_size=local_group, cast_before_weight=True,
                                  enforce_enable=True)

    def extra_repr(self) -> str:
        return (f"full_hidden_size={self.full_hidden_size}, full_n_groups={self.full_n_groups}, "
                f"use_rms_norm={self.use_rms_norm}, eps={self.eps}, tp={self.tp.size} ({self.tp_mode})")

    def check_inputs(self, x: Any, gate: Any = None, weight: Any = None) -> None:
        op = "mixer2_gated_rms_norm"
        fe = check_array(op, "x", x)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"{op}: argument 'x' has last dim {x.shape[-1]}; expected full_hidden_size / tp = "
                             f"{self.full_hidden_size} / {self.tp.size} = {self.hidden_size}")
        if gate is None:
            raise TypeError(f"{op}: argument 'gate' is required; expected an array shaped and typed like 'x'")
        check_optional_like(op, "gate", gate, "x", x, fe, same_dtype=True)
        if self.use_rms_norm and weight is None:
            raise TypeError(f"{op}: argument 'weight' is required with use_rms_norm; expected an array of shape "
                            f"({self.hidden_size},)")
        if not self.use_rms_norm and weight is not None:
            raise ValueError(f"{op}: argument 'weight' must be None with use_rms_norm=False (there is no norm)")
        check_optional_like(op, "weight", weight, "x", x, fe, shape=(self.hidden_size,))

    def forward_native(self, x: Any, gate: Any, weight: Any = None) -> Any:
        xp = array_namespace(x)
        f32 = xp.float32
        g = xp.astype(gate, f32)
        h = xp.astype(x, f32) * (g * xp.sigmoid(g))
        if not self.use_rms_norm:
            return xp.astype(h, x.dtype)
        if self.tp_mode == _ALL_REDUCE:
            sums = self.tp.all_reduce(xp.sum(h * h, axis=-1, keepdims=True))
            h = h * xp.rsqrt(sums / self.full_hidden_size + self.eps)
        else:
            if self.tp_mode == _ALL_GATHER:
                h = self.tp.all_gather(h, dim=-1)
            shape = tuple(h.shape)
            grouped = xp.reshape(h, (*shape[:-1], shape[-1] // self.group_size, self.group_size))
            grouped = grouped * xp.rsqrt(xp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
            h = xp.reshape(grouped, shape)
            if self.tp_mode == _ALL_GATHER:
                h = _rank_block(h, self.tp.rank, self.hidden_size)
        h = xp.astype(xp.astype(h, x.dtype), f32) * xp.astype(weight, f32)
        return xp.astype(h, x.dtype)

    def declines(self, method: str, frontend: str) -> str | None:
        if not self.use_rms_norm:
            return "use_rms_norm=False: x * silu(gate) alone, no norm kernel to run"
        if self.tp_mode == _ALL_REDUCE:
            return f"one group over tp={self.tp.size}: the sums of squares are all-reduced between ranks (native)"
        if self.tp_mode == _ALL_GATHER:
            return (f"{self.full_n_groups} groups do not split over tp={self.tp.size}: the gated input is "
                    "all-gathered (native)")
        return None

    # The kernels: rms_norm_gated's (gate before the norm, cast before the weight).
    def forward_cpu(self, x: Any, gate: Any, weight: Any = None) -> Any:
        return self._norm.forward_cpu(x, weight, gate)

    def forward_cuda(self, x: Any, gate: Any, weight: Any = None) -> Any:
        return self._norm.forward_cuda(x, weight, gate)

    def forward_tpu(self, x: Any, gate: Any, weight: Any = None) -> Any:
        return self._norm.forward_tpu(x, weight, gate)


def _kernel_ops(mixer: "MambaMixer2") -> tuple[Any, Any]:
    """The mixer's kernel ops ``(CausalConv1d, SSDChunkScan)``."""
    from dualop.ops.causal_conv1d import CausalConv1d
    from dualop.ops.ssd import SSDChunkScan

    conv = CausalConv1d(mixer.conv_dim, mixer.conv_kernel_size, activation=mixer.activation)
    ssd = SSDChunkScan(mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, n_groups=mixer.n_groups,
                       chunk_size=mixer.chunk_size, delta_softplus=True, dt_limit=mixer.time_step_limit)
    return conv, ssd


_MIXER = "mamba_mixer2"

# transformers' Mamba2Mixer / BambaMixer / NemotronHMamba2Mixer state-dict names -> the op's weight
# arguments (conv1d.weight is stored [C, 1, K]: the loaders drop the middle dim).
HF_PARAMETER_NAMES = {
    "in_proj.weight": "in_proj_weight",
    "in_proj.bias": "in_proj_bias",
    "conv1d.weight": "conv_weight",
    "conv1d.bias": "conv_bias",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "D": "D",
    "norm.weight": "norm_weight",
    "out_proj.weight": "out_proj_weight",
    "out_proj.bias": "out_proj_bias",
}


@CustomOp.register("mamba_mixer2")
class MambaMixer2(MixerPlatformMethods, CustomOp):
    """The engine's MambaMixer2 math on packed sequences with a state cache (one rank).

    ``op(hidden_states [T, Hd], in_proj_weight [I + (I + 2GN) + H, Hd], conv_weight [I + 2GN, K],
    conv_bias, dt_bias [H], A_log [H], D [H], norm_weight [I], out_proj_weight [Hd, I],
    in_proj_bias=None, out_proj_bias=None, conv_state=None [S, I + 2GN, K-1], ssm_state=None
    [S, H, P, N], cu_seqlens=None, state_indices=None, has_initial_state=None)``
    -> ``(out [T, Hd], conv_state, ssm_state)``; the serving batch and caches as
    ``dualop.ops.ssm_batch`` says (torch caches updated in place, jax returns new ones).

    1. ``in_proj`` -> ``[z (I) | xBC (I + 2GN) | dt (H)]`` (rounded to the input dtype);
    2. causal depthwise conv of ``xBC`` (with its bias) and ``activation``;
    3. ``x [T, H, P]``, ``B``, ``C`` ``[T, G, N]``; the SSD scan with ``A = -exp(A_log)``, ``D``,
       ``dt_bias``, softplus and ``time_step_limit`` (no gate inside the scan);
    4. the gated norm (``mixer2_gated_rms_norm``) of the scan output with ``z`` (or only
       ``y * silu(z)`` without ``use_rms_norm``, ``norm_weight`` then None);
    5. ``out_proj``. Tokens of padding sequences (slot -1) give zeros.

    ``forward_native`` composes the references (``ssm_math``) and float32 GEMMs; the platform
    methods run the vendor GEMM (``replicated_linear``'s paths) and the ``causal_conv1d`` /
    ``ssd_chunk_scan`` / gated-norm ops, which dispatch to their own kernels (the conv's weight and
    the projections' biases in the tokens' dtype). Every argument, both caches included, is
    checked before either cache is written (``check_inputs``, ``ssm_batch``).
    """

    # torch updates the given caches in place (torch.library declares them; backends/torch/library.py)
    mutates_args: ClassVar[tuple[str, ...]] = ("conv_state", "ssm_state")
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "conv_state", "ssm_state")

    def __init__(self, hidden_size: int, ssm_state_size: int, conv_kernel_size: int, intermediate_size: int,
                 use_conv_bias: bool, use_bias: bool, n_groups: int = 1, num_heads: int = 128, head_dim: int = 64,
                 rms_norm_eps: float = 1e-5, activation: str | None = "silu", chunk_size: int = 256,
                 time_step_limit: tuple[float, float] = (0.0, float("inf")), use_rms_norm: bool = True, *,
                 enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = _MIXER
        self.hidden_size = check_positive_int(op, "hidden_size", hidden_size)
        self.ssm_state_size = check_positive_int(op, "ssm_state_size", ssm_state_size)
        self.conv_kernel_size = check_positive_int(op, "conv_kernel_size", conv_kernel_size)
        self.intermediate_size = check_positive_int(op, "intermediate_size", intermediate_size)
        self.n_groups = check_positive_int(op, "n_groups", n_groups)
        self.num_heads = check_positive_int(op, "num_heads", num_heads)
        self.head_dim = check_positive_int(op, "head_dim", head_dim)
        self.chunk_size = check_positive_int(op, "chunk_size", chunk_size)
        # Checked here too, so the error names this op and its argument, not the inner norm's.
        rms_norm_eps = check_finite_float(op, "rms_norm_eps", rms_norm_eps, minimum=0.0)
        if num_heads * head_dim != intermediate_size:
            raise ValueError(f"{op}: num_heads * head_dim = {num_heads} * {head_dim} must equal intermediate_size "
                             f"{intermediate_size}")
        if num_heads % n_groups:
            raise ValueError(f"{op}: n_groups {n_groups} must divide num_heads {num_heads} (each group serves "
                             "num_heads / n_groups heads)")
        if activation not in ("silu", None):
            raise ValueError(f"{op}: argument 'activation' must be 'silu' or None, got {activation!r}")
        try:
            low, high = (float(v) for v in time_step_limit)
        except (TypeError, ValueError):
            raise ValueError(f"{op}: argument 'time_step_limit' must be a pair (min, max), got "
                             f"{time_step_limit!r}") from None
        if not 0.0 <= low <= high:
            raise ValueError(f"{op}: argument 'time_step_limit' must satisfy 0 <= min <= max, got {time_step_limit!r}")
        self.use_conv_bias, self.use_bias = bool(use_conv_bias), bool(use_bias)
        self.activation, self.time_step_limit, self.use_rms_norm = activation, (low, high), bool(use_rms_norm)
        self.conv_dim = intermediate_size + 2 * n_groups * ssm_state_size
        self.projection_size = intermediate_size + self.conv_dim + num_heads
        one = TensorParallel()
        self.norm = Mixer2RMSNormGated(intermediate_size, n_groups, use_rms_norm=self.use_rms_norm, eps=rms_norm_eps,
                                       tp=one, enforce_enable=True)
        self.in_proj = projection(hidden_size, self.projection_size, bias=self.use_bias)
        self.out_proj = projection(intermediate_size, hidden_size, bias=self.use_bias)
        self._conv, self._ssd = _kernel_ops(self)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"heads={self.num_heads}x{self.head_dim}, n_groups={self.n_groups}, state={self.ssm_state_size}, "
                f"conv_kernel={self.conv_kernel_size}, time_step_limit={self.time_step_limit}")

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One sequence's conv state: the last ``K - 1`` inputs of ``xBC``."""
        return (self.conv_dim, self.conv_kernel_size - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """One sequence's SSD state ``[H, P, N]``."""
        return (self.num_heads, self.head_dim, self.ssm_state_size)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The weight arguments this mixer takes (name -> shape; absent optional ones left out),
        the layers' parameters. ``HF_PARAMETER_NAMES`` maps transformers' state-dict names to them."""
        shapes = {
            "in_proj_weight": (self.projection_size, self.hidden_size),
            "in_proj_bias": (self.projection_size,) if self.use_bias else None,
            "conv_weight": (self.conv_dim, self.conv_kernel_size),
            "conv_bias": (self.conv_dim,) if self.use_conv_bias else None,
            "dt_bias": (self.num_heads,),
            "A_log": (self.num_heads,),
            "D": (self.num_heads,),
            "norm_weight": (self.intermediate_size,) if self.use_rms_norm else None,
            "out_proj_weight": (self.hidden_size, self.intermediate_size),
            "out_proj_bias": (self.hidden_size,) if self.use_bias else None,
        }
        return {name: shape for name, shape in shapes.items() if shape is not None}

    def _batches(self, hidden_states, conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state):
        return mixer_batches(_MIXER, hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                             has_initial_state, self.conv_state_shape, self.ssm_state_shape)

    def check_inputs(self, hidden_states: Any, in_proj_weight: Any = None, conv_weight: Any = None,
                     conv_bias: Any = None, dt_bias: Any = None, A_log: Any = None, D: Any = None,
                     norm_weight: Any = None, out_proj_weight: Any = None, in_proj_bias: Any = None,
                     out_proj_bias: Any = None, conv_state: Any = None, ssm_state: Any = None, cu_seqlens: Any = None,
                     state_indices: Any = None, has_initial_state: Any = None) -> None:
        op = _MIXER
        fe = check_array(op, "hidden_states", hidden_states)
        if hidden_states.ndim != 2 or hidden_states.shape[1] != self.hidden_size:
            raise ValueError(f"{op}: argument 'hidden_states' has shape {tuple(hidden_states.shape)}; expected "
                             f"[T, hidden_size={self.hidden_size}] (tokens packed along the first axis)")
        heads, inter = self.num_heads, self.intermediate_size
        check_not_engine_mixer_call(op, "MambaMixer2", hidden_states, in_proj_weight,
                                    (self.projection_size, self.hidden_size))
        required = [
            ("in_proj_weight", in_proj_weight, (self.projection_size, self.hidden_size)),
            ("conv_weight", conv_weight, (self.conv_dim, self.conv_kernel_size)),
            ("dt_bias", dt_bias, (heads,)),
            ("A_log", A_log, (heads,)),
            ("D", D, (heads,)),
            ("out_proj_weight", out_proj_weight, (self.hidden_size, inter)),
        ]
        optional = [
            ("conv_bias", conv_bias, (self.conv_dim,), self.use_conv_bias, "use_conv_bias"),
            ("in_proj_bias", in_proj_bias, (self.projection_size,), self.use_bias, "use_bias"),
            ("out_proj_bias", out_proj_bias, (self.hidden_size,), self.use_bias, "use_bias"),
            ("norm_weight", norm_weight, (inter,), self.use_rms_norm, "use_rms_norm"),
        ]
        for name, value, shape in required:
            if value is None:
                raise TypeError(f"{op}: argument {name!r} is required; expected an array of shape {list(shape)}")
            check_optional_like(op, name, value, "hidden_states", hidden_states, fe, shape=shape)
        for name, value, shape, wanted, flag in optional:
            if (value is None) == wanted:
                need = f"an array of shape {list(shape)}" if wanted else "None"
                raise ValueError(f"{op}: argument {name!r} must be {need} ({flag}={wanted})")
            check_optional_like(op, name, value, "hidden_states", hidden_states, fe, shape=shape)
        for name, value in (("in_proj_weight", in_proj_weight), ("out_proj_weight", out_proj_weight)):
            if value.dtype != hidden_states.dtype:
                raise TypeError(f"{op}: argument {name!r} has dtype {value.dtype}; expected hidden_states' dtype "
                                f"{hidden_states.dtype}")
        self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices, has_initial_state)

    def _split(self, xp, projected):
        inter, conv_dim = self.intermediate_size, self.conv_dim
        return projected[:, :inter], projected[:, inter:inter + conv_dim], projected[:, inter + conv_dim:]

    def _split_xbc(self, xp, xbc):
        num_tokens, inter, gn = xbc.shape[0], self.intermediate_size, self.n_groups * self.ssm_state_size
        x = xp.reshape(xbc[:, :inter], (num_tokens, self.num_heads, self.head_dim))
        b = xp.reshape(xbc[:, inter:inter + gn], (num_tokens, self.n_groups, self.ssm_state_size))
        c = xp.reshape(xbc[:, inter + gn:], (num_tokens, self.n_groups, self.ssm_state_size))
        return x, b, c

    def _zero_padding(self, xp, out, batch):
        seq = ssm_math.sequence_layout(xp, batch.cu_seqlens, batch.num_tokens)[0]
        keep = ssm_math.token_keep(xp, batch.state_indices, seq)
        return xp.where(keep[:, None], out, 0.0)

    def forward_native(self, hidden_states, in_proj_weight, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
                       out_proj_weight, in_proj_bias=None, out_proj_bias=None, conv_state=None, ssm_state=None,
                       cu_seqlens=None, state_indices=None, has_initial_state=None):
        xp = array_namespace(hidden_states)
        conv_b, ssm_b = self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                                      has_initial_state)
        meta = (conv_b.cu_seqlens, conv_b.state_indices, conv_b.has_initial_state)
        z, xbc, dt = self._split(xp, project(self.in_proj, "forward_native", hidden_states, in_proj_weight, in_proj_bias))
        xbc, conv_out = ssm_math.causal_conv1d_reference(xp, xbc, conv_weight, conv_bias, conv_b.state, *meta,
                                                         self.activation)
        x, b, c = self._split_xbc(xp, xbc)
        a = -xp.exp(xp.astype(A_log, xp.float32))
        y, ssm_out = ssm_math.ssd_reference(xp, x, dt, a, b, c, D, None, dt_bias, ssm_b.state, *meta, True,
                                            self.time_step_limit)
        y = self.norm.forward_native(xp.reshape(y, (y.shape[0], self.intermediate_size)), z, norm_weight)
        out = project(self.out_proj, "forward_native", y, out_proj_weight, out_proj_bias)
        return self._zero_padding(xp, out, conv_b), conv_out, ssm_out

    # forward_cpu serves torch tensors (the default); on a GPU every frontend takes the platform
    # body, whose projections are XLA's dot for jax arrays and whose kernel ops fall back alone.
    serves = {"forward_cuda": Serves(ALL_FRONTENDS), "forward_hip": Serves(ALL_FRONTENDS)}

    def _forward_platform(self, method, hidden_states, in_proj_weight, conv_weight, conv_bias, dt_bias, A_log, D,
                          norm_weight, out_proj_weight, in_proj_bias, out_proj_bias, conv_state, ssm_state, cu_seqlens,
                          state_indices, has_initial_state):
        """The platform methods' one body: the vendor GEMMs (``method`` of ``replicated_linear``)
        around the kernel ops (each dispatching to its own kernel) and the gated norm's ``method``."""
        xp = array_namespace(hidden_states)
        conv_b, _ = self._batches(hidden_states, conv_state, ssm_state, cu_seqlens, state_indices,
                                  has_initial_state)
        meta = dict(cu_seqlens=conv_b.cu_seqlens, state_indices=conv_b.state_indices,
                    has_initial_state=conv_b.has_initial_state)
        # the kernels take operands of the tokens' dtype (a weight of another is cast, as the
        # projections' are): every argument checked passes them, before any cache is written
        dtype = hidden_states.dtype
        in_proj_bias, out_proj_bias, conv_weight, conv_bias = (
            a if a is None or a.dtype == dtype else xp.astype(a, dtype)
            for a in (in_proj_bias, out_proj_bias, conv_weight, conv_bias))
        projected = project(self.in_proj, method, hidden_states, in_proj_weight, in_proj_bias)
        z, xbc, dt = self._split(xp, projected)
        xbc, conv_out = self._conv(xbc, conv_weight, conv_bias, conv_state=conv_state, **meta)
        x, b, c = self._split_xbc(xp, xbc)
        a = -xp.exp(xp.astype(A_log, xp.float32))
        y, ssm_out = self._ssd(x, dt, a, b, c, D=D, dt_bias=dt_bias, ssm_state=ssm_state, **meta)
        y = xp.reshape(y, (y.shape[0], self.intermediate_size))
        norm = self.norm
        y = getattr(norm, method)(y, z, norm_weight) if norm.passes_over(method, frontend_of(y)) is None else \
            norm.forward_native(y, z, norm_weight)
        out = project(self.out_proj, method, y, out_proj_weight, out_proj_bias)
        return self._zero_padding(xp, out, conv_b), conv_out, ssm_out

    def _forward_kernels(self, method, *args, **kwargs):
        return self._forward_platform(method, *self._arguments(args, kwargs))

    _ARGUMENTS = ("hidden_states", "in_proj_weight", "conv_weight", "conv_bias", "dt_bias", "A_log", "D",
                  "norm_weight", "out_proj_weight", "in_proj_bias", "out_proj_bias", "conv_state", "ssm_state",
                  "cu_seqlens", "state_indices", "has_initial_state")

    def _arguments(self, args, kwargs) -> tuple:
        values = dict(zip(self._ARGUMENTS, args))
        values.update(kwargs)
        return tuple(values.get(name) for name in self._ARGUMENTS)


# The mixer's check config: hidden 16, 4 heads of 4 in 2 groups of state 8, kernel 4.
_CASE_MIXER = dict(hidden_size=16, ssm_state_size=8, conv_kernel_size=4, intermediate_size=16, use_conv_bias=True,
                   use_bias=False, n_groups=2, num_heads=4, head_dim=4, chunk_size=8)


def mixer_case_inputs(op: MambaMixer2, num_tokens: int, rng, lengths: tuple[int, ...] | None = None) -> tuple:
    """Random weights and ``num_tokens`` packed tokens for ``op`` (float32 numpy; ``cu_seqlens``
    pinned int32 when ``lengths`` splits them into sequences), no caches."""
    import numpy as np

    from dualop.testing import Pinned, normal

    shapes = op.parameter_shapes()
    w = {name: normal(shape, rng, 0.3) for name, shape in shapes.items()}
    w["A_log"] = np.log(rng.uniform(0.1, 1.0, shapes["A_log"])).astype(np.float32)
    if "norm_weight" in w:
        w["norm_weight"] = 1.0 + w["norm_weight"]
    cu = None if lengths is None else Pinned(np.cumsum((0,) + tuple(lengths)).astype(np.int32), "int32")
    return (normal((num_tokens, op.hidden_size), rng), w["in_proj_weight"], w["conv_weight"], w.get("conv_bias"),
            w["dt_bias"], w["A_log"], w["D"], w.get("norm_weight"), w["out_proj_weight"], w.get("in_proj_bias"),
            w.get("out_proj_bias"), None, None, cu)


def check_cases():
    """``dualop check`` cases: the gated norm with Mamba-2 / Bamba's one group (hidden off the lane
    grid) and Nemotron-H-like groups (lane-aligned and not), one rank; the mixer over one token,
    a decode step of four sequences and three packed sequences (T <= 12: the native body loops over
    tokens); shapes ``(tokens, sequences, hidden)``."""
    from dualop.testing import OpCase, normal

    def inputs(shape, rng):
        return (normal(shape, rng, 3.0), normal(shape, rng, 2.0), 1.0 + 0.5 * normal(shape[-1:], rng))

    def mixer_inputs(shape, rng):  # (tokens, sequences, hidden)
        lengths = {(1, 1): (1,), (4, 4): (1, 1, 1, 1), (12, 3): (5, 1, 6)}[shape[:2]]
        return mixer_case_inputs(MambaMixer2(**_CASE_MIXER), shape[0], rng, lengths)

    name = "mixer2_gated_rms_norm"
    groups_of = {200: 5, 256: 2, 136: 1}
    mixer = [OpCase(_MIXER, _MIXER, lambda s: MambaMixer2(**_CASE_MIXER), mixer_inputs,
                    ((1, 1, 16), (4, 4, 16), (12, 3, 16)))]
    return [
        OpCase(name, name, lambda s: Mixer2RMSNormGated(s[-1], 1), inputs, ((0, 136), (1, 200), (2, 3, 136))),
        OpCase(name, f"{name}[groups]", lambda s: Mixer2RMSNormGated(s[-1], groups_of[s[-1]]), inputs,
               ((0, 256), (1, 256), (5, 200), (2, 3, 200))),
        *mixer,
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- mixer2_gated_rms_norm: the Mamba-2 mixers' output norm -------------------------------
# The bench size (rows, hidden) in 8 groups (Nemotron-H-8B: hidden 8192 over 8 groups), gate like x,
# the weight in x's dtype. Peers: transformers' NemotronHRMSNormGated (the weight set to the call's)
# and the same math in jax.numpy under jit.
_GATED_NORM_GROUPS = 8


def _mixer2_gated_norm(hidden: int):
    from dualop.ops import Mixer2RMSNormGated

    return Mixer2RMSNormGated(hidden, _GATED_NORM_GROUPS if hidden % _GATED_NORM_GROUPS == 0 else 1)


def _mixer2_gated_norm_inputs(shape, rng):
    rows, hidden = shape
    return (rng.standard_normal((rows, hidden), dtype=np.float32),
            rng.standard_normal((rows, hidden), dtype=np.float32),
            1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32))


def _mixer2_gated_norm_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.rms_norm_gated_cost(shape[0], shape[1], op.group_size, itemsize, itemsize, True)


def _torch_nemotron_h_gated_norm(op):
    import torch
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    norm = NemotronHRMSNormGated(op.hidden_size, group_size=op.group_size, eps=op.eps)

    def run(x, gate, weight):
        with torch.no_grad():
            norm.weight.data = weight
            return norm(x, gate)

    return run


def _jax_gated_norm(op):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(x, gate, weight):
        h = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        g = h.reshape(*h.shape[:-1], -1, op.group_size)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + op.eps)
        return weight * g.reshape(h.shape).astype(x.dtype)

    return run


# --- mamba_mixer2: the Mamba-2 mixer -------------------------------------------------------
# The bench size is (tokens, hidden): the mixer has intermediate 2 x hidden in heads of 64, 8 groups
# (1 when the heads do not split into 8), state 128, kernel 4 (Nemotron-H-8B at hidden 4096). Three
# cases: the tokens as a prefill of one sequence, of eight equal ones, and as a decode step (one
# token per sequence); the sizes are ``1024x4096`` for the prefills and ``64x4096`` for the
# decode step. Every sequence starts from a fresh state (no cache given: the op returns the final
# states). Peers: transformers'
# Mamba-2 torch path (its causal_conv1d_fn and mamba2_chunk_scan fallbacks and MambaRMSNormGated,
# equal-length sequences as one batch), torch.compile of the native body (the bench's own), and for
# jax the native body under jit (a lax.scan over tokens). Not run by default (the native body loops
# over tokens in Python for torch): ``--ops mamba_mixer2 --sizes 1024x256``.
_MIXER2_MODES = ("prefill", "prefill_8seq", "decode")


def _mixer2_seqs(mode: str, tokens: int) -> int:
    return {"prefill": 1, "prefill_8seq": 8, "decode": tokens}[mode]


def _mixer2_op(hidden: int):
    from dualop.ops import MambaMixer2

    heads = 2 * hidden // 64
    return MambaMixer2(hidden, 128, 4, 2 * hidden, True, False, n_groups=8 if heads % 8 == 0 else 1,
                       num_heads=heads, head_dim=64)


def _mixer2_inputs(mode: str):
    def make(shape, rng):
        from dualop.ops.mamba_mixer2 import mixer_case_inputs

        tokens, seqs = shape[0], _mixer2_seqs(mode, shape[0])
        if tokens % seqs:
            raise ValueError(f"mamba_mixer2[{mode}]: {tokens} tokens do not split into {seqs} equal sequences")
        return mixer_case_inputs(_mixer2_op(shape[-1]), tokens, rng, (tokens // seqs,) * seqs)

    return make


def _mixer2_cost(mode: str):
    """The GEMMs, the conv, the scan (about 6 flops per state element per token) and the norm; bytes:
    the weights, x and out, and each sequence's final states written in float32."""

    def cost(op, shape, itemsize) -> KernelCost:
        return _mixer2_call_cost(op, shape, itemsize, _mixer2_seqs(mode, shape[0]))

    return cost


def _mixer2_call_cost(op, shape, itemsize, seqs: int) -> KernelCost:
    tokens, hidden = shape
    inter, heads = op.intermediate_size, op.num_heads
    states = op.num_heads * op.head_dim * op.ssm_state_size + op.conv_dim * (op.conv_kernel_size - 1)
    flops = (2 * tokens * hidden * (op.projection_size + inter) + 2 * tokens * op.conv_dim * op.conv_kernel_size
             + 6 * tokens * heads * op.head_dim * op.ssm_state_size + 6 * tokens * inter)
    weights = sum(math.prod(s) for s in op.parameter_shapes().values())
    return KernelCost(flops=flops, transcendentals=tokens * (op.conv_dim + 2 * heads + inter),
                      bytes_accessed=(weights + 2 * tokens * hidden) * itemsize + 4 * seqs * states)


def _transformers_mixer2(op):
    """transformers' Mamba-2 torch path (its causal_conv1d_fn and mamba2_chunk_scan fallbacks, its
    MambaRMSNormGated) over the batch's equal-length sequences, returning what the op returns (out,
    the conv states, the SSD states in float32). The conv and the scan run on float32 copies and
    their outputs are cast to x's dtype, where the engine's kernels round them (transformers' own
    16-bit path keeps the scan in float32 through the norm and rounds elsewhere, so its 16-bit
    results differ from the engine's by more than the tolerance table)."""
    import torch
    import torch.nn.functional as F
    from transformers.models.mamba2 import modeling_mamba2 as hf

    inter, conv_dim, heads = op.intermediate_size, op.conv_dim, op.num_heads
    gn, k = op.n_groups * op.ssm_state_size, op.conv_kernel_size
    norm = hf.MambaRMSNormGated(inter, inter // op.n_groups, op.norm.eps)

    def run(x, w_in, w_conv, b_conv, dt_bias, a_log, d, w_norm, w_out, b_in, b_out, conv_state, ssm_state, cu):
        seqs, f32 = cu.shape[0] - 1, torch.float32
        length = x.shape[0] // seqs
        z, xbc, dt = F.linear(x, w_in, b_in).view(seqs, length, -1).split([inter, conv_dim, heads], dim=-1)
        xbc = xbc.transpose(1, 2).float()
        conv_out = F.pad(xbc, (max(0, k - 1 - length), 0))[..., -(k - 1):]
        bias = None if b_conv is None else b_conv.float()
        xbc = hf.causal_conv1d_fn(xbc, w_conv.float(), bias, activation=op.activation).to(x.dtype).transpose(1, 2)
        xs, b, c = (t.float() for t in xbc.split([inter, gn, gn], dim=-1))
        y, final = hf.mamba2_chunk_scan(
            xs.reshape(seqs, length, heads, op.head_dim), dt.float(), -torch.exp(a_log.float()),
            b.reshape(seqs, length, op.n_groups, -1), c.reshape(seqs, length, op.n_groups, -1),
            chunk_size=op.chunk_size, D=d.to(f32), dt_bias=dt_bias.to(f32), dt_softplus=True,
            dt_limit=op.time_step_limit, return_final_states=True)
        norm.weight.data = w_norm
        y = norm(y.reshape(seqs, length, inter).to(x.dtype), z)
        return F.linear(y, w_out, b_out).reshape(x.shape[0], -1), conv_out, final.float()

    return run


def _jax_mixer2(op):
    return op.forward_native


def _mixer2_norm_op(shape: tuple[int, ...]):
    from dualop.ops import Mixer2RMSNormGated

    return Mixer2RMSNormGated(shape[-1], 8)


_NEMOTRON_H_8B_MIXER = dict(hidden_size=4096, ssm_state_size=128, conv_kernel_size=4, intermediate_size=8192,
                            use_conv_bias=True, use_bias=False, n_groups=8, num_heads=128, head_dim=64)


def _mamba_mixer2_op(shape: tuple[int, ...]):
    from dualop.ops import MambaMixer2

    return MambaMixer2(**_NEMOTRON_H_8B_MIXER)


def _mamba_mixer2_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs = shape
    op = _mamba_mixer2_op(shape)
    weights = {name: InputSpec(s, None) for name, s in op.parameter_shapes().items()}
    return (InputSpec((tokens, op.hidden_size), None), weights["in_proj_weight"], weights["conv_weight"],
            weights.get("conv_bias"), weights["dt_bias"], weights["A_log"], weights["D"], weights.get("norm_weight"),
            weights["out_proj_weight"], None, None, None, None, InputSpec((seqs + 1,), "int32"))


def bench_cases():
    """Not run by default: the gated norm against Nemotron-H's norm (torch) and a jax body; the mixer
    per mode against transformers' Mamba2Mixer slow path and a jax mixer."""
    return [
        BenchCase("mixer2_gated_rms_norm", "mixer2_gated_rms_norm", _mixer2_gated_norm, _mixer2_gated_norm_inputs,
                  _mixer2_gated_norm_cost, _torch_nemotron_h_gated_norm, _jax_gated_norm, default=False),
        *(BenchCase(f"mamba_mixer2[{mode}]", "mamba_mixer2", _mixer2_op, _mixer2_inputs(mode), _mixer2_cost(mode),
                    _transformers_mixer2, _jax_mixer2, default=False, matrix=True)
          for mode in _MIXER2_MODES),
    ]


def serving():
    """mixer2_gated_rms_norm: Nemotron-H-8B's mixer output (intermediate 8192, 8 groups; one group
    for Mamba-2 / Bamba), an 8192-token prefill and a 64-sequence decode step. mamba_mixer2:
    (tokens, sequences) at Nemotron-H-8B's widths (hidden 4096, intermediate 8192, 128 heads of 64 in
    8 groups of state 128, kernel 4), an 8192-token prefill of 8 sequences and a 64-sequence decode
    step, no caches (fresh states); bfloat16 only (a float32 Nemotron-H mixer at 8192 tokens took
    XLA:TPU over a minute; its kernel ops build float32 at serving shapes themselves)."""
    return {
        "mixer2_gated_rms_norm": Serving(((8192, 8192), (64, 8192)), None,
                                         {"mixer2_gated_rms_norm[groups]": _mixer2_norm_op}),
        "mamba_mixer2": Serving(((8192, 8), (64, 64)), _mamba_mixer2_inputs, {"mamba_mixer2": _mamba_mixer2_op},
                                ("bfloat16",)),
    }

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"mamba_mixer2": {"traits": {"structured_inputs", "widens_nonfinite", "packed_sequences", "mixer"},
                  "kernel_in_native_cells": {("jax", "cuda"): "forward_cuda"}}}
