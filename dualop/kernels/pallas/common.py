"""What every dualop Pallas kernel shares: the VMEM each TPU generation offers and row-block
sizing from it that respects TPU tiling, version compatibility for the few Pallas TPU names that
moved between JAX releases, and the interpret mode that lets the TPU kernels run on a CPU host."""

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
    "block_vmem_bytes",
    "VmemSpec",
    "TPU_VMEM",
    "vmem_spec",
    "block_budget",
    "step_vmem_ceiling",
    "current_generation",
    "tpu_jit",
    "resident_spec",
    "single_buffered",
    "streamed_spec",
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

MAX_BLOCK_ROWS = 512
_MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class VmemSpec:
    """VMEM of one TensorCore: ``capacity`` bytes in all, of which a kernel may use
    ``scoped_default`` unless its compiler params raise the limit (``vmem_limit_bytes``)."""

    capacity: int
    scoped_default: int


# Checked here by compiling a copy kernel for each topology with libtpu 0.0.52: a grid step's
# buffers just over ``scoped_default`` are refused ("Scoped allocation ... limit 16.00M" on v5e and
# v5p, 32.00M on v6e and tpu7x; v4 has no headroom above its 16 MiB), and with the limit raised the
# refusal names the capacity ("would exceed memory (size=67108864)" on v5p and tpu7x, 134217728 on
# v6e). The capacities are also JAX's (``jax._src.pallas.mosaic.tpu_info``, 0.10).
TPU_VMEM = {
    "v4": VmemSpec(capacity=16 * _MiB, scoped_default=16 * _MiB),
    "v5e": VmemSpec(capacity=128 * _MiB, scoped_default=16 * _MiB),
    "v5p": VmemSpec(capacity=64 * _MiB, scoped_default=16 * _MiB),
    "v6e": VmemSpec(capacity=128 * _MiB, scoped_default=32 * _MiB),
    "tpu7x": VmemSpec(capacity=64 * _MiB, scoped_default=32 * _MiB),
}
# Interpret mode on a CPU host, or a TPU this table does not know: the smallest VMEM above, so block
# choices made here are ones every generation accepts.
CONSERVATIVE_VMEM = VmemSpec(capacity=16 * _MiB, scoped_default=16 * _MiB)

# jax device_kind -> generation (the names jax reports for real chips and compile-only topologies).
_GENERATION_OF_KIND = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU7x": "tpu7x",
}

# A grid step's estimated working set aims at this fraction of the default scoped limit: Mosaic's
# own temporaries and tile padding come on top of the estimate (seen up to about 2x).
_BUDGET_FRACTION = 4
# Headroom over the estimate when a kernel must raise the scoped limit, and the share of the
# capacity it may take (the rest stays with the compiler: v5p and tpu7x report 63.94 of 64 MiB).
_LIMIT_MARGIN = 2
_CAPACITY_SHARE = 15 / 16


def current_generation() -> str | None:
    """The TPU generation kernels are built for: the ``compile_target`` if one is active, else the
    TPU this process runs on, else None (a CPU host: interpret mode)."""
    gen = _compile_target.get()
    return gen if gen is not None else _running_generation()


@functools.lru_cache(maxsize=None)
def _running_generation() -> str | None:
    """The generation of the attached TPU; never asks about a CPU host's devices."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    if device.platform != "tpu":
        return None
    return _GENERATION_OF_KIND.get(device.device_kind)


def vmem_spec(generation: str | None = None) -> VmemSpec:
    """The VMEM of ``generation`` (default: ``current_generation()``); conservative if unknown."""
    gen = current_generation() if generation is None else generation
    return TPU_VMEM.get(gen, CONSERVATIVE_VMEM)


def block_budget() -> int:
    """Bytes one grid step's blocks (double-buffered I/O and float32 temporaries) should take."""
    return vmem_spec().scoped_default // _BUDGET_FRACTION


