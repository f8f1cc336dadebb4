"""The C interface of the CPU kernels, stated once per entry point as its C prototype.

A kernel module declares each C function it calls with ``c_function("int dualop_x(const
DualopArray* x, float eps, ...)")``, beside its torch wrapper. From that one statement follow both sides:

- C++: ``header_text()`` collects every declaration into ``dualop_api.h``, which the build
  force-includes into every ``csrc/*.cc``; a definition whose parameters differ from its
  declaration is then a compile error (two ``extern "C"`` declarations of one name conflict), so a
  mismatch fails the build, not memory at run time.
- Python: the ctypes ``argtypes``/``restype`` come from the same prototype, and the function is
  called by parameter name only (``X(x=tensor, eps=..., ...)``): a missing or unknown name is a
  ``TypeError`` before anything runs. ``const DualopArray*`` parameters take a CPU tensor or None
  (NULL); other pointer parameters a CPU tensor (its data pointer), None or an address.

Arrays travel as ``const DualopArray*`` (``csrc/common.h``): data pointer, element type, rank,
shape and strides in one struct, so an entry point reads its sizes and dtypes from the tensors
themselves instead of a long list of positional integers, and can refuse arrays that disagree. A
tensor passed for such a parameter is packed by ``array_arg``; ``DualopArray`` below is the ctypes
mirror, and both follow from ``ARRAY_FIELDS``. The element type codes are stated once here
(``DTYPE_CODES``) and emitted into the header as ``dualop::dtype_code::<name>``.
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil
import re
import struct
from typing import Any

__all__ = ["ARRAY_FIELDS", "CFunction", "DTYPE_CODES", "DualopArray", "MAX_DIMS", "PARALLEL_MIN_ELEMENTS", "array_arg",
           "array_layout", "c_function", "declared_functions", "header_text"]

# Element types of array arguments and their codes (DualopArray::dtype).
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2, "int32": 3, "int64": 4, "uint8": 5}

# Below this many elements a kernel runs on one thread: waking the OpenMP team costs more than the
# work. Emitted into the header as ``dualop::parallel_min_elements`` for the C++ side.
PARALLEL_MIN_ELEMENTS = 1 << 15

# csrc/common.h's DualopArray, field by field, in order. The ctypes mirror and array_arg's packing
# both follow from this list; tests/infra/test_c_interface.py checks it against the compiled layout.
MAX_DIMS = 4
ARRAY_FIELDS = (("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("strides", ctypes.c_int64 * MAX_DIMS))


class DualopArray(ctypes.Structure):
    """``csrc/common.h``'s ``DualopArray``: an array argument's data pointer, element type code
    (``DTYPE_CODES``), rank, and shape and strides (in elements; the first ``ndim`` entries)."""

    _fields_ = ARRAY_FIELDS


def _packing(ndim: int) -> struct.Struct:
    """``ARRAY_FIELDS`` as a ``struct`` format for a tensor of rank ``ndim``: the per-dimension
    arrays hold ``ndim`` values and zero padding, so a call packs only the tensor's own sizes."""
    codes = {ctypes.c_void_p: "P", ctypes.c_int32: "i", ctypes.c_int64: "q"}
    parts = []
    for _, c_type in ARRAY_FIELDS:
        if hasattr(c_type, "_length_"):
            parts.append(f"{ndim}{codes[c_type._type_]}{(c_type._length_ - ndim) * ctypes.sizeof(c_type._type_)}x")
        else:
            parts.append(codes[c_type])
    packing = struct.Struct("@" + "".join(parts))
    if packing.size != ctypes.sizeof(DualopArray):
        raise ImportError(f"DualopArray packs to {packing.size} bytes for rank {ndim}, "
                          f"not its {ctypes.sizeof(DualopArray)}")
    return packing


# Packing bytes is about three times cheaper per call than filling a ctypes Structure, and ctypes
# passes bytes to a pointer parameter without a copy.
_PACK_BY_RANK = tuple(_packing(ndim).pack for ndim in range(MAX_DIMS + 1))
_CODE_OF_TORCH_DTYPE: dict[Any, int] = {}  # filled on the first array_arg


def array_arg(t: Any) -> bytes:
    """A CPU tensor as a packed ``DualopArray`` (valid while ``t`` is alive), for a C parameter of
    type ``const DualopArray*``. ``TypeError`` for a tensor no entry point can take."""
    code = _CODE_OF_TORCH_DTYPE.get(getattr(t, "dtype", None))
    if code is None and not _CODE_OF_TORCH_DTYPE:
        import torch

        _CODE_OF_TORCH_DTYPE.update({getattr(torch, name): code for name, code in DTYPE_CODES.items()})
        code = _CODE_OF_TORCH_DTYPE.get(getattr(t, "dtype", None))
    if code is None or not t.is_cpu:
        raise TypeError(f"a {getattr(t, 'dtype', type(t).__name__)} on {getattr(t, 'device', None)} is not an "
                        f"array the CPU kernels take (CPU tensors of {', '.join(DTYPE_CODES)})")
    ndim = t.ndim
    if ndim > MAX_DIMS:
        raise TypeError(f"a {ndim}-dimensional tensor: array arguments have at most {MAX_DIMS} dimensions")
    return _PACK_BY_RANK[ndim](t.data_ptr(), code, ndim, *t.shape, *t.stride())


# C scalar types the prototypes may use, and their ctypes; every pointer is a c_void_p.
_SCALARS = {
    "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
    "double": ctypes.c_double, "uint8_t": ctypes.c_uint8,
}
_PROTOTYPE = re.compile(r"^\s*(?P<ret>[\w ]+?)\s+(?P<name>dualop_\w+)\s*\((?P<params>.*)\)\s*$", re.S)
_PARAM = re.compile(r"^(?P<type>(?:const\s+)?\w+(?:\s*\*)?)\s*(?P<name>\w+)$")

