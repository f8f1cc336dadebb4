"""torch.library: every op has a typed schema derived from forward_native and a constructor spec
that round-trips; every op case passes opcheck and, when enabled, compiles (fullgraph=True) to its
opaque custom op (checked in the FX graph), and to no custom op with ``custom_ops=none``; models
using the ops compile and match eager; autograd flows through the compiled op."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import numpy as np
import pytest

from dualop import CustomOp, OpsConfig, ctor_spec, set_config, testing

import torch  # noqa: E402  (both test environments have torch: a broken install fails here)

from dualop.backends.torch import library  # noqa: E402

CASES = list(testing.cases_for(None))


def _inputs(case, dtype="float32", seed=0, shape=None):
    shape = shape or next(s for s in case.shapes if s[0] > 0)
    rng = np.random.default_rng(seed)
    args = tuple(testing.to_frontend(a, "torch", dtype) for a in case.make_inputs(shape, rng))
    return case.make_op(shape), args


def _library(name):
    return getattr(torch.ops.dualop, name)


# ---------------------------------------------------------------- schemas


def test_every_registered_op_has_a_library_op_with_its_derived_schema():
    """Defined once torch is in the process and an op is built (or a torch tensor dispatched)."""
    from dualop.ops import SiluAndMul

    SiluAndMul()
    for name, cls in CustomOp.op_registry.items():
        defined = str(_library(name).default._schema)
        assert defined == f"dualop::{name}{library.op_signature(cls).schema}", name


@pytest.mark.parametrize("name, schema", [
    ("silu_and_mul", "(Tensor x, str ctor) -> Tensor"),
    ("xielu", "(Tensor x, Tensor alpha_p, Tensor alpha_n, str ctor) -> Tensor"),
    ("rms_norm_gated", "(Tensor x, Tensor weight, Tensor? z, str ctor) -> Tensor"),
    ("rms_norm", "(Tensor x, Tensor? weight, Tensor? residual, str ctor) -> Tensor[]"),
    ("quant_fp8", "(Tensor x, Tensor? scale, Tensor? scale_ub, str ctor) -> (Tensor, Tensor)"),
    ("reshape_and_cache",
     "(Tensor key, Tensor value, Tensor(a!) kv_pages, Tensor slot_mapping, str kv_cache_dtype, Tensor? k_scale, "
     "Tensor? v_scale, str ctor) -> ()"),
    ("rotary_embedding", "(Tensor positions, Tensor query, Tensor? key, str ctor) -> (Tensor, Tensor?)"),
    ("apply_rotary_emb", "(Tensor x, Tensor cos, Tensor sin, str ctor) -> Tensor"),
    ("dual_chunk_rotary_embedding",
     "(Tensor positions, Tensor query, Tensor key, Tensor? offsets, str ctor) -> (Tensor, Tensor)"),
])
def test_schemas_of_the_in_tree_ops(name, schema):
    assert library.op_signature(CustomOp.op_registry[name]).schema == schema


class _Scaled(CustomOp):
    """A test op whose call takes numbers, a bool, a str and keyword-only arguments (no in-tree op
    does); registered by the tests that need it."""

    def __init__(self, shift: float = 0.0, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.shift = shift

    def forward_native(self, x: Any, alpha: float, repeat: int = 1, negate=False, mode: str = "add",
                       z: Any = None, *, bias: float | None = None) -> tuple[Any, Any]:
        y = x * alpha * repeat + self.shift
        y = -y if negate else y
        if z is not None:
            y = y + z if mode == "add" else y * z
        return y + (0.0 if bias is None else bias), x * 2

    def forward_cpu(self, x, alpha, repeat=1, negate=False, mode="add", z=None, *, bias=None):
        out, twice = self.forward_native(x, alpha, repeat, negate, mode, z, bias=bias)
        return out.clone(), twice.clone()


_SCALED_SCHEMA = ("(Tensor x, float alpha, SymInt repeat, bool negate, str mode, Tensor? z, float? bias, str ctor)"
                  " -> (Tensor, Tensor)")


@pytest.fixture
def scaled_op(clean_registry):
    CustomOp.register("test_library_scaled")(_Scaled)
    library.library_op("test_library_scaled")
    yield _Scaled
    _Scaled.name = None


def test_scalar_parameters_are_typed_by_annotation_or_default(scaled_op):
    assert library.op_signature(scaled_op).schema == _SCALED_SCHEMA
    assert str(torch.ops.dualop.test_library_scaled.default._schema) == "dualop::test_library_scaled" + _SCALED_SCHEMA


def test_scalar_parameters_pass_opcheck_and_compile_to_the_custom_op(scaled_op):
    op = scaled_op(0.25)
    x, z = torch.randn(3, 8), torch.randn(3, 8)
    args = library.library_args(op, (x, 1.5, 2), {"negate": True, "z": z, "bias": -0.5})
    result = torch.library.opcheck(torch.ops.dualop.test_library_scaled.default, tuple(args))
    assert set(result.values()) == {"SUCCESS"}, result
    with set_config(OpsConfig(["all"])):
        graphs, got = _compile_and_record(lambda a, b: op(a, 1.5, 2, True, "mul", b, bias=-0.5), x, z)
    assert _dualop_targets(graphs) == ["test_library_scaled"]
    want = op.forward_native(x, 1.5, 2, True, "mul", z, bias=-0.5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("source, message", [
    ("def forward_native(self, x, n: int | str = 1): return x", "parameter 'n' is annotated"),
    ("def forward_native(self, x, f: list = None): return x", "parameter 'f'"),
    ("def forward_native(self, x) -> list: return x", "return annotation"),
    ("def forward_native(self, *xs): return xs[0]", "no \\*args"),
])
def test_a_signature_without_a_schema_type_is_an_error_naming_the_op(source, message):
    namespace: dict = {"Any": Any}
    exec(source, namespace)
    cls = type("Odd", (CustomOp,), {"forward_native": namespace["forward_native"], "name": "odd_op"})
    with pytest.raises(TypeError, match=f"odd_op: .*{message}"):
        library.op_signature(cls)


# ---------------------------------------------------------------- constructor specs


class _Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


@dataclasses.dataclass(frozen=True)
class _Shape:
    rows: int
    cols: tuple


@pytest.mark.parametrize("value", [
    None, True, 3, -2.5, "per_token", (1, -1), [1, (2, 3)], {"a": 1, 2: (3,)}, _Mode.EXACT,
    _Shape(1, (128, _Mode.FAST)), [float("inf"), float("-inf")], np.float64(0.5), torch.bfloat16,
])
def test_constructor_values_round_trip(value):
    from dualop.ops import QuantFP8

    spec = ctor_spec.encode(QuantFP8, (False,), {"group_shape": value})
    assert ctor_spec.encode(QuantFP8, (False,), {"group_shape": value}) == spec  # stable
    path, args, kwargs = ctor_spec.json.loads(spec)
    decoded = ctor_spec._decode_value(kwargs["group_shape"])
    assert decoded == value and type(decoded) is (float if isinstance(value, float) else type(value))


def test_a_rope_built_with_a_torch_dtype_rebuilds_the_same():
    """The engine builds its ropes with a torch dtype: the op's spec encodes it, so torch.compile
    can make the op opaque."""
    from dualop.ops import RotaryEmbedding

    op = RotaryEmbedding(16, 16, 64, 10000.0, True, torch.bfloat16)
    assert op._ctor_error is None
    rebuilt = ctor_spec.build(op._ctor)
    assert rebuilt.dtype == "bfloat16" and (rebuilt.cos_sin_cache == op.cos_sin_cache).all()


def test_nan_round_trips():
    from dualop.ops import RMSNorm

    spec = ctor_spec.encode(RMSNorm, (8, float("nan")), {})
    assert math.isnan(ctor_spec._decode_value(ctor_spec.json.loads(spec)[1][1]))


def test_group_shape_constant_builds_the_same_op():
    from dualop.ops import QuantFP8
    from dualop.ops.quantization import GroupShape

    op = QuantFP8(False, GroupShape.PER_TOKEN)
    assert op._ctor_error is None
    rebuilt = ctor_spec.build(op._ctor)
    assert type(rebuilt) is QuantFP8 and rebuilt.group_shape == GroupShape.PER_TOKEN and rebuilt.static is False


@pytest.mark.parametrize("value, where", [
    (lambda: 1, "'group_shape'"), ((1, object()), "'group_shape'\\[1\\]"), (_Shape(1, (print,)), "'group_shape'.cols\\[0\\]"),
])
def test_unencodable_constructor_argument_is_named(value, where):
    from dualop.ops import QuantFP8

    with pytest.raises(TypeError, match=f"quant_fp8: constructor argument {where} has no torch.library encoding"):
        ctor_spec.encode(QuantFP8, (False, value), {})


def test_a_class_defined_in_a_function_has_no_spec():
    @dataclasses.dataclass
    class Local:
        size: int = 1

    from dualop.ops import QuantFP8

    with pytest.raises(TypeError, match="'group_shape'.*defined inside a function"):
        ctor_spec.encode(QuantFP8, (False, Local()), {})


# ---------------------------------------------------------------- every op case


TYPED = [c for c in CASES if "untyped_inputs" not in c.traits]


def _typed(op, args, case) -> tuple[tuple, dict]:
    """The call's arguments as the op hands them to its library op (``library_arguments``)."""
    return op.library_arguments(tuple(args), dict(case.options))


