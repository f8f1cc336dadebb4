"""``import dualop`` imports neither torch nor jax; with one blocked, the other's paths all work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import NATIVE_CASES, NATIVE_CELLS


def _run(code: str, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DUALOP_")}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_dualop_imports_neither_torch_nor_jax():
    out = _run("""
        import sys, dualop
        print(sorted(m for m in ("torch", "jax", "jaxlib", "triton", "torch_xla", "numpy.testing") if m in sys.modules))
        dualop.CustomOp.op_registry["rms_norm"]
        dualop.OpsConfig(["none,+rms_norm"])
    """)
    assert out.strip() == "[]"


CELL_SCRIPT = """
    import sys
    sys.modules[{blocked!r}] = None
    import dualop
    from dualop import check, testing
    cases = list(testing.cases_for(["rms_norm", "silu_and_mul"]))
    native = {native!r}
    for frontend, platform in {cells!r}:
        for case in cases:
            expected = "native" if {{(frontend, platform), (case.label, frontend, platform)}} & native else "pass"
            for dtype in ("float32", "bfloat16"):
                r = check._run_cell(case, frontend, platform, dtype, seed=0)
                assert r.status == expected, (case.label, frontend, platform, r)
    assert {blocked!r} not in {{m for m, v in sys.modules.items() if v is not None}}
    print("ok")
"""


NATIVE = {*NATIVE_CELLS, *NATIVE_CASES}  # where no kernel exists: the cell must say native


def test_jax_paths_work_without_torch():
    out = _run(CELL_SCRIPT.format(blocked="torch", cells=[("jax", "cpu"), ("jax", "tpu")], native=NATIVE))
    assert out.strip().endswith("ok")


def test_torch_paths_work_without_jax():
    out = _run(
        CELL_SCRIPT.format(blocked="jax", cells=[("torch", "cpu"), ("torch", "cuda"), ("torch", "rocm")],
                           native=NATIVE),
        TRITON_INTERPRET="1",
    )
    assert out.strip().endswith("ok")


def test_compiled_code_is_released_near_the_map_limit():
    """The suite's guard against the kernel's memory-mapping limit: under the threshold nothing
    happens; over it, jax's compiled executables are dropped and their mappings go with them."""
    import jax
    import jax.numpy as jnp

    from dualop import testing

    for i in range(60):
        jax.jit(lambda x, i=i: x * i + 1.0)(jnp.ones(i + 1)).block_until_ready()
    before = testing.memory_mappings()
    assert not testing.release_compiled_code_near_map_limit(fraction=1.0)
    assert testing.release_compiled_code_near_map_limit(fraction=0.0)
    assert testing.memory_mappings() < before - 60
