"""Quantized checkpoints loaded whole (``from_pretrained``), their linear weights kept quantized: a
tiny transformers Llama written here in each format by the format's rules, loaded in both frontends.

- fp8 (128x128-style blocks, here 32x32 for a 64-wide model): against transformers' own loading of
  the same checkpoint (it dequantises FP8 on a host without an FP8 GPU; needs accelerate).
  ``weight_only`` computes what it computes (float32 noise apart); the checkpoint's W8A8 scheme
  (activations quantized per token group of 32) lands within the activations' fp8 rounding, about
  3% normwise here, and the bound is 8%.
- compressed-tensors int4 (pack-quantized, groups of 32, with and without zero points) and AWQ:
  against transformers' float model holding the weights float64 numpy dequantises by the format's
  definition (codes unpacked bit by bit), within float32 noise; int8 W8A8 (int-quantized, per
  channel, dynamic per-token activations) within its activations' int8 rounding (bound 4%).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

import dualop.models as dm

HIDDEN, INTER = 64, 128
PROMPT = [1, 5, 9, 33, 70, 2, 8, 100]


def _float_llama(path, kind="llama"):
    """A tiny float model of ``kind`` (llama, qwen3, qwen3_moe) saved at ``path``."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes, head_dim=16))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **sizes, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2))
    model = model.eval()
    model.save_pretrained(path)
    return model


