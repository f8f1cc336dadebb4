"""Mamba-2's SSD scan (``ssd_chunk_scan``) for jax arrays on the CPU and GPUs: the chunked
state-space-duality form in ``jax.numpy``, so that XLA's dot does the work. (The native body is the
token recurrence: a loop of small matrix-vector products, 1.1-2.7x slower than a chunked jax scan
on this host; there is no Triton launch for jax arrays.)

Under ``jit`` the sequence boundaries are traced, so the chunks are per sequence ("logical
chunks"): sequence ``b`` is cut into chunks of ``L`` tokens from its own first token, and every
chunk holds one sequence's tokens. The chunk table is computed from ``cu_seqlens`` on the device;
its length is bounded statically by ``(T + B (L - 1)) // L`` (a sequence's last chunk may be
partial), and chunks past the used ones are empty. Per chunk, as matmuls: ``y`` from the chunk's
own tokens (``C Bᵀ`` masked to ``s <= t`` and weighted by the decay over ``(s, t]``) and the
chunk's state contribution. A scan over the chunks carries the state (a sequence's first chunk
starts from its cached state, or zeros), and ``y`` gets the entering state's part. A decode step
(``T == B``, one token per sequence) is one elementwise update of each state.

Decays within a chunk are partial sums from each token (as in the Pallas and torch CPU kernels), not
differences of running sums. Everything in float32; y in x's dtype; the new cache is returned.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from dualop.backends import array_namespace
from dualop.kernels import ssm_math

__all__ = ["ssd_chunk_scan", "MAX_CHUNK", "num_chunks"]

# The longest chunk this path uses (the op's chunk_size when shorter). The per-token work is the
# masked C Bᵀ, ~L (N + P) per head, plus the state terms, ~2 P N, and XLA:CPU lowers a cumsum to a
# reduce-window (L² per row: the [L, L] decay sums cost L³ per head and chunk); short chunks also
# waste less on the sequences' partial last chunks. Measured (16 heads of 64, state 64, a 1024-token
# prefill as one and as eight sequences): 32 and 64 tie, 16 is 1.1-1.8x slower, 128 1.3-2.2x,
# 256 3.5-5x.
MAX_CHUNK = 32


def num_chunks(tokens: int, seqs: int, length: int) -> int:
    """The static bound on the logical chunks of ``seqs`` non-empty sequences of ``tokens`` in all."""
    return max(1, min(tokens, (tokens + seqs * (length - 1)) // length))


def _decode(xf, delta, a, bh, ch, init):
    """One token per sequence: ``h = exp(Δ A) h0 + Δ x ⊗ B``, ``y = h C``."""
    decay = jnp.exp(delta * a)[:, :, None, None]
    h = decay * init + (delta[:, :, None] * xf)[..., None] * bh[:, :, None, :]
    return jnp.einsum("bhpn,bhn->bhp", h, ch, precision=jax.lax.Precision.HIGHEST), h


def _segment_decays(da):
    """``[..., L] -> [..., L, L]``: the sum of ``da`` over ``(s, t]`` at ``[t, s]`` for ``s <= t``
    (partial sums down each column), -inf above the diagonal."""
    length = da.shape[-1]
    below = jnp.tril(jnp.ones((length, length), bool), -1)
    seg = jnp.cumsum(jnp.where(below, da[..., :, None], 0.0), axis=-2)
    return jnp.where(jnp.tril(jnp.ones((length, length), bool)), seg, -jnp.inf)


def _prefill(xf, delta, a, bmat, cmat, init, cu_seqlens, length: int):
    """y ``[T, H, P]`` and the final states ``[B, H, P, N]`` of the chunked scan over logical chunks."""
    hi = jax.lax.Precision.HIGHEST
    tokens, heads, head_dim = xf.shape
    seqs, groups, state = init.shape[0], bmat.shape[1], bmat.shape[2]
    rep = heads // groups
    chunks = num_chunks(tokens, seqs, length)

    # the chunk table: chunk j is chunk k_j of sequence s_j, tokens [start_j, start_j + len_j)
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    per_seq = (lens + length - 1) // length
    chunk_end = jnp.cumsum(per_seq)
    first_chunk = chunk_end - per_seq
    j = jnp.arange(chunks, dtype=jnp.int32)
    seq_j = jnp.minimum(jnp.sum(j[:, None] >= chunk_end[None, :], axis=1, dtype=jnp.int32), seqs - 1)
    k_j = j - first_chunk[seq_j]
    start_j = cu[seq_j] + k_j * length
    len_j = jnp.where(j < chunk_end[-1], jnp.clip(cu[seq_j + 1] - start_j, 0, length), 0)
    pos = jnp.arange(length, dtype=jnp.int32)
    token = jnp.clip(start_j[:, None] + pos[None, :], 0, tokens - 1)  # [NC, L]
    valid = pos[None, :] < len_j[:, None]

    # each chunk's tokens; past a chunk's end Δ·A, Δ·x, B and C are 0 (no decay, no input), by
    # selects: the clamped gather there reads another sequence's token, which may hold a NaN
    xd = jnp.where(valid[..., None, None], (xf * delta[..., None])[token], 0.0)  # [NC, L, H, P]
    da = jnp.where(valid[..., None], (delta * a)[token], 0.0).transpose(0, 2, 1)  # [NC, H, L]
    b_c, c_c = (jnp.where(valid[..., None, None], m[token], 0.0) for m in (bmat, cmat))  # [NC, L, G, N]

    # within each chunk: y from the chunk's own tokens, and its state contribution
    cb = jnp.einsum("jlgn,jsgn->jgls", c_c, b_c, precision=hi)
    w = jnp.exp(_segment_decays(da)).reshape(chunks, groups, rep, length, length) * cb[:, :, None]
    xd_g = xd.reshape(chunks, length, groups, rep, head_dim)
    y_own = jnp.einsum("jgrls,jsgrp->jlgrp", w, xd_g, precision=hi)
    to_end = jnp.exp(jnp.flip(jnp.cumsum(jnp.flip(da, -1), -1), -1) - da)  # over (l, L): [NC, H, L]
    contrib = jnp.einsum("jlgn,jgrl,jlgrp->jgrpn", b_c, to_end.reshape(chunks, groups, rep, length), xd_g,
                         precision=hi).reshape(chunks, heads, head_dim, state)
    cum = jnp.cumsum(da, axis=-1)  # over [0, l]
    total = jnp.exp(cum[..., -1])  # [NC, H]

    # between chunks: a sequence's first chunk enters with its initial state, the others with the
    # state the previous chunk left
    def carry(h, inputs):
        s, first, decay, add = inputs
        h_in = jnp.where(first, init[s], h)
        return decay[:, None, None] * h_in + add, h_in

    _, entering = jax.lax.scan(carry, jnp.zeros(init.shape[1:], jnp.float32), (seq_j, k_j == 0, total, contrib))
    y_in = jnp.einsum("jlgn,jgrpn->jlgrp", c_c, entering.reshape(chunks, groups, rep, head_dim, state), precision=hi)
    y_in = y_in * jnp.exp(cum).transpose(0, 2, 1).reshape(chunks, length, groups, rep)[..., None]
    y_c = (y_own + y_in).reshape(chunks * length, heads, head_dim)

    # back to the packed tokens (a token no sequence owns, seq B, reads any row: it is zeroed), and
    # each sequence's state after its last chunk (an empty one keeps its starting state)
    seq, _, _ = ssm_math.sequence_layout(array_namespace(cu), cu, tokens)
    owner = jnp.minimum(seq, seqs - 1)
    offset = jnp.maximum(jnp.arange(tokens, dtype=jnp.int32) - cu[owner], 0)
    y = y_c[jnp.clip((first_chunk[owner] + offset // length) * length + offset % length, 0, chunks * length - 1)]
    last = jnp.maximum(chunk_end - 1, 0)
    finals = total[last][:, :, None, None] * entering[last] + contrib[last]
    finals = jnp.where((per_seq == 0)[:, None, None, None], init, finals)
    return y, finals, seq


@functools.partial(jax.jit, static_argnames=("chunk_size", "delta_softplus", "dt_limit"))
def ssd_chunk_scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
                   chunk_size: int = 256, delta_softplus: bool = True,
                   dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[Any, Any]:
    """``(y [T, H, P] in x's dtype, new ssm_state)`` of ``ssm_math.ssd_reference`` for complete,
    validated serving metadata (``ssm_batch``). Jitted: an eager call is one compiled program per
    shape, not an operation-by-operation dispatch; inside a caller's ``jit`` it is inlined."""
    xp = array_namespace(x)
    tokens, heads, _ = x.shape
    seqs = state_indices.shape[0]
    if tokens == 0:
        return ssm_math.ssd_reference(xp, x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices,
                                      has_initial_state, delta_softplus, dt_limit)
    f32 = jnp.float32
    rep = heads // B.shape[1]
    # every index read in bounds, bad traced metadata read as the native body reads it
    cu_seqlens, state_indices = ssm_math.sanitize_metadata(xp, cu_seqlens, state_indices, tokens,
                                                           ssm_state.shape[0])
    delta = ssm_math.process_dt(xp, dt, dt_bias, delta_softplus, dt_limit)
    a = A.astype(f32)
    xf, bf, cf = x.astype(f32), B.astype(f32), C.astype(f32)
    init = ssm_math.initial_states(xp, ssm_state, state_indices, has_initial_state)
    if tokens == seqs:
        y, finals = _decode(xf, delta, a, jnp.repeat(bf, rep, axis=1), jnp.repeat(cf, rep, axis=1), init)
        seq = jnp.arange(tokens, dtype=jnp.int32)
    else:
        y, finals, seq = _prefill(xf, delta, a, bf, cf, init, cu_seqlens, max(1, min(int(chunk_size), MAX_CHUNK)))
    return ssm_math.ssd_output(xp, y, x, D, z, state_indices, seq), \
        ssm_math.store_states(xp, ssm_state, state_indices, finals)
