"""Every seed op called the way the reference serving engine calls it.

``ENGINE_CALLS`` has one row per op of the engine's CustomOp documents (the op names dualop
registers): the engine's call, written as its code makes it (positional and keyword as there),
and where dualop takes that call:

- ``op``: the op itself takes it as it is;
- ``op+params``: the engine's arguments as it passes them, then the parameters its module owns
  (dualop ops hold no parameters: they are arguments);
- ``layer``: the engine's module owns parameters, so the layer of ``dualop.torch.layers`` that owns
  them takes the engine's call as it is;
- ``method``: a method of the op named as the engine's (``apply(layer, ...)``) or, for
  transformers' experts call, ``routed``;
- ``refused``: the engine's own layer refuses the call too (its LM head has no forward): the op
  refuses it with a ValueError/TypeError saying what to call instead, and the dualop call runs.

The stateful layers (the mixers, multi-head latent attention) take the engine's call as the engine
makes it: the batch metadata from ``dualop.torch.forward_context``, the caches bound to the layer's
``kv_cache``; their rows check it with no context set (one new sequence) and in a context.

Each row builds small torch CPU inputs and returns pairs (the engine's way, the dualop way); the
dualop way is ``forward_native`` with every argument by keyword (for a stateful layer, its dualop
call: caches and metadata as arguments). Both run under ``custom_ops =
["none"]``, so both run ``forward_native`` and must agree exactly: a difference is an argument bound
to the wrong parameter. The platform paths of ``mm_encoder_attn``'s tensor ``max_seqlen`` (the one
argument whose type changed) are tested below the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from dualop import OpsConfig, override_platform, set_config, testing
from dualop import ops
from dualop.custom_op import CustomOp
from dualop.torch import layers

# The ops the engine's CustomOp documents list (the seeds: their op families and register names).
SEED_OPS = (
    "mm_encoder_attn", "rel_pos_attention", "multi_head_latent_attention",
    "silu_and_mul", "mul_and_silu", "gelu_new", "gelu_fast", "quick_gelu", "gelu_and_mul", "gelu_and_mul_sparse",
    "relu2", "xielu", "swigluoai_and_mul", "fatrelu_and_mul",
    "conv2d", "conv3d",
    "vocab_parallel_embedding", "parallel_lm_head",
    "row_parallel_linear", "column_parallel_linear", "replicated_linear",
    "logits_processor",
    "mamba_mixer", "mamba_mixer2", "mixer2_gated_rms_norm", "plamo2_mamba_mixer", "short_conv",
    "fused_moe", "modular_fused_moe", "unquantized_fused_moe", "transformers_fused_moe", "grouped_topk",
    "rms_norm", "rms_norm_gated", "gemma_rms_norm",
    "quant_fp8",
    "rotary_embedding", "dual_chunk_rotary_embedding", "apply_rotary_emb",
)

Pair = tuple[Callable[[], Any], Callable[[], Any] | None]


@dataclasses.dataclass(frozen=True)
class EngineCall:
    """How the engine calls one op (``engine``, its code's call), where dualop takes it (``where``:
    see the module docstring), the refusal's message for ``refused`` rows, and ``pairs(rng)``: the
    calls to compare, (the engine's way, the dualop way)."""

    engine: str
    where: str
    pairs: Callable[[np.random.Generator], list[Pair]]
    refusal: str | None = None


def _t(rng, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(testing.normal(shape, rng, scale))


def _randomize(*params: torch.nn.Parameter | None, rng) -> None:
    """Random values in a layer's parameters (they start at zeros or ones: a swap would not show)."""
    with torch.no_grad():
        for p in params:
            if p is not None:
                p.copy_(_t(rng, *p.shape, scale=0.5))


def _routing(rng, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids int64 [tokens, top_k], distinct ids per token)."""
    scores = _t(rng, tokens, experts)
    weights, ids = torch.topk(torch.softmax(scores, -1), top_k)
    return weights, ids


# --------------------------------------------------------------------------------------------- rows


def _activation(make: Callable[[], Any], width: int = 32) -> Callable:
    def pairs(rng):
        op, x = make(), _t(rng, 5, width, scale=3.0)
        return [(lambda: op(x), lambda: op.forward_native(x=x)),
                (lambda: op(x.reshape(1, 5, width)), lambda: op.forward_native(x=x.reshape(1, 5, width)))]
    return pairs


def _xielu(rng):
    act, x = layers.XIELU(), _t(rng, 5, 16, scale=3.0)
    return [(lambda: act(x), lambda: act.op.forward_native(x=x, alpha_p=act.alpha_p, alpha_n=act.alpha_n))]


def _mm_encoder_attn(rng):
    op = ops.MMEncoderAttention(2, 16, num_kv_heads=1)
    q, k, v = _t(rng, 1, 12, 32), _t(rng, 1, 12, 16), _t(rng, 1, 12, 16)
    cu = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)
    max_seqlen = (cu[1:] - cu[:-1]).max()  # the engine's: a 0-d int32 tensor
    return [(lambda: op(query=q, key=k, value=v, cu_seqlens=cu, max_seqlen=max_seqlen),
             lambda: op.forward_native(query=q, key=k, value=v, cu_seqlens=cu)),
            (lambda: op(q.reshape(1, 12, 2, 16), k.reshape(1, 12, 1, 16), v.reshape(1, 12, 1, 16)),
             lambda: op.forward_native(query=q.reshape(1, 12, 2, 16), key=k.reshape(1, 12, 1, 16),
                                       value=v.reshape(1, 12, 1, 16)))]


def _mla(rng):
    """``mla(positions, hidden_states)``: with no forward context (one new sequence) and in a
    context of two sequences over the bound latent cache, against the op's call with that metadata."""
    from dualop.torch.forward_context import forward_context

    rope = ops.RotaryEmbedding(8, 8, 64, 10000.0, False)
    layer = layers.MultiHeadLatentAttention(32, 2, 0.1, 8, 8, 8, 16, 16, rope)
    _randomize(*layer.parameters(), rng=rng)
    weights = {name: getattr(layer, name).weight for name in layer.op.weight_shapes()}
    positions, hidden = torch.tensor([0, 1, 2, 3, 4, 0, 1]), _t(rng, 7, 32)

    def ints(*values):
        return torch.tensor(values, dtype=torch.int32)

    one_seq = (torch.zeros(1, 7, 24), torch.arange(7, dtype=torch.int32), ints(7), ints(0).reshape(1, 1), ints(0, 7),
               ints(1))
    cache = _t(rng, 4, 4, 24)  # 4 pages of 4 slots; sequence 0 on pages 2, 0; sequence 1 on page 3
    meta = dict(slot_mapping=ints(8, 9, 10, 11, 0, 12, 13), kv_lens=ints(5, 2), page_indices=ints(2, 0, 3, 1).reshape(2, 2),
                cu_q_lens=ints(0, 5, 7), num_seqs=ints(2))

    def engine_in_context():
        layer.kv_cache = cache.clone()
        with forward_context(**meta):
            return layer(positions, hidden), layer.kv_cache

    return [(lambda: layer(positions, hidden), lambda: layer.op.forward_native(positions, hidden, weights, *one_seq)[0]),
            (engine_in_context, lambda: layer.op.forward_native(positions, hidden, weights, cache.clone(), **meta))]


def _conv(layer_cls, kernel: tuple[int, ...], x_shape: tuple[int, ...]) -> Callable:
    def pairs(rng):
        conv = layer_cls(3, 8, kernel_size=kernel, stride=kernel)
        x = _t(rng, *x_shape)
        return [(lambda: conv(x), lambda: conv.op.forward_native(x=x, weight=conv.weight, bias=conv.bias))]
    return pairs


def _embedding(rng):
    emb = layers.VocabParallelEmbedding(100, 16)
    _randomize(emb.weight, rng=rng)
    ids = torch.from_numpy(rng.integers(0, 100, 9)).to(torch.int32)
    return [(lambda: emb(ids), lambda: emb.op.forward_native(input_ids=ids, weight_shard=emb.weight))]


def _lm_head(rng):
    head, processor = layers.ParallelLMHead(100, 16), layers.LogitsProcessor(100)
    _randomize(head.weight, rng=rng)
    ids, hidden = torch.from_numpy(rng.integers(0, 100, 9)).to(torch.int32), _t(rng, 9, 16)
    return [(lambda: head(ids), lambda: processor(head, hidden))]


def _linear(make: Callable[[], Any]) -> Callable:
    def pairs(rng):
        lin = make()
        _randomize(lin.weight, lin.bias, rng=rng)
        x = _t(rng, 5, 16)
        return [(lambda: lin(x), lambda: lin.op.forward_native(x=x, weight=lin.weight, bias=lin.bias))]
    return pairs


def _logits_processor(rng):
    head, processor = layers.ParallelLMHead(100, 16), layers.LogitsProcessor(100, soft_cap=5.0)
    _randomize(head.weight, rng=rng)
    hidden = _t(rng, 7, 16)
    return [(lambda: processor(head, hidden),
             lambda: processor.op.forward_native(lm_head_weight=head.weight, hidden_states=hidden))]


def _mixer_layer(make: Callable[[], Any]) -> Callable:
    """The engine's ``mixer(hidden_states, output)``: with no forward context (one new sequence, no
    cache) and in a context of two sequences over the bound caches (``kv_cache``, updated in place),
    against the layer's dualop call (caches and metadata as arguments) on copies of the caches."""
    from dualop.torch.forward_context import forward_context

    def pairs(rng):
        layer = make()
        _randomize(*layer.parameters(), rng=rng)
        op = layer.op
        shapes = [getattr(op, f"{name}_shape") for name in layer.cache_names]
        hidden = _t(rng, 7, op.hidden_size)
        caches = [_t(rng, 3, *shape) for shape in shapes]
        meta = dict(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32),
                    state_indices=torch.tensor([2, 0], dtype=torch.int32),
                    has_initial_state=torch.tensor([True, False]))

        def engine_alone():
            output = torch.full_like(hidden, float("nan"))
            assert layer(hidden, output) is None
            return output

        def engine_in_context():
            output = torch.full_like(hidden, float("nan"))
            layer.kv_cache = tuple(c.clone() for c in caches)
            with forward_context(**meta):
                layer(hidden, output)
            return output, *layer.kv_cache

        return [(engine_alone, lambda: layer.run(hidden)[0]),
                (engine_in_context, lambda: layer.run(hidden, *(c.clone() for c in caches), **meta))]
    return pairs


def _rel_pos_attention(rng):
    """``attn(x)`` on the layer (transformers' SamVisionAttention parameters), at its table size and
    at another (the tables interpolated)."""
    attn = layers.RelPosAttention(16, num_heads=2, use_rel_pos=True, input_size=(4, 4))
    _randomize(*attn.parameters(), rng=rng)
    params = dict(qkv_weight=attn.qkv.weight, qkv_bias=attn.qkv.bias, proj_weight=attn.proj.weight,
                  proj_bias=attn.proj.bias, rel_pos_h=attn.rel_pos_h, rel_pos_w=attn.rel_pos_w)
    x, y = _t(rng, 2, 4, 4, 16), _t(rng, 1, 3, 5, 16)
    return [(lambda: attn(x), lambda: attn.op.forward_native(x=x, **params)),
            (lambda: attn(y), lambda: attn.op.forward_native(x=y, **params))]


def _mixer2_gated_rms_norm(rng):
    op = ops.Mixer2RMSNormGated(64, 2)
    x, gate, weight = _t(rng, 5, 64), _t(rng, 5, 64), _t(rng, 64)
    return [(lambda: op(x, gate, weight), lambda: op.forward_native(x=x, gate=gate, weight=weight))]


def _fused_moe(rng):
    moe = layers.FusedMoE(4, 2, 16, 8)
    _randomize(moe.w13_weight, moe.w2_weight, rng=rng)
    hidden, logits = _t(rng, 6, 16), _t(rng, 6, 4)
    return [(lambda: moe(hidden, logits),
             lambda: moe.op.forward_native(hidden_states=hidden, router_logits=logits, w13=moe.w13_weight,
                                           w2=moe.w2_weight))]


def _experts_method(make: Callable[[], Any]) -> Callable:
    """``quant_method.apply(layer=..., x=..., topk_weights=..., topk_ids=...)``, the engine's call."""
    def pairs(rng):
        layer, op = layers.FusedMoE(4, 2, 16, 8), make()
        _randomize(layer.w13_weight, layer.w2_weight, rng=rng)
        x = _t(rng, 6, 16)
        weights, ids = _routing(rng, 6, 4, 2)
        ids = ids.to(torch.int32)
        return [(lambda: op.apply(layer=layer, x=x, topk_weights=weights, topk_ids=ids),
                 lambda: op.forward_native(x=x, topk_weights=weights, topk_ids=ids, w13=layer.w13_weight,
                                           w2=layer.w2_weight))]
    return pairs


def _transformers_fused_moe(rng):
    op = ops.TransformersFusedMoE(4, 2, 16, 8)
    gate_up, down, hidden = _t(rng, 4, 16, 16, scale=0.25), _t(rng, 4, 16, 8, scale=0.35), _t(rng, 6, 16)
    weights, ids = _routing(rng, 6, 4, 2)  # transformers' top_k_index is int64
    return [(lambda: op.routed(hidden, ids, weights, gate_up, down),
             lambda: op.quant_method.forward_native(x=hidden, topk_weights=weights, topk_ids=ids.to(torch.int32),
                                                    w13=gate_up, w2=down))]


def _grouped_topk(rng):
    op = ops.GroupedTopk(2, True, num_expert_group=2, topk_group=1, scoring_func="sigmoid")
    hidden, logits, bias = _t(rng, 6, 16), _t(rng, 6, 8), _t(rng, 8, scale=0.1)
    return [(lambda: op(hidden, logits, bias),
             lambda: op.forward_native(hidden_states=hidden, gating_output=logits, e_score_correction_bias=bias)),
            (lambda: op(hidden, logits), lambda: op.forward_native(hidden_states=hidden, gating_output=logits))]


def _norm(make: Callable[[], Any]) -> Callable:
    def pairs(rng):
        norm = make()
        _randomize(norm.weight, rng=rng)
        x, residual = _t(rng, 5, 32), _t(rng, 5, 32)
        return [(lambda: norm(x, residual), lambda: norm.op.forward_native(x=x, weight=norm.weight, residual=residual)),
                (lambda: norm(x), lambda: norm.op.forward_native(x=x, weight=norm.weight))]
    return pairs


def _rms_norm_gated(rng):
    norm = layers.RMSNormGated(32, group_size=16, norm_before_gate=True)
    _randomize(norm.weight, rng=rng)
    x, z = _t(rng, 5, 32), _t(rng, 5, 32)
    return [(lambda: norm(x, z), lambda: norm.op.forward_native(x=x, weight=norm.weight, z=z)),
            (lambda: norm(x), lambda: norm.op.forward_native(x=x, weight=norm.weight))]


def _quant_fp8(rng):
    dynamic, static = ops.QuantFP8(False, "per_token"), ops.QuantFP8(True, "per_tensor")
    x, scale_ub, scale = _t(rng, 5, 64, scale=3.0), torch.tensor([2.0]), torch.tensor([0.02])
    return [(lambda: dynamic(x, None, scale_ub), lambda: dynamic.forward_native(x=x, scale_ub=scale_ub)),
            (lambda: dynamic(x), lambda: dynamic.forward_native(x=x)),
            (lambda: static(x, scale), lambda: static.forward_native(x=x, scale=scale))]


def _rotary(rng):
    rope = ops.RotaryEmbedding(16, 16, 64, 10000.0, True, torch.float32)
    positions = torch.from_numpy(rng.integers(0, 64, 6))
    q, k = _t(rng, 6, 32), _t(rng, 6, 16)
    return [(lambda: rope(positions, q, k), lambda: rope.forward_native(positions=positions, query=q, key=k)),
            (lambda: rope(positions, q), lambda: rope.forward_native(positions=positions, query=q))]


def _dual_chunk(rng):
    rope = ops.DualChunkRotaryEmbedding(16, 8, 64, 10000.0, True, torch.float32, 16, 4)
    positions = torch.from_numpy(rng.integers(0, 32, 6))
    q, k = _t(rng, 6, 32), _t(rng, 6, 16)
    return [(lambda: rope(positions, q, k), lambda: rope.forward_native(positions=positions, query=q, key=k))]


def _apply_rotary_emb(rng):
    op = ops.ApplyRotaryEmb(is_neox_style=False, enable_fp32_compute=True)
    x, angles = _t(rng, 2, 5, 3, 16), torch.from_numpy(rng.uniform(0, 3, (5, 8)).astype(np.float32))
    cos, sin = angles.cos(), angles.sin()
    return [(lambda: op(x, cos, sin), lambda: op.forward_native(x=x, cos=cos, sin=sin)),
            (lambda: op(x[0], cos, sin), lambda: op.forward_native(x=x[0], cos=cos, sin=sin))]


ENGINE_CALLS: dict[str, EngineCall] = {
    "mm_encoder_attn": EngineCall("attn(query=q, key=k, value=v, cu_seqlens=cu, max_seqlen=<0-d int tensor>)", "op",
                                  _mm_encoder_attn),
    "multi_head_latent_attention": EngineCall("mla(positions, hidden_states)", "layer", _mla),
    **{name: EngineCall("act(x)", "op", _activation(make)) for name, make in (
        ("silu_and_mul", ops.SiluAndMul), ("mul_and_silu", ops.MulAndSilu), ("gelu_new", ops.NewGELU),
        ("gelu_fast", ops.FastGELU), ("quick_gelu", ops.QuickGELU), ("gelu_and_mul", lambda: ops.GeluAndMul("tanh")),
        ("gelu_and_mul_sparse", lambda: ops.GeluAndMulSparse(0.5)), ("relu2", ops.ReLUSquaredActivation),
        ("swigluoai_and_mul", ops.SwigluOAIAndMul), ("fatrelu_and_mul", lambda: ops.FatreluAndMul(0.3)))},
    "xielu": EngineCall("act(x)", "layer", _xielu),
    "rel_pos_attention": EngineCall("attn(x)", "layer", _rel_pos_attention),
    "conv2d": EngineCall("conv(x)", "layer", _conv(layers.Conv2dLayer, (2, 2), (2, 3, 4, 6))),
    "conv3d": EngineCall("conv(x)", "layer", _conv(layers.Conv3dLayer, (1, 2, 2), (1, 3, 2, 4, 4))),
    "vocab_parallel_embedding": EngineCall("embed_tokens(input_ids)", "layer", _embedding),
    "parallel_lm_head": EngineCall("lm_head(input_ids)", "refused", _lm_head, r"parallel_lm_head: the LM head has no "
                                   r"forward"),
    "replicated_linear": EngineCall("proj(x) -> (out, bias)", "layer",
                                    _linear(lambda: layers.ReplicatedLinear(16, 8))),
    "column_parallel_linear": EngineCall("proj(x) -> (out, bias)", "layer",
                                         _linear(lambda: layers.ColumnParallelLinear(16, 8, skip_bias_add=True))),
    "row_parallel_linear": EngineCall("proj(x) -> (out, bias)", "layer",
                                      _linear(lambda: layers.RowParallelLinear(16, 8))),
    "logits_processor": EngineCall("logits_processor(lm_head, hidden_states)", "layer", _logits_processor),
    **{name: EngineCall("mixer(hidden_states, output)", "layer", _mixer_layer(make)) for name, make in (
        ("mamba_mixer", lambda: layers.MambaMixer(16, 4, 3, 24, 4, use_bias=True)),
        ("mamba_mixer2", lambda: layers.MambaMixer2(16, 4, 3, 32, True, True, n_groups=2, num_heads=4, head_dim=8,
                                                   chunk_size=4)),
        ("plamo2_mamba_mixer", lambda: layers.Plamo2MambaMixer(16, 4, 3, 2, 8, chunk_size=4)),
        ("short_conv", lambda: layers.ShortConv(16, 3, bias=True)))},
    "mixer2_gated_rms_norm": EngineCall("norm(x, gate)", "op+params", _mixer2_gated_rms_norm),
    "fused_moe": EngineCall("experts(hidden_states, router_logits)", "layer", _fused_moe),
    "unquantized_fused_moe": EngineCall("quant_method.apply(layer=layer, x=x, topk_weights=w, topk_ids=ids)", "method",
                                        _experts_method(ops.UnquantizedFusedMoEMethod)),
    "modular_fused_moe": EngineCall("quant_method.apply(layer=layer, x=x, topk_weights=w, topk_ids=ids)", "method",
                                    _experts_method(ops.FusedMoEModularMethod)),
    "transformers_fused_moe": EngineCall("experts(hidden_states, topk_ids, topk_weights)", "method",
                                         _transformers_fused_moe),
    "grouped_topk": EngineCall("grouped_topk(hidden_states, gating_output, e_score_correction_bias)", "op",
                               _grouped_topk),
    "rms_norm": EngineCall("norm(x, residual)", "layer", _norm(lambda: layers.RMSNorm(32))),
    "gemma_rms_norm": EngineCall("norm(x, residual)", "layer", _norm(lambda: layers.GemmaRMSNorm(32))),
    "rms_norm_gated": EngineCall("norm(x, z)", "layer", _rms_norm_gated),
    "quant_fp8": EngineCall("quant_fp8(x, scale, scale_ub) -> (x_q, scale)", "op", _quant_fp8),
    "rotary_embedding": EngineCall("rotary_emb(positions, q, k) -> (q, k)", "op", _rotary),
    "dual_chunk_rotary_embedding": EngineCall("rotary_emb(positions, q, k) -> (q5, k)", "op", _dual_chunk),
    "apply_rotary_emb": EngineCall("apply_rotary_emb(x, cos, sin)", "op", _apply_rotary_emb),
}


# -------------------------------------------------------------------------------------------- tests


def _assert_same(got: Any, want: Any) -> None:
    """Equal results: the same structure (tuples, None) and bit-equal arrays (float8 via float32)."""
    if want is None or got is None:
        assert got is None and want is None, (type(got), type(want))
        return
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), (type(got), type(want))
        for g, w in zip(got, want):
            _assert_same(g, w)
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    if got.element_size() == 1 and got.is_floating_point():
        got, want = got.float(), want.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_every_registered_seed_op_has_a_row():
    """A seed op dualop registers must say how the engine calls it (add its row to ENGINE_CALLS)."""
    registered = [name for name in SEED_OPS if name in CustomOp.op_registry]
    assert registered, "no seed op is registered"
    missing = [name for name in registered if name not in ENGINE_CALLS]
    assert not missing, f"seed ops without an ENGINE_CALLS row: {missing}"
    stale = [name for name in ENGINE_CALLS if name not in SEED_OPS]
    assert not stale, f"ENGINE_CALLS rows for ops the seed documents do not list: {stale}"
    assert {row.where for row in ENGINE_CALLS.values()} <= {"op", "op+params", "layer", "method", "refused"}