def _requantize(path, quantize, quant_config, keep_float=()):
    """Rewrite the float checkpoint at ``path``: every ``*_proj.weight`` (but those whose name holds
    one of ``keep_float``) replaced by ``quantize(name, float64 weight)`` -> ({tensor suffix:
    array}, float64 dequantised weight); returns {weight name: dequantised weight}."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    out, dequantised = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") and not any(part in name for part in keep_float):
            stored, deq = quantize(name, w.double().numpy())
            layer = name.removesuffix(".weight")
            out.update({f"{layer}.{suffix}": value for suffix, value in stored.items()})
            dequantised[name] = deq
        else:
            out[name] = w
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(config))
    return dequantised


def _logits(path, frontend, **kw):
    model = dm.from_pretrained(str(path), frontend=frontend, dtype="float32", max_model_len=32, max_num_seqs=1,
                               max_num_batched_tokens=16, page_size=4, **kw)
    return np.asarray(model.logits(PROMPT), np.float64)


def _reference_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].double().numpy()


def _normwise(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --- fp8 -------------------------------------------------------------------------------------------

def _fp8_blocks(block):
    def quantize(name, w):
        n, k = w.shape
        g = w.reshape(n // block, block, k // block, block)
        scale = (np.abs(g).max(axis=(1, 3)) / 448.0).astype(np.float32)
        codes = torch.from_numpy((g / scale[:, None, :, None].astype(np.float64)).reshape(n, k).astype(np.float32))
        codes = codes.to(torch.float8_e4m3fn)
        deq = codes.double().numpy().reshape(g.shape) * scale[:, None, :, None]
        return {"weight": codes, "weight_scale_inv": torch.from_numpy(scale)}, deq.reshape(n, k)

    return quantize


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints through accelerate")
    path = tmp_path_factory.mktemp("fp8")
    _float_llama(path)
    _requantize(path, _fp8_blocks(32), {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                        "weight_block_size": [32, 32]})
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, _reference_logits(reference)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_fp8_block_checkpoint_against_transformers_loading(fp8_checkpoint, frontend):
    path, want = fp8_checkpoint
    weight_only = _logits(path, frontend, weight_only=True)
    assert _normwise(weight_only, want) < 1e-5
    w8a8 = _logits(path, frontend)
    assert 1e-3 < _normwise(w8a8, want) < 0.08  # the activations' fp8 rounding, and only that


# --- compressed-tensors and AWQ, against the float model of their dequantised weights -----------------

def _pack_words(codes: np.ndarray, bits: int, axis: int, order=None) -> torch.Tensor:
    per = 32 // bits
    order = order or range(per)
    c = np.moveaxis(codes.astype(np.int64), axis, -1)
    c = c.reshape(*c.shape[:-1], -1, per)
    words = sum(c[..., j] << (bits * slot) for j, slot in enumerate(order))
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(((words + 2**31) % 2**32 - 2**31).astype(np.int32),
                                                             -1, axis)))


def _int4_groups(group, symmetric):
    def quantize(name, w):
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        if symmetric:
            scale = (np.abs(g).max(-1) / 7.5).astype(np.float32)
            zero = np.zeros_like(scale, dtype=np.int64)
        else:
            lo, hi = g.min(-1), g.max(-1)
            scale = ((hi - lo) / 15).astype(np.float32)
            zero = np.clip(np.round(-lo / scale) - 8, -8, 7).astype(np.int64)
        s = scale.astype(np.float64)[..., None]
        q = np.clip(np.round(g / s) + zero[..., None], -8, 7).astype(np.int64)
        stored = {"weight_packed": _pack_words((q + 8).reshape(n, k), 4, 1),
                  "weight_shape": torch.tensor([n, k]), "weight_scale": torch.from_numpy(scale)}
        if not symmetric:
            stored["weight_zero_point"] = _pack_words(zero + 8, 4, 0)
        return stored, ((q - zero[..., None]) * s).reshape(n, k)

    return quantize


def _awq(group):
    order = (0, 4, 1, 5, 2, 6, 3, 7)

    def quantize(name, w):
        n, k = w.shape
        g = w.reshape(n, k // group, group)
        lo, hi = g.min(-1), g.max(-1)
        scale = ((hi - lo) / 15).astype(np.float16)
        s = scale.astype(np.float64)[..., None]
        zero = np.clip(np.round(-lo / scale.astype(np.float64)), 0, 15).astype(np.int64)
        q = np.clip(np.round(g / s) + zero[..., None], 0, 15).astype(np.int64)
        stored = {"qweight": _pack_words(q.reshape(n, k).T, 4, 1, order),
                  "qzeros": _pack_words(zero.T, 4, 1, order), "scales": torch.from_numpy(scale.T.copy())}
        return stored, ((q - zero[..., None]) * s).reshape(n, k)

    return quantize


def _int8_channels(name, w):
    scale = (np.abs(w).max(-1, keepdims=True) / 127).astype(np.float32)
    q = np.clip(np.round(w / scale.astype(np.float64)), -128, 127)
    return {"weight": torch.from_numpy(q.astype(np.int8)), "weight_scale": torch.from_numpy(scale)}, q * scale


def _ct_config(fmt, bits, strategy, group, symmetric, activations=None):
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                          "weights": {"num_bits": bits, "type": "int", "strategy": strategy,
                                                      "group_size": group, "symmetric": symmetric,
                                                      "dynamic": False}}}}


FORMATS = {
    "int4_group_symmetric": (_int4_groups(32, True), _ct_config("pack-quantized", 4, "group", 32, True)),
    "int4_group_zero_points": (_int4_groups(32, False), _ct_config("pack-quantized", 4, "group", 32, False)),
    "awq": (_awq(32), {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
}


def _dequantised_reference(path, float_model, dequantised):
    state = {name: torch.from_numpy(w) for name, w in dequantised.items()}
    reference = type(float_model)(float_model.config).eval()
    reference.load_state_dict({**float_model.state_dict(), **{k: v.float() for k, v in state.items()}})
    return _reference_logits(reference)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_weight_only_int4_formats_against_their_dequantised_model(tmp_path, fmt, frontend):
    quantize, config = FORMATS[fmt]
    float_model = _float_llama(tmp_path)
    dequantised = _requantize(tmp_path, quantize, config)
    want = _dequantised_reference(tmp_path, float_model, dequantised)
    assert _normwise(_logits(tmp_path, frontend), want) < 1e-5


def test_int8_w8a8_checkpoint_within_its_activation_rounding(tmp_path):
    float_model = _float_llama(tmp_path)
    config = _ct_config("int-quantized", 8, "channel", None, True,
                        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True})
    dequantised = _requantize(tmp_path, _int8_channels, config)
    want = _dequantised_reference(tmp_path, float_model, dequantised)
    assert _normwise(_logits(tmp_path, "torch", weight_only=True), want) < 1e-5
    assert 1e-4 < _normwise(_logits(tmp_path, "torch"), want) < 0.04


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_qwen3_dense_layers_in_int4_against_their_dequantised_model(tmp_path, kind, frontend):
    """Qwen3's projections (and Qwen3-MoE's attention projections: its experts and router stay
    float, by the checkpoint's ignore list) in compressed-tensors int4 groups."""
    quantize, config = FORMATS["int4_group_symmetric"]
    config = {**config, "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*mlp.experts.*"]}
    float_model = _float_llama(tmp_path, kind)
    dequantised = _requantize(tmp_path, quantize, config, keep_float=(".experts.",))
    assert any("self_attn" in name for name in dequantised)
    want = _dequantised_reference(tmp_path, float_model, dequantised)
    assert _normwise(_logits(tmp_path, frontend), want) < 1e-5


