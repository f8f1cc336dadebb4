"""dualop.models' Mamba-2 hybrids (dualop/models/bamba.py) against transformers: a tiny random
BambaForCausalLM (mamba, attention, mamba layers) saved once per module and loaded by dualop in
both frontends: float32 and bfloat16 logits, greedy generation with chunked prefill mixed with
decode over the state caches, all ops native, the kernels inside the whole model (Triton
interpreted, Pallas in interpret mode), tensor parallel 2 == 1 (mamba layers replicated), and a
checkpoint with a tensor missing."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import require_frontend

from dualop import OpsConfig, dispatch_report, override_platform, set_config, testing
from dualop.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

# Three prompts of different lengths; with 8 tokens per step the 19-token prompt is cut into
# chunks that share steps with the others' decodes (the state caches carry across the chunks).
PROMPTS = [[3, 17, 45, 9, 100, 2, 77, 31, 5, 60, 11], [8, 99], list(range(20, 39))]
NEW_TOKENS = 16
SERVING = dict(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)


def bamba_config():
    from transformers import BambaConfig

    # layer 1 attention (half-rotary rope, GQA 4:2), layers 0 and 2 Mamba-2 (8 heads of 16, 2 groups,
    # state 16, chunk 8: several chunks per prompt); no eos, so every generation runs its 16 tokens
    return BambaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8,
                       mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                       mamba_chunk_size=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
                       eos_token_id=None)


def _randomise(model) -> None:
    """Weights of unit-scale activations (transformers' 0.02 init makes every position's logits
    nearly alike, so greedy tokens would hinge on tiny margins and layers would barely matter):
    matrices ~ N(0, 1/fan_in), norms 1 ± 0.2, A = -(0.2..1.7), dt_bias and D ~ N(0, 0.25)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_((0.2 + 1.5 * torch.rand_like(p)).log())
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(("dt_bias", ".D")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny random Bamba checkpoint directory (one per module)."""
    pytest.importorskip("transformers")
    from transformers import BambaForCausalLM

    model = BambaForCausalLM(bamba_config()).eval()
    _randomise(model)
    path = tmp_path_factory.mktemp("bamba")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import BambaForCausalLM

    return BambaForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def hf_tokens(hf_model):
    """transformers' greedy tokens, one prompt at a time."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            seq = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)
            out.append(seq[0, len(prompt):].tolist())
    return out


_models: dict[str, object] = {}
_generated: dict[str, list[list[int]]] = {}


def dualop_model(checkpoint: str, frontend: str):
    """dualop's float32 model with the default config, one per frontend and module (jax compiles
    each step shape once for every test that uses it)."""
    if frontend not in _models:
        import dualop.models

        _models[frontend] = dualop.models.from_pretrained(checkpoint, frontend=frontend, **SERVING)
    return _models[frontend]


def dualop_tokens(checkpoint: str, frontend: str) -> list[list[int]]:
    """dualop's greedy tokens with the default config (once per frontend and module), after
    checking that the run mixed prefill chunks with decodes."""
    if frontend not in _generated:
        model = dualop_model(checkpoint, frontend)
        _generated[frontend] = model.generate(PROMPTS, NEW_TOKENS)
        stats = model.last_step_stats
        assert any(0 < s.prefill_tokens < s.tokens for s in stats), stats  # prefill chunk + decode in one step
        assert sum(s.prefill_tokens for s in stats) == sum(map(len, PROMPTS))
        assert max(s.tokens for s in stats) <= SERVING["max_num_batched_tokens"]
    return _generated[frontend]


def _rel_max(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# --- against transformers -------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_float32_logits_match_transformers(checkpoint, hf_model, frontend):
    import torch

    require_frontend(frontend)
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    model = dualop_model(checkpoint, frontend)
    got = model.frontend.to_numpy(model.logits(PROMPTS[0]))
    assert got.shape == want.shape
    assert _rel_max(got, want) <= 1e-4, _rel_max(got, want)


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_bfloat16_logits_match_transformers(checkpoint, frontend):
    """bfloat16 logits against transformers' model in bfloat16, under the tolerance table's
    bfloat16 row taken normwise (|got - want| <= 1e-5 + 1.6e-2 * max|want|: two bfloat16 ulp of
    the largest logit; elementwise, a logit near 0 would be held to far less than the roundings
    of three layers leave)."""
    import torch
    from transformers import BambaForCausalLM

    import dualop.models

    require_frontend(frontend)
    ref = BambaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPTS[0]])).logits[0].float().numpy()
    model = dualop.models.from_pretrained(checkpoint, frontend=frontend, dtype="bfloat16", **SERVING)
    logits = model.logits(PROMPTS[0])
    assert "bfloat16" in str(logits.dtype)
    cmp = testing.compare(model.frontend.to_numpy(logits), want, "bfloat16", normwise=True)
    assert cmp.ok, cmp


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_greedy_generation_matches_transformers(checkpoint, hf_tokens, frontend):
    require_frontend(frontend)
    assert dualop_tokens(checkpoint, frontend) == hf_tokens


