"""The MoE experts (``unquantized_fused_moe``) on TPU: two grouped matmuls over the (token, slot)
pairs sorted by expert, the activation fused into the first.

1. Routing to rows: ``moe_math.local_expert_ids`` and ``moe_math.sort_by_expert`` order the
   ``T * k`` pairs by local expert (pairs for other devices' experts last); x's rows are gathered
   in that order and padded to whole row tiles.
2. First projection (this module's kernel): for each row tile and intermediate block, the gate
   and up tiles of the SAME intermediate block are accumulated side by side (two index maps into
   ``w13``: gate-first ``[E, 2I, H]`` reads rows ``n`` and ``n + I/ti`` blocks; gpt-oss's
   interleaved layout viewed as ``[E, I, 2H]`` reads columns ``k`` and ``k + H/th`` blocks, so no
   weight is ever gathered or de-interleaved), and the epilogue applies the router weight (with
   ``apply_router_weight_on_input``), ``w13_bias`` and the activation (``gate_math.apply_gate``,
   ``moe_math.activate`` for ``relu2``) in float32, storing only the rows of the tile's expert.
   The tiles each grid step visits come from megablox's ``make_group_metadata`` (JAX's shipped
   grouped-matmul metadata: which expert and which row tile each step works on, tiles shared by
   two experts visited once per expert, empty experts not at all); its step axis is as long as
   that metadata's tile count, known only at run time (a dynamic grid, as ``gmm`` has: a static
   worst case of ``row_tiles + E - 1`` steps would idle through every empty expert's H blocks,
   most of a decode step's grid with 32 local experts).
3. Second projection: JAX's shipped megablox ``gmm`` (``transpose_rhs=True`` reads ``w2``
   ``[E, H, I]`` as stored). The float32 activation is never rounded to 16 bits: with 16-bit
   weights it is split into ``hi = bf16(a)`` and ``lo = bf16(a - hi)`` and the two ``gmm``
   products (float32 accumulation) are added, as the paged-attention kernels do for ``p . v``.
4. Combine: back to pair order, ``w2_bias`` added, weighted by the routing weights, summed per
   token in float32 and cast once (not at all with ``float32_output``). Rows no expert wrote (past
   ``sum(group_sizes)``: pairs routed elsewhere and row padding) hold whatever ``gmm`` left there:
   they are selected away with ``where``, never multiplied by a zero weight (garbage may be NaN).

H and I that are not multiples of 128 are zero-padded (an exact no-op: padded columns of x and
rows of the weights add zeros; a zero pre-activation activates to zero in every activation). That
copies the weights on each call, so it is for small odd shapes; serving sizes are aligned.

XLA's own grouped matmul, ``jax.lax.ragged_dot``, is the path to compare with. Compiled for v5e here
(libtpu's compile-only device, Qwen3-235B experts: E 128, H 4096, I 1536, top 8, bfloat16; the same
sort, gather, float32 activation with hi/lo halves and combine around two ``ragged_dot`` calls), XLA's
cost analysis of the compiled program at 16 tokens counts 8.3e11 flops for the ``ragged_dot``
version, the dense work of every expert on every row, against 6.5e9 for this one (whose Pallas
calls XLA counts by their own cost estimates: the grouped matmuls over the padded sorted rows), and 3 GiB of
temporaries against 3 MiB (the ``ragged_dot`` operands need ``w13`` and ``w2`` transposed). At 8192
tokens both took about 30 s to compile on a loaded 2-core host, most of it XLA's (the stable sort
of the 65536 pairs alone is about 10 s). Not timed on a TPU: none here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.backends.xla import array_api as xp
from dualop.kernels import moe_math
from dualop.kernels.cost import KernelCost
from dualop.kernels.gate_math import apply_gate
from dualop.kernels.pallas.common import block_budget, compiler_params, cost_estimate, tpu_jit

__all__ = ["fused_experts", "MoeBlocks", "moe_blocks"]

# JAX's grouped matmul (`megablox` exports the function under the module's name, so the module is
# imported by path); present with the same signatures in jax 0.7.1 and 0.10.2.
_megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

_LANE = 128
_ROW_TILE = 16  # rows of a 16-bit vreg tile: the hi/lo halves fed to gmm are 16-bit
_MAX_BLOCK_ROWS = 256
_BLOCK_CHOICES = (512, 256, 128)


@dataclasses.dataclass(frozen=True)
class MoeBlocks:
    """Tiles of both grouped matmuls: ``rows`` sorted rows, ``hidden`` columns of H (the first
    projection's contraction block, the second's output block), ``inter`` columns of I (the
    first's output block, the second's contraction block)."""

    rows: int
    hidden: int
    inter: int

    def gate_up_vmem(self, itemsize: int, gated: bool) -> int:
        """Estimated VMEM of one step of the first projection: double-buffered x and weight tiles
        and float32 output, float32 accumulators and epilogue temporaries."""
        parts = 2 if gated else 1
        tile_out = self.rows * self.inter * 4
        return (2 * self.rows * self.hidden * itemsize + 2 * parts * self.inter * self.hidden * itemsize
                + 2 * tile_out + parts * tile_out + 4 * tile_out)

    def down_vmem(self, itemsize: int) -> int:
        """Estimated VMEM of one step of ``gmm`` for the second projection."""
        tile_out = self.rows * self.hidden * 4
        return 2 * self.rows * self.inter * itemsize + 2 * self.hidden * self.inter * itemsize + 3 * tile_out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _largest_dividing(size: int, cap: int) -> int:
    return next(b for b in _BLOCK_CHOICES if b <= cap and size % b == 0)


def moe_blocks(num_rows: int, hidden: int, inter: int, itemsize: int, gated: bool) -> MoeBlocks:
    """Tiles for ``num_rows`` sorted rows and (128-aligned) ``hidden``/``inter`` within
    ``block_budget()`` of the current TPU generation: the widest column blocks dividing the sizes,
    narrowed (intermediate first, then hidden, then rows) until both projections' steps fit."""
    rows = min(_MAX_BLOCK_ROWS, _round_up(max(num_rows, 1), _ROW_TILE))
    blocks = MoeBlocks(rows, _largest_dividing(hidden, 512), _largest_dividing(inter, 512))
    budget = block_budget()
    while max(blocks.gate_up_vmem(itemsize, gated), blocks.down_vmem(itemsize)) > budget:
        if blocks.inter > _LANE:
            blocks = dataclasses.replace(blocks, inter=_largest_dividing(inter, blocks.inter // 2))
        elif blocks.hidden > _LANE:
            blocks = dataclasses.replace(blocks, hidden=_largest_dividing(hidden, blocks.hidden // 2))
        elif blocks.rows > _ROW_TILE:
            blocks = dataclasses.replace(blocks, rows=max(_ROW_TILE, blocks.rows // 2 // _ROW_TILE * _ROW_TILE))
        else:
            break
    return blocks


# ---------------------------------------------------------------------------------- first projection


def _gate_up_kernel(group_offsets, group_ids, m_tile_ids, x_ref, *refs, activation: str, has_bias: bool,
                    has_scale: bool, tiles_k: int):
    gated = moe_math.is_gated(activation)
    it = iter(refs)
    gate_w = next(it)
    up_w = next(it) if gated else None
    bias = next(it) if has_bias else None
    scale = next(it) if has_scale else None
    out = next(it)
    gate_acc = next(it)
    up_acc = next(it) if gated else None
    step, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _zero():
        gate_acc[...] = jnp.zeros_like(gate_acc)
        if gated:
            up_acc[...] = jnp.zeros_like(up_acc)

    x = x_ref[...]
    # x @ w^T on (rows, H-block) x (I-block, H-block), float32 accumulation; x and the weights are
    # exact in their dtype, so 16-bit operands lose nothing.
    dims = (((1,), (1,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    gate_acc[...] += jax.lax.dot_general(x, gate_w[...], dims, precision=precision,
                                         preferred_element_type=jnp.float32)
    if gated:
        up_acc[...] += jax.lax.dot_general(x, up_w[...], dims, precision=precision,
                                           preferred_element_type=jnp.float32)

    @pl.when(k == tiles_k - 1)
    def _epilogue():
        parts = [gate_acc[...]] + ([up_acc[...]] if gated else [])
        if has_scale:  # apply_router_weight_on_input: (w x) @ W^T = w (x @ W^T)
            parts = [p * scale[...] for p in parts]
        if has_bias:
            parts = [p + bias[i:i + 1, :] for i, p in enumerate(parts)]
        if gated:
            act = apply_gate(xp, parts[0], parts[1], moe_math.gate_spec(activation))
        else:
            act = moe_math.activate(xp, parts[0], activation)
        # Store only this expert's rows: a row tile shared by two experts is visited by both.
        group = group_ids[step]
        rows, cols = out.shape
        row = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) + m_tile_ids[step] * rows
        mine = (row >= group_offsets[group]) & (row < group_offsets[group + 1])
        out[...] = jnp.where(mine, act, out[...])


def _gate_up(x_sorted, w13, bias, scale, metadata, num_tiles, *, activation: str, blocks: MoeBlocks,
             num_experts: int, interpret):
    """float32 ``[m, I]``: act(x_sorted @ w13[e]^T (+ bias)) for each sorted row's expert ``e``.

    ``w13`` is already viewed as gate-first ``[E, 2I, H]``, interleaved ``[E, I, 2H]`` or relu2's
    ``[E, I, H]`` (all 128-aligned); ``bias`` is float32 ``[E, parts, I]`` (gate, up rows)."""
    gated = moe_math.is_gated(activation)
    interleaved = gated and moe_math.gate_spec(activation).interleaved
    m, hidden = x_sorted.shape
    inter = w13.shape[1] // (2 if gated and not interleaved else 1)
    tm, th, ti = blocks.rows, blocks.hidden, blocks.inter
    tiles_k, tiles_i = hidden // th, inter // ti

    def x_map(n, step, k, offsets, group_ids, m_tile_ids):
        return m_tile_ids[step], k

    def weight_map(row_shift, col_shift):
        def index(n, step, k, offsets, group_ids, m_tile_ids):
            return group_ids[step], n + row_shift, k + col_shift
        return index

    def bias_map(n, step, k, offsets, group_ids, m_tile_ids):
        return group_ids[step], 0, n

    def out_map(n, step, k, offsets, group_ids, m_tile_ids):
        return m_tile_ids[step], n

    def row_map(n, step, k, offsets, group_ids, m_tile_ids):  # per-row [m, 1] operands
        return m_tile_ids[step], 0

    in_specs = [pl.BlockSpec((tm, th), x_map), pl.BlockSpec((None, ti, th), weight_map(0, 0))]
    operands = [x_sorted, w13]
    if gated:
        up_shift = (0, tiles_k) if interleaved else (tiles_i, 0)
        in_specs.append(pl.BlockSpec((None, ti, th), weight_map(*up_shift)))
        operands.append(w13)
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, bias.shape[1], ti), bias_map))
        operands.append(bias)
    if scale is not None:
        in_specs.append(pl.BlockSpec((tm, 1), row_map))
        operands.append(scale)
    parts = 2 if gated else 1
    itemsize = x_sorted.dtype.itemsize
    cost = KernelCost(
        flops=2 * m * hidden * inter * parts + 8 * m * inter,
        transcendentals=m * inter if activation != "relu2" else 0,
        bytes_accessed=m * hidden * itemsize + num_experts * parts * inter * hidden * itemsize + m * inter * 4,
    )
    kernel = functools.partial(_gate_up_kernel, activation=activation, has_bias=bias is not None,
                               has_scale=scale is not None, tiles_k=tiles_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, inter), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, ti), out_map),
            grid=(tiles_i, num_tiles, tiles_k),
            scratch_shapes=[pltpu.VMEM((tm, ti), jnp.float32)] * parts,
        ),
        compiler_params=compiler_params(3, vmem_bytes=blocks.gate_up_vmem(itemsize, gated),
                                        semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost_estimate(cost),
        interpret=interpret,
        name="dualop_moe_gate_up",
    )(*metadata, *operands)


# ---------------------------------------------------------------------------------- layouts


def _pad_axis(a, axis: int, size: int):
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def _w13_view(w13, activation: str, inter: int, hidden_p: int, inter_p: int):
    """``w13`` padded to aligned sizes and viewed as the kernel reads it (free reshapes when
    already aligned): gate-first ``[E, 2I, H]``, interleaved ``[E, I, 2H]``, relu2 ``[E, I, H]``."""
    num_experts, _, hidden = w13.shape
    if not moe_math.is_gated(activation):
        return _pad_axis(_pad_axis(w13, 1, inter_p), 2, hidden_p)
    if moe_math.gate_spec(activation).interleaved:
        w = w13.reshape(num_experts, inter, 2, hidden)  # row i = [gate_i | up_i]
        w = _pad_axis(_pad_axis(w, 1, inter_p), 3, hidden_p)
        return w.reshape(num_experts, inter_p, 2 * hidden_p)
    w = w13.reshape(num_experts, 2, inter, hidden)
    w = _pad_axis(_pad_axis(w, 2, inter_p), 3, hidden_p)
    return w.reshape(num_experts, 2 * inter_p, hidden_p)


def _w13_bias_parts(w13_bias, activation: str, inter: int, inter_p: int):
    """float32 ``[E, parts, I]``: the gate and up halves of ``w13_bias`` (one part for relu2)."""
    b = w13_bias.astype(jnp.float32)
    num_experts = b.shape[0]
    if not moe_math.is_gated(activation):
        parts = b.reshape(num_experts, 1, inter)
    elif moe_math.gate_spec(activation).interleaved:
        parts = jnp.stack([b[:, 0::2], b[:, 1::2]], axis=1)
    else:
        parts = b.reshape(num_experts, 2, inter)
    return _pad_axis(parts, 2, inter_p)


# ---------------------------------------------------------------------------------- entry point


@tpu_jit(static_argnames=("activation", "apply_router_weight_on_input", "float32_output", "interpret", "blocks"))
def fused_experts(x, topk_weights, topk_ids, w13, w2, w13_bias=None, w2_bias=None, expert_map=None, *,
                  activation: str, apply_router_weight_on_input: bool, float32_output: bool = False,
                  interpret=False, blocks: MoeBlocks | None = None):
    """``[T, H]`` in x's dtype (float32 with ``float32_output``): ``sum_j w[t, j] * (w2[e] @
    act(w13[e] @ x[t] + b13[e]) + b2[e])`` over token t's routed local experts ``e =
    local(topk_ids[t, j])`` (``moe_math``'s conventions).

    ``blocks`` overrides the budget's tiles (``moe_blocks``); tests use it to force several row,
    hidden and intermediate tiles.
    """
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    inter = w2.shape[2]
    out_dtype = jnp.float32 if float32_output else x.dtype
    if tokens == 0:
        return jnp.zeros((0, hidden), out_dtype)
    if x.dtype == jnp.float16:  # megablox gmm takes bfloat16 or float32: float16 widens exactly
        wide = [None if a is None else a.astype(jnp.float32) for a in (x, w13, w2, w13_bias, w2_bias)]
        out = fused_experts(wide[0], topk_weights, topk_ids, *wide[1:3], *wide[3:], expert_map,
                            activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                            float32_output=True, interpret=interpret, blocks=blocks)
        return out.astype(out_dtype)
    hidden_p, inter_p = _round_up(hidden, _LANE), _round_up(inter, _LANE)
    pairs = tokens * top_k
    gated = moe_math.is_gated(activation)
    if blocks is None:
        blocks = moe_blocks(pairs, hidden_p, inter_p, x.dtype.itemsize, gated)
    tm = blocks.rows
    m = _round_up(pairs, tm)

    # 1. pairs sorted by local expert; rows past `pairs` pad to whole row tiles.
    local = moe_math.local_expert_ids(xp, topk_ids, expert_map, num_experts)
    order, group_sizes = moe_math.sort_by_expert(xp, local, num_experts)
    order_p = jnp.pad(order, (0, m - pairs))
    x_sorted = jnp.take(_pad_axis(x, 1, hidden_p), order_p // top_k, axis=0)
    weights = topk_weights.astype(jnp.float32).reshape(-1)
    scale = None
    if apply_router_weight_on_input:
        scale = jnp.take(weights, order_p).reshape(m, 1)
        weights = jnp.ones_like(weights)
    metadata, num_tiles = _megablox.make_group_metadata(
        group_sizes=group_sizes, m=m, tm=tm, start_group=jnp.int32(0), num_nonzero_groups=num_experts,
        visit_empty_groups=False)

    # 2. act(x @ w13^T + b13), float32 [m, I].
    bias13 = None if w13_bias is None else _w13_bias_parts(w13_bias, activation, inter, inter_p)
    act = _gate_up(x_sorted, _w13_view(w13, activation, inter, hidden_p, inter_p), bias13, scale, metadata,
                   num_tiles, activation=activation, blocks=blocks,
                   num_experts=num_experts, interpret=interpret)

    # 3. act @ w2^T with megablox gmm; a 16-bit w2 gets the activation in hi + lo 16-bit halves.
    w2_p = _pad_axis(_pad_axis(w2, 1, hidden_p), 2, inter_p)
    down = functools.partial(_megablox.gmm, rhs=w2_p, group_sizes=group_sizes, preferred_element_type=jnp.float32,
                             tiling=(tm, blocks.inter, blocks.hidden), transpose_rhs=True, interpret=interpret)
    if w2.dtype == jnp.float32:
        y = down(act)
    else:
        hi = act.astype(w2.dtype)
        lo = (act - hi.astype(jnp.float32)).astype(w2.dtype)
        y = down(hi) + down(lo)

    # 4. back to (token, slot) order; rows no expert wrote are selected away, never multiplied.
    rank = jnp.zeros((pairs,), jnp.int32).at[order].set(jnp.arange(pairs, dtype=jnp.int32))
    y_pairs = jnp.take(y, rank, axis=0)[:, :hidden]
    written = (rank < jnp.sum(group_sizes))[:, None]
    if w2_bias is not None:
        y_pairs = y_pairs + jnp.take(w2_bias.astype(jnp.float32), jnp.maximum(local.reshape(-1), 0), axis=0)
    contrib = jnp.where(written, y_pairs * weights[:, None], 0.0)
    return jnp.sum(contrib.reshape(tokens, top_k, hidden), axis=1).astype(out_dtype)
