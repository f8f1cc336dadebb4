"""The quick sweep of ``dualop check`` (the default of ``scripts/check.sh``): each case's first
shape only, and a tiny model's greedy tokens on the kernel paths against transformers'."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dualop import check, testing

ROOT = Path(__file__).resolve().parents[2]


def test_quick_sweep_runs_each_cases_first_shape_only():
    case = next(c for c in testing.cases_for(["rms_norm"]) if len(c.shapes) > 1)
    quick = check.run_check(ops=["rms_norm"], frontends=["torch"], platforms=["cpu"], dtypes=["float32"],
                            progress=False, max_shapes=1)
    full = check.run_check(ops=["rms_norm"], frontends=["torch"], platforms=["cpu"], dtypes=["float32"],
                           progress=False)
    by_case = {r.case: r for r in quick}
    assert by_case[case.label].status == "pass" and by_case[case.label].shapes == 1
    assert {r.case: r.shapes for r in full}[case.label] == len(case.shapes)


def test_model_check_matches_transformers_and_names_the_kernels():
    pytest.importorskip("transformers", reason="the model check's reference is transformers' generate")
    (result,) = check.run_model_check(frontends=["torch"], platforms=["cpu"], progress=False)
    assert result.status == "pass", result
    assert result.tokens == result.want and all(len(t) == 4 for t in result.tokens)
    assert any(k.startswith("rms_norm (forward_cpu)") for k in result.kernel_ops), result.kernel_ops
    table = check.format_model_table([result])
    assert "torch/cpu: PASS" in table and "kernels: " in table


def test_model_check_fails_a_path_whose_tokens_differ(monkeypatch):
    """The harness itself: a model whose greedy tokens are off by one is a failing path."""
    pytest.importorskip("transformers", reason="the model check's reference is transformers' generate")
    from dualop.models.engine import CausalLM

    real = CausalLM.generate
    monkeypatch.setattr(CausalLM, "generate", lambda self, *a, **k: [[t + 1 for t in s] for s in real(self, *a, **k)])
    (result,) = check.run_model_check(frontends=["torch"], platforms=["cpu"], progress=False)
    assert result.status == "fail" and check.model_failed([result])
    assert "tokens" in check.format_model_table([result])


@pytest.mark.latest_only
def test_check_sh_runs_the_quick_sweep_and_says_how_to_run_the_full_one():
    env = dict(os.environ, DUALOP_ENVS="latest")
    proc = subprocess.run(["bash", "scripts/check.sh", "--ops", "silu_and_mul", "--frontends", "torch",
                           "--platforms", "cpu", "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dualop check --quick in the 'latest' environment" in proc.stdout
    assert "model: " in proc.stdout and "torch/cpu: PASS" in proc.stdout
    assert "bash scripts/check.sh --full" in proc.stdout
