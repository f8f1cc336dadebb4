"""Entry-point plugins.

- ``dualop.plugins``: functions called once (at ``import dualop``) to register out-of-tree ops,
  typically with ``CustomOp.register_oot``.
- ``dualop.platform_plugins``: functions returning a platform name (``oot``, ``tpu``, ...) when
  their device is present, or None. The first non-None answer is the platform for every frontend
  (below only ``DUALOP_PLATFORM``).

``DUALOP_PLUGINS`` (comma-separated entry-point names) is an allow-list for both groups; unset
means all. A plugin that fails is logged with its traceback; ``DUALOP_STRICT_PLUGINS=1`` makes
the failure an exception instead.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import EntryPoint, entry_points

from dualop import platforms as _platforms

__all__ = ["load_plugins", "platform_from_plugins", "PLUGIN_GROUP", "PLATFORM_PLUGIN_GROUP"]

logger = logging.getLogger("dualop.plugins")

PLUGIN_GROUP = "dualop.plugins"
PLATFORM_PLUGIN_GROUP = "dualop.platform_plugins"
ENV_ALLOW = "DUALOP_PLUGINS"
ENV_STRICT = "DUALOP_STRICT_PLUGINS"

_loaded: dict[str, str] = {}  # entry-point name -> "ok" or the error text
_platform_answer: list[str | None] = []  # memo of platform_from_plugins()


def _allowed(ep: EntryPoint) -> bool:
    raw = os.environ.get(ENV_ALLOW)
    if raw is None:
        return True
    allow = {n.strip() for n in raw.split(",") if n.strip()}
    return ep.name in allow


def _strict() -> bool:
    return os.environ.get(ENV_STRICT, "0").strip().lower() in ("1", "true", "yes", "on")


def _entry_points(group: str) -> list[EntryPoint]:
    return sorted(entry_points(group=group), key=lambda ep: ep.name)


def _fail(group: str, ep: EntryPoint, err: BaseException) -> None:
    _loaded[f"{group}:{ep.name}"] = f"{type(err).__name__}: {err}"
    if _strict():
        raise RuntimeError(f"dualop plugin {ep.name!r} ({ep.value}) in {group} failed: {err}") from err
    logger.error("dualop plugin %r (%s) in %s failed to load; skipping it", ep.name, ep.value, group, exc_info=err)


def load_plugins() -> dict[str, str]:
    """Call every allowed ``dualop.plugins`` entry point once; return name -> status."""
    for ep in _entry_points(PLUGIN_GROUP):
        key = f"{PLUGIN_GROUP}:{ep.name}"
        if key in _loaded or not _allowed(ep):
            continue
        try:
            ep.load()()
        except Exception as err:
            _fail(PLUGIN_GROUP, ep, err)
        else:
            _loaded[key] = "ok"
            logger.info("dualop plugin %r loaded", ep.name)
    _platforms.invalidate()
    return dict(_loaded)


def platform_from_plugins() -> str | None:
    """The platform the first allowed platform plugin claims, or None (memoised)."""
    if _platform_answer:
        return _platform_answer[0]
    answer = None
    for ep in _entry_points(PLATFORM_PLUGIN_GROUP):
        if not _allowed(ep):
            continue
        try:
            result = ep.load()()
        except Exception as err:
            _fail(PLATFORM_PLUGIN_GROUP, ep, err)
            continue
        if result is None:
            continue
        if result not in _platforms.PLATFORMS:
            _fail(
                PLATFORM_PLUGIN_GROUP,
                ep,
                ValueError(f"returned {result!r}, not one of {_platforms.PLATFORMS}"),
            )
            continue
        answer = result
        logger.info("dualop platform plugin %r claims platform %r", ep.name, result)
        break
    _platform_answer.append(answer)
    return answer


def plugin_status() -> dict[str, str]:
    return dict(_loaded)
