"""mm_encoder_attn (MMEncoderAttention): the native body against torch's own
``F.scaled_dot_product_attention`` run per segment in float64, in both frontends, both layouts,
GQA, packed sequences, under jit and vmap; the kernels under jit/vmap and with ``max_seqlen``;
bad input refused before any kernel, naming the op and the argument. (Every kernel against
forward_native in every cell: tests/sweeps/test_cells.py with this op's check_cases.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import MMEncoderAttention
from dualop.ops import encoder_attention as enc_mod


def sdpa_reference(q, k, v, num_heads, num_kv_heads, head_size, scale, cu_seqlens=None) -> np.ndarray:
    """float64 ``F.scaled_dot_product_attention`` per batch element and per segment."""
    b, s = q.shape[:2]
    bounds = [0, s] if cu_seqlens is None else list(cu_seqlens)

    def heads(a, n):
        return torch.from_numpy(np.asarray(a, np.float64).reshape(b, s, n, head_size)).transpose(1, 2)

    qh, kh, vh = heads(q, num_heads), heads(k, num_kv_heads), heads(v, num_kv_heads)
    out = torch.zeros_like(qh)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[:, :, start:end] = F.scaled_dot_product_attention(
                qh[:, :, start:end], kh[:, :, start:end], vh[:, :, start:end], scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
    return out.transpose(1, 2).reshape(q.shape).numpy()


def _inputs(rng, b, s, heads, kv_heads, d, four_d):
    qs = (b, s, heads, d) if four_d else (b, s, heads * d)
    ks = (b, s, kv_heads, d) if four_d else (b, s, kv_heads * d)
    return testing.normal(qs, rng, 2.0), testing.normal(ks, rng, 2.0), testing.normal(ks, rng)


def _rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` as the op sees it in ``dtype`` (bfloat16 rounding), back in float32."""
    return testing.to_numpy(testing.to_frontend(a, "torch", dtype))


# (num_heads, num_kv_heads, head_size): MHA at the ViTs' 80, GQA 2:1 at 64, all heads on one kv head at 128.
HEADS = [(2, 2, 80), (4, 2, 64), (4, 1, 128)]


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
@pytest.mark.parametrize("four_d", [False, True], ids=["bs(hd)", "bshd"])
@pytest.mark.parametrize("heads, kv_heads, d", HEADS, ids=lambda v: str(v))
def test_native_matches_sdpa_per_segment(heads, kv_heads, d, four_d, packed, dtype, frontend):
    rng = np.random.default_rng(d + heads)
    b, s = (1, 29) if packed else (2, 13)
    q, k, v = _inputs(rng, b, s, heads, kv_heads, d, four_d)
    cu = enc_mod.packed_cu_seqlens(s) if packed else None
    op = MMEncoderAttention(heads, d, num_kv_heads=kv_heads)
    args = [testing.to_frontend(a, frontend, dtype) for a in (q, k, v)]
    cu_arg = None if cu is None else testing.to_frontend(testing.Pinned(cu, "int32"), frontend, "int32")
    got = op.forward_native(*args, cu_seqlens=cu_arg)
    assert tuple(got.shape) == q.shape
    assert str(got.dtype).removeprefix("torch.") == dtype
    want = sdpa_reference(*(_rounded(a, dtype) for a in (q, k, v)), heads, kv_heads, d, d**-0.5, cu)
    cmp = testing.compare(testing.to_numpy(got), want.astype(np.float32), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


def test_segments_do_not_see_each_other():
    """Changing one segment's keys leaves the other segments' outputs bit-identical."""
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, 1, 24, 2, 2, 16, False)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    op = MMEncoderAttention(2, 16)
    base = op.forward_native(*map(torch.from_numpy, (q, k, v)), cu)
    k2, v2 = k.copy(), v.copy()
    k2[:, 10:] += 5.0
    v2[:, 10:] -= 3.0
    moved = op.forward_native(*map(torch.from_numpy, (q, k2, v2)), cu)
    assert torch.equal(base[:, :10], moved[:, :10])
    assert not torch.equal(base[:, 10:], moved[:, 10:])


