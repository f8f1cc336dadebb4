"""Rope ops against code nobody here wrote (Hugging Face transformers: Llama's rotary embedding and
``apply_rotary_pos_emb`` for neox, GPT-J's for interleaved pairs, Qwen2.5-VL's vision rotary for
``apply_rotary_emb``), the three rotation kernels against the native formula at head sizes 64, 80,
128 and ragged token blocks, JAX under ``jit``/``vmap``, torch.compile with ``key=None``, and bad
input refused before launch."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import ApplyRotaryEmb, DualChunkRotaryEmbedding, RotaryEmbedding

jnp = jax.numpy


def _data(shape, seed=0, scale=2.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _close(got, want, dtype="float32"):
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), dtype)
    assert cmp.ok, (cmp.max_abs, cmp.max_rel, cmp.detail)


def _close_angles(got, want):
    """float32 caches built two ways (HF: torch pow and a float32 matmul of positions; here numpy's
    float32 outer product) round angles differently, by up to ~position * 1 ulp: compared at 1e-4."""
    np.testing.assert_allclose(testing.to_numpy(got), testing.to_numpy(want), rtol=1e-4, atol=1e-4)


def _both_frontends(op, *arrays):
    """``op.forward_native`` on torch tensors and on jax arrays of the same numpy inputs."""
    torch_args = [None if a is None else torch.from_numpy(a) for a in arrays]
    jax_args = [None if a is None else jnp.asarray(a) for a in arrays]
    return op.forward_native(*torch_args), op.forward_native(*jax_args)


# ------------------------------------------------------------------ native vs transformers


@pytest.mark.reference
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (128, 128), (80, 80), (128, 64)])
def test_neox_matches_llama(head_size, rotary_dim):
    """Llama's LlamaRotaryEmbedding + apply_rotary_pos_emb on the rotated channels (a partial
    rotary_dim rotates the first channels; the rest pass through)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    base, tokens, heads, kv_heads = 10000.0, 11, 4, 2
    config = LlamaConfig(hidden_size=rotary_dim * heads, num_attention_heads=heads, head_dim=rotary_dim,
                         max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": base})
    positions = np.random.default_rng(1).integers(0, 256, tokens).astype(np.int64)
    q, k = _data((tokens, heads, head_size), 2), _data((tokens, kv_heads, head_size), 3)
    tq, tk = torch.from_numpy(q), torch.from_numpy(k)
    cos, sin = LlamaRotaryEmbedding(config)(tq, torch.from_numpy(positions)[None])
    # HF layout: [batch, heads, seq, dim]; cos/sin [batch, seq, dim]
    rq, rk = apply_rotary_pos_emb(tq[None, ..., :rotary_dim].transpose(1, 2), tk[None, ..., :rotary_dim].transpose(1, 2), cos, sin)
    want_q = torch.cat([rq.transpose(1, 2)[0], tq[..., rotary_dim:]], -1)
    want_k = torch.cat([rk.transpose(1, 2)[0], tk[..., rotary_dim:]], -1)
    op = RotaryEmbedding(head_size, rotary_dim, 256, base, True)
    for got_q, got_k in _both_frontends(op, positions.astype(np.int32), q.reshape(tokens, -1), k):
        _close_angles(got_q, want_q.reshape(tokens, -1))
        _close_angles(got_k, want_k)


@pytest.mark.reference
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (256, 64), (80, 48)])
def test_gptj_matches_transformers(head_size, rotary_dim):
    """GPT-J's sinusoidal table and apply_rotary_pos_emb (interleaved pairs) on the first
    rotary_dim channels, the rest passed through, as GPT-J's attention does."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    tokens, heads = 9, 3
    positions = np.random.default_rng(4).integers(0, 128, tokens)
    x = _data((tokens, heads, head_size), 5)
    table = create_sinusoidal_positions(128, rotary_dim)[torch.from_numpy(positions)][None]  # [1, T, R]
    sin, cos = torch.split(table, rotary_dim // 2, dim=-1)
    tx = torch.from_numpy(x)[None]  # [1, T, H, D]
    want = torch.cat([apply_rotary_pos_emb(tx[..., :rotary_dim], sin, cos), tx[..., rotary_dim:]], -1)[0]
    op = RotaryEmbedding(head_size, rotary_dim, 128, 10000.0, is_neox_style=False)
    for got, key in _both_frontends(op, positions.astype(np.int32), x):
        assert key is None
        _close_angles(got, want)


@pytest.mark.reference
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batched", [False, True])
def test_apply_rotary_emb_matches_qwen2_5_vl_vision(dtype, batched):
    """Qwen2.5-VL's apply_rotary_pos_emb_vision (float32 math, one cast) with its full-width
    cos/sin, against ApplyRotaryEmb with float32 angles (enable_fp32_compute) and head size 80."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    seq, heads, head = 12, 3, 80
    freqs = np.outer(np.arange(seq), 1.0 / 10000.0 ** (np.arange(0, head, 2) / head)).astype(np.float32)
    emb = np.concatenate([freqs, freqs], -1)
    shape = (2, seq, heads, head) if batched else (seq, heads, head)
    x = torch.from_numpy(_data(shape, 6)).to(getattr(torch, dtype))
    want, _ = apply_rotary_pos_emb_vision(x, x, torch.from_numpy(np.cos(emb)), torch.from_numpy(np.sin(emb)))
    op = ApplyRotaryEmb(enable_fp32_compute=True)
    got = op.forward_native(x, torch.from_numpy(np.cos(freqs)), torch.from_numpy(np.sin(freqs)))
    _close(got, want, dtype)
    jgot = op.forward_native(jnp.asarray(testing.to_numpy(x)).astype(dtype), jnp.cos(freqs), jnp.sin(freqs))
    _close(jgot, want, dtype)


