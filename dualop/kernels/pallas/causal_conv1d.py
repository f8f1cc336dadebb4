"""Depthwise causal conv1d over packed sequences as Pallas TPU kernels: the ``causal_conv1d``
op's fast path (contract: ``dualop/ops/causal_conv1d.py``; math: ``ssm_math.causal_conv1d_reference``).

Prefill (``_prefill_kernel``), grid ``(D blocks, T blocks)``, every step independent (a token's
window is its K - 1 predecessors, not a carried state): the step's x block ``[bt, bd]`` goes to a
float32 VMEM scratch behind the last ``_HALO`` rows of the previous T block (a second, small view
of x), and ``y = bias + sum_k w[k] * rows shifted by K - 1 - k`` for the whole block. Then the
first K - 1 tokens of each sequence that starts in (or just before) the block are recomputed one
row each, their window's head taken from the sequence's starting state (``init``, ``[K - 1, B,
bd]`` in VMEM) instead of the previous sequence's tokens: a scalar loop over those sequences whose
range per T block (``fix_first``, ``seq_last``) and ``cu_seqlens`` / ``state_indices`` are
scalar-prefetched to SMEM. Rows of padding sequences (slot -1) are zeroed by a mask built in the same
loop. The starting states are gathered from the cache and the final states (each sequence's last
K - 1 inputs, from its tokens or, for a sequence shorter than that, partly from its starting state)
scattered back by XLA around the kernel: ``B (K - 1) D`` elements, small next to x. Tokens past
``cu_seqlens[B]`` (traced metadata that ends early) are masked as padding rows are, by selects.

Decode (``_decode_kernel``, T == B): grid ``(D blocks, B blocks)``; each sequence's window is its
starting state and its one token; the kernel also emits the shifted window (the new state).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels import ssm_math
from dualop.kernels.cost import causal_conv1d_cost
from dualop.kernels.pallas.common import compiler_params, cost_estimate, rowwise_batching, tpu_jit
from dualop.backends.xla import array_api as _xp

__all__ = ["causal_conv1d", "causal_conv1d_cost", "ConvBlocks"]

_HALO = 16  # rows of the previous T block each prefill step reads (>= K - 1; a bf16 sublane tile)


@dataclasses.dataclass(frozen=True)
class ConvBlocks:
    """Tile sizes: tokens (prefill) or sequences (decode) per step, and channels per step."""

    block_tokens: int = 256
    block_dim: int = 512

    def dim_block(self, dim: int) -> int:
        """A 128-lane multiple dividing ``dim``, or the whole dim when it is off the lane grid."""
        if dim % 128:
            return dim
        block = min(self.block_dim, dim) // 128 * 128
        while dim % block:
            block -= 128
        return block


def _silu(v):
    return v * jax.nn.sigmoid(v)


def _prefill_kernel(cu_ref, slot_ref, fix_first_ref, seq_last_ref, x_ref, halo_ref, init_ref, w_ref, b_ref, y_ref,
                    ext_ref, acc_ref, *, kernel_size: int, block_tokens: int, has_halo: bool, activation):
    hist = kernel_size - 1
    i = pl.program_id(1)
    blk_start = i * block_tokens
    if has_halo:
        ext_ref[0:_HALO, :] = halo_ref[...].astype(jnp.float32)
    else:
        ext_ref[0:_HALO, :] = jnp.zeros((_HALO, ext_ref.shape[1]), jnp.float32)
    ext_ref[_HALO:, :] = x_ref[...].astype(jnp.float32)
    w = w_ref[...]  # [K, bd] float32
    acc = b_ref[...] + w[0:1, :] * ext_ref[_HALO - hist:_HALO - hist + block_tokens, :]
    for k in range(1, kernel_size):
        acc = acc + w[k:k + 1, :] * ext_ref[_HALO - hist + k:_HALO - hist + k + block_tokens, :]
    acc_ref[...] = acc

    def fix_sequence(b, keep):
        """Recompute the rows of sequence b's first K - 1 tokens in this block; mask its rows if padding."""
        start, end = cu_ref[b], cu_ref[b + 1]
        for j in range(hist):
            t = start + j

            @pl.when((t >= blk_start) & (t < blk_start + block_tokens) & (t < end))
            def _():
                r = t - blk_start
                total = b_ref[...]
                for k in range(kernel_size):
                    rel = j - hist + k  # the source token's offset from the sequence start
                    if rel >= 0:
                        src = ext_ref[pl.ds(_HALO + r - j + rel, 1), :]
                    else:
                        src = init_ref[j + k, pl.ds(b, 1), :]  # state column hist + rel
                    total = total + w[k:k + 1, :] * src
                acc_ref[pl.ds(r, 1), :] = total

        rows = jax.lax.broadcasted_iota(jnp.int32, keep.shape, 0) + blk_start
        padding = (slot_ref[b] < 0) & (rows >= start) & (rows < end)
        return jnp.where(padding, 0.0, keep)

    keep = jax.lax.fori_loop(fix_first_ref[i], seq_last_ref[i] + 1, fix_sequence,
                             jnp.ones((block_tokens, 1), jnp.float32))
    rows = jax.lax.broadcasted_iota(jnp.int32, keep.shape, 0) + blk_start
    keep = jnp.where(rows >= cu_ref[cu_ref.shape[0] - 1], 0.0, keep)  # tokens no sequence owns
    y = acc_ref[...]
    if activation == "silu":
        y = _silu(y)
    y_ref[...] = jnp.where(keep > 0, y, 0.0).astype(y_ref.dtype)  # a select: a NaN in a dropped row stays there


