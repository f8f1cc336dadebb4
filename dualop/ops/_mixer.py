"""The projections of the Mamba-family mixers (``mamba_mixer``, ``mamba_mixer2``,
``plamo2_mamba_mixer``): one rule for their GEMMs.

Each projection is a one-rank ``ReplicatedLinear``: the native body runs its reference
(``_native_gemm``: float32 operands at full precision, one rounding to x's dtype), and a platform
method runs the same platform method of the linear op, so a mixer's matmuls are the vendor GEMM the
linear ops use (``F.linear`` on the torch CPU and GPUs; XLA's dot through the Pallas bridge on a
TPU, from jax, torch_xla, torchax and torch_tpu).
"""

from __future__ import annotations

from typing import Any

from dualop.backends import array_namespace
from dualop.ops._checks import check_not_engine_activation
from dualop.ops.linear import ReplicatedLinear
from dualop.ops.ssm_batch import SSMBatch, ssm_batch
from dualop.parallel import TensorParallel

__all__ = ["projection", "project", "mixer_batches", "MixerPlatformMethods", "check_not_engine_mixer_call"]


def check_not_engine_mixer_call(op: str, layer: str, hidden_states: Any, in_proj_weight: Any,
                                expected: tuple[int, ...]) -> None:
    """Refuse the engine's mixer call ``mixer(hidden_states, output)`` (its output buffer lands where
    the op takes ``in_proj_weight``), saying what takes the call instead."""
    check_not_engine_activation(
        op, "in_proj_weight", in_proj_weight, "hidden_states", hidden_states, expected,
        "mixer(hidden_states, output)", "op(hidden_states, in_proj_weight, ...)",
        f"the layer {layer} (dualop.torch.layers / dualop.jax.layers), which owns the weights; the engine reads its "
        f"caches from its forward context and writes into 'output', dualop takes the caches as arguments and "
        f"returns (out, conv_state, ...)")


def mixer_batches(op: str, hidden_states: Any, conv_state: Any, ssm_state: Any, cu_seqlens: Any,
                  state_indices: Any, has_initial_state: Any, conv_state_shape: tuple[int, ...],
                  ssm_state_shape: tuple[int, ...]) -> tuple[SSMBatch, SSMBatch]:
    """A mixer's two caches validated against the layer and each other (both or neither, one slot
    count): the conv's and the scan's serving batches."""
    if (conv_state is None) != (ssm_state is None):
        given, missing = ("conv_state", "ssm_state") if ssm_state is None else ("ssm_state", "conv_state")
        raise ValueError(f"{op}: argument '{given}' is given but '{missing}' is None; pass both caches or neither")
    conv = ssm_batch(op, hidden_states, cu_seqlens, state_indices, has_initial_state, conv_state, "conv_state",
                     conv_state_shape)
    ssm = ssm_batch(op, hidden_states, cu_seqlens, state_indices, has_initial_state, ssm_state, "ssm_state",
                    ssm_state_shape)
    if conv_state is not None and conv_state.shape[0] != ssm_state.shape[0]:
        raise ValueError(f"{op}: argument 'ssm_state' has {ssm_state.shape[0]} slots but 'conv_state' has "
                         f"{conv_state.shape[0]}; expected one slot count for both caches")
    return conv, ssm


def projection(input_size: int, output_size: int, bias: bool = False) -> ReplicatedLinear:
    """A mixer's projection ``y = x @ W.T (+ b)``, ``W [output_size, input_size]``, on one rank."""
    return ReplicatedLinear(input_size, output_size, bias=bias, return_bias=False, tp=TensorParallel(),
                            enforce_enable=True)


def project(linear: ReplicatedLinear, method: str, x: Any, weight: Any, bias: Any = None) -> Any:
    """``linear``'s ``method`` (``forward_native`` or the mixer's own platform method) on ``x``. The
    vendor GEMM takes operands of one dtype, so a platform method casts a weight or bias of another
    dtype (each on its own) to x's; the reference multiplies them in float32 as given."""
    if method != "forward_native":
        xp = array_namespace(x)
        weight = weight if weight.dtype == x.dtype else xp.astype(weight, x.dtype)
        bias = bias if bias is None or bias.dtype == x.dtype else xp.astype(bias, x.dtype)
    return getattr(linear, method)(x, weight, bias)


class MixerPlatformMethods:
    """The platform methods of a mixer whose one platform body is
    ``_forward_kernels(method, *args, **kwargs)``: the projections' ``method`` around the kernel ops,
    each of which dispatches to its own kernel."""

    # What every op serves (DEFAULT_SERVES): forward_cpu and the GPU methods torch tensors (the
    # kernel ops' C++ and Triton kernels take torch tensors), so jax arrays run the native body.

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """torch on the CPU: ``F.linear`` and the kernel ops' CPU kernels."""
        return self._forward_kernels("forward_cpu", *args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        """torch on a GPU: cuBLAS through ``F.linear`` and the kernel ops' Triton kernels."""
        return self._forward_kernels("forward_cuda", *args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> Any:
        """On a TPU: XLA's dot and the kernel ops' Pallas kernels (reached through their bridges)."""
        return self._forward_kernels("forward_tpu", *args, **kwargs)
