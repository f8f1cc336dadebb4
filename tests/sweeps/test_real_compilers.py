"""The real TPU and GPU compilers, run on this machine with no accelerator, on what the
per-generation kernel layouts depend on: the VMEM table against the compiler's own limits, the
wide-row layouts (quant_fp8 at hidden 53248, which Mosaic refused on v5e before; rms_norm with a
residual on v4's 16 MiB), the membership-matmul group norm, and the Triton fp8 kernel per GPU.

TPU: compile-only devices from libtpu (``jax.experimental.topologies``), traced under
``compile_target`` so the kernels build for that chip; GPU: ``triton.compile`` for a ``GPUTarget``
in a subprocess with Triton's interpreter off. ``dualop compile`` covers the whole kernel matrix;
these stay small (about a second per TPU compile).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import jax  # noqa: E402  (both test environments have jax: a broken install fails here)

jnp = jax.numpy

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:1x1", "v5p": "v5p:2x2x1", "v6e": "v6e:1x1", "tpu7x": "tpu7x:2x2x1"}
_MiB = 1024 * 1024


def _libtpu_missing() -> str | None:
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed in this environment (the latest environment has it)"
    return None


needs_libtpu = pytest.mark.skipif(_libtpu_missing() is not None, reason=str(_libtpu_missing()))


def _devices(generation: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=TOPOLOGIES[generation], platform="tpu").devices


def _compile(generation: str, fn, *shapes) -> None:
    """``jit(fn)`` traced for ``generation`` on ``shapes`` ((shape, dtype) pairs) and compiled by
    XLA:TPU and Mosaic; raises what they refuse."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from dualop.kernels.pallas.common import compile_target

    sharding = NamedSharding(Mesh(_devices(generation)[:1], ("x",)), PartitionSpec())
    specs = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    with compile_target(generation):
        jax.jit(fn).trace(*specs).lower().compile()


# ------------------------------------------------------------------------------ the VMEM table


def _copy_kernel_footprint(generation: str, mib: int, limit: int | None) -> None:
    """A copy kernel whose grid step holds ``mib`` MiB (input and output blocks, double-buffered).
    Eight steps, so that megacore chips splitting the grid still pipeline (two steps split over two
    cores need one buffer each, and then fit)."""
    from jax.experimental import pallas as pl

    from dualop.kernels.pallas.common import compiler_params

    rows = mib * _MiB // (4 * 4 * 1024)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def fn(x):
        params = compiler_params(1)
        if limit is not None:
            params = type(params)(dimension_semantics=("parallel",), vmem_limit_bytes=limit)
        spec = pl.BlockSpec((rows, 1024), lambda i: (i, 0))
        return pl.pallas_call(kernel, grid=(8,), in_specs=[spec], out_specs=spec,
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=params)(x)

    _compile(generation, fn, ((8 * rows, 1024), jnp.float32))