def _decode_kernel(x_ref, init_ref, w_ref, b_ref, keep_ref, y_ref, new_ref, *, kernel_size: int, activation):
    hist = kernel_size - 1
    w = w_ref[...]
    xf = x_ref[...].astype(jnp.float32)
    acc = b_ref[...] + w[hist:hist + 1, :] * xf
    for k in range(hist):
        acc = acc + w[k:k + 1, :] * init_ref[k]
    for k in range(hist - 1):
        new_ref[k] = init_ref[k + 1]
    new_ref[hist - 1] = xf
    if activation == "silu":
        acc = _silu(acc)
    y_ref[...] = jnp.where(keep_ref[...] > 0, acc, 0.0).astype(y_ref.dtype)


def _final_states(x, init, cu, hist):
    """Each sequence's last ``hist`` inputs ``[B, hist, D]`` float32: from its tokens, or (a sequence
    shorter than ``hist``) the tail of its starting state ``init`` ``[B, hist, D]`` before them."""
    starts, ends = cu[:-1], cu[1:]
    src = ends[:, None] - hist + jnp.arange(hist, dtype=jnp.int32)[None, :]  # [B, hist] token positions
    from_x = src >= starts[:, None]
    xs = jnp.take(x, jnp.clip(src, 0, x.shape[0] - 1), axis=0).astype(jnp.float32)
    state_col = jnp.clip(hist + src - starts[:, None], 0, hist - 1)
    ss = jnp.take_along_axis(init, state_col[:, :, None], axis=1)
    return jnp.where(from_x[:, :, None], xs, ss)


def _store(conv_state, slots, finals):
    """Write ``finals [B, hist, D]`` into the cache ``[S, D, hist]`` at ``slots`` (padding dropped)."""
    num_slots = conv_state.shape[0]
    index = jnp.where(slots >= 0, slots, num_slots)
    return conv_state.at[index].set(jnp.swapaxes(finals, 1, 2).astype(conv_state.dtype), mode="drop")


@tpu_jit(static_argnames=("activation", "decode", "interpret", "blocks"))
def causal_conv1d(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state, *, activation="silu",
                  decode=False, interpret=False, blocks: ConvBlocks = ConvBlocks()):
    """``(y [T, D], new conv_state)`` for x ``[T, D]``, weight ``[D, K]``, bias ``[D]`` or None,
    conv_state ``[S, D, K - 1]`` and int32/bool serving metadata (validated by the op). ``decode``
    (T == B) takes the single-step kernel. Under ``vmap`` (independent serving batches) the batch is
    mapped with ``lax.map``, one kernel call per batch item."""
    static = dict(activation=activation, decode=decode, interpret=interpret, blocks=blocks)
    if bias is None:
        def call(x, weight, conv_state, cu, slots, init):
            return _causal_conv1d(x, weight, None, conv_state, cu, slots, init, **static)

        return rowwise_batching(call, 0)(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state)
    return rowwise_batching(functools.partial(_causal_conv1d, **static), 0)(
        x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state)


