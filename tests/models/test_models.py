"""Whole models from dualop ops (``dualop.models``) against Hugging Face transformers.

Each family is a tiny random-initialised transformers model saved with ``save_pretrained`` into a
temporary directory, loaded by ``dualop.models.from_pretrained`` in both frontends, and compared
with transformers' own forward and greedy ``generate`` on the same ids (the references nobody
here wrote). The generation runs with small batching limits so the loop really mixes chunked
prefill with decode and a waiting prompt takes a finished one's slot.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualop import testing

torch = pytest.importorskip("torch", reason="the transformers references need torch")
transformers = pytest.importorskip("transformers", reason="the references are transformers' models")

import dualop.models as dm  # noqa: E402

FRONTENDS = ("torch", "jax")
PROMPTS = [[1, 2, 3, 4, 5], list(range(12, 26)), [30, 31, 32]]
IDS = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41]
# Small limits: 2 sequences at a time, 8 tokens a step: the long prompt is prefilled in chunks beside
# the first one's decode steps, and the third prompt waits for a slot and is prefilled beside a decode.
SERVING = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, page_size=4)
LOGITS_RTOL = 1e-4  # float32: max |dualop - transformers| / max |transformers|


def _common(**kw):
    return {**dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128), **kw}


# family -> (config class, model class, config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              _common(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _common(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _common(head_dim=32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  _common(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, mlp_only_layers=[1])),
    # MLA with a q LoRA, YaRN with mscale_all_dim != mscale (the attention factor and the softmax
    # scale both move), one dense layer then MoE layers with grouped sigmoid routing, shared experts.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    _common(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=8, v_head_dim=16,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})),
}


def save_tiny(family: str, path: str, seed: int = 0, dtype=None):
    """A random-initialised transformers model of ``family`` saved at ``path``; returns it (eval)."""
    config_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # transformers starts the routers' correction bias at zero: make it count
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (path, the transformers model)}, saved once per module."""
    root = tmp_path_factory.mktemp("models")
    return {family: (str(root / family), save_tiny(family, str(root / family))) for family in FAMILIES}


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_generate(model, prompts, max_new_tokens=16) -> list[list[int]]:
    """transformers' greedy generation, one prompt at a time (no padding in the reference)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.reference
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_logits_and_greedy_tokens_match_transformers(checkpoints, family, frontend):
    path, hf = checkpoints[family]
    model = dm.from_pretrained(path, frontend=frontend, **SERVING)
    logits = model.logits(IDS)
    assert type(logits).__module__.split(".")[0] in ("torch", "jax", "jaxlib")
    assert tuple(logits.shape) == (len(IDS), hf.config.vocab_size)
    err = rel_err(testing.to_numpy(logits), hf_logits(hf, IDS))
    assert err < LOGITS_RTOL, f"{family}/{frontend}: logits differ from transformers by {err:.2e} (relative)"
    assert model.generate(PROMPTS, 16) == hf_generate(hf, PROMPTS)
    stats = model.last_step_stats
    assert any(s.prefill_tokens and s.tokens > s.prefill_tokens for s in stats), "no step mixed prefill and decode"
    assert max(s.tokens for s in stats) <= SERVING["max_num_batched_tokens"]


@pytest.mark.reference
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_logits_match_transformers(tmp_path, family, frontend):
    """bfloat16 weights and activations on both sides: the logits (after the final norm and the LM
    head) within the tolerance table's bfloat16 row, normwise: |d| <= 1e-5 + 1.6e-2 * max|ref|."""
    hf = save_tiny(family, str(tmp_path), seed=1, dtype=torch.bfloat16)
    model = dm.from_pretrained(str(tmp_path), frontend=frontend, **SERVING)
    assert model.dtype == "bfloat16"  # the config's dtype
    got = model.logits(IDS)
    assert str(got.dtype).endswith("bfloat16")
    cmp = testing.compare(testing.to_numpy(got), hf_logits(hf, IDS), "bfloat16", normwise=True)
    assert cmp.ok, f"max abs {cmp.max_abs}"


def _kernel_methods() -> dict[str, set[str]]:
    """{op: methods} that ran, from dualop's dispatch report."""
    from dualop.custom_op import dispatch_report

    out: dict[str, set[str]] = {}
    for row in dispatch_report():
        out.setdefault(str(row["op"]), set()).add(row["method"])
    return out