@pytest.mark.parametrize("name", sorted(ENGINE_CALLS))
def test_engine_call(name):
    if name not in CustomOp.op_registry:
        pytest.skip(f"{name} is not registered in this checkout: its row has no op to call")
    row = ENGINE_CALLS[name]
    with torch.no_grad(), set_config(OpsConfig(["none"])):
        pairs = row.pairs(np.random.default_rng(0))
        assert pairs
        for engine_way, dualop_way in pairs:
            if row.where == "refused" and engine_way is pairs[0][0]:
                with pytest.raises((TypeError, ValueError, RuntimeError), match=row.refusal) as err:
                    engine_way()
                assert str(err.value).startswith(f"{name}:"), str(err.value)
                if dualop_way is not None:
                    assert dualop_way() is not None
                continue
            _assert_same(engine_way(), dualop_way())


# --- mm_encoder_attn: max_seqlen as the engine passes it, on every path that takes it ----------------


def _packed(rng):
    q, k, v = _t(rng, 1, 40, 160, scale=2.0), _t(rng, 1, 40, 160, scale=2.0), _t(rng, 1, 40, 160)
    return q, k, v, torch.tensor([0, 7, 7, 40], dtype=torch.int32)


@pytest.mark.parametrize("platform, method", [("cpu", "forward_cpu"), ("cuda", "forward_cuda")])
@pytest.mark.parametrize("form", ["0-d int32", "[1] int64", "int"])
def test_mm_encoder_attn_takes_a_tensor_max_seqlen(platform, method, form):
    """The engine's tensor max_seqlen (0-d or [1], int32 or int64) gives what the int gives, on the
    torch CPU kernel (which ignores it) and the Triton kernel (interpreted here; it sizes its loops)."""
    q, k, v, cu = _packed(np.random.default_rng(1))
    longest = (cu[1:] - cu[:-1]).max()
    max_seqlen = {"0-d int32": longest, "[1] int64": longest.reshape(1).to(torch.int64), "int": 33}[form]
    op = ops.MMEncoderAttention(2, 80)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        op.last_fallback = None
        got = op(q, k, v, cu, max_seqlen)
        assert op.last_run("torch", platform)[0] == method
        keyword = op(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen)
    want = op.forward_native(q, k, v, cu)
    torch.testing.assert_close(keyword, got, rtol=0, atol=0)
    assert testing.compare(testing.to_numpy(got), testing.to_numpy(want), "float32").ok


