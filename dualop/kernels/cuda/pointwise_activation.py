"""Pointwise activations ``y = act(x)`` as one Triton kernel family.

Twin of ``kernels/pallas/pointwise_activation.py``: the activation is a compile-time constant, math
in float32, result cast to x's dtype. Grid: 1-D over the flattened contiguous tensor, ``BLOCK``
elements per program, the ragged tail masked. xIELU's raw parameters arrive as pointers (they may
live on the GPU) and their softplus is taken in the kernel, so a call is one launch and no sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dualop.kernels.cuda.common import cast_out, needs_exact_bf16

__all__ = ["pointwise_activation", "ACTIVATION_IDS"]

ACTIVATION_IDS = {"gelu_new": 0, "gelu_fast": 1, "quick_gelu": 2, "relu2": 3, "xielu": 4, "gelu": 5}
PARAMETRIC = frozenset({"xielu"})
_BLOCK = 1024


@triton.jit
def _log1p_of(e):
    """``log(1 + e)`` for ``e >= 0``, accurate for small ``e`` (Kahan's trick; no log1p in tl)."""
    u = 1.0 + e
    small = u == 1.0
    return tl.where(small, e, tl.log(u) * (e / tl.where(small, 1.0, u - 1.0)))


@triton.jit
def _softplus(a):
    """torch's softplus: ``a`` above 20, else ``log(1 + exp(a))``. The clamp keeps exp finite; a
    NaN, which a GPU's fminf would drop, is selected back (a product ``0 * a`` would also turn
    softplus(-inf) = 0 into NaN)."""
    return tl.where(a > 20.0, a, tl.where(a != a, a, _log1p_of(tl.exp(tl.minimum(a, 20.0)))))


@triton.jit
def _sigmoid(t):
    """``1 / (1 + exp(-t))`` from ``exp(-|t|)``, which never overflows."""
    e = tl.exp(-tl.abs(t))
    r = 1.0 / (1.0 + e)
    return tl.where(t >= 0.0, r, e * r)


@triton.jit
def _expm1(x):
    """``exp(x) - 1`` accurate near 0 (Kahan's trick), from exp and log."""
    u = tl.exp(x)
    um1 = u - 1.0
    one = u == 1.0
    log_u = tl.log(tl.where(one | (u == 0.0), 2.0, u))  # the unselected lanes stay finite
    return tl.where(one, x, tl.where((um1 == -1.0) | (u == float("inf")), um1, um1 * (x / log_u)))


@triton.jit
def _pointwise_kernel(
    x_ptr, out_ptr, ap_ptr, an_ptr, n, beta, eps,
    ACT: tl.constexpr, BLOCK: tl.constexpr, EXACT_BF16: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # gelu_new; 0.5 * (1 + tanh(z)) == sigmoid(2z)
        y = x * _sigmoid(2.0 * (0.7978845608028654 * (x + 0.044715 * (x * x * x))))
    elif ACT == 1:  # gelu_fast
        y = x * _sigmoid(2.0 * (0.7978845608 * x * (1.0 + 0.044715 * (x * x))))
    elif ACT == 2:  # quick_gelu
        y = x * _sigmoid(1.702 * x)
    elif ACT == 3:  # relu2; where(x < 0) keeps NaN, as maximum(x, 0) does
        r = tl.where(x < 0.0, 0.0, x)
        y = r * r
    elif ACT == 5:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:  # xielu
        a_p = _softplus(tl.load(ap_ptr).to(tl.float32))
        a_n = beta + _softplus(tl.load(an_ptr).to(tl.float32))
        pos = a_p * x * x + beta * x
        neg = (_expm1(tl.minimum(x, eps)) - x) * a_n + beta * x
        y = tl.where(x > 0.0, pos, neg)
    tl.store(out_ptr + offs, cast_out(y, out_ptr, EXACT_BF16), mask=mask)


def pointwise_activation(
    x: torch.Tensor,
    alpha_p: torch.Tensor | None = None,
    alpha_n: torch.Tensor | None = None,
    *,
    activation: str,
    beta: float = 0.5,
    eps: float = -1e-6,
    block: int | None = None,
) -> torch.Tensor:
    """``act(x)`` elementwise, any shape. xIELU takes raw ``alpha_p``/``alpha_n`` (shape (1,)) on
    x's device. ``block`` (a power of two) overrides the elements per program; tests use it to
    force several programs and a ragged tail."""
    if activation not in ACTIVATION_IDS:
        raise ValueError(f"pointwise_activation: activation {activation!r} is not one of {sorted(ACTIVATION_IDS)}")
    given = (alpha_p is not None, alpha_n is not None)
    if (activation in PARAMETRIC and not all(given)) or (activation not in PARAMETRIC and any(given)):
        want = "alpha_p and alpha_n" if activation in PARAMETRIC else "no parameters"
        raise ValueError(f"pointwise_activation: activation {activation!r} takes {want}")
    flat = x.contiguous().view(-1)
    out = torch.empty_like(flat)
    n = flat.numel()
    if n > 0:
        blk = block or min(_BLOCK, triton.next_power_of_2(n))
        ap = alpha_p if alpha_p is not None else flat  # never read unless xielu
        an = alpha_n if alpha_n is not None else flat
        _pointwise_kernel[(triton.cdiv(n, blk),)](
            flat, out, ap, an, n, float(beta), float(eps),
            ACT=ACTIVATION_IDS[activation], BLOCK=blk, EXACT_BF16=needs_exact_bf16(x.dtype), num_warps=4,
        )
    return out.view(x.shape)
