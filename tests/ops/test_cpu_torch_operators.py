"""The torch operators in front of the CPU kernels (dualop/kernels/cpu/torch_ops.py, csrc/torch/ops.cc):
built here, taking exactly the plain calls, giving the ctypes path's bits, and declining everything
else untouched, so that the op's own checks and path answer it."""

from __future__ import annotations

import pytest
import torch

from dualop.custom_op import validates_inputs
from dualop.kernels.cpu import rms_norm as cpu_rms_norm, rotary as cpu_rotary, torch_ops
from dualop.ops import GemmaRMSNorm, RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


pytestmark = pytest.mark.usefixtures("cpu_kernels")


def test_the_operators_build_and_load_here():
    assert torch_ops.unavailable_reason() is None
    assert cpu_rms_norm.FAST_RMS_NORM.get() is torch.ops.dualop_cpu.rms_norm.default
    assert cpu_rotary.FAST_ROTARY_BY_POSITION.get() is torch.ops.dualop_cpu.rotary_by_position.default


def _norm_call(op, x, w, r, out, residual_out):
    """The operator's answer to a call of ``op`` (None: declined)."""
    fast = cpu_rms_norm.FAST_RMS_NORM.get()
    y, ro = fast(x, w, r, out, residual_out, *cpu_rms_norm.fast_constants(op.hidden_size, op.spec))
    return None if y is None else (y if ro is None else (y, ro))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.float32, None], ids=["w_f32", "w_like_x"])
