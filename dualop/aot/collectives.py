"""The collectives of a compiled XLA program, read from its post-optimisation HLO text (the module
XLA dumps as ``*after_optimizations.txt``, as ``jax.stages.Compiled.as_text()`` prints it), for
``dualop compile``'s sharded layers.

One entry per collective the program runs: its kind (``KINDS``), its result type with layouts
removed (``f32[16,4096]``; a combined collective's tuple ``(f32[8], bf16[8,2])``), ``bytes``: the
RESULT's bytes on one device (an all-gather's gathered array, a reduce-scatter's shard, an
all-reduce's reduced array; for a tuple, the sum of its elements), and ``operand_bytes``: its
operands' bytes on one device. They differ beyond what the kind implies where XLA folded a convert
into the collective: XLA:TPU turns ``psum`` of float32 followed by a cast to bfloat16 into one
all-reduce from float32 operands to a bfloat16 result. The program text is walked from
its entry computation through every computation it calls (fusions, calls, loop bodies, branches,
``async-start`` wrappers), so a collective XLA fused into a computation counts where it runs:

- async pairs count once: ``all-gather-start``/``-done`` (and the other ``<kind>-start``/``-done``)
  by the ``-done``, whose result is the collective's; ``async-start``/``-done`` by the wrapped
  collective (the ``async-done`` and ``async-update`` edges to it are not followed);
- XLA:TPU's async collective fusion copies one collective into its start, each continuation fusion
  that overlaps it with compute, and its done; the copies share a ``chain_id`` frontend attribute,
  and a chain counts once;
- a collective in a ``while`` body counts the loop's ``known_trip_count`` times where the program
  states it (XLA:GPU's backend config), else once, marked ``per_iteration`` (XLA:TPU states no trip
  counts; a ``fori_loop`` of 5 psums reads as one all-reduce per iteration).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["KINDS", "Collective", "collectives", "summarize", "describe", "format_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
         "collective-broadcast")

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_CHAIN = re.compile(r'\bchain_id="([^"]*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OPERAND = re.compile(r"%([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_LAYOUT = re.compile(r"\{[^{}]*\}")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a program: ``count`` times per run (its loops' stated trip counts
    multiplied, else 1); ``per_iteration``: inside a loop whose trip count the program does not
    state, so it runs ``count`` times per iteration of that loop."""

    kind: str
    result: str
    bytes: int
    operand_bytes: int
    count: int = 1
    per_iteration: bool = False


@dataclasses.dataclass
class _Instruction:
    name: str
    result: str  # the result type as printed, layouts and all
    opcode: str
    operands: list[str]  # the operands' instruction names
    rest: str  # attributes (and, for older HLO text, the operands' printed types)


