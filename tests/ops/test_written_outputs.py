"""The written forms (``out=`` and in place) of the norms, gated activations and rope: every path
(the C++ CPU kernels, the native body) writes the out-of-place result into the given tensors and
returns them, in place included (the engine's fused add-norm and rope), with any layout of output;
bad outputs are refused before anything is written; ``torch.library`` declares the written form as
its own mutating op (``<name>_out``), which passes opcheck and is what ``torch.compile`` puts in the
graph. The out-of-place results themselves are tested against references elsewhere (test_rotary,
test_cpu_kernels, the sweeps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualop import OpsConfig, set_config, testing
from dualop.backends.torch import library
from dualop.ops import (GeluAndMul, GemmaRMSNorm, Llama3RotaryEmbedding, MRotaryEmbedding, RMSNorm, RotaryEmbedding,
                        SiluAndMul)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PATHS = ["kernel", "native"]  # the op's default (the C++ CPU kernel here) and custom_ops=none


def _config(path):
    return set_config(OpsConfig(["all"] if path == "kernel" else ["none"]))


def _same(got, want):
    """Equal within the tolerance table (a written form computes what the out-of-place call does;
    the kernel against the native body is within the table, as elsewhere)."""
    key, _ = testing.tolerance_for(str(want.dtype).removeprefix("torch."), want)
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), key)
    assert cmp.ok, cmp


def _randn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(2).to(dtype)


# ------------------------------------------------------------------ norms


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 300), (16, 4096)])
@pytest.mark.parametrize("make", [lambda h: RMSNorm(h), lambda h: GemmaRMSNorm(h)], ids=["rms_norm", "gemma"])
def test_fused_add_norm_in_place_is_the_out_of_place_result(path, dtype, shape, make):
    op = make(shape[-1])
    x, r, w = _randn(shape, dtype, 0), _randn(shape, dtype, 1), 1 + _randn(shape[-1:], dtype, 2) / 4
    with _config(path):
        want_y, want_sum = op(x.clone(), w, r.clone())
        got = op(x, w, r, out=x, residual_out=r)
        assert got[0] is x and got[1] is r
        _same(x, want_y)
        _same(r, want_sum)
        assert op.last_run("torch")[0] == ("forward_cpu" if path == "kernel" else "forward_native")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_into_given_outputs_of_any_layout(path, dtype):
    op = RMSNorm(48)
    x, r, w = _randn((6, 48), dtype, 0), _randn((6, 48), dtype, 1), _randn((48,), dtype, 2)
    with _config(path):
        want_y, want_sum = op(x, w, r)
        out = torch.empty(48, 6, dtype=dtype).t()  # not row-major: the kernel writes elsewhere, then copies
        residual_out = torch.empty(6, 48, dtype=dtype)
        got = op(x, w, r, out=out, residual_out=residual_out)
        assert got[0] is out and got[1] is residual_out
        _same(out, want_y)
        _same(residual_out, want_sum)
        only = torch.empty(6, 48, dtype=dtype)
        assert op(x, w, out=only) is only  # no residual: the one result, written
        _same(only, op(x, w))
        y, fresh_sum = op(x, w, r, out=only)  # out given, the sum new
        assert y is only and fresh_sum.data_ptr() not in (x.data_ptr(), r.data_ptr())
        _same(fresh_sum, want_sum)


# ------------------------------------------------------------------ gated activations


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", [SiluAndMul, lambda: GeluAndMul(approximate="tanh")], ids=["silu", "gelu_tanh"])
def test_gated_activation_into_out(path, dtype, make):
    op = make()
    x = _randn((2, 5, 96), dtype, 0)
    with _config(path):
        want = op(x)
        out = torch.full((2, 5, 48), float("nan"), dtype=dtype)
        assert op(x, out=out) is out
        _same(out, want)
        strided = torch.empty(2, 5, 96, dtype=dtype)[..., ::2]
        assert op(x, out=strided) is strided
        _same(strided, want)


# ------------------------------------------------------------------ rope


def _rope_inputs(tokens, q_heads, k_heads, head, dtype, layout, positions_dtype, seed=0):
    rng = np.random.default_rng(seed)
    positions = torch.from_numpy(rng.integers(0, 512, tokens)).to(positions_dtype)
    q = _randn((tokens, q_heads, head), dtype, seed + 1)
    k = None if k_heads is None else _randn((tokens, k_heads, head), dtype, seed + 2)
    if layout == "flat":
        q = q.reshape(tokens, -1)
        k = None if k is None else k.reshape(tokens, -1)
    return positions, q, k


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head, rotary_dim, neox", [(128, 128, True), (80, 80, False), (64, 32, True)])
@pytest.mark.parametrize("k_heads, layout, positions_dtype", [(2, "flat", torch.int64), (None, "heads", torch.int32),
                                                              (8, "heads", torch.int64)])
def test_rope_in_place_is_the_out_of_place_result(path, dtype, head, rotary_dim, neox, k_heads, layout,
                                                  positions_dtype):
    """The default rope gathers its cos/sin rows inside the C++ kernel (by position); in place
    rotates query and key where they are."""
    op = RotaryEmbedding(head, rotary_dim, 512, 10000.0, neox)
    positions, q, k = _rope_inputs(7, 8, k_heads, head, dtype, layout, positions_dtype)
    with _config(path):
        want_q, want_k = op(positions, q.clone(), None if k is None else k.clone())
        got_q, got_k = op(positions, q, k, query_out=q, key_out=k)
        assert got_q is q and got_k is k
        _same(q, want_q)
        if k is not None:
            _same(k, want_k)
        assert op.last_run("torch")[0] == ("forward_cpu" if path == "kernel" else "forward_native")


@pytest.mark.parametrize("make", [
    lambda: Llama3RotaryEmbedding(64, 64, 512, 500000.0, True, None, 8.0, 1.0, 4.0, 64),
    lambda: MRotaryEmbedding(64, 64, 512, 10000.0, True, None, [8, 12, 12]),
], ids=["llama3", "mrope_text"])
def test_scaled_ropes_write_in_place_too(make):
    op = make()
    positions, q, k = _rope_inputs(9, 4, 2, 64, torch.bfloat16, "flat", torch.int64)
    want_q, want_k = op(positions, q.clone(), k.clone())
    op(positions, q, k, query_out=q, key_out=k)
    _same(q, want_q)
    _same(k, want_k)


def test_rope_kernel_by_position_matches_native_at_the_cache_edges():
    """Positions 0 and the last cached row, a single token, and an empty call."""
    op = RotaryEmbedding(64, 64, 100, 10000.0, True)
    positions = torch.tensor([0, 99, 50, 99, 0])
    q, k = _randn((5, 3, 64), torch.float32, 0), _randn((5, 1, 64), torch.float32, 1)
    got = op.forward_cpu(positions, q, k)
    want = op.forward_native(positions, q, k)
    for g, w in zip(got, want):
        _same(g, w)
    empty_q, empty_k = op.forward_cpu(torch.zeros(0, dtype=torch.int64), q[:0], k[:0])
    assert empty_q.shape == (0, 3, 64) and empty_k.shape == (0, 1, 64)


# ------------------------------------------------------------------ refusals


def _refused(call, error, match, *untouched):
    before = [t.clone() for t in untouched]
    with pytest.raises(error, match=match):
        call()
    for t, b in zip(untouched, before):
        assert torch.equal(t, b) or (t.isnan() == b.isnan()).all()


def test_bad_outputs_are_refused_before_anything_is_written():
    op, rope, gate = RMSNorm(8), RotaryEmbedding(8, 8, 16, 10000.0), SiluAndMul()
    x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    _refused(lambda: op(x, w, r, out=torch.empty(4, 9)), ValueError, r"rms_norm: argument 'out' has shape", x, r)
    _refused(lambda: op(x, w, r, out=torch.empty(4, 8, dtype=torch.float16)), TypeError,
             r"rms_norm: argument 'out' has dtype float16; expected float32", x, r)
    buffer = torch.randn(5, 8)
    _refused(lambda: op(buffer[:4], w, out=buffer[1:]), ValueError,
             r"rms_norm: argument 'out' overlaps 'x' without being it", buffer)
    _refused(lambda: op(x, w, r, out=r, residual_out=r), ValueError,
             r"rms_norm: arguments 'out' and 'residual_out' overlap", x, r)
    _refused(lambda: op(x, w, residual_out=r), ValueError, r"'residual_out' given without a residual", x, r)
    _refused(lambda: op(x, w, out=x.numpy()), TypeError, r"argument 'out' must be None or a torch.Tensor", x)
    q = torch.randn(4, 8)
    _refused(lambda: rope(torch.arange(4), q, None, key_out=torch.empty(4, 8)), ValueError,
             r"rotary_embedding: argument 'key_out' given without a key", q)
    _refused(lambda: rope(torch.tensor([0, 1, 2, 16]), q, None, query_out=q), ValueError,
             r"rotary_embedding: argument 'positions' holds values in \[0, 16\]", q)
    _refused(lambda: gate(torch.randn(4, 16), out=torch.empty(4, 16)), ValueError,
             r"silu_and_mul: argument 'out' has shape \(4, 16\); expected \(4, 8\)")


def test_query_and_key_split_from_one_projection_rotate_in_place():
    """The engine's rope takes query and key as column slices of one qkv matrix: interleaved in
    memory, sharing no element, so in place is allowed; an output that does share one is refused."""
    op = RotaryEmbedding(16, 16, 64, 10000.0)
    qkv = _randn((5, 4 * 16 + 2 * 2 * 16), torch.float32, 0)
    q, k, _ = qkv.split([4 * 16, 2 * 16, 2 * 16], dim=-1)
    positions = torch.arange(5)
    want_q, want_k = op(positions, q.clone(), k.clone())
    got_q, got_k = op(positions, q, k, query_out=q, key_out=k)
    assert got_q is q and got_k is k
    _same(q, want_q)
    _same(k, want_k)
    _refused(lambda: op(positions, q, k, query_out=qkv[:, 8:8 + 64], key_out=k), ValueError,
             r"argument 'query_out' overlaps 'query' without being it", qkv)


def test_jax_arrays_cannot_be_written():
    jnp = pytest.importorskip("jax.numpy", reason="jax is in both test environments; this guards a bare install")
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"rms_norm: argument 'out' must be None or a torch.Tensor to write into, "
                                        r"got a jax array \(immutable"):
        RMSNorm(8)(x, out=jnp.zeros((2, 8), jnp.float32))


# ------------------------------------------------------------------ torch.library


@pytest.mark.parametrize("name, schema", [
    ("rms_norm", "(Tensor x, Tensor? weight, Tensor? residual, Tensor(a!)? out, Tensor(b!)? residual_out, str ctor)"
                 " -> (Tensor, Tensor)"),
    ("silu_and_mul", "(Tensor x, Tensor(a!)? out, str ctor) -> Tensor"),
    ("rotary_embedding", "(Tensor positions, Tensor query, Tensor? key, Tensor(a!)? query_out, Tensor(b!)? key_out, "
                         "str ctor) -> (Tensor, Tensor)"),
])
def test_written_forms_are_their_own_mutating_library_ops(name, schema):
    from dualop import CustomOp

    cls = CustomOp.op_registry[name]
    assert library.op_signature(cls, written=True).schema == schema
    assert str(library.written_op(name).default._schema) == f"dualop::{name}_out{schema}"
    assert "(a!)" not in library.op_signature(cls).schema  # the functional op keeps its autograd formula


def _opcheck(op, args, kwargs):
    values = library.library_args(op, args, kwargs, written=True)
    result = torch.library.opcheck(library.written_op(type(op).name).default, tuple(values))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_written_forms_pass_opcheck(dtype):
    x, r, w = _randn((4, 32), dtype, 0), _randn((4, 32), dtype, 1), _randn((32,), dtype, 2)
    _opcheck(RMSNorm(32), (x, w, r), {"out": torch.empty_like(x), "residual_out": torch.empty_like(x)})
    _opcheck(RMSNorm(32), (x, w), {"out": torch.empty_like(x)})
    _opcheck(SiluAndMul(), (x,), {"out": torch.empty(4, 16, dtype=dtype)})
    positions, q, k = _rope_inputs(4, 2, 1, 16, dtype, "flat", torch.int64)
    _opcheck(RotaryEmbedding(16, 16, 512, 10000.0), (positions, q, k),
             {"query_out": torch.empty_like(q), "key_out": torch.empty_like(k)})
    _opcheck(RotaryEmbedding(16, 16, 512, 10000.0), (positions, q, None), {"query_out": torch.empty_like(q)})


def test_compiled_in_place_calls_hold_the_written_op_and_match_eager():
    norm, rope = RMSNorm(32), RotaryEmbedding(16, 16, 512, 10000.0)

    def step(positions, q, k, x, r, w):
        rope(positions, q, k, query_out=q, key_out=k)
        return norm(x, w, r, out=x, residual_out=r)

    positions, q, k = _rope_inputs(4, 2, 1, 16, torch.float32, "flat", torch.int64)
    x, r, w = _randn((4, 32), torch.float32, 0), _randn((4, 32), torch.float32, 1), _randn((32,), torch.float32, 2)
    eager = [t.clone() for t in (q, k, x, r)]
    step(positions, *eager, w)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with set_config(OpsConfig(["all"])):
        got = torch.compile(step, backend=record, fullgraph=True)(positions, q, k, x, r, w)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if "dualop" in str(n.target)}
    assert targets == {"dualop.rotary_embedding_out", "dualop.rms_norm_out"}, targets
    assert got[0] is x and got[1] is r
    for g, e in zip((q, k, x, r), eager):
        torch.testing.assert_close(g, e)
