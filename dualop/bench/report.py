"""Terminal tables for ``dualop bench``."""

from __future__ import annotations

from typing import Any

__all__ = ["table", "format_throughput"]


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Left-aligned columns under a dashed rule; ``columns`` defaults to the first row's keys."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    cells = [columns] + [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    out = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def format_throughput(records: list[dict]) -> str:
    """The throughput table (one row per timed implementation), then one line per error record."""
    timed = [r for r in records if r.get("op") != "dispatch" and "error" not in r]
    errors = [r for r in records if r.get("op") != "dispatch" and "error" in r]
    rows = [
        {
            "case": r["op"],
            "shape": "x".join(map(str, r["shape"])),
            "dtype": r["dtype"],
            "frontend": r["frontend"],
            "impl": r["impl"],
            "median ms": _fmt(r["median_s"] * 1e3, ".3f"),
            "spread": _fmt(r["spread"] * 100, ".0f") + "%",
            "GB/s": _fmt(r["gbps"], ".1f"),
            "copy GB/s": _fmt(r["copy_gbps"], ".1f"),
            "% of copy": _fmt(r["roofline_fraction"] * 100, ".0f"),
            "vs best peer": _fmt(r.get("vs_best_peer"), ".2f"),
            "warm-up s": _fmt(r.get("warmup_s"), ".2f"),
            "faults/call": _fmt(r.get("minor_faults"), ".0f"),
            **({"x predicted": _fmt(r.get("vs_predicted"), ".1f")} if "vs_predicted" in r else {}),
            "same HLO": {True: "yes", False: "no"}.get(r.get("same_hlo_as_handwritten"), ""),
        }
        for r in timed
    ]
    parts = []
    if rows:
        allocators = sorted({r["allocator"] for r in timed})
        columns = list(dict.fromkeys(c for row in rows for c in row))
        parts.append(table(rows, columns))
        parts.append(
            "spread = (max - min) / median over rounds; GB/s = the kernel cost model's bytes / median; "
            "% of copy = GB/s / copy GB/s measured in the same rounds; vs best peer = median over rounds "
            "of time / the time in the same round of the peer (torch-*, vllm-*, jax-*) with the lowest median; "
            "warm-up s = the first call (compilation); faults/call = median minor page faults per call; "
            "same HLO = jax dualop-default compiles to the hand-written version's optimised HLO (names "
            "and metadata aside); "
            f"allocator: {', '.join(allocators)}"
        )
    for r in errors:
        parts.append(
            f"ERROR {r['op']} {'x'.join(map(str, r['shape']))} {r['dtype']} {r['frontend']} {r['impl']}: {r['error']}"
        )
    return "\n\n".join(parts) if parts else "no throughput records"
