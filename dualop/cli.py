"""The ``dualop`` command: ``ops``, ``report``, ``check``, ``bench``, ``compile``, ``generate``."""

from __future__ import annotations

import argparse
import json
import linecache
import os
import sys
from typing import Any

from dualop.bench.report import table as _table
from dualop.cli_names import check_names, split_names

__all__ = ["main"]

# The frontends and platforms of ``dualop check``'s cells (and ``report``'s frontends).
_CELL_FRONTENDS = ("torch", "jax", "torch_xla", "torchax")
_CELL_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _op_names(value: str | None, labels: bool = False) -> list[str] | None:
    """``--ops``: registered op names (and, with ``labels``, check case labels), each with a check
    case of its own (the commands that take it run those cases; None: every op)."""
    from dualop import testing
    from dualop.custom_op import CustomOp

    cases = list(testing.cases_for(None))
    accepted = sorted(CustomOp.op_registry) + (sorted({c.label for c in cases} - set(CustomOp.op_registry))
                                               if labels else [])
    kind = "registered op or check case label" if labels else "registered op"
    names = check_names("--ops", split_names("--ops", value), accepted, kind,
                        listed_by="`dualop ops` and `dualop check --list`" if labels else "`dualop ops`")
    covered = {c.op for c in cases} | {c.label for c in cases}
    without = [n for n in names or () if n not in covered]
    if without:
        raise ValueError(f"--ops: {', '.join(map(repr, without))} {'has' if len(without) == 1 else 'have'} no check "
                         f"case of its own, so nothing would run; the cases there are: `dualop check --list`")
    return names


def _dtype_names(flag: str, value: str | None) -> list[str] | None:
    from dualop.testing import DTYPES

    return check_names(flag, split_names(flag, value), DTYPES, "dtype")


def _cell_filters(args: argparse.Namespace) -> tuple[list[str] | None, list[str] | None]:
    """``check``'s ``--frontends`` and ``--platforms``, checked, and refused if together they leave no cell."""
    from dualop import check

    frontends = check_names("--frontends", split_names("--frontends", args.frontends), _CELL_FRONTENDS, "frontend")
    platforms = check_names("--platforms", split_names("--platforms", args.platforms), _CELL_PLATFORMS, "platform")
    if not check.default_cells(frontends, platforms):
        cells = ", ".join(f"{f}/{p}" for f, p in check.DEFAULT_CELLS)
        raise ValueError(f"--frontends {','.join(frontends or _CELL_FRONTENDS)} with --platforms "
                         f"{','.join(platforms or _CELL_PLATFORMS)} select no cell, so nothing would run; "
                         f"the cells (frontend/platform): {cells}")
    return frontends, platforms


def _available_frontends(requested: list[str] | None) -> list[str]:
    """The requested frontends (default: all four) that can be imported here."""
    from dualop import testing

    testing.prepare_triton()  # before torch_xla imports triton (see dualop.kernels.cuda)
    names = requested or ["torch", "jax", "torch_xla", "torchax"]
    return [f for f in names if testing.frontend_available(f) is None]