@pytest.mark.parametrize("form", ["plain", "residual", "in_place", "out"])
@pytest.mark.parametrize("gemma", [False, True], ids=["rms", "gemma"])
def test_rms_norm_operator_gives_the_ctypes_paths_bits(dtype, weight_dtype, form, gemma):
    g = torch.Generator().manual_seed(1)
    shape, hidden = (5, 3, 96), 96
    x = torch.randn(shape, generator=g).mul(2).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), 0.0]).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(weight_dtype or dtype)
    op = GemmaRMSNorm(hidden, eps=1e-5) if gemma else RMSNorm(hidden, eps=1e-5)
    residual = None if form == "plain" else r
    want = cpu_rms_norm.rms_norm(x, w, residual, spec=op.spec)
    xc, rc = x.clone(), r.clone()
    outs = {"in_place": (xc, rc), "out": (torch.empty_like(x), torch.empty_like(x))}.get(form, (None, None))
    got = _norm_call(op, xc, w, None if residual is None else rc, *outs)
    assert got is not None, "the operator declined a plain call"
    got_t, want_t = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got_t, want_t):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    if outs[0] is not None:
        assert got_t[0] is outs[0] and got_t[1] is outs[1]
    # and the op's call takes that route, with the same bits
    op_got = op(x.clone(), w, residual)
    for a, b in zip(op_got if isinstance(op_got, tuple) else (op_got,), want_t):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def _declines_untouched(call, *tensors):
    before = [t.clone() for t in tensors]
    assert call() is None
    for t, b in zip(tensors, before):
        assert torch.equal(t.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_rms_norm_operator_declines_what_it_does_not_take_and_writes_nothing():
    op = RMSNorm(64)
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    wide, shared, spare = torch.randn(4, 128), torch.randn(320), torch.empty(4, 64)
    cases = {
        "strided x": lambda: _norm_call(op, wide[:, ::2], w, None, None, None),
        "other hidden": lambda: _norm_call(op, torch.randn(4, 32), torch.randn(32), None, None, None),
        "weight shape": lambda: _norm_call(op, x, torch.randn(4, 64), None, None, None),
        "residual dtype": lambda: _norm_call(op, x, w, r.double(), None, None),
        "residual shape": lambda: _norm_call(op, x, w, r[:2], None, None),
        "out dtype": lambda: _norm_call(op, x, w, None, torch.empty(4, 64, dtype=torch.bfloat16), None),
        "out is residual": lambda: _norm_call(op, x, w, r, r, None),
        "out overlaps x": lambda: _norm_call(op, shared[:256].view(4, 64), w, None, shared[32:288].view(4, 64), None),
        "residual_out without residual": lambda: _norm_call(op, x, w, None, None, torch.empty_like(x)),
        "outputs overlap": lambda: _norm_call(op, x, w, r, spare, spare),
        "int x": lambda: _norm_call(op, torch.ones(4, 64, dtype=torch.int32), w, None, None, None),
        "double x": lambda: _norm_call(op, x.double(), w, None, None, None),
    }
    for name, call in cases.items():
        _declines_untouched(call, x, r, w, shared)
    x_grad = x.clone().requires_grad_()
    assert _norm_call(op, x_grad, w, None, None, None) is None
    with torch.no_grad():
        assert _norm_call(op, x_grad, w, None, None, None) is not None


def test_rms_norm_overlap_of_out_and_x_is_refused_by_the_op_before_writing():
    op = RMSNorm(64)
    buf = torch.randn(5 * 64)
    x, out = buf[:256].view(4, 64), buf[64:320].view(4, 64)
    before = buf.clone()
    with pytest.raises(ValueError, match="overlaps 'x'"):
        op(x, torch.ones(64), out=out)
    assert torch.equal(buf, before)


def _rope_call(rope, positions, q, k, q_out=None, k_out=None, dtype=None):
    fast = cpu_rotary.FAST_ROTARY_BY_POSITION.get()
    cache = rope.cache_for(positions, dtype or q.dtype)
    a, b = fast(positions, q, k, cache, q_out, k_out, rope.head_size, rope.rotary_dim, rope.cache_positions,
                rope.is_neox_style)
    return None if a is None else (a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["flat", "heads", "no_key", "in_place", "int32_positions", "partial_rotary",
                                    "qkv_slices"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rope_operator_gives_the_ctypes_paths_bits(dtype, layout, neox):
    g = torch.Generator().manual_seed(2)
    tokens, hq, hk, d = 6, 4, 2, 32
    rope = RotaryEmbedding(d, 16 if layout == "partial_rotary" else d, 64, 10000.0, neox)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    if layout == "int32_positions":
        positions = positions.int()
    q = torch.randn(tokens, hq * d, generator=g).to(dtype)
    k = None if layout == "no_key" else torch.randn(tokens, hk * d, generator=g).to(dtype)
    if layout == "heads":
        q, k = q.view(tokens, hq, d), k.view(tokens, hk, d)
    if layout == "qkv_slices":  # column slices of one projection's rows, as the models split them
        qkv = torch.cat([q, k, torch.randn(tokens, hk * d, generator=g).to(dtype)], dim=1)
        q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
        before = qkv.clone()
    cache = rope.cache_for(positions, dtype)
    want = cpu_rotary.rotary_by_position(positions, q, k, cache, head_size=d, rotary_dim=rope.rotary_dim,
                                         is_neox_style=neox)
    qc, kc = q.clone(), None if k is None else k.clone()
    outs = (qc, kc) if layout == "in_place" else (None, None)
    got = _rope_call(rope, positions, qc, kc, *outs)
    assert got is not None, "the operator declined a plain call"
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    if layout == "in_place":
        assert got[0] is qc and got[1] is kc
    if layout == "qkv_slices":
        assert torch.equal(qkv, before)  # read, not written
        slices = qkv.clone()
        _declines_untouched(lambda: _rope_call(rope, positions, slices[:, :hq * d], None, slices[:, :hq * d]), slices)


def test_rope_operator_declines_out_of_range_positions_and_the_op_refuses_them_untouched():
    rope = RotaryEmbedding(32, 32, 64, 10000.0, True)
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    for bad in ([0, 64, 1], [0, -1, 2]):
        positions = torch.tensor(bad)
        _declines_untouched(lambda: _rope_call(rope, positions, q, k, q, k), q, k)
        before = (q.clone(), k.clone())
        with pytest.raises(ValueError, match="positions"):
            rope(positions, q, k, query_out=q, key_out=k)
        assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_rope_operator_declines_other_layouts_untouched():
    rope = RotaryEmbedding(32, 32, 64, 10000.0, True)
    positions = torch.tensor([1, 2, 3])
    q, k = torch.randn(3, 64), torch.randn(3, 32)
    wide, strided = torch.randn(3, 96), torch.randn(3, 128)[:, ::2]
    cases = {
        "strided query in place": lambda: _rope_call(rope, positions, strided, k, strided),
        "head size": lambda: _rope_call(rope, positions, torch.randn(3, 48), k),
        "token count": lambda: _rope_call(rope, positions, torch.randn(2, 64), k),
        "key dtype": lambda: _rope_call(rope, positions, q, k.bfloat16()),
        "cache dtype": lambda: _rope_call(rope, positions, q, k, dtype=torch.bfloat16),
        "float positions": lambda: _rope_call(rope, positions.float(), q, k, dtype=torch.float32),
        "query_out overlaps key": lambda: _rope_call(rope, positions, q, wide[:, :32], q_out=wide[:, 16:80]),
        "key_out without key": lambda: _rope_call(rope, positions, q, None, None, torch.empty(3, 32)),
        "empty": lambda: _rope_call(rope, positions[:0], q[:0], k[:0]),
    }
    for name, call in cases.items():
        _declines_untouched(call, q, k, wide, strided)


def test_a_subclass_that_adds_checks_gets_them_run_by_dispatch():
    class StrictNorm(RMSNorm):
        def check_inputs(self, x, weight=None, residual=None, *, out=None, residual_out=None):
            super().check_inputs(x, weight, residual, out=out, residual_out=residual_out)
            if x.shape[0] > 2:
                raise ValueError("strict_norm: argument 'x' has more than 2 rows")

    assert RMSNorm.validates_own_inputs("forward_cpu")
    assert not StrictNorm.validates_own_inputs("forward_cpu")
    op = StrictNorm(16)
    op(torch.randn(2, 16), torch.ones(16))
    with pytest.raises(ValueError, match="more than 2 rows"):
        op(torch.randn(3, 16), torch.ones(16))


def test_validates_inputs_marks_only_the_method_it_decorates():
    class Plain(RMSNorm):
        @validates_inputs
        def forward_xpu(self, *args, **kwargs):  # pragma: no cover - never dispatched here
            raise NotImplementedError

    assert Plain.validates_own_inputs("forward_xpu") and Plain.validates_own_inputs("forward_cpu")
    assert not Plain.validates_own_inputs("forward_native")


# --- gated activations ------------------------------------------------------------------------


def _act_call(op, x, out=None):
    from dualop.kernels.cpu import gated_activation as cpu_gated

    tables, code, first = cpu_gated.fast_arguments(op.spec)
    return cpu_gated.FAST_GATED_ACTIVATION.get()(x, tables.get(x.dtype), out, code, first)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [3, 40], ids=["few_gates", "table_sized"])
@pytest.mark.parametrize("op_name", ["SiluAndMul", "GeluAndMul", "MulAndSilu"])
def test_gated_operator_matches_the_native_body_and_the_ctypes_path_where_it_looks_up(dtype, rows, op_name):
    import dualop.ops as ops
    from dualop import testing
    from dualop.kernels.cpu import gated_activation as cpu_gated

    op = getattr(ops, op_name)()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 2 * 1024, generator=g).mul(3).to(dtype)  # 40 rows: 40960 gates, the table's side
    out = torch.empty(rows, 1024, dtype=dtype)
    got = _act_call(op, x, out)
    assert got is out
    want = op.forward_native(x)
    key, _ = testing.tolerance_for(str(dtype).removeprefix("torch."), want)
    assert testing.compare(testing.to_numpy(got), testing.to_numpy(want), key).ok
    if dtype == torch.float32 or rows == 40:  # the same entry point as the ctypes path: the same bits
        assert torch.equal(got, cpu_gated.gated_activation(x, spec=op.spec))


def test_gated_operator_declines_untouched():
    from dualop.ops import SiluAndMul

    op = SiluAndMul()
    x = torch.randn(4, 64)
    shared = torch.randn(4 * 64)
    cases = {
        "odd last dim": lambda: _act_call(op, torch.randn(4, 63)),
        "strided x": lambda: _act_call(op, torch.randn(4, 128)[:, ::2]),
        "out shape": lambda: _act_call(op, x, torch.empty(4, 64)),
        "out dtype": lambda: _act_call(op, x, torch.empty(4, 32, dtype=torch.bfloat16)),
        "out overlaps x": lambda: _act_call(op, shared.view(4, 64), shared[:128].view(4, 32)),
        "int x": lambda: _act_call(op, torch.ones(4, 64, dtype=torch.int32)),
    }
    for name, call in cases.items():
        _declines_untouched(call, x, shared)
    assert _act_call(op, x.clone().requires_grad_()) is None


# --- the paged KV cache write -------------------------------------------------------------------


def _cache_call(key, value, pages, slots):
    from dualop.kernels.cpu import kv_cache as cpu_kv

    return cpu_kv.FAST_RESHAPE_AND_CACHE.get()(key, value, pages, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_cache_write_operator_matches_the_torch_path_skips_negative_slots_and_lets_the_last_writer_win(dtype, slot_dtype):
    from dualop.ops import ReshapeAndCache

    g = torch.Generator().manual_seed(4)
    tokens, heads, d, pages, page = 9, 2, 16, 5, 4
    key = torch.randn(tokens, heads, d, generator=g).to(dtype)
    value = torch.randn(tokens, heads, d, generator=g).to(dtype)
    slots = torch.tensor([3, 7, -1, 12, 7, 0, 19, -5, 3], dtype=slot_dtype)  # 7 and 3 twice: the later wins
    cache = torch.randn(pages, page, 2 * heads, d, generator=g).to(dtype)
    want = ReshapeAndCache().forward_native(key, value, cache.clone(), slots)
    got_cache = cache.clone()
    assert _cache_call(key, value, got_cache, slots) is got_cache
    assert torch.equal(got_cache, want)
    assert torch.equal(got_cache.view(-1, 2 * heads, d)[7, 0::2], key[4]) and torch.equal(
        got_cache.view(-1, 2 * heads, d)[3, 1::2], value[8])
    # key and value as column slices of one fused projection's output (strided over tokens)
    fused = torch.cat([key.reshape(tokens, -1), value.reshape(tokens, -1)], dim=1)
    strided_key, strided_value = (part.reshape(tokens, heads, d) for part in fused.split(heads * d, dim=1))
    assert not strided_key.is_contiguous()
    got_cache = cache.clone()
    assert _cache_call(strided_key, strided_value, got_cache, slots) is got_cache
    assert torch.equal(got_cache, want)


def test_cache_write_operator_declines_untouched_and_the_op_refuses_a_slot_past_the_cache():
    from dualop.ops import ReshapeAndCache

    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cache = torch.randn(2, 4, 4, 8)
    slots = torch.tensor([0, 5, 2])
    wide = torch.randn(2, 4, 8, 8)
    cases = {
        "slot past the cache": lambda: _cache_call(key, value, cache, torch.tensor([0, 8, 1])),
        "float slots": lambda: _cache_call(key, value, cache, slots.float()),
        "slot count": lambda: _cache_call(key, value, cache, slots[:2]),
        "value dtype": lambda: _cache_call(key, value.double(), cache, slots),
        "cache heads": lambda: _cache_call(key, value, torch.randn(2, 4, 2, 8), slots),
        "strided cache": lambda: _cache_call(key, value, wide[:, :, ::2], slots),
        "strided key rows": lambda: _cache_call(torch.randn(3, 2, 16)[:, :, ::2], value, cache, slots),
        "key inside the cache": lambda: _cache_call(cache.view(-1)[:48].view(3, 2, 8), value, cache, slots),
        "cache requires grad": lambda: _cache_call(key, value, cache.clone().requires_grad_(), slots),
    }
    for name, call in cases.items():
        _declines_untouched(call, key, value, cache, wide)
    with torch.inference_mode():
        inference_cache = torch.zeros(2, 4, 4, 8)
    _declines_untouched(lambda: _cache_call(key, value, inference_cache, slots), inference_cache)
    before = cache.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        ReshapeAndCache()(key, value, cache, torch.tensor([0, 8, 1]))
    assert torch.equal(cache, before)


# --- ragged paged attention -----------------------------------------------------------------------


def _paged_batch(dtype, q_lens=(1, 5, 1), kv_lens=(7, 9, 12), tokens=8):
    import numpy as np

    from dualop.ops.attention import paged_batch

    arrays = paged_batch(np.random.default_rng(5), list(q_lens), list(kv_lens), num_tokens=tokens, num_q_heads=4,
                         num_kv_heads=2, head_dim=32, page_size=4, max_seqs=len(q_lens) + 1)
    q, pages = (torch.from_numpy(a).to(dtype) for a in arrays[:2])
    return (q, pages, *(torch.from_numpy(a) for a in arrays[2:]))


def _attention_call(*args, sm_scale=0.125):
    from dualop.kernels.cpu import ragged_paged_attention as cpu_rpa

    return cpu_rpa.FAST_RAGGED_PAGED_ATTENTION.get()(*args, sm_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_operator_gives_the_ctypes_paths_bits(dtype):
    from dualop.kernels.cpu import ragged_paged_attention as cpu_rpa
    from dualop.ops import RaggedPagedAttention

    batch = _paged_batch(dtype)
    got = _attention_call(*batch)
    assert got is not None
    assert torch.equal(got, cpu_rpa.ragged_paged_attention(*batch, sm_scale=0.125))
    assert torch.equal(RaggedPagedAttention()(*batch, sm_scale=0.125), got)


def test_attention_operator_declines_bad_metadata_and_the_op_names_it():
    from dualop.ops import RaggedPagedAttention

    q, pages, kv_lens, page_indices, cu_q_lens, num_seqs = _paged_batch(torch.float32)

    def edited(name, index, value):
        arrays = dict(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
        arrays[name] = arrays[name].clone()
        arrays[name][index] = value
        return (q, pages, arrays["kv_lens"], arrays["page_indices"], arrays["cu_q_lens"], arrays["num_seqs"])

    bad = {
        "num_seqs": edited("num_seqs", 0, 9),
        "cu_q_lens": edited("cu_q_lens", 0, 1),
        "kv_lens": edited("kv_lens", 1, 3),  # shorter than its 5 queries
        "page_indices": edited("page_indices", (0, 0), pages.shape[0]),
    }
    for name, args in bad.items():
        assert _attention_call(*args) is None, name
        with pytest.raises(ValueError, match=name):
            RaggedPagedAttention()(*args, sm_scale=0.125)
    assert _attention_call(q, pages, kv_lens.long(), page_indices, cu_q_lens, num_seqs) is None
    assert _attention_call(q, pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=float("nan")) is None
    assert _attention_call(q[:, :3], pages, kv_lens, page_indices, cu_q_lens, num_seqs) is None  # 3 % 2 heads
