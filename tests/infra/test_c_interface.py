"""The CPU kernels' C interface is stated once (a prototype per entry point, in the module that calls
it) and both sides follow from it: a definition that differs fails the build, a Python call that
names its arguments wrongly fails before any C runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dualop.kernels import cpu
from dualop.kernels.cpu import abi

CSRC = Path(cpu.__file__).parent / "csrc"


def _definitions() -> dict[str, str]:
    """Every ``extern "C"`` function the sources define: name -> its prototype, whitespace folded."""
    found = {}
    for path in sorted(CSRC.glob("*.cc")):
        for match in re.finditer(r'extern "C"\s+(.*?)\s*\{', path.read_text(), re.S):
            prototype = " ".join(match.group(1).split())
            found[re.search(r"(dualop_\w+)\s*\(", prototype).group(1)] = prototype
    return found


def _compiler() -> str:
    compiler = cpu._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler on this machine: the CPU kernels (and this check) need one")
    return compiler


def test_every_defined_function_is_declared_once_as_defined():
    declared = {name: fn.prototype for name, fn in abi.declared_functions().items()}
    assert declared == _definitions()


def test_a_definition_that_differs_from_its_declaration_does_not_compile(tmp_path):
    compiler = _compiler()
    header = tmp_path / "dualop_api.h"
    header.write_text(abi.header_text())
    good = tmp_path / "good.cc"
    good.write_text('extern "C" int dualop_split_bf16(const float* v, void* hi, void* lo, int64_t count, int threads)'
                    " { return 0; }\n")
    bad = tmp_path / "bad.cc"  # count narrowed to int: the ctypes side would pass 8 bytes where 4 are read
    bad.write_text('extern "C" int dualop_split_bf16(const float* v, void* hi, void* lo, int count, int threads)'
                   " { return 0; }\n")
    for source, ok in ((good, True), (bad, False)):
        cmd = cpu.compile_command(compiler, [source], header, tmp_path / f"{source.stem}.so")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert (proc.returncode == 0) == ok, proc.stderr
    assert "dualop_split_bf16" in proc.stderr and "conflicting" in proc.stderr


def test_the_library_exports_every_declared_function():
    _compiler()
    lib = cpu.load()
    for name in abi.declared_functions():
        assert hasattr(lib, name), name


def test_a_call_with_a_wrong_argument_name_or_a_non_cpu_pointer_runs_no_c():
    import torch

    split = abi.declared_functions()["dualop_split_bf16"]
    with pytest.raises(TypeError, match="dualop_split_bf16.*unexpected keyword argument 'thread'"):
        split(v=None, hi=None, lo=None, count=0, thread=1)
    with pytest.raises(TypeError, match="dualop_split_bf16.*missing 1 required keyword-only argument: 'threads'"):
        split(v=None, hi=None, lo=None, count=0)
    with pytest.raises(TypeError, match="pointer argument 'v' must be a CPU tensor"):
        split(v=torch.empty(4, device="meta"), hi=None, lo=None, count=0, threads=1)


def test_a_prototype_the_interface_cannot_read_is_refused():
    with pytest.raises(ValueError, match="not a C prototype"):
        abi.CFunction("void helper(int x)")
    with pytest.raises(ValueError, match="C type 'size_t'"):
        abi.CFunction("int dualop_x(size_t n)")