def cmd_ops(args: argparse.Namespace) -> int:
    from dualop import CustomOp
    from dualop.reference import implemented_methods, op_reference_markdown

    if args.markdown:
        sys.stdout.write(op_reference_markdown())
        return 0
    rows = []
    for name, cls in sorted(CustomOp.op_registry.items()):
        implemented = [m.removeprefix("forward_") for m in implemented_methods(cls)]
        oot = CustomOp.op_registry_oot.get(cls.__name__)
        rows.append({
            "op": name,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "implements": ",".join(implemented) or "no forward",
            "oot replacement": f"{oot.__module__}.{oot.__qualname__}" if oot else "",
        })
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows, ["op", "class", "implements", "oot replacement"]))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Per op case and frontend: the method that ran (unless --no-run, on one call of a tiny
    input, so per-call declines show), whether that was a kernel, and why."""
    import numpy as np
    from tqdm import tqdm

    from dualop import get_config, testing
    from dualop.platforms import current_platform, platform_of

    ops = _op_names(args.ops)
    requested = check_names("--frontends", split_names("--frontends", args.frontends), _CELL_FRONTENDS, "frontend")
    frontends = _available_frontends(requested)
    if not frontends:
        print(f"dualop report: none of the frontends {', '.join(requested or _CELL_FRONTENDS)} can be imported here",
              file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    rows = []
    cases = list(testing.cases_for(ops))
    bar = tqdm(total=len(cases) * len(frontends), desc="dualop report", unit="cell", disable=args.no_progress,
               dynamic_ncols=True)
    for case in cases:
        shape = next(s for s in case.shapes if s[0] > 0)
        op = case.make_op(shape)
        for fe in frontends:
            bar.set_postfix_str(f"{case.label} {fe}", refresh=False)
            with testing.frontend_context(fe):
                inputs = [testing.to_frontend(a, fe, "float32") for a in case.make_inputs(shape, rng)]
                platform = platform_of(inputs[0], fe)  # a torch tensor's follows its device
                if args.no_run:
                    method, reason = op.resolution(fe, platform)
                else:
                    op.last_fallback = None
                    op(*inputs, **case.options)
                    method, reason = op.last_run(fe, platform)
            rows.append({
                "op": case.op, "case": case.label, "frontend": fe, "platform": platform,
                "method": method, "kernel": method != "forward_native",
                "enabled": op.enforce_enable or type(op).enabled(), "reason": reason,
            })
            bar.update()
    bar.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cfg = get_config()
    platforms = ", ".join(f"{fe}: {current_platform(fe)}" for fe in frontends)
    print(f"config: {cfg!r}\nplatforms: {platforms}\n")
    print(_table(rows, ["case", "frontend", "platform", "method", "kernel", "reason"]))
    return 0


def _print_lines(lines: list[str]) -> int:
    """A ``--list`` listing: its lines, then nothing else (so two versions' outputs diff cleanly)."""
    print("\n".join(lines))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from dualop import check

    if args.fuzz and not args.list:
        return _check_fuzz(args)
    # Every filter is checked before anything runs: an unknown name, or filters that select no
    # cell, is an error rather than a run of nothing.
    ops = _op_names(args.ops)
    frontends, platforms = _cell_filters(args)
    dtypes = _dtype_names("--dtypes", args.dtypes)
    if args.list:
        return _print_lines(check.case_listing(ops))
    fuzz_only = [flag for flag, given in (("--paths", args.paths), ("--budget", args.fuzz_budget),
                                          ("--draws", args.draws != 1), ("--jobs", args.jobs),
                                          ("--item", args.item)) if given]
    if fuzz_only:
        raise ValueError(f"{', '.join(fuzz_only)}: only with --fuzz")
    results = check.run_check(
        ops=ops,
        frontends=frontends,
        platforms=platforms,
        dtypes=dtypes,
        progress=not args.no_progress,
        seed=args.seed,
        max_shapes=1 if args.quick else None,
    )
    # The quick sweep adds a tiny model's greedy tokens through the kernel paths (check.run_model_check).
    model = check.run_model_check(frontends, platforms, progress=not args.no_progress) if args.quick else []
    if args.json:
        print(json.dumps([r.as_dict() for r in results] if not args.quick else
                         {"cells": [r.as_dict() for r in results], "model": [r.as_dict() for r in model]}, indent=2))
    else:
        print(check.format_table(results))
        if model:
            print("\n" + check.format_model_table(model))
    return 1 if check.failed(results) or check.model_failed(model) else 0


def _check_fuzz(args: argparse.Namespace) -> int:
    """``dualop check --fuzz``: the mutation sweep of dualop.fuzz; exit 1 if any case fails."""
    import time

    from dualop import fuzz

    for flag, given in (("--frontends", args.frontends), ("--platforms", args.platforms), ("--dtypes", args.dtypes)):
        if given:
            raise ValueError(f"{flag} does not apply with --fuzz (it draws dtypes itself; choose paths with --paths)")
    ops = _op_names(args.ops, labels=True)
    paths = check_names("--paths", split_names("--paths", args.paths), fuzz.PATHS, "path")
    only = None
    if args.item:
        only = []
        for text in args.item:
            label, sep, rest = text.rpartition("/")
            family, _, index = rest.partition("#")
            if not sep or not index.isdigit():
                raise ValueError(f"--item {text!r}: expected LABEL/FAMILY#INDEX, e.g. 'rms_norm[weight]/nonfinite.nan#0'")
            only.append((label, family, int(index)))
    start = time.perf_counter()
    results = fuzz.run_fuzz(
        ops=ops,
        paths=paths,
        budget=args.fuzz_budget,
        seed=args.seed,
        draws=args.draws,
        progress=not args.no_progress,
        jobs=args.jobs,
        case_timeout=args.case_timeout,
        only=only,
    )
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"seconds": seconds, "seed": args.seed, "budget": args.fuzz_budget, "draws": args.draws,
                          "totals": fuzz.summary(results), "results": [r.as_dict() for r in results]}, indent=2))
    else:
        budget = ("the cases named by --item" if only else "every case" if args.fuzz_budget is None
                  else f"at most {args.fuzz_budget} cases per path")
        print(fuzz.format_report(results, seconds, header=f"dualop check --fuzz (seed {args.seed}, {budget}, "
                                                          f"draws {args.draws})"))
    return 1 if fuzz.failed(results) else 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Build every kernel variant with the real TPU and GPU compilers (see dualop/aot)."""
    import time

    from dualop import aot

    ops = _op_names(args.ops)
    dtypes = _dtype_names("--dtypes", args.dtypes)
    serving_dtypes = _dtype_names("--serving-dtypes", args.serving_dtypes)
    if args.list:
        return _print_lines(aot.variant_listing(ops, dtypes, serving_dtypes))
    if args.model is not None:
        return _compile_models(args)
    start = time.perf_counter()
    rows = aot.run_compile(
        ops=ops,
        targets=_csv(args.targets) if args.targets else None,
        dtypes=dtypes,
        progress=not args.no_progress,
        sharded_serving=args.sharded_serving,
        serving_dtypes=serving_dtypes,
        serving_targets=_csv(args.serving_targets) if args.serving_targets else None,
    )
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        if not args.no_details:
            print(aot.format_details(rows) + "\n")
        collectives = aot.format_collectives(rows)
        if collectives:
            print(collectives + "\n")
        print(aot.format_matrix(rows))
        print("\n" + aot.format_summary(rows, time.perf_counter() - start))
    return aot.exit_status(rows)


def _compile_models(args: argparse.Namespace) -> int:
    """``dualop compile --model``: whole models' serving steps on multi-chip slices (dualop/aot/model.py).
    Exit 1 if the compiler refused one, 3 if one does not fit its chips' HBM, else 0."""
    from dualop.aot import tpu
    from dualop.aot.model import MODEL_SHAPES, MODEL_TARGETS, compile_model, format_model_builds

    names = list(MODEL_SHAPES) if args.model == "all" else check_names(
        "--model", split_names("--model", args.model), list(MODEL_SHAPES), "model")
    targets = list(MODEL_TARGETS)
    if args.targets:
        targets = []
        for t in _csv(args.targets):
            generation, _, topology = t.partition(":")
            if not topology or generation not in tpu.TOPOLOGIES or not all(d.isdigit() for d in topology.split("x")):
                raise ValueError(f"--model needs TPU topology targets such as v5e:2x2 or v6e:2x4, got {t!r}")
            chips = 1
            for d in topology.split("x"):
                chips *= int(d)
            targets.append((t, chips))
    why = tpu.tpu_available(layers=True)
    if why is not None:
        print(f"dualop compile --model: the TPU compiler is unavailable here: {why}", file=sys.stderr)
        return 2
    builds = []
    for name in names:
        for target, tp in targets:
            if not args.no_progress:
                print(f"dualop compile --model: building {name} for {target} at tp {tp} ...", file=sys.stderr, flush=True)
            builds.append(compile_model(name, target, tp, layers=args.layers))
    if args.json:
        import dataclasses

        print(json.dumps([dict(dataclasses.asdict(b), total_bytes=b.total_bytes) for b in builds], indent=2))
    else:
        print(format_model_builds(builds))
    if any(b.status in ("refused", "unavailable") for b in builds):
        return 1
    return 3 if any(b.status == "does-not-fit" for b in builds) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Throughput against peers with the copy roofline, then dispatch overhead; or, with
    ``--roofline-only``, predicted times on an accelerator from the kernels' cost models."""
    from dualop.bench import cases as bench_cases
    from dualop.bench import memory, roofline, throughput, timing

    # Validate every argument before anything is allocated or imported.
    timing.check_counts(args.rounds, args.warmup)
    ops = check_names("--ops", split_names("--ops", args.ops),
                      sorted({c.label for c in bench_cases.CASES} | {c.op_name for c in bench_cases.CASES}),
                      "bench case or op")
    cases = bench_cases.select_cases(ops)
    shapes = throughput.parse_sizes(_csv(args.sizes) if args.sizes is not None else list(throughput.SIZES))
    dtypes = throughput.check_dtypes(check_names("--dtypes", split_names("--dtypes", args.dtypes),
                                                 bench_cases.ITEMSIZE, "dtype") or ["float32", "bfloat16"])
    impls = check_names("--impls", split_names("--impls", args.impls), throughput.IMPLS, "implementation")
    requested = check_names("--frontends", split_names("--frontends", args.frontends), throughput.FRONTENDS,
                            "frontend") or list(throughput.FRONTENDS)
    if args.device is not None:
        roofline.check_device(args.device)
    if args.threads is not None and not 1 <= args.threads <= (os.cpu_count() or 1):
        raise ValueError(f"--threads: expected 1 to {os.cpu_count()} (this machine's CPUs), got {args.threads}")
    if args.model is not None and args.decode is not None:
        raise ValueError("--model and --decode: give one of them (a model against transformers, or checkpoints "
                         "against the first)")
    try:
        batches = tuple(_positive_int(b) for b in _csv(args.batches))
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"--batches: {err}") from None
    if not batches:
        raise ValueError(f"--batches: expected comma-separated positive ints, got {args.batches!r}")
    if args.list:
        return _print_lines(bench_cases.case_listing(ops, shapes))

    if args.roofline_only:
        devices = [args.device] if args.device else list(roofline.DEVICES)
        records = [roofline.predict(c, s, d, dev) for dev in devices for c in cases for s in shapes for d in dtypes]
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(records, fh, indent=2)
        print(roofline.format_roofline(records))
        return 0

    if args.plot:
        from dualop.bench import plot

        plot.check_path(args.plot)
        try:
            plot.require_matplotlib()
        except ImportError as err:
            print(f"dualop bench: {err}", file=sys.stderr)
            return 2

    # Before torch or jax start their threads (see dualop/bench/memory.py).
    allocator = memory.ALLOCATOR_SYSTEM
    if not args.system_malloc:
        if memory.reuse_freed_memory():
            allocator = memory.ALLOCATOR_REUSE
        else:
            print("dualop bench: the C library is not glibc; running on the system allocator "
                  "(preload tcmalloc or jemalloc for numbers not bound by page faults)", file=sys.stderr)
    frontends = _available_frontends(requested)
    if not frontends:
        print(f"dualop bench: none of the frontends {', '.join(requested)} can be imported here", file=sys.stderr)
        return 2
    if args.threads is not None:  # torch's intra-op threads, which dualop's C++ CPU kernels use too
        import torch

        torch.set_num_threads(args.threads)
    if args.model is not None:
        return _bench_model(args, frontends, dtypes)
    if args.decode is not None:
        return _bench_decode(args, frontends, dtypes, batches)

    records: list[dict[str, Any]] = []
    if not args.dispatch_only:
        records += throughput.run_throughput(
            cases, shapes, dtypes, frontends, impls=impls, rounds=args.rounds, warmup=args.warmup,
            allocator=allocator, progress=not args.no_progress, device=args.device,
        )
    if not args.no_dispatch:
        records += _bench_dispatch(frontends, args.rounds, not args.no_progress)
    if args.threads is not None:
        for rec in records:
            rec["threads"] = args.threads
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=2)
    if args.plot:
        from dualop.bench.plot import plot_throughput

        plot_throughput(records, args.plot)
    from dualop.bench import format_dispatch, format_throughput

    parts = [] if args.dispatch_only else [format_throughput(records)]
    dispatch = [r for r in records if r.get("op") == "dispatch"]
    if dispatch:
        parts.append(format_dispatch(dispatch))
    if args.threads is not None:
        parts.append(f"threads: {args.threads} (torch.set_num_threads, for every implementation)")
    print("\n\n".join(parts))
    return 0