# (family, frontend, platform): the method, and the ops that must have run it in the whole model.
_LLAMA_KERNELS = ("ragged_paged_attention", "reshape_and_cache", "rms_norm", "silu_and_mul", "rotary_embedding",
                  "vocab_parallel_embedding")
_DEEPSEEK_KERNELS = ("ragged_paged_mla_attention", "concat_and_cache_mla", "fused_moe", "grouped_topk", "rms_norm")
KERNEL_RUNS = {
    ("llama", "jax", "tpu"): ("forward_tpu", _LLAMA_KERNELS),
    ("llama", "torch", "cuda"): ("forward_cuda", _LLAMA_KERNELS),
    ("llama", "torch", "cpu"): ("forward_cpu", ("ragged_paged_attention", "rms_norm", "silu_and_mul", "rotary_embedding")),
    ("deepseek_v3", "jax", "tpu"): ("forward_tpu", _DEEPSEEK_KERNELS),
    ("deepseek_v3", "torch", "cuda"): ("forward_cuda", _DEEPSEEK_KERNELS),
}


@pytest.mark.xla_only
@pytest.mark.parametrize("family, frontend, platform", list(KERNEL_RUNS))
def test_kernel_platform_paths_give_the_native_tokens(checkpoints, family, frontend, platform):
    """The whole serving path through the kernels' sources (Pallas in interpret mode, Triton in its
    interpreter, the C++ CPU kernels) gives the tokens of the same model with every op native."""
    from dualop.config import OpsConfig, set_config
    from dualop.custom_op import clear_dispatch_report
    from dualop.platforms import override_platform

    if (frontend, platform) == ("torch", "cuda") and testing.prepare_triton() is not None:
        pytest.skip(f"Triton cannot run here: {testing.prepare_triton()}")
    path, _ = checkpoints[family]
    prompts = [p[:6] for p in PROMPTS]
    with set_config(OpsConfig(custom_ops=["none"])):
        native = dm.from_pretrained(path, frontend=frontend, **SERVING)
        want = native.generate(prompts, 4)
        want_logits = testing.to_numpy(native.logits(IDS[:6]))
    clear_dispatch_report()
    with override_platform(platform):
        model = dm.from_pretrained(path, frontend=frontend, **SERVING)
        got = model.generate(prompts, 4)
        got_logits = testing.to_numpy(model.logits(IDS[:6]))
    method, kernel_ops = KERNEL_RUNS[(family, frontend, platform)]
    ran = _kernel_methods()
    missing = [op for op in kernel_ops if method not in ran.get(op, set())]
    assert not missing, f"{frontend}/{platform}: no kernel ran for {missing} ({ {op: ran.get(op) for op in missing} })"
    assert got == want
    assert rel_err(got_logits, want_logits) < LOGITS_RTOL


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_all_ops_native_give_the_same_tokens(checkpoints, frontend):
    from dualop.config import OpsConfig, set_config

    path, _ = checkpoints["qwen3_moe"]
    fast = dm.from_pretrained(path, frontend=frontend, **SERVING).generate(PROMPTS, 8)
    with set_config(OpsConfig(custom_ops=["none"])):
        native = dm.from_pretrained(path, frontend=frontend, **SERVING).generate(PROMPTS, 8)
    assert fast == native


# --- tensor parallelism -------------------------------------------------------------------------

TP_FAMILIES = ("llama", "qwen3_moe", "deepseek_v3")

_JAX_TP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np
    import dualop.models as dm
    paths, prompts, ids, serving = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
    out = {}
    for family, path in paths.items():
        for tp in (1, 2):
            model = dm.from_pretrained(path, frontend="jax", tp=tp, **serving)
            out[f"{family}/{tp}"] = dict(tokens=model.generate(prompts, 8), logits=np.asarray(model.logits(ids)).tolist(),
                                         sharded=str(model.params["0.o_proj"].sharding.spec) if tp > 1 else "")
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.once_in_xla
def test_jax_tp2_equals_tp1(checkpoints):
    """Each TP family at tp 2 over a mesh of two host devices == tp 1 (one subprocess: the host
    device count is fixed when jax starts)."""
    importlib.import_module("jax")
    paths = {family: checkpoints[family][0] for family in TP_FAMILIES}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _JAX_TP_SCRIPT, json.dumps(paths), json.dumps(PROMPTS), json.dumps(IDS),
                           json.dumps(SERVING)], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    for family in TP_FAMILIES:
        one, two = out[f"{family}/1"], out[f"{family}/2"]
        assert two["tokens"] == one["tokens"], family
        assert "tp" in two["sharded"], family  # the weights really are split over the mesh
        assert rel_err(np.asarray(two["logits"]), np.asarray(one["logits"])) < LOGITS_RTOL, family


