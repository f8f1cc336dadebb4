"""jax arrays on a GPU: XLA's and cuDNN's own kernels, since dualop's Triton kernels would need
jax-triton, whose current release needs Python >= 3.12. An op's ``forward_cuda`` takes these for
jax arrays where the built-in applies and declines (reported) where it does not."""

from __future__ import annotations

from typing import Any

__all__ = ["cudnn_declines", "cudnn_encoder_attention"]

_NO_TRITON = "no Triton launch for jax arrays (it would need jax-triton, which needs Python >= 3.12)"


def cudnn_declines(frontend: str) -> str | None:
    """Why jax arrays cannot take cuDNN's attention here (no GPU behind jax), or None."""
    import jax

    if jax.default_backend() != "gpu":
        return (f"{_NO_TRITON}; cuDNN's flash attention (jax.nn.dot_product_attention) serves jax arrays "
                f"on a GPU, and jax's backend here is {jax.default_backend()}")
    return None


def cudnn_encoder_attention(query, key, value, cu_seqlens=None, *, num_heads: int, num_kv_heads: int,
                            head_size: int, scale: float) -> Any:
    """``mm_encoder_attn`` with ``jax.nn.dot_product_attention(implementation="cudnn")``: [B, S, N, D]
    is its layout, GQA is native, packed segments become a block-diagonal mask. cuDNN takes 16-bit
    inputs only (and head sizes it supports): other calls decline to the native body."""
    import jax
    import jax.numpy as jnp

    if query.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"{_NO_TRITON}; cuDNN's flash attention takes bfloat16/float16, not {query.dtype}")
    b, s = query.shape[:2]
    q = query.reshape(b, s, num_heads, head_size)
    k = key.reshape(b, s, num_kv_heads, head_size)
    v = value.reshape(b, s, num_kv_heads, head_size)
    mask = None
    if cu_seqlens is not None:
        from dualop.backends.xla import array_api as xp
        from dualop.kernels.encoder_attention_math import segment_ids

        seg = segment_ids(xp, cu_seqlens, s, query)
        mask = (seg[:, None] == seg[None, :])[None, None]
    try:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError) as err:
        raise NotImplementedError(f"cuDNN's flash attention does not take this call ({err})") from err
    return out.reshape(query.shape)
