"""The ``custom_ops`` configuration: which ops take their fast (platform) path.

One parser, one validator, one place that decides the default. The same config governs callers
with ``torch.Tensor``s and callers with ``jax.Array``s.

Syntax of an entry: ``all``, ``none``, ``+name``, ``-name``; one entry may hold several joined by
commas (``"none,+rms_norm"``). When neither ``all`` nor ``none`` is given, ``none`` is appended if
``backend == "inductor"`` and ``mode != CompilationMode.NONE``, else ``all`` (the reference serving
engine's rule: let Inductor generate fused kernels when it compiles).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import enum
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

__all__ = [
    "CompilationMode",
    "OpsConfig",
    "get_config",
    "set_config",
    "config_from_env",
    "ENV_CUSTOM_OPS",
    "ENV_BACKEND",
    "ENV_MODE",
]

ENV_CUSTOM_OPS = "DUALOP_CUSTOM_OPS"
ENV_BACKEND = "DUALOP_BACKEND"
ENV_MODE = "DUALOP_MODE"

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


class CompilationMode(enum.IntEnum):
    """Compilation level, as the reference engine numbers it."""

    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    FULL = 3


def _split_entries(custom_ops: Iterable[str]) -> list[str]:
    if isinstance(custom_ops, str):
        raise TypeError(
            f"OpsConfig: custom_ops must be a list of strings, got the string {custom_ops!r}; "
            f"write [{custom_ops!r}]"
        )
    out: list[str] = []
    for entry in custom_ops:
        if not isinstance(entry, str):
            raise TypeError(f"OpsConfig: custom_ops entries must be strings, got {entry!r}")
        for part in entry.split(","):
            part = part.strip()
            if part:
                out.append(part)
    return out


def _entry_hint(entry: str) -> str:
    """``; did you mean ...?`` for a malformed entry: the keyword it misspells, or an op name
    missing its ``+``/``-``; empty when nothing is close."""
    if _NAME_RE.fullmatch(entry):
        close = difflib.get_close_matches(entry.lower(), ("all", "none"), n=1, cutoff=0.6)
        if close:
            return f"; did you mean {close[0]!r}?"
        return f"; did you mean '+{entry}' (enable it) or '-{entry}' (disable it)?"
    stripped = entry.lstrip("+-*! ").replace(" ", "_")
    if stripped in ("all", "none"):
        return f"; did you mean {stripped!r}?"
    if stripped != entry and _NAME_RE.fullmatch(stripped):
        sign = "-" if entry.startswith(("-", "!")) else "+"
        return f"; did you mean '{sign}{stripped}'?"
    return ""


def _validate(entries: list[str], where: str = "OpsConfig: custom_ops") -> None:
    """Refuse malformed or contradictory entries; ``where`` opens each message (the argument, or
    the environment variable the entries came from)."""
    for e in entries:
        if e in ("all", "none"):
            continue
        if e[0] in "+-" and _NAME_RE.fullmatch(e[1:]):
            continue
        raise ValueError(
            f"{where} entry {e!r} is not one of 'all', 'none', '+<op name>', '-<op name>'{_entry_hint(e)}"
        )
    for word in ("all", "none"):
        if entries.count(word) > 1:
            raise ValueError(f"{where} holds {word!r} more than once: {entries}")
    if "all" in entries and "none" in entries:
        raise ValueError(f"{where} holds both 'all' and 'none': {entries}")
    plus = {e[1:] for e in entries if e[0] == "+"}
    minus = {e[1:] for e in entries if e[0] == "-"}
    both = sorted(plus & minus)
    if both:
        raise ValueError(
            f"{where} both enables and disables {', '.join(both)} "
            f"('+{both[0]}' and '-{both[0]}')"
        )


@dataclass(frozen=True, eq=False)
class OpsConfig:
    """Which custom ops are enabled, and the compilation context that decides the default.

    ``custom_ops`` is normalised at construction: comma-joined entries are split, and ``all`` or
    ``none`` is appended when neither is present. ``strict=True`` turns a ``+name``/``-name`` that
    names no registered op from a warning into an error (raised at first dispatch, once the
    registry is populated).
    """

    custom_ops: tuple[str, ...] = field(default=())
    backend: str = "eager"
    mode: CompilationMode = CompilationMode.NONE
    strict: bool = False

    def __init__(
        self,
        custom_ops: Iterable[str] = (),
        backend: str = "eager",
        mode: int | CompilationMode = 0,
        strict: bool = False,
    ) -> None:
        if not isinstance(backend, str) or not backend:
            raise TypeError(f"OpsConfig: backend must be a non-empty string, got {backend!r}")
        try:
            mode = CompilationMode(int(mode))
        except (ValueError, TypeError):
            raise ValueError(
                f"OpsConfig: mode must be one of {[m.value for m in CompilationMode]} "
                f"or a CompilationMode, got {mode!r}"
            ) from None
        entries = _split_entries(custom_ops)
        _validate(entries)
        if "all" not in entries and "none" not in entries:
            compiling = backend == "inductor" and mode != CompilationMode.NONE
            entries.append("none" if compiling else "all")
        object.__setattr__(self, "custom_ops", tuple(entries))
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "strict", bool(strict))
        object.__setattr__(
            self, "_enabled", frozenset(e[1:] for e in entries if e[0] == "+")
        )
        object.__setattr__(
            self, "_disabled", frozenset(e[1:] for e in entries if e[0] == "-")
        )
        # A str identity of the config: hashing a str is cached by Python, so the dispatcher can
        # key its per-call cache lookup on it at almost no cost (a dataclass __hash__ cannot).
        object.__setattr__(
            self, "dispatch_key", "\x1f".join((*entries, backend, str(int(mode)), str(bool(strict))))
        )

    @property
    def default_on(self) -> bool:
        """Whether an op not named by ``+``/``-`` takes its fast path: exactly when ``all`` is set."""
        return "all" in self.custom_ops

    @property
    def named_ops(self) -> frozenset[str]:
        """Every op name this config mentions with ``+`` or ``-``."""
        return self._enabled | self._disabled  # type: ignore[attr-defined]

    def decide(self, name: str | None) -> tuple[bool, str]:
        """Return ``(enabled, reason)`` for the op registered as ``name`` (None: unregistered)."""
        if name is not None:
            if name in self._enabled:  # type: ignore[attr-defined]
                return True, f"config '+{name}'"
            if name in self._disabled:  # type: ignore[attr-defined]
                return False, f"config '-{name}'"
        if self.default_on:
            return True, "default: config holds 'all'"
        return False, "default: config holds 'none'"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpsConfig) and other.dispatch_key == self.dispatch_key

    def __hash__(self) -> int:
        return hash(self.dispatch_key)

    def __repr__(self) -> str:
        return (
            f"OpsConfig(custom_ops={list(self.custom_ops)!r}, backend={self.backend!r}, "
            f"mode={self.mode.name}, strict={self.strict})"
        )


def config_from_env(environ: os._Environ | dict | None = None) -> OpsConfig:
    """The process default: ``DUALOP_CUSTOM_OPS`` (comma-joined), ``DUALOP_BACKEND``, ``DUALOP_MODE``."""
    env = os.environ if environ is None else environ
    raw_ops = env.get(ENV_CUSTOM_OPS, "")
    backend = env.get(ENV_BACKEND, "eager") or "eager"
    raw_mode = env.get(ENV_MODE, "0") or "0"
    text = raw_mode.strip()
    try:
        mode = CompilationMode(int(text)) if text.lstrip("-").isdigit() else CompilationMode[text.upper()]
    except (ValueError, KeyError):
        raise ValueError(
            f"{ENV_MODE}={raw_mode!r} is not a compilation mode "
            f"(expected 0-3 or one of {[m.name for m in CompilationMode]})"
        ) from None
    _validate(_split_entries([raw_ops] if raw_ops else []), f"{ENV_CUSTOM_OPS}={raw_ops!r}:")
    return OpsConfig([raw_ops] if raw_ops else [], backend=backend, mode=mode)


class _UnreadableEnvironment:
    """The process default while the environment variables do not parse: using it in any way
    raises their error. So ``import dualop`` succeeds and the error surfaces where the config is
    first used (the ``dualop`` command reports it in one line), not as an import traceback."""

    def __init__(self, error: ValueError) -> None:
        self._error = error

    def __getattr__(self, name: str):
        raise ValueError(str(self._error))


def _read_environment() -> OpsConfig | _UnreadableEnvironment:
    try:
        return config_from_env()
    except ValueError as err:
        return _UnreadableEnvironment(err)


_current: contextvars.ContextVar[OpsConfig | None] = contextvars.ContextVar(
    "dualop_config", default=None
)
# Read once at import (the environment variables are the process default); see reload_process_default.
_process_default: OpsConfig | _UnreadableEnvironment = _read_environment()


def _default() -> OpsConfig:
    if isinstance(_process_default, _UnreadableEnvironment):
        raise ValueError(str(_process_default._error))
    return _process_default


def get_config() -> OpsConfig:
    """The active config: the innermost ``set_config`` of this context, else the process default."""
    cfg = _current.get()
    return cfg if cfg is not None else _default()


@contextlib.contextmanager
def set_config(cfg: OpsConfig) -> Iterator[OpsConfig]:
    """Make ``cfg`` the active config inside a ``with`` block.

    Context-local (a ``ContextVar``): other threads and other asyncio tasks keep their own config.
    """
    if not isinstance(cfg, OpsConfig):
        raise TypeError(f"set_config: expected an OpsConfig, got {type(cfg).__name__}")
    token = _current.set(cfg)
    try:
        yield cfg
    finally:
        _current.reset(token)


def reload_process_default() -> OpsConfig:
    """Re-read the environment variables (for tests and long-lived processes that change them)."""
    global _process_default
    _process_default = config_from_env()  # raises here, for the caller that asked to re-read
    from dualop import platforms  # every op's cached dispatch assumed the old default

    platforms.invalidate()
    return _process_default