def _split_type(text: str) -> tuple[str, str]:
    """(the result type at the start of ``text``, what follows it): the type ends at the first space
    outside brackets (a tuple type ``(f32[2]{0}, s32[])`` holds spaces inside its parentheses)."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            return text[:i], text[i + 1:]
    return text, ""


def _split_operands(text: str) -> tuple[list[str], str]:
    """(the operand names, the attributes) of the text after an opcode's opening parenthesis."""
    depth = 1
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return _OPERAND.findall(text[:i]), text[i + 1:]
    return _OPERAND.findall(text), ""


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """The computations of an HLO module text (name -> instructions) and the entry's name."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(2), [])
                entry = header.group(2) if header.group(1) else entry
            elif line.strip() == "}":
                current = None
            continue
        match = _INSTRUCTION.match(line) if current is not None else None
        if not match:
            continue
        result, rest = _split_type(match.group(2))
        opcode = _OPCODE.match(rest)
        if opcode:
            operands, attributes = _split_operands(rest[opcode.end():])
            current.append(_Instruction(match.group(1), result, opcode.group(1), operands, attributes))
    return computations, entry


def _element_bits(element: str) -> int:
    if element == "pred":
        return 8
    digits = re.match(r"[a-z]+(\d+)", element)  # bf16, f8e4m3fn, s4, c64; token / opaque: none
    return int(digits.group(1)) if digits else 0


def result_type(printed: str) -> str:
    """A printed HLO type without layouts and index comments: ``f32[16,16]``, ``(bf16[8], s32[2])``."""
    text = _COMMENT.sub("", printed)
    while True:
        stripped = _LAYOUT.sub("", text)
        if stripped == text:
            return stripped
        text = stripped


def result_bytes(printed: str) -> int:
    """Bytes of every array in a printed HLO type (a bounded dynamic dimension ``<=N`` counts N)."""
    total = 0
    for element, dims in _ARRAY.findall(result_type(printed)):
        sizes = [int(re.sub(r"[^0-9]", "", d) or 0) for d in dims.split(",") if d.strip()]
        total += math.ceil(math.prod(sizes) * _element_bits(element) / 8)
    return total


def _kind(opcode: str) -> tuple[str | None, bool]:
    """(the collective kind ``opcode`` counts as, or None; whether it is an async ``-start`` half)."""
    if opcode in KINDS:
        return opcode, False
    for suffix, is_start in (("-done", False), ("-start", True)):
        if opcode.endswith(suffix) and opcode[: -len(suffix)] in KINDS:
            return opcode[: -len(suffix)], is_start
    return None, False


def _callees(instruction: _Instruction) -> Iterator[tuple[str, int | None]]:
    """The computations ``instruction`` runs, each with how many times per run of it (None: a
    loop's body or condition, its trip count not stated)."""
    if instruction.opcode in ("async-done", "async-update"):
        return  # the same wrapped computation as its async-start
    loop = instruction.opcode == "while"
    trips = _TRIP_COUNT.search(instruction.rest) if loop else None
    for attribute, name in _CALLEE.findall(instruction.rest):
        if loop and attribute in ("body", "condition"):
            yield name, int(trips.group(1)) if trips else None
        else:
            yield name, 1
    for _, names in _CALLEE_LIST.findall(instruction.rest):
        for name in names.split(","):
            if name.strip():
                yield name.strip().lstrip("%"), 1


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective the program in ``hlo_text`` runs, in program order (see the module doc)."""
    computations, entry = _parse(hlo_text)
    found: list[Collective] = []
    chains: set[str] = set()

    def walk(name: str, times: int, per_iteration: bool, stack: tuple[str, ...]) -> None:
        if name not in computations or name in stack:  # not a computation (a stray match), or recursion
            return
        named = {ins.name: ins for ins in computations[name]}

        def operand_bytes(ins: _Instruction) -> int:
            if ins.opcode.endswith("-done"):  # the operands are its -start's
                start = named.get(ins.operands[0]) if ins.operands else None
                return operand_bytes(start) if start is not None else 0
            return sum(result_bytes(named[o].result) for o in ins.operands if o in named)

        for ins in computations[name]:
            kind, is_start = _kind(ins.opcode)
            if kind is not None and not is_start:
                chain = _CHAIN.search(ins.rest)
                if chain is None or chain.group(1) not in chains:
                    found.append(Collective(kind, result_type(ins.result), result_bytes(ins.result),
                                            operand_bytes(ins), times, per_iteration))
                    if chain is not None:
                        chains.add(chain.group(1))
            for callee, trips in _callees(ins):
                walk(callee, times * (trips or 1), per_iteration or trips is None, (*stack, name))

    if entry is not None:
        walk(entry, 1, False, ())
    return found


def summarize(found: Iterable[Collective]) -> list[dict[str, Any]]:
    """Per kind, in ``KINDS`` order: ``{"kind", "count", "bytes", "operand_bytes", "per_iteration",
    "results"}``; ``count`` collectives per run of the program, ``bytes`` and ``operand_bytes`` their
    result and operand bytes per device added up, ``per_iteration`` how many of the ``count`` run
    once per iteration of a loop of unstated trip count (so the run has more), ``results`` each
    one's result type (repeated for a loop's stated trips)."""
    by_kind: dict[str, list[Collective]] = collections.defaultdict(list)
    for c in found:
        by_kind[c.kind].append(c)
    return [{"kind": kind,
             "count": sum(c.count for c in by_kind[kind]),
             "bytes": sum(c.bytes * c.count for c in by_kind[kind]),
             "operand_bytes": sum(c.operand_bytes * c.count for c in by_kind[kind]),
             "per_iteration": sum(c.count for c in by_kind[kind] if c.per_iteration),
             "results": [c.result for c in by_kind[kind] for _ in range(c.count)]}
            for kind in KINDS if by_kind[kind]]


def format_bytes(n: int) -> str:
    """``512 B``, ``64 KiB``, ``1.5 MiB``, ``2 GiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            text = f"{n / scale:.3g}"
            return f"{text if 'e' not in text else f'{n / scale:.0f}'} {unit}"  # 1000 KiB, not 1e+03 KiB
    return f"{n} B"


def describe(summary: list[dict[str, Any]]) -> str:
    """One line: ``all-reduce 2x 64 KiB, all-gather 1x 2 MiB -> 8 MiB`` (count, then the bytes per
    device of all of that kind: operands -> results where they differ, else the one number; then
    ``(N per loop iteration)`` for those in loops of unstated trip count); ``none`` for a program
    without collectives."""
    parts = []
    for s in summary:
        size = format_bytes(s["bytes"])
        if s["operand_bytes"] != s["bytes"]:
            size = f"{format_bytes(s['operand_bytes'])} -> {size}"
        loop = f" ({s['per_iteration']} per loop iteration)" if s.get("per_iteration") else ""
        parts.append(f"{s['kind']} {s['count']}x {size}{loop}")
    return ", ".join(parts) or "none"
