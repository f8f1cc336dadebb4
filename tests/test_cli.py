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
    proc = _dualop("report", "--json", DUALOP_PLATFORM="tpu")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["op"], r["frontend"]): r for r in json.loads(proc.stdout)}
    assert rows[("rms_norm", "jax")]["method"] == "forward_tpu"
    assert rows[("silu_and_mul", "jax")]["method"] == "forward_tpu"
    assert rows[("rms_norm", "jax")]["reason"] == "default: config holds 'all'"
    torch_row = rows[("rms_norm", "torch")]  # a CPU torch tensor has no TPU bridge
    assert torch_row["method"] == "forward_native" and "no TPU bridge" in torch_row["reason"]
    assert all(r["platform"] == "tpu" for r in rows.values())


def test_report_under_custom_ops_none_plus_rms_norm():
    proc = _dualop("report", DUALOP_CUSTOM_OPS="none,+rms_norm")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "custom_ops=['none', '+rms_norm']" in lines[0]
    rms = [ln for ln in lines if ln.startswith("rms_norm ")]
    silu = [ln for ln in lines if ln.startswith("silu_and_mul ")]
    assert rms and all("forward_cpu" in ln and "config '+rms_norm'" in ln for ln in rms)
    assert silu and all("forward_native" in ln and "config holds 'none'" in ln for ln in silu)


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
    assert cells[("jax", "cuda")]["status"] == "fallback"
    for r in results:
        assert {"max_abs", "max_rel", "atol", "rtol", "dtype", "method"} <= set(r)

    assert cli.main(["check", "--ops", "silu_and_mul", "--frontends", "torch", "--platforms", "cpu",
                     "--dtypes", "float32,bfloat16", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "matrix (worst over dtypes):" in out and "2 passed, 0 failed" in out


def test_check_exits_1_when_a_cell_fails(monkeypatch, capsys):
    from dualop.ops import SiluAndMul

    monkeypatch.setattr(SiluAndMul, "forward_cpu", lambda self, x: self.forward_native(x) + 1)
    code = cli.main(["check", "--ops", "silu_and_mul", "--frontends", "torch", "--platforms", "cpu",
                     "--dtypes", "float32", "--no-progress"])
    assert code == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_rejects_unknown_names(capsys):
    assert cli.main(["check", "--ops", "rms_nrom", "--no-progress"]) == 2
    assert "unknown op(s) ['rms_nrom']" in capsys.readouterr().err
    assert cli.main(["check", "--dtypes", "float64", "--no-progress"]) == 2


def test_check_formats_errors_and_unavailable_frontends():
    results = [
        check.CellResult("rms_norm", "rms_norm", "torch", "cpu", "float32", "pass", "forward_cpu", "torch cpu", 0, 0, 1e-5, 1e-5, 4),
        check.CellResult("rms_norm", "rms_norm", "jax", "tpu", "float32", "error", detail="RuntimeError: boom"),
        check.CellResult("rms_norm", "rms_norm", "torchax", "tpu", "float32", "unavailable", detail="No module named 'torchax'"),
    ]
    text = check.format_table(results)
    assert "ERROR" in text and "boom" in text and "frontend torchax unavailable here" in text
    assert text.strip().endswith("1 passed, 1 failed, 0 fell back to native")
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
