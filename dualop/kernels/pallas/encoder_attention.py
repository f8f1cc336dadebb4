"""``mm_encoder_attn`` on TPU: JAX's own Pallas flash-attention kernel
(``jax.experimental.pallas.ops.tpu.flash_attention``), driven with segment ids.

Why JAX's kernel rather than our own: it is maintained with Pallas, takes ``SegmentIds`` (exactly
packed sequences: a query attends to keys of its own segment id), and here it runs in both
interpreters (JAX's TPU interpreter and the generic one that torch_xla's ``call_jax`` needs, seen
with jax 0.10.2 and 0.7.1) and compiles with the real TPU compiler for v4, v5e, v5p, v6e and tpu7x
(``dualop compile``). What this wrapper adds:

- layout: ``[B, S, H*D]`` / ``[B, S, H, D]`` in and out; the kernel wants ``[B, H, S, D]``.
- float32 operands: the kernel casts the probabilities to the input dtype before ``P @ V``; dualop's
  contract is float32 softmax and ``P @ V`` with one cast at the end, so 16-bit inputs are
  widened first (twice the kernel's HBM reads; the result then matches the native body to the
  tolerance table).
- GQA: the kernel has one K/V head per query head, so K and V heads are repeated ``H / Hkv`` times.
- lengths: its key blocks must divide the sequence, so S is padded to a multiple of 128 and the
  padding gets a segment id of its own (real tokens never see it; padded rows are sliced off).
- head size: not padded. A block spans the whole head dim, which is legal at any size; Mosaic
  lays 80 or 72 columns (common in ViTs) out in 128-lane vregs itself (``dualop compile`` builds
  D 64/72/80 for every generation), so zero-padding in HBM would only add traffic.
- ``cu_seqlens`` -> segment ids by comparison (``ops/encoder_attention.segment_ids``), so it
  traces with ``cu_seqlens`` unknown.
- interpretation: the kernel has no ``interpret`` argument, so the mode dualop chose is forced
  around its trace (JAX's ``force_tpu_interpret_mode`` for the TPU interpreter; the same JAX config
  value set to ``True`` for the generic interpreter).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

from dualop.kernels.pallas.common import tpu_jit

__all__ = ["encoder_attention", "flash_block_sizes"]

_SEQ_TILE = 128  # S is padded to a multiple of this (the kernel's smallest key block)
_MAX_BLOCK = 512  # query / key rows per grid step (float32: about 3 MiB of VMEM per step at D 128)


def flash_block_sizes(padded_len: int) -> jax_flash.BlockSizes:
    """The largest of 512, 256, 128 rows that divides the padded sequence, for queries and keys
    (the backward-pass sizes are the kernel's defaults' shape; the VJP here is the native body's)."""
    block = next(b for b in (_MAX_BLOCK, 256, _SEQ_TILE) if padded_len % b == 0)
    return jax_flash.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1)


@contextlib.contextmanager
def _interpreting(interpret):
    """Run the pallas_calls traced inside in dualop's interpret mode (False: compile)."""
    if interpret is False or interpret is None:
        yield
        return
    if interpret is True:
        from jax._src import config as jax_config  # the value force_tpu_interpret_mode sets

        prev = jax_config.pallas_tpu_interpret_mode_context_manager.swap_local(True)
        try:
            yield
        finally:
            jax_config.pallas_tpu_interpret_mode_context_manager.set_local(prev)
        return
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode(interpret):
        yield


def _segment_ids(cu_rows, seq_len: int, padded_len: int):
    """int32 [rows, padded_len]: each token's segment per row of ``cu_rows`` ([rows, n + 1], or
    None: one segment); the padding gets an id no real token has."""
    pos = jnp.arange(padded_len, dtype=jnp.int32)
    if cu_rows is None:
        return jnp.where(pos < seq_len, 0, 1)[None, :]
    bounds = cu_rows[:, 1:].astype(jnp.int32)
    seg = jnp.sum((pos[None, :, None] >= bounds[:, None, :]).astype(jnp.int32), axis=-1)
    return jnp.where(pos[None, :] < seq_len, seg, cu_rows.shape[1])  # n + 1 > any real id


def _attention_rows(query, key, value, cu_rows, *, num_heads: int, num_kv_heads: int, head_size: int,
                    scale: float, interpret):
    """The kernel call on [R, S, ...] inputs; ``cu_rows`` None or int32 [R, n + 1] (row r's packing)."""
    shape, dtype = query.shape, query.dtype
    b, s = shape[:2]
    group = num_heads // num_kv_heads
    s_pad = -s % _SEQ_TILE
    padded_len = s + s_pad

    def heads_first(t, heads):
        t = t.reshape(b, s, heads, head_size).astype(jnp.float32).transpose(0, 2, 1, 3)
        if group > 1 and heads == num_kv_heads:
            t = jnp.repeat(t, group, axis=1)
        return jnp.pad(t, ((0, 0), (0, 0), (0, s_pad), (0, 0)))

    q = heads_first(query, num_heads)
    k = heads_first(key, num_kv_heads)
    v = heads_first(value, num_kv_heads)
    segments = None
    if cu_rows is not None or s_pad:
        ids = jnp.broadcast_to(_segment_ids(cu_rows, s, padded_len), (b, padded_len))
        segments = jax_flash.SegmentIds(q=ids, kv=ids)
    with _interpreting(interpret):
        out = jax_flash.flash_attention(q, k, v, segment_ids=segments, sm_scale=scale,
                                        block_sizes=flash_block_sizes(padded_len))
    return out[:, :, :s].transpose(0, 2, 1, 3).reshape(shape).astype(dtype)


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