def _causal_conv1d(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state, *, activation,
                   decode, interpret, blocks):
    num_tokens, dim = x.shape
    kernel_size = weight.shape[1]
    hist = kernel_size - 1
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0:
        return x, conv_state
    # every index the kernels read in bounds, bad traced metadata read as the native body reads it
    cu, slots = ssm_math.sanitize_metadata(_xp, cu_seqlens, state_indices, num_tokens, conv_state.shape[0])
    init = ssm_math.initial_states(_xp, conv_state, slots, has_initial_state)  # [B, D, hist] float32
    init_t = jnp.transpose(init, (2, 0, 1))  # [hist, B, D]: one lane-dense [B, D] tile per tap
    w = jnp.transpose(weight.astype(jnp.float32))  # [K, D]
    b = (jnp.zeros((dim,), jnp.float32) if bias is None else bias.astype(jnp.float32)).reshape(1, dim)
    bd = blocks.dim_block(dim)
    itemsize = jnp.dtype(x.dtype).itemsize
    if decode:
        bb = num_seqs if num_seqs <= blocks.block_tokens else blocks.block_tokens
        grid = (dim // bd, pl.cdiv(num_seqs, bb))
        keep = (slots >= 0).astype(jnp.float32).reshape(num_seqs, 1)
        kernel = functools.partial(_decode_kernel, kernel_size=kernel_size, activation=activation)
        y, new = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[
                pl.BlockSpec((bb, bd), lambda j, i: (i, j)),
                pl.BlockSpec((hist, bb, bd), lambda j, i: (0, i, j)),
                pl.BlockSpec((kernel_size, bd), lambda j, i: (0, j)),
                pl.BlockSpec((1, bd), lambda j, i: (0, j)),
                pl.BlockSpec((bb, 1), lambda j, i: (i, 0)),
            ],
            out_specs=[pl.BlockSpec((bb, bd), lambda j, i: (i, j)),
                       pl.BlockSpec((hist, bb, bd), lambda j, i: (0, i, j))],
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                       jax.ShapeDtypeStruct((hist, num_seqs, dim), jnp.float32)],
            compiler_params=compiler_params(2, vmem_bytes=2 * bb * bd * (2 * itemsize + 8 * hist + 8)),
            cost_estimate=cost_estimate(causal_conv1d_cost(num_tokens, dim, num_seqs, kernel_size, itemsize,
                                                           activation == "silu")),
            interpret=interpret,
        )(x, init_t, w, b, keep)
        return y, _store(conv_state, slots, jnp.transpose(new, (1, 0, 2)))

    bt = num_tokens if num_tokens <= blocks.block_tokens else blocks.block_tokens
    steps = pl.cdiv(num_tokens, bt)
    has_halo = steps > 1
    # Per T block: the first sequence that may start within K - 2 tokens before it (its first
    # tokens' windows reach the block) and the last sequence in it.
    blk = jnp.arange(steps, dtype=jnp.int32) * bt
    seq_of = lambda t: jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)  # noqa: E731
    fix_first = seq_of(jnp.maximum(blk - (hist - 1), 0))
    seq_last = jnp.minimum(seq_of(jnp.minimum(blk + bt, num_tokens) - 1), num_seqs - 1)
    kernel = functools.partial(_prefill_kernel, kernel_size=kernel_size, block_tokens=bt, has_halo=has_halo,
                               activation=activation)
    halo_blocks = bt // _HALO
    halo_spec = (pl.BlockSpec((_HALO, bd), lambda j, i, *_: (jnp.maximum(i * halo_blocks - 1, 0), j))
                 if has_halo else pl.BlockSpec((bt, bd), lambda j, i, *_: (0, j)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(dim // bd, steps),
        in_specs=[
            pl.BlockSpec((bt, bd), lambda j, i, *_: (i, j)),
            halo_spec,
            pl.BlockSpec((hist, num_seqs, bd), lambda j, i, *_: (0, 0, j)),
            pl.BlockSpec((kernel_size, bd), lambda j, i, *_: (0, j)),
            pl.BlockSpec((1, bd), lambda j, i, *_: (0, j)),
        ],
        out_specs=pl.BlockSpec((bt, bd), lambda j, i, *_: (i, j)),
        scratch_shapes=[pltpu.VMEM((_HALO + bt, bd), jnp.float32), pltpu.VMEM((bt, bd), jnp.float32)],
    )
    vmem = bd * (2 * 2 * bt * itemsize + 2 * _HALO * itemsize + 2 * hist * num_seqs * 4 + (2 * bt + _HALO) * 4)
    y = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params(2, vmem_bytes=vmem),
        cost_estimate=cost_estimate(causal_conv1d_cost(num_tokens, dim, num_seqs, kernel_size, itemsize,
                                                       activation == "silu")),
        interpret=interpret,
    )(cu, slots, fix_first, seq_last, x, x, init_t, w, b)
    finals = _final_states(x, jnp.swapaxes(init, 1, 2), cu, hist)
    return y, _store(conv_state, slots, finals)
