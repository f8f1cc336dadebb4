"""The quantization formats read from a checkpoint's header (``dualop.models.quantized``): each
format written here by its own rules (fp8 block and per-tensor, compressed-tensors float / int /
pack-quantized, AWQ's GEMM layout), every quantized layer found with its scheme and tensors, and
each kind of mismatch refused, all problems in one error, before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch

from dualop.models.checkpoint import Checkpoint, CheckpointError
from dualop.models.quantized import SUPPORTED_METHODS, read_quantization

HIDDEN, INTER, KV = 256, 384, 128
# a one-layer Llama's linear layers: name -> (out_features, in_features)
LINEARS = {
    "model.layers.0.self_attn.q_proj": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.k_proj": (KV, HIDDEN),
    "model.layers.0.self_attn.v_proj": (KV, HIDDEN),
    "model.layers.0.self_attn.o_proj": (HIDDEN, HIDDEN),
    "model.layers.0.mlp.gate_proj": (INTER, HIDDEN),
    "model.layers.0.mlp.up_proj": (INTER, HIDDEN),
    "model.layers.0.mlp.down_proj": (HIDDEN, INTER),
}
FLOATS = {"model.embed_tokens.weight": (64, HIDDEN), "lm_head.weight": (64, HIDDEN),
          "model.norm.weight": (HIDDEN,), "model.layers.0.input_layernorm.weight": (HIDDEN,),
          "model.layers.0.post_attention_layernorm.weight": (HIDDEN,)}


def _cdiv(a, b):
    return -(-a // b)


def _write(path, tensors, quant):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}
    if quant is not None:
        config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    floats = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in FLOATS.items()}
    save_file({**floats, **tensors}, str(path / "model.safetensors"))
    return Checkpoint(path)


def _fp8_block(block=(128, 128), drop=(), reshape=None):
    tensors = {}
    for layer, (n, k) in LINEARS.items():
        tensors[f"{layer}.weight"] = torch.zeros(n, k).to(torch.float8_e4m3fn)
        tensors[f"{layer}.weight_scale_inv"] = torch.ones(_cdiv(n, block[0]), _cdiv(k, block[1]))
    for name in drop:
        del tensors[name]
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.ones(shape)
    return tensors


FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def test_fp8_block_checkpoint_is_read_layer_by_layer(tmp_path):
    q = read_quantization(_write(tmp_path, _fp8_block(), FP8_BLOCK))
    assert q.method == "fp8" and set(q.linears) == set(LINEARS)
    down = q.linears["model.layers.0.mlp.down_proj"]
    assert (down.scheme, down.bits, down.strategy, down.block, down.shape, down.activations) == (
        "fp8", 8, "block", (128, 128), (HIDDEN, INTER), "dynamic")
    assert down.tensors == {"codes": "model.layers.0.mlp.down_proj.weight",
                            "scale": "model.layers.0.mlp.down_proj.weight_scale_inv"}
    assert "7 quantized linear layers: fp8 weights in 128x128 blocks, dynamic activation scales" == q.summary()


def test_a_float_checkpoint_reads_as_none(tmp_path):
    assert read_quantization(_write(tmp_path, {}, None)) is None


def test_every_mismatch_of_an_fp8_block_checkpoint_is_listed_at_once(tmp_path):
    """A missing scale and a scale of the wrong grid (384 rows in blocks of 128 are 3, not 2): both
    named in one error."""
    tensors = _fp8_block(drop=["model.layers.0.self_attn.q_proj.weight_scale_inv"],
                         reshape={"model.layers.0.mlp.up_proj.weight_scale_inv": (2, 2)})
    with pytest.raises(CheckpointError) as err:
        read_quantization(_write(tmp_path, tensors, FP8_BLOCK))
    text = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv: missing" in text
    assert "model.layers.0.mlp.up_proj.weight_scale_inv: shape (2, 2), expected (3, 2)" in text
    assert "nothing was loaded" in text


def test_fp8_per_tensor_with_static_activations(tmp_path):
    tensors = {}
    for layer, (n, k) in LINEARS.items():
        tensors[f"{layer}.weight"] = torch.zeros(n, k).to(torch.float8_e4m3fn)
        tensors[f"{layer}.weight_scale"] = torch.ones(())
        tensors[f"{layer}.input_scale"] = torch.ones(1)
    del tensors["model.layers.0.mlp.gate_proj.input_scale"]
    quant = {"quant_method": "fp8", "activation_scheme": "static"}
    with pytest.raises(CheckpointError, match=r"gate_proj.input_scale: missing \(the static activation scale"):
        read_quantization(_write(tmp_path / "bad", tensors, quant))
    tensors["model.layers.0.mlp.gate_proj.input_scale"] = torch.ones(1)
    q = read_quantization(_write(tmp_path / "good", tensors, quant))
    assert {(v.strategy, v.activations) for v in q.linears.values()} == {("tensor", "static")}


def test_an_unknown_quant_method_is_refused_naming_the_supported_ones(tmp_path):
    with pytest.raises(CheckpointError, match=r"quant_method 'gptq', which dualop does not read; supported: "
                                              + ", ".join(SUPPORTED_METHODS)):
        read_quantization(_write(tmp_path, _fp8_block(), {"quant_method": "gptq", "bits": 4}))


def test_quantized_tensors_the_config_does_not_explain_are_refused(tmp_path):
    """float8 codes without a quantization_config, and with one whose ignore list says the layer
    stays float."""
    with pytest.raises(CheckpointError, match=r"holds tensors of quantized dtypes \(7: .*\) though config.json has "
                                              r"no quantization_config"):
        read_quantization(_write(tmp_path / "none", {k: v for k, v in _fp8_block().items() if "scale" not in k},
                                 None))
    quant = {**FP8_BLOCK, "ignored_layers": ["model.layers.0.mlp.down_proj"]}
    with pytest.raises(CheckpointError, match=r"down_proj.weight: float8, but the config lists .* unquantized"):
        read_quantization(_write(tmp_path / "ignored", _fp8_block(), quant))


def _pack_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' packing by its definition: 32 // bits unsigned codes per int32, the first
    in the lowest bits, along ``dim`` (padded with zeros)."""
    per = 32 // bits
    codes = codes.movedim(dim, -1)
    pad = (-codes.shape[-1]) % per
    codes = torch.nn.functional.pad(codes, (0, pad)).to(torch.int64).reshape(*codes.shape[:-1], -1, per)
    words = sum(codes[..., i] << (bits * i) for i in range(per))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32).movedim(-1, dim).contiguous()  # int32 bits