# --- tensor parallelism: each rank its shard of the codes, scales and zero points -----------------

TP_FORMATS = ("int4_group_zero_points", "awq")


def _tp_checkpoints(root):
    paths = {}
    for fmt in TP_FORMATS:
        path = root / fmt
        quantize, config = FORMATS[fmt]
        _float_llama(path)
        _requantize(path, quantize, config)
        paths[fmt] = str(path)
    return paths


def _tp_rank(rank: int, world: int, port: int, paths: dict, result_file: str) -> None:
    from dualop import testing

    with testing.gloo_group(rank, world, port):
        out = {fmt: _logits_at(path, "torch", world).tolist() for fmt, path in paths.items()}
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(out, f)


def _logits_at(path, frontend, tp):
    model = dm.from_pretrained(str(path), frontend=frontend, dtype="float32", max_model_len=32, max_num_seqs=1,
                               max_num_batched_tokens=16, page_size=4, tp=tp)
    return np.asarray(model.logits(PROMPT), np.float64)


@pytest.mark.once_in_xla
def test_torch_tp2_shards_of_quantized_weights_equal_tp1(tmp_path):
    """int4 groups with zero points packed along the outputs, and AWQ's words along the outputs, cut
    per rank for column- and row-parallel layers (two gloo processes) == one process."""
    import torch.multiprocessing as mp

    from dualop import testing

    paths = _tp_checkpoints(tmp_path)
    result_file = str(tmp_path / "rank0.json")
    mp.spawn(_tp_rank, args=(2, testing.free_port(), paths, result_file), nprocs=2, join=True)
    with open(result_file) as f:
        out = json.load(f)
    for fmt, path in paths.items():
        assert _normwise(np.asarray(out[fmt]), _logits_at(path, "torch", 1)) < 1e-5, fmt


_JAX_TP_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np
import dualop.models as dm
out = {}
for fmt, path in json.loads(sys.argv[1]).items():
    for tp in (1, 2):
        model = dm.from_pretrained(path, frontend="jax", dtype="float32", max_model_len=32, max_num_seqs=1,
                                   max_num_batched_tokens=16, page_size=4, tp=tp)
        out[f"{fmt}/{tp}"] = np.asarray(model.logits(json.loads(sys.argv[2])), np.float64).tolist()
        if tp == 2:
            out[f"{fmt}/spec"] = str(model.params["0.o_proj"].codes.sharding.spec)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.once_in_xla