@pytest.mark.parametrize("platform, method", [("cpu", "forward_cpu"), ("cuda", "forward_cuda")])
def test_mm_encoder_attn_tensor_max_seqlen_inside_torch_compile(platform, method):
    """Inside ``torch.compile(fullgraph=True)`` the engine's ``(cu[1:] - cu[:-1]).max()`` reaches the
    op as a traced tensor: the opaque op gets None (its schema takes an int) and the Triton kernel
    bounds its loops from ``cu_seqlens``; the result is eager's."""
    q, k, v, cu = _packed(np.random.default_rng(2))
    op = ops.MMEncoderAttention(2, 80)
    compiled = torch.compile(lambda q, k, v, cu: op(q, k, v, cu_seqlens=cu, max_seqlen=(cu[1:] - cu[:-1]).max()),
                             fullgraph=True, backend="eager")
    with override_platform(platform), set_config(OpsConfig(["all"])):
        got = compiled(q, k, v, cu)
        assert op.last_run("torch", platform)[0] == method
        want = op(q, k, v, cu, 33)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mm_encoder_attn_max_seqlen_int_conversion():
    """The one host read: ints pass, 1-element tensors become their value, None stays None."""
    from dualop.ops.encoder_attention import max_seqlen_int

    assert max_seqlen_int(None) is None
    assert max_seqlen_int(np.int64(5)) == 5 and type(max_seqlen_int(np.int64(5))) is int
    assert max_seqlen_int(torch.tensor(7, dtype=torch.int32)) == 7
    assert max_seqlen_int(torch.tensor([9])) == 9


