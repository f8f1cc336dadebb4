"""The state-space recurrences, written once against an array namespace ``xp``: the native bodies
of ``causal_conv1d``, ``selective_scan`` and ``ssd_chunk_scan`` (and so of the Mamba mixers that
compose them), and the references every kernel of those ops is tested against.

Every op here runs over a batch of sequences packed along the token axis (``SSMBatch``,
``dualop/ops/ssm_batch.py``): sequence ``b`` is tokens ``cu_seqlens[b] : cu_seqlens[b + 1]``, its
state lives in slot ``state_indices[b]`` of a state cache ``[slots, *state_shape]``, and it starts
from that slot's state when ``has_initial_state[b]``, else from zeros. A sequence whose slot is
``-1`` (padding) gives zero outputs and writes no state; so do tokens no sequence owns (past
``cu_seqlens[B]`` in traced metadata: ``sanitize_metadata`` says how such metadata is read). Padding
rows are dropped by selects, so a NaN there reaches nothing else.

The recurrences are the plain token-by-token ones (no chunking): one ``step(h, *inputs_t) -> (h,
y_t)`` per op, run by ``scan_packed`` (a Python loop for torch tensors, ``lax.scan`` for jax arrays,
so the native bodies trace under ``jit``). Everything is computed in float32; outputs are cast to
the input's dtype and states to the cache's dtype once, at the end.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "sequence_layout",
    "token_keep",
    "sanitize_metadata",
    "initial_states",
    "store_states",
    "scan_packed",
    "causal_conv1d_reference",
    "selective_scan_reference",
    "ssd_reference",
    "ssd_output",
    "process_dt",
]


def _is_jax(xp) -> bool:
    return xp.name != "torch"


def sequence_layout(xp, cu_seqlens: Any, num_tokens: int) -> tuple[Any, Any, Any]:
    """``(seq_of_token, is_first, is_last)``, each ``[num_tokens]``: the sequence each packed token
    belongs to and whether it opens or closes it (``cu_seqlens`` ``[B + 1]``). Token t belongs to
    sequence ``#{b >= 1: cu_seqlens[b] <= t}``; a token outside ``[cu_seqlens[0], cu_seqlens[B])``
    (traced metadata that ends early, ``sanitize_metadata``) belongs to none: its ``seq`` is B and
    it neither opens nor closes a sequence."""
    cu = xp.astype(cu_seqlens, xp.int32)
    num_seqs = cu.shape[0] - 1
    t = xp.arange(num_tokens, like=cu, dtype=xp.int32)
    seq = xp.sum(xp.astype(t[:, None] >= cu[None, 1:], xp.int32), axis=1)
    owned = (t >= cu[0]) & (seq < num_seqs)
    seq = xp.where(owned, seq, num_seqs)
    starts, ends = xp.take(cu, seq, axis=0), xp.take(cu, xp.minimum(seq + 1, num_seqs), axis=0)
    return seq, owned & (t == starts), owned & (t == ends - 1)


def token_keep(xp, state_indices: Any, seq: Any) -> Any:
    """``[T]`` bool: the tokens whose outputs are kept, those of a sequence with a real slot;
    padding sequences' tokens (slot -1) and tokens no sequence owns (``seq`` B, as
    ``sequence_layout`` gives it) give zeros, by a select (a NaN in a dropped row stays there)."""
    num_seqs = state_indices.shape[0]
    real = xp.take(state_indices >= 0, xp.minimum(seq, num_seqs - 1), axis=0)
    return real & (seq < num_seqs)


def sanitize_metadata(xp, cu_seqlens: Any, state_indices: Any, num_tokens: int, num_slots: int) -> tuple[Any, Any]:
    """Traced metadata (values no check could read) made safe to index with, the same way for the
    native body and every kernel (``ssm_batch`` applies it): ``cu_seqlens`` (int32) starts at 0,
    is clamped into ``[0, T]`` and made non-decreasing (a running max), so a sequence may be empty
    (its slot then gets its starting state) and tokens past ``cu_seqlens[B]`` belong to no sequence
    (zero outputs, nothing read or written); a slot outside ``[0, num_slots)`` is padding (-1). A
    decode step (T == B) is token b = sequence b whatever ``cu_seqlens`` says, as its kernels read
    it. Valid metadata comes back unchanged."""
    num_seqs = state_indices.shape[0]
    slots = xp.astype(state_indices, xp.int32)
    slots = xp.where((slots >= 0) & (slots < num_slots), slots, -1)
    b = xp.arange(num_seqs + 1, like=slots, dtype=xp.int32)
    if num_tokens == num_seqs:
        return b, slots
    cu = xp.where(b == 0, 0, xp.clip(xp.astype(cu_seqlens, xp.int32), min=0, max=num_tokens))
    if _is_jax(xp):
        import jax

        cu = jax.lax.cummax(cu, axis=0)
    else:
        import torch

        cu = torch.cummax(cu, 0).values
    return cu, slots


def initial_states(xp, cache: Any, state_indices: Any, has_initial_state: Any) -> Any:
    """Each sequence's starting state ``[B, *state_shape]`` in float32: its slot's cached state
    when ``has_initial_state`` and the slot is not padding (-1), else zeros."""
    valid = (state_indices >= 0) & (state_indices < cache.shape[0])  # outside the cache: padding
    slot = xp.where(valid, state_indices, 0)
    cached = xp.astype(xp.take(cache, slot, axis=0), xp.float32)
    use = xp.reshape(has_initial_state & valid, (-1,) + (1,) * (cached.ndim - 1))
    return xp.where(use, cached, 0.0)


def store_states(xp, cache: Any, state_indices: Any, finals: Any) -> Any:
    """Write each sequence's final state into its slot (padding slots dropped), cast to the cache's
    dtype: IN PLACE for a torch cache (returned), a new array for jax."""
    valid = (state_indices >= 0) & (state_indices < cache.shape[0])
    slot = xp.where(valid, state_indices, 0)
    return xp.set_at_dropping(cache, (slot,), xp.astype(finals, cache.dtype), valid)


def scan_packed(xp, step: Callable, per_token: tuple, initial: Any, layout: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """Run ``h, y_t = step(h, *[a[t] for a in per_token])`` over the packed tokens, restarting at
    each sequence's first token from ``initial[seq]``; return ``(ys [T, ...], finals [B, ...])``
    (a sequence's final state is its state after its last token)."""
    seq, is_first, is_last = layout
    num_tokens = seq.shape[0]
    if _is_jax(xp):
        import jax
        import jax.numpy as jnp

        if num_tokens and num_tokens == initial.shape[0]:
            # a decode step (T == B: every sequence is non-empty, so each is one token, in order):
            # the step on every sequence at once, not a loop over them
            finals, ys = jax.vmap(step)(initial, *per_token)
            return ys, finals

        lax = jax.lax

        def body(carry, inputs):
            h, finals = carry
            s, first, last, *xs = inputs
            h = jnp.where(first, lax.dynamic_index_in_dim(initial, s, keepdims=False), h)
            h, y = step(h, *xs)
            # the whole-cache select on a scalar: XLA keeps it an in-place update of one slot (a
            # read of finals[s] to select in measured 12-18% slower over 1024 tokens)
            finals = jnp.where(last, lax.dynamic_update_index_in_dim(finals, h, s, 0), finals)
            return (h, finals), y

        h0 = jnp.zeros(initial.shape[1:], jnp.float32)
        (_, finals), ys = jax.lax.scan(body, (h0, initial), (seq, is_first, is_last, *per_token), length=num_tokens)
        return ys, finals
    import torch

    # Selects on the metadata tensors, not Python branches on their values: torch.compile traces
    # this loop (the native body under custom_ops="none") without reading data.
    finals = initial.clone()
    h, ys = torch.zeros_like(initial[0]), []
    seq = torch.clamp(seq, max=initial.shape[0] - 1)  # a token no sequence owns: never first or last
    for t in range(num_tokens):
        s = seq[t:t + 1]  # a one-element index tensor (an int index would read its value)
        h = torch.where(is_first[t], initial.index_select(0, s)[0], h)
        h, y = step(h, *(a[t] for a in per_token))
        ys.append(y)
        finals.index_copy_(0, s, torch.where(is_last[t], h, finals.index_select(0, s)[0])[None])
    if not ys:
        return None, finals
    return torch.stack(ys), finals


def _zero_padding_rows(xp, y: Any, state_indices: Any, seq: Any) -> Any:
    """Tokens of padding sequences (slot -1), and tokens no sequence owns, give zeros."""
    keep = token_keep(xp, state_indices, seq)
    return xp.where(xp.reshape(keep, (-1,) + (1,) * (y.ndim - 1)), y, 0.0)


def _empty_like_tokens(xp, x: Any, shape: tuple, dtype: Any) -> Any:
    return xp.astype(xp.reshape(x[:0], (0, *shape)), dtype)


def causal_conv1d_reference(xp, x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state,
                            activation: str | None) -> tuple[Any, Any]:
    """Depthwise causal conv1d over packed sequences: ``y[t, d] = act(bias[d] + sum_k weight[d, k]
    * window[d, k])`` where the window is the sequence's previous ``K - 1`` inputs (from the cached
    state at its start) and ``x[t]``. x ``[T, D]``, weight ``[D, K]``, conv_state ``[S, D, K - 1]``
    (the last ``K - 1`` inputs, oldest first). Returns ``(y [T, D] in x's dtype, conv_state)``."""
    num_tokens, dim = x.shape
    layout = sequence_layout(xp, cu_seqlens, num_tokens)
    w = xp.astype(weight, xp.float32)
    b = None if bias is None else xp.astype(bias, xp.float32)

    def step(h, x_t):
        window = xp.concat([h, x_t[:, None]], axis=1)  # [D, K]
        y = xp.sum(window * w, axis=1)
        if b is not None:
            y = y + b
        if activation == "silu":
            y = y * xp.sigmoid(y)
        return window[:, 1:], y

    init = initial_states(xp, conv_state, state_indices, has_initial_state)
    ys, finals = scan_packed(xp, step, (xp.astype(x, xp.float32),), init, layout)
    if ys is None:
        return _empty_like_tokens(xp, x, (dim,), x.dtype), conv_state
    y = _zero_padding_rows(xp, ys, state_indices, layout[0])
    return xp.astype(y, x.dtype), store_states(xp, conv_state, state_indices, finals)


def process_dt(xp, dt, dt_bias, softplus: bool, dt_limit: tuple[float, float] | None = None) -> Any:
    """The step sizes as the scans use them, float32: ``dt + dt_bias``, then ``softplus`` when
    asked, then clamped to ``dt_limit`` (Mamba-2's ``time_step_limit``) when given."""
    d = xp.astype(dt, xp.float32)
    if dt_bias is not None:
        d = d + xp.astype(dt_bias, xp.float32)
    if softplus:
        d = xp.softplus(d)
    if dt_limit is not None and (dt_limit[0] > 0.0 or dt_limit[1] != float("inf")):
        d = xp.clip(d, min=dt_limit[0], max=dt_limit[1])
    return d


def selective_scan_reference(xp, x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices,
                             has_initial_state, delta_softplus: bool) -> tuple[Any, Any]:
    """Mamba-1's selective scan over packed sequences. x, dt, z ``[T, I]``; A ``[I, N]``; B, C
    ``[T, N]``; D, dt_bias ``[I]``; ssm_state ``[S, I, N]``. With ``Δ = process_dt(dt)``:
    ``h_t = exp(Δ_t A) ⊙ h_{t-1} + (Δ_t x_t) ⊗ B_t``, ``y_t = h_t C_t + D ⊙ x_t``, then
    ``y_t ⊙ silu(z_t)`` when z is given. Returns ``(y [T, I] in x's dtype, ssm_state)``."""
    num_tokens, dim = x.shape
    layout = sequence_layout(xp, cu_seqlens, num_tokens)
    a = xp.astype(A, xp.float32)
    xf = xp.astype(x, xp.float32)
    delta = process_dt(xp, dt, dt_bias, delta_softplus)

    def step(h, d_t, x_t, b_t, c_t):
        h = xp.exp(d_t[:, None] * a) * h + (d_t * x_t)[:, None] * b_t[None, :]
        return h, h @ c_t  # a matrix-vector product (a dot: XLA's and ATen's fastest form of the sum)

    init = initial_states(xp, ssm_state, state_indices, has_initial_state)
    ys, finals = scan_packed(xp, step, (delta, xf, xp.astype(B, xp.float32), xp.astype(C, xp.float32)), init,
                             layout)
    if ys is None:
        return _empty_like_tokens(xp, x, (dim,), x.dtype), ssm_state
    if D is not None:
        ys = ys + xp.astype(D, xp.float32) * xf
    if z is not None:
        zf = xp.astype(z, xp.float32)
        ys = ys * (zf * xp.sigmoid(zf))
    y = _zero_padding_rows(xp, ys, state_indices, layout[0])
    return xp.astype(y, x.dtype), store_states(xp, ssm_state, state_indices, finals)


def ssd_reference(xp, x, dt, A, B, C, D, z, dt_bias, ssm_state, cu_seqlens, state_indices, has_initial_state,
                  delta_softplus: bool, dt_limit: tuple[float, float] | None = None) -> tuple[Any, Any]:
    """Mamba-2's state-space duality recurrence (the SSD scan, token by token). x, z ``[T, H, P]``;
    dt ``[T, H]``; A, dt_bias ``[H]`` (A a scalar per head); B, C ``[T, G, N]`` (head h reads group
    ``h // (H / G)``); D ``[H]`` or ``[H, P]``; ssm_state ``[S, H, P, N]``. With ``Δ = process_dt``:
    ``h_t = exp(Δ_t A) h_{t-1} + Δ_t (x_t ⊗ B_t)``, ``y_t = h_t C_t + D x_t``, then ``y_t ⊙ silu(z_t)``
    when z is given. Returns ``(y [T, H, P] in x's dtype, ssm_state)``."""
    num_tokens, heads, head_dim = x.shape
    groups = B.shape[1]
    layout = sequence_layout(xp, cu_seqlens, num_tokens)
    head_group = xp.arange(heads, like=cu_seqlens, dtype=xp.int32) // (heads // groups)
    bh = xp.take(xp.astype(B, xp.float32), head_group, axis=1)  # [T, H, N]
    ch = xp.take(xp.astype(C, xp.float32), head_group, axis=1)
    a = xp.astype(A, xp.float32)
    xf = xp.astype(x, xp.float32)
    delta = process_dt(xp, dt, dt_bias, delta_softplus, dt_limit)  # [T, H]

    def step(h, d_t, x_t, b_t, c_t):
        decay = xp.exp(d_t * a)[:, None, None]
        h = decay * h + (d_t[:, None] * x_t)[:, :, None] * b_t[:, None, :]
        return h, (h @ c_t[:, :, None])[..., 0]  # per head [P, N] @ [N]

    init = initial_states(xp, ssm_state, state_indices, has_initial_state)
    ys, finals = scan_packed(xp, step, (delta, xf, bh, ch), init, layout)
    if ys is None:
        return _empty_like_tokens(xp, x, (heads, head_dim), x.dtype), ssm_state
    return ssd_output(xp, ys, x, D, z, state_indices, layout[0]), store_states(xp, ssm_state, state_indices, finals)


def ssd_output(xp, ys: Any, x: Any, D: Any, z: Any, state_indices: Any, seq: Any) -> Any:
    """The SSD scan's elementwise tail on its float32 ``ys`` ``[T, H, P]``: ``+ D x``, times
    ``silu(z)``, padding sequences' rows zeroed (``seq``: each token's sequence), cast to x's dtype."""
    if D is not None:
        d = xp.astype(D, xp.float32)
        ys = ys + (d[:, None] if d.ndim == 1 else d) * xp.astype(x, xp.float32)
    if z is not None:
        zf = xp.astype(z, xp.float32)
        ys = ys * (zf * xp.sigmoid(zf))
    return xp.astype(_zero_padding_rows(xp, ys, state_indices, seq), x.dtype)
