"""The tutorials' code runs: each file a tutorial writes (a fenced block right after an HTML comment
``<!-- tutorial-file: PATH -->``) goes into a copy of the repository, and the commands the tutorial
says to run pass there. For "Write your own op" that is the whole claim of the page: the op's six new
files, and no change elsewhere, give an op whose kernels run and pass in every kernel cell here, that
the shared sweeps test and the real compilers build. For "Write a plugin", the package installs and its usage script prints
what the page says it prints."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_ENV

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
FILE_BLOCK = re.compile(r"<!-- tutorial-file: (?P<path>\S+) -->\n```\w*\n(?P<body>.*?)\n```", re.S)
# Where adding an op may write: its op module, one file per kernel backend, its test file.
OP_FILES = (r"dualop/ops/\w+\.py", r"dualop/kernels/(pallas|cuda|cpu)/\w+\.py", r"dualop/kernels/cpu/csrc/\w+\.cc",
            r"tests/ops/test_\w+\.py")


def tutorial_files(page: str) -> dict[str, str]:
    return {m["path"]: m["body"] + "\n" for m in FILE_BLOCK.finditer((TUTORIALS / page).read_text())}


def _repository_copy(tmp_path: Path) -> Path:
    """The tracked files of this checkout, as they are in the working tree."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (git ls-files) to copy the repository")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    copy = tmp_path / "repo"
    for name in filter(None, listed.decode().split("\0")):
        if name.startswith(("docs/", "site/")) or not (ROOT / name).is_file():
            continue
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, copy / name)
    return copy


def _run(args: list[str], copy: Path, tmp_path: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PYTHONPATH=str(copy), DUALOP_CACHE_DIR=str(tmp_path / "cache"), TRITON_INTERPRET="1",
               PJRT_DEVICE="CPU")
    env.pop("DUALOP_PLATFORM", None)
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_write_an_op_adds_only_the_files_adding_an_op_may_touch():
    files = tutorial_files("write-an-op.md")
    assert len(files) == 6, sorted(files)
    for path in files:
        assert any(re.fullmatch(pattern, path) for pattern in OP_FILES), path
        assert not (ROOT / path).exists(), f"{path} exists already: the tutorial would edit it"


@pytest.mark.xla_only
def test_write_an_op_runs_in_every_kernel_cell_and_its_tests_pass(tmp_path):
    copy = _repository_copy(tmp_path)
    for path, text in tutorial_files("write-an-op.md").items():
        (copy / path).write_text(text)

    check = _run(["-m", "dualop.cli", "check", "--ops", "l2_norm", "--json", "--no-progress"], copy, tmp_path)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    cells = json.loads(check.stdout)
    ran = {(c["frontend"], c["platform"]) for c in cells if c["status"] == "pass"}
    assert {("torch", "cpu"), ("torch", "cuda"), ("torch", "rocm"), ("jax", "tpu")} <= ran, cells
    if TEST_ENV == "xla":  # the torch bridges to the Pallas kernel
        assert {("torch_xla", "tpu"), ("torchax", "tpu")} <= ran, cells
    assert not [c for c in cells if c["status"] in ("fail", "error")], cells
    native = {(c["frontend"], c["platform"]) for c in cells if c["status"] == "native"}
    assert native <= {("jax", "cpu"), ("jax", "cuda")}, cells

    tests = _run(["-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/ops/test_l2_norm.py", "tests/sweeps",
                  "-k", "l2_norm"], copy, tmp_path)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert re.search(r"\b(1[0-9]|[2-9]\d) passed", tests.stdout), tests.stdout[-2000:]

    bench = _run(["-m", "dualop.cli", "bench", "--list", "--ops", "l2_norm"], copy, tmp_path)
    assert bench.returncode == 0 and "l2_norm | op l2_norm" in bench.stdout, bench.stderr[-2000:]


@pytest.mark.latest_only
def test_write_an_ops_kernels_pass_the_real_compilers(tmp_path):
    copy = _repository_copy(tmp_path)
    for path, text in tutorial_files("write-an-op.md").items():
        (copy / path).write_text(text)
    built = _run(["-m", "dualop.cli", "compile", "--ops", "l2_norm", "--targets", "v5e,sm90", "--dtypes", "bfloat16",
                  "--no-progress", "--no-details"], copy, tmp_path)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert re.search(r"\d+ builds \(\d+ ok\)", built.stdout), built.stdout[-2000:]


@pytest.mark.latest_only
def test_write_a_plugin_installs_and_its_kernels_run_on_the_claimed_platform(tmp_path):
    source = tmp_path / "my-dualop-plugin"
    for path, text in tutorial_files("write-a-plugin.md").items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text(text)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, cwd=tmp_path, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DUALOP_", "PYTEST"))}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), MY_DEVICE="1")
    run = subprocess.run([sys.executable, str(source / "use_it.py")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    printed = run.stdout.splitlines()
    expected = re.search(r"which prints\n\n```\n(.*?)\n```", (TUTORIALS / "write-a-plugin.md").read_text(), re.S)
    assert printed == expected.group(1).splitlines()
