"""The CPU kernels' C interface is stated once (a prototype per entry point, in the module that calls
it) and both sides follow from it: a definition that differs fails the build, a Python call that
names its arguments wrongly fails before any C runs. Arrays travel as DualopArray structs, whose
Python mirror must match the compiled layout, and an entry point refuses arrays that disagree."""

from __future__ import annotations

import ctypes
import re
import shutil
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
    good.write_text('extern "C" int dualop_split_bf16(const DualopArray* v, const DualopArray* hi, '
                    "const DualopArray* lo, int threads) { return 0; }\n")
    bad = tmp_path / "bad.cc"  # a raw pointer where the struct is declared: ctypes would pass a DualopArray*
    bad.write_text('extern "C" int dualop_split_bf16(const float* v, const DualopArray* hi, '
                   "const DualopArray* lo, int threads) { return 0; }\n")
    for source, ok in ((good, True), (bad, False)):
        cmd = cpu.compile_command(compiler, [source], header, tmp_path / f"{source.stem}.so")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert (proc.returncode == 0) == ok, proc.stderr
    assert "dualop_split_bf16" in proc.stderr and "conflicting" in proc.stderr


def test_the_library_exports_exactly_the_declared_functions():
    _compiler()
    lib = cpu.load()
    for name in abi.declared_functions():
        assert hasattr(lib, name), name
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's exported symbols")
    path = cpu.library_path(_compiler())
    listing = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in listing.stdout.splitlines() if line.split()[-1].startswith("dualop_")}
    assert exported == set(abi.declared_functions())


def test_the_array_struct_mirror_matches_the_compiled_layout():
    import torch

    _compiler()
    layout = torch.zeros(8, dtype=torch.int64)
    assert abi.array_layout(out=layout) == 6
    offsets = [getattr(abi.DualopArray, name).offset for name, _ in abi.ARRAY_FIELDS]
    assert layout[:6].tolist() == [ctypes.sizeof(abi.DualopArray), *offsets]
    # array_arg packs, at every rank, the bytes the ctypes mirror describes
    base = torch.empty(2, 3, 5, 7, dtype=torch.bfloat16)
    for t in (base[0, 0, 0, 0], base[0, 0, 0], base[0, :, 1:4], base[:, :, 1:4], base.transpose(1, 3)):
        packed = abi.array_arg(t)
        assert len(packed) == ctypes.sizeof(abi.DualopArray)
        view = abi.DualopArray.from_buffer_copy(packed)
        assert (view.data, view.dtype, view.ndim) == (t.data_ptr(), abi.DTYPE_CODES["bfloat16"], t.ndim)
        padding = [0] * (abi.MAX_DIMS - t.ndim)
        assert list(view.shape) == [*t.shape, *padding] and list(view.strides) == [*t.stride(), *padding]


def test_the_header_states_the_dtype_codes_python_packs():
    header = abi.header_text()
    for name, code in abi.DTYPE_CODES.items():
        assert f"constexpr int32_t {name} = {code};" in header


def test_arrays_that_disagree_with_the_entry_point_are_refused_before_any_write():
    import torch

    _compiler()
    split = abi.declared_functions()["dualop_split_bf16"]
    v = torch.randn(4, 8)
    hi, lo = torch.full((4, 8), 7.0, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    assert split(v=v, hi=hi, lo=lo, threads=1) == 0
    torch.testing.assert_close(hi.float() + lo.float(), v, rtol=2**-15, atol=0)
    for wrong in (torch.zeros(4, 8, dtype=torch.float16),  # element type
                  torch.zeros(4, 7, dtype=torch.bfloat16),  # shape
                  torch.zeros(8, 4, dtype=torch.bfloat16).T):  # not row-major
        before = wrong.clone()
        assert split(v=v, hi=wrong, lo=lo, threads=1) == -10  # kBadArrays
        assert torch.equal(wrong, before)


def test_a_call_with_a_wrong_argument_name_or_a_non_cpu_pointer_runs_no_c():
    import torch

    split = abi.declared_functions()["dualop_split_bf16"]
    with pytest.raises(TypeError, match="dualop_split_bf16.*unexpected keyword argument 'thread'"):
        split(v=None, hi=None, lo=None, thread=1)
    with pytest.raises(TypeError, match="dualop_split_bf16.*missing 1 required keyword-only argument: 'threads'"):
        split(v=None, hi=None, lo=None)
    with pytest.raises(TypeError, match="array argument 'v': .* on meta is not an array"):
        split(v=torch.empty(4, device="meta"), hi=None, lo=None, threads=1)
    with pytest.raises(TypeError, match="array argument 'v': a 5-dimensional tensor"):
        split(v=torch.empty(1, 1, 1, 1, 4), hi=None, lo=None, threads=1)
    with pytest.raises(TypeError, match="array argument 'hi': a torch.complex64"):
        split(v=torch.empty(4), hi=torch.empty(4, dtype=torch.complex64), lo=None, threads=1)


def test_a_prototype_the_interface_cannot_read_is_refused():
    with pytest.raises(ValueError, match="not a C prototype"):
        abi.CFunction("void helper(int x)")
    with pytest.raises(ValueError, match="C type 'size_t'"):
        abi.CFunction("int dualop_x(size_t n)")
