"""What the install promises: every version pyproject allows works, each extra gives what
docs/install.md says, a missing compiler names the extra that installs it, and importing dualop
keeps the TPU runtimes quiet on a host with no TPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from dualop import aot, platforms

ROOT = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def _pins(environment: str) -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints" / f"{environment}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower().replace("-", "_")] = Version(version.strip())
    return pins


def _requirement_names(reqs: list[Requirement]) -> set[str]:
    return {r.name.lower().replace("-", "_") for r in reqs}


def _environment_extras() -> dict[str, list[str]]:
    """The extras scripts/env.sh installs in each test environment."""
    script = (ROOT / "scripts" / "env.sh").read_text()
    return {name: extras.split(",") for name, extras in re.findall(r'^\s*(\w+)\)\s+extras="([^"]+)"', script, re.M)}


# --- pyproject, the constraint files and the environments -------------------------------------


def test_each_environment_pin_is_inside_pyproject_and_the_xla_pins_are_its_lower_bounds():
    """A pin outside the range of an extra its environment installs would test a version no
    install gets; the oldest version each framework allows is the one the 'xla' environment tests."""
    extras = _extras()
    for environment, names in _environment_extras().items():
        for name, version in _pins(environment).items():
            for r in (r for extra in names for r in extras[extra]):
                if r.name.lower().replace("-", "_") == name:
                    assert r.specifier.contains(version, prereleases=True), (environment, name, str(version), str(r))
    xla = _pins("xla")
    for name in ("torch", "jax", "jaxlib", "triton", "torch_xla", "torchax"):
        lower = {Version(s.version) for reqs in extras.values() for r in reqs
                 if r.name.lower().replace("-", "_") == name for s in r.specifier if s.operator == ">="}
        assert min(lower) == xla[name], (name, sorted(map(str, lower)), str(xla[name]))


def test_tpu_extra_is_libtpu_and_jax_and_torch_tpu_has_its_own():
    """``[tpu]`` serves ``dualop compile``'s TPU targets and the Pallas TPU path without torch_tpu
    (whose import is slow and loud); PyTorch's native TPU backend is ``[torch-tpu]``; the model
    examples' transformers and safetensors are ``[models]``."""
    extras = _extras()
    assert _requirement_names(extras["tpu"]) >= {"libtpu", "jax", "flax"}  # flax: the sharded layers
    assert "torch_tpu" not in _requirement_names(extras["tpu"])
    assert "torch_tpu" in _requirement_names(extras["torch-tpu"])
    assert _requirement_names(extras["models"]) >= {"transformers", "safetensors"}


def test_readme_install_names_the_cpu_torch_wheel_and_every_extra():
    """A CPU host told how to get the CPU torch build (not the multi-GB CUDA one), and the install
    table naming each extra pyproject declares (a feature's extra, never found by trial)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install"):readme.index("\n## ", readme.index("## Install") + 1)]
    assert "--index-url https://download.pytorch.org/whl/cpu" in section
    named = set(re.findall(r"`([\w-]+)`", section))
    missing = set(_extras()) - named
    assert not missing, f"extras the README's install section does not name: {sorted(missing)}"
    assert re.search(r"transformers.*`models`", section), "the models extra must say it brings transformers"


def test_env_script_installs_existing_extras_and_the_constraint_files_cite_existing_pages():
    extras = set(_extras())
    environments = _environment_extras()
    assert set(environments) == {"latest", "xla", "vllm"}
    for name, names in environments.items():
        assert set(names) <= extras, (name, set(names) - extras)
    assert "torch-tpu" in environments["latest"]  # the tests of the torch_tpu bridge
    for environment in environments:
        text = (ROOT / "constraints" / f"{environment}.txt").read_text()
        cited = re.findall(r"docs/[\w./-]+\.md", text)
        assert cited, f"constraints/{environment}.txt cites no page saying what the environment is for"
        for page in cited:
            assert (ROOT / page).is_file(), (environment, page)


# --- dualop compile across versions ------------------------------------------------------------


# Compiled-mode Triton needs its own process (the interpreter is chosen when kernels are defined,
# and an interpreted launch earlier in this process leaves triton.language as it runs there), as
# ``dualop compile`` builds in a child.
_LAUNCHER_PROBE = """
import json
import os
import torch
import triton
import triton.language as tl

from dualop.aot import gpu
from dualop.kernels.cuda import GPU_TARGETS


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


class KnobsWithout:
    # triton.knobs as an older triton has it: the named knobs.compilation settings missing.
    def __init__(self, knobs, hidden):
        self._knobs, self._hidden = knobs, hidden

    def __getattr__(self, name):
        value = getattr(self._knobs, name)
        if name != "compilation":
            return value
        hidden = self._hidden

        class Compilation:
            def __getattr__(self, knob):
                if knob in hidden:
                    raise AttributeError(f"'compilation_knobs' object has no attribute {knob!r}")
                return getattr(value, knob)

        return Compilation()


