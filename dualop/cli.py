"""The ``dualop`` command: ``ops``, ``report``, ``check``, ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["main"]


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [columns] + [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    out = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _available_frontends(requested: list[str] | None) -> list[str]:
    """The requested frontends (default: all four) that can be imported here."""
    from dualop import testing

    testing.prepare_triton()  # before torch_xla imports triton (see dualop.kernels.cuda)
    names = requested or ["torch", "jax", "torch_xla", "torchax"]
    return [f for f in names if testing.frontend_available(f) is None]


def cmd_ops(args: argparse.Namespace) -> int:
    from dualop import CustomOp
    from dualop.custom_op import PLATFORM_METHOD

    rows = []
    for name, cls in sorted(CustomOp.op_registry.items()):
        implemented = [m.removeprefix("forward_") for m in ("forward_native", *PLATFORM_METHOD.values())
                       if m == "forward_native" or cls._implements(m)]
        oot = CustomOp.op_registry_oot.get(cls.__name__)
        rows.append({
            "op": name,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "implements": ",".join(implemented),
            "oot replacement": f"{oot.__module__}.{oot.__qualname__}" if oot else "",
        })
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows, ["op", "class", "implements", "oot replacement"]))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Resolve (and, unless --no-run, call once on a tiny input) every op for each frontend."""
    import numpy as np

    from dualop import dispatch_report, get_config, testing
    from dualop.platforms import current_platform

    frontends = _available_frontends(_csv(args.frontends) if args.frontends else None)
    if not frontends:
        print("dualop report: no frontend (torch, jax) can be imported here", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    seen = set()
    for case in testing.cases_for(None):
        if case.op in seen:
            continue
        seen.add(case.op)
        shape = next(s for s in case.shapes if s[0] > 0)
        op = case.make_op(shape)
        for fe in frontends:
            if args.no_run:
                op.dispatched_method(fe)
                continue
            with testing.frontend_context(fe):
                op(*(testing.to_frontend(a, fe, "float32") for a in case.make_inputs(shape, rng)))
    rows = dispatch_report()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cfg = get_config()
    platforms = ", ".join(f"{fe}: {current_platform(fe)}" for fe in frontends)
    print(f"config: {cfg!r}\nplatforms: {platforms}\n")
    print(_table(rows, ["op", "frontend", "platform", "method", "enabled", "reason"]))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from dualop import check

    results = check.run_check(
        ops=_csv(args.ops) if args.ops else None,
        frontends=_csv(args.frontends) if args.frontends else None,
        platforms=_csv(args.platforms) if args.platforms else None,
        dtypes=_csv(args.dtypes) if args.dtypes else None,
        progress=not args.no_progress,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(check.format_table(results))
    return 1 if check.failed(results) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dualop import bench

    records = bench.dispatch_overhead(
        frontends=_available_frontends(_csv(args.frontends) if args.frontends else ["torch", "jax"]),
        rounds=args.rounds,
        progress=not args.no_progress,
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=2)
    print(bench.format_dispatch(records))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualop",
        description="dualop: one op definition for PyTorch and JAX, Pallas kernels on TPU, Triton on CUDA/ROCm.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ops", help="list registered ops and the platform methods each implements")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(fn=cmd_ops)

    s = sub.add_parser("report", help="which method each op dispatches to, and why, under the current config")
    s.add_argument("--frontends", help="comma-separated: torch, jax, torch_xla, torchax (default: all importable)")
    s.add_argument("--no-run", action="store_true", help="only resolve; do not call each op on a tiny input")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("check", help="run every op through every reachable implementation against forward_native")
    s.add_argument("--ops", help="comma-separated registered op names (default: all)")
    s.add_argument("--frontends", help="comma-separated: torch, jax, torch_xla, torchax (default: all importable)")
    s.add_argument("--platforms", help="comma-separated: cpu, cuda, rocm, tpu (default: all)")
    s.add_argument("--dtypes", help="comma-separated: float32, bfloat16, float16 (default: float32,bfloat16)")
    s.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    s.add_argument("--json", action="store_true", help="print results as JSON instead of the table")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("bench", help="measure dispatch overhead against the reference engine's pattern")
    s.add_argument("--frontends", help="comma-separated: torch, jax (default: both where importable)")
    s.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    s.add_argument("--json", metavar="FILE", help="also write the records as JSON to FILE")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as err:
        print(f"dualop {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
