"""Rotary embedding of query and key (one launch) as a Pallas TPU kernel.

Same contract as ``kernels/rope_math.rotate``: per token, the first ``rotary_dim`` channels of each
head rotate in pairs (neox: i with i + rotary_dim/2; GPT-J: 2i with 2i+1) by that token's cos/sin,
in float32, cast once; the rest pass through. ``rotary_reference`` states it in plain jnp.

Layout: query ``[T, Hq*D]`` and key ``[T, Hk*D]`` rows, lane-dense, blocked over tokens (a block
spans whole rows, so any head size is legal, 80 included); one grid step rotates both. Inside a
step, heads are taken in groups whose width ``g*D`` is a multiple of 128 lanes (``lcm(D, 128)``),
so every slice of the block is lane-aligned. The pair swap is a matmul by a signed permutation
``P`` and the spread of a token's ``rotary_dim/2`` cos/sin values over the group's channels a matmul
by a 0/1 matrix ``E`` (no lane shuffles at unaligned offsets, which a head size of 80 would need):
``out = x * (cos @ E + pass) + (x @ P) * (sin @ E)``, ``pass`` being 1 on pass-through channels. The
MXU products are exact: bfloat16 operands are multiplied by +-1 and 0 with float32 accumulation;
float32 and float16 operands are split into three bfloat16 parts that sum back exactly.
Non-finite values are carried by a second product of small codes (``_moved``), in x's pair swap
and in the cos/sin spread alike, so inf and NaN land where the native formula puts them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dualop.backends.xla import array_api as xp
from dualop.kernels import cost as cost_model
from dualop.kernels.pallas.common import (
    block_vmem_bytes,
    compiler_params,
    cost_estimate,
    row_blocks,
    tpu_jit,
)
from dualop.kernels.rope_math import rotate

__all__ = ["rotary", "rotary_query", "rotary_reference", "group_width", "MAX_GROUP_WIDTH"]

# Widest head group (lanes) the kernel takes: its permutation matrix is group_width² floats.
MAX_GROUP_WIDTH = 1024


def group_width(head_size: int) -> int:
    """Lanes of one head group: the smallest multiple of ``head_size`` that is a multiple of 128."""
    return math.lcm(head_size, 128)


def rotary_reference(query, key, cos, sin, *, rotary_dim: int, is_neox_style: bool):
    """The plain jax.numpy statement of the kernel (query/key ``[T, H, D]``, cos/sin ``[Tc, R/2]``)."""
    reps = query.shape[0] // max(cos.shape[0], 1)
    cos, sin = jnp.tile(cos, (reps, 1)), jnp.tile(sin, (reps, 1))
    q = rotate(xp, query, cos, sin, rotary_dim, is_neox_style)
    k = None if key is None else rotate(xp, key, cos, sin, rotary_dim, is_neox_style)
    return q, k


def _matrices(width: int, head_size: int, rotary_dim: int, is_neox_style: bool):
    """``E`` (half, width): channel c takes frequency j; ``P`` (width, width): x @ P is the signed
    pair swap; ``keep`` (1, width): 1.0 on pass-through channels. Built from iotas (no inputs);
    ``lax.rem``/``lax.div`` on these non-negative indices (jnp's floor rules lower to ``sign``,
    whose Mosaic rule asks the attached device for its TPU generation)."""
    rem, div = jax.lax.rem, jax.lax.div
    half = rotary_dim // 2
    j = jax.lax.broadcasted_iota(jnp.int32, (half, width), 0)
    c = rem(jax.lax.broadcasted_iota(jnp.int32, (half, width), 1), head_size)
    freq = rem(c, half) if is_neox_style else div(c, 2)
    spread = jnp.where((c < rotary_dim) & (freq == j), 1.0, 0.0).astype(jnp.bfloat16)
    src = jax.lax.broadcasted_iota(jnp.int32, (width, width), 0)
    dst = jax.lax.broadcasted_iota(jnp.int32, (width, width), 1)
    same_head = div(src, head_size) == div(dst, head_size)
    s, d = rem(src, head_size), rem(dst, head_size)
    if is_neox_style:  # rot[d] = -x[d + half] (d < half), x[d - half] (half <= d < R)
        minus = (d < half) & (s == d + half)
        plus = (d >= half) & (d < rotary_dim) & (s == d - half)
    else:  # rot[2i] = -x[2i + 1], rot[2i + 1] = x[2i]
        even = rem(d, 2) == 0
        minus = even & (d < rotary_dim) & (s == d + 1)
        plus = ~even & (d < rotary_dim) & (s == d - 1)
    perm = jnp.where(same_head & minus, -1.0, jnp.where(same_head & plus, 1.0, 0.0)).astype(jnp.bfloat16)
    lane = rem(jax.lax.broadcasted_iota(jnp.int32, (1, width), 1), head_size)
    keep = jnp.where(lane >= rotary_dim, 1.0, 0.0).astype(jnp.float32)
    return spread, perm, keep


def _exact_dot(a, m, split: bool):
    """``a @ m`` for a 0/+-1 bfloat16 ``m``, exact in float32: ``a`` as one bfloat16 operand when it
    is bfloat16 already, else as three bfloat16 parts summing to it."""
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    if not split:
        return dot(a.astype(jnp.bfloat16), m)
    a = a.astype(jnp.float32)
    hi = a.astype(jnp.bfloat16)
    rest = a - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return dot(hi, m) + dot(mid, m) + dot(lo, m)


def _moved(xf, m, split: bool):
    """``xf @ m`` for a matrix ``m`` with at most one 0/+-1 entry per column (the signed pair swap,
    the cos/sin spread) with non-finite values moved, not smeared: the product runs on the finite
    values (0 * inf would make the whole group NaN), and each non-finite value travels as a small
    code (+-1: +-inf, 2: NaN) through a second, exact bfloat16 product."""
    finite = jnp.abs(xf) < jnp.inf  # False for inf and NaN
    rot = _exact_dot(jnp.where(finite, xf, 0.0), m, split)
    code = jnp.where(finite, 0.0, jnp.where(xf != xf, 2.0, jnp.where(xf > 0, 1.0, -1.0)))
    moved = _exact_dot(code, m, False)
    special = jnp.where(moved == 1.0, jnp.inf, jnp.where(moved == -1.0, -jnp.inf, jnp.nan))
    return jnp.where(moved == 0.0, rot, special)


def _kernel(cos_ref, sin_ref, *refs, widths: tuple[int, ...], head_size: int, rotary_dim: int,
            is_neox_style: bool, split: bool, cos_split: bool):
    n = len(widths)
    in_refs, out_refs = refs[:n], refs[n:]
    cos, sin = cos_ref[...], sin_ref[...]
    group = group_width(head_size)
    made = {}
    for x_ref, o_ref, width in zip(in_refs, out_refs, widths):
        for start in range(0, width, group):
            w = min(group, width - start)
            if w not in made:  # the cos/sin spread over a group of this width, shared by query and key
                spread, perm, keep = _matrices(w, head_size, rotary_dim, is_neox_style)
                c = _moved(cos, spread, cos_split) + keep
                s = _moved(sin, spread, cos_split)
                made[w] = (perm, c, s)
            perm, c, s = made[w]
            xf = x_ref[:, start:start + w].astype(jnp.float32)
            out = xf * c + _moved(xf, perm, split) * s
            o_ref[:, start:start + w] = out.astype(o_ref.dtype)


@tpu_jit(static_argnames=("rotary_dim", "is_neox_style", "interpret", "block_tokens"))
def rotary(query, key, cos, sin, *, rotary_dim: int, is_neox_style: bool, interpret=False,
           block_tokens: int | None = None):
    """Rotate ``query`` ``[T, Hq, D]`` (and ``key`` ``[T, Hk, D]`` or None) by ``cos``/``sin``
    ``[Tc, rotary_dim // 2]`` (T a multiple of Tc: token t takes row t % Tc). Returns ``(query, key)``.

    ``block_tokens`` overrides the VMEM-budget choice of tokens per grid step (tests use it to
    force several blocks and a ragged last one). Under ``vmap`` the batch folds into tokens (one
    grid, no batched ``pallas_call``)."""
    head_size = query.shape[-1]
    if group_width(head_size) > MAX_GROUP_WIDTH:
        raise NotImplementedError(
            f"head_size {head_size}: a lane-aligned head group is {group_width(head_size)} lanes, over the "
            f"Pallas kernel's {MAX_GROUP_WIDTH}"
        )
    call = _build(key is not None, rotary_dim, is_neox_style, interpret, block_tokens)
    out = call(query, cos, sin) if key is None else call(query, key, cos, sin)
    return out[0], (out[1] if key is not None else None)


def rotary_query(query, cos, sin, *, rotary_dim: int, is_neox_style: bool, interpret=False,
                 block_tokens: int | None = None):
    """``rotary`` with no key, returning the rotated query alone (one array: the form the
    torch_xla, torchax and torch_tpu bridges take when there is no second output)."""
    return rotary(query, None, cos, sin, rotary_dim=rotary_dim, is_neox_style=is_neox_style, interpret=interpret,
                  block_tokens=block_tokens)[0]


@functools.lru_cache(maxsize=None)
def _build(has_key: bool, rotary_dim: int, is_neox_style: bool, interpret, block_tokens: int | None):
    launch = functools.partial(_launch, rotary_dim=rotary_dim, is_neox_style=is_neox_style, interpret=interpret,
                               block_tokens=block_tokens)

    @jax.custom_batching.custom_vmap
    def batched(*arrays):
        *heads, cos, sin = arrays
        return launch(*heads, cos, sin)

    @batched.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        full = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(arrays, in_batched)]
        *heads, cos, sin = full
        reps = heads[0].shape[1] // max(cos.shape[1], 1)
        if reps > 1:  # each batch member's tokens repeat its cos/sin rows: make that explicit first
            cos, sin = jnp.tile(cos, (1, reps, 1)), jnp.tile(sin, (1, reps, 1))
        fold = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
        out = batched(*(fold(h) for h in heads), fold(cos), fold(sin))
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in out), (True,) * len(out)

    return batched


def _launch(query, key=None, cos=None, sin=None, *, rotary_dim: int, is_neox_style: bool, interpret,
            block_tokens: int | None):
    """One ``pallas_call`` over token blocks for query (and key); returns a tuple of outputs."""
    if sin is None:  # called as (query, cos, sin): no key
        key, cos, sin = None, key, cos
    tokens, _, head_size = query.shape
    arrays = [query] if key is None else [query, key]
    if tokens == 0:
        return tuple(a + 0 for a in arrays)
    if any(a.size == 0 for a in arrays):  # no query heads (or no key heads): rotate the other alone
        live = [a for a in arrays if a.size]
        rotated = iter(_launch(live[0], None, cos, sin, rotary_dim=rotary_dim, is_neox_style=is_neox_style,
                               interpret=interpret, block_tokens=block_tokens) if live else ())
        return tuple(next(rotated) if a.size else a + 0 for a in arrays)
    if cos.shape[0] != tokens:
        reps = tokens // cos.shape[0]
        cos, sin = jnp.tile(cos, (reps, 1)), jnp.tile(sin, (reps, 1))
    rows = [a.reshape(tokens, -1) for a in arrays]
    widths = tuple(r.shape[1] for r in rows)
    dtype = query.dtype
    half = rotary_dim // 2
    # per token: each row array in and out, double-buffered, plus float32 temporaries of one group
    per_token = sum(widths) * 4 * dtype.itemsize + 6 * 4 * group_width(head_size)
    blocks = row_blocks(tokens, 1, dtype, bytes_per_elem=per_token)
    bt = blocks.block_rows if block_tokens is None else min(block_tokens, tokens)
    vmem = block_vmem_bytes(bt, 1, dtype, per_token) // 128
    kernel = functools.partial(
        _kernel, widths=widths, head_size=head_size, rotary_dim=rotary_dim, is_neox_style=is_neox_style,
        split=dtype != jnp.bfloat16, cos_split=cos.dtype != jnp.bfloat16,
    )
    token_spec = lambda width: pl.BlockSpec((bt, width), lambda i: (i, 0))  # noqa: E731
    heads = sum(widths) // head_size
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(tokens, bt),),
        in_specs=[token_spec(half), token_spec(half), *(token_spec(w) for w in widths)],
        out_specs=[token_spec(w) for w in widths],
        out_shape=[jax.ShapeDtypeStruct(r.shape, dtype) for r in rows],
        compiler_params=compiler_params(1, vmem_bytes=vmem),
        cost_estimate=cost_estimate(
            cost_model.rotary_cost(tokens, heads, head_size, rotary_dim, dtype.itemsize, cos.dtype.itemsize)
        ),
        interpret=interpret,
        name="dualop_rotary",
    )(cos, sin, *rows)
    return tuple(o.reshape(a.shape) for o, a in zip(outs, arrays))
