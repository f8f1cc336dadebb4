"""``mm_encoder_attn`` on TPU: a flash-attention Pallas kernel over packed segments.

Grid ``(B, H, query blocks, key blocks)``, the key axis innermost (``arbitrary``): a step scores its
``block`` queries of one head against ``block`` keys, masks by segment id with ``where`` and folds
the block into an online softmax (float32 running max, sum and accumulator in VMEM scratch), as
JAX's ``flash_attention`` does. Its kernel (used here before) adds the segment mask to the scores,
``s + where(same, 0, mask_value)``, so a non-finite score of another segment (a key holding inf or
NaN, or a product past float32's range) stays non-finite and turns every row of the block NaN;
``where`` replaces such a score instead, so a segment's keys reach only its own rows.

- layout: ``[B, S, H*D]`` / ``[B, S, H, D]`` in and out; the kernel reads ``[B, H, S, D]``.
- float32 operands and ``P @ V``, one cast at the end (dualop's contract); 16-bit inputs widened
  first.
- GQA: query head ``h``'s blocks read K/V head ``h // (H / Hkv)`` (the index map; no repeat).
- lengths: S is padded to a multiple of 128 (the smallest block); the padding gets a segment id
  of its own, so real tokens never see it; padded rows are sliced off.
- head size: not padded; a block spans the whole head dim (legal at any size: 64, 72, 80).
- segment ids (``ops/encoder_attention.segment_ids``' rule, by comparison, so it traces with
  ``cu_seqlens`` unknown) enter as int32 ``[B, S, 128]`` (query side, lane-broadcast) and
  ``[B, 8, S]`` (key side, sublane-broadcast): the layouts Mosaic compares without relayout.
- values: a key's weight is 0 for another segment's rows, and ``0 * inf`` in ``P @ V`` would still
  reach them, so with ``cu_seqlens`` the kernel reads V with its non-finite entries zeroed and
  ``ops/encoder_attention.isolate_nonfinite_values`` puts them back in their own segment's rows
  (the native body's rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels.pallas.common import compiler_params, online_softmax_update, step_vmem_ceiling, tpu_jit

__all__ = ["encoder_attention", "flash_block"]

_SEQ_TILE = 128  # S is padded to a multiple of this (the smallest block)
_LANES = 128
_SUBLANES = 8


def _vmem_bytes(block: int, head_size: int) -> int:
    """One grid step: q, k, v and output blocks and both segment-id blocks (double-buffered), the
    running max and sum, the accumulator, and about three (block, block) float32 temporaries."""
    d = -(-head_size // _LANES) * _LANES
    io = 2 * 4 * (4 * block * d + block * _LANES + _SUBLANES * block)
    return io + 4 * (2 * block * _LANES + block * d) + 3 * 4 * block * block


def flash_block(padded_len: int, head_size: int) -> int:
    """The largest of 512, 256, 128 rows that divides the padded sequence and whose step fits
    ``step_vmem_ceiling()`` (queries and keys alike)."""
    ceiling = step_vmem_ceiling()
    for block in (512, 256, _SEQ_TILE):
        if padded_len % block == 0 and (block == _SEQ_TILE or _vmem_bytes(block, head_size) <= ceiling):
            return block
    return _SEQ_TILE


def _kernel(q_seg_ref, kv_seg_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, scale: float):
    """One (batch row, head, query block, key block) step of the online softmax."""
    kv_block = pl.program_id(3)
    block_k = k_ref.shape[2]

    @pl.when(kv_block == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]  # (block_q, D), (block_k, D), (block_k, D)
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    same = jnp.tile(q_seg_ref[0], (1, block_k // _LANES)) == kv_seg_ref[0, :1]  # (block_q, block_k)
    scores = jnp.where(same, scores, -jnp.inf)  # another segment's score, whatever it is, never counts
    online_softmax_update(scores, v, m_ref, l_ref, acc_ref)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def _():
        # l is 0 only for a row whose every score is -inf: 0 / 0 = NaN, as softmax gives
        o_ref[0, 0] = (acc_ref[...] / l_ref[:, :1]).astype(o_ref.dtype)


def _segment_ids(cu_rows, seq_len: int, padded_len: int):
    """int32 [rows, padded_len]: each token's segment per row of ``cu_rows`` ([rows, n + 1], or
    None: one segment); the padding gets an id no real token has."""
    pos = jnp.arange(padded_len, dtype=jnp.int32)
    if cu_rows is None:
        return jnp.where(pos < seq_len, 0, 1)[None, :]
    bounds = cu_rows[:, 1:].astype(jnp.int32)
    seg = jnp.sum((pos[None, :, None] >= bounds[:, None, :]).astype(jnp.int32), axis=-1)
    return jnp.where(pos[None, :] < seq_len, seg, cu_rows.shape[1])  # n + 1 > any real id


def _flash(q, k, v, ids, *, scale: float, interpret):
    """The kernel on float32 ``q [B, H, P, D]``, ``k``/``v [B, Hkv, P, D]`` and int32 segment ids
    ``[B, P]`` (P a multiple of 128): ``[B, H, P, D]`` float32."""
    b, heads, padded_len, head_size = q.shape
    group = heads // k.shape[1]
    block = flash_block(padded_len, head_size)
    blocks = padded_len // block
    q_ids = jnp.broadcast_to(ids[:, :, None], (b, padded_len, _LANES))
    kv_ids = jnp.broadcast_to(ids[:, None, :], (b, _SUBLANES, padded_len))
    q_spec = pl.BlockSpec((1, 1, block, head_size), lambda i, h, qi, ki: (i, h, qi, 0))
    kv_spec = pl.BlockSpec((1, 1, block, head_size), lambda i, h, qi, ki: (i, jax.lax.div(h, group), ki, 0))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        grid=(b, heads, blocks, blocks),
        in_specs=[
            pl.BlockSpec((1, block, _LANES), lambda i, h, qi, ki: (i, qi, 0)),
            pl.BlockSpec((1, _SUBLANES, block), lambda i, h, qi, ki: (i, 0, ki)),
            q_spec, kv_spec, kv_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        scratch_shapes=[
            pltpu.VMEM((block, _LANES), jnp.float32),
            pltpu.VMEM((block, _LANES), jnp.float32),
            pltpu.VMEM((block, head_size), jnp.float32),
        ],
        compiler_params=compiler_params(4, vmem_bytes=_vmem_bytes(block, head_size),
                                        semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="dualop_encoder_attention",
    )(q_ids, kv_ids, q, k, v)


def _attention_rows(query, key, value, cu_rows, *, num_heads: int, num_kv_heads: int, head_size: int,
                    scale: float, interpret):
    """The kernel call on [R, S, ...] inputs; ``cu_rows`` None or int32 [R, n + 1] (row r's packing)."""
    from dualop.backends.xla import array_api as xp
    from dualop.kernels.encoder_attention_math import isolate_nonfinite_values

    shape, dtype = query.shape, query.dtype
    b, s = shape[:2]
    s_pad = -s % _SEQ_TILE
    padded_len = s + s_pad

    def heads_first(t, heads):
        t = t.reshape(b, s, heads, head_size).transpose(0, 2, 1, 3)
        return jnp.pad(t, ((0, 0), (0, 0), (0, s_pad), (0, 0)))

    q = query.astype(jnp.float32)
    k = key.astype(jnp.float32)
    v = value.astype(jnp.float32).reshape(b, s, num_kv_heads, head_size)
    v_in = v if cu_rows is None else jnp.where(jnp.isfinite(v), v, 0.0)  # see the module docstring
    ids = jnp.broadcast_to(_segment_ids(cu_rows, s, padded_len), (b, padded_len))
    out = _flash(heads_first(q, num_heads), heads_first(k, num_kv_heads), heads_first(v_in, num_kv_heads), ids,
                 scale=scale, interpret=interpret)
    out = out[:, :, :s].transpose(0, 2, 1, 3).reshape(b, s, num_kv_heads, num_heads // num_kv_heads, head_size)
    if cu_rows is not None:
        out = isolate_nonfinite_values(xp, out, v, ids[:, :s], cu_rows.shape[1])
    return out.reshape(shape).astype(dtype)


@functools.lru_cache(maxsize=None)
def _build(static: tuple, has_cu: bool):
    """The call, batched under ``vmap`` by folding the vmapped axis into the kernel's batch rows
    (its grid has no room for another axis: the TPU interpreter refuses a vmapped kernel whose
    dimension semantics name fewer axes than the grid)."""
    opts = dict(static)

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        q, k, v = arrays[:3]
        return _attention_rows(q, k, v, arrays[3] if has_cu else None, **opts)

    @call.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        full = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(arrays, in_batched)]
        rows = [a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in full]
        out = call(*rows)
        return out.reshape(axis_size, -1, *out.shape[1:]), True

    return call


@tpu_jit(static_argnames=("num_heads", "num_kv_heads", "head_size", "scale", "interpret"))
def encoder_attention(query, key, value, cu_seqlens=None, *, num_heads: int, num_kv_heads: int, head_size: int,
                      scale: float, interpret=False):
    """Non-causal attention of ``query`` over ``key``/``value`` (see the module docstring)."""
    b, s = query.shape[:2]
    if b * s == 0:
        return jnp.zeros(query.shape, query.dtype)
    static = (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_size", head_size),
              ("scale", scale), ("interpret", interpret))
    if cu_seqlens is None:
        return _build(static, False)(query, key, value)
    cu_rows = jnp.broadcast_to(cu_seqlens.astype(jnp.int32), (b, cu_seqlens.shape[0]))
    return _build(static, True)(query, key, value, cu_rows)
