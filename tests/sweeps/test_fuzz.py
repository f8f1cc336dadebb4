"""The fuzz sweep (``dualop check --fuzz``, dualop/fuzz.py): a fixed derandomised draw on all four
paths must hold no crash, unclear error, wrong result or NaN where forward_native is finite; and
the harness itself must tell those apart (fake ops that crash, hang, answer wrong, err unclearly),
so it cannot pass by classifying everything as fine."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dualop import fuzz, testing
from dualop.custom_op import CustomOp

THIS_FILE = str(Path(__file__).resolve())
# The CI draw: cases per path, spread evenly over the ops (docs/FUZZ.md has its size and time).
CI_BUDGET = 64
CI_SEED = 0


# --- fake ops the harness must classify ---------------------------------------------------------


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("torch.")


class FakeOp(CustomOp):
    """x * 2 natively; its CPU 'kernel' misbehaves as ``mode`` says (unregistered: enforce_enable)."""

    def __init__(self, mode: str) -> None:
        super().__init__(enforce_enable=True)
        self.mode = mode

    def check_inputs(self, x) -> None:
        if self.mode != "accepts_ints" and _dtype(x) not in ("float32", "bfloat16", "float16"):
            raise TypeError(f"fuzz_fake: argument 'x' has dtype {_dtype(x)}")

    def forward_native(self, x):
        if _dtype(x).startswith("int"):
            raise ValueError("fuzz_fake: the reference takes no int arrays")
        return x * 2

    def forward_cpu(self, x):
        if self.mode == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.mode == "hang":
            time.sleep(3600)
        if self.mode == "wrong":
            return x * 2 + 1
        if self.mode == "nan":
            y = x * 2
            y.reshape(-1)[0] = float("nan")
            return y
        if self.mode == "neg_inf":
            y = x * 2
            y.reshape(-1)[0] = -float("inf")
            return y
        if self.mode == "index_error":
            raise IndexError("index 7 is out of bounds for dimension 0 with size 2")
        if self.mode == "unnamed_value_error":
            raise ValueError("bad input")
        if self.mode == "dtype":
            return (x * 2).double()
        return x * 2


class FakeCacheOp(CustomOp):
    """Writes ``x`` into ``cache`` in place; its 'kernel' refuses after writing (or writes wrong)."""

    def __init__(self, mode: str) -> None:
        super().__init__(enforce_enable=True)
        self.mode = mode

    def forward_native(self, x, cache):
        cache[: x.shape[0]] = x
        return cache

    def forward_cpu(self, x, cache):
        cache[0] = 99.0
        if self.mode == "refuse_after_write":
            raise ValueError("fuzz_fake_cache: argument 'x' refused")
        return cache  # wrong: only row 0 written, with 99


def _case(op_cls, mode: str, shape=(2, 8)) -> testing.OpCase:
    if op_cls is FakeCacheOp:
        def make(shape, rng):
            return testing.normal(shape, rng), testing.normal((shape[0] + 2, shape[1]), rng)
        return testing.OpCase("fuzz_fake_cache", f"fuzz_fake_cache[{mode}]", lambda s: FakeCacheOp(mode), make,
                              (shape,))
    return testing.OpCase("fuzz_fake", f"fuzz_fake[{mode}]", lambda s: FakeOp(mode), testing.x_only(1.0), (shape,))


def fake_cases() -> list[testing.OpCase]:
    """The provider the subprocess tests hand to the workers (``THIS_FILE:fake_cases``)."""
    modes = ("ok", "segfault", "hang", "wrong", "nan", "neg_inf", "index_error", "unnamed_value_error", "dtype",
             "accepts_ints")
    return [_case(FakeOp, m) for m in modes] + [_case(FakeCacheOp, m) for m in ("refuse_after_write", "wrong")]


def _run(mode: str, family: str = "dtype.float32", op_cls=FakeOp) -> fuzz.FuzzResult:
    case = _case(op_cls, mode)
    mutation = fuzz.make_mutation(case, family, 0)
    return fuzz.run_item(case, mutation, "torch-cpu")


# --- the classifier ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode, family, expected", [
    ("ok", "dtype.float32", "correct"),
    ("ok", "nonfinite.nan", "correct"),
    ("ok", "dtype.int_for_float", "refused"),
    ("wrong", "dtype.float32", "wrong"),
    ("nan", "dtype.float32", "nan_where_native_finite"),
    ("neg_inf", "dtype.float32", "wrong"),
    ("index_error", "dtype.float32", "unclear_error"),
    ("unnamed_value_error", "dtype.float32", "unclear_error"),
    ("dtype", "dtype.float32", "wrong"),
    ("accepts_ints", "dtype.int_for_float", "wrong"),  # returns where forward_native refuses
])
def test_fake_ops_are_classified(mode, family, expected):
    result = _run(mode, family)
    assert result.cls == expected, result


def test_a_refusal_that_changed_a_cache_is_wrong():
    result = _run("refuse_after_write", op_cls=FakeCacheOp)
    assert result.cls == "wrong" and "in place" in result.detail, result


def test_in_place_results_are_compared():
    result = _run("wrong", op_cls=FakeCacheOp)
    assert result.cls == "wrong", result


def _arr(values, dtype="float32"):
    return np.asarray(values, np.float32), dtype


@pytest.mark.parametrize("got, want, expected", [
    ([1.0, np.nan], [1.0, np.nan], "correct"),
    ([1.0, np.inf], [1.0, np.inf], "correct"),
    ([1.0, -np.inf], [1.0, np.inf], "wrong"),
    ([1.0, 5.0], [1.0, np.inf], "wrong"),
    ([np.nan, 2.0], [1.0, 2.0], "nan_where_native_finite"),
    ([1.0, 2.0], [np.nan, 2.0], "wrong"),
    ([1.0, 2.0 + 1e-6], [1.0, 2.0], "correct"),
    ([1.0, 2.01], [1.0, 2.0], "wrong"),
])
def test_classify_values(got, want, expected):
    kernel = fuzz.Outcome(outputs=[_arr(got)])
    native = fuzz.Outcome(outputs=[_arr(want)])
    assert fuzz.classify(kernel, native, {"op"})[0] == expected


def test_classify_errors():
    named, unnamed = ValueError("op: argument 'x' bad"), ValueError("argument 'x' bad")
    ok = fuzz.Outcome(outputs=[_arr([1.0])])
    assert fuzz.classify(fuzz.Outcome(error=named), fuzz.Outcome(error=named), {"op"})[0] == "refused"
    assert fuzz.classify(fuzz.Outcome(error=TypeError("op: no")), ok, {"op"})[0] == "refused"
    assert fuzz.classify(fuzz.Outcome(error=unnamed), fuzz.Outcome(error=named), {"op"})[0] == "unclear_error"
    assert fuzz.classify(fuzz.Outcome(error=RuntimeError("op: no")), ok, {"op"})[0] == "unclear_error"
    assert fuzz.classify(fuzz.Outcome(error=ValueError("other_op: no")), ok, {"op"})[0] == "unclear_error"
    assert fuzz.classify(ok, fuzz.Outcome(error=named), {"op"})[0] == "wrong"
    assert fuzz.classify(ok, fuzz.Outcome(error=KeyError("k")), {"op"})[0] == "unclear_error"
    changed = fuzz.Outcome(error=named, changed=["cache"])
    assert fuzz.classify(changed, fuzz.Outcome(error=named), {"op"})[0] == "wrong"
    assert fuzz.classify(ok, fuzz.Outcome(outputs=[_arr([1.0]), None]), {"op"})[0] == "wrong"
    assert fuzz.classify(ok, fuzz.Outcome(outputs=[_arr([1.0], "bfloat16")]), {"op"})[0] == "wrong"


# --- the derandomised draw --------------------------------------------------------------------


def test_the_draw_repeats_and_spreads_over_ops():
    cases = [c for c in testing.cases_for(None) if c.op in ("rms_norm", "reshape_and_cache", "causal_conv1d")]
    first, again = fuzz.plan(cases, seed=3), fuzz.plan(cases, seed=3)
    assert first == again
    drawn = fuzz.draw(first["torch-cpu"], 6, seed=3)
    assert drawn == fuzz.draw(again["torch-cpu"], 6, seed=3)
    assert sorted(it.op for it in drawn) == sorted(["rms_norm", "reshape_and_cache", "causal_conv1d"] * 2)
    assert len({it.family for it in drawn}) == 6  # each op's draws take distinct families first
    case = cases[0]
    a, b = fuzz.make_mutation(case, "nonfinite.nan", 0, 3), fuzz.make_mutation(case, "nonfinite.nan", 0, 3)
    assert a.what == b.what and all(np.array_equal(x.values, y.values, equal_nan=True)
                                    for x, y in zip(a.args, b.args) if isinstance(x, fuzz.Spec))
    c = fuzz.make_mutation(case, "nonfinite.nan", 0, 4)
    assert not all(np.array_equal(x.values, y.values, equal_nan=True)
                   for x, y in zip(a.args, c.args) if isinstance(x, fuzz.Spec))


def test_layouts_keep_values_and_break_contiguity():
    import torch

    case = next(c for c in testing.cases_for(["causal_conv1d"]))
    for family in ("layout.transposed", "layout.strided", "layout.meta_column"):
        m = fuzz.make_mutation(case, family, 0)
        views = fuzz.materialize(m, "torch")
        plain = fuzz.materialize(dataclasses_replace_layouts(m), "torch")
        changed = [i for i, a in enumerate(m.args) if isinstance(a, fuzz.Spec) and a.layout]
        assert len(changed) == 1, family
        i = changed[0]
        assert not views[i].is_contiguous() and torch.equal(views[i], plain[i]), family


def dataclasses_replace_layouts(m: fuzz.Mutation) -> fuzz.Mutation:
    import dataclasses

    return dataclasses.replace(m, args=[dataclasses.replace(a, layout="") if isinstance(a, fuzz.Spec) else a
                                        for a in m.args])


# --- the watched subprocesses -----------------------------------------------------------------


def test_a_segfault_or_a_hang_costs_one_case_and_the_sweep_goes_on():
    only = [(f"fuzz_fake[{m}]", "dtype.float32", 0) for m in ("ok", "segfault", "wrong", "hang", "index_error")]
    only.append(("fuzz_fake[ok]", "nonfinite.nan", 0))
    results = fuzz.run_fuzz(paths=["torch-cpu"], provider=f"{THIS_FILE}:fake_cases", only=only, progress=False,
                            case_timeout=10, startup_timeout=240)
    got = {(r.case, r.family): r for r in results}
    assert len(results) == len(only), results
    assert got[("fuzz_fake[ok]", "dtype.float32")].cls == "correct"
    segv = got[("fuzz_fake[segfault]", "dtype.float32")]
    assert segv.cls == "crash" and "SIGSEGV" in segv.detail, segv
    assert got[("fuzz_fake[wrong]", "dtype.float32")].cls == "wrong"
    hang = got[("fuzz_fake[hang]", "dtype.float32")]
    assert hang.cls == "crash" and "hang" in hang.detail, hang
    assert got[("fuzz_fake[index_error]", "dtype.float32")].cls == "unclear_error"
    assert got[("fuzz_fake[ok]", "nonfinite.nan")].cls == "correct"  # after the hang, in a fresh worker
    assert fuzz.failed(results)


# --- the CI draw ------------------------------------------------------------------------------


def test_ci_draw_has_no_failures():
    """CI_BUDGET cases per path (torch CPU, jax CPU, Triton interpreted, Pallas in TPU interpret
    mode), the same draw on every run; the report lists each failing case with its mutation."""
    results = fuzz.run_fuzz(budget=CI_BUDGET, seed=CI_SEED, progress=False)
    report = fuzz.format_report(results)
    print(report)
    counts = fuzz.summary(results)["total"]
    assert counts["skipped"] == 0, report
    assert len(results) == CI_BUDGET * len(fuzz.PATHS), report
    assert not fuzz.failed(results), report


@pytest.mark.parametrize("got, want, ok", [
    ([1.0, np.inf], [1.0, np.inf], True),
    ([1.0, 5.0], [1.0, np.inf], False),  # the bound atol + rtol * |want| is infinite there
    ([1.0, -np.inf], [1.0, np.inf], False),
    ([1.0, np.inf], [1.0, 5.0], False),
    ([1.0, np.nan], [1.0, np.inf], False),
])
def test_compare_matches_infinities_exactly(got, want, ok):
    """``testing.compare`` (every kernel-against-native check) holds an infinite reference to the
    same infinity, not to an infinite tolerance."""
    assert testing.compare(*(np.asarray(v, np.float32) for v in (got, want)), "float32").ok is ok
