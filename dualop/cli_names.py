"""The names the ``dualop`` command's filters take (``--ops``, ``--frontends``, ``--platforms``,
``--dtypes``, ``--paths``, ...), checked before anything runs.

A filter value is a comma-separated list of names. An unknown name is a ``ValueError`` in one line
that names the flag, the value, what the flag takes and the nearest accepted name (an alias a new
user reaches for, such as ``pytorch`` for ``torch``, else ``difflib``'s closest match); ``main``
prints it as ``dualop <command>: <message>``. A flag given with no name at all is refused too, so a
filter never silently selects nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ALIASES", "check_names", "split_names", "suggestion"]

# Names a new user types for a thing dualop names otherwise, by the kind of name.
ALIASES: dict[str, dict[str, str]] = {
    "frontend": {"pytorch": "torch", "pt": "torch", "torch-xla": "torch_xla", "torchxla": "torch_xla",
                 "ptxla": "torch_xla", "jaxlib": "jax"},
    "platform": {"gpu": "cuda", "nvidia": "cuda", "amd": "rocm", "hip": "rocm", "host": "cpu"},
    "dtype": {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
              "f16": "float16", "half": "float16"},
    "path": {"torch": "torch-cpu", "cpu": "torch-cpu", "jax": "jax-cpu", "cuda": "triton", "gpu": "triton",
             "tpu": "pallas"},
}
# Longer lists of accepted names are not written out in full; the message says where to find them.
_LISTED_IN_FULL = 16


def split_names(flag: str, value: str | None) -> list[str] | None:
    """A filter flag's comma-separated names; None when the flag was not given (no filter). A comma
    inside brackets belongs to its name (a case label such as ``ragged_paged_attention[decode,window128]``).
    Given with no name (``--ops ""``, ``--ops ,``) it is a ``ValueError``: a filter that names nothing
    would select nothing."""
    if value is None:
        return None
    parts, depth, start = [], 0, 0
    for i, char in enumerate(value):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth <= 0:
            parts.append(value[start:i])
            start, depth = i + 1, 0
    parts.append(value[start:])
    names = [v.strip() for v in parts if v.strip()]
    if not names:
        raise ValueError(f"{flag} {value!r} names nothing; give comma-separated names, or leave {flag} out for all")
    return names


def suggestion(name: str, accepted: Iterable[str], kind: str | None = None) -> str | None:
    """The accepted name ``name`` most likely meant: its alias for ``kind`` (see ``ALIASES``), else
    the closest spelling (``difflib``), else None."""
    accepted = list(accepted)
    alias = ALIASES.get(kind or "", {}).get(name.lower())
    if alias in accepted:
        return alias
    if name.lower() in accepted:
        return name.lower()
    close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
    return close[0] if close else None


def check_names(flag: str, names: list[str] | None, accepted: Iterable[str], kind: str,
                listed_by: str | None = None) -> list[str] | None:
    """``names`` (None passes through: no filter) if every one is in ``accepted``, else a
    ``ValueError`` naming ``flag``, each unknown name with its likely meaning, and the accepted
    names (or, when there are many, how many and ``listed_by``, the command that lists them)."""
    if names is None:
        return None
    accepted = list(accepted)
    unknown = [n for n in dict.fromkeys(names) if n not in accepted]
    if not unknown:
        return names
    parts = []
    for name in unknown:
        hint = suggestion(name, accepted, kind)
        parts.append(f"{name!r}" + (f" (did you mean {hint!r}?)" if hint else ""))
    what = f"is not a {kind}" if len(unknown) == 1 else f"are not {kind}s"
    if len(accepted) <= _LISTED_IN_FULL or listed_by is None:
        choices = ", ".join(accepted)
    else:
        choices = f"one of {len(accepted)} names, listed by {listed_by}"
    raise ValueError(f"{flag}: {', '.join(parts)} {what}; accepted: {choices}")