def _bench_model(args: argparse.Namespace, frontends: list[str], dtypes: list[str]) -> int:
    """``dualop bench --model [PATH]``: a whole model's prefill and decode steps against transformers."""
    from dualop.bench.model import bench_model, format_model_bench

    records = []
    for dtype in dtypes:
        records += bench_model(None if args.model == "tiny-llama" else args.model,
                               tuple(f for f in frontends if f in ("torch", "jax")), dtype, batch=args.batch,
                               rounds=args.rounds, warmup=args.warmup, progress=not args.no_progress)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=2)
    print(format_model_bench(records))
    return 0


def _bench_decode(args: argparse.Namespace, frontends: list[str], dtypes: list[str], batches: tuple[int, ...]) -> int:
    """``dualop bench --decode PATH [PATH ...]``: the decode step of each checkpoint against the first."""
    from dualop.bench.model import bench_decode, format_decode_bench

    frontend = frontends[0] if args.frontends else "torch"
    dtype = dtypes[0] if args.dtypes else "bfloat16"
    records = bench_decode(args.decode, frontend, dtype, batches, rounds=args.rounds, warmup=args.warmup,
                           progress=not args.no_progress)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=2)
    print(format_decode_bench(records))
    return 0


def _bench_dispatch(frontends: list[str], rounds: int, progress: bool) -> list[dict[str, Any]]:
    """Dispatch-overhead records for the frontends it measures (torch, jax)."""
    from dualop import bench

    return bench.dispatch_overhead(frontends=[f for f in frontends if f in ("torch", "jax")], rounds=rounds,
                                   progress=progress)