def test_mm_encoder_attn_jax_max_seqlen():
    """A jax caller's max_seqlen may be a jax scalar too (checked against cu_seqlens in one read)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    q, k, v, cu = (jnp.asarray(a.numpy()) for a in _packed(rng))
    op = ops.MMEncoderAttention(2, 80)
    got = op(q, k, v, cu, jnp.asarray(33, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(op.forward_native(q, k, v, cu)))
    with pytest.raises(ValueError, match=r"mm_encoder_attn: argument 'max_seqlen' = 32 is below the longest segment"):
        op(q, k, v, cu, jnp.asarray([32], jnp.int32))


@pytest.mark.parametrize("bad, error, message", [
    (torch.tensor(33.0), TypeError, r"argument 'max_seqlen' has dtype float32; expected int32 or int64"),
    (torch.tensor([33, 33]), ValueError, r"argument 'max_seqlen' must hold one value \(shape \(\) or \(1,\)\), "
                                         r"got shape \(2,\)"),
    (torch.tensor(32), ValueError, r"argument 'max_seqlen' = 32 is below the longest segment \(33\)"),
    (True, TypeError, r"argument 'max_seqlen' must be None, an int or a 1-element int tensor, got a bool"),
    (-1, ValueError, r"argument 'max_seqlen' must be non-negative, got -1"),
    (33.0, TypeError, r"argument 'max_seqlen' must be None, an int or a 1-element int tensor, got builtins.float"),
    (np.zeros(1, np.int32), TypeError, r"argument 'max_seqlen' must be None, an int or a 1-element int tensor, "
                                       r"got numpy.ndarray"),
])
def test_mm_encoder_attn_refuses_a_bad_max_seqlen(bad, error, message):
    q, k, v, cu = _packed(np.random.default_rng(3))
    with pytest.raises(error, match=r"mm_encoder_attn: " + message):
        ops.MMEncoderAttention(2, 80)(q, k, v, cu, bad)


def test_mm_encoder_attn_refuses_a_max_seqlen_of_another_frontend():
    import jax.numpy as jnp

    q, k, v, cu = _packed(np.random.default_rng(4))
    with pytest.raises(TypeError, match=r"mm_encoder_attn: argument 'max_seqlen' is a jax array but 'query' is a "
                                        r"torch array"):
        ops.MMEncoderAttention(2, 80)(q, k, v, cu, jnp.asarray(33))


# --- the engine's calls a dualop op refuses, with the way out in the message ----------------------


@pytest.mark.parametrize("make, has_weight", [(lambda: ops.RMSNorm(32), True), (lambda: ops.GemmaRMSNorm(32), True),
                                              (lambda: ops.RMSNorm(32, has_weight=False), False)])
def test_norm_op_refuses_the_engines_positional_residual(make, has_weight):
    """``norm(x, residual)`` on the op puts the residual where it takes its weight: refused, naming
    the call that works and the layer that takes the engine's."""
    rng = np.random.default_rng(5)
    op, x, residual = make(), _t(rng, 4, 32), _t(rng, 4, 32)
    name = type(op).name
    call = r"op\(x, weight, residual\)" if has_weight else r"op\(x, residual=residual\)"
    with pytest.raises(ValueError, match=rf"{name}: argument 'weight' has shape \(4, 32\); expected \(32,\)\. That is "
                                         rf"'x''s shape: the engine's call norm\(x, residual\) .*call {call}, or the "
                                         rf"layer {type(op).__name__} "):
        op(x, residual)


