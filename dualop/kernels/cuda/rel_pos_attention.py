"""``rel_pos_attention`` as a Triton flash-attention kernel with the relative-position bias added
per tile; the projections and the per-query decomposed terms run as torch matmuls (float32).

One program per (image x head, query block): it holds ``BLOCK`` float32 queries and streams the
image's keys in ``BLOCK`` blocks with an online softmax (float32 running max and sum), so memory is
linear in S = H W. A tile's bias is gathered from the per-query terms: key ``j`` is image cell
``(j // W, j % W)``, and query ``i`` adds ``rel_h[i, j // W] + rel_w[i, j % W]`` (``rel_h [S, H]``
and ``rel_w [S, W]`` per head, ``ops/rel_pos_attention.rel_pos_terms``), so the S x S bias is never
stored. The head dim is padded to a power of two with masked loads.

Precision, as the op's contract: q, k and v come from float32 projections, ``q . k`` and ``P @ V``
are IEEE float32 dots (no TF32), one cast of the output after ``proj``. The key-block count is a
compile-time constant (Triton 3.5's interpreter cannot loop to a runtime bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rel_pos_attention"]

_MAX_BLOCK = 64  # query and key rows per block (registers: BLOCK x BLOCK_D float32 accumulator)
_MIN_BLOCK = 16  # tl.dot's smallest operand dim


@triton.jit
def _rel_pos_attention_kernel(
    q_ptr, k_ptr, v_ptr, rel_h_ptr, rel_w_ptr, out_ptr,
    seq_len, height, width, head_dim, scale,
    USE_REL_POS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, N_KV_BLOCKS: tl.constexpr,
):
    image_head = tl.program_id(0).to(tl.int64)
    q_block = tl.program_id(1)
    base = image_head * seq_len * head_dim
    rows = q_block * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < seq_len
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + base + rows[:, None] * head_dim + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0)

    rel_h_base = rel_h_ptr + image_head * seq_len * height
    rel_w_base = rel_w_ptr + image_head * seq_len * width
    m_i = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    for j in range(N_KV_BLOCKS):
        keys = j * BLOCK + tl.arange(0, BLOCK)
        key_ok = keys < seq_len
        kv_off = base + keys[:, None] * head_dim + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_REL_POS:  # in-image offsets in int32 (S x max(H, W) < 2^31), the image's base in int64
            tile_ok = row_ok[:, None] & key_ok[None, :]
            qk += tl.load(rel_h_base + rows[:, None] * height + (keys // width)[None, :], mask=tile_ok, other=0.0)
            qk += tl.load(rel_w_base + rows[:, None] * width + (keys % width)[None, :], mask=tile_ok, other=0.0)
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp gives 0, not NaN
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(qk - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + base + rows[:, None] * head_dim + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])


def rel_pos_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                      proj_weight: torch.Tensor, proj_bias: torch.Tensor | None, rel_pos_h: torch.Tensor | None = None,
                      rel_pos_w: torch.Tensor | None = None, *, num_heads: int, scale: float) -> torch.Tensor:
    """SAM's attention of ``x [B, H, W, dim]`` (see ``dualop/ops/rel_pos_attention.py``)."""
    from dualop.backends.torch import array_api as xp
    from dualop.kernels.rel_pos_math import project_out, project_qkv, rel_pos_terms

    b, height, width, _ = x.shape
    s = height * width
    if b * s == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    q, k, v = (t.contiguous() for t in project_qkv(xp, x, qkv_weight, qkv_bias, num_heads))
    head_dim = q.shape[-1]
    use_rel_pos = rel_pos_h is not None
    if use_rel_pos:
        rel_h, rel_w = (t.contiguous() for t in rel_pos_terms(xp, q, rel_pos_h, rel_pos_w, height, width))
    else:
        rel_h = rel_w = q  # not read
    out = torch.empty_like(q)
    block = min(_MAX_BLOCK, max(_MIN_BLOCK, triton.next_power_of_2(s)))
    n_blocks = triton.cdiv(s, block)
    block_d = max(_MIN_BLOCK, triton.next_power_of_2(head_dim))
    # Float32 operands (IEEE dots, no tensor-core layout) keep q, k, v, the scores, the gathered bias
    # and the accumulator in registers: at full blocks 8 warps and one stage keep them from spilling
    # (sm90 builds of SAM's windowed and global shapes: 4 warps or 2-3 stages spilled).
    _rel_pos_attention_kernel[(b * num_heads, n_blocks)](
        q, k, v, rel_h, rel_w, out,
        s, height, width, head_dim, float(scale),
        USE_REL_POS=use_rel_pos, BLOCK=block, BLOCK_D=block_d, N_KV_BLOCKS=n_blocks,
        num_warps=8 if block == _MAX_BLOCK else 4, num_stages=1,
    )
    return project_out(xp, out, proj_weight, proj_bias, x)
