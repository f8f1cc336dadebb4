"""The scaled rotary embeddings and get_rope against code nobody here wrote: Hugging Face
transformers' rope-init functions (``ROPE_INIT_FUNCTIONS``: inverse frequencies and attention
factor), its ``apply_rotary_pos_emb`` (Llama for neox, GPT-J for interleaved pairs), and Qwen2-VL's
/ Qwen3-VL's multimodal rotary embeddings for mrope. Both frontends (torch, jax); get_rope's
mapping, cache and errors."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import torch
import transformers
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

from dualop import ops, testing
from dualop.ops import get_rope
from dualop.ops import rope_scaling
from dualop.ops._checks import dtype_name

# Against transformers (the same version in both environments): run once, in 'latest' (conftest).
pytestmark = pytest.mark.reference

jnp = jax.numpy

HEAD = 64
FRONTENDS = ["torch", "jax"]


def hf_config(max_position: int, params: dict, head: int = HEAD) -> LlamaConfig:
    return LlamaConfig(hidden_size=2 * head, num_attention_heads=2, head_dim=head,
                       max_position_embeddings=max_position, rope_parameters=dict(params))


def hf_cos_sin(config, positions: np.ndarray, seq_len: int | None = None):
    """Hugging Face's per-token cos/sin halves ``[T, rotary_dim // 2]`` (times its attention
    factor) for ``config``'s rope type, from its own inverse frequencies."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, scale = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)  # honours partial
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    freqs = torch.from_numpy(positions.astype(np.float32))[:, None] * inv_freq.float()[None, :]
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


def ours_cos_sin(rope, positions: np.ndarray):
    cos, sin = rope.cos_sin(torch.from_numpy(positions.astype(np.int64)), torch.float32)
    return cos.numpy(), sin.numpy()


def assert_close(got, want, atol=2e-4, rtol=1e-4):
    np.testing.assert_allclose(testing.to_numpy(got), testing.to_numpy(want), atol=atol, rtol=rtol)


def positions_below(limit: int, count: int = 40, seed: int = 0) -> np.ndarray:
    """Random positions in [0, limit), with the two ends included."""
    rng = np.random.default_rng(seed)
    return np.concatenate([[0, limit - 1], rng.integers(0, limit, count - 2)]).astype(np.int64)


# --- the cache of every type against Hugging Face's rope-init functions --------------------------