def test_apply_rotary_emb_without_fp32_compute_rounds_the_angles_first():
    """enable_fp32_compute=False: cos/sin are first cast to x's dtype, as the engine does."""
    seq, head = 5, 64
    x = torch.from_numpy(_data((seq, 2, head), 7)).bfloat16()
    cos, sin = (torch.from_numpy(_data((seq, head // 2), s, 1.0)) for s in (8, 9))
    got = ApplyRotaryEmb().forward_native(x, cos, sin)
    want = ApplyRotaryEmb(enable_fp32_compute=True).forward_native(x, cos.bfloat16().float(), sin.bfloat16().float())
    assert torch.equal(got, want)


@pytest.mark.reference
def test_dual_chunk_matches_the_engine_definition():
    """The five query angle sets and the key's, stated here in float64 numpy from the reference
    engine's definition (no library ships this op)."""
    head, rot, max_pos, chunk, local, base = 64, 32, 64, 16, 4, 10000.0
    n = chunk - local
    tokens, heads = 7, 2
    rng = np.random.default_rng(10)
    positions, offsets = rng.integers(0, 32, tokens), rng.integers(0, 32, tokens)
    q, k = _data((tokens, heads * head), 11), _data((tokens, head), 12)
    inv = 1.0 / base ** (np.arange(0, rot, 2) / rot)

    def rotate64(x, angle_pos):
        x = x.reshape(tokens, -1, head).astype(np.float64)
        ang = np.outer(angle_pos, inv)[:, None, :]
        c, s = np.cos(ang), np.sin(ang)
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]], -1).reshape(tokens, -1)

    p = positions + offsets
    local_pos = p % n
    want_q = np.concatenate([
        rotate64(q, local_pos),
        rotate64(q, np.minimum(local_pos + n, chunk)),
        rotate64(q, np.full(tokens, min(2 * n - 1, chunk))),
        rotate64(q, local_pos + n),
        rotate64(q, local_pos + chunk),
    ], -1)
    want_k = rotate64(k, p % n)
    op = DualChunkRotaryEmbedding(head, rot, max_pos, base, True, None, chunk, local)
    for got_q, got_k in _both_frontends(op, positions.astype(np.int32), q, k, offsets.astype(np.int32)):
        assert tuple(got_q.shape) == (tokens, 5 * heads * head)
        _close(got_q, want_q.astype(np.float32))
        _close(got_k, want_k.astype(np.float32))
    # [T, H, D] in: the sets concatenate on the head dim, as the engine's view does
    got3, _ = op.forward_native(torch.from_numpy(positions.astype(np.int32)),
                                torch.from_numpy(q.reshape(tokens, heads, head)), torch.from_numpy(k))
    assert tuple(got3.shape) == (tokens, heads, 5 * head)


# ------------------------------------------------------------------ kernels vs native


def _kernel_inputs(tokens, q_heads, k_heads, head, rot, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 512, tokens).astype(np.int32), _data((tokens, q_heads * head), seed + 1),
            _data((tokens, k_heads * head), seed + 2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head, rot, q_heads, k_heads", [(128, 128, 8, 1), (80, 80, 4, 4), (128, 64, 3, 1), (64, 32, 2, 0)])
def test_torch_kernels_match_native(head, rot, q_heads, k_heads, neox, dtype):
    """The C++ CPU kernel and the Triton kernel (interpreter) against forward_native."""
    pos, q, k = _kernel_inputs(21, q_heads, k_heads, head, rot)
    op = RotaryEmbedding(head, rot, 512, 10000.0, neox)
    tdt = getattr(torch, dtype)
    args = (torch.from_numpy(pos), torch.from_numpy(q).to(tdt), torch.from_numpy(k).to(tdt) if k_heads else None)
    want = op.forward_native(*args)
    for method in (op.forward_cpu, op.forward_cuda):
        got = method(*args)
        _close(got[0], want[0], dtype)
        if k_heads:
            _close(got[1], want[1], dtype)
        else:
            assert got[1] is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head, rot, q_heads, k_heads", [(128, 96, 4, 2), (80, 80, 9, 1), (64, 64, 3, 0)])
def test_pallas_kernel_matches_native_over_ragged_blocks(head, rot, q_heads, k_heads, neox, dtype):
    """Several token blocks with a ragged last one (block_tokens=8, 21 tokens), head groups of
    lcm(D, 128) lanes with a partial last group (9 heads of 80), key in the same launch."""
    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.rotary import rotary

    pos, q, k = _kernel_inputs(21, q_heads, k_heads, head, rot, seed=3)
    op = RotaryEmbedding(head, rot, 512, 10000.0, neox)
    jq = jnp.asarray(q).astype(dtype).reshape(21, q_heads, head)
    jk = jnp.asarray(k).astype(dtype).reshape(21, k_heads, head) if k_heads else None
    cos, sin = op.cos_sin(jnp.asarray(pos), jq.dtype)
    got = rotary(jq, jk, cos, sin, rotary_dim=rot, is_neox_style=neox, interpret=interpret_mode(), block_tokens=8)
    want = op.forward_native(jnp.asarray(pos), jq, jk)
    _close(got[0], want[0], dtype)
    if k_heads:
        _close(got[1], want[1], dtype)
    else:
        assert got[1] is None


@pytest.mark.parametrize("q_heads, k_heads", [(0, 2), (3, 0)], ids=["no_query_heads", "empty_key"])
@pytest.mark.parametrize("frontend, platform", [("torch", "cpu"), ("torch", "cuda"), ("jax", "tpu")])
def test_kernels_rotate_the_key_when_the_query_has_no_heads(frontend, platform, q_heads, k_heads):
    """A query of 0 heads (an empty array) must not stop the key's rotation: the three kernels
    returned the key unrotated (Pallas) or uninitialised memory (Triton, C++)."""
    pos, q, k = _kernel_inputs(5, q_heads, k_heads, 64, 64, seed=4)
    op = RotaryEmbedding(64, 64, 512, 10000.0, True)
    args = lambda: (testing.to_frontend(pos, frontend, "int32"),  # noqa: E731
                    testing.to_frontend(q.reshape(5, q_heads, 64), frontend, "float32"),
                    testing.to_frontend(k.reshape(5, k_heads, 64), frontend, "float32"))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = op(*args())
        method, reason = op.last_run(frontend)
    assert method != "forward_native", reason
    want = op.forward_native(*args())
    for g, w in zip(got, want):
        _close(g, w)


# ------------------------------------------------------------------ jax: jit, vmap, clamp


@pytest.mark.parametrize("platform, method", [("cpu", "forward_native"), ("tpu", "forward_tpu")])
def test_jax_jit_and_vmap(platform, method):
    op = RotaryEmbedding(80, 80, 64, 10000.0, True)
    pos, q, k = _kernel_inputs(6, 2, 1, 80, 80, seed=5)
    pos = pos % 64
    batch_q = jnp.asarray(np.stack([q, 2 * q]))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = jax.jit(op)(jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k))
        vgot = jax.vmap(lambda x: op(jnp.asarray(pos), x, jnp.asarray(k))[0])(batch_q)
        assert op.last_run("jax", platform)[0] == method
    want = op.forward_native(jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k))
    _close(got[0], want[0])
    _close(got[1], want[1])
    for i in range(2):
        _close(vgot[i], op.forward_native(jnp.asarray(pos), batch_q[i], jnp.asarray(k))[0])


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_positions_under_jit_clamp_into_the_cache(platform):
    """Under jit the values are not visible: out-of-range positions clamp to [0, max_position)
    (documented on RotaryEmbedding), where eager calls refuse them."""
    op = RotaryEmbedding(64, 64, 32, 10000.0, True)
    q = jnp.asarray(_data((3, 64), 6))
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got, _ = jax.jit(op)(jnp.asarray([-5, 3, 99], jnp.int32), q)
    want, _ = op.forward_native(jnp.asarray([0, 3, 31], jnp.int32), q)
    _close(got, want)