def _torch_rank(rank: int, world: int, port: int, paths: dict, result_file: str) -> None:
    with testing.gloo_group(rank, world, port):
        out = {}
        for family, path in paths.items():
            model = dm.from_pretrained(path, frontend="torch", tp=world, **SERVING)
            out[family] = dict(tokens=model.generate(PROMPTS, 8), logits=model.logits(IDS).numpy().tolist(),
                               shard=list(model.params["0.o_proj"].shape))
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(out, f)


@pytest.mark.once_in_xla
def test_torch_tp2_equals_tp1(checkpoints, tmp_path):
    """Each TP family in two gloo processes (tp 2) == one process (tp 1)."""
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    paths = {family: checkpoints[family][0] for family in TP_FAMILIES}
    result_file = str(tmp_path / "rank0.json")
    mp.spawn(_torch_rank, args=(2, testing.free_port(), paths, result_file), nprocs=2, join=True)
    with open(result_file) as f:
        out = json.load(f)
    for family, path in paths.items():
        one = dm.from_pretrained(path, frontend="torch", **SERVING)
        assert out[family]["shard"][1] * 2 == list(one.params["0.o_proj"].shape)[1]  # each rank: half the heads
        assert out[family]["tokens"] == one.generate(PROMPTS, 8), family
        assert rel_err(np.asarray(out[family]["logits"]), one.logits(IDS).numpy()) < LOGITS_RTOL, family


# --- bad input ----------------------------------------------------------------------------------

