"""The C interface of the CPU kernels, stated once per entry point as its C prototype.

A kernel module declares each C function it calls with ``c_function("int dualop_x(int dtype, const
void* x, ...)")``, beside its torch wrapper. From that one statement follow both sides:

- C++: ``header_text()`` collects every declaration into ``dualop_api.h``, which the build
  force-includes into every ``csrc/*.cc``; a definition whose parameters differ from its
  declaration is then a compile error (two ``extern "C"`` declarations of one name conflict), so a
  mismatch fails the build, not memory at run time.
- Python: the ctypes ``argtypes``/``restype`` come from the same prototype, and the function is
  called by parameter name only (``X(dtype=..., x=tensor, ...)``): a missing or unknown name is a
  ``TypeError`` before anything runs. Pointer parameters take a CPU tensor (its data pointer), None
  (NULL) or an address.
"""

from __future__ import annotations

import ctypes
import importlib
import pkgutil
import re
from typing import Any

__all__ = ["CFunction", "c_function", "declared_functions", "header_text"]

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
        self._pointers = {n for t, n in self.params if t.endswith("*")}
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
            args = ", ".join(f"None if {n} is None else _address({n!r}, {n})" if n in self._pointers else n
                             for n in self._names)
            source = (f"def {self.name}({'*, ' + names if names else ''}):\n"
                      f"    return (_c[0] or _bind())({args})\n")
            bound: list = [None]

            def bind():
                bound[0] = self._bound()
                return bound[0]

            namespace = {"_c": bound, "_bind": bind, "_address": self._address}
            exec(source, namespace)  # noqa: S102  (built from a parsed prototype's identifiers only)
            self._call = namespace[self.name]
            self._call.c_function = self
        return self._call

    def _address(self, name: str, value: Any) -> int:
        if type(value) is int:
            return value
        if getattr(getattr(value, "device", None), "type", None) != "cpu":
            raise TypeError(f"{self.name}: pointer argument {name!r} must be a CPU tensor, None or an address, "
                            f"got {type(value).__name__} on {getattr(value, 'device', None)}")
        return value.data_ptr()

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
             "#pragma once", "#include <cstdint>", ""]
    lines += [fn.declaration() for fn in declared_functions().values()]
    return "\n".join(lines) + "\n"