# ------------------------------------------------------------------ torch.compile, key None


def test_torch_compile_with_and_without_key():
    """The torch.library schema derived from forward_native (-> (Tensor, Tensor?)) carries a None
    key through torch.compile."""
    from dualop.backends.torch.library import op_signature

    assert op_signature(RotaryEmbedding).returns == "(Tensor, Tensor?)"
    op = RotaryEmbedding(64, 64, 64, 10000.0, True)
    pos, q, k = (torch.from_numpy(a) for a in _kernel_inputs(5, 2, 1, 64, 64, seed=7))
    pos = pos % 64
    with set_config(OpsConfig(["all"])):
        no_key = torch.compile(lambda p, x: op(p, x), fullgraph=True)(pos, q)
        with_key = torch.compile(lambda p, x, y: op(p, x, y), fullgraph=True)(pos, q, k)
    assert no_key[1] is None
    want = op.forward_native(pos, q, k)
    _close(no_key[0], want[0])
    _close(with_key[0], want[0])
    _close(with_key[1], want[1])


# ------------------------------------------------------------------ bad input


def _refuses(exc, match, fn, *args):
    with pytest.raises(exc, match=match):
        fn(*args)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_bad_input_is_refused_before_launch(frontend):
    def arr(a, dtype=None):
        if frontend == "torch":
            t = torch.from_numpy(np.asarray(a))
            return t if dtype is None else t.to(getattr(torch, dtype))
        return jnp.asarray(a) if dtype is None else jnp.asarray(a).astype(dtype)

    op = RotaryEmbedding(64, 64, 32, 10000.0, True)
    pos, q, k = arr(np.arange(3, dtype=np.int32)), arr(_data((3, 128))), arr(_data((3, 64)))
    _refuses(TypeError, "rotary_embedding: argument 'positions' has dtype float32", op, arr(np.zeros(3, np.float32)), q)
    _refuses(ValueError, r"rotary_embedding: argument 'positions' holds values in \[0, 40\]", op,
             arr(np.array([0, 1, 40], np.int32)), q)
    _refuses(ValueError, r"rotary_embedding: argument 'positions' holds values in \[-1, 1\]", op,
             arr(np.array([0, 1, -1], np.int32)), q)
    _refuses(ValueError, "rotary_embedding: argument 'query' has shape", op, pos, arr(_data((3, 100))))
    _refuses(ValueError, "rotary_embedding: argument 'key' has shape", op, pos, q, arr(_data((4, 64))))
    _refuses(TypeError, "rotary_embedding: argument 'key' has dtype bfloat16", op, pos, q, arr(_data((3, 64)), "bfloat16"))
    vision = ApplyRotaryEmb()
    x, cs = arr(_data((5, 2, 80))), arr(_data((5, 40)))
    _refuses(ValueError, r"apply_rotary_emb: argument 'cos' has shape \(5, 80\)", vision, x, arr(_data((5, 80))), cs)
    _refuses(ValueError, r"apply_rotary_emb: argument 'sin' has shape \(4, 40\)", vision, x, cs, arr(_data((4, 40))))
    _refuses(ValueError, "apply_rotary_emb: argument 'x' must have at least 3", vision, arr(_data((5, 80))), cs, cs)
    dual = DualChunkRotaryEmbedding(64, 64, 32, 10000.0, True, None, 16, 4)
    _refuses(TypeError, "dual_chunk_rotary_embedding: argument 'key' is required", dual, pos, q)
    _refuses(ValueError, r"dual_chunk_rotary_embedding: argument 'positions' holds values in \[30, 32\]", dual,
             pos, q, k, arr(np.full(3, 30, np.int32)))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="rotary_dim must be even and at most head_size"):
        RotaryEmbedding(64, 96, 32, 10000.0)
    with pytest.raises(ValueError, match="local_size must be an int in"):
        DualChunkRotaryEmbedding(64, 64, 32, 10000.0, True, None, 16, 16)


