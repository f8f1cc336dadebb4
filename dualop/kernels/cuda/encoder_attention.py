"""``mm_encoder_attn`` as a Triton flash-attention kernel: non-causal, GQA, packed segments.

Tokens are viewed as ``[T, H, D]`` (``T = B * S``) and split into segments by ``cu_seqlens``; a
batch without ``cu_seqlens`` is ``B`` segments of ``S``. One program per (segment, query block,
head): it reads ``BLOCK_M`` queries of its segment and streams the segment's keys in ``BLOCK_N``
blocks with an online softmax (float32 running max and sum), so memory is linear in S. Query head
``h`` reads kv head ``h // GROUP``. The head size is padded to the next power of two with masked
loads (80 -> 128, 72 -> 128), the padding contributing zeros to ``q . k`` and never stored.

Precision, as the op's contract: ``q . k`` from the inputs with float32 accumulation (exact
products for 16-bit inputs; IEEE float32 for float32 inputs, no TF32), probabilities kept in
float32 and ``P @ V`` in IEEE float32, one cast at the store. Under Triton's CPU interpreter 16-bit
``q . k`` is widened to float32 first: the interpreter's 16-bit ``tl.dot`` is wrong here (seen with
triton 3.9: errors of order 1 against the float32 products), while the widened products are the
exact ones a GPU's 16-bit dot accumulates. The key-block count is a
compile-time constant from ``max_seqlen`` (Triton 3.5's interpreter cannot loop to a runtime bound);
blocks past a segment's end are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda import interpreting
from dualop.kernels.cuda.common import cast_out, needs_exact_bf16

__all__ = ["encoder_attention", "block_sizes"]

_MAX_BLOCK = 64  # query and key rows per block (registers: BLOCK_M x BLOCK_D float32 accumulator)
_MIN_BLOCK = 16  # tl.dot's smallest operand dim


@triton.jit
def _encoder_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr,
    q_tok_stride, kv_tok_stride, out_tok_stride,
    head_size, scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    N_KV_BLOCKS: tl.constexpr, IEEE_QK: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    seg = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    start = tl.load(cu_ptr + seg).to(tl.int64)
    end = tl.load(cu_ptr + seg + 1).to(tl.int64)

    rows = start + q_block * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < end
    dim_ok = dims < head_size
    q = tl.load(q_ptr + rows[:, None] * q_tok_stride + head * head_size + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if IEEE_QK:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(N_KV_BLOCKS):
        keys = start + j * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        key_ok = keys < end
        kv_off = keys[:, None] * kv_tok_stride + kv_head * head_size + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE_QK:
            qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(key_ok[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    # A stored row's segment holds at least its own key, so l_i >= 1 unless every score is -inf:
    # then 0 / 0 = NaN, as softmax (the native body) gives; rows past the segment are not stored.
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * out_tok_stride + head * head_size + dims[None, :],
             cast_out(out, out_ptr, EXACT_BF16), mask=row_ok[:, None] & dim_ok[None, :])


def block_sizes(max_seqlen: int) -> tuple[int, int]:
    """(BLOCK_M = BLOCK_N, key-block count) for segments of at most ``max_seqlen`` tokens."""
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, triton.next_power_of_2(max(max_seqlen, 1))))
    return block, triton.cdiv(max(max_seqlen, 1), block)


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cu_seqlens: torch.Tensor | None = None, *, max_seqlen: int | None = None, num_heads: int,
                      num_kv_heads: int, head_size: int, scale: float) -> torch.Tensor:
    """Non-causal attention of ``query`` over ``key``/``value`` ([B, S, H*D] or [B, S, H, D]).

    ``max_seqlen`` (the longest segment) sizes the loops; without it the longest segment is read
    from ``cu_seqlens`` (one device sync), or S when its values are not readable (meta tensors of
    ``dualop compile``).
    """
    b, s = query.shape[:2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if b * s == 0:
        return out
    q = query.reshape(b * s, num_heads * head_size).contiguous()
    k = key.reshape(b * s, num_kv_heads * head_size).contiguous()
    v = value.reshape(b * s, num_kv_heads * head_size).contiguous()
    if cu_seqlens is None:
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        longest = s
    else:
        cu = cu_seqlens.to(torch.int32).contiguous()
        if max_seqlen is not None:
            longest = int(max_seqlen)
        elif cu.device.type == "meta":
            longest = s
        else:
            longest = int((cu[1:] - cu[:-1]).max())
    block, n_kv_blocks = block_sizes(longest)
    block_d = max(_MIN_BLOCK, triton.next_power_of_2(head_size))
    # float32 operands (IEEE dots, no tensor-core layout) hold q, k, v, the logits and the
    # accumulator in registers: 8 warps at head sizes above 64 keep them from spilling.
    num_warps = 8 if query.dtype == torch.float32 and block_d > 64 else 4
    out2 = out.view(b * s, num_heads * head_size)
    grid = (cu.shape[0] - 1, n_kv_blocks, num_heads)
    _encoder_attention_kernel[grid](
        q, k, v, out2, cu,
        q.stride(0), k.stride(0), out2.stride(0),
        head_size, float(scale),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block, BLOCK_N=block,
        BLOCK_D=block_d, N_KV_BLOCKS=n_kv_blocks,
        IEEE_QK=query.dtype == torch.float32 or interpreting(), EXACT_BF16=needs_exact_bf16(query.dtype),
        num_warps=num_warps,
    )
    return out
