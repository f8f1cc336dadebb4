"""LFM2's short convolution block: ``ShortConv`` (registered ``short_conv``), the serving engine's
``ShortConv`` mixer and transformers' ``Lfm2ShortConv``, over packed sequences with a conv-state
cache.

``op = ShortConv(hidden_size, conv_kernel, bias=False)``;
``out, conv_state = op(hidden_states [T, Hd], in_proj_weight [3 Hd, Hd], conv_weight [Hd, L],
out_proj_weight [Hd, Hd], conv_bias=None, conv_state=None [S, Hd, L - 1], cu_seqlens=None,
state_indices=None, has_initial_state=None, in_proj_bias=None, out_proj_bias=None)``:

    B, C, x = split(in_proj(hidden_states), 3)      # in this order along the features
    out = out_proj(C * causal_conv1d(B * x))         # width L, no activation

With ``bias=True`` (transformers' ``conv_bias``) the conv, in_proj and out_proj each have a bias
(all three required); with ``bias=False`` none may be given. The serving metadata and the cache
follow ``dualop.ops.ssm_batch`` (the conv's state: the last ``L - 1`` values of ``B * x``).
Everything is computed in float32; ``out`` is cast to ``hidden_states``' dtype.

The native body composes the references (float32 matmuls and ``ssm_math.causal_conv1d_reference``);
the platform methods run the projections with the frontend's own matmul (``F.linear`` / XLA dot,
in float32) and the ``causal_conv1d`` op, which dispatches to its own kernels.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from dualop.backends import array_namespace
from dualop.custom_op import CustomOp
from dualop.kernels import cost as cost_model
from dualop.kernels import ssm_math
from dualop.kernels.cost import KernelCost
from dualop.ops._checks import check_array, check_optional_like, check_positive_int
from dualop.ops._mixer import check_not_engine_mixer_call
from dualop.ops.causal_conv1d import CausalConv1d
from dualop.ops.ssm_batch import conv_sequences, fresh_equal_sequences, random_serving_batch, ssm_batch
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["ShortConv"]

OP = "short_conv"


@CustomOp.register(OP)
class ShortConv(CustomOp):
    """LFM2's gated short convolution (see the module docstring)."""

    # As causal_conv1d's: a given cache is updated in place and returned second.
    mutates_args: ClassVar[tuple[str, ...]] = ("conv_state",)
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "conv_state")

    def __init__(self, hidden_size: int, conv_kernel: int, bias: bool = False, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        check_positive_int(OP, "hidden_size", hidden_size)
        if check_positive_int(OP, "conv_kernel", conv_kernel) < 2:
            raise ValueError(f"{OP}: conv_kernel must be an int >= 2, got {conv_kernel!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"{OP}: bias must be a bool, got {bias!r}")
        self.hidden_size = hidden_size
        self.conv_kernel = conv_kernel
        self.bias = bias
        self.conv = CausalConv1d(hidden_size, conv_kernel, activation=None, enforce_enable=enforce_enable)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, conv_kernel={self.conv_kernel}, bias={self.bias}"

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One slot of the conv cache: the last ``L - 1`` values of ``B * x`` per channel."""
        return (self.hidden_size, self.conv_kernel - 1)

    def check_inputs(self, hidden_states: Any, in_proj_weight: Any = None, conv_weight: Any = None,
                     out_proj_weight: Any = None, conv_bias: Any = None, conv_state: Any = None,
                     cu_seqlens: Any = None, state_indices: Any = None, has_initial_state: Any = None,
                     in_proj_bias: Any = None, out_proj_bias: Any = None) -> None:
        h = hidden_states
        hd = self.hidden_size
        fe = check_array(OP, "hidden_states", h, min_ndim=2)
        if h.ndim != 2 or h.shape[1] != hd:
            raise ValueError(f"{OP}: argument 'hidden_states' has shape {tuple(h.shape)}; expected [tokens, {hd}]")
        check_not_engine_mixer_call(OP, "ShortConv", h, in_proj_weight, (3 * hd, hd))
        for name, value, shape in (("in_proj_weight", in_proj_weight, (3 * hd, hd)),
                                   ("conv_weight", conv_weight, (hd, self.conv_kernel)),
                                   ("out_proj_weight", out_proj_weight, (hd, hd))):
            if value is None:
                raise TypeError(f"{OP}: argument '{name}' is required; expected an array of shape {shape}")
            check_optional_like(OP, name, value, "hidden_states", h, fe, shape=shape, same_dtype=True)
        biases = (("conv_bias", conv_bias, (hd,)), ("in_proj_bias", in_proj_bias, (3 * hd,)),
                  ("out_proj_bias", out_proj_bias, (hd,)))
        for name, value, shape in biases:
            if (value is None) == self.bias:
                want = "is required (bias=True)" if self.bias else "must be None (bias=False)"
                raise ValueError(f"{OP}: argument '{name}' {want}")
            check_optional_like(OP, name, value, "hidden_states", h, fe, shape=shape, same_dtype=True)
        if conv_state is not None:
            check_optional_like(OP, "conv_state", conv_state, "hidden_states", h, fe,
                                shape=tuple(getattr(conv_state, "shape", ())))
        ssm_batch(OP, h, cu_seqlens, state_indices, has_initial_state, conv_state, "conv_state",
                  self.conv_state_shape)

    def _split(self, xp, bcx):
        hd = self.hidden_size
        return bcx[:, :hd], bcx[:, hd:2 * hd], bcx[:, 2 * hd:]

    def forward_native(self, hidden_states: Any, in_proj_weight: Any, conv_weight: Any, out_proj_weight: Any,
                       conv_bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None,
                       state_indices: Any = None, has_initial_state: Any = None, in_proj_bias: Any = None,
                       out_proj_bias: Any = None) -> tuple[Any, Any]:
        xp = array_namespace(hidden_states)
        f32 = xp.float32
        batch = ssm_batch(OP, hidden_states, cu_seqlens, state_indices, has_initial_state, conv_state, "conv_state",
                          self.conv_state_shape)
        bcx = xp.astype(hidden_states, f32) @ xp.astype(in_proj_weight, f32).T
        if in_proj_bias is not None:
            bcx = bcx + xp.astype(in_proj_bias, f32)
        b, c, x = self._split(xp, bcx)
        conv, state = ssm_math.causal_conv1d_reference(
            xp, b * x, conv_weight, conv_bias, batch.state, batch.cu_seqlens, batch.state_indices,
            batch.has_initial_state, None)
        out = (c * conv) @ xp.astype(out_proj_weight, f32).T
        if out_proj_bias is not None:
            out = out + xp.astype(out_proj_bias, f32)
        return xp.astype(out, hidden_states.dtype), state

    def forward_fake(self, hidden_states: Any, in_proj_weight: Any, conv_weight: Any, out_proj_weight: Any,
                     conv_bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                     has_initial_state: Any = None, in_proj_bias: Any = None, out_proj_bias: Any = None):
        """Empty results of the right shapes (torch.library's fake kernel), as ``causal_conv1d``'s."""
        return self.conv.forward_fake(hidden_states, conv_weight, conv_bias, conv_state, cu_seqlens)

    def _platform(self, hidden_states: Any, in_proj_weight: Any, conv_weight: Any, out_proj_weight: Any,
                  conv_bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None, state_indices: Any = None,
                  has_initial_state: Any = None, in_proj_bias: Any = None, out_proj_bias: Any = None) -> tuple[Any, Any]:
        """The vendor matmuls in float32 around the ``causal_conv1d`` op (its own kernels)."""
        fe = frontend_of(hidden_states)
        if family_of(fe) == "jax":
            import jax.numpy as jnp

            def linear(a, w, bias):
                y = jnp.dot(a, w.T, preferred_element_type=jnp.float32)
                return y if bias is None else y + bias.astype(jnp.float32)

            f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
        else:
            import torch
            import torch.nn.functional as F

            def linear(a, w, bias):
                return F.linear(a.to(torch.float32), w.to(torch.float32),
                                None if bias is None else bias.to(torch.float32))

            f32 = lambda a: None if a is None else a.to(torch.float32)  # noqa: E731
        bcx = linear(hidden_states, in_proj_weight, in_proj_bias)
        b, c, x = self._split(None, bcx)
        conv, state = self.conv(b * x, f32(conv_weight), f32(conv_bias), conv_state, cu_seqlens, state_indices,
                                has_initial_state)
        out = linear(c * conv, out_proj_weight, out_proj_bias)
        return out.astype(hidden_states.dtype) if family_of(fe) == "jax" else out.to(hidden_states.dtype), state

    # One shared body for every platform: the conv op picks its own kernel.
    forward_cpu = forward_cuda = forward_tpu = _platform


# (tokens, hidden, sequences) at LFM2's conv_L_cache = 3: one token, a decode step with a padding
# slot, a packed prefill (one sequence shorter than the 2-input history).
CHECK_SHAPES = ((1, 1, 16), (4, 4, 24), (17, 3, 16))  # (tokens, sequences, hidden)
CHECK_KERNEL = 3


def check_cases():
    from dualop.testing import OpCase, Pinned, normal

    def inputs(with_bias: bool):
        def make(shape, rng):
            tokens, seqs, hd = shape
            cu, slots, init, num_slots = random_serving_batch(tokens, seqs, rng)
            scale = hd ** -0.5
            bias = lambda n: normal((n,), rng, 0.5) if with_bias else None  # noqa: E731
            return (normal((tokens, hd), rng), normal((3 * hd, hd), rng, scale), normal((hd, CHECK_KERNEL), rng, 0.5),
                    normal((hd, hd), rng, scale), bias(hd), normal((num_slots, hd, CHECK_KERNEL - 1), rng),
                    Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(init, "bool"), bias(3 * hd), bias(hd))

        return make

    return [
        OpCase(OP, OP, lambda s: ShortConv(s[2], CHECK_KERNEL), inputs(False), CHECK_SHAPES),
        OpCase(OP, f"{OP}[bias]", lambda s: ShortConv(s[2], CHECK_KERNEL, bias=True), inputs(True), CHECK_SHAPES),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- short_conv: LFM2's gated short convolution block -----------------------------------
# The bench size (tokens, hidden) at LFM2's conv width 3, no biases: ``[prefill_8seq]`` packs the
# tokens into eight equal sequences, ``[decode]`` is one token per sequence (``64xH``: 64 sequences).
# Every sequence starts fresh (no initial state; the torch cache is updated in place, so repeated
# calls compute the same thing). Peers: transformers' Lfm2ShortConv math written out in torch (its
# slow path: in_proj, chunk into B, C, x, ``B * x``, a depthwise ``F.conv1d`` with ``L - 1`` zeros
# of padding cut back to the sequence, ``C *``, out_proj) on the equal-length sequences as a batch,
# in float32 like the op, and the native body under jit for jax.
_SHORT_CONV_WIDTH = 3


def _short_conv(hidden: int):
    from dualop.ops import ShortConv

    return ShortConv(hidden, _SHORT_CONV_WIDTH)


def _short_conv_inputs(split: str):
    def make(shape, rng):
        tokens, hidden = shape
        seqs = conv_sequences(split, tokens)
        scale = hidden ** -0.5
        return (rng.standard_normal((tokens, hidden), dtype=np.float32),
                scale * rng.standard_normal((3 * hidden, hidden), dtype=np.float32),
                0.5 * rng.standard_normal((hidden, _SHORT_CONV_WIDTH), dtype=np.float32),
                scale * rng.standard_normal((hidden, hidden), dtype=np.float32),
                None, np.zeros((seqs, hidden, _SHORT_CONV_WIDTH - 1), np.float32),
                *fresh_equal_sequences(tokens, seqs))

    return make


def _short_conv_cost(split: str):
    def cost(op, shape, itemsize) -> KernelCost:
        return cost_model.short_conv_cost(shape[0], shape[1], conv_sequences(split, shape[0]),
                                          _SHORT_CONV_WIDTH, itemsize)

    return cost


def _torch_lfm2_short_conv(op):
    """transformers' Lfm2ShortConv slow path in float32 over equal-length sequences as a batch."""
    import torch
    import torch.nn.functional as F

    width = op.conv_kernel

    def run(h, in_w, conv_w, out_w, conv_bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        f32 = torch.float32
        seqs, hidden = state_indices.shape[0], h.shape[1]
        bcx = F.linear(h.to(f32), in_w.to(f32)).view(seqs, -1, 3 * hidden).transpose(1, 2)  # [B, 3H, L]
        b, c, x = bcx.chunk(3, dim=1)
        bx = b * x
        length = bx.shape[-1]
        conv = F.conv1d(bx, conv_w.to(f32)[:, None], padding=width - 1, groups=hidden)[..., :length]
        out = F.linear((c * conv).transpose(1, 2).reshape(-1, hidden), out_w.to(f32))
        history = F.pad(bx, (width - 1, 0))[..., -(width - 1):]  # the last L - 1 inputs, zeros before
        conv_state[state_indices.long()] = history.to(conv_state.dtype)
        return out.to(h.dtype), conv_state

    return run


def _jax_short_conv(op):
    import jax

    return jax.jit(op.forward_native)


_SHORT_CONV_KERNEL, _SHORT_CONV_SLOTS = 3, 256  # LFM2's conv_L_cache; a 256-slot state cache


def _serving_short_conv_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, hidden = shape
    return (InputSpec((tokens, hidden), None), InputSpec((3 * hidden, hidden), None),
            InputSpec((hidden, _SHORT_CONV_KERNEL), None), InputSpec((hidden, hidden), None), None,
            InputSpec((_SHORT_CONV_SLOTS, hidden, _SHORT_CONV_KERNEL - 1), None), InputSpec((seqs + 1,), "int32"),
            InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"), None, None)


def bench_cases():
    """Not run by default: against transformers' Lfm2ShortConv math (torch) and a hand-written jax body."""
    return [BenchCase(f"short_conv[{split}]", "short_conv", _short_conv, _short_conv_inputs(split),
                      _short_conv_cost(split), _torch_lfm2_short_conv, _jax_short_conv, default=False, matrix=True)
            for split in ("prefill_8seq", "decode")]


def serving():
    """(tokens, sequences, hidden) at LFM2-1.2B's width (hidden 2048, conv_L_cache 3, no biases): the
    same prefill and decode batches as causal_conv1d."""
    return {"short_conv": Serving(((1024, 1, 2048), (1024, 8, 2048), (64, 64, 2048)), _serving_short_conv_inputs,
                                  cases=("short_conv",))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"short_conv": {"traits": {"case_shapes_only", "contraction", "widens_nonfinite", "packed_sequences"}}}
