"""Compile Pallas kernels for real TPU generations on a host with no TPU.

libtpu gives compile-only devices for a named topology (``jax.experimental.topologies``); a
function traced on ``ShapeDtypeStruct``s sharded over one of them and ``.lower().compile()``d runs
XLA:TPU and Mosaic for that chip, which refuse what the chip would (``CompileTimeScopedVmemOom``,
a primitive Mosaic cannot lower, a block off the (8, 128) tile). Kernels are traced inside
``compile_target(generation)``, so they lower for Mosaic and size their blocks for that chip.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from dualop.aot.result import KernelResult, first_line
from dualop.aot.variants import InputSpec, Variant

__all__ = ["TOPOLOGIES", "build", "compile_function", "compile_variant", "pallas_calls", "topology_devices",
           "tpu_available"]

# The smallest topology name libtpu resolves for each generation (v4, v5p and tpu7x have no 1x1).
TOPOLOGIES = {
    "v4": "v4:2x2x1",
    "v5e": "v5e:1x1",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:1x1",
    "tpu7x": "tpu7x:2x2x1",
}


def _no_tpu_attached() -> bool:
    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


if _no_tpu_attached():
    # Compile-only use: let several processes load libtpu at once (it otherwise takes a host-wide
    # lock file meant to stop two programs sharing one TPU). Read when libtpu first loads.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[Any]:
    """Send file descriptor 2 (where libtpu and XLA's C++ logging write: the TPU-init error jax
    logs on a CPU host, TPU_ACCELERATOR_TYPE warnings) to a temporary file for the block. Yields
    a text stream on the original stderr, for output that must still be seen (the progress bar)."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        visible = os.fdopen(os.dup(saved), "w", buffering=1)
        try:
            yield visible
        finally:
            visible.flush()
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            visible.close()


def tpu_available(layers: bool = False) -> str | None:
    """None if TPU compiles can run here, else why not and which extra installs what they need:
    libtpu and jax, and with ``layers`` (the sharded layers of topology targets, whole models)
    flax as well."""
    try:
        import libtpu  # noqa: F401
        from jax.experimental import topologies  # noqa: F401

        if layers:
            import flax  # noqa: F401
    except ImportError as err:
        needs = "libtpu, jax and flax" if layers else "libtpu and jax"
        return f"the TPU {'topology ' if layers else ''}targets need {needs} ({err}): pip install 'dualop[tpu]'"
    return None


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str):
    """The compile-only devices of a libtpu topology name (``v5e:1x1``, ``v6e:2x4``, ...)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices


def _devices(generation: str):
    return topology_devices(TOPOLOGIES[generation])


def _abstract(spec: Any, sharding) -> Any:
    import jax
    import jax.numpy as jnp

    from dualop.aot.variants import map_specs

    return map_specs(spec, lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype), sharding=sharding))


def _sub_jaxprs(value: Any) -> Iterator[Any]:
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def pallas_calls(jaxpr) -> list[Any]:
    """Every ``pallas_call`` equation in ``jaxpr`` and the jaxprs nested in it, each once."""
    found, seen = [], set()

    def walk(j):
        if id(j) in seen:
            return
        seen.add(id(j))
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
                continue
            for value in eqn.params.values():
                for sub in _sub_jaxprs(value):
                    walk(sub)

    walk(jaxpr)
    return found


def _block_dims(block_shape) -> tuple[int, ...]:
    """A block shape as ints (a squeezed dim counts as 1)."""
    dims = []
    for d in block_shape:
        size = getattr(d, "block_size", d)  # Blocked(block_size=n) in newer JAX, a plain int before
        dims.append(size if isinstance(size, int) else 1)  # None / Squeezed(): a squeezed dim
    return tuple(dims)


def _in_smem(aval) -> bool:
    """Whether a block or scratch buffer lives outside VMEM: in SMEM (scalars), or left in HBM
    (``memory_space=ANY``, an input the kernel copies from itself, such as a paged KV cache)."""
    space = str(getattr(aval, "memory_space", "")).lower()
    return any(name in space for name in ("smem", "any", "hbm"))


def describe_pallas_call(eqn) -> dict[str, Any]:
    """Grid, block shapes and the VMEM one grid step asks for: every VMEM block times its buffer
    count (2 unless the spec says otherwise: the pipeline fetches step i+1 while step i runs),
    plus VMEM scratch, and the kernel's own ``vmem_limit_bytes`` if it sets one."""
    gm = eqn.params["grid_mapping"]
    blocks, vmem = [], 0
    for bm in gm.block_mappings:
        dims = _block_dims(bm.block_shape)
        # The whole array's type: array_aval in newer JAX, array_shape_dtype in 0.7.
        dtype = getattr(bm, "array_aval", None) or bm.array_shape_dtype
        dtype = dtype.dtype
        blocks.append("x".join(map(str, dims)) + f":{dtype}")
        if not _in_smem(getattr(bm, "transformed_block_aval", None)):
            buffers = getattr(getattr(bm, "pipeline_mode", None), "buffer_count", None) or 2
            vmem += buffers * math.prod(dims) * dtype.itemsize
    for aval in getattr(gm, "scratch_avals", ()) or ():
        shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
        if shape is not None and hasattr(dtype, "itemsize") and not _in_smem(aval):
            vmem += math.prod(shape) * dtype.itemsize
    params = eqn.params.get("compiler_params")
    limit = getattr(params, "vmem_limit_bytes", None)
    if limit is None and isinstance(params, dict):  # older JAX: {"mosaic": {...}}
        limit = (params.get("mosaic") or params.get("mosaic_tpu") or {}).get("vmem_limit_bytes")
    name = eqn.params.get("name") or eqn.params.get("name_and_src_info") or "pallas_call"
    return {
        "kernel": str(getattr(name, "name", name)),
        # A dimension known only at run time (megablox gmm's tile count) shows as "dynamic".
        "grid": tuple(int(g) if isinstance(g, int) else "dynamic" for g in gm.grid),
        "blocks": blocks,
        "vmem_bytes": vmem,
        "vmem_limit_bytes": limit,
    }


