"""An op's constructor call as a stable string, and the op rebuilt from it.

``torch.ops.dualop.<name>`` takes the op's constructor state as its ``ctor`` argument (a string: it
is a constant of every graph that calls the op, and FX graph caches key on it), and its kernels
rebuild the op from it. The string is tagged JSON of ``[class path, args, kwargs]``; it names only
importable things, so it means the same op in every process. Values:

- ``None``, ``bool``, ``int``, ``str`` and finite ``float`` (subclasses such as numpy's float64 are
  stored as the plain type), and lists of values: JSON's own;
- every JSON object is a tag: ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}``,
  ``{"float": "nan" | "inf" | "-inf"}``, ``{"enum": [path, member name]}``,
  ``{"dataclass": [path, {field: value}]}`` (the fields ``__init__`` takes),
  ``{"torch_dtype": name}`` (a ``torch.dtype``, as the engine passes a rope's ``dtype``).

A class path is ``module:qualname`` and must import back to the same class. Anything else (a
function, an arbitrary object, a class defined inside a function) has no encoding: ``encode``
raises a ``TypeError`` naming the op and the constructor argument.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import inspect
import json
import math
from typing import Any

__all__ = ["encode", "build", "op_class"]


class _Unencodable(Exception):
    """A value has no encoding; ``where`` is its path inside the argument (``[0]``, ``.col``)."""

    def __init__(self, why: str, where: str = "") -> None:
        super().__init__(why)
        self.why, self.where = why, where


def _class_path(cls: type) -> str:
    """``module:qualname`` of a class that imports back to itself."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    if "<locals>" in cls.__qualname__:
        raise _Unencodable(f"{path} is defined inside a function, so no other process can import it")
    try:
        found = _resolve(path)
    except (ImportError, AttributeError) as err:
        raise _Unencodable(f"{path} does not import ({err})") from None
    if found is not cls:
        raise _Unencodable(f"{path} imports a different object than the class given")
    return path


@functools.lru_cache(maxsize=None)
def _resolve(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_value(value: Any) -> Any:
    """``value`` as JSON-ready data (see the module docstring), or ``_Unencodable``."""
    if value is None or type(value) in (bool, int, str):
        return value
    if isinstance(value, enum.Enum):  # before int/str: IntEnum and StrEnum members are ints and strs
        return {"enum": [_class_path(type(value)), value.name]}
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (tuple, list)):
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_encode_value(item))
            except _Unencodable as err:
                raise _Unencodable(err.why, f"[{i}]{err.where}") from None
        if type(value) is list:
            return items
        if type(value) is tuple:
            return {"tuple": items}
        raise _Unencodable(f"a {type(value).__qualname__} (only plain tuples and lists are encoded)")
    if type(value) is dict:
        pairs = []
        for key, item in value.items():
            try:
                pairs.append([_encode_value(key), _encode_value(item)])
            except _Unencodable as err:
                raise _Unencodable(err.why, f"[{key!r}]{err.where}") from None
        return {"dict": pairs}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"torch_dtype": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {}
        for field in dataclasses.fields(value):
            if field.init:
                try:
                    fields[field.name] = _encode_value(getattr(value, field.name))
                except _Unencodable as err:
                    raise _Unencodable(err.why, f".{field.name}{err.where}") from None
        return {"dataclass": [_class_path(type(value)), fields]}
    raise _Unencodable(
        f"a {type(value).__module__}.{type(value).__qualname__}; expected None, bool, int, float, str, "
        f"a torch.dtype, an Enum member, a dataclass instance, or a tuple, list or dict of those"
    )


def _decode_value(data: Any) -> Any:
    if isinstance(data, list):
        return [_decode_value(item) for item in data]
    if not isinstance(data, dict):
        return data
    ((tag, body),) = data.items()
    if tag == "tuple":
        return tuple(_decode_value(item) for item in body)
    if tag == "dict":
        return {_decode_value(k): _decode_value(v) for k, v in body}
    if tag == "float":
        return float(body)
    if tag == "enum":
        return _resolve(body[0])[body[1]]
    if tag == "dataclass":
        return _resolve(body[0])(**{k: _decode_value(v) for k, v in body[1].items()})
    if tag == "torch_dtype":
        import torch

        return getattr(torch, body)
    raise ValueError(f"dualop: unknown tag {tag!r} in a constructor spec")


def _argument_name(cls: type, position: int | str) -> str:
    """The constructor parameter a positional index (or keyword) stands for, for error messages."""
    if isinstance(position, str):
        return position
    try:
        params = [p for p in inspect.signature(cls.__init__).parameters.values()][1:]
    except (TypeError, ValueError):
        params = []
    if position < len(params) and params[position].kind in (params[position].POSITIONAL_ONLY,
                                                             params[position].POSITIONAL_OR_KEYWORD):
        return params[position].name
    return f"positional argument {position}"


def encode(cls: type, args: tuple, kwargs: dict) -> str:
    """The constructor call ``cls(*args, **kwargs)`` as a stable string (see the module docstring).

    Raises ``TypeError`` naming the op and the argument when some value has no encoding."""
    op = getattr(cls, "name", None) or cls.__qualname__
    try:
        path = _class_path(cls)
    except _Unencodable as err:
        raise TypeError(f"{op}: torch.library cannot rebuild this op: {err.why}") from None
    encoded: list[Any] = [path, [], {}]
    for key, value in [*enumerate(args), *sorted(kwargs.items())]:
        try:
            data = _encode_value(value)
        except _Unencodable as err:
            raise TypeError(
                f"{op}: constructor argument {_argument_name(cls, key)!r}{err.where} has no torch.library "
                f"encoding ({err.why}), so torch.compile cannot make this op opaque"
            ) from None
        if isinstance(key, int):
            encoded[1].append(data)
        else:
            encoded[2][key] = data
    return json.dumps(encoded, sort_keys=True, allow_nan=False, separators=(",", ":"))


@functools.lru_cache(maxsize=None)
def build(spec: str) -> Any:
    """The op a spec describes, constructed (one instance per spec, shared)."""
    path, args, kwargs = json.loads(spec)
    return _resolve(path)(*_decode_value(args), **{k: _decode_value(v) for k, v in kwargs.items()})


def op_class(spec: str) -> type:
    """The class a spec builds, without building it."""
    return _resolve(json.loads(spec)[0])
