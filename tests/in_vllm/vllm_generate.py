"""Run by tests/in_vllm/test_vllm_plugin.py in a child process (vLLM's op registry is process-global):
``python vllm_generate.py PROMPTS_JSON MAX_TOKENS [--compiled] MODEL_DIR...`` generates greedily with
vLLM's ``LLM`` (CPU, float32, engine and worker in this process) from each checkpoint in turn and
prints one JSON line per model: the tokens, dualop's dispatch report read in this process (cleared
before each model), vLLM's compilation mode, and what the dualop plugin replaced."""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its report is ours


def main() -> None:
    prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
    compiled = "--compiled" in sys.argv[3:]
    models = [arg for arg in sys.argv[3:] if arg != "--compiled"]
    from vllm import LLM, SamplingParams

    from dualop.custom_op import clear_dispatch_report, dispatch_report

    for model in models:
        clear_dispatch_report()
        llm = LLM(model=model, enforce_eager=not compiled, skip_tokenizer_init=True, dtype="float32",
                  max_model_len=128, seed=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
        plugin = sys.modules.get("dualop.vllm_plugin")
        compilation = llm.llm_engine.vllm_config.compilation_config
        print("RESULT " + json.dumps({
            "model": model,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "report": [{k: row[k] for k in ("op", "frontend", "platform", "method", "reason")}
                       for row in dispatch_report()],
            "compilation_mode": str(compilation.mode), "custom_ops": list(compilation.custom_ops),
            "replaced": sorted(plugin.replaced()) if plugin else [],
            "not_replaced": plugin.not_replaced() if plugin else {},
        }), flush=True)
        del llm, outs
        gc.collect()


if __name__ == "__main__":
    main()