def test_jax_tp2_shards_of_quantized_weights_equal_tp1(tmp_path):
    """The same over a mesh of two host devices: every array of a quantized weight laid out
    rank-major and sharded along its first dim."""
    import os
    import subprocess
    import sys

    paths = _tp_checkpoints(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _JAX_TP_SCRIPT, json.dumps(paths), json.dumps(PROMPT)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    for fmt in paths:
        assert "tp" in out[f"{fmt}/spec"], out[f"{fmt}/spec"]
        assert _normwise(np.asarray(out[f"{fmt}/2"]), np.asarray(out[f"{fmt}/1"])) < 1e-5, fmt


def test_a_shard_that_would_split_a_scale_block_is_refused(tmp_path):
    """fp8 32x32 blocks at tp 2: k_proj's 32 rows give each rank 16, half a block (a real checkpoint's
    128-row blocks at tp 8 need 1024-row projections). Refused before anything is read."""
    _float_llama(tmp_path)
    _requantize(tmp_path, _fp8_blocks(32), {"quant_method": "fp8", "activation_scheme": "dynamic",
                                            "weight_block_size": [32, 32]})
    from dualop.models import params
    from dualop.models.checkpoint import Checkpoint, CheckpointError
    from dualop.models.quantized import read_quantization
    from dualop.ops import QKVParallelLinear
    from dualop.parallel import TensorParallel

    class TwoRanks(TensorParallel):  # rank 0 of 2, for the layout only (no collective is made)
        size = 2

    op = QKVParallelLinear(HIDDEN, 16, 4, 2, bias=False, tp=TwoRanks())
    plan = [params.linear("0.qkv", op, tuple((f"model.layers.0.self_attn.{x}_proj.weight", x) for x in "qkv"))]
    with pytest.raises(CheckpointError, match=r"k_proj: rank 0's output features \[0, 16\) at tp=2 split its fp8"):
        params.with_quantization(plan, read_quantization(Checkpoint(str(tmp_path))), 2)


# --- the kernels in a whole model ---------------------------------------------------------------

QUANTIZED_KERNEL_RUNS = {  # (frontend, platform): the linear ops' method there
    ("torch", "cpu"): "forward_cpu",    # the C++ quantized GEMM
    ("torch", "cuda"): "forward_cuda",  # Triton, in its interpreter
    ("jax", "tpu"): "forward_tpu",      # Pallas, in interpret mode
    ("jax", "cpu"): "forward_cpu",      # XLA's dots on the codes
}


@pytest.mark.parametrize("frontend, platform", list(QUANTIZED_KERNEL_RUNS))
def test_quantized_kernels_in_a_model_give_the_native_tokens(tmp_path, frontend, platform):
    """int4 groups with zero points (the linears) through each platform's quantized GEMM give the
    tokens and, within float32 noise, the logits of the same checkpoint with every op native."""
    from dualop import testing
    from dualop.config import OpsConfig, set_config
    from dualop.custom_op import clear_dispatch_report, dispatch_report
    from dualop.platforms import override_platform

    if (frontend, platform) == ("torch", "cuda") and testing.prepare_triton() is not None:
        pytest.skip(f"Triton cannot run here: {testing.prepare_triton()}")
    quantize, config = FORMATS["int4_group_zero_points"]
    _float_llama(tmp_path)
    _requantize(tmp_path, quantize, config)
    serving = dict(frontend=frontend, dtype="float32", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16,
                   page_size=4)
    prompts = [PROMPT, PROMPT[::-1]]
    with set_config(OpsConfig(custom_ops=["none"])):
        native = dm.from_pretrained(str(tmp_path), **serving)
        want, want_logits = native.generate(prompts, 4), np.asarray(native.logits(PROMPT), np.float64)
    clear_dispatch_report()
    with override_platform(platform):
        model = dm.from_pretrained(str(tmp_path), **serving)
        got, got_logits = model.generate(prompts, 4), np.asarray(model.logits(PROMPT), np.float64)
    ran = {row["method"] for row in dispatch_report() if str(row["op"]).endswith("_linear")}
    assert ran == {QUANTIZED_KERNEL_RUNS[(frontend, platform)]}, dispatch_report()
    assert got == want
    assert _normwise(got_logits, want_logits) < 1e-5


# --- dualop bench --decode: a quantized checkpoint's decode step against its float model -----------------

def test_bench_decode_times_each_checkpoint_against_the_first(tmp_path):
    from dualop.bench.model import bench_decode, format_decode_bench

    float_path, int8_path = tmp_path / "float", tmp_path / "int8"
    _float_llama(float_path)
    _float_llama(int8_path)
    _requantize(int8_path, _int8_channels, _ct_config("int-quantized", 8, "channel", None, True))
    records = bench_decode([str(float_path), str(int8_path)], "torch", "float32", (1, 3), context_len=5, rounds=2,
                           warmup=0, progress=False)
    assert [(r["batch"], r["impl"]) for r in records] == [(1, "float"), (1, "int8"), (3, "float"), (3, "int8")]
    assert [r["weights"] for r in records[:2]] == [
        "float32 (float)", "compressed-tensors: int8 weights in a scale per output channel, weight-only"]
    for r in records:
        assert r["seconds"] > 0 and r["tokens_per_second"] == pytest.approx(r["batch"] / r["seconds"])
    assert records[0]["speedup"] == records[2]["speedup"] == 1.0  # the baseline against itself
    assert "int8 weights in a scale per output channel" in format_decode_bench(records)
    with pytest.raises(ValueError, match="at least one checkpoint"):
        bench_decode([], progress=False)
    with pytest.raises(ValueError, match="batches must be positive ints"):
        bench_decode([str(float_path)], batches=(0,), progress=False)


def test_bench_decode_cli_refuses_bad_batches_before_loading(capsys):
    from dualop.cli import main

    assert main(["bench", "--decode", "/nonexistent", "--batches", "1,x"]) == 2
    assert "--batches: expected a positive int, got 'x'" in capsys.readouterr().err
    assert main(["bench", "--decode", "/nonexistent", "--model"]) == 2
    assert "--model and --decode" in capsys.readouterr().err
