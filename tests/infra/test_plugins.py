"""Entry-point plugins, with a real package installed (pip --target) into a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugin_pkg"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(PLUGIN_SRC)],
        check=True, cwd=build, capture_output=True, text=True,
    )
    assert any(p.name.startswith("dualop_dummy_plugin") for p in target.iterdir())
    return target


def _run(plugin_path, code, **env_overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUALOP_") and k != "DUMMY_PLUGIN_CLAIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_path), env.get("PYTHONPATH", "")])
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


PROBE = """
import dualop, torch
from dualop import CustomOp, plugins
print("status", sorted(plugins.plugin_status().items()))
print("oot", CustomOp.op_registry_oot.get("RMSNorm").__name__ if "RMSNorm" in CustomOp.op_registry_oot else None)
op = dualop.ops.RMSNorm(8)
print("type", type(op).__name__)
print("platform", dualop.current_platform("torch"))
out = op(torch.ones(2, 8))
print("result", out[0] if isinstance(out, tuple) else "native")
"""


def test_plugin_registers_oot_op_and_failure_is_logged(plugin_path):
    proc = _run(plugin_path, PROBE)
    assert proc.returncode == 0, proc.stderr
    assert "oot DummyRMSNorm" in proc.stdout and "type DummyRMSNorm" in proc.stdout
    # the broken plugin is logged with its traceback, never swallowed silently
    assert "dualop plugin 'dummy_broken'" in proc.stderr
    assert "Traceback" in proc.stderr and "the dummy plugin's device is missing" in proc.stderr
    assert "('dualop.plugins:dummy_broken', \"RuntimeError: the dummy plugin's device is missing\")" in proc.stdout
    assert "platform cpu" in proc.stdout and "result native" in proc.stdout


def test_platform_plugin_routes_to_forward_oot(plugin_path):
    proc = _run(plugin_path, PROBE, DUMMY_PLUGIN_CLAIM="1")
    assert proc.returncode == 0, proc.stderr
    assert "platform oot" in proc.stdout and "result dummy_oot" in proc.stdout


def test_dualop_platform_overrides_the_plugin(plugin_path):
    proc = _run(plugin_path, PROBE, DUMMY_PLUGIN_CLAIM="1", DUALOP_PLATFORM="cpu")
    assert proc.returncode == 0, proc.stderr
    assert "platform cpu" in proc.stdout


def test_allow_list(plugin_path):
    proc = _run(plugin_path, PROBE, DUALOP_PLUGINS="dummy_platform", DUMMY_PLUGIN_CLAIM="1")
    assert proc.returncode == 0, proc.stderr
    assert "oot None" in proc.stdout and "type RMSNorm" in proc.stdout  # dummy_oot not allowed
    assert "dummy_broken" not in proc.stderr
    assert "platform oot" in proc.stdout


def test_strict_plugins_make_failure_fatal(plugin_path):
    proc = _run(plugin_path, PROBE, DUALOP_STRICT_PLUGINS="1")
    assert proc.returncode != 0
    assert "dualop plugin 'dummy_broken'" in proc.stderr and "device is missing" in proc.stderr
