"""Linear weights packed once for oneDNN on the CPU (dualop/kernels/cpu/linear.py): the linear ops
and the LM head take a packed weight where they take the weight and give F.linear's result (the
vendor GEMM both ways) and the native body's within the tolerance table; only its owner packs a
weight (the models do, unless DUALOP_CPU_PACKED_WEIGHTS=0); what oneDNN cannot take is refused
with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dualop import OpsConfig, set_config, testing
from dualop.kernels.cpu import linear
from dualop.ops import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from dualop.ops.logits_processor import LogitsProcessor

DTYPES = [torch.float32, torch.bfloat16]


def _same(got, want):
    key, _ = testing.tolerance_for(str(want.dtype).removeprefix("torch."), want)
    cmp = testing.compare(testing.to_numpy(got), testing.to_numpy(want), key)
    assert cmp.ok, cmp


def _randn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(autouse=True)
def packable_here():
    why = linear.packable(torch.zeros(2, 2))
    if why is not None:
        pytest.skip(f"this torch cannot pack for oneDNN here: {why}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_packed_matmul_is_f_linear(dtype, rows):
    w, x, b = _randn((96, 80), dtype, 0), _randn((rows, 80), dtype, 1), _randn((96,), dtype, 2)
    packed = linear.pack(w)
    assert linear.is_packed(packed) and packed.shape == w.shape and packed.dtype == w.dtype
    assert torch.equal(linear.unpacked(packed), w)
    _same(linear.matmul(x, packed, b), F.linear(x, w, b))
    _same(linear.matmul(x.reshape(1, rows, 80), packed), F.linear(x, w).reshape(1, rows, 96))
    assert linear.matmul(x, w) is not None and not linear.is_packed(w)  # a plain weight: F.linear


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_ops_take_a_packed_weight(dtype):
    x = _randn((5, 64), dtype, 0)
    cases = [
        (ReplicatedLinear(64, 48, bias=True, return_bias=False), _randn((48, 64), dtype, 1), _randn((48,), dtype, 2)),
        (QKVParallelLinear(64, 16, 2, 1, bias=False, return_bias=False), _randn((64, 64), dtype, 3), None),
        (MergedColumnParallelLinear(64, [32, 32], bias=False, return_bias=False), _randn((64, 64), dtype, 4), None),
    ]
    for op, w, b in cases:
        packed = linear.pack(w)
        want = op(x, w, b)
        _same(op(x, packed, b), want)
        assert op.last_run("torch")[0] == "forward_cpu"
        with set_config(OpsConfig(["none"])):  # the native body reads the packed weight's values
            _same(op(x, packed, b), op.forward_native(x, w, b))


@pytest.mark.parametrize("vocab, rows", [(128, 128), (100, 128)], ids=["whole", "padded"])
def test_lm_head_takes_a_packed_weight(vocab, rows):
    """A padded head (rows past the vocabulary) and one with an epilogue read the packed weight's
    plain values; a whole one with none multiplies the packed weight."""
    w, h = _randn((rows, 32), torch.bfloat16, 0), _randn((3, 32), torch.bfloat16, 1)
    for op in (LogitsProcessor(vocab, org_vocab_size=vocab), LogitsProcessor(vocab, soft_cap=30.0)):
        _same(op(linear.pack(w), h), op(w, h))


def test_what_onednn_cannot_take_is_refused_with_the_reason():
    assert "float16" in linear.packable(torch.zeros(4, 4, dtype=torch.float16))
    assert "2-D" in linear.packable(torch.zeros(4))
    assert "requires grad" in linear.packable(torch.zeros(4, 4, requires_grad=True))
    with pytest.raises(ValueError, match="linear: cannot pack this weight for oneDNN: only 2-D"):
        linear.pack(torch.zeros(4))


def test_models_pack_their_linear_weights_unless_told_not_to(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="both test environments have transformers")
    from dualop import models

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = models.from_pretrained(tmp_path, frontend="torch", dtype="float32", max_model_len=16)
    packed = {name for name, p in model.params.items() if linear.is_packed(p)}
    assert packed == {"0.qkv", "0.o_proj", "0.gate_up", "0.down", "lm_head"}, packed
    monkeypatch.setenv("DUALOP_CPU_PACKED_WEIGHTS", "0")
    plain = models.from_pretrained(tmp_path, frontend="torch", dtype="float32", max_model_len=16)
    assert not any(linear.is_packed(p) for p in plain.params.values())
    prompt = [[1, 2, 3, 4]]
    assert model.generate(prompt, 4, stop_at_eos=False) == plain.generate(prompt, 4, stop_at_eos=False)
