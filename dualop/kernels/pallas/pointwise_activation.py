"""Pointwise activations ``y = act(x)`` as one Pallas TPU kernel family.

NewGELU (``gelu_new``), FastGELU (``gelu_fast``), QuickGELU, ReLU² and xIELU share this kernel;
the activation is a static parameter. Computation is in float32, the result cast to x's dtype.

Layout: the op is elementwise, so the shape of the caller's array does not matter, only how the
flattened data fills vregs (8 sublanes x 128 lanes).

- When the element count is a multiple of 128, the data is viewed lane-dense as
  ``(n // width, width)`` with ``width`` a multiple of 128 (up to 1024); every block is full-width.
- Otherwise it is viewed as ``(rows, last dim)``. A last dim that fits the VMEM budget is one
  full-width block (legal for any width); a wider one is split into 128-lane multiples and Pallas
  masks the ragged edge block. No copy or pad is made in either case.

Rows are blocked along sublanes (``row_blocks``); the ragged last row block is also a Pallas edge
block. xIELU's two scalars (``softplus(alpha_p)`` and ``beta + softplus(alpha_n)``, computed in
float32 outside the kernel from the raw parameters) ride in SMEM; ``beta`` and ``eps`` are static.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.backends.xla import array_api as xp
from dualop.kernels import cost as cost_model
from dualop.kernels import gate_math
from dualop.kernels.pallas.common import (
    block_budget,
    block_vmem_bytes,
    compiler_params,
    cost_estimate,
    row_blocks,
    rowwise_batching,
    sublane_tile,
    tpu_jit,
)

__all__ = [
    "pointwise_activation",
    "pointwise_activation_reference",
    "pointwise_activation_cost",
    "pointwise_layout",
    "ACTIVATIONS",
    "PARAMETRIC",
]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_LANE_WIDTHS = (1024, 512, 256, 128)


def _expm1(x):
    """``exp(x) - 1`` accurate near 0 (Kahan's trick), from exp and log only: Mosaic has no expm1."""
    u = jnp.exp(x)
    um1 = u - 1.0
    safe_log = jnp.log(jnp.where(u == 1.0, 2.0, u))
    return jnp.where(u == 1.0, x, jnp.where((um1 == -1.0) | (u == jnp.inf), um1, um1 * (x / safe_log)))


def _gelu_new(x):
    return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x))))


def _gelu(x):
    return gate_math.gelu(xp, x)


def _gelu_fast(x):
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608 * x * (1.0 + 0.044715 * (x * x))))


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


def _relu2(x):
    r = jnp.where(x < 0.0, 0.0, x)  # keeps NaN, as maximum(x, 0) does
    return r * r


def _xielu(x, a_p, a_n, *, beta: float, eps: float):
    """``a_p`` = softplus(alpha_p), ``a_n`` = beta + softplus(alpha_n), both float32 scalars."""
    pos = a_p * x * x + beta * x
    neg = (_expm1(jnp.minimum(x, eps)) - x) * a_n + beta * x
    return jnp.where(x > 0.0, pos, neg)


_FUNCTIONS = {
    "gelu_new": _gelu_new,
    "gelu": _gelu,
    "gelu_fast": _gelu_fast,
    "quick_gelu": _quick_gelu,
    "relu2": _relu2,
    "xielu": _xielu,
}
# name -> (float32 activation, flops per element, transcendentals per element); the counts are the
# cost model's (kernels/cost.py).
ACTIVATIONS = {name: (fn, *cost_model.POINTWISE_COUNTS[name]) for name, fn in _FUNCTIONS.items()}
# Activations that take (alpha_p, alpha_n) arrays and (beta, eps) statics.
PARAMETRIC = frozenset({"xielu"})


def _scalars(alpha_p, alpha_n, beta: float):
    """The (2,) float32 array of the xIELU slopes the kernel reads from SMEM."""
    a_p = jax.nn.softplus(alpha_p.astype(jnp.float32).reshape(1))
    a_n = beta + jax.nn.softplus(alpha_n.astype(jnp.float32).reshape(1))
    return jnp.concatenate([a_p, a_n])


@functools.partial(jax.jit, static_argnames=("activation", "beta", "eps"))
def pointwise_activation_reference(x, alpha_p=None, alpha_n=None, *, activation: str, beta: float = 0.5, eps: float = -1e-6):
    """The plain jax.numpy statement of the kernel (used by tests and docs; jitted, because
    op-by-op dispatch of its dozen small ops is slower than compiling them once)."""
    act = ACTIVATIONS[activation][0]
    xf = x.astype(jnp.float32)
    if activation in PARAMETRIC:
        p = _scalars(alpha_p, alpha_n, beta)
        return act(xf, p[0], p[1], beta=beta, eps=eps).astype(x.dtype)
    return act(xf).astype(x.dtype)


def pointwise_activation_cost(n: int, itemsize: int, activation: str) -> pl.CostEstimate:
    """One read and one write of every element (``kernels/cost.py``), as a ``pl.CostEstimate``."""
    return cost_estimate(cost_model.pointwise_activation_cost(n, itemsize, activation))


