"""``rel_pos_attention`` on TPU: the projections and the decomposed relative-position terms as XLA
matmuls, the attention as a flash Pallas kernel that adds the relative-position bias per tile.

Grid ``(B, heads, query blocks, key blocks)``, the key axis innermost (``arbitrary``): a step scores
its ``block`` queries against ``block`` keys (float32 ``q . k`` times the scale), adds the tile's
bias and folds it into an online softmax (float32 running max, sum and accumulator in VMEM
scratch), as ``mm_encoder_attn``'s kernel does.

The bias of query ``i`` and key ``j = (h', w')`` is ``rel_h[i, h'] + rel_w[i, w']``: ``rel_h`` and
``rel_w`` ([S, H] and [S, W] per head, ``ops/rel_pos_attention.rel_pos_terms``) enter as blocks of
the tile's queries, zero-padded to 128 lanes, and the tile expands them over its keys with two
one-hot matmuls on the MXU: ``rel_h_block [block, 128] @ onehot(h' of each key) [128, block]``
(exact: each output sums one product with 1). The keys' row and column indices come in as int32
``[8, S]`` (sublane-broadcast, the layout Mosaic compares against a lane iota without relayout),
-1 for the sequence's padding, which also masks those keys.

- S = H W is padded to a multiple of 128 (the smallest block); padded query rows are sliced off.
- float32 q, k, v from the float32 projections; one cast of the output after ``proj``.
- the head dim is not padded (a block spanning it whole is legal at any size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels.pallas.common import compiler_params, online_softmax_update, step_vmem_ceiling, tpu_jit

__all__ = ["rel_pos_attention", "attention_block"]

_SEQ_TILE = 128
_LANES = 128
_SUBLANES = 8


def _vmem_bytes(block: int, head_dim: int, rel_lanes: int) -> int:
    """One grid step: the q, k, v and output blocks, the rel_h / rel_w blocks and the key index
    blocks (double-buffered), the running max and sum and the accumulator, and about five (block,
    block)-sized float32 temporaries (scores, bias, probabilities, the two one-hot matrices)."""
    d = -(-head_dim // _LANES) * _LANES
    io = 2 * 4 * (4 * block * d + 2 * block * rel_lanes + 2 * _SUBLANES * block)
    return io + 4 * (2 * block * _LANES + block * d) + 5 * 4 * block * max(block, rel_lanes)


def attention_block(padded_len: int, head_dim: int, rel_lanes: int) -> int:
    """The largest of 512, 256, 128 rows that divides the padded sequence and whose step fits
    ``step_vmem_ceiling()``."""
    ceiling = step_vmem_ceiling()
    for block in (512, 256, _SEQ_TILE):
        if padded_len % block == 0 and (block == _SEQ_TILE or _vmem_bytes(block, head_dim, rel_lanes) <= ceiling):
            return block
    return _SEQ_TILE


def _kernel(*refs, scale: float, use_rel_pos: bool):
    """One (image, head, query block, key block) step of the online softmax."""
    if use_rel_pos:
        key_row_ref, key_col_ref, q_ref, k_ref, v_ref, rel_h_ref, rel_w_ref, o_ref, m_ref, l_ref, acc_ref = refs
    else:
        key_row_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs
    kv_block = pl.program_id(3)

    @pl.when(kv_block == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q, k, v = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0]  # (block, d) each
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    key_row = key_row_ref[:1]  # (1, block): the key's image row, -1 for padding
    if use_rel_pos:
        key_col = key_col_ref[:1]
        lanes_h, lanes_w = rel_h_ref.shape[-1], rel_w_ref.shape[-1]
        onehot_h = (jax.lax.broadcasted_iota(jnp.int32, (lanes_h, key_row.shape[1]), 0) == key_row)
        onehot_w = (jax.lax.broadcasted_iota(jnp.int32, (lanes_w, key_col.shape[1]), 0) == key_col)
        scores = scores + jnp.dot(rel_h_ref[0, 0], onehot_h.astype(jnp.float32), preferred_element_type=jnp.float32)
        scores = scores + jnp.dot(rel_w_ref[0, 0], onehot_w.astype(jnp.float32), preferred_element_type=jnp.float32)
    scores = jnp.where(key_row >= 0, scores, -jnp.inf)  # the sequence's padding never counts
    online_softmax_update(scores, v, m_ref, l_ref, acc_ref)

    @pl.when(kv_block == pl.num_programs(3) - 1)
    def _():
        o_ref[0, 0] = acc_ref[...] / l_ref[:, :1]


def _pad_to(a, axis: int, size: int):
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def _flash(q, k, v, rel_h, rel_w, height: int, width: int, *, scale: float, interpret):
    """The kernel on float32 ``q``/``k``/``v`` ``[B, n, S, d]`` and (or None) ``rel_h [B, n, S, H]``,
    ``rel_w [B, n, S, W]``: float32 ``[B, n, S, d]``."""
    b, heads, s, d = q.shape
    padded_len = s + (-s % _SEQ_TILE)
    use_rel_pos = rel_h is not None
    rel_lanes = _LANES * -(-max(height, width) // _LANES) if use_rel_pos else 0
    block = attention_block(padded_len, d, rel_lanes)
    blocks = padded_len // block
    pos = jnp.arange(padded_len, dtype=jnp.int32)
    key_row = jnp.broadcast_to(jnp.where(pos < s, pos // width, -1)[None, :], (_SUBLANES, padded_len))
    key_col = jnp.broadcast_to(jnp.where(pos < s, pos % width, -1)[None, :], (_SUBLANES, padded_len))
    q, k, v = (_pad_to(t, 2, padded_len) for t in (q, k, v))
    ids_spec = pl.BlockSpec((_SUBLANES, block), lambda i, h, qi, ki: (0, ki))
    q_spec = pl.BlockSpec((1, 1, block, d), lambda i, h, qi, ki: (i, h, qi, 0))
    kv_spec = pl.BlockSpec((1, 1, block, d), lambda i, h, qi, ki: (i, h, ki, 0))
    if use_rel_pos:
        rel_spec = pl.BlockSpec((1, 1, block, rel_lanes), lambda i, h, qi, ki: (i, h, qi, 0))
        rel_h, rel_w = (_pad_to(_pad_to(t, 3, rel_lanes), 2, padded_len) for t in (rel_h, rel_w))
        arrays, specs = [key_row, key_col, q, k, v, rel_h, rel_w], [ids_spec, ids_spec, q_spec, kv_spec, kv_spec,
                                                                      rel_spec, rel_spec]
    else:
        arrays, specs = [key_row, q, k, v], [ids_spec, q_spec, kv_spec, kv_spec]
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, use_rel_pos=use_rel_pos),
        grid=(b, heads, blocks, blocks),
        in_specs=specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        scratch_shapes=[
            pltpu.VMEM((block, _LANES), jnp.float32),
            pltpu.VMEM((block, _LANES), jnp.float32),
            pltpu.VMEM((block, d), jnp.float32),
        ],
        compiler_params=compiler_params(4, vmem_bytes=_vmem_bytes(block, d, rel_lanes),
                                        semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="dualop_rel_pos_attention",
    )(*arrays)
    return out[:, :, :s]


@tpu_jit(static_argnames=("num_heads", "scale", "interpret"))
def rel_pos_attention(x, qkv_weight, qkv_bias, proj_weight, proj_bias, rel_pos_h=None, rel_pos_w=None, *,
                      num_heads: int, scale: float, interpret=False):
    """SAM's attention of ``x [B, H, W, dim]`` (see ``dualop/ops/rel_pos_attention.py``)."""
    from dualop.backends.xla import array_api as xp
    from dualop.kernels.rel_pos_math import project_out, project_qkv, rel_pos_terms

    b, height, width, _ = x.shape
    if b * height * width == 0:
        return jnp.zeros(x.shape, x.dtype)
    q, k, v = project_qkv(xp, x, qkv_weight, qkv_bias, num_heads)
    rel_h = rel_w = None
    if rel_pos_h is not None:
        rel_h, rel_w = rel_pos_terms(xp, q, rel_pos_h, rel_pos_w, height, width)
    attended = _flash(q, k, v, rel_h, rel_w, height, width, scale=scale, interpret=interpret)
    return project_out(xp, attended, proj_weight, proj_bias, x)