@pytest.mark.parametrize("case", [c for c in CASES if "untyped_inputs" in c.traits], ids=lambda c: c.label)
def test_an_input_no_schema_types_is_refused_by_name(case):
    op, args = _inputs(case)
    with pytest.raises(TypeError, match=rf"{op.name}: argument 'weight' must be a torch.Tensor .*got QuantizedWeight"):
        library.library_args(op, args, {})


@pytest.mark.parametrize("dtype, which", [("float32", "first"), ("bfloat16", "first"), ("float32", "last")])
@pytest.mark.parametrize("case", [c for c in TYPED if "fp8_inputs" not in c.traits], ids=lambda c: c.label)
def test_opcheck(case, dtype, which):
    nonempty = [s for s in case.shapes if s[0] > 0]
    op, args = _inputs(case, dtype, shape=nonempty[0] if which == "first" else nonempty[-1])
    result = torch.library.opcheck(_library(op.name).default, tuple(library.library_args(op, *_typed(op, args, case))))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("case", TYPED, ids=lambda c: c.label)
def test_library_op_equals_the_eager_call(case):
    """Each call gets its own inputs, so an op that updates an argument in place
    (``mutates_args``: the library op returns nothing) is compared by that argument."""
    op, args = _inputs(case)
    _, eager_args = _inputs(case)
    got = _library(op.name)(*library.library_args(op, *_typed(op, args, case)))
    want = op(*eager_args, **case.options)
    sig = library.op_signature(type(op))
    mutated = sig.mutated
    if sig.mutated_results:  # outputs and a state updated in place: compare the assembled result
        values = library.library_args(op, *_typed(op, args, case))[:-1]
        got = library.assemble_result(sig, values, got)
    elif mutated:
        assert got is None
        names = [p for p, _ in library.op_signature(type(op)).params]
        got = tuple(args[names.index(p)] for p in mutated)
        assert want is eager_args[names.index(mutated[0])]  # eager torch returns the updated argument
    got, want = (list(v) if isinstance(v, (tuple, list)) else [v] for v in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)


