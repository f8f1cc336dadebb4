"""embedding ops (issue 11; filled in by its work)."""

from __future__ import annotations

__all__: list[str] = []