def pointwise_layout(shape: tuple[int, ...], dtype) -> tuple[int, int]:
    """The 2-D (rows, cols) view the kernel runs on (see the module docstring)."""
    n = math.prod(shape)
    if n % 128 == 0 and n > 0:
        tile = sublane_tile(dtype)
        fits = [w for w in _LANE_WIDTHS if n % w == 0]
        # widest lanes that still leave a full sublane tile of rows (else the narrowest, 128)
        width = next((w for w in fits if n // w >= tile), fits[-1])
        return n // width, width
    if len(shape) == 0:
        return 1, 1
    return n // shape[-1] if shape[-1] else 0, shape[-1]


def _lane_block(cols: int, dtype, per_elem: int) -> int:
    """Columns per block: the full width when a sublane tile of it fits the VMEM budget, else the
    widest multiple of 128 lanes that does (Pallas masks the ragged edge block)."""
    tile, budget = sublane_tile(dtype), block_budget()
    if cols * per_elem * tile <= budget:
        return cols
    return max(128, budget // (per_elem * tile) // 128 * 128)


def _kernel(*refs, act, parametric: bool):
    if parametric:
        p_ref, x_ref, o_ref = refs
        y = act(x_ref[...].astype(jnp.float32), p_ref[0], p_ref[1])
    else:
        x_ref, o_ref = refs
        y = act(x_ref[...].astype(jnp.float32))
    o_ref[...] = y.astype(o_ref.dtype)


@tpu_jit(static_argnames=("activation", "beta", "eps", "interpret", "block_rows", "block_cols"))
def pointwise_activation(
    x: jax.Array,
    alpha_p: jax.Array | None = None,
    alpha_n: jax.Array | None = None,
    *,
    activation: str,
    beta: float = 0.5,
    eps: float = -1e-6,
    interpret=False,
    block_rows: int | None = None,
    block_cols: int | None = None,
):
    """``act(x)`` elementwise, any shape (rank 0 included). xIELU takes the raw (pre-softplus)
    ``alpha_p`` and ``alpha_n`` (shape (1,)) and static ``beta``, ``eps``.

    ``block_rows`` / ``block_cols`` override the VMEM-budget tiling (``block_cols`` a multiple of
    128, used only when the data is not lane-dense); tests use them to force several blocks with
    ragged edges.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"pointwise_activation: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    parametric = activation in PARAMETRIC
    given = (alpha_p is not None, alpha_n is not None)
    if (parametric and not all(given)) or (not parametric and any(given)):
        want = "alpha_p and alpha_n" if parametric else "no parameters"
        raise ValueError(f"pointwise_activation: activation {activation!r} takes {want}")
    if block_cols is not None and block_cols % 128:
        raise ValueError(f"pointwise_activation: block_cols must be a multiple of 128, got {block_cols}")
    call = _build(activation, float(beta), float(eps), interpret, block_rows, block_cols)
    return call(x, alpha_p, alpha_n) if parametric else call(x)


@functools.lru_cache(maxsize=None)
def _build(activation: str, beta: float, eps: float, interpret, block_rows: int | None, block_cols: int | None):
    parametric = activation in PARAMETRIC
    act = ACTIVATIONS[activation][0]
    if parametric:
        act = functools.partial(act, beta=beta, eps=eps)
    kernel = functools.partial(_kernel, act=act, parametric=parametric)

    def call(x, *params):
        shape, dtype = x.shape, x.dtype
        n = math.prod(shape)
        if n == 0:
            return jnp.zeros(shape, dtype)
        rows, cols = pointwise_layout(shape, dtype)
        x2 = x.reshape(rows, cols)
        per_elem = 2 * 2 * dtype.itemsize + 16  # x and out double-buffered + float32 temporaries
        bc = _lane_block(cols, dtype, per_elem)
        if block_cols is not None and block_cols < cols and cols % 128:
            bc = block_cols
        blocks = row_blocks(rows, cols, dtype, per_elem, block_cols=bc)
        br = blocks.block_rows if block_rows is None else min(block_rows, rows)
        vmem = block_vmem_bytes(br, bc, dtype, per_elem)
        spec = pl.BlockSpec((br, bc), lambda i, j: (i, j))
        in_specs, operands = [spec], [x2]
        if parametric:
            in_specs.insert(0, pl.BlockSpec(memory_space=pltpu.SMEM))
            operands.insert(0, _scalars(*params, beta))
        out = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(rows, br), pl.cdiv(cols, bc)),
            in_specs=in_specs,
            out_specs=spec,
            out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
            compiler_params=compiler_params(2, vmem_bytes=vmem),
            cost_estimate=pointwise_activation_cost(n, dtype.itemsize, activation),
            interpret=interpret,
            name=f"dualop_{activation}",
        )(*operands)
        return out.reshape(shape)

    return rowwise_batching(call, n_rowwise=1)
