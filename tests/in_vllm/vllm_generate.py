"""Run by tests/in_vllm/test_vllm_plugin.py in a child process (vLLM's op registry is process-global):
``python vllm_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS [--compiled]`` generates greedily with
vLLM's ``LLM`` (CPU, float32, engine and worker in this process) and prints one JSON line: the
tokens, dualop's dispatch report read in this process, and what the dualop plugin replaced."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its report is ours


def main() -> None:
    model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    compiled = "--compiled" in sys.argv[4:]
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, enforce_eager=not compiled, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens,
                                                                                    temperature=0.0))
    from dualop.custom_op import dispatch_report

    plugin = sys.modules.get("dualop.vllm_plugin")
    compilation = llm.llm_engine.vllm_config.compilation_config
    print("RESULT " + json.dumps({
        "compilation_mode": str(compilation.mode), "custom_ops": list(compilation.custom_ops),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "report": [{k: row[k] for k in ("op", "frontend", "platform", "method", "reason")} for row in dispatch_report()],
        "replaced": sorted(plugin.replaced()) if plugin else [],
        "not_replaced": plugin.not_replaced() if plugin else {},
    }))


if __name__ == "__main__":
    main()
