"""The Mamba-2 mixer of the reference serving engine (Mamba-2, Bamba, Nemotron-H, Falcon-H1, Zamba2):
its gated output norm ``mixer2_gated_rms_norm`` and the whole mixer ``mamba_mixer2``.

Both run per tensor-parallel rank, as the engine's layers do: ``tp`` (a
``dualop.parallel.TensorParallel``; default the current group) gives the rank's share of the
heads and the collectives the math needs.
"""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.ops._checks import check_array, check_optional_like, cpu_declines
from dualop.ops.gated_norm import RMSNormGated
from dualop.parallel import TensorParallel, current_tensor_parallel, divide

__all__ = ["Mixer2RMSNormGated"]


def _positive_int(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{op}: argument {name!r} must be a positive int, got {value!r}")
    return value


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
        self.full_hidden_size = _positive_int(op, "full_hidden_size", full_hidden_size)
        self.full_n_groups = _positive_int(op, "full_n_groups", full_n_groups)
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
        return cpu_declines(method, frontend)

    # The kernels: rms_norm_gated's (gate before the norm, cast before the weight).
    def forward_cpu(self, x: Any, gate: Any, weight: Any = None) -> Any:
        return self._norm.forward_cpu(x, weight, gate)

    def forward_cuda(self, x: Any, gate: Any, weight: Any = None) -> Any:
        return self._norm.forward_cuda(x, weight, gate)

    def forward_tpu(self, x: Any, gate: Any, weight: Any = None) -> Any:
        return self._norm.forward_tpu(x, weight, gate)


def check_cases():
    """``dualop check`` cases: Mamba-2 / Bamba with one group (hidden off the lane grid) and
    Nemotron-H-like groups (lane-aligned and not), one rank."""
    from dualop.testing import OpCase, normal

    def inputs(shape, rng):
        return (normal(shape, rng, 3.0), normal(shape, rng, 2.0), 1.0 + 0.5 * normal(shape[-1:], rng))

    name = "mixer2_gated_rms_norm"
    groups_of = {200: 5, 256: 2, 136: 1}
    return [
        OpCase(name, name, lambda s: Mixer2RMSNormGated(s[-1], 1), inputs, ((0, 136), (1, 200), (2, 3, 136))),
        OpCase(name, f"{name}[groups]", lambda s: Mixer2RMSNormGated(s[-1], groups_of[s[-1]]), inputs,
               ((1, 256), (5, 200))),
    ]