def _compile_and_record(fn, *args, then=None):
    """Compile ``fn`` with fullgraph=True through a backend that records each FX graph, then runs it
    as traced (or hands it to the backend ``then``); return the graphs and the compiled call's result."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward if then is None else torch._dynamo.lookup_backend(then)(gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(fn, backend=record, fullgraph=True)(*args)
    return graphs, out


def _dualop_targets(graphs) -> list[str]:
    """The dualop custom ops the graphs call, by op name."""
    names = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                continue
            packet = getattr(node.target, "overloadpacket", node.target)
            namespace, _, name = packet._qualified_op_name.partition("::")
            if namespace == "dualop":
                names.append(name)
    return names




@pytest.mark.parametrize("case, custom_ops", [
    pytest.param(c, ops, id=f"{c.label}-{ops[0]}") for c in CASES for ops in (["all"], ["none"])
    if ops == ["none"] or "untyped_inputs" not in c.traits])  # enabled with an untyped input: refused, above
def test_compiled_case_is_the_opaque_op_exactly_when_enabled(case, custom_ops):
    op, args = _inputs(case)
    _, eager_args = _inputs(case)  # its own inputs: an in-place op must not compare with itself
    with set_config(OpsConfig(custom_ops)):
        want = op(*eager_args, **case.options)
        graphs, got = _compile_and_record(lambda *a: op(*a, **case.options), *args)
    assert _dualop_targets(graphs) == ([case.op] if custom_ops == ["all"] else [])
    got, want = (list(v) if isinstance(v, (tuple, list)) else [v] for v in (got, want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if g is None or w is None:  # an output that is None when an optional input is (rope's key)
            assert g is None and w is None
        elif g.dtype == torch.float8_e4m3fn:
            torch.testing.assert_close(g.float(), w.float(), atol=0, rtol=0)
        else:
            torch.testing.assert_close(g, w)


def test_quant_fp8_with_a_group_shape_constant_compiles_to_the_custom_op():
    """The issue's example: a dataclass constructor argument (no JSON) is still the opaque op."""
    from dualop.ops import QuantFP8
    from dualop.ops.quantization import GroupShape

    op = QuantFP8(False, GroupShape.PER_TOKEN)
    x = torch.randn(4, 256)
    with set_config(OpsConfig(["all"])):
        graphs, (x_q, scale) = _compile_and_record(lambda a: op(a), x)
    assert _dualop_targets(graphs) == ["quant_fp8"]
    want_q, want_scale = op.forward_native(x)
    assert torch.equal(x_q.float(), want_q.float()) and torch.equal(scale, want_scale)


