"""The ``dualop`` command: ops, report, check (its matrix, JSON and exit code), bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dualop import check, cli


def _dualop(*args, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DUALOP_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "dualop.cli", *args], env=full_env,
                          capture_output=True, text=True, timeout=600)


def test_ops_lists_every_registered_op(capsys):
    assert cli.main(["ops", "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"rms_norm", "silu_and_mul", "gelu_and_mul", "relu2"} <= set(rows)
    assert rows["rms_norm"]["implements"] == "native,cpu,cuda,tpu"


def test_report_under_platform_tpu():
    # two ops: every op's TPU path is tests/sweeps/test_cells.py's; here the platform override reaches report
    proc = _dualop("report", "--json", "--ops", "rms_norm,silu_and_mul", DUALOP_PLATFORM="tpu")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["case"], r["frontend"]): r for r in json.loads(proc.stdout)}
    assert rows[("rms_norm", "jax")]["method"] == "forward_tpu"
    assert rows[("silu_and_mul", "jax")]["method"] == "forward_tpu"
    assert rows[("rms_norm", "jax")]["reason"] == "default: config holds 'all'"
    assert rows[("rms_norm", "jax")]["kernel"] is True
    torch_row = rows[("rms_norm", "torch")]  # a CPU torch tensor has no TPU bridge
    assert torch_row["method"] == "forward_native" and "no TPU bridge" in torch_row["reason"]
    assert torch_row["kernel"] is False
    assert all(r["platform"] == "tpu" for r in rows.values())


@pytest.mark.once_in_xla
def test_report_gives_the_reason_for_every_native_run():
    """On the CPU: jax runs the native body (no CPU kernel for jax arrays), torch the C++ kernel
    except for the variants it lacks; every native row names why, none says only the config."""
    proc = _dualop("report", "--json", "--frontends", "torch,jax")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["case"], r["frontend"]): r for r in json.loads(proc.stdout)}
    assert rows[("rms_norm", "torch")]["method"] == "forward_cpu" and rows[("rms_norm", "torch")]["kernel"]
    jax_row = rows[("rms_norm", "jax")]
    assert (jax_row["method"], jax_row["kernel"]) == ("forward_native", False)
    assert "no CPU kernel for jax arrays: XLA compiles the native body" in jax_row["reason"]
    assert "var_hidden_size" in rows[("rms_norm[var_hidden_size]", "torch")]["reason"]
    assert "xIELU" in rows[("xielu", "torch")]["reason"]
    for r in rows.values():
        assert r["kernel"] == (r["method"] != "forward_native")
        if not r["kernel"]:
            assert "forward_cpu" in r["reason"] and "so forward_native" in r["reason"], r


def test_report_under_custom_ops_none_plus_rms_norm():
    proc = _dualop("report", "--ops", "rms_norm,silu_and_mul", DUALOP_CUSTOM_OPS="none,+rms_norm")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "custom_ops=['none', '+rms_norm']" in lines[0]
    rms = [ln for ln in lines if ln.startswith("rms_norm ") and " torch " in ln]
    silu = [ln for ln in lines if ln.startswith("silu_and_mul ")]
    assert rms and all("forward_cpu" in ln and "config '+rms_norm'" in ln for ln in rms)
    assert silu and all("forward_native" in ln and "config holds 'none'" in ln for ln in silu)


def test_report_takes_only_registered_ops():
    proc = _dualop("report", "--ops", "rms_norm,rms_nrom")
    assert proc.returncode == 2 and "dualop report: --ops: 'rms_nrom' (did you mean 'rms_norm'?)" in proc.stderr
    proc = _dualop("report", "--json", "--ops", "rms_norm", "--frontends", "torch")
    assert {r["op"] for r in json.loads(proc.stdout)} == {"rms_norm"}


def test_report_rejects_a_bad_env_config():
    proc = _dualop("report", DUALOP_CUSTOM_OPS="all,none")
    assert proc.returncode != 0 and "DUALOP_CUSTOM_OPS='all,none'" in proc.stderr


def test_check_json_and_matrix(capsys):
    code = cli.main(["check", "--ops", "silu_and_mul", "--frontends", "torch,jax",
                     "--platforms", "cpu,cuda", "--dtypes", "float32", "--json", "--no-progress"])
    assert code == 0
    results = json.loads(capsys.readouterr().out)
    cells = {(r["frontend"], r["platform"]): r for r in results}
    assert set(cells) == {("torch", "cpu"), ("torch", "cuda"), ("jax", "cpu"), ("jax", "cuda")}
    assert cells[("torch", "cuda")]["status"] == "pass" and cells[("torch", "cuda")]["path"].startswith("triton")
    assert cells[("jax", "cuda")]["status"] == "native" and "jax-triton" in cells[("jax", "cuda")]["detail"]
    assert cells[("jax", "cpu")]["status"] == "native" and "no CPU kernel for jax arrays" in cells[("jax", "cpu")]["detail"]
    assert cells[("torch", "cpu")]["status"] == "pass" and cells[("torch", "cpu")]["method"] == "forward_cpu"
    for r in results:
        assert {"max_abs", "max_rel", "atol", "rtol", "dtype", "method"} <= set(r)

    assert cli.main(["check", "--ops", "silu_and_mul", "--frontends", "torch", "--platforms", "cpu",
                     "--dtypes", "float32,bfloat16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "matrix (worst over dtypes" in out and "kernel cells: 2 passed, 0 failed; 0 native" in out


def test_check_matrix_says_native_with_its_reason(capsys):
    assert cli.main(["check", "--ops", "silu_and_mul,xielu", "--frontends", "torch,jax", "--platforms", "cpu",
                     "--dtypes", "float32", "--no-progress"]) == 0
    out = capsys.readouterr().out
    matrix = out[out.index("matrix"):]
    silu = next(ln for ln in matrix.splitlines() if ln.startswith("silu_and_mul "))
    assert silu.split()[1:] == ["ok", "native", "(1)"]  # torch/cpu: the C++ kernel; jax/cpu: native
    assert "(1) default: config holds 'all'; forward_cpu: no CPU kernel for jax arrays" in out
    assert "torch has no fused xIELU" in out
    assert "kernel cells: 1 passed, 0 failed; 3 native (no kernel ran; reasons above); 0 errors; 0 unavailable" in out


def test_check_exits_1_when_a_cell_fails(monkeypatch, capsys):
    from dualop.ops import SiluAndMul

    monkeypatch.setattr(SiluAndMul, "forward_cpu", lambda self, x: self.forward_native(x) + 1)
    code = cli.main(["check", "--ops", "silu_and_mul", "--frontends", "torch", "--platforms", "cpu",
                     "--dtypes", "float32", "--no-progress"])
    assert code == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_rejects_unknown_names(capsys):
    assert cli.main(["check", "--ops", "rms_nrom", "--no-progress"]) == 2
    assert "--ops: 'rms_nrom' (did you mean 'rms_norm'?) is not a registered op" in capsys.readouterr().err
    assert cli.main(["check", "--dtypes", "float64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--dtypes: 'float64'" in err and "is not a dtype; accepted: float32, bfloat16, float16" in err


def test_check_formats_errors_and_unavailable_frontends():
    results = [
        check.CellResult("rms_norm", "rms_norm", "torch", "cpu", "float32", "pass", "forward_cpu", "torch cpu", 0, 0, 1e-5, 1e-5, 4),
        check.CellResult("rms_norm", "rms_norm", "jax", "tpu", "float32", "error", detail="RuntimeError: boom"),
        check.CellResult("rms_norm", "rms_norm", "torchax", "tpu", "float32", "unavailable", detail="No module named 'torchax'"),
    ]
    text = check.format_table(results)
    assert "ERROR" in text and "boom" in text and "frontend torchax unavailable here" in text
    assert text.strip().endswith("kernel cells: 1 passed, 0 failed; 0 native (no kernel ran; reasons above); "
                                 "1 errors; 1 unavailable")
    assert check.failed(results)


def test_check_reports_a_broken_frontend_as_an_error(monkeypatch):
    """An installed frontend that fails to import is an error cell, not 'unavailable'."""
    from dualop import testing

    monkeypatch.setattr(testing, "frontend_available", lambda fe: "ImportError: broken .so" if fe == "jax" else None)
    results = check.run_check(ops=["relu2"], frontends=["jax"], platforms=["cpu"], dtypes=["float32"], progress=False)
    assert [(r.status, r.detail) for r in results] == [("error", "jax is installed but does not import: ImportError: broken .so")]
    assert check.failed(results)


def test_bench_dispatch_records(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--dispatch-only", "--rounds", "2", "--json", str(out), "--no-progress",
                     "--system-malloc"]) == 0
    records = json.loads(out.read_text())
    assert {r["frontend"] for r in records} == {"torch", "jax"}
    for r in records:
        assert r["op"] == "dispatch"
        assert r["overhead_ns"] == pytest.approx(r["call_ns"] - r["direct_ns"])
        assert r["reference_overhead_ns"] == pytest.approx(r["reference_call_ns"] - r["direct_ns"])
        assert r["call_ns"] > 0 and r["direct_ns"] > 0
    assert "overhead ns" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["check", "compile", "bench"])
def test_list_prints_the_sorted_case_set(command, capsys):
    """``--list``: what the command would run, one sorted line each, the same on every call, and
    no line names a module path or an object address (moving code must not change a listing)."""
    from dualop.custom_op import CustomOp
    from dualop.testing import cases_for

    assert cli.main([command, "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == sorted(lines) and len(set(lines)) == len(lines)
    assert not any("dualop." in line or " at 0x" in line for line in lines)
    assert cli.main([command, "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == lines
    if command != "bench":  # check and compile cover every op with a check case
        listed = {line.split(" | ")[1 if command == "compile" else 0] for line in lines}
        assert {case.label for case in cases_for()} <= listed
        assert {case.op for case in cases_for()} <= set(CustomOp.op_registry)
    assert cli.main([command, "--list", "--ops", "rms_norm"]) == 0
    only = capsys.readouterr().out.splitlines()
    assert only and all("rms_norm" in line for line in only)


def test_compile_serving_dtypes_narrows_only_the_serving_builds(capsys):
    assert cli.main(["compile", "--list"]) == 0
    every = capsys.readouterr().out.splitlines()
    assert cli.main(["compile", "--list", "--serving-dtypes", "bfloat16"]) == 0
    narrowed = capsys.readouterr().out.splitlines()
    kernels = [line for line in every if line.startswith("kernel |")]
    assert any("| float32 | serving" in line for line in kernels)
    assert [line for line in narrowed if line.startswith("kernel |")] == [
        line for line in kernels if "| float32 | serving" not in line]