@needs_libtpu
@pytest.mark.parametrize("generation", list(TOPOLOGIES))
def test_vmem_table_matches_the_compiler(generation):
    """A grid step 1 MiB under the table's default scoped limit compiles, 1 MiB over is refused
    unless the limit is raised (up to the capacity, which is 16 MiB on v4: no room above)."""
    from dualop.kernels.pallas.common import TPU_VMEM

    spec = TPU_VMEM[generation]
    default = spec.scoped_default // _MiB
    _copy_kernel_footprint(generation, default - 1, None)
    with pytest.raises(Exception, match="(?i)vmem|memory"):
        _copy_kernel_footprint(generation, default + 1, None)
    if spec.capacity > spec.scoped_default:
        _copy_kernel_footprint(generation, default + 1, spec.capacity * 3 // 4)


def test_generation_on_a_cpu_host_is_conservative():
    """No compile target and no TPU attached: no generation (never the CPU's device kind), and
    the smallest VMEM of the table, so interpret-mode block choices fit every chip."""
    from dualop.kernels.pallas.common import TPU_VMEM, compile_target, current_generation, vmem_spec

    if jax.default_backend() == "tpu":
        pytest.skip("a TPU is attached: its own generation applies")
    assert current_generation() is None
    assert vmem_spec().capacity == min(s.capacity for s in TPU_VMEM.values())
    assert vmem_spec().scoped_default == min(s.scoped_default for s in TPU_VMEM.values())
    with compile_target("v6e"):
        assert current_generation() == "v6e" and vmem_spec() == TPU_VMEM["v6e"]


def test_kernel_traces_are_keyed_on_the_generation():
    """Same shapes, different chips, different programs: per-token quantisation of 20000-wide
    bfloat16 rows is one pass where the default scoped VMEM is 32 MiB (v6e) and two passes (running
    amax, then quantise) where it is 16 MiB (v5e); a trace cached for one must not serve the other."""
    from dualop.kernels.pallas.common import compile_target
    from dualop.kernels.pallas.quant_fp8 import quant_fp8

    x = jax.ShapeDtypeStruct((64, 20000), jnp.bfloat16)

    def pallas_calls(jaxpr) -> int:
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        n = 0
        for eqn in inner.eqns:
            n += eqn.primitive.name == "pallas_call"
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(getattr(v, "jaxpr", v), "eqns"):
                        n += pallas_calls(v)
        return n

    def kernels(generation):
        with compile_target(generation):
            return pallas_calls(jax.make_jaxpr(lambda a: quant_fp8(a, granularity="token"))(x))

    assert kernels("v6e") == 1
    assert kernels("v5e") == 2
    assert kernels("v6e") == 1


# ------------------------------------------------------------------------------ the kernels


def _quant(granularity, static=False):
    from dualop.kernels.pallas.quant_fp8 import quant_fp8

    if static:
        return lambda x: quant_fp8(x, jnp.full((1,), 0.01, jnp.float32), granularity="tensor")
    return lambda x: quant_fp8(x, granularity=granularity, group_size=128 if granularity == "group" else 0)


@needs_libtpu
@pytest.mark.parametrize("generation", ["v4", "v5e"])
@pytest.mark.parametrize("granularity", ["tensor", "token", "group"])
def test_quant_fp8_wide_rows_compile(generation, granularity):
    """Hidden 53248 (whole-row blocks were refused on v5e: CompileTimeScopedVmemOom)."""
    _compile(generation, _quant(granularity), ((16, 53248), jnp.bfloat16))


@needs_libtpu
@pytest.mark.parametrize("generation", ["v4", "v6e"])
def test_quant_fp8_serving_batch_compiles(generation):
    _compile(generation, _quant("token"), ((2048, 8192), jnp.float32))
    _compile(generation, _quant("tensor", static=True), ((2048, 8192), jnp.bfloat16))


@needs_libtpu
@pytest.mark.parametrize("generation", ["v4", "tpu7x"])
def test_rms_norm_with_residual_compiles_at_the_widest_rows(generation):
    """float32 rows of 53248 with a residual: four row arrays of 1.7 MB a block; on v4 (16 MiB in
    all) they fit only single-buffered, which the kernel picks from the VMEM table."""
    from dualop.kernels.pallas.rms_norm import rms_norm

    fn = lambda x, r: rms_norm(x, jnp.ones(x.shape[-1], x.dtype), r)  # noqa: E731
    _compile(generation, fn, ((16, 53248), jnp.float32), ((16, 53248), jnp.float32))


@needs_libtpu
@pytest.mark.parametrize("hidden, group", [(200, 40), (53248, 416), (53248, 128), (8192, 1024)])
def test_rms_norm_gated_groups_compile(hidden, group):
    """The membership matmul (groups off the lane grid: 40 at a test shape, 416 at a serving
    shape) and blocks of lane-aligned groups, on v5e."""
    from dualop.kernels.pallas.rms_norm_gated import rms_norm_gated

    fn = lambda x, z: rms_norm_gated(x, jnp.ones(hidden, x.dtype), z, group_size=group)  # noqa: E731
    _compile("v5e", fn, ((13, hidden), jnp.bfloat16), ((13, hidden), jnp.bfloat16))


# ------------------------------------------------------------------------------ Triton fp8

_TRITON_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from dualop.kernels.cuda import GPU_TARGETS
    from dualop.kernels.cuda import quant_fp8 as q

    def signature(q_type):
        return {
            "x_ptr": "*bf16", "q_ptr": q_type, "s_ptr": "*fp32", "ub_ptr": "*fp32", "amax_ptr": "*fp32",
            "x_row_stride": "i64", "q_row_stride": "i64", "width": "i32", "n_groups": "i32",
            "MODE": "constexpr", "HAS_UB": "constexpr", "BLOCK": "constexpr", "N_CHUNKS": "constexpr",
            "EXACT_FP8": "constexpr", "FP8_MAX": "constexpr", "MIN_SCALE": "constexpr", "FNUZ": "constexpr",
        }

    def constexprs(fp8_max, fnuz):
        return {"MODE": 0, "HAS_UB": False, "BLOCK": 8192, "N_CHUNKS": 1, "EXACT_FP8": False,
                "FP8_MAX": fp8_max, "MIN_SCALE": 1.0 / (fp8_max * 512.0), "FNUZ": fnuz}

    # e4m3fn (fp8e4nv, max 448) for CUDA; fnuz (fp8e4b8, max 224) for MI300, as quant_fp8 asks
    for name, q_type, fp8_max, fnuz in (("sm90", "*fp8e4nv", 448.0, False), ("gfx942", "*fp8e4b8", 224.0, True),
                                        ("sm80", "*fp8e4nv", 448.0, False)):
        t = GPU_TARGETS[name]
        try:
            k = triton.compile(triton.compiler.ASTSource(q._quant_kernel, signature(q_type), constexprs(fp8_max, fnuz)),
                               target=GPUTarget(t.backend, t.arch, t.warp_size), options={"num_warps": 16})
            asm = k.asm.get("amdgcn", "")
            asm = asm.decode(errors="replace") if isinstance(asm, bytes) else asm
            fp8_cvt = "v_cvt_pk_fp8_f32" in asm
            print(name, "ok", ",".join(sorted(k.asm)), "fp8-cvt" if fp8_cvt else "")
        except Exception as err:
            print(name, "refused", str(err).strip().splitlines()[-1])
    """
)


def test_triton_compiles_the_fp8_kernel_where_e4m3_exists():
    """The dynamic per-token fp8 kernel: accepted for sm_90 (e4m3fn; PTX, cubin) and gfx942
    (e4m3fnuz, fp8e4b8: AMDGCN with MI300's hardware fp8 conversion, hsaco), refused for sm_80 (no
    fp8e4nv), which is why quant_fp8 declines there."""
    import triton  # noqa: F401  (both test environments have it)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ", 1)[0] in ("sm90", "gfx942", "sm80"))
    assert lines["sm90"].startswith("ok") and "cubin" in lines["sm90"], lines
    assert lines["gfx942"].startswith("ok") and "hsaco" in lines["gfx942"] and "fp8-cvt" in lines["gfx942"], lines
    assert lines["sm80"].startswith("refused") and "fp8e4nv not supported" in lines["sm80"], lines