def _rewrite(path: str, drop: str | None = None, reshape: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].clone()
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.latest_only
def test_a_missing_or_misshapen_tensor_is_named_before_anything_loads(tmp_path):
    save_tiny("llama", str(tmp_path / "a"))
    _rewrite(str(tmp_path / "a"), drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(dm.CheckpointError, match=r"missing tensors \(1\): model\.layers\.1\.mlp\.up_proj\.weight"):
        dm.from_pretrained(str(tmp_path / "a"))
    save_tiny("llama", str(tmp_path / "b"))
    _rewrite(str(tmp_path / "b"), reshape="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(dm.CheckpointError, match=r"k_proj\.weight: shape \(31, 64\), expected \(32, 64\)"):
        dm.from_pretrained(str(tmp_path / "b"), frontend="jax")


@pytest.mark.latest_only
def test_an_unsupported_architecture_and_bad_options_are_refused(tmp_path):
    save_tiny("llama", str(tmp_path))
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with pytest.raises(ValueError, match="frontend must be 'torch' or 'jax'"):
        dm.from_pretrained(str(tmp_path), frontend="numpy")
    with pytest.raises(ValueError, match="dtype must be one of"):
        dm.from_pretrained(str(tmp_path), dtype="int8")
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
        dm.from_pretrained(str(tmp_path), max_num_seqs=0)
    with pytest.raises(dm.CheckpointError, match="is not a directory"):
        dm.from_pretrained(str(tmp_path / "nowhere"))
    config["architectures"] = ["GPT2LMHeadModel"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' .* is not supported; supported: .*LlamaForCausalLM"):
        dm.from_pretrained(str(tmp_path))


@pytest.mark.latest_only
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_prompts_longer_than_the_cache_and_bad_ids_are_refused(checkpoints, frontend):
    path, _ = checkpoints["llama"]
    model = dm.from_pretrained(path, frontend=frontend, **SERVING)
    with pytest.raises(ValueError, match=r"prompt 1 has 60 tokens; with max_new_tokens=16 that exceeds max_model_len=64"):
        model.generate([[1, 2], [3] * 60], 16)
    with pytest.raises(ValueError, match=r"70 tokens exceed max_model_len=64"):
        model.logits([1] * 70)
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 96; expected ints in \[0, 96\)"):
        model.generate([[1, 96]], 4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        model.generate([[]], 4)
    with pytest.raises(TypeError, match="prompts must be a list of token-id lists"):
        model.generate("1 2 3", 4)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        model.generate([[1]], 0)
    with pytest.raises(ValueError, match="must be one sequence"):
        model.logits([[1, 2], [3, 4]])
    assert model.generate([[1, 2]], 2)  # the refusals left the model usable


def test_torch_steps_give_up_busy_cores_and_restore_torchs_thread_count(checkpoints, monkeypatch):
    """Each torch CPU step runs with torch's count lowered to the kernels' team (here forced to one
    thread, as beside a busy core) and restores it after: same tokens, the user's count kept."""
    from dualop.kernels.cpu import common

    path, _ = checkpoints["llama"]
    configured = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quiet = dm.from_pretrained(path, frontend="torch", **SERVING).generate(PROMPTS, 4)
        counts = []
        monkeypatch.setattr(common, "team_size", lambda requested: 1)
        real_set = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), real_set(n))[-1])
        busy = dm.from_pretrained(path, frontend="torch", **SERVING).generate(PROMPTS, 4)
        assert busy == quiet
        assert counts and counts[0::2] == [1] * (len(counts) // 2) and counts[1::2] == [2] * (len(counts) // 2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(configured)


# --- the command line ---------------------------------------------------------------------------

@pytest.mark.latest_only
def test_dualop_generate_prints_the_tokens_steps_and_kernels(checkpoints, capsys):
    from dualop import cli

    path, _ = checkpoints["qwen3"]
    assert cli.main(["generate", path, "--frontend", "torch", "--prompt", "1 2 3", "--prompt", "4 5",
                     "--max-new-tokens", "6", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = dm.from_pretrained(path, frontend="torch")
    assert out["outputs"] == model.generate([[1, 2, 3], [4, 5]], 6, stop_at_eos=False)
    assert len(out["steps"]) == 6 and out["steps"][0]["prefill_tokens"] == 5
    methods = {row["op"]: row["method"] for row in out["dispatch"]}
    assert methods["ragged_paged_attention"] == "forward_cpu"  # the C++ kernel on torch CPU tensors
    assert cli.main(["generate", path, "--prompt", "1 x"]) == 2
    assert "must be token ids" in capsys.readouterr().err
    assert cli.main(["generate", path, "--prompt", "1 2", "--max-new-tokens", "600"]) == 2
    assert "exceeds --max-model-len=512" in capsys.readouterr().err


# --- a real model on a real slice, compiled here -------------------------------------------------

def _need_tpu_compiler():
    from dualop.aot import tpu

    why = tpu.tpu_available()
    if why is not None:
        pytest.skip(f"TPU compiles need libtpu, installed in the latest environment only: {why}")


@pytest.mark.latest_only
def test_compile_model_builds_a_llama3_8b_layer_on_v5e_2x2_and_reports_memory():
    """One layer of Llama-3-8B's width, tp 4 on a v5e:2x2 slice, through XLA:TPU and Mosaic: the
    per-chip memory from the compiler's analysis, and the all-reduces the row-parallel layers make."""
    _need_tpu_compiler()
    from dualop.aot import model as aot_model

    build = aot_model.compile_model("llama3-8b", "v5e:2x2", 4, layers=1, num_tokens=128, num_seqs=16,
                                    max_model_len=512)
    assert build.status == "ok", build.message
    c = aot_model.MODEL_SHAPES["llama3-8b"]
    h, inter, vocab, kv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_key_value_heads"]
    layer = (h * (32 + 2 * kv) * 128 + 32 * 128 * h + 3 * h * inter) // 4 + 2 * h
    expected = 2 * (layer + 2 * (vocab // 4) * h + h)  # bfloat16: one layer, embedding and LM head shards, norm
    assert build.weight_bytes == expected
    assert build.kv_cache_bytes == 2 * 16 * 512 * 2 * (kv // 4) * 128  # pages x page size x K/V heads x dim
    assert build.argument_bytes >= build.weight_bytes + build.kv_cache_bytes
    assert 0 < build.total_bytes < build.hbm_bytes == 16 * 1024 ** 3
    kinds = {s["kind"]: s["count"] for s in build.collectives}
    assert kinds.get("all-reduce") == 3  # the embedding, o_proj, down_proj
    assert kinds.get("all-gather") == 1  # the logits
    # A chip too small for it is reported as not fitting, with the numbers, not as a pass.
    small = aot_model.judge_fit(dataclasses.replace(build, hbm_bytes=64 * 1024 ** 2))
    assert small.status == "does-not-fit" and "GiB per chip; a v5e chip has" in small.message
    text = aot_model.format_model_builds([build, small])
    assert "does-not-fit" in text and "all-reduce 3x" in text
