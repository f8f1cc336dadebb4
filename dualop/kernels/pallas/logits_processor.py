"""The LM head's logits with the soft cap and scale fused after the matmul, as a Pallas TPU kernel.

``logits[t, v] = epilogue(sum_h hidden[t, h] * weight[v, h] + bias[v])`` for the first ``rows``
weight rows (this rank's base vocabulary), where the epilogue is ``kernels/logits_math``'s
``cap_and_scale`` (``tanh(l / c) * c``, then ``* scale``), in float32, cast once to the input dtype.

Why a kernel: at a vocabulary of 128k-256k the logits ``[T, V]`` are the largest tensor of a step;
XLA's dot writes them and a separate soft-cap pass would read and write them again. Here they are
written once, already capped.

Tiling: grid ``(token blocks, vocab blocks, hidden blocks)``. Each step multiplies a hidden block
``[tm, tk]`` by a weight block ``[tv, tk]`` (streamed from HBM) on the MXU into a float32
accumulator ``[tm, tv]`` held in VMEM scratch; the last hidden step adds the bias, applies the
epilogue and writes the block once. The hidden dim is tiled (``tk`` divides it) when the blocks of
a wide model (H 8192) would not fit ``block_budget()``; the vocab axis may end ragged (Pallas masks
the edge block's writes, and the weight rows read past ``rows`` only feed those masked columns).
A decode batch is one token block, so the weight (the dominant read) streams through once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.backends.xla import array_api as xp
from dualop.kernels import cost as cost_model
from dualop.kernels.logits_math import LogitsSpec, cap_and_scale
from dualop.kernels.pallas.common import block_budget, compiler_params, cost_estimate, tpu_jit

__all__ = ["logits_processor", "logits_processor_reference", "LogitsBlocks", "logits_blocks"]

_MAX_TOKENS_BLOCK = 256
_MAX_VOCAB_BLOCK = 512
_MAX_HIDDEN_BLOCK = 4096


def logits_processor_reference(weight, hidden, bias=None, *, spec: LogitsSpec = LogitsSpec(), rows: int | None = None):
    """The plain jax.numpy statement of the kernel."""
    rows = weight.shape[0] if rows is None else rows
    y = jnp.einsum("th,vh->tv", hidden, weight[:rows], preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias[:rows].astype(jnp.float32)
    return cap_and_scale(xp, y, spec).astype(hidden.dtype)


@dataclasses.dataclass(frozen=True)
class LogitsBlocks:
    """Tokens, vocab rows and hidden columns per grid step, and the step's estimated VMEM bytes."""

    tokens: int
    vocab: int
    hidden: int
    vmem_bytes: int