from dualop.ops import SiluAndMul  # noqa: E402


class _WiderSiluAndMul(SiluAndMul):
    """An unregistered subclass (so named silu_and_mul) whose call takes another argument."""

    def forward_native(self, x: Any, scale: Any) -> Any:
        return super().forward_native(x) * scale


class _Callback(CustomOp):
    """A test op whose constructor takes a function, which no spec can encode."""

    def __init__(self, fn: Any = None, *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        self.fn = fn

    def forward_native(self, x: Any) -> Any:
        return self.fn(x)


def test_an_enabled_op_without_a_spec_fails_the_trace_naming_the_argument(clean_registry):
    CustomOp.register("test_library_callback")(_Callback)
    try:
        op = _Callback(torch.neg)
        x = torch.ones(3)
        with set_config(OpsConfig(["all"])), pytest.raises(RuntimeError, match=(
            "test_library_callback: constructor argument 'fn' has no torch.library encoding")):
            _compile_and_record(lambda a: op(a), x)
        with set_config(OpsConfig(["none"])):  # disabled: traced through forward_native, as Inductor wants
            graphs, out = _compile_and_record(lambda a: op(a), x)
        assert _dualop_targets(graphs) == [] and torch.equal(out, -x)
    finally:
        _Callback.name = None


def test_a_subclass_with_another_signature_fails_the_trace():
    op = _WiderSiluAndMul()
    with set_config(OpsConfig(["all"])), pytest.raises(RuntimeError, match="silu_and_mul: _WiderSiluAndMul.forward_native"):
        _compile_and_record(lambda a, s: op(a, s), torch.ones(2, 8), torch.ones(2, 4))


class _Mislabelled(CustomOp):
    """A test op whose return annotation says one array while it returns two."""

    def forward_native(self, x: Any) -> Any:
        return x + 1, x - 1


def test_a_result_unlike_the_declared_output_is_an_error_naming_the_op(clean_registry):
    CustomOp.register("test_library_mislabelled")(_Mislabelled)
    try:
        library.library_op("test_library_mislabelled")
        with pytest.raises(TypeError, match="test_library_mislabelled: the call returned a tuple of 2 array.*declares Tensor"):
            torch.ops.dualop.test_library_mislabelled(*library.library_args(_Mislabelled(), (torch.ones(2),), {}))
    finally:
        _Mislabelled.name = None


def test_required_argument_of_the_wrong_type_is_named():
    from dualop.ops import XIELU

    op = XIELU()
    with pytest.raises(TypeError, match="xielu: argument 'alpha_p' must be a torch.Tensor"):
        library.library_args(op, (torch.ones(3), 0.5, torch.ones(1)), {})
    with pytest.raises(TypeError, match="xielu: argument 'alpha_n' is required"):
        library.library_args(op, (torch.ones(3), torch.ones(1)), {})


# ---------------------------------------------------------------- models, autograd


class _Block(torch.nn.Module):
    """A transformer-ish block built from dualop ops."""

    def __init__(self, hidden=64):
        super().__init__()
        from dualop.ops import GemmaRMSNorm, RMSNorm, SiluAndMul

        self.norm, self.gemma, self.act = RMSNorm(hidden), GemmaRMSNorm(hidden), SiluAndMul()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, hidden))
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)

    def forward(self, x, residual):
        h, residual = self.norm(x, self.w, residual)
        h = self.act(self.up(h))
        return self.gemma(h, self.w), residual