def test_rms_norm_gated_op_refuses_the_engines_positional_gate():
    rng = np.random.default_rng(6)
    x, z = _t(rng, 4, 32), _t(rng, 4, 32)
    with pytest.raises(ValueError, match=r"rms_norm_gated: argument 'weight' has shape \(4, 32\); expected \(32,\)\. "
                                         r".*norm\(x, z\).*op\(x, weight, z\), or the layer RMSNormGated"):
        ops.RMSNormGated(32)(x, z)


def test_transformers_fused_moe_refuses_routing_in_place_of_logits():
    """transformers' experts call on the op (routing where it takes logits) points to ``routed``."""
    rng = np.random.default_rng(7)
    weights, ids = _routing(rng, 6, 4, 2)
    with pytest.raises(TypeError, match=r"transformers_fused_moe: argument 'router_logits' has dtype int64; expected "
                                        r"float logits \[tokens, 4\].*op\.routed\(hidden_states, topk_ids, "
                                        r"topk_weights, gate_up_proj, down_proj, \.\.\.\)"):
        ops.TransformersFusedMoE(4, 2, 16, 8)(_t(rng, 6, 16), ids, weights)


def test_transformers_fused_moe_routed_refuses_bad_routing():
    rng = np.random.default_rng(8)
    op = ops.TransformersFusedMoE(4, 2, 16, 8)
    hidden, gate_up, down = _t(rng, 6, 16), _t(rng, 4, 16, 16), _t(rng, 4, 16, 8)
    weights, ids = _routing(rng, 6, 4, 2)
    with pytest.raises(TypeError, match=r"transformers_fused_moe: argument 'topk_ids' has dtype float32; expected "
                                        r"one of int32, int64"):
        op.routed(hidden, weights, weights, gate_up, down)
    with pytest.raises(ValueError, match=r"transformers_fused_moe: argument 'topk_weights' has shape \(5, 2\); "
                                         r"expected \[6, top_k\]"):
        op.routed(hidden, ids, weights[:5], gate_up, down)