# (id, max_position passed to get_rope and to HF's config, rope_parameters, seq_len for HF's
# dynamic/longrope functions, positions' upper bound)
HF_TYPES = [
    ("default", 2048, {"rope_type": "default", "rope_theta": 10000.0}, None, 2048),
    ("default-partial", 2048, {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
     None, 2048),
    ("linear", 1024, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}, None, 2560),
    ("dynamic", 512, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, 2048, 2048),
    ("yarn", 4096,
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}, None, 4096),
    ("yarn-betas-untruncated", 4096,
     {"rope_type": "yarn", "rope_theta": 1e6, "factor": 3.0, "original_max_position_embeddings": 512,
      "beta_fast": 16, "beta_slow": 2, "truncate": False}, None, 1536),
    ("yarn-attention_factor-partial", 4096,
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
      "attention_factor": 0.8, "partial_rotary_factor": 0.5}, None, 4096),
    ("yarn-mscale", 4096,
     {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
      "mscale": 1.0, "mscale_all_dim": 0.5}, None, 2560),
    ("llama3", 2048,
     {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 256}, None, 2048),
    ("longrope-short", 2048,
     {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
      "short_factor": [1.0 + 0.05 * i for i in range(HEAD // 2)],
      "long_factor": [1.0 + 0.5 * i for i in range(HEAD // 2)]}, 512, 512),
    ("longrope-long", 2048,
     {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
      "short_factor": [1.0 + 0.05 * i for i in range(HEAD // 2)],
      "long_factor": [1.0 + 0.5 * i for i in range(HEAD // 2)]}, 2048, 2048),
]


@pytest.mark.parametrize("max_position, params, seq_len, limit", [t[1:] for t in HF_TYPES],
                         ids=[t[0] for t in HF_TYPES])
def test_cache_matches_transformers_rope_init(max_position, params, seq_len, limit):
    rope = get_rope(HEAD, max_position, True, params)
    positions = positions_below(limit)
    if params["rope_type"] == "longrope":
        positions[1] = seq_len - 1  # the call's largest position picks the factors, as HF's seq_len does
    want_cos, want_sin = hf_cos_sin(hf_config(max_position, params), positions, seq_len)
    got_cos, got_sin = ours_cos_sin(rope, positions)
    assert got_cos.shape == want_cos.shape
    assert_close(got_cos, want_cos)
    assert_close(got_sin, want_sin)


def test_every_transformers_rope_type_is_tested_or_refused():
    """Every type Hugging Face has is either compared above or refused by get_rope by name."""
    tested = {t[2]["rope_type"] for t in HF_TYPES}
    for rope_type in ROPE_INIT_FUNCTIONS:
        if rope_type in tested:
            continue
        with pytest.raises(ValueError, match=rf"unknown rope_type '{rope_type}'"):
            get_rope(HEAD, 128, True, {"rope_type": rope_type, "factor": 2.0})
    assert {"linear", "dynamic", "yarn", "longrope", "llama3"} <= tested


def test_deepseek_yarn_matches_transformers_yarn_with_both_mscales():
    """deepseek_yarn's mscale / mscale_all_dim ratio is HF yarn's when both are given; with neither
    the ratio is yarn_get_mscale(factor), HF's default."""
    for extra in ({"mscale": 0.707, "mscale_all_dim": 0.5}, {}):
        params = {"rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64, **extra}
        rope = get_rope(HEAD, 2560, True, {"rope_type": "deepseek_yarn", **params})
        assert type(rope) is ops.DeepseekScalingRotaryEmbedding
        positions = positions_below(2560)
        want = hf_cos_sin(hf_config(2560, {"rope_type": "yarn", **params}), positions)
        for got, ref in zip(ours_cos_sin(rope, positions), want):
            assert_close(got, ref)


def test_deepseek_attn_factor_and_engine_default_denominator():
    rope = ops.DeepseekScalingRotaryEmbedding(HEAD, HEAD, 64, 10000.0, True, 40.0, mscale=0.707, attn_factor=1.5)
    assert rope.mscale == pytest.approx((0.1 * 0.707 * math.log(40) + 1) * 1.5)  # mscale_all_dim=0: denominator 1


def test_dynamic_alpha_is_default_rope_with_the_alpha_base():
    """Hunyuan's alpha: HF's default rope with theta * alpha ** (d / (d - 2))."""
    rope = get_rope(HEAD, 1024, True, {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0})
    assert type(rope) is ops.DynamicNTKAlphaRotaryEmbedding
    theta = 10000.0 * 1000.0 ** (HEAD / (HEAD - 2))
    positions = positions_below(1024)
    want = hf_cos_sin(hf_config(1024, {"rope_type": "default", "rope_theta": theta}), positions)
    for got, ref in zip(ours_cos_sin(rope, positions), want):
        assert_close(got, ref)


def test_fixed_ntk_is_linear_scaling_of_the_raised_base():
    """Fixed NTK (base * factor, frequencies / factor ** (2 / d)) is HF's linear rope with factor
    ``factor ** (2 / d)`` over theta ``base * factor``."""
    rope = get_rope(HEAD, 1024, True, {"rope_type": "ntk", "rope_theta": 10000.0, "factor": 8.0})
    assert type(rope) is ops.NTKScalingRotaryEmbedding and rope.cache_positions == 1024
    params = {"rope_type": "linear", "rope_theta": 80000.0, "factor": 8.0 ** (2 / HEAD)}
    positions = positions_below(1024)
    want = hf_cos_sin(hf_config(1024, params), positions)
    for got, ref in zip(ours_cos_sin(rope, positions), want):
        assert_close(got, ref)


def test_mixed_ntk_against_float64_formula():
    """Mixed NTK has no transformers counterpart: frequency i (1-based) divided by
    exp(ln(factor) * (i / (d / 2)) ** b), checked in float64 (https://kexue.fm/archives/9706)."""
    factor, b = 8.0, 0.75
    rope = get_rope(HEAD, 512, True, {"rope_type": "ntk", "rope_theta": 10000.0, "factor": factor, "mixed_b": b})
    i = np.arange(1, HEAD // 2 + 1, dtype=np.float64)
    inv_freq = 10000.0 ** (-2 * (i - 1) / HEAD) / np.exp(np.log(factor) * (i / (HEAD / 2)) ** b)
    positions = positions_below(512)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = ours_cos_sin(rope, positions)
    assert_close(cos, np.cos(angles))
    assert_close(sin, np.sin(angles))


def test_linear_with_several_factors_stacks_one_block_each():
    rope = ops.LinearScalingRotaryEmbedding(HEAD, HEAD, 100, 10000.0, True, [1.0, 2.0, 4.0])
    assert rope.scaling_factor_to_offset == {1.0: 0, 2.0: 100, 4.0: 300}
    assert rope.cache_positions == 700
    for factor, offset in rope.scaling_factor_to_offset.items():
        positions = positions_below(int(100 * factor))
        want = hf_cos_sin(hf_config(100, {"rope_type": "linear", "rope_theta": 10000.0, "factor": factor}), positions)
        got = ours_cos_sin(rope, positions + offset)
        for g, w in zip(got, want):
            assert_close(g, w)


def test_longrope_switches_factors_for_the_whole_call():
    """One position past the original context moves every token of the call to the long factors."""
    params = dict(HF_TYPES[-1][2])
    rope = get_rope(HEAD, 2048, True, params)
    short = ours_cos_sin(rope, np.array([5, 511]))[0]
    long_ = ours_cos_sin(rope, np.array([5, 512]))[0]
    assert np.abs(short[0] - long_[0]).max() > 1e-3  # position 5 itself changed block
    fixed = ops.Phi3LongRoPEScaledRotaryEmbedding(HEAD, HEAD, 2048, 512, 10000.0, True, None,
                                                  params["short_factor"], params["long_factor"], use_long_rope=True)
    assert_close(ours_cos_sin(fixed, np.array([5, 6]))[0][0], long_[0], atol=0, rtol=0)


def test_longrope_under_jit_picks_the_block_from_traced_positions():
    params = dict(HF_TYPES[-1][2])
    rope = get_rope(HEAD, 2048, True, params)
    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, HEAD)), jnp.float32)
    for positions in ([5, 511], [5, 512]):
        p = jnp.asarray(positions, jnp.int32)
        eager, _ = rope(p, q)
        jitted, _ = jax.jit(lambda p, q: rope(p, q))(p, q)
        assert_close(jitted, eager, atol=1e-6)
        want = ops.RotaryEmbedding.forward_native(rope, torch.tensor(positions), torch.from_numpy(np.array(q)))[0]
        assert_close(eager, want, atol=1e-5)


# --- the op's output against Hugging Face's apply_rotary_pos_emb ---------------------------------


def hf_rotate(query: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int, neox: bool) -> np.ndarray:
    """``query`` ``[T, H, D]`` rotated by HF's Llama (neox) or GPT-J (interleaved) function."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply

    x = torch.from_numpy(query)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    c, s = torch.from_numpy(cos), torch.from_numpy(sin)
    if neox:
        full_cos, full_sin = torch.cat((c, c), -1)[None], torch.cat((s, s), -1)[None]  # [1, T, rd]
        out, _ = llama_apply(rot.transpose(0, 1)[None], rot.transpose(0, 1)[None], full_cos, full_sin)
        out = out[0].transpose(0, 1)
    else:
        out = gptj_apply(rot[None], s[None], c[None])[0]  # [B, T, H, rd] with [B, T, rd/2] sin, cos
    return torch.cat((out, rest), -1).numpy()


def frontend_array(a: np.ndarray, frontend: str):
    if frontend == "jax":
        return jnp.asarray(a)
    return torch.from_numpy(a)


APPLY_TYPES = [t for t in HF_TYPES if t[0] in ("linear", "dynamic", "yarn-attention_factor-partial", "llama3",
                                               "longrope-long")]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("max_position, params, seq_len, limit, neox", [
    pytest.param(*t[1:], neox, id=f"{t[0]}-{'neox' if neox else 'gptj'}")
    for t in APPLY_TYPES for neox in (True, False)
    if neox or t[2]["rope_type"] != "longrope"  # longrope is neox-only (test_longrope_refuses_gptj_style)
])
def test_op_matches_transformers_apply_rotary_pos_emb(max_position, params, seq_len, limit, neox, frontend):
    rope = get_rope(HEAD, max_position, neox, params)
    rng = np.random.default_rng(1)
    positions = positions_below(limit, 11)
    if seq_len is not None:
        positions[1] = seq_len - 1
    query = rng.standard_normal((11, 4, HEAD)).astype(np.float32)
    key = rng.standard_normal((11, HEAD)).astype(np.float32)  # one kv head, [T, H*D] layout
    cos, sin = hf_cos_sin(hf_config(max_position, params), positions, seq_len)
    got_q, got_k = rope(frontend_array(positions.astype(np.int32), frontend), frontend_array(query, frontend),
                        frontend_array(key, frontend))
    assert_close(got_q, hf_rotate(query, cos, sin, rope.rotary_dim, neox), atol=1e-3)
    want_k = hf_rotate(key.reshape(11, 1, HEAD), cos, sin, rope.rotary_dim, neox).reshape(11, HEAD)
    assert_close(got_k, want_k, atol=1e-3)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_bfloat16_output_follows_the_float32_reference(frontend):
    """The cache is cast to the query's dtype (bfloat16 here) before rotating, as the engine does:
    the reference rotates the bfloat16 query by bfloat16-rounded cos/sin in float32."""
    _, max_position, params, _, limit = HF_TYPES[4]  # yarn
    rope = get_rope(HEAD, max_position, True, params)
    positions = positions_below(limit, 9)
    query = np.random.default_rng(2).standard_normal((9, 2 * HEAD)).astype(np.float32)
    q = testing.to_frontend(query, frontend, "bfloat16")

    def bf16(a):
        return torch.from_numpy(np.asarray(a, np.float32)).bfloat16().float().numpy()

    cos, sin = hf_cos_sin(hf_config(max_position, params), positions)
    want = hf_rotate(bf16(query).reshape(9, 2, HEAD), bf16(cos), bf16(sin), HEAD, True).reshape(9, 2 * HEAD)
    got, _ = rope(frontend_array(positions.astype(np.int32), frontend), q)
    assert dtype_name(got) == "bfloat16"
    cmp = testing.compare(testing.to_numpy(got), want, "bfloat16")
    assert cmp.ok, (cmp.max_abs, cmp.max_rel)


# --- mrope against Qwen2-VL / Qwen3-VL ----------------------------------------------------------


def qwen_reference(positions: np.ndarray, query: np.ndarray, params: dict, max_position: int, interleaved: bool):
    """Qwen2-VL's (or Qwen3-VL's interleaved) text rotary embedding and apply_rotary_pos_emb."""
    if interleaved:
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding as Rotary
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb
    config = Config(hidden_size=2 * HEAD, num_attention_heads=2, head_dim=HEAD, max_position_embeddings=max_position,
                    rope_parameters=dict(params))
    x = torch.from_numpy(query)  # [T, H, D]
    rows = positions if positions.ndim == 2 else np.stack([positions] * 3)  # text: the same position thrice
    pos = torch.from_numpy(rows.reshape(3, 1, -1))
    with torch.no_grad():
        cos, sin = Rotary(config)(x, pos)
        out, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    return out[0].transpose(0, 1).numpy()


MROPE = [
    ("qwen2-vl", {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}, 512, False),
    ("qwen3-vl-interleaved", {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10],
                              "mrope_interleaved": True}, 512, True),
    ("qwen2-vl-yarn", {"rope_type": "yarn", "rope_theta": 1e6, "mrope_section": [8, 12, 12], "factor": 4.0,
                       "original_max_position_embeddings": 256}, 1024, False),
]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("one_row", [False, True], ids=["3xT", "T"])
@pytest.mark.parametrize("params, max_position, interleaved", [m[1:] for m in MROPE], ids=[m[0] for m in MROPE])
def test_mrope_matches_qwen_vl(params, max_position, interleaved, one_row, frontend):
    rope = get_rope(HEAD, max_position, True, params)
    assert type(rope) is ops.MRotaryEmbedding
    rng = np.random.default_rng(3)
    tokens = 13
    limit = min(rope.cache_positions, 4 * max_position)
    positions = rng.integers(0, limit, tokens if one_row else (3, tokens)).astype(np.int64)
    query = rng.standard_normal((tokens, 3, HEAD)).astype(np.float32)
    want = qwen_reference(positions, query, params, max_position, interleaved)
    got, key = rope(frontend_array(positions.astype(np.int32), frontend),
                    frontend_array(query.reshape(tokens, -1), frontend))
    assert key is None
    assert_close(testing.to_numpy(got).reshape(tokens, 3, HEAD), want, atol=1e-3)


def test_mrope_text_positions_are_plain_rope():
    rope = get_rope(HEAD, 512, True, MROPE[0][1])
    plain = get_rope(HEAD, 2048, True, {"rope_type": "default", "rope_theta": 1e6})
    positions = torch.tensor([0, 7, 2047])
    same = torch.stack([positions] * 3)
    for p in (positions, same):
        assert_close(rope.cos_sin(p, torch.float32)[0], plain.cos_sin(positions, torch.float32)[0], atol=0, rtol=0)


def test_mrope_under_jit():
    rope = get_rope(HEAD, 512, True, MROPE[1][1])
    rng = np.random.default_rng(4)
    p = jnp.asarray(rng.integers(0, 2048, (3, 6)), jnp.int32)
    q = jnp.asarray(rng.standard_normal((6, 2 * HEAD)), jnp.float32)
    assert_close(jax.jit(lambda p, q: rope(p, q)[0])(p, q), rope(p, q)[0], atol=1e-6)


def test_mrope_refuses_bad_positions_and_sections():
    rope = get_rope(HEAD, 64, True, MROPE[0][1])
    q = torch.zeros(4, HEAD)
    with pytest.raises(ValueError,
                       match=r"rotary_embedding: argument 'positions' has shape \(2, 4\); expected \[T\] or \[3, T\]"):
        rope(torch.zeros(2, 4, dtype=torch.int64), q)
    with pytest.raises(ValueError, match=r"argument 'positions' holds values in \[0, 256\]"):
        rope(torch.tensor([[0, 1, 2, 3], [0, 0, 0, 0], [0, 0, 0, 256]]), q)
    with pytest.raises(ValueError, match=r"argument 'query' has shape"):
        rope(torch.zeros(3, 5, dtype=torch.int64), q)
    with pytest.raises(ValueError, match=r"mrope_section must be 3 non-negative ints .* rotary_dim // 2 = 32"):
        ops.MRotaryEmbedding(HEAD, HEAD, 64, 1e6, True, None, mrope_section=[8, 8, 8])
    no_section = ops.MRotaryEmbedding(HEAD, HEAD, 64, 1e6, True, None)
    with pytest.raises(ValueError, match=r"has no mrope_section"):
        no_section(torch.zeros(3, 4, dtype=torch.int64), q)


# --- get_rope: mapping, cache, errors -------------------------------------------------------------

MAPPING = [
    (None, ops.RotaryEmbedding),
    ({"rope_type": "linear", "factor": 2.0}, ops.LinearScalingRotaryEmbedding),
    ({"rope_type": "dynamic", "factor": 2.0}, ops.DynamicNTKScalingRotaryEmbedding),
    ({"rope_type": "dynamic", "alpha": 2.0}, ops.DynamicNTKAlphaRotaryEmbedding),
    ({"rope_type": "ntk", "factor": 2.0}, ops.NTKScalingRotaryEmbedding),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}, ops.YaRNScalingRotaryEmbedding),
    ({"rope_type": "deepseek_yarn", "factor": 2.0, "original_max_position_embeddings": 64},
     ops.DeepseekScalingRotaryEmbedding),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, ops.Llama3RotaryEmbedding),
    ({"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0] * 32,
      "long_factor": [2.0] * 32}, ops.Phi3LongRoPEScaledRotaryEmbedding),
    ({"mrope_section": [16, 8, 8]}, ops.MRotaryEmbedding),
]


@pytest.mark.parametrize("params, cls", MAPPING, ids=lambda v: getattr(v, "__name__", None))
def test_get_rope_maps_types_to_the_engine_classes(params, cls):
    rope = get_rope(HEAD, 256, True, params)
    assert type(rope) is cls
    assert rope.name == "rotary_embedding"  # variants share the registered op, as in the engine
    assert rope.cos_sin_cache.dtype == np.float32


def test_get_rope_caches_instances_per_arguments():
    params = {"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0] * 32,
              "long_factor": [2.0] * 32}
    first = get_rope(HEAD, 256, True, params)
    assert get_rope(HEAD, 256, True, {k: (list(v) if isinstance(v, list) else v) for k, v in params.items()}) is first
    assert get_rope(HEAD, 256, True, {**params, "long_factor": [3.0] * 32}) is not first
    assert get_rope(HEAD, 256, True, params, dtype="bfloat16") is not first
    bf16 = get_rope(HEAD, 256, True, params, dtype="bfloat16")
    assert get_rope(HEAD, 256, True, params, dtype=torch.bfloat16) is bf16
    assert get_rope(HEAD, 512, True, params) is not first


def test_get_rope_partial_rotary_factor():
    rope = get_rope(80, 128, True, {"rope_theta": 10000.0, "partial_rotary_factor": 0.4})
    assert rope.rotary_dim == 32 and rope.head_size == 80
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=rf"get_rope: partial_rotary_factor must be in \(0, 1\], got {bad}"):
            get_rope(HEAD, 128, True, {"partial_rotary_factor": bad})


@pytest.mark.parametrize("params, message", [
    ({"rope_type": "su"}, r"get_rope: unknown rope_type 'su'; expected one of default, linear"),
    ({"rope_type": "linear"}, r"rope_type 'linear' needs rope_parameters\['factor'\]"),
    ({"rope_type": "dynamic"}, r"rope_type 'dynamic' needs rope_parameters\['factor'\] or \['alpha'\]"),
    ({"rope_type": "yarn", "factor": 2.0},
     r"rope_type 'yarn' needs rope_parameters\['original_max_position_embeddings'\]"),
    ({"rope_type": "linear", "factor": -1.0},
     r"LinearScalingRotaryEmbedding\): scaling_factors must be a positive number"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1.0] * 3,
      "long_factor": [1.0] * 32}, r"short_factor must be a list of rotary_dim // 2 = 32 numbers"),
])
def test_get_rope_errors_name_the_problem(params, message):
    with pytest.raises(ValueError, match=message):
        get_rope(HEAD, 128, True, params)


def test_longrope_refuses_gptj_style():
    with pytest.raises(ValueError, match=r"Phi3LongRoPEScaledRotaryEmbedding\): only neox style"):
        get_rope(HEAD, 256, False, MAPPING[8][0])


def test_dual_chunk_config_builds_the_dual_chunk_op():
    config = {"chunk_size": 64, "local_size": 16, "sparse_attention_config": {"a": [1, 2]}}
    rope = get_rope(HEAD, 256, True, {"rope_theta": 10000.0}, dual_chunk_attention_config=config)
    assert type(rope) is ops.DualChunkRotaryEmbedding
    assert (rope.chunk_size, rope.local_size) == (64, 16)
    assert get_rope(HEAD, 256, True, {"rope_theta": 10000.0},
                    dual_chunk_attention_config={**config, "sparse_attention_config": None}) is rope


def test_transformers_version_is_reported():
    """Both environments carry transformers 5.x (ROPE_INIT_FUNCTIONS with these signatures)."""
    assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__


def test_check_cases_are_collected_from_the_variants_module():
    labels = {c.label for c in testing.cases_for(["rotary_embedding"])}
    assert {"rotary_embedding[yarn]", "rotary_embedding[llama3,gptj,partial]", "rotary_embedding[mrope]"} <= labels
    assert rope_scaling.check_cases()[0].op == "rotary_embedding"
