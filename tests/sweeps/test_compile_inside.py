"""An op built inside the function ``torch.compile`` traces: every op case builds there under
``fullgraph=True``, its graph calls the op's custom op (or none with ``custom_ops=none``) and the
result matches an op built and called eagerly; the build runs in plain Python (whatever the
constructor does), takes a size read from a dynamic shape, traces once, and reports a bad argument
as the op does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dualop import OpsConfig, set_config, testing

import torch  # noqa: E402  (both test environments have torch)

CASES = list(testing.cases_for(None))
REPRESENTATIVE = ("rms_norm[weight,residual]", "silu_and_mul", "quant_fp8[dynamic,group128]", "mamba_mixer2",
                  "rotary_embedding[yarn]")  # rope: its cos/sin cache made inside the trace


def _inputs(case, shape):
    rng = np.random.default_rng(0)
    return tuple(testing.to_frontend(a, "torch", "float32") for a in case.make_inputs(shape, rng))


def _compile(fn, backend="eager"):
    """``fn`` compiled with fullgraph=True, and the FX graphs its traces hand to ``backend``."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return torch.compile(fn, backend=record, fullgraph=True), graphs


def _dualop_ops(graphs) -> list[str]:
    """The dualop custom ops the graphs call, by op name (a target prints as ``dualop.<name>[.overload]``)."""
    return [str(node.target).split(".")[1] for gm in graphs for node in gm.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("dualop.")]


def _assert_same(got, want):
    got, want = (list(v) if isinstance(v, (tuple, list)) else [v] for v in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g is None or w is None:  # an output that is None when an optional input is (rope's key)
            assert g is None and w is None
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=0, rtol=0)


def _built_inside_matches_eager(case, custom_ops):
    shape = next(s for s in case.shapes if s[0] > 0)
    torch._dynamo.reset()
    with set_config(OpsConfig(custom_ops)):
        want = case.make_op(shape)(*_inputs(case, shape), **case.options)
        compiled, graphs = _compile(lambda *a: case.make_op(shape)(*a, **case.options))
        got = compiled(*_inputs(case, shape))
    _assert_same(got, want)
    return _dualop_ops(graphs)


@pytest.mark.parametrize("case", [c for c in CASES if "untyped_inputs" not in c.traits], ids=lambda c: c.label)
def test_every_op_case_built_inside_compiles_fullgraph_to_its_custom_op(case):
    """With every op enabled the graph holds the op opaque: the same custom op, with the same
    constructor spec, as an op built outside the compiled function."""
    assert _built_inside_matches_eager(case, ["all"]) == [case.op]


@pytest.mark.parametrize("case", [c for c in CASES if "untyped_inputs" in c.traits], ids=lambda c: c.label)
def test_an_input_no_schema_types_is_refused_at_trace_time(case):
    """A call whose input torch.library cannot type (a quantized weight) is never traced through
    forward_native in silence: the trace fails, naming the argument and its type."""
    shape = next(s for s in case.shapes if s[0] > 0)
    torch._dynamo.reset()
    with set_config(OpsConfig(["all"])):
        compiled, _ = _compile(lambda *a: case.make_op(shape)(*a, **case.options))
        with pytest.raises(Exception, match=r"argument 'weight' must be a torch.Tensor.*got QuantizedWeight"):
            compiled(*_inputs(case, shape))


@pytest.mark.parametrize("label", REPRESENTATIVE)
def test_built_inside_and_disabled_traces_forward_native(label):
    case = next(c for c in CASES if c.label == label)
    assert _built_inside_matches_eager(case, ["none"]) == []


@pytest.mark.each_env
@pytest.mark.parametrize("custom_ops", [["all"], ["none"]])
def test_the_rms_norm_example_compiles_through_aot_autograd(custom_ops):
    """``RMSNorm(4096)(x, w)`` inside the compiled function, through AOTAutograd (the fake kernel
    rebuilds the op from its spec), in both torch versions."""
    from dualop.ops import RMSNorm

    x, w = torch.randn(3, 4096), torch.randn(4096)
    torch._dynamo.reset()
    with set_config(OpsConfig(custom_ops)):
        compiled, graphs = _compile(lambda x: RMSNorm(4096)(x, w), backend="aot_eager")
        got = compiled(x)
        want = RMSNorm(4096)(x, w)
    torch.testing.assert_close(got, want)
    assert _dualop_ops(graphs) == (["rms_norm"] if custom_ops == ["all"] else [])


def test_an_op_built_inside_traces_once_and_leaves_other_graphs_alone():
    """A second call reuses the graph; building another op in another compiled function does not
    invalidate the first's guards."""
    from dualop.ops import RMSNorm, SiluAndMul

    x, w = torch.randn(3, 64), torch.randn(64)
    torch._dynamo.reset()
    with set_config(OpsConfig(["all"])):
        norm, norm_graphs = _compile(lambda x: RMSNorm(64)(x, w))
        act, act_graphs = _compile(lambda x: SiluAndMul()(x))
        first, gated = norm(x), act(x)
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.testing.assert_close(norm(x), first)
            torch.testing.assert_close(act(x), gated)
    assert len(norm_graphs) == len(act_graphs) == 1


def test_a_size_read_from_a_dynamic_shape_builds_the_op_for_that_size():
    """Under ``dynamic=True`` ``x.shape[-1]`` is symbolic: the op is built for its value in the
    trace, and another hidden size traces again."""
    from dualop.ops import RMSNorm

    w = torch.randn(64)
    torch._dynamo.reset()
    with set_config(OpsConfig(["all"])):
        compiled = torch.compile(lambda x: RMSNorm(x.shape[-1])(x, w[: x.shape[-1]]), fullgraph=True,
                                 backend="eager", dynamic=True)
        for hidden in (64, 32):
            x = torch.randn(5, hidden)
            torch.testing.assert_close(compiled(x), RMSNorm(hidden)(x, w[:hidden]))


@pytest.mark.each_env
def test_a_bad_constructor_argument_inside_fails_the_trace_with_the_ops_error():
    from dualop.ops import RMSNorm

    torch._dynamo.reset()
    # Dynamo reports an exception raised by plain Python it called as its own error, with the
    # original type and message first.
    with pytest.raises(Exception, match=r"ValueError: rms_norm: hidden_size must be a positive int, got -1"):
        torch.compile(lambda x: RMSNorm(-1)(x), fullgraph=True, backend="eager")(torch.randn(2, 8))


@pytest.mark.each_env
def test_the_first_op_of_a_process_can_be_built_inside_a_compiled_function():
    """The torch support (torch.library definitions) is installed when the first op is built; in a
    fresh process that build may be inside the trace."""
    script = textwrap.dedent("""
        import torch
        from dualop import OpsConfig, set_config
        from dualop.ops import RMSNorm
        x, w = torch.randn(3, 256), torch.randn(256)
        with set_config(OpsConfig(["all"])):
            got = torch.compile(lambda x: RMSNorm(256)(x, w), fullgraph=True, backend="eager")(x)
        want = RMSNorm(256).forward_native(x, w)
        torch.testing.assert_close(got, want)
        print("built inside: ok")
    """)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0 and "built inside: ok" in done.stdout, done.stderr[-3000:]