@pytest.mark.parametrize("platform, method", [("cpu", "forward_native"), ("tpu", "forward_tpu")])
def test_jax_jit_with_traced_cu_seqlens(platform, method):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(a) for a in _inputs(rng, 1, 29, 4, 2, 80, False))
    cu = jnp.asarray(enc_mod.packed_cu_seqlens(29))
    op = MMEncoderAttention(4, 80, num_kv_heads=2)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = jax.jit(op)(q, k, v, cu)
        assert op.last_run("jax", platform)[0] == method
    want = sdpa_reference(q, k, v, 4, 2, 80, 80**-0.5, enc_mod.packed_cu_seqlens(29))
    assert testing.compare(np.asarray(got), want.astype(np.float32), "float32").ok


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
def test_jax_vmap_over_a_leading_batch(platform, packed):
    """vmap over N independent calls (each [B, S, H*D]; with cu_seqlens, each its own packing)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    n, b, s = 3, (1 if packed else 2), 17
    qkv = [jnp.asarray(testing.normal((n, b, s, 2 * 72), rng)) for _ in range(3)]
    cus = jnp.asarray(np.stack([[0, 5, 17], [0, 0, 17], [0, 16, 17]]).astype(np.int32))
    op = MMEncoderAttention(2, 72)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        if packed:
            got = jax.jit(jax.vmap(op))(*qkv, cus)
        else:
            got = jax.vmap(lambda q, k, v: op(q, k, v))(*qkv)
        assert op.last_run("jax", platform)[0] == ("forward_tpu" if platform == "tpu" else "forward_native")
    for i in range(n):
        cu = np.asarray(cus[i]) if packed else None
        want = sdpa_reference(*(np.asarray(a[i]) for a in qkv), 2, 2, 72, 72**-0.5, cu)
        assert testing.compare(np.asarray(got[i]), want.astype(np.float32), "float32").ok


def test_triton_kernel_takes_max_seqlen():
    """The Triton kernel sized by a given max_seqlen (no device read) matches the native body."""
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(a) for a in _inputs(rng, 1, 40, 2, 2, 80, True))
    cu = torch.tensor([0, 7, 7, 40], dtype=torch.int32)
    op = MMEncoderAttention(2, 80)
    with override_platform("cuda"), set_config(OpsConfig(["all"])):
        op.last_fallback = None
        got = op(q, k, v, cu, 33)
        assert op.last_run("torch", "cuda")[0] == "forward_cuda"
    want = op.forward_native(q, k, v, cu)
    assert testing.compare(got.numpy(), want.numpy(), "float32").ok


def test_cpu_path_declines_while_autograd_records():
    rng = np.random.default_rng(4)
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in _inputs(rng, 1, 9, 2, 2, 16, False))
    op = MMEncoderAttention(2, 16)
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        op.last_fallback = None
        out = op(q, k, v)
        assert "autograd is recording" in op.last_run("torch", "cpu")[1]
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_layers_wrap_the_op():
    import jax.numpy as jnp

    from dualop.jax import layers as jax_layers
    from dualop.torch import layers as torch_layers

    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 1, 11, 4, 2, 64, True)
    cu = enc_mod.packed_cu_seqlens(11)
    want = sdpa_reference(q, k, v, 4, 2, 64, 64**-0.5, cu).astype(np.float32)
    t_layer = torch_layers.MMEncoderAttention(4, 64, num_kv_heads=2)
    j_layer = jax_layers.MMEncoderAttention(4, 64, num_kv_heads=2)
    got_t = t_layer(*map(torch.from_numpy, (q, k, v)), torch.from_numpy(cu))
    got_j = j_layer(*map(jnp.asarray, (q, k, v)), jnp.asarray(cu))
    assert testing.compare(got_t.numpy(), want, "float32").ok
    assert testing.compare(np.asarray(got_j), want, "float32").ok


# --- bad input -------------------------------------------------------------------------------------


@pytest.fixture
def no_kernel_may_launch(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    for ref in (enc_mod._PALLAS_ENCODER_ATTENTION, enc_mod._TRITON_ENCODER_ATTENTION):
        monkeypatch.setattr(ref, "resolve", forbidden)
    monkeypatch.setattr("dualop.kernels.cpu.encoder_attention.encoder_attention", forbidden)
    with set_config(OpsConfig(["all"])):
        yield


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"mm_encoder_attn: num_heads=6 must be a multiple of num_kv_heads=4"):
        MMEncoderAttention(6, 64, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"mm_encoder_attn: head_size must be a positive int"):
        MMEncoderAttention(2, 0)
    with pytest.raises(ValueError, match=r"mm_encoder_attn: scale must be a positive float"):
        MMEncoderAttention(2, 64, scale=-1.0)


def _arrays(frontend, *shapes, dtype="float32"):
    return [testing.to_frontend(np.zeros(s, np.float32), frontend, dtype) for s in shapes]


def _int32(frontend, values):
    return testing.to_frontend(testing.Pinned(np.asarray(values, np.int32), "int32"), frontend, "int32")


@pytest.mark.usefixtures("no_kernel_may_launch")
@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_bad_input_is_refused_before_any_kernel(frontend, platform):
    op = MMEncoderAttention(4, 16, num_kv_heads=2)
    ok_q, ok_kv = (1, 6, 64), (1, 6, 32)
    cases = [
        (ValueError, r"argument 'query' has last dim 48; expected 4 heads x head_size 16", ((1, 6, 48), ok_kv, ok_kv)),
        (ValueError, r"argument 'key' has last dim 64; expected 2 heads x head_size 16", (ok_q, ok_q, ok_kv)),
        (ValueError, r"argument 'value' has heads x head_size \(2, 8\); expected \(2, 16\)",
         ((1, 6, 4, 16), (1, 6, 2, 16), (1, 6, 2, 8))),
        (ValueError, r"argument 'key' has 4 dims but 'query' has 3", (ok_q, (1, 6, 2, 16), ok_kv)),
        (ValueError, r"argument 'value' has \[B, S\] = \(1, 5\); expected \(1, 6\)", (ok_q, ok_kv, (1, 5, 32))),
        (ValueError, r"argument 'query' must have at least 3 dimension", ((6, 64), ok_kv, ok_kv)),
    ]
    with override_platform(platform):
        for err, msg, shapes in cases:
            with pytest.raises(err, match=r"mm_encoder_attn: " + msg):
                op(*_arrays(frontend, *shapes))
        q, k, v = _arrays(frontend, ok_q, ok_kv, ok_kv)
        bad_cu = [
            ([0, 4, 2, 6], r"argument 'cu_seqlens' must be non-decreasing"),
            ([0, 3, 5], r"argument 'cu_seqlens' must start at 0 and end at S = 6"),
            ([1, 3, 6], r"argument 'cu_seqlens' must start at 0 and end at S = 6"),
            ([6], r"argument 'cu_seqlens' must be 1-D \[n \+ 1\] with n >= 1"),
        ]
        for values, msg in bad_cu:
            with pytest.raises(ValueError, match=r"mm_encoder_attn: " + msg):
                op(q, k, v, _int32(frontend, values))
        with pytest.raises(TypeError, match=r"mm_encoder_attn: argument 'cu_seqlens' has dtype float32; expected int32"):
            op(q, k, v, _arrays(frontend, (3,))[0])
        with pytest.raises(ValueError, match=r"mm_encoder_attn: argument 'max_seqlen' = 2 is below the longest segment \(4\)"):
            op(q, k, v, _int32(frontend, [0, 4, 6]), 2)
        qb, kb, vb = _arrays(frontend, (2, 6, 64), (2, 6, 32), (2, 6, 32))
        with pytest.raises(ValueError, match=r"mm_encoder_attn: argument 'cu_seqlens' needs packed sequences \(B == 1\)"):
            op(qb, kb, vb, _int32(frontend, [0, 6]))
        with pytest.raises(TypeError, match=r"mm_encoder_attn: argument 'key' has dtype bfloat16; expected float32"):
            op(q, *_arrays(frontend, ok_kv, dtype="bfloat16"), v)
        with pytest.raises(TypeError, match=r"mm_encoder_attn: expected a torch.Tensor or jax.Array"):
            op(np.zeros(ok_q, np.float32), k, v)