def step_vmem_ceiling() -> int:
    """The largest estimated VMEM of one grid step that ``compiler_params(vmem_bytes=...)`` can
    still raise the scoped limit for on the current generation (its margin included): the budget
    of kernels whose working set cannot shrink to ``block_budget()`` (attention's per-head state)."""
    spec = vmem_spec()
    return int(spec.capacity * _CAPACITY_SHARE) // _LIMIT_MARGIN


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Tiling of a (rows, cols) problem: ``block_rows`` rows per grid step, ``block_cols`` columns."""

    block_rows: int
    block_cols: int

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        return pl.cdiv(rows, self.block_rows), pl.cdiv(cols, self.block_cols)


def online_softmax_update(scores, v, m_ref, l_ref, acc_ref) -> None:
    """One key block of an online softmax over float32 ``scores`` ``(rows, block)`` and values ``v``
    ``(block, D)``: the running row maximum ``m_ref`` and sum ``l_ref`` (``(rows, 128)``, equal across
    lanes) and the unnormalised output ``acc_ref`` ``(rows, D)`` take the block in. A row that has
    seen only -inf subtracts 0, so exp gives 0 rather than NaN."""
    m_prev, l_prev = m_ref[...], l_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(scores - m_shift[:, :1])
    alpha = jnp.exp(m_prev - m_shift)
    l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + jnp.dot(p, v, preferred_element_type=jnp.float32)


def sublane_tile(dtype) -> int:
    """Rows per vreg tile: 8 for 32-bit, 16 for 16-bit (packed), 32 for 8-bit types."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def row_blocks(rows: int, cols: int, dtype, bytes_per_elem: int, block_cols: int | None = None) -> RowBlocks:
    """Pick a TPU-legal row block for a row-wise kernel, within ``block_budget()``.

    ``bytes_per_elem`` counts every byte one element of one row costs in VMEM (inputs, outputs,
    double buffering, float32 temporaries). The row block is a multiple of the sublane tile, or
    the whole row count when that is smaller; the ragged last block is left to Pallas, which pads
    reads and masks writes of edge blocks. When one sublane tile of rows is over the budget the
    block is that one tile, and ``compiler_params(..., vmem_bytes=...)`` raises the limit for it.
    """
    block_cols = cols if block_cols is None else block_cols
    tile = sublane_tile(dtype)
    per_row = max(1, block_cols * bytes_per_elem)
    fit = max(tile, min(MAX_BLOCK_ROWS, block_budget() // per_row) // tile * tile)
    if rows <= fit:
        return RowBlocks(block_rows=max(rows, 1), block_cols=block_cols)
    return RowBlocks(block_rows=fit, block_cols=block_cols)


def block_vmem_bytes(block_rows: int, block_cols: int, dtype, bytes_per_elem: int) -> int:
    """Estimated VMEM of one grid step: the block padded to whole (sublane, 128-lane) tiles."""
    tile = sublane_tile(dtype)
    return pl.cdiv(block_rows, tile) * tile * pl.cdiv(block_cols, 128) * 128 * bytes_per_elem


def vmem_limit_bytes(vmem_bytes: int | None) -> int | None:
    """The scoped-VMEM limit a grid step of ``vmem_bytes`` (estimated) needs on the current
    generation, or None when the default limit has the margin for it."""
    if vmem_bytes is None:
        return None
    spec = vmem_spec()
    need = _LIMIT_MARGIN * vmem_bytes
    if need <= spec.scoped_default:
        return None
    return int(min(pl.cdiv(need, _MiB) * _MiB, spec.capacity * _CAPACITY_SHARE))


def compiler_params(n_grid_dims: int, *, vmem_bytes: int | None = None, semantics: tuple[str, ...] | None = None):
    """Grid dimensions ``parallel`` (rows are independent, so megacore chips split them) unless
    ``semantics`` says otherwise (``arbitrary`` for an axis a block accumulates over); the scoped
    VMEM limit raised when a grid step's estimated ``vmem_bytes`` needs it (``vmem_limit_bytes``)."""
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    semantics = ("parallel",) * n_grid_dims if semantics is None else semantics
    return cls(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit_bytes(vmem_bytes))


def single_buffered(vmem_bytes: int) -> bool:
    """Whether a grid step estimated at ``vmem_bytes`` (double-buffered) exceeds, with its margin,
    even the largest limit the current generation allows: then its streamed inputs take one
    buffer each (no overlap of the next block's fetch, but it fits; v4's 16 MiB at very wide rows)."""
    return _LIMIT_MARGIN * vmem_bytes > vmem_spec().capacity * _CAPACITY_SHARE


def streamed_spec(block_shape: tuple[int, ...], index_map, *, single: bool = False) -> pl.BlockSpec:
    """A block that moves with the grid; one VMEM buffer instead of two when ``single``."""
    if single:
        return pl.BlockSpec(block_shape, index_map, pipeline_mode=pl.Buffered(1))
    return pl.BlockSpec(block_shape, index_map)


def resident_spec(block_shape: tuple[int, ...]) -> pl.BlockSpec:
    """A block every grid step reads whole (a norm's weight): one VMEM buffer instead of two,
    since it is fetched once (a (1, hidden) block pads to 8 sublanes, so a second copy of a wide
    weight is not free: it decides whether float32 rows of 53248 with a residual fit v4)."""
    index = lambda *_: (0,) * len(block_shape)  # noqa: E731
    return pl.BlockSpec(block_shape, index, pipeline_mode=pl.Buffered(1))


def tpu_jit(*, static_argnames: tuple[str, ...]):
    """``jax.jit`` of a kernel entry point, keyed also on ``current_generation()``: block sizes and
    VMEM limits depend on it, so a trace for one generation must not be reused for another."""

    def decorate(fn):
        @functools.partial(jax.jit, static_argnames=(*static_argnames, "_generation"))
        def jitted(*args, _generation, **kwargs):
            return fn(*args, **kwargs)

        @functools.wraps(fn)
        def entry(*args, **kwargs):
            out = jitted(*args, _generation=current_generation(), **kwargs)
            if not isinstance(interpret_mode(), bool):
                _wait_for_interpreted(out)
            return out

        return entry

    return decorate


def _wait_for_interpreted(out) -> None:
    """Block until an eager call's outputs are ready under JAX's TPU interpreter.

    That interpreter simulates memory and DMAs in host callbacks, which themselves run jax
    operations. With the CPU client's asynchronous dispatch, the caller's next eager operation
    can be queued while such a callback waits for its own, and the process deadlocks (seen on
    this 2-core host: the test suite hung in a rotary native body after an interpreted kernel).
    Waiting here keeps one interpreted kernel in flight at a time. Inside a trace there is nothing
    to wait for; a caller that jits several ops around a kernel should turn asynchronous dispatch
    off (``JAX_CPU_ENABLE_ASYNC_DISPATCH=false``, as the test suite does)."""
    leaves = jax.tree_util.tree_leaves(out)
    if leaves and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        jax.block_until_ready(leaves)


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
TPU_GENERATIONS = tuple(TPU_VMEM)

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