# --- dualop against itself ------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_all_ops_native_give_the_same_tokens(checkpoint, frontend):
    import dualop.models

    require_frontend(frontend)
    with set_config(OpsConfig(["none"])):
        model = dualop.models.from_pretrained(checkpoint, frontend=frontend, **SERVING)
        tokens = model.generate(PROMPTS, NEW_TOKENS)
    methods = {(r["op"], r["method"]) for r in dispatch_report()}
    assert ("mamba_mixer2", "forward_native") in methods and ("ragged_paged_attention", "forward_native") in methods
    assert {m for _, m in methods} == {"forward_native"}, methods
    assert tokens == dualop_tokens(checkpoint, frontend)


# The kernels the whole model must reach on a platform (the mixer's own and its kernel ops included).
KERNEL_OPS = ("mamba_mixer2", "causal_conv1d", "ssd_chunk_scan", "ragged_paged_attention", "reshape_and_cache",
              "rms_norm", "rotary_embedding", "silu_and_mul")


@pytest.mark.parametrize("frontend,platform", [("torch", "cuda"), ("jax", "tpu")])
def test_kernels_run_inside_the_model(checkpoint, frontend, platform):
    """The platform's kernels (Triton interpreted for torch on "cuda", Pallas in interpret mode for
    jax on "tpu") inside the whole model give the default run's tokens, on a short generation that
    still cuts a prompt into chunks beside decodes; the dispatch report shows they ran."""
    import dualop.models

    require_frontend(frontend)
    prompts, new = [PROMPTS[1], PROMPTS[0]], 2  # steps: both prompts' chunks; a decode + a chunk; a decode
    with override_platform(platform), set_config(OpsConfig(["all"])):
        model = dualop.models.from_pretrained(checkpoint, frontend=frontend, **SERVING)
        tokens = model.generate(prompts, new)
    want = dualop_tokens(checkpoint, frontend)
    assert tokens == [want[1][:new], want[0][:new]]
    stats = [(s.tokens, s.prefill_tokens) for s in model.last_step_stats]
    assert stats == [(8, 8), (6, 5), (1, 0)], stats
    method = "forward_cuda" if platform == "cuda" else "forward_tpu"
    ran = {r["op"]: r["method"] for r in dispatch_report() if r["platform"] == platform}
    assert {op: ran.get(op) for op in KERNEL_OPS} == {op: method for op in KERNEL_OPS}, ran


# --- tensor parallel 2 == 1 -----------------------------------------------------------------------

TP_PROMPTS = [PROMPTS[0], PROMPTS[1]]
TP_NEW = 4


def _tp1_reference(checkpoint: str, frontend: str):
    """tp 1's logits of PROMPTS[0] and greedy tokens of TP_PROMPTS (chunked prefill beside decodes)."""
    model = dualop_model(checkpoint, frontend)
    return model.frontend.to_numpy(model.logits(PROMPTS[0])), model.generate(TP_PROMPTS, TP_NEW)