def test_experts_method_refuses_the_layer_as_first_argument_and_a_layer_without_weights():
    """The engine's ``forward_native(layer, x, ...)`` form is ``apply`` here; a layer without the
    expert weights is refused naming what it lacks."""
    rng = np.random.default_rng(9)
    layer, op = layers.FusedMoE(4, 2, 16, 8), ops.UnquantizedFusedMoEMethod()
    weights, ids = _routing(rng, 6, 4, 2)
    x = _t(rng, 6, 16)
    with pytest.raises(TypeError, match=r"unquantized_fused_moe: expected a torch.Tensor or jax.Array as the first "
                                        r"argument"):
        op(layer, x, weights, ids.to(torch.int32))
    with pytest.raises(TypeError, match=r"modular_fused_moe: argument 'layer' \(Module\) has no w13_weight or "
                                        r"w2_weight; expected the engine's FusedMoE layer"):
        ops.FusedMoEModularMethod().apply(torch.nn.Module(), x, weights, ids.to(torch.int32))


def test_logits_processor_op_takes_the_weight_and_its_layer_the_module():
    """The engine passes the LM head module: the layer takes it, the op its weight (the op's first
    argument is the array dispatch reads the frontend from)."""
    rng = np.random.default_rng(10)
    head = layers.ParallelLMHead(100, 16)
    hidden = _t(rng, 3, 16)
    with pytest.raises(TypeError, match=r"logits_processor: expected a torch.Tensor or jax.Array as the first "
                                        r"argument"):
        ops.LogitsProcessor(100)(head, hidden)