def _step_bytes(tm: int, tv: int, tk: int, itemsize: int, tile: int) -> int:
    """One step's VMEM: double-buffered hidden, weight and output blocks, the float32 accumulator
    and one float32 epilogue temporary, each padded to whole (sublane, 128-lane) tiles."""
    pad = lambda n, m: -(-n // m) * m  # noqa: E731
    tm_p, tv_p, tk_p = pad(tm, tile), pad(tv, 128), pad(tk, 128)
    return 2 * (tm_p * tk_p + pad(tv, tile) * tk_p + tm_p * tv_p) * itemsize + 2 * tm_p * tv_p * 4


def logits_blocks(tokens: int, hidden: int, rows: int, weight_rows: int, itemsize: int) -> LogitsBlocks:
    """The blocks for ``tokens`` x ``hidden`` times ``rows`` of a ``weight_rows``-row weight.

    Raises NotImplementedError (the op then runs its native body) for the one layout Mosaic's
    tiling cannot express: fewer than 128 base rows that are not the whole weight."""
    tile = 8 * max(1, 4 // itemsize)
    if rows == weight_rows and rows <= _MAX_VOCAB_BLOCK:
        tv = rows  # the whole weight: exempt from the 128-lane rule
    else:
        tv = min(_MAX_VOCAB_BLOCK, -(-rows // 128) * 128)
        if tv > weight_rows:
            raise NotImplementedError(
                f"a shard of {rows} base rows in a {weight_rows}-row weight has no 128-row tiling")
    budget = block_budget()
    # lane-aligned divisors of the hidden size, largest first (4608: 2304, 1536, 1152, ...)
    divisors = [k for k in range(min(hidden, _MAX_HIDDEN_BLOCK) // 128 * 128, 0, -128) if hidden % k == 0]

    def hidden_block(tm: int) -> int:
        if _step_bytes(tm, tv, hidden, itemsize, tile) <= budget:
            return hidden
        fitting = [k for k in divisors if _step_bytes(tm, tv, k, itemsize, tile) <= budget]
        return fitting[0] if fitting else (divisors[-1] if divisors else hidden)

    # A decode batch is one token block. Prefill takes 512-token blocks where the budget still
    # leaves 512-wide hidden steps (v6e), else 256: the weight is re-read once per token block, so
    # taller blocks raise the flops per weight byte (512 x 512 tiles: about v5e's ridge point).
    if tokens <= _MAX_TOKENS_BLOCK:
        tm = tokens
    else:
        tm = 2 * _MAX_TOKENS_BLOCK if tokens >= 2 * _MAX_TOKENS_BLOCK and hidden_block(2 * _MAX_TOKENS_BLOCK) >= 512 \
            else _MAX_TOKENS_BLOCK
    tk = hidden_block(tm)
    return LogitsBlocks(tm, tv, tk, _step_bytes(tm, tv, tk, itemsize, tile))


def _kernel(*refs, spec: LogitsSpec, has_bias: bool, precision):
    if has_bias:
        h_ref, w_ref, b_ref, o_ref, acc_ref = refs
    else:
        (h_ref, w_ref, o_ref, acc_ref), b_ref = refs, None
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jax.lax.dot_general(h_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                        precision=precision, preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        y = acc_ref[...]
        if has_bias:
            y = y + b_ref[...].astype(jnp.float32)
        o_ref[...] = cap_and_scale(xp, y, spec).astype(o_ref.dtype)


@tpu_jit(static_argnames=("spec", "rows", "interpret"))
def logits_processor(weight: jax.Array, hidden: jax.Array, bias: jax.Array | None = None, *,
                     spec: LogitsSpec = LogitsSpec(), rows: int | None = None, interpret=False):
    """``[..., rows]`` logits of ``hidden`` ``[..., H]`` against the first ``rows`` rows of
    ``weight`` ``[R, H]`` (default all), plus ``bias[:rows]``, with ``spec``'s epilogue."""
    rows = weight.shape[0] if rows is None else rows
    lead, hidden_size = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(-1, hidden_size)
    tokens, dtype = h2.shape[0], hidden.dtype
    if tokens == 0:
        return jnp.zeros((*lead, rows), dtype)
    blocks = logits_blocks(tokens, hidden_size, rows, weight.shape[0], dtype.itemsize)
    tm, tv, tk = blocks.tokens, blocks.vocab, blocks.hidden
    grid = (pl.cdiv(tokens, tm), pl.cdiv(rows, tv), hidden_size // tk)
    in_specs = [pl.BlockSpec((tm, tk), lambda i, j, k: (i, k)), pl.BlockSpec((tv, tk), lambda i, j, k: (j, k))]
    operands = [h2, weight]
    if bias is not None:
        in_specs.append(pl.BlockSpec((1, tv), lambda i, j, k: (0, j)))
        operands.append(bias.reshape(1, -1))
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, spec=spec, has_bias=bias is not None, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tv), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((tokens, rows), dtype),
        scratch_shapes=[pltpu.VMEM((tm, tv), jnp.float32)],
        compiler_params=compiler_params(3, vmem_bytes=blocks.vmem_bytes,
                                        semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(cost_model.logits_processor_cost(
            tokens, hidden_size, rows, dtype.itemsize, bias is not None, spec.soft_cap is not None)),
        interpret=interpret,
        name="dualop_logits_processor",
    )(*operands)
    return out.reshape(*lead, rows)