def cmd_generate(args: argparse.Namespace) -> int:
    """Greedy generation from a local checkpoint with a model built from dualop ops: the tokens,
    the time of each step, and which method each op ran (the dispatch report)."""
    import contextlib
    import time

    from dualop import models
    from dualop.custom_op import clear_dispatch_report, dispatch_report

    prompts = []
    for text in args.prompt or ["1 2 3"]:
        try:
            prompts.append([int(t) for t in text.replace(",", " ").split()])
        except ValueError:
            print(f"dualop generate: --prompt {text!r} must be token ids separated by spaces (no tokenizer here)",
                  file=sys.stderr)
            return 2
    # Before loading anything: a prompt the cache cannot hold, named by the flags that size it.
    serving = models.ServingConfig(args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    for i, prompt in enumerate(prompts):
        overflow = serving.prompt_overflow(len(prompt), args.max_new_tokens, ("--max-new-tokens", "--max-model-len"))
        if overflow:
            raise ValueError(f"--prompt {i} {overflow}; pass a larger --max-model-len")
    clear_dispatch_report()
    platform = contextlib.nullcontext()
    if args.platform:
        from dualop.platforms import override_platform

        platform = override_platform(args.platform)
    with platform:
        start = time.perf_counter()
        model = models.from_pretrained(args.path, frontend=args.frontend, dtype=args.dtype, tp=args.tp,
                                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                       max_num_batched_tokens=args.max_num_batched_tokens)
        loaded = time.perf_counter() - start
        outputs = model.generate(prompts, args.max_new_tokens, stop_at_eos=not args.ignore_eos)
    steps = model.last_step_stats
    report = [r for r in dispatch_report() if r["frontend"] in ("torch", "jax")]
    if args.json:
        print(json.dumps({"model": repr(model), "load_seconds": loaded, "outputs": outputs,
                          "steps": [vars(s) for s in steps], "dispatch": report}, indent=2, default=str))
        return 0
    print(f"{_model_line(model)}: loaded in {loaded:.2f} s")
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        print(f"prompt {i}: {' '.join(map(str, prompt))}\n  -> {' '.join(map(str, out))}")
    rows = [{"step": i, "tokens": s.tokens, "prefill": s.prefill_tokens, "sequences": s.sequences,
             "ms": f"{s.seconds * 1e3:.2f}"} for i, s in enumerate(steps)]
    print("\nsteps (the first of each shape includes compiling it):" if args.frontend == "jax" else "\nsteps:")
    print(_table(rows, ["step", "tokens", "prefill", "sequences", "ms"]))
    decode = [s.seconds for s in steps if s.prefill_tokens == 0]
    if decode:
        print(f"decode steps: median {sorted(decode)[len(decode) // 2] * 1e3:.2f} ms")
    print("\nwhich method each op ran:")
    print(_table([{k: r[k] for k in ("op", "cls", "frontend", "platform", "method", "reason")} for r in report],
                 ["op", "cls", "frontend", "platform", "method", "reason"]))
    return 0


def _model_line(model: Any) -> str:
    """The model as ``dualop generate`` introduces it: its class (and the checkpoint's architecture
    where that is another name), frontend, dtype, tensor-parallel size and parameter count."""
    name = type(model).__name__
    arch = model.architectures[0]
    built = name if arch == name else f"{arch} (as {name})"
    return (f"model {built}, frontend {model.frontend.name}, {model.dtype}, tp {model.frontend.tp_size}, "
            f"{len(model.params)} parameter tensors")


def _positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (argparse names the flag when it refuses one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualop",
        description="dualop: one op definition for PyTorch and JAX, Pallas kernels on TPU, Triton on CUDA/ROCm.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ops", help="list registered ops and the platform methods each implements")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--markdown", action="store_true",
                   help="print the documentation's op reference page (docs/reference.md): constructors, calls, "
                        "what each platform runs and why, tolerances, cases")
    s.set_defaults(fn=cmd_ops)

    s = sub.add_parser("report", help="which method each op case runs per frontend, whether a kernel, and why")
    s.add_argument("--ops", help="comma-separated registered op names (default: all)")
    s.add_argument("--frontends", help="comma-separated: torch, jax, torch_xla, torchax (default: all importable)")
    s.add_argument("--no-run", action="store_true", help="only resolve; do not call each op on a tiny input")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_report)

    s = sub.add_parser("check", help="run every op through every reachable implementation against forward_native")
    s.add_argument("--ops", help="comma-separated registered op names (default: all)")
    s.add_argument("--frontends", help="comma-separated: torch, jax, torch_xla, torchax (default: all importable)")
    s.add_argument("--platforms", help="comma-separated: cpu, cuda, rocm, tpu (default: all)")
    s.add_argument("--dtypes", help="comma-separated: float32, bfloat16, float16 (default: float32,bfloat16)")
    s.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    s.add_argument("--json", action="store_true", help="print results as JSON instead of the table")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--fuzz", action="store_true",
                   help="instead of the matrix: the derandomised mutation sweep (dualop.fuzz, docs/FUZZ.md) on "
                        "each path in watched subprocesses; exit 1 if any case crashes, errs unclearly, is wrong "
                        "or gives NaN where forward_native is finite")
    s.add_argument("--paths", help="with --fuzz: comma-separated: torch-cpu, jax-cpu, triton, pallas (default: all)")
    s.add_argument("--budget", "--fuzz-budget", "--fuzz-cases", dest="fuzz_budget", type=int, metavar="N",
                   help="with --fuzz: at most N cases per path, spread evenly over ops (default: every case)")
    s.add_argument("--draws", type=int, default=1, help="with --fuzz: draws per mutation family and op case (default 1)")
    s.add_argument("--jobs", type=int, help="with --fuzz: paths run at once (default: one per CPU, at most 4)")
    s.add_argument("--case-timeout", type=float, default=180.0,
                   help="with --fuzz: seconds one case may take before its worker is killed (default 180)")
    s.add_argument("--item", action="append", metavar="LABEL/FAMILY#INDEX",
                   help="with --fuzz: run only this case (repeatable), e.g. 'rms_norm[weight]/nonfinite.nan#0'")
    s.add_argument("--quick", action="store_true",
                   help="each case's first shape only, and a tiny model's greedy tokens on the kernel paths "
                        "against transformers' (scripts/check.sh's default; minutes instead of an hour)")
    s.add_argument("--list", action="store_true", help="instead of running: print the sorted set of what would run, one line each (compare two versions byte for byte)")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser(
        "compile",
        help="compile every kernel variant for real TPUs and GPUs (no device needed); runs nothing",
        description="Build every kernel variant dualop check runs, plus serving shapes, with XLA:TPU/Mosaic "
                    "(libtpu's compile-only devices) and Triton (PTX/cubin, AMDGCN/hsaco). Prints a matrix "
                    "op case x target: ok / refused (the compiler's message) / n/a (why); on TPU topology "
                    "targets, each sharded layer's collectives (count, bytes per device). Exit 1 if any "
                    "build is refused, 2 if a compiler is unavailable here.",
    )
    s.add_argument("--ops", help="comma-separated registered op names (default: all)")
    s.add_argument("--targets", help="comma-separated: v4, v5e, v5p, v6e, tpu7x, sm80, sm89, sm90, sm100, gfx942, "
                                     "gfx950 (default: v4,v5e,v5p,v6e,tpu7x,sm80,sm90,gfx942); a TPU topology "
                                     "such as v5e:2x2 or v6e:2x4 builds the sharded layers on all its chips")
    s.add_argument("--model", metavar="NAMES",
                   help="instead of the kernels: whole models' JAX serving steps (llama3-8b, qwen3-30b-a3b or all) "
                        "on multi-chip slices (default v5e:2x2 at tp 4 and v6e:2x4 at tp 8; --targets takes "
                        "topologies), with per-chip memory against HBM and the collectives per step")
    s.add_argument("--layers", type=int, help="with --model: build this many layers of the model's width")
    s.add_argument("--sharded-serving", action="store_true",
                   help="on topology targets, also build the sharded layers at model sizes (minutes)")
    s.add_argument("--dtypes", help="comma-separated: float32, bfloat16, float16 (default: float32,bfloat16)")
    s.add_argument("--serving-dtypes", help="comma-separated: build the serving shapes in these dtypes only (default: "
                                            "all of --dtypes; the check shapes are built in every one)")
    s.add_argument("--serving-targets", help="comma-separated, among --targets: build the serving shapes for these "
                                             "targets only (default: every target; the check shapes are built for all)")
    s.add_argument("--json", action="store_true", help="print one JSON record per (variant, target) instead of tables")
    s.add_argument("--no-details", action="store_true", help="only the matrix, not the per-kernel table")
    s.add_argument("--list", action="store_true", help="instead of running: print the sorted set of what would run, one line each (compare two versions byte for byte)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser(
        "bench",
        help="throughput against torch/jax peers with the copy roofline, and dispatch overhead",
        description="Time each op's implementations and the peers a user would pick instead, interleaved, "
                    "against the copy bandwidth measured in the same rounds; then dispatch overhead. "
                    "--roofline-only: predicted times on an accelerator from the kernels' cost models.",
    )
    s.add_argument("--ops", help="comma-separated case labels or op names (default: "
                                 "rms_norm, rms_norm[residual], gemma_rms_norm, silu_and_mul, gelu_and_mul; "
                                 "also mul_and_silu, gelu_tanh_and_mul, gelu_new, quick_gelu, relu2; the "
                                 "written forms against the engine's kernels by label: rms_norm[out], "
                                 "rms_norm[in_place], silu_and_mul[out], rotary_embedding[in_place])")
    s.add_argument("--sizes", help="comma-separated: small (4096x4096), large (16384x4096) or ROWSxCOLS, the "
                                   "shape of x (default: small,large)")
    s.add_argument("--dtypes", help="comma-separated: float32, bfloat16, float16 (default: float32,bfloat16)")
    s.add_argument("--frontends", help="comma-separated: torch, jax (default: both where importable)")
    s.add_argument("--impls", help="comma-separated: dualop-default, dualop-native, torch-eager, torch-compile, "
                                   "torch-builtin, vllm-kernel (where vLLM is installed), jax-handwritten (default: all)")
    s.add_argument("--rounds", type=int, default=7, help="timed interleaved rounds (default 7; rounded up to whole cycles of balanced orders)")
    s.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    s.add_argument("--json", metavar="FILE", help="also write the records as JSON to FILE")
    s.add_argument("--plot", metavar="FILE.png", help="draw GB/s per case and implementation against the copy "
                                                      "roofline (needs matplotlib: dualop[bench])")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--system-malloc", action="store_true",
                   help="keep the C allocator's defaults (page faults on every fresh output) instead of "
                        "making glibc reuse freed memory")
    s.add_argument("--model", nargs="?", const="tiny-llama", metavar="PATH",
                   help="time a whole model's prefill and decode steps, dualop (both frontends) against "
                        "transformers' forward: PATH a local checkpoint (default: a tiny random Llama)")
    s.add_argument("--batch", type=int, default=8, help="with --model: sequences per step (default 8)")
    s.add_argument("--decode", nargs="+", metavar="PATH",
                   help="time the decode step of these checkpoints of one model against the first (a float "
                        "checkpoint, then its quantized forms), interleaved; one frontend (--frontends, default "
                        "torch) and dtype (--dtypes, default bfloat16)")
    s.add_argument("--batches", default="1,4,8", help="with --decode: comma-separated sequences per step "
                                                      "(default 1,4,8)")
    s.add_argument("--threads", type=int, help="torch's CPU threads (torch.set_num_threads; dualop's C++ CPU kernels "
                                               "and vLLM's use them too) for the whole run (default: torch's own)")
    s.add_argument("--device", help="tpu-v5e, tpu-v6e or h100: with --roofline-only, the device to predict "
                                    "for (default: all); when timing, add its predicted time to each record")
    s.add_argument("--list", action="store_true", help="instead of running: print the sorted set of what would run, one line each (compare two versions byte for byte)")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--roofline-only", action="store_true",
                      help="no timing: print each case's bytes, flops and predicted time on --device")
    mode.add_argument("--no-dispatch", action="store_true", help="skip the dispatch-overhead measurement")
    mode.add_argument("--dispatch-only", action="store_true", help="only the dispatch-overhead measurement")
    s.set_defaults(fn=cmd_bench)

    s = sub.add_parser(
        "generate",
        help="greedy generation from a local transformers checkpoint with a model built from dualop ops",
        description="Load PATH (config.json + safetensors) with dualop.models.from_pretrained, generate greedily "
                    "for each --prompt (token ids; no tokenizer), and print the tokens, the time of each step and "
                    "which method each op ran.",
    )
    s.add_argument("path", help="a local checkpoint directory (e.g. one written by transformers' save_pretrained)")
    s.add_argument("--frontend", default="torch", choices=["torch", "jax"], help="default torch")
    s.add_argument("--prompt", action="append", help='token ids, e.g. "1 2 3" (repeat for a batch; default "1 2 3")')
    s.add_argument("--max-new-tokens", type=_positive_int, default=16, help="default 16")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    s.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (jax: a mesh over host devices)")
    s.add_argument("--platform", choices=["cpu", "cuda", "rocm", "tpu"],
                   help="take this platform's path (kernels in interpreters on a CPU host)")
    s.add_argument("--max-model-len", type=_positive_int, default=512, help="tokens per sequence in the KV cache (default 512)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=8, help="sequences batched at once (default 8)")
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=256, help="tokens per step (default 256)")
    s.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(fn=cmd_generate)
    return p