launch = gpu.Launch(add_one, (torch.empty(4096, device="meta"), 4096), {"BLOCK": 1024}, (4,))
real, out, cache = triton.knobs, [], os.environ["TRITON_CACHE_DIR"]
for hidden in ((), ("fpsan_homomorphic_casts",), ("instrumentation_mode", "fpsan_homomorphic_casts")):
    # a fresh cache each time: a cached kernel is loaded, and ptxas's register report is not printed
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "-".join(hidden or ("installed",)))
    triton.knobs = KnobsWithout(real, hidden)
    gpu._DONE.clear()
    for target in ("sm90", "gfx942"):
        details, error = gpu.compile_launch(launch, GPU_TARGETS[target])
        out.append(dict(hidden=list(hidden), target=target, error=error, kernel=(details or {}).get("kernel"),
                        num_warps=(details or {}).get("num_warps"), registers=(details or {}).get("registers")))
    triton.knobs = real
print(json.dumps(out, default=str))
"""


@pytest.mark.each_env
def test_gpu_builds_follow_the_launcher_of_every_triton_allowed(tmp_path):
    """``dualop compile`` specialises a launch as ``JITFunction.run`` would, passing each
    ``knobs.compilation`` setting only where this triton has it: as installed (3.5 in 'xla',
    3.9 in 'latest'), and as 3.8 (no fpsan_homomorphic_casts) and 3.5-3.7 (no
    instrumentation_mode either) have them. The launch compiles for sm90 and gfx942 each time."""
    pytest.importorskip("torch", reason="the launch is captured on torch meta tensors")
    pytest.importorskip("triton", reason="the GPU builds need triton")
    from dualop.aot.gpu import child_environment

    script = tmp_path / "launcher_probe.py"
    script.write_text(_LAUNCHER_PROBE)
    env = child_environment(str(tmp_path / "triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    for r in results:
        assert r["error"] is None, r
        assert r["kernel"] == "add_one" and r["num_warps"] == 4 and r["registers"] > 0, r


def test_missing_compilers_name_the_extra_that_installs_them(monkeypatch):
    """Without triton the GPU targets say ``dualop[torch,triton]`` (and start no compiling child);
    without libtpu the TPU targets say ``dualop[tpu]``, libtpu and jax, nothing about torch_tpu;
    the topology targets (sharded layers) name flax too."""
    from dualop.aot import gpu

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError

    def no_child(*args, **kwargs):
        raise AssertionError(f"a compiling child was started: {args}")

    monkeypatch.setattr(gpu.subprocess, "run", no_child)
    rows = aot.run_compile(ops=["rms_norm"], targets=["v5e", "sm90"], dtypes=["float32"], progress=False)
    assert {r["status"] for r in rows} == {"unavailable"} and {r["target"] for r in rows} == {"v5e", "sm90"}
    (gpu_why,) = {r["message"] for r in rows if r["target"] == "sm90"}
    (tpu_why,) = {r["message"] for r in rows if r["target"] == "v5e"}
    assert gpu_why.startswith("the GPU targets need triton and torch (not installed: triton)")
    assert gpu_why.endswith("pip install 'dualop[torch,triton]'")
    assert tpu_why.startswith("the TPU targets need libtpu and jax") and tpu_why.endswith("pip install 'dualop[tpu]'")
    assert "torch_tpu" not in tpu_why
    assert aot.exit_status(rows) == 2
    monkeypatch.setitem(sys.modules, "flax", None)
    rows = aot.run_compile(targets=["v5e:2x2"], dtypes=["bfloat16"], progress=False)
    assert rows and {r["status"] for r in rows} == {"unavailable"}
    (layers_why,) = {r["message"] for r in rows}
    assert layers_why.startswith("the TPU topology targets need libtpu, jax and flax")
    assert layers_why.endswith("pip install 'dualop[tpu]'")


# --- quiet imports -----------------------------------------------------------------------------

_TPU_RUNTIME_VARIABLES = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD",
                          "JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")


@pytest.mark.latest_only
def test_importing_dualop_keeps_torch_and_jax_quiet_without_a_tpu():
    """With torch_tpu and libtpu installed and no TPU attached, ``import torch`` alone prints
    torch_tpu's tcmalloc warning and absl lines, and jax's first computation libtpu's failed TPU
    initialisation. A script that imports dualop before torch, or after jax but before jax
    computes (the README's order), prints nothing."""
    if platforms.tpu_attached():
        pytest.skip("this host has a TPU: the runtimes are meant to start there")
    missing = [name for name in ("torch_tpu", "libtpu", "torch", "jax") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"nothing to keep quiet without {', '.join(missing)} (the latest environment has them)")
    env = {k: v for k, v in os.environ.items() if k not in _TPU_RUNTIME_VARIABLES}
    body = ("x = dualop.ops.RMSNorm(64)(torch.ones(2, 64))\n"
            "y = dualop.ops.RMSNorm(64)(jnp.ones((2, 64))).block_until_ready()\n"
            "print(jax.default_backend(), tuple(x.shape), y.shape)\n")
    for imports in ("import dualop, torch, jax, jax.numpy as jnp\n", "import jax, jax.numpy as jnp, dualop, torch\n"):
        proc = subprocess.run([sys.executable, "-c", imports + body], env=env, capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.split() == ["cpu", "(2,", "64)", "(2,", "64)"], imports
        assert proc.stderr == "", imports