# --- the stateful layers: the engine's call refused where it cannot be served ------------------------


@pytest.mark.parametrize("name", ["mamba_mixer", "mamba_mixer2", "plamo2_mamba_mixer", "short_conv"])
def test_mixer_op_refuses_the_engine_call_and_names_the_layer(name):
    """The op has no weights: ``op(hidden_states, output)`` puts the output buffer where it takes
    ``in_proj_weight``; refused, naming the layer that takes the call."""
    case = next(testing.cases_for([name]))
    op = case.make_op(case.shapes[0])
    hidden = testing.to_frontend(case.make_inputs(case.shapes[0], np.random.default_rng(0))[0], "torch", "float32")
    with pytest.raises(ValueError, match=rf"^{name}: argument 'in_proj_weight' has shape .*mixer\(hidden_states, "
                                         rf"output\).*dualop\.torch\.layers"):
        op(hidden, torch.empty_like(hidden))


def test_mixer_layer_engine_call_refusals_leave_the_caches_untouched():
    """A context with no cache bound, extra arguments (the engine's optional mup_vector), an output
    of another dtype: each refused before anything runs; with no context a bound cache stays as it was."""
    from dualop.torch.forward_context import forward_context

    rng = np.random.default_rng(11)
    mixer = layers.MambaMixer2(16, 4, 3, 32, True, True, n_groups=2, num_heads=4, head_dim=8, chunk_size=4)
    hidden = _t(rng, 5, 16)
    with forward_context(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"mamba_mixer2: a forward context is set but 'kv_cache' is NoneType; "
                                             r"bind layer.kv_cache = \(conv_state, ssm_state\)"):
            mixer(hidden, torch.empty_like(hidden))
    with pytest.raises(TypeError, match=r"mamba_mixer2: the engine's call mixer\(hidden_states, output\) takes "
                                        r"nothing more here.*mup_vector"):
        mixer(hidden, torch.empty_like(hidden), torch.ones(32))
    with pytest.raises(ValueError, match=r"mamba_mixer2: argument 'output' must be shaped, typed and placed as "
                                         r"'hidden_states' \(5, 16\) torch.float32"):
        mixer(hidden, output=torch.empty(5, 16, dtype=torch.bfloat16))
    caches = (_t(rng, 2, *mixer.op.conv_state_shape), _t(rng, 2, *mixer.op.ssm_state_shape))
    mixer.kv_cache = tuple(c.clone() for c in caches)
    output = torch.empty_like(hidden)
    mixer(hidden, output)
    for bound, before in zip(mixer.kv_cache, caches):
        assert torch.equal(bound, before)
    assert torch.isfinite(output).all()