# Compiles already done in this process: (generation, hash of the lowered module, whether its
# collectives were read) -> (status, message, collectives).
_DONE: dict[tuple[str, str, bool], tuple[str, str, list]] = {}


def compile_reading_hlo(lowered) -> tuple[Any, list[str]]:
    """Compile ``lowered``; return the executable and the optimised program's HLO text (one per module; none if XLA
    wrote none), from XLA's own dump of it (``xla_dump_to``). Not ``Compiled.as_text()``: that rebuilds the module
    from its proto, which this jaxlib refuses for some XLA:TPU programs (v6e's SparseCore offload:
    "async-update instruction should have 1 operands but sees 4")."""
    with tempfile.TemporaryDirectory(prefix="dualop-hlo-") as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        texts = []
        for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
            with open(path) as fh:
                texts.append(fh.read())
    return compiled, texts


def _compile_lowered(lowered, generation: str, result: KernelResult, read_collectives: bool = False) -> None:
    """Compile once per distinct lowered module and generation; record the verdict in ``result``
    and, with ``read_collectives`` (a program over several chips), the collectives of the compiled
    program (``collectives.py``)."""
    from dualop.aot.collectives import collectives, summarize

    key = (generation, hashlib.sha256(lowered.as_text().encode()).hexdigest(), read_collectives)
    if key in _DONE:
        result.status, result.message, result.collectives = _DONE[key]
        result.cached = True
        return
    hlo = None
    try:
        if read_collectives:
            _, hlo = compile_reading_hlo(lowered)
        else:
            lowered.compile()
    except Exception as err:  # the compiler's refusal
        result.status, result.message = "refused", first_line(err)
    else:
        if hlo:
            result.collectives = summarize([c for module in hlo for c in collectives(module)])
        elif read_collectives:
            result.message = "collectives not read: XLA dumped no optimised HLO"
    _DONE[key] = (result.status, result.message, result.collectives)


def compile_function(fn: Callable, args: tuple, generation: str) -> KernelResult:
    """Trace, lower and compile ``fn(*args)`` (``args``: InputSpecs, None or Python scalars) for
    ``generation``. A ``NotImplementedError`` while tracing makes the result ``n/a`` (the kernel
    declines these inputs); any other failure is a refusal, reported by the message's first line."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    start = time.perf_counter()
    try:
        devices = _devices(generation)
    except Exception as err:  # libtpu cannot describe this chip
        return KernelResult(status="unavailable", message=f"topology {TOPOLOGIES[generation]}: {first_line(err)}")
    sharding = NamedSharding(Mesh(devices[:1], ("x",)), PartitionSpec())
    abstract = tuple(_abstract(a, sharding) for a in args)
    result = build(fn, abstract, generation)
    result.seconds = time.perf_counter() - start
    return result


def build(fn: Callable, abstract: tuple, generation: str, read_collectives: bool = False) -> KernelResult:
    """Trace ``fn`` on ``abstract`` inputs (``jax.ShapeDtypeStruct``s carrying their shardings,
    None, scalars) for ``generation``, lower and compile it; the verdict as ``compile_function``'s,
    and with ``read_collectives`` the compiled program's collectives (``KernelResult.collectives``)."""
    import jax

    from dualop.kernels.pallas.common import compile_target

    result = KernelResult(status="ok")
    with compile_target(generation):
        try:
            traced = jax.jit(fn).trace(*abstract)
        except NotImplementedError as err:
            result.status, result.message = "n/a", first_line(err)
        except Exception as err:
            result.status, result.message = "refused", first_line(err)
        else:
            result.kernels = [describe_pallas_call(e) for e in pallas_calls(traced.jaxpr.jaxpr)]
            try:
                lowered = traced.lower()  # Pallas -> Mosaic: block-shape and primitive errors
            except Exception as err:
                result.status, result.message = "refused", first_line(err)
            else:
                _compile_lowered(lowered, generation, result, read_collectives)
    return result


def compile_variant(variant: Variant, generation: str) -> KernelResult:
    """Build ``variant``'s ``forward_tpu`` (its Pallas kernels) for ``generation``."""
    op = variant.make_op()
    options = variant.case.options
    return compile_function(lambda *a: op.forward_tpu(*a, **options), variant.inputs, generation)
