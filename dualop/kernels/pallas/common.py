"""What every dualop Pallas kernel shares: row-block sizing that respects TPU tiling, version
compatibility for the few Pallas TPU names that moved between JAX releases, and the interpret
mode that lets the TPU kernels run on a CPU host."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dualop.kernels.cost import KernelCost

__all__ = [
    "RowBlocks",
    "row_blocks",
    "compiler_params",
    "interpret_mode",
    "ENV_INTERPRET",
    "to_rows",
    "cost_estimate",
    "TPU_GENERATIONS",
    "compile_target",
    "target_generation",
]

ENV_INTERPRET = "DUALOP_PALLAS_INTERPRET"

# A block of this many bytes (all inputs and outputs of one grid step, double-buffered, plus the
# float32 temporaries) fits the default scoped VMEM of every TPU generation (16 MiB on v4/v5e).
VMEM_BLOCK_BUDGET = 4 * 1024 * 1024
MAX_BLOCK_ROWS = 512


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Tiling of a (rows, cols) problem: ``block_rows`` rows per grid step, ``block_cols`` columns."""

    block_rows: int
    block_cols: int

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        return pl.cdiv(rows, self.block_rows), pl.cdiv(cols, self.block_cols)


def sublane_tile(dtype) -> int:
    """Rows per vreg tile: 8 for 32-bit, 16 for 16-bit (packed), 32 for 8-bit types."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def row_blocks(rows: int, cols: int, dtype, bytes_per_elem: int, block_cols: int | None = None) -> RowBlocks:
    """Pick a TPU-legal row block for a row-wise kernel.

    ``bytes_per_elem`` counts every byte one element of one row costs in VMEM (inputs, outputs,
    double buffering, float32 temporaries). The row block is a multiple of the sublane tile, or
    the whole row count when that is smaller; the ragged last block is left to Pallas, which pads
    reads and masks writes of edge blocks.
    """
    block_cols = cols if block_cols is None else block_cols
    tile = sublane_tile(dtype)
    per_row = max(1, block_cols * bytes_per_elem)
    fit = max(tile, min(MAX_BLOCK_ROWS, VMEM_BLOCK_BUDGET // per_row) // tile * tile)
    if rows <= fit:
        return RowBlocks(block_rows=max(rows, 1), block_cols=block_cols)
    return RowBlocks(block_rows=fit, block_cols=block_cols)


def compiler_params(n_grid_dims: int):
    """Mark every grid dimension parallel (rows are independent), so megacore chips split them."""
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(dimension_semantics=("parallel",) * n_grid_dims)


@functools.lru_cache(maxsize=None)
def _tpu_interpret_params():
    """JAX's TPU interpreter, where this JAX can run it inside jit(custom_vmap(...)).

    JAX 0.7.x's TPU interpreter fails there (KeyError on its ordered IO effect), and its
    ``InterpretParams`` names moved across releases; older JAX gets the generic interpreter.
    """
    cls = getattr(pltpu, "InterpretParams", None)
    if cls is None or _jax_version() < (0, 8):
        return True
    return cls()


def _jax_version() -> tuple[int, ...]:
    return tuple(int(p) for p in jax.__version__.split(".")[:2] if p.isdigit())


# TPU generations dualop compiles for (the topology names of jax.experimental.topologies).
TPU_GENERATIONS = ("v4", "v5e", "v5p", "v6e", "tpu7x")

# The TPU generation kernels are being built for ahead of time (``dualop compile``), or None.
_compile_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("dualop_tpu_target", default=None)


def target_generation() -> str | None:
    """The TPU generation a ``compile_target`` block builds for, else None (then a kernel that
    needs the generation asks the TPU it runs on; never the default backend of a CPU host)."""
    return _compile_target.get()


@contextlib.contextmanager
def compile_target(generation: str) -> Iterator[str]:
    """Trace kernels for ``generation`` (one of ``TPU_GENERATIONS``) with interpretation off, so
    ``jit(...).lower().compile()`` on compile-only topology devices runs Mosaic for that chip."""
    if generation not in TPU_GENERATIONS:
        raise ValueError(f"compile_target: unknown TPU generation {generation!r}; expected one of {TPU_GENERATIONS}")
    token = _compile_target.set(generation)
    try:
        yield generation
    finally:
        _compile_target.reset(token)


def interpret_mode(frontend: str = "jax"):
    """The ``interpret=`` value for ``pl.pallas_call``.

    ``DUALOP_PALLAS_INTERPRET``: ``auto`` (default), ``tpu``, ``generic`` or ``off``. ``auto``
    compiles for a real TPU and otherwise interprets: JAX's TPU interpreter (simulated VMEM, DMAs,
    semaphores) for jax and torchax callers, the generic interpreter under torch_xla, whose
    ``call_jax`` cannot run the TPU interpreter's host callbacks (and on JAX < 0.8, see
    ``_tpu_interpret_params``).
    """
    if _compile_target.get() is not None:
        return False  # building for a real chip (dualop compile)
    mode = os.environ.get(ENV_INTERPRET, "auto").strip().lower() or "auto"
    if mode == "auto":
        if jax.default_backend() == "tpu":
            return False
        mode = "generic" if frontend == "torch_xla" else "tpu"
    if mode == "off":
        return False
    if mode == "generic":
        return True
    if mode == "tpu":
        return _tpu_interpret_params()
    raise ValueError(f"{ENV_INTERPRET}={mode!r}: expected auto, tpu, generic or off")


def to_rows(x: jax.Array) -> jax.Array:
    """View ``x`` as 2-D (rows, last dim); a free reshape for contiguous arrays."""
    return x.reshape(-1, x.shape[-1])


def rowwise_batching(call, n_rowwise: int):
    """Make ``call(*arrays)`` batch under ``vmap`` by folding the batch into rows.

    ``call`` must treat every leading dim of its first ``n_rowwise`` arrays as independent rows
    (a row-wise kernel), and its remaining arrays as per-call parameters (a norm's weight). A
    ``vmap`` then costs nothing: the batch axis becomes more rows of the same kernel, one grid.
    A batched parameter cannot be folded; then the batch is mapped with ``lax.map``.
    """

    @jax.custom_batching.custom_vmap
    def batched_call(*arrays):
        return call(*arrays)

    @batched_call.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        def full(a, b):
            return a if b else jnp.broadcast_to(a, (axis_size, *a.shape))

        if any(in_batched[n_rowwise:]):
            out = jax.lax.map(lambda xs: batched_call(*xs), tuple(map(full, arrays, in_batched)))
        else:
            rows = [full(a, b) for a, b in zip(arrays[:n_rowwise], in_batched[:n_rowwise])]
            out = batched_call(*rows, *arrays[n_rowwise:])
        return out, jax.tree.map(lambda _: True, out)

    return batched_call


def cost_estimate(cost: KernelCost) -> pl.CostEstimate:
    """The ``pl.CostEstimate`` of a kernel's cost model (``dualop/kernels/cost.py``)."""
    return pl.CostEstimate(**dataclasses.asdict(cost))