def test_a_kernel_never_launches_on_bad_input(monkeypatch):
    """check_inputs runs before the kernel: a kernel that would record its launch never does."""
    import dualop.ops.rotary as rotary_module

    launched = []
    monkeypatch.setattr(rotary_module, "rotate_heads", lambda *a, **kw: launched.append(a))
    op = RotaryEmbedding(64, 64, 32, 10000.0, True)
    with override_platform("cpu"), set_config(OpsConfig(["all"])), pytest.raises(ValueError):
        op(torch.tensor([0, 99], dtype=torch.int32), torch.zeros(2, 64))
    assert launched == []


# ------------------------------------------------------------------ layers


def test_rope_layers_in_both_frontends():
    from dualop.jax import layers as jl
    from dualop.torch import layers as tl

    pos, q, k = _kernel_inputs(4, 2, 1, 64, 64, seed=8)
    pos = pos % 32
    op = RotaryEmbedding(64, 64, 32, 10000.0, True)
    want = op.forward_native(torch.from_numpy(pos), torch.from_numpy(q), torch.from_numpy(k))
    layer = tl.RotaryEmbedding(64, 64, 32, 10000.0, True)
    seq = torch.nn.Sequential(layer)
    got = seq[0](torch.from_numpy(pos), torch.from_numpy(q), torch.from_numpy(k))
    _close(got[0], want[0])
    _close(got[1], want[1])
    jgot = jax.jit(jl.RotaryEmbedding(64, 64, 32, 10000.0, True))(jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k))
    _close(jgot[0], want[0])
    x, cs = _data((3, 2, 80), 9), _data((3, 40), 10, 1.0)
    vision = tl.ApplyRotaryEmb(is_neox_style=False)(torch.from_numpy(x), torch.from_numpy(cs), torch.from_numpy(cs))
    _close(vision, jl.ApplyRotaryEmb(is_neox_style=False)(jnp.asarray(x), jnp.asarray(cs), jnp.asarray(cs)))
    assert isinstance(tl.DualChunkRotaryEmbedding(64, 64, 32, 1e4, True, None, 16, 4), torch.nn.Module)


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_pallas_kernel_puts_non_finite_values_where_native_does(special):
    """The MXU pair swap must not smear a non-finite channel over its head group (0 * inf)."""
    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.rotary import rotary

    op = RotaryEmbedding(80, 80, 64, 10000.0, True)
    q = _data((3, 4, 80), 11)
    q[1, 2, 5] = special
    pos = jnp.asarray([0, 7, 63], jnp.int32)
    cos, sin = op.cos_sin(pos, jnp.float32)
    got, _ = rotary(jnp.asarray(q), None, cos, sin, rotary_dim=80, is_neox_style=True, interpret=interpret_mode())
    want, _ = op.forward_native(pos, jnp.asarray(q))
    _close(got, want)
    assert int(jnp.sum(~jnp.isfinite(got))) == int(jnp.sum(~jnp.isfinite(want))) == 2