def _counting(monkeypatch):
    """Names of the ops whose torch.library real kernel runs (it rebuilds the op from its spec)."""
    calls = []
    real_build = ctor_spec.build

    def spy(spec):
        op = real_build(spec)
        if not torch._dynamo.is_compiling():
            calls.append(type(op).name)
        return op

    monkeypatch.setattr(ctor_spec, "build", spy)
    return calls


@pytest.mark.parametrize("custom_ops, expect_library", [(["all"], True), (["none"], False), (["none", "+rms_norm"], True)])
def test_model_compiles_fullgraph_and_matches_eager(custom_ops, expect_library, monkeypatch):
    torch.manual_seed(0)
    block = _Block()
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    with set_config(OpsConfig(custom_ops)):
        want = block(x, r)
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        calls = _counting(monkeypatch)
        got = compiled(x, r)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # enabled ops run as opaque custom ops (their eager dispatch runs inside); disabled ones are traced
    assert (len(calls) > 0) == expect_library, calls


@pytest.mark.parametrize("with_residual", [False, True], ids=["Tensor[] of one", "Tensor[] of two"])
def test_gradients_flow_through_the_compiled_op(with_residual):
    from dualop.ops import RMSNorm

    norm = RMSNorm(32)
    leaves = [torch.randn(3, 32), torch.linspace(0.5, 1.5, 32)] + ([torch.randn(3, 32)] if with_residual else [])
    leaves = [t.requires_grad_() for t in leaves]

    def loss(outputs):
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum((o * o * (i + 1)).sum() for i, o in enumerate(outputs))

    with set_config(OpsConfig(["all"])):
        graphs, out = _compile_and_record(lambda *a: norm(*a), *leaves, then="aot_eager")  # traces the backward
    assert _dualop_targets(graphs) == ["rms_norm"]
    got = torch.autograd.grad(loss(out), leaves)
    refs = [t.detach().requires_grad_() for t in leaves]
    want = torch.autograd.grad(loss(norm.forward_native(*refs)), refs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_locally_defined_unregistered_ops_compile_through_forward_native(clean_registry):
    class Local(CustomOp):
        def forward_native(self, x):
            return x * 2

        def forward_cpu(self, x):
            raise AssertionError("an unregistered op has no library op")

    op = Local()
    torch._dynamo.reset()
    out = torch.compile(lambda a: op(a), fullgraph=True)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