def test_mla_layer_engine_call_refusals():
    from dualop.torch.forward_context import forward_context

    rope = ops.RotaryEmbedding(8, 8, 64, 10000.0, False)
    mla = layers.MultiHeadLatentAttention(32, 2, 0.1, 8, 8, 8, None, 16, rope)
    positions, hidden = torch.arange(3), _t(np.random.default_rng(12), 3, 32)
    meta = dict(slot_mapping=torch.arange(3, dtype=torch.int32), kv_lens=torch.tensor([3], dtype=torch.int32),
                page_indices=torch.zeros(1, 1, dtype=torch.int32), cu_q_lens=torch.tensor([0, 3], dtype=torch.int32),
                num_seqs=torch.tensor([1], dtype=torch.int32))
    with forward_context(**meta):
        with pytest.raises(ValueError, match=r"multi_head_latent_attention: a forward context is set but 'kv_cache' "
                                             r"is NoneType; bind layer.kv_cache = latent_pages"):
            mla(positions, hidden)
    mla.kv_cache = torch.zeros(1, 4, 24)
    with forward_context(cu_seqlens=torch.tensor([0, 3])):
        with pytest.raises(ValueError, match=r"multi_head_latent_attention: the forward context has no slot_mapping, "
                                             r"kv_lens, page_indices, cu_q_lens, num_seqs"):
            mla(positions, hidden)
    with pytest.raises(TypeError, match=r"forward_context: unknown field\(s\) \['slots'\]"):
        with forward_context(slots=meta["slot_mapping"]):
            pass
    with pytest.raises(TypeError, match=r"multi_head_latent_attention: argument 'hidden_states' must be a torch "
                                        r"tensor \[tokens, 32\]"):
        mla(positions, hidden[None])
    with pytest.raises(TypeError, match=r"multi_head_latent_attention: argument 'weights' is required"):
        mla.op(positions, hidden)  # the op: the weights, cache and metadata are its arguments
