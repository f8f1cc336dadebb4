"""Causal conv1d over packed sequences on the CPU for torch tensors: the ``causal_conv1d`` op's
``forward_cpu`` (contract: ``dualop/ops/causal_conv1d.py``, math: ``ssm_math.causal_conv1d_reference``).

Prefill lays the sequences end to end in one float32 buffer ``[T + B (K - 1), D]``, each behind its
``K - 1`` rows of history (its starting state), so every token's window is ``K`` consecutive rows:
``y = sum_k weight[:, k] * buf[rows + k]`` is K fused multiply-adds over contiguous rows (measured
here faster than a grouped ``F.conv1d`` over the same buffer, which needs the channels-first
transposes, and than ``torch.compile`` of the token loop). Each sequence's final state is the last
``K - 1`` rows of its segment of the buffer. A decode step (T == B) is one ``[B, D, K]`` window.
Windows never reach into another sequence's rows, so a NaN stays in its sequence; tokens past
``cu_seqlens[B]`` (traced metadata, ``ssm_math.sanitize_metadata``) give zeros.
"""

from __future__ import annotations

from typing import Any

from dualop.kernels import ssm_math

__all__ = ["causal_conv1d", "causal_conv1d_grouped_conv"]


def _finish(y, bias, activation):
    import torch.nn.functional as F

    if bias is not None:
        y = y.add_(bias.to(y.dtype))
    return F.silu(y, inplace=True) if activation == "silu" else y


def _padded(x, init, cu_seqlens):
    """``(buf [T + B H, D] float32, token_rows [T], seq_of_token [T])``: the sequences end to end,
    each behind its H = K - 1 history rows (``init [B, D, H]``); token t sits at row
    ``t + (seq(t) + 1) H``."""
    import torch

    num_tokens, dim = x.shape
    num_seqs, _, hist = init.shape
    seq = torch.searchsorted(cu_seqlens[1:], torch.arange(num_tokens, dtype=torch.int32), right=True)
    token_rows = torch.arange(num_tokens) + (seq + 1) * hist
    starts = cu_seqlens[:-1].to(torch.int64) + torch.arange(num_seqs) * hist  # each segment's first row
    hist_rows = (starts[:, None] + torch.arange(hist)[None, :]).reshape(-1)
    buf = torch.empty(num_tokens + num_seqs * hist, dim, dtype=torch.float32)
    buf.index_copy_(0, token_rows, x.to(torch.float32))
    buf.index_copy_(0, hist_rows, init.transpose(1, 2).reshape(num_seqs * hist, dim))
    return buf, token_rows, seq


def _store(x, y, conv_state, state_indices, finals, seq):
    import torch

    keep = torch.index_select(state_indices >= 0, 0, seq)
    y = y.masked_fill_(~keep[:, None], 0.0).to(x.dtype)
    return y, ssm_math.store_states(_torch_xp(), conv_state, state_indices, finals)


def _torch_xp():
    from dualop.backends.torch import array_api

    return array_api


def causal_conv1d(x: Any, weight: Any, bias: Any, conv_state: Any, cu_seqlens: Any, state_indices: Any,
                  has_initial_state: Any, *, activation: str | None) -> tuple[Any, Any]:
    """``(y [T, D], conv_state)`` for validated int32 metadata (``SSMBatch``); the cache is
    updated in place."""
    import torch

    num_tokens, dim = x.shape
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0:
        return x.new_empty((0, dim)), conv_state
    # bad metadata (traced, or a direct call) read as the native body reads it: indices in bounds
    cu_seqlens, state_indices = ssm_math.sanitize_metadata(_torch_xp(), cu_seqlens, state_indices, num_tokens,
                                                           conv_state.shape[0])
    init = ssm_math.initial_states(_torch_xp(), conv_state, state_indices, has_initial_state)  # [B, D, H] f32
    w = weight.to(torch.float32)
    if num_tokens == num_seqs:  # decode: one token per sequence
        window = torch.cat([init, x.to(torch.float32)[:, :, None]], dim=2)  # [B, D, K]
        y = _finish(torch.einsum("bdk,dk->bd", window, w), bias, activation)
        seq = torch.arange(num_seqs)
        return _store(x, y, conv_state, state_indices, window[:, :, 1:], seq)
    owned = int(cu_seqlens[-1])  # tokens past it belong to no sequence: zeros
    if owned < num_tokens:
        y, conv_state = _prefill(x[:owned], w, bias, conv_state, init, cu_seqlens, state_indices, activation)
        return torch.cat([y, x.new_zeros((num_tokens - owned, dim))]), conv_state
    return _prefill(x, w, bias, conv_state, init, cu_seqlens, state_indices, activation)


def _prefill(x, w, bias, conv_state, init, cu_seqlens, state_indices, activation):
    """The packed sequences end to end behind their histories (see the module docstring)."""
    import torch

    dim, kernel_size = w.shape
    hist = kernel_size - 1
    num_seqs = cu_seqlens.shape[0] - 1
    buf, token_rows, seq = _padded(x, init, cu_seqlens)
    rows = buf.shape[0] - hist
    out = buf[:rows] * w[:, 0]
    for k in range(1, kernel_size):
        out.addcmul_(buf[k:k + rows], w[:, k])
    # The window of the token at buffer row r ends at r: out row r - H.
    y = _finish(out.index_select(0, token_rows - hist), bias, activation)
    ends = cu_seqlens[1:].to(torch.int64) + torch.arange(1, num_seqs + 1) * hist  # one past each segment
    final_rows = ends[:, None] - hist + torch.arange(hist)[None, :]
    finals = buf.index_select(0, final_rows.reshape(-1)).reshape(num_seqs, hist, dim).transpose(1, 2)
    return _store(x, y, conv_state, state_indices, finals, seq)


def causal_conv1d_grouped_conv(x: Any, weight: Any, bias: Any, conv_state: Any, cu_seqlens: Any,
                               state_indices: Any, has_initial_state: Any, *, activation: str | None):
    """The same prefill as one grouped ``F.conv1d`` over the padded buffer (channels first): the
    peer ``causal_conv1d`` was measured against (kept for the benchmark)."""
    import torch
    import torch.nn.functional as F

    num_tokens, dim = x.shape
    hist = weight.shape[1] - 1
    num_seqs = cu_seqlens.shape[0] - 1
    init = ssm_math.initial_states(_torch_xp(), conv_state, state_indices, has_initial_state)
    buf, token_rows, seq = _padded(x, init, cu_seqlens)
    out = F.conv1d(buf.t()[None], weight.to(torch.float32)[:, None, :], None, groups=dim)[0]  # [D, rows]
    y = _finish(out.t().index_select(0, token_rows - hist), bias, activation)
    ends = cu_seqlens[1:].to(torch.int64) + torch.arange(1, num_seqs + 1) * hist
    final_rows = ends[:, None] - hist + torch.arange(hist)[None, :]
    finals = buf.index_select(0, final_rows.reshape(-1)).reshape(num_seqs, hist, dim).transpose(1, 2)
    return _store(x, y, conv_state, state_indices, finals, seq)