def _compressed(fmt: str, bits: int, group: int | None, symmetric: bool, kind: str = "int"):
    tensors = {}
    for layer, (n, k) in LINEARS.items():
        groups = _cdiv(k, group) if group else 1
        scale_shape = (n, groups) if group else (n, 1)
        if fmt == "pack-quantized":
            tensors[f"{layer}.weight_packed"] = _pack_int32(torch.randint(0, 2**bits, (n, k)), bits)
            tensors[f"{layer}.weight_shape"] = torch.tensor([n, k])
        elif kind == "float":
            tensors[f"{layer}.weight"] = torch.zeros(n, k).to(torch.float8_e4m3fn)
        else:
            tensors[f"{layer}.weight"] = torch.zeros(n, k, dtype=torch.int8)
        tensors[f"{layer}.weight_scale"] = torch.ones(scale_shape, dtype=torch.bfloat16)
        if not symmetric:
            zp = torch.randint(0, 2**bits, scale_shape)
            tensors[f"{layer}.weight_zero_point"] = _pack_int32(zp, bits, dim=0) if fmt == "pack-quantized" else \
                zp.to(torch.int8)
    strategy = "group" if group else "channel"
    quant = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                           "weights": {"num_bits": bits, "type": kind, "strategy": strategy,
                                                       "group_size": group, "symmetric": symmetric,
                                                       "dynamic": False}}}}
    return tensors, quant


@pytest.mark.parametrize("fmt, bits, group, symmetric, kind", [
    ("pack-quantized", 4, 128, True, "int"), ("pack-quantized", 4, 32, False, "int"),
    ("int-quantized", 8, None, True, "int"), ("float-quantized", 8, None, True, "float")])
def test_compressed_tensors_formats_are_read(tmp_path, fmt, bits, group, symmetric, kind):
    tensors, quant = _compressed(fmt, bits, group, symmetric, kind)
    q = read_quantization(_write(tmp_path, tensors, quant))
    assert set(q.linears) == set(LINEARS)  # lm_head ignored, the embedding not a Linear target
    down = q.linears["model.layers.0.mlp.down_proj"]
    assert (down.bits, down.shape, down.group_size, down.symmetric, down.scheme) == (
        bits, (HIDDEN, INTER), group, symmetric, "fp8" if kind == "float" else "int")
    assert down.layout == ("packed" if fmt == "pack-quantized" else "plain")
    assert ("zero_point" in down.tensors) == (not symmetric)


