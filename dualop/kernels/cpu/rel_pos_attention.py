"""``rel_pos_attention`` on the CPU for torch tensors: the projections and the per-query
relative-position terms as torch matmuls (float32), the attention in C++ (``csrc/rel_pos_attention.cc``)
with the bias added per score."""

from __future__ import annotations

from typing import Any

from dualop.kernels.cpu.abi import c_function
from dualop.kernels.cpu.common import threads_for

__all__ = ["rel_pos_attention"]

# The C entry point, stated once: the build checks csrc/rel_pos_attention.cc against it.
_C_REL_POS_ATTENTION = c_function(
    "int dualop_rel_pos_attention(const float* q, const float* k, const float* v, const float* rel_h, "
    "const float* rel_w, float* out, int64_t images, int64_t seq_len, int64_t height, int64_t width, "
    "int64_t head_dim, float scale, int threads)")


def rel_pos_attention(x: Any, qkv_weight: Any, qkv_bias: Any, proj_weight: Any, proj_bias: Any, rel_pos_h: Any = None,
                      rel_pos_w: Any = None, *, num_heads: int, scale: float) -> Any:
    """SAM's attention of ``x [B, H, W, dim]`` (see ``dualop/ops/rel_pos_attention.py``)."""
    import torch

    from dualop.backends.torch import array_api as xp
    from dualop.kernels.rel_pos_math import project_out, project_qkv, rel_pos_terms

    if x.device.type != "cpu":
        raise NotImplementedError(f"the C++ rel_pos_attention kernel takes CPU tensors, got one on {x.device}")
    b, height, width, _ = x.shape
    s = height * width
    if b * s == 0:
        return torch.zeros(x.shape, dtype=x.dtype)
    q, k, v = (t.contiguous() for t in project_qkv(xp, x, qkv_weight, qkv_bias, num_heads))
    rel_h = rel_w = None
    if rel_pos_h is not None:
        rel_h, rel_w = (t.contiguous() for t in rel_pos_terms(xp, q, rel_pos_h, rel_pos_w, height, width))
    out = torch.empty_like(q)
    status = _C_REL_POS_ATTENTION(q=q, k=k, v=v, rel_h=rel_h, rel_w=rel_w, out=out, images=b * num_heads, seq_len=s,
                                  height=height, width=width, head_dim=q.shape[-1], scale=float(scale),
                                  threads=threads_for(q.numel() * s // max(q.shape[-1], 1)))
    if status != 0:
        raise NotImplementedError(f"dualop_rel_pos_attention returned {status}")
    return project_out(xp, out, proj_weight, proj_bias, x)