_DECLARED: dict[str, CFunction] = {}


class CFunction:
    """One C entry point: its prototype, parsed; called with keyword arguments only."""

    def __init__(self, prototype: str) -> None:
        match = _PROTOTYPE.match(" ".join(prototype.split()))
        if match is None:
            raise ValueError(f"not a C prototype of a dualop_ function: {prototype!r}")
        self.prototype = " ".join(prototype.split())
        self.name = match["name"]
        self.restype = self._ctype(match["ret"].strip())
        params = match["params"].strip()
        self.params: list[tuple[str, str]] = []
        for part in ([] if params in ("", "void") else params.split(",")):
            param = _PARAM.match(" ".join(part.split()))
            if param is None:
                raise ValueError(f"{self.name}: cannot read parameter {part.strip()!r}")
            self.params.append((param["type"], param["name"]))
        self.argtypes = [self._ctype(t) for t, _ in self.params]
        self._names = [n for _, n in self.params]
        self._arrays = {n for t, n in self.params if t.removeprefix("const ").rstrip("* ") == "DualopArray"}
        self._pointers = {n for t, n in self.params if t.endswith("*")} - self._arrays
        self._fn = None
        self._call = None

    def _ctype(self, c_type: str):
        if c_type.endswith("*"):
            return ctypes.c_void_p
        try:
            return _SCALARS[c_type.removeprefix("const ").strip()]
        except KeyError:
            raise ValueError(f"{getattr(self, 'name', '?')}: C type {c_type!r} is not one the CPU kernels use "
                             f"(pointers, {', '.join(_SCALARS)})") from None

    def declaration(self) -> str:
        return f'extern "C" {self.prototype};'

    def __call__(self, **kwargs: Any) -> int:
        return self.caller()(**kwargs)

    def caller(self):
        """The function kernel modules call: the C parameters as keyword-only arguments (Python's own
        binding makes a wrong name a ``TypeError`` naming the C function), pointers converted, the
        library bound on the first call."""
        if self._call is None:
            names = ", ".join(self._names)
            args = ", ".join(f"None if {n} is None else _array({n!r}, {n})" if n in self._arrays
                             else f"None if {n} is None else _address({n!r}, {n})" if n in self._pointers else n
                             for n in self._names)
            source = (f"def {self.name}({'*, ' + names if names else ''}):\n"
                      f"    return (_c[0] or _bind())({args})\n")
            bound: list = [None]

            def bind():
                bound[0] = self._bound()
                return bound[0]

            namespace = {"_c": bound, "_bind": bind, "_address": self._address, "_array": self._array}
            exec(source, namespace)  # noqa: S102  (built from a parsed prototype's identifiers only)
            self._call = namespace[self.name]
            self._call.c_function = self
        return self._call

    def positional(self):
        """The bound C function itself, for a caller that packs its arrays once (``array_arg``) and
        passes every parameter in the prototype's order: no names checked, nothing converted (an
        array parameter takes packed bytes or None, a pointer an address or None)."""
        return self._bound()

    def _address(self, name: str, value: Any) -> int:
        if type(value) is int:
            return value
        if getattr(getattr(value, "device", None), "type", None) != "cpu":
            raise TypeError(f"{self.name}: pointer argument {name!r} must be a CPU tensor, None or an address, "
                            f"got {type(value).__name__} on {getattr(value, 'device', None)}")
        return value.data_ptr()

    def _array(self, name: str, value: Any) -> bytes:
        try:
            return array_arg(value)
        except TypeError as err:
            raise TypeError(f"{self.name}: array argument {name!r}: {err}") from None

    def _bound(self):
        if self._fn is None:
            from dualop.kernels.cpu import load

            fn = getattr(load(), self.name)
            fn.argtypes, fn.restype = self.argtypes, self.restype
            self._fn = fn
        return self._fn


def c_function(prototype: str):
    """Declare a C entry point (see the module docstring), each name once; returns the function to
    call it with (``CFunction.caller``; its ``c_function`` attribute is the declaration)."""
    fn = CFunction(prototype)
    known = _DECLARED.get(fn.name)
    if known is not None and known.prototype != fn.prototype:
        raise ValueError(f"{fn.name} is declared twice, differently: {known.prototype!r} and {fn.prototype!r}")
    _DECLARED.setdefault(fn.name, fn)
    return _DECLARED[fn.name].caller()


def declared_functions() -> dict[str, CFunction]:
    """Every C function the CPU kernel modules declare (importing each of them)."""
    import dualop.kernels.cpu as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    return dict(sorted(_DECLARED.items()))


def header_text() -> str:
    """``dualop_api.h``: every declaration, force-included into each ``csrc/*.cc``."""
    lines = ["// Generated from the prototypes in dualop/kernels/cpu/*.py (dualop.kernels.cpu.abi).",
             "#pragma once", "#include <cstdint>", "", '#include "common.h"  // DualopArray', "",
             "namespace dualop::dtype_code {  // DualopArray::dtype"]
    lines += [f"constexpr int32_t {name} = {code};" for name, code in DTYPE_CODES.items()]
    lines += ["}  // namespace dualop::dtype_code", "",
              f"namespace dualop {{ constexpr int64_t parallel_min_elements = {PARALLEL_MIN_ELEMENTS}; }}", ""]
    lines += [fn.declaration() for fn in declared_functions().values()]
    return "\n".join(lines) + "\n"


array_layout = c_function("int dualop_array_layout(int64_t* out)")
array_layout.__doc__ = """Writes DualopArray's sizeof and its fields' offsets, as compiled, into ``out`` (int64, 6)."""
