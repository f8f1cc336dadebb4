"""Depthwise causal conv1d over packed sequences with a conv-state cache: ``CausalConv1d``
(registered ``causal_conv1d``), the short convolution in front of every Mamba scan (and LFM2's
ShortConv).

``op = CausalConv1d(dim, kernel_size, activation="silu")``;
``y, conv_state = op(x, weight, bias=None, conv_state=None, cu_seqlens=None, state_indices=None,
has_initial_state=None)``.

- ``x`` ``[T, D]``: the tokens of B sequences packed along T (float32/bfloat16/float16).
- ``weight`` ``[D, K]``, ``bias`` ``[D]`` (optional), both in x's dtype.
- ``conv_state`` ``[S, D, K - 1]``: each slot holds a sequence's last ``K - 1`` inputs, oldest
  first. The serving metadata (``cu_seqlens``, ``state_indices`` with -1 for padding,
  ``has_initial_state``) and what happens to the cache are ``dualop.ops.ssm_batch``'s contract:
  torch updates the cache in place and returns it, jax returns a new one, no cache gives fresh
  float32 final states ``[B, D, K - 1]``.

``y[t, d] = act(bias[d] + sum_k weight[d, k] * window[d, k])`` with the window the sequence's previous
``K - 1`` inputs (from its cached state at its start) and ``x[t]``; computed in float32, ``y`` in
x's dtype (``ssm_math.causal_conv1d_reference``, the native body).

Kernels: Pallas (``kernels/pallas/causal_conv1d.py``: a prefill kernel tiled over T and D and a
decode-step kernel), Triton (``kernels/cuda/causal_conv1d.py``) and on the torch CPU one grouped
``F.conv1d`` over the sequences laid end to end, each behind its history
(``kernels/cpu/causal_conv1d.py``).

Strided inputs (any view: a transposed ``x``, a column of a metadata buffer, a strided bias or
cache): the Triton kernels take the strides of x, weight, bias and the cache (the cache is written
in place where it lies, never through a copy); ``ssm_batch`` hands every kernel contiguous int32
metadata; the torch CPU kernel is torch operations, which honour strides; jax arrays have none.
Bad traced metadata is read as ``ssm_batch`` says (``ssm_math.sanitize_metadata``), the same on
every path, and every kernel clamps the indices it reads from it.
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
from dualop.ops._checks import check_array, check_optional_like, check_positive_int
from dualop.ops.ssm_batch import SSMBatch, conv_sequences, random_serving_batch, ssm_batch
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["CausalConv1d"]

_PALLAS_CAUSAL_CONV1D = KernelRef("dualop.kernels.pallas.causal_conv1d", "causal_conv1d")
_TRITON_CAUSAL_CONV1D = KernelRef("dualop.kernels.cuda.causal_conv1d", "causal_conv1d")
_CPU_CAUSAL_CONV1D = KernelRef("dualop.kernels.cpu.causal_conv1d", "causal_conv1d")
_ACTIVATIONS = ("silu", None)
OP = "causal_conv1d"


def _torch_float32():
    import torch

    return torch.float32


@CustomOp.register(OP)
class CausalConv1d(CustomOp):
    """Depthwise causal conv1d with a per-sequence conv state (see the module docstring)."""

    # torch updates a given cache in place and returns it as the second result (torch.library:
    # ``dualop/backends/torch/library.py``); with no cache the second result is a new array.
    mutates_args: ClassVar[tuple[str, ...]] = ("conv_state",)
    mutated_results: ClassVar[tuple[str | None, ...]] = (None, "conv_state")

    def __init__(self, dim: int, kernel_size: int, activation: str | None = "silu", *,
                 enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        check_positive_int(OP, "dim", dim)
        if check_positive_int(OP, "kernel_size", kernel_size) < 2:
            raise ValueError(f"{OP}: kernel_size must be an int >= 2, got {kernel_size!r}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"{OP}: activation must be 'silu' or None, got {activation!r}")
        self.dim = dim
        self.kernel_size = kernel_size
        self.activation = activation

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kernel_size={self.kernel_size}, activation={self.activation!r}"

    @property
    def state_shape(self) -> tuple[int, int]:
        return (self.dim, self.kernel_size - 1)

    def _batch(self, x, conv_state, cu_seqlens, state_indices, has_initial_state) -> SSMBatch:
        return ssm_batch(OP, x, cu_seqlens, state_indices, has_initial_state, conv_state, "conv_state",
                         self.state_shape)

    def check_inputs(self, x: Any, weight: Any = None, bias: Any = None, conv_state: Any = None,
                     cu_seqlens: Any = None, state_indices: Any = None, has_initial_state: Any = None) -> None:
        fe = check_array(OP, "x", x, min_ndim=2)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{OP}: argument 'x' has shape {tuple(x.shape)}; expected [tokens, dim={self.dim}]")
        if weight is None:
            raise TypeError(f"{OP}: argument 'weight' is required; expected an array of shape "
                            f"({self.dim}, {self.kernel_size})")
        check_optional_like(OP, "weight", weight, "x", x, fe, shape=(self.dim, self.kernel_size), same_dtype=True)
        check_optional_like(OP, "bias", bias, "x", x, fe, shape=(self.dim,), same_dtype=True)
        if conv_state is not None:
            check_optional_like(OP, "conv_state", conv_state, "x", x, fe, shape=tuple(getattr(conv_state, "shape", ())))
        self._batch(x, conv_state, cu_seqlens, state_indices, has_initial_state)

    def forward_native(self, x: Any, weight: Any, bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None,
                       state_indices: Any = None, has_initial_state: Any = None) -> tuple[Any, Any]:
        batch = self._batch(x, conv_state, cu_seqlens, state_indices, has_initial_state)
        return ssm_math.causal_conv1d_reference(
            array_namespace(x), x, weight, bias, batch.state, batch.cu_seqlens, batch.state_indices,
            batch.has_initial_state, self.activation)

    def forward_fake(self, x: Any, weight: Any, bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None,
                     state_indices: Any = None, has_initial_state: Any = None) -> tuple[Any, Any]:
        """Empty results of the right shapes (torch.library's fake kernel: the token loop of the
        native body needs metadata values)."""
        if conv_state is not None:
            return x.new_empty(x.shape), conv_state
        seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return x.new_empty(x.shape), x.new_empty((seqs, *self.state_shape), dtype=_torch_float32())


    def _kernel_args(self, x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        batch = self._batch(x, conv_state, cu_seqlens, state_indices, has_initial_state)
        return batch, (x, weight, bias, batch.state, batch.cu_seqlens, batch.state_indices, batch.has_initial_state)

    def forward_cpu(self, x: Any, weight: Any, bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None,
                    state_indices: Any = None, has_initial_state: Any = None) -> tuple[Any, Any]:
        _, args = self._kernel_args(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state)
        return _CPU_CAUSAL_CONV1D(*args, activation=self.activation)

    def forward_cuda(self, x: Any, weight: Any, bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None,
                     state_indices: Any = None, has_initial_state: Any = None) -> tuple[Any, Any]:
        _, args = self._kernel_args(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state)
        return call_triton(frontend_of(x), _TRITON_CAUSAL_CONV1D, *args, activation=self.activation)

    def forward_tpu(self, x: Any, weight: Any, bias: Any = None, conv_state: Any = None, cu_seqlens: Any = None,
                    state_indices: Any = None, has_initial_state: Any = None) -> tuple[Any, Any]:
        """The Pallas kernels (decode step when T == B); torch frontends get the new cache written
        back into ``conv_state`` (``copy_``), so they see the update in place."""
        fe = frontend_of(x)
        batch, args = self._kernel_args(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state)

        def native(*arrays):
            return ssm_math.causal_conv1d_reference(array_namespace(arrays[0]), *arrays, self.activation)

        y, new_state = call_jax_function(fe, _PALLAS_CAUSAL_CONV1D, *args, native=native,
                                   activation=self.activation, decode=batch.decode)
        if family_of(fe) == "torch" and conv_state is not None:
            conv_state.copy_(new_state)
            return y, conv_state
        return y, new_state


# (tokens, dim, sequences): one token; a decode step (T == B) with a padding slot, D off the
# 128-lane grid; a packed prefill of new and continued sequences, some shorter than the window's
# history (K - 1 = 3). Three shapes keep the interpreted cells quick; T 1024 with T blocks
# splitting sequences runs once per kernel in tests/ops/test_causal_conv1d.py.
CHECK_SHAPES = ((1, 1, 128), (5, 5, 136), (21, 4, 128))  # (tokens, sequences, dim)
CHECK_KERNEL_SIZE = 4


def check_cases():
    """Serving batches over a cache of ``2B + 1`` slots (untouched slots must stay as they were):
    with bias and SiLU (Mamba), and without either (LFM2's ShortConv)."""
    from dualop.testing import OpCase, Pinned, normal

    def inputs(with_bias: bool):
        def make(shape, rng):
            tokens, sequences, dim = shape
            cu, slots, init, num_slots = random_serving_batch(tokens, sequences, rng)
            return (
                normal((tokens, dim), rng), 0.5 * normal((dim, CHECK_KERNEL_SIZE), rng),
                normal((dim,), rng) if with_bias else None, normal((num_slots, dim, CHECK_KERNEL_SIZE - 1), rng),
                Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(init, "bool"),
            )

        return make

    return [
        OpCase(OP, OP, lambda s: CausalConv1d(s[2], CHECK_KERNEL_SIZE), inputs(True), CHECK_SHAPES),
        OpCase(OP, f"{OP}[no_act,no_bias]", lambda s: CausalConv1d(s[2], CHECK_KERNEL_SIZE, activation=None),
               inputs(False), CHECK_SHAPES),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- causal_conv1d: the Mamba / LFM2 short convolution over packed sequences ------------
# The bench size (tokens, D) is x's shape at kernel width 4; the case fixes how the tokens are
# split: one sequence, eight, or one token per sequence (a decode step; ``64xD``: 64 sequences).
# Every sequence is new (no initial state), so repeated calls on the same inputs give the same
# outputs and final states (the torch cache is updated in place). Peers: transformers-style
# grouped ``F.conv1d`` over the sequences behind their histories (torch), a ``lax.scan`` over the
# tokens under jit (jax), and torch.compile of the native body (the bench's torch-compile impl).
_CONV_WIDTH = 4


def _causal_conv1d(dim: int):
    from dualop.ops import CausalConv1d

    return CausalConv1d(dim, _CONV_WIDTH)


def _causal_conv1d_inputs(split: str):
    def make(shape, rng):
        from dualop.ops.ssm_batch import random_serving_batch
        from dualop.testing import Pinned

        tokens, dim = shape
        cu, slots, _, num_slots = random_serving_batch(tokens, conv_sequences(split, tokens), rng, padding=False)
        return (rng.standard_normal((tokens, dim), dtype=np.float32),
                0.5 * rng.standard_normal((dim, _CONV_WIDTH), dtype=np.float32),
                rng.standard_normal(dim, dtype=np.float32),
                np.zeros((num_slots, dim, _CONV_WIDTH - 1), np.float32),
                Pinned(cu, "int32"), Pinned(slots, "int32"), Pinned(np.zeros(len(slots), bool), "bool"))

    return make


def _causal_conv1d_cost(split: str):
    def cost(op, shape, itemsize) -> KernelCost:
        return cost_model.causal_conv1d_cost(shape[0], shape[1], conv_sequences(split, shape[0]), _CONV_WIDTH,
                                             itemsize, True)

    return cost


def _torch_grouped_conv1d(op):
    from dualop.kernels.cpu.causal_conv1d import causal_conv1d_grouped_conv

    def run(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        return causal_conv1d_grouped_conv(x, weight, bias, conv_state, cu_seqlens, state_indices,
                                          has_initial_state, activation=op.activation)

    return run


def _jax_conv_scan(op):
    import jax

    from dualop.backends.xla import array_api
    from dualop.kernels import ssm_math

    @jax.jit
    def run(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state):
        return ssm_math.causal_conv1d_reference(array_api, x, weight, bias, conv_state, cu_seqlens, state_indices,
                                                has_initial_state, op.activation)

    return run


_CONV_SLOTS, _CONV_KERNEL = 256, 4


def _serving_causal_conv1d_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, seqs, dim = shape
    return (InputSpec((tokens, dim), None), InputSpec((dim, _CONV_KERNEL), None), InputSpec((dim,), None),
            InputSpec((_CONV_SLOTS, dim, _CONV_KERNEL - 1), None), InputSpec((seqs + 1,), "int32"),
            InputSpec((seqs,), "int32"), InputSpec((seqs,), "bool"))


def bench_cases():
    """Not run by default: one sequence, eight, or one token per sequence, against transformers-style
    grouped F.conv1d (torch) and a lax.scan over the tokens (jax)."""
    return [BenchCase(f"causal_conv1d[{split}]", "causal_conv1d", _causal_conv1d, _causal_conv1d_inputs(split),
                      _causal_conv1d_cost(split), _torch_grouped_conv1d, _jax_conv_scan, default=False)
            for split in ("prefill", "prefill_8seq", "decode")]


def serving():
    """(tokens, sequences, dim), as the check shapes: Mamba conv widths at kernel size 4
    (Falcon-Mamba-7B / Jamba's intermediate 8192 and Nemotron-H-8B's Mamba-2 conv input I + 2GN =
    8192 + 2 * 8 * 128); a 1024-token prefill of one and of eight sequences and a 64-sequence decode
    step, over a 256-slot state cache."""
    shapes = tuple((tokens, seqs, dim) for dim in (8192, 8192 + 2 * 8 * 128)
                   for tokens, seqs in ((1024, 1), (1024, 8), (64, 64)))
    return {"causal_conv1d": Serving(shapes, _serving_causal_conv1d_inputs, cases=("causal_conv1d",))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"causal_conv1d": {"traits": {"case_shapes_only", "contraction", "widens_nonfinite", "packed_sequences"}}}
