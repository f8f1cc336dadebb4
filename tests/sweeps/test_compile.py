"""``dualop compile``: the variants it builds, the real compilers' verdicts (TPU in this process,
Triton in a compiled-mode child), the matrix and the exit status.

The refusals below come from XLA:TPU/Mosaic (libtpu) and Triton/ptxas themselves, not from mocks.
The TPU builds need libtpu (the latest environment has it; elsewhere they skip saying so); the
Triton builds run under every triton pyproject allows (tests/infra/test_versions.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dualop import aot, cli, testing
from dualop.aot import variants as aot_variants
from dualop.aot.result import KernelResult, first_line
from dualop.aot.variants import InputSpec


def _require_tpu_compiler():
    from dualop.aot import tpu

    why = tpu.tpu_available()
    if why is not None:
        pytest.skip(f"TPU compiles need libtpu, installed in the latest environment only: {why}")


def _require_triton_aot():
    try:
        import triton  # noqa: F401
    except ImportError as err:
        pytest.skip(f"triton is not installed here: {err}")


# --- variants ------------------------------------------------------------------------------


def test_variants_cover_every_check_shape_and_dtype_once():
    dtypes = ["float32", "bfloat16"]
    variants = aot_variants.variants_for(None, dtypes)
    keys = [v.key for v in variants]
    assert len(keys) == len(set(keys))
    want = {(c.label, d, tuple(s)) for c in testing.cases_for(None) for d in dtypes for s in c.shapes if s[0] > 0}
    assert want <= set(keys)
    assert not any(v.shape[0] == 0 for v in variants)


def test_every_op_with_cases_has_serving_shapes_and_they_are_built():
    ops = {c.op for c in testing.cases_for(None)}
    declared = aot.servings()
    assert ops <= set(declared), f"ops without serving shapes: {ops - set(declared)}"
    variants = aot_variants.variants_for(None, ["bfloat16"])
    serving = {(v.case.op, v.shape) for v in variants if v.serving}
    for op in ops:
        for shape in declared[op].shapes:
            assert (op, tuple(shape)) in serving


def test_serving_inputs_are_scaled_from_the_case_inputs():
    by_key = {v.key: v for v in aot_variants.variants_for(["rms_norm", "xielu", "rms_norm_gated"], ["bfloat16"])}
    v = by_key[("rms_norm[weight,residual]", "bfloat16", (8192, 8192))]
    assert v.serving and v.inputs == (InputSpec((8192, 8192), "bfloat16"), InputSpec((8192,), "bfloat16"),
                                      InputSpec((8192, 8192), "bfloat16"))
    v = by_key[("xielu", "bfloat16", (16, 53248))]  # the alphas are pinned float32 (1,) inputs
    assert v.inputs == (InputSpec((16, 53248), "bfloat16"), InputSpec((1,), "float32"), InputSpec((1,), "float32"))
    grouped = by_key[("rms_norm_gated[z,group]", "bfloat16", (8192, 8192))].make_op()
    assert grouped.group_size == 1024


def test_unknown_names_are_clear_errors(capsys):
    assert cli.main(["compile", "--targets", "v5e,sm70"]) == 2
    assert "unknown target(s) ['sm70']" in capsys.readouterr().err
    assert cli.main(["compile", "--ops", "rms_nrom", "--targets", "v5e"]) == 2
    assert "--ops: 'rms_nrom' (did you mean 'rms_norm'?) is not a registered op" in capsys.readouterr().err
    assert cli.main(["compile", "--dtypes", "float64", "--targets", "v5e"]) == 2
    assert "--dtypes: 'float64'" in capsys.readouterr().err


def test_tpu_target_names_are_the_pallas_generations():
    from dualop.kernels.pallas.common import TPU_GENERATIONS

    assert set(aot.TPU_TARGETS) == set(TPU_GENERATIONS)


# --- matrix and exit status ----------------------------------------------------------------


def _row(case, target, status, message="", shape=(8, 128)):
    return {"op": case, "case": case, "dtype": "float32", "shape": list(shape), "serving": False,
            "target": target, **KernelResult(status=status, message=message).as_dict()}


def test_exit_status_and_matrix_cells():
    rows = [_row("a", "v5e", "ok"), _row("a", "v5e", "refused", "E1001: CompileTimeScopedVmemOom", (16, 53248)),
            _row("a", "sm80", "n/a", "NotImplementedError: no e4m3 below sm_89")]
    assert aot.exit_status(rows) == 1
    text = aot.format_matrix(rows)
    assert "refused 1/2, ok 1" in text and "n/a 1" in text
    assert "refused: a on v5e (float32 16x53248): E1001: CompileTimeScopedVmemOom" in text
    assert "n/a: a on sm80 (float32 8x128): NotImplementedError: no e4m3 below sm_89" in text
    assert aot.exit_status(rows[:1] + rows[2:]) == 0  # n/a is not a failure
    assert aot.exit_status([_row("a", "v5e", "unavailable", "no libtpu")]) == 2


def test_first_line_of_compiler_messages():
    class CompilationError(Exception):
        pass

    err = CompilationError('at 1:0:\ndef k(\n^\nValueError("type fp8e4nv not supported in this architecture")')
    assert first_line(err) == 'CompilationError: ValueError("type fp8e4nv not supported in this architecture")'
    err = RuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in vmem\nmore")
    assert first_line(err) == "RuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory in vmem"


# --- the real TPU compiler -----------------------------------------------------------------


def _copy_kernel(block):
    import jax
    from jax.experimental import pallas as pl

    def call(x):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2.0

        return pl.pallas_call(
            kernel, grid=(x.shape[0] // block[0],),
            in_specs=[pl.BlockSpec(block, lambda i: (i, 0))], out_specs=pl.BlockSpec(block, lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="test_copy",
        )(x)

    return call


@pytest.mark.latest_only
def test_oversized_pallas_block_is_refused_on_v5e_and_a_fitting_one_compiles():
    _require_tpu_compiler()
    from dualop.aot import tpu

    with tpu.quiet_native_stderr():
        big = tpu.compile_function(_copy_kernel((4096, 4096)), (InputSpec((8192, 4096), "float32"),), "v5e")
        small = tpu.compile_function(_copy_kernel((64, 4096)), (InputSpec((8192, 4096), "float32"),), "v5e")
    assert big.status == "refused", big
    assert "vmem" in big.message.lower()
    (kernel,) = big.kernels
    assert kernel["grid"] == (2,) and kernel["blocks"] == ["4096x4096:float32"] * 2
    assert kernel["vmem_bytes"] == 2 * 2 * 4096 * 4096 * 4  # in and out blocks, double-buffered
    assert small.status == "ok", small
    assert small.kernels[0]["vmem_bytes"] == 2 * 2 * 64 * 4096 * 4  # 4 MiB: under the default scoped VMEM


@pytest.mark.latest_only
def test_tpu_kernel_that_declines_is_not_applicable(monkeypatch):
    _require_tpu_compiler()
    from dualop.aot import tpu
    from dualop.ops import RMSNorm

    def decline(self, *args):
        raise NotImplementedError("declined for the test")

    monkeypatch.setattr(RMSNorm, "forward_tpu", decline)
    (variant, *_) = aot_variants.variants_for(["rms_norm"], ["float32"])
    with tpu.quiet_native_stderr():
        result = tpu.compile_variant(variant, "v6e")
    assert result.status == "n/a" and result.message == "NotImplementedError: declined for the test"


# --- the real Triton compiler (compiled mode needs its own process) -------------------------

_FP8_PROBE = '''
import json, sys
import torch
import triton
import triton.language as tl
from dualop.aot import gpu
from dualop.kernels.cuda import GPU_TARGETS


@triton.jit
def to_fp8(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(q_ptr + offs, x.to(tl.float8e4nv), mask=offs < n)


x = torch.empty(4096, dtype=torch.float32, device="meta")
q = torch.empty(4096, dtype=torch.float8_e4m3fn, device="meta")
with gpu.capture_launches() as launches:
    to_fp8[(4,)](x, q, 4096, BLOCK=1024)
out = {}
for name in sys.argv[1:]:
    details, error = gpu.compile_launch(launches[0], GPU_TARGETS[name])
    out[name] = {"details": details, "error": error}
print(json.dumps(out, default=str))
'''


def test_triton_fp8_kernel_is_refused_for_sm80_and_compiles_for_sm90(tmp_path):
    _require_triton_aot()
    from dualop.aot.gpu import child_environment

    script = tmp_path / "fp8_probe.py"
    script.write_text(textwrap.dedent(_FP8_PROBE))
    env = child_environment(str(tmp_path / "triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(script), "sm80", "sm90"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "fp8e4nv not supported in this architecture" in out["sm80"]["error"]
    assert out["sm90"]["error"] is None
    details = out["sm90"]["details"]
    assert details["kernel"] == "to_fp8" and details["num_warps"] == 4 and details["registers"] > 0


def test_triton_kernel_that_declines_is_not_applicable(monkeypatch):
    _require_triton_aot()
    from dualop.aot import gpu
    from dualop.ops import RMSNorm

    def decline(self, *args):
        raise NotImplementedError("declined for the test")

    monkeypatch.setattr(RMSNorm, "forward_cuda", decline)
    (variant, *_) = aot_variants.variants_for(["rms_norm"], ["float32"])
    result = gpu.compile_variant(variant, "sm80")  # nothing reaches the compiler
    assert result.status == "n/a" and result.message == "NotImplementedError: declined for the test"


# --- the command end to end ----------------------------------------------------------------


@pytest.mark.latest_only
def test_compile_command_builds_one_op_for_a_tpu_and_two_gpus():
    _require_tpu_compiler()
    _require_triton_aot()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALOP_")}
    proc = subprocess.run(
        [sys.executable, "-m", "dualop.cli", "compile", "--ops", "relu2", "--targets", "v6e,sm90,gfx942",
         "--dtypes", "bfloat16", "--serving-targets", "v6e,sm90", "--json", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    variants = aot_variants.variants_for(["relu2"], ["bfloat16"])
    built = {(r["target"], r["serving"]) for r in rows}
    assert ("gfx942", True) not in built and {("v6e", True), ("sm90", True), ("gfx942", False)} <= built
    assert len(rows) == sum(3 if not v.serving else 2 for v in variants)
    assert {r["status"] for r in rows} == {"ok"}
    serving = [r for r in rows if r["serving"] and r["target"] == "v6e"]
    assert serving and all(k["grid"] and k["blocks"] and k["vmem_bytes"] > 0 for r in serving for k in r["kernels"])
    gpu_rows = [r for r in rows if r["target"] in ("sm90", "gfx942")]
    assert all(k["num_warps"] >= 1 and k["num_stages"] >= 1 and "shared_bytes" in k for r in gpu_rows
               for k in r["kernels"])
    assert all(r["kernels"] for r in rows)