def test_compressed_tensors_mismatches_are_named(tmp_path):
    tensors, quant = _compressed("pack-quantized", 4, 32, False)
    layer = "model.layers.0.self_attn.o_proj"
    tensors[f"{layer}.weight_packed"] = tensors[f"{layer}.weight_packed"][:, :-1].contiguous()  # a word short
    tensors["model.layers.0.mlp.up_proj.weight_zero_point"] = torch.zeros(INTER, HIDDEN // 32, dtype=torch.int32)
    with pytest.raises(CheckpointError) as err:
        read_quantization(_write(tmp_path, tensors, quant))
    text = str(err.value)
    assert f"{layer}.weight_packed: shape ({HIDDEN}, {HIDDEN // 8 - 1}), expected ({HIDDEN}, {HIDDEN // 8})" in text
    assert f"up_proj.weight_zero_point: shape ({INTER}, {HIDDEN // 32}), expected ({INTER // 8}, {HIDDEN // 32})" \
        in text
    quant["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(CheckpointError, match=r"activation ordering 'group'"):
        read_quantization(_write(tmp_path / "actorder", tensors, quant))


def _awq(group=64):
    tensors = {}
    for layer, (n, k) in LINEARS.items():
        tensors[f"{layer}.qweight"] = torch.zeros(k, n // 8, dtype=torch.int32)
        tensors[f"{layer}.qzeros"] = torch.zeros(_cdiv(k, group), n // 8, dtype=torch.int32)
        tensors[f"{layer}.scales"] = torch.ones(_cdiv(k, group), n, dtype=torch.float16)
    return tensors


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}


def test_awq_gemm_checkpoint_is_read_and_its_mismatches_named(tmp_path):
    q = read_quantization(_write(tmp_path / "good", _awq(), AWQ))
    down = q.linears["model.layers.0.mlp.down_proj"]
    assert (down.layout, down.shape, down.group_size, down.symmetric) == ("awq", (HIDDEN, INTER), 64, False)
    with pytest.raises(CheckpointError, match=r"input features do not split into groups of 96"):
        read_quantization(_write(tmp_path / "group", _awq(96), {**AWQ, "group_size": 96}))
    with pytest.raises(CheckpointError, match=r"version 'gemv': only AWQ's 'gemm' layout is read"):
        read_quantization(_write(tmp_path / "gemv", _awq(), {**AWQ, "version": "gemv"}))
    tensors = _awq()
    tensors["model.layers.0.mlp.up_proj.scales"] = torch.ones(3, INTER, dtype=torch.float16)
    with pytest.raises(CheckpointError, match=rf"up_proj.scales: shape \(3, {INTER}\), expected \(4, {INTER}\)"):
        read_quantization(_write(tmp_path / "scales", tensors, AWQ))


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_a_quantized_layer_the_model_does_not_read_is_refused_before_any_tensor(tmp_path, frontend, monkeypatch):
    """An fp8 LM head: the model's LM head takes a float weight, so the load stops at the plan."""
    import dualop.models as dm

    tensors = _fp8_block()
    tensors["lm_head.weight"] = torch.zeros(64, HIDDEN).to(torch.float8_e4m3fn)
    tensors["lm_head.weight_scale_inv"] = torch.ones(1, 2)
    path = tmp_path / "ckpt"
    _write(path, {}, FP8_BLOCK)  # the float tensors, then the quantized ones over them
    from safetensors.torch import load_file, save_file

    save_file({**load_file(str(path / "model.safetensors")), **tensors}, str(path / "model.safetensors"))
    monkeypatch.setattr(Checkpoint, "get", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match=r"quantized layers this model reads no linear weight from \(1\): "
                                              r"lm_head"):
        dm.from_pretrained(str(path), frontend=frontend)


def test_a_fused_weight_whose_parts_split_a_scale_block_is_refused(tmp_path, monkeypatch):
    """QKV fuses q (256 rows) and k: with 96-row scale blocks q's last block straddles into k."""
    import dualop.models as dm

    _write(tmp_path, _fp8_block(block=(96, 128)), {**FP8_BLOCK, "weight_block_size": [96, 128]})
    monkeypatch.setattr(Checkpoint, "get", lambda *a, **k: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj has 256 output features, not a "
                                              r"multiple of the 96 that one scale block spans"):
        dm.from_pretrained(str(tmp_path), frontend="torch")