@pytest.mark.parametrize("neox, special", [(True, -np.inf), (False, np.nan), (False, np.inf)])
def test_pallas_kernel_keeps_a_non_finite_angle_where_the_native_body_puts_it(neox, special):
    """A non-finite cos/sin value reaches only the channels that read it (the kernel spreads cos/sin
    over channels by a 0/1 product, where 0 * inf would make the whole head group NaN)."""
    seq, heads, head = 4, 2, 64
    x = jnp.asarray(_data((seq, heads, head), 3))
    freqs = np.outer(np.arange(seq), 1.0 / 10000.0 ** (np.arange(0, head, 2) / head)).astype(np.float32)
    cos, sin = np.cos(freqs), np.sin(freqs)
    (cos if np.isnan(special) else sin)[1, 5] = special
    op = ApplyRotaryEmb(is_neox_style=neox, enable_fp32_compute=True)
    want = testing.to_numpy(op.forward_native(x, jnp.asarray(cos), jnp.asarray(sin)))
    with set_config(OpsConfig(["all"])), override_platform("tpu"):
        op.last_fallback = None
        got = testing.to_numpy(op(x, jnp.asarray(cos), jnp.asarray(sin)))
        assert op.last_run("jax")[0] == "forward_tpu"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert 0 < np.count_nonzero(~np.isfinite(want)) < want.size // 8
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
