"""dualop.models' Mamba-2 hybrids (dualop/models/bamba.py, nemotron_h.py) against transformers.

A tiny random BambaForCausalLM (mamba, attention, mamba layers) saved once per module and loaded
by dualop in both frontends: float32 and bfloat16 logits, greedy generation with chunked prefill
mixed with decode over the state caches, all ops native, the kernels inside the whole model
(Triton interpreted, Pallas in interpret mode), tensor parallel 2 == 1 (mamba layers replicated),
a checkpoint with a tensor missing and bad configs. A tiny NemotronHForCausalLM (mamba, MLP,
attention, MLP, mamba, MLP blocks) against transformers (logits, generation) and at tp 2.
"""

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

from dualop import OpsConfig, dispatch_report, override_platform, set_config, testing
from dualop.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def nemotron_h_config():
    from transformers import NemotronHConfig

    # "M-*-M-": Mamba-2 (as Bamba's, time_step_min 0.001), relu2 MLP, attention without rope
    return NemotronHConfig(vocab_size=128, hidden_size=64,
                           layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                                              "mlp"],
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                           mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
                           chunk_size=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
                           eos_token_id=None)


def _save(tmp_path_factory, name: str, model) -> str:
    _randomise(model)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny random Bamba checkpoint directory (one per module)."""
    pytest.importorskip("transformers")
    from transformers import BambaForCausalLM

    return _save(tmp_path_factory, "bamba", BambaForCausalLM(bamba_config()).eval())


@pytest.fixture(scope="module")
def nemotron_checkpoint(tmp_path_factory):
    """The tiny random Nemotron-H checkpoint directory."""
    pytest.importorskip("transformers")
    from transformers import NemotronHForCausalLM

    return _save(tmp_path_factory, "nemotron_h", NemotronHForCausalLM(nemotron_h_config()).eval())


def hf_greedy(model, prompts, new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time."""
    import torch

    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            out.append(seq[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import BambaForCausalLM

    return BambaForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def hf_tokens(hf_model):
    return hf_greedy(hf_model, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def nemotron_reference(nemotron_checkpoint):
    """transformers' Nemotron-H: float32 logits of PROMPTS[0] and 8 greedy tokens per prompt."""
    import torch
    from transformers import NemotronHForCausalLM

    ref = NemotronHForCausalLM.from_pretrained(nemotron_checkpoint).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    return logits, hf_greedy(ref, PROMPTS, 8)


@pytest.fixture(scope="module")
def models():
    """dualop's float32 models with the default config, one per (checkpoint, frontend) and module
    (jax compiles each step shape once for every test that uses it), and their greedy tokens."""
    cache: dict = {}
    yield cache
    cache.clear()


def dualop_model(models: dict, checkpoint: str, frontend: str):
    if (checkpoint, frontend) not in models:
        import dualop.models

        models[checkpoint, frontend] = dualop.models.from_pretrained(checkpoint, frontend=frontend, **SERVING)
    return models[checkpoint, frontend]


def dualop_tokens(models: dict, checkpoint: str, frontend: str, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """dualop's greedy tokens of PROMPTS with the default config (once per model), after checking
    that the run mixed prefill chunks with decodes."""
    key = ("tokens", checkpoint, frontend, new_tokens)
    if key not in models:
        model = dualop_model(models, checkpoint, frontend)
        models[key] = model.generate(PROMPTS, new_tokens)
        stats = model.last_step_stats
        assert any(0 < s.prefill_tokens < s.tokens for s in stats), stats  # prefill chunk + decode in one step
        assert sum(s.prefill_tokens for s in stats) == sum(map(len, PROMPTS))
        assert max(s.tokens for s in stats) <= SERVING["max_num_batched_tokens"]
    return models[key]


def require_frontend(frontend: str) -> None:
    """conftest's check, imported when a test runs (the tp subprocesses import this module, and
    conftest imports jax and triton)."""
    from conftest import require_frontend as require

    require(frontend)


def _rel_max(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# --- against transformers -------------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_float32_logits_match_transformers(checkpoint, hf_model, models, frontend):
    import torch

    require_frontend(frontend)
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    model = dualop_model(models, checkpoint, frontend)
    got = model.frontend.to_numpy(model.logits(PROMPTS[0]))
    assert got.shape == want.shape
    assert _rel_max(got, want) <= 1e-4, _rel_max(got, want)


@pytest.fixture(scope="module")
def bf16_reference(checkpoint):
    """transformers' logits of PROMPTS[0] for the bfloat16 model: computed in bfloat16, and exactly
    (float32 arithmetic on the same bfloat16-rounded weights)."""
    import torch
    from transformers import BambaForCausalLM

    ref = BambaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        in_bf16 = ref(torch.tensor([PROMPTS[0]])).logits[0].float().numpy()
        exact = ref.float()(torch.tensor([PROMPTS[0]])).logits[0].numpy()
    return in_bf16, exact


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_bfloat16_logits_match_transformers(checkpoint, bf16_reference, frontend):
    """bfloat16 logits under the tolerance table's bfloat16 row (atol 1e-5, rtol 1.6e-2: two ulp of
    an 8-bit significand), taken normwise (scaled by the largest logit; elementwise, a logit near 0
    would be held to far less than the roundings of three layers leave).

    The row bounds one op's rounding; a whole bfloat16 model's logits stray further from their
    exact values (transformers' own bfloat16 run is 0.8x-2.9x the row away from them over eight
    seeds of this model: a bfloat16 Mamba-2 mixer amplifies roundings where its output nearly
    cancels). So dualop's bfloat16 logits must be within the row of transformers' bfloat16 logits
    PLUS transformers' own distance from the exact logits: no worse than transformers' bfloat16
    by more than the row (the float32 test holds the math to 1e-4)."""
    import dualop.models

    require_frontend(frontend)
    in_bf16, exact = bf16_reference
    model = dualop.models.from_pretrained(checkpoint, frontend=frontend, dtype="bfloat16", **SERVING)
    logits = model.logits(PROMPTS[0])
    assert "bfloat16" in str(logits.dtype)
    got = model.frontend.to_numpy(logits)
    row = testing.TOLERANCES["bfloat16"]
    hf_error = float(np.abs(in_bf16 - exact).max())
    allowed = row.atol + row.rtol * float(np.abs(in_bf16).max()) + hf_error
    diff = float(np.abs(got - in_bf16).max())
    assert diff <= allowed, dict(diff=diff, allowed=allowed, transformers_from_exact=hf_error,
                                 dualop_from_exact=float(np.abs(got - exact).max()))


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_greedy_generation_matches_transformers(checkpoint, hf_tokens, models, frontend):
    require_frontend(frontend)
    assert dualop_tokens(models, checkpoint, frontend) == hf_tokens


@pytest.mark.reference
@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_nemotron_h_matches_transformers(nemotron_checkpoint, nemotron_reference, models, frontend):
    """Nemotron-H: float32 logits within 1e-4 of transformers' (relative to the largest) and its
    greedy tokens (8 per prompt, chunked prefill beside decodes)."""
    require_frontend(frontend)
    want, want_tokens = nemotron_reference
    model = dualop_model(models, nemotron_checkpoint, frontend)
    assert model.layer_types == ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
    got = model.frontend.to_numpy(model.logits(PROMPTS[0]))
    assert _rel_max(got, want) <= 1e-4, _rel_max(got, want)
    assert dualop_tokens(models, nemotron_checkpoint, frontend, 8) == want_tokens


# --- dualop against itself ------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_all_ops_native_give_the_same_tokens(checkpoint, models, frontend):
    import dualop.models

    require_frontend(frontend)
    with set_config(OpsConfig(["none"])):
        model = dualop.models.from_pretrained(checkpoint, frontend=frontend, **SERVING)
        tokens = model.generate(PROMPTS, NEW_TOKENS)
    methods = {(r["op"], r["method"]) for r in dispatch_report()}
    assert ("mamba_mixer2", "forward_native") in methods and ("ragged_paged_attention", "forward_native") in methods
    assert {m for _, m in methods} == {"forward_native"}, methods
    assert tokens == dualop_tokens(models, checkpoint, frontend)


# The kernels the whole model must reach on a platform (the mixer's own and its kernel ops included).
KERNEL_OPS = ("mamba_mixer2", "causal_conv1d", "ssd_chunk_scan", "ragged_paged_attention", "reshape_and_cache",
              "rms_norm", "rotary_embedding", "silu_and_mul")


@pytest.mark.xla_only
@pytest.mark.parametrize("frontend,platform", [("torch", "cuda"), ("jax", "tpu")])
def test_kernels_run_inside_the_model(checkpoint, models, frontend, platform):
    """The platform's kernels (Triton interpreted for torch on "cuda", Pallas in interpret mode for
    jax on "tpu") inside the whole model give the default run's tokens, on a short generation that
    still cuts a prompt into chunks beside decodes; the dispatch report shows they ran."""
    import dualop.models

    require_frontend(frontend)
    prompts, new = [PROMPTS[1], PROMPTS[0]], 2  # steps: both prompts' chunks; a decode + a chunk; a decode
    with override_platform(platform), set_config(OpsConfig(["all"])):
        model = dualop.models.from_pretrained(checkpoint, frontend=frontend, **SERVING)
        tokens = model.generate(prompts, new)
    want = dualop_tokens(models, checkpoint, frontend)
    assert tokens == [want[1][:new], want[0][:new]]
    stats = [(s.tokens, s.prefill_tokens) for s in model.last_step_stats]
    assert stats == [(8, 8), (6, 5), (1, 0)], stats
    method = "forward_cuda" if platform == "cuda" else "forward_tpu"
    ran = {r["op"]: r["method"] for r in dispatch_report() if r["platform"] == platform}
    assert {op: ran.get(op) for op in KERNEL_OPS} == {op: method for op in KERNEL_OPS}, ran


# --- tensor parallel 2 == 1 -----------------------------------------------------------------------

TP_PROMPTS = [PROMPTS[0], PROMPTS[1]]
TP_NEW = 4
# per family: {parameter: its shape on each of 2 ranks (torch) / its sharding (jax)}: attention and
# MLP split over the ranks, the mamba layers whole on each (q, k, v heads of 16; MLP 96 wide)
TP_SHAPES = {
    "bamba": {"1.qkv": (8 * 16 // 2, 64), "0.gate_up": (2 * 96 // 2, 64), "0.in_proj_weight": (328, 64)},
    "nemotron_h": {"2.qkv": (8 * 16 // 2, 64), "1.up": (96 // 2, 64), "1.down": (64, 96 // 2),
                   "0.in_proj_weight": (328, 64)},
}
TP_SPECS = {
    "bamba": {"1.qkv": ["tp", None], "0.gate_up": ["tp", None], "0.in_proj_weight": []},
    "nemotron_h": {"2.qkv": ["tp", None], "1.up": ["tp", None], "1.down": [None, "tp"], "0.in_proj_weight": []},
}


def _tp1_reference(models: dict, checkpoints: dict[str, str], frontend: str) -> dict:
    """Per family: tp 1's logits of PROMPTS[0] and greedy tokens of TP_PROMPTS (chunked prefill
    beside decodes)."""
    out = {}
    for family, path in checkpoints.items():
        model = dualop_model(models, path, frontend)
        out[family] = (model.frontend.to_numpy(model.logits(PROMPTS[0])), model.generate(TP_PROMPTS, TP_NEW))
    return out


def _torch_at_tp2(rank: int, world: int, port: int, checkpoints: dict[str, str], reference: dict) -> None:
    import dualop.models
    from dualop.torch import parallel as tparallel

    with testing.gloo_group(rank, world, port):
        tparallel.init_tensor_parallel_group()
        for family, path in checkpoints.items():
            model = dualop.models.from_pretrained(path, frontend="torch", tp=world, **SERVING)
            shapes = {name: tuple(model.params[name].shape) for name in TP_SHAPES[family]}
            assert shapes == TP_SHAPES[family], (family, shapes)
            logits1, tokens1 = reference[family]
            cmp = testing.compare(model.logits(PROMPTS[0]).numpy(), logits1, "float32", normwise=True)
            assert cmp.ok, (family, rank, cmp)
            assert model.generate(TP_PROMPTS, TP_NEW) == tokens1, family


@pytest.mark.once_in_xla
def test_torch_tp2_equals_tp1(checkpoint, nemotron_checkpoint, models):
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    checkpoints = {"bamba": checkpoint, "nemotron_h": nemotron_checkpoint}
    reference = _tp1_reference(models, checkpoints, "torch")
    mp.spawn(_torch_at_tp2, args=(2, free_port(), checkpoints, reference), nprocs=2, join=True)


_JAX_TP_SCRIPT = textwrap.dedent("""
    import json, os, pickle, sys
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import dualop.models
    from dualop import testing
    from test_models_hybrid import PROMPTS, SERVING, TP_NEW, TP_PROMPTS, TP_SPECS

    with open(sys.argv[1], "rb") as f:
        checkpoints, reference = pickle.load(f)
    results = {}
    for family, path in checkpoints.items():
        model = dualop.models.from_pretrained(path, frontend="jax", tp=2, **SERVING)
        logits1, tokens1 = reference[family]
        cmp = testing.compare(model.frontend.to_numpy(model.logits(PROMPTS[0])), logits1, "float32", normwise=True)
        tokens = model.generate(TP_PROMPTS, TP_NEW)
        results[family] = dict(ok=bool(cmp.ok), max_abs=cmp.max_abs, same_tokens=tokens == tokens1,
                               devices=len(model.frontend.mesh.devices.flat),
                               spec={name: list(model.params[name].sharding.spec) for name in TP_SPECS[family]})
    print("RESULTS " + json.dumps(results))
""")


@pytest.mark.once_in_xla
def test_jax_tp2_of_8_devices_equals_tp1(checkpoint, nemotron_checkpoint, models, tmp_path):
    import pickle

    importlib.import_module("jax")
    checkpoints = {"bamba": checkpoint, "nemotron_h": nemotron_checkpoint}
    with open(tmp_path / "tp1.pickle", "wb") as f:
        pickle.dump((checkpoints, _tp1_reference(models, checkpoints, "jax")), f)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_TP_SCRIPT, str(tmp_path / "tp1.pickle")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    for family, r in results.items():
        assert r["ok"] and r["same_tokens"] and r["devices"] == 2, (family, r)
        assert r["spec"] == TP_SPECS[family], (family, r["spec"])
    assert sorted(results) == ["bamba", "nemotron_h"]


# --- bad input --------------------------------------------------------------------------------------


@pytest.mark.latest_only
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


@pytest.mark.latest_only
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


@pytest.mark.latest_only
@pytest.mark.parametrize("change,match", [
    (dict(layers_block_type=None, hybrid_override_pattern="M-*-ME"), r"has a MoE layer \('E'\); Nemotron-H's MoE"),
    (dict(layers_block_type=["mamba", "mlp", "cross"]), r"'layers_block_type' holds 'cross'"),
    (dict(mlp_hidden_act="gelu"), r"NemotronHForCausalLM with mlp_hidden_act='gelu' is not supported"),
])
def test_nemotron_h_bad_config_is_refused_before_loading(nemotron_checkpoint, tmp_path, change, match):
    import dualop.models

    with open(os.path.join(nemotron_checkpoint, "config.json")) as f:
        config = json.load(f)
    config.update(change)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    os.symlink(os.path.join(nemotron_checkpoint, "model.safetensors"), tmp_path / "model.safetensors")
    loaded = []
    with pytest.raises(ValueError, match=match):
        dualop.models.from_pretrained(tmp_path, frontend="torch", progress=loaded.append)
    assert loaded == []


@pytest.mark.latest_only
def test_nemotron_h_pattern_config_loads(nemotron_checkpoint, tmp_path):
    """The older ``hybrid_override_pattern`` string gives the same blocks as ``layers_block_type``."""
    import dualop.models

    with open(os.path.join(nemotron_checkpoint, "config.json")) as f:
        config = json.load(f)
    config.pop("layers_block_type")
    config["hybrid_override_pattern"] = "M-*-M-"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    os.symlink(os.path.join(nemotron_checkpoint, "model.safetensors"), tmp_path / "model.safetensors")
    model = dualop.models.from_pretrained(tmp_path, frontend="torch", **SERVING)
    assert model.layer_types == ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