def _torch_at_tp2(rank: int, world: int, port: int, checkpoint: str, logits1: np.ndarray, tokens1) -> None:
    import torch

    import dualop.models
    from dualop import parallel
    from dualop.torch import parallel as tparallel

    tparallel.init_tensor_parallel_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = dualop.models.from_pretrained(checkpoint, frontend="torch", tp=world, **SERVING)
        # attention and MLP sharded, the mamba layers whole on each rank
        assert tuple(model.params["1.qkv"].shape) == ((4 + 2 + 2) * 16 // world, 64)  # q, k, v heads of 16
        assert tuple(model.params["0.gate_up"].shape) == (2 * 96 // world, 64)
        assert tuple(model.params["0.in_proj_weight"].shape) == (2 * 128 + 2 * 2 * 16 + 8, 64)
        logits = model.logits(PROMPTS[0]).numpy()
        cmp = testing.compare(logits, logits1, "float32", normwise=True)
        assert cmp.ok, (rank, cmp)
        assert model.generate(TP_PROMPTS, TP_NEW) == tokens1
    finally:
        parallel.set_tensor_parallel(None)
        torch.distributed.destroy_process_group()


def test_torch_tp2_equals_tp1(checkpoint):
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    logits1, tokens1 = _tp1_reference(checkpoint, "torch")
    mp.spawn(_torch_at_tp2, args=(2, free_port(), checkpoint, logits1, tokens1), nprocs=2, join=True)


_JAX_TP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import numpy as np
    import dualop.models
    from dualop import testing
    from test_models_hybrid import PROMPTS, SERVING, TP_NEW, TP_PROMPTS

    checkpoint, reference = sys.argv[1], np.load(sys.argv[2])
    model = dualop.models.from_pretrained(checkpoint, frontend="jax", tp=2, **SERVING)
    logits = model.frontend.to_numpy(model.logits(PROMPTS[0]))
    cmp = testing.compare(logits, reference["logits"], "float32", normwise=True)
    tokens = model.generate(TP_PROMPTS, TP_NEW)
    spec = {name: list(model.params[name].sharding.spec) for name in ("1.qkv", "0.gate_up", "0.in_proj_weight")}
    print("RESULTS " + json.dumps(dict(ok=bool(cmp.ok), max_abs=cmp.max_abs, tokens=tokens,
                                       tokens1=reference["tokens"].tolist(),
                                       devices=len(model.frontend.mesh.devices.flat), spec=spec)))
""")


def test_jax_tp2_of_8_devices_equals_tp1(checkpoint, tmp_path):
    importlib.import_module("jax")
    logits1, tokens1 = _tp1_reference(checkpoint, "jax")
    np.savez(tmp_path / "tp1.npz", logits=logits1, tokens=np.asarray(tokens1))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_TP_SCRIPT, checkpoint, str(tmp_path / "tp1.npz")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    r = json.loads(line.removeprefix("RESULTS "))
    assert r["ok"], r
    assert r["tokens"] == r["tokens1"] and len(r["tokens"]) == len(TP_PROMPTS), r
    assert r["devices"] == 2
    # attention and MLP sharded over the axis, the mamba layers replicated
    assert r["spec"] == {"1.qkv": ["tp", None], "0.gate_up": ["tp", None], "0.in_proj_weight": []}, r["spec"]


# --- bad input --------------------------------------------------------------------------------------


def test_checkpoint_missing_a_tensor_loads_nothing(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    import dualop.models
    from dualop.models import CheckpointError

    gone = "model.layers.2.mamba.A_log"
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    del tensors[gone]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(checkpoint, "config.json"), tmp_path / "config.json")
    loaded = []
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model\.layers\.2\.mamba\.A_log"):
        dualop.models.from_pretrained(tmp_path, frontend="torch", progress=loaded.append)
    assert loaded == []


@pytest.mark.parametrize("change,match", [
    (dict(mamba_d_head=12), r"BambaForCausalLM config: mamba_n_heads \* mamba_d_head = 8 \* 12 must equal"),
    (dict(attn_layer_indices=[5]), r"BambaForCausalLM config 'attn_layer_indices' holds 5"),
    (dict(layers_block_type=["mamba", "attention"]), r"'layers_block_type' must list one type per layer \(3\)"),
    (dict(layers_block_type=["mamba", "moe", "mamba"]), r"'layers_block_type' holds 'moe'"),
    (dict(time_step_limit=[0.0, "x"]), r"BambaForCausalLM config 'time_step_limit' must be a number, got 'x'"),
])
def test_bad_config_is_refused_before_loading(checkpoint, tmp_path, change, match):
    import dualop.models

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    config.update(change)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    os.symlink(os.path.join(checkpoint, "model.safetensors"), tmp_path / "model.safetensors")
    loaded = []
    with pytest.raises(ValueError, match=match):
        dualop.models.from_pretrained(tmp_path, frontend="torch", progress=loaded.append)
    assert loaded == []