def _interpret_triton_without_gpu() -> None:
    """Turn Triton's interpreter on before anything imports triton when no GPU driver tool is
    visible: ``import torch`` can import triton itself (torch_tpu's device-backend autoload does),
    and Triton decides interpreter or compiler when its functions are defined."""
    import os
    import shutil

    if "TRITON_INTERPRET" not in os.environ and not (shutil.which("nvidia-smi") or shutil.which("rocm-smi")):
        os.environ["TRITON_INTERPRET"] = "1"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dualop.platforms import keep_tpu_runtimes_off_without_tpu

    keep_tpu_runtimes_off_without_tpu()
    if args.command != "compile":  # compile runs no Triton here; it builds for GPUs in a child
        _interpret_triton_without_gpu()
    from dualop.config import get_config

    try:
        get_config()  # a bad DUALOP_* variable is reported before any work, as the command's error
        return args.fn(args)
    except (ValueError, TypeError) as err:
        if not _raised_by_dualop(err):
            raise  # a bug, not a refusal: its traceback is the report
        print(_error_line(args.command, err), file=sys.stderr)
        return 2


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_by_dualop(err: BaseException) -> bool:
    """Whether ``err`` is one of dualop's own refusals: raised by a ``raise`` statement in dualop's
    code (an argument, option or environment variable it refuses, with a message written for the
    user), not by Python or a library deep inside a call (a bug, whose traceback matters)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    if not os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
        return False
    return linecache.getline(filename, tb.tb_lineno).lstrip().startswith("raise")


def _error_line(command: str, err: BaseException) -> str:
    """``dualop <command>: <message>``; a message that already names a dualop command keeps its own."""
    message = str(err)
    return message if message.startswith(f"dualop {command}") else f"dualop {command}: {message}"


if __name__ == "__main__":
    sys.exit(main())
