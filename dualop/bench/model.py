"""``dualop bench --model``: tokens per second of a whole model's prefill and decode steps, dualop
(both frontends) against transformers' own forward, interleaved in one run.

The same checkpoint (by default a tiny random Llama written to a temporary directory) is loaded
by transformers (eager attention, its KV cache) and by ``dualop.models.from_pretrained`` in each
frontend. Two step shapes are timed, each as one entry per implementation per round
(``timing.interleaved``):

- prefill: ``batch`` prompts of ``prompt_len`` tokens in one step;
- decode: one new token for each of ``batch`` sequences after ``context_len`` cached tokens.

Every entry returns its greedy tokens (the argmax of each sequence's last logits), so a step is
done when it returns; transformers computes only the last position's logits (``logits_to_keep=1``)
and its cache is cropped back after each decode call, so every round does the same work.

Where vLLM is installed (the ``vllm`` environment), a third kind, ``generate``, times whole greedy
generations of ``batch`` prompts of ``prompt_len`` tokens and ``new_tokens`` new ones: transformers'
``generate``, dualop's engine (``generate``) and vLLM's ``LLM.generate`` in eager and compiled mode
(its own kernels: the dualop plugin is filtered out with ``VLLM_PLUGINS`` unless the caller set it),
end-of-sequence ignored by all, with each one's tokens compared to transformers'.

``dualop bench --decode PATH [PATH ...]`` (``bench_decode``) times the decode step of several
checkpoints of one model against the first, interleaved in one run: a float checkpoint and its
quantized forms (``docs/quantization.md``), at a few batch sizes. Each is loaded by
``from_pretrained`` in one frontend and dtype, all held in memory at once.
"""

from __future__ import annotations

import functools
import importlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

from dualop.bench.timing import interleaved, median, paired_ratio, relative_range

__all__ = ["TINY_LLAMA", "save_tiny_llama", "bench_model", "format_model_bench", "bench_decode",
           "format_decode_bench"]

# The default model: a small Llama (GQA, llama3 rope) that runs in milliseconds on a CPU.
TINY_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=1024,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 128})


def save_tiny_llama(path: str, seed: int = 0) -> str:
    """A random-initialised ``TINY_LLAMA`` saved with transformers' ``save_pretrained`` at ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval().save_pretrained(path)
    return path


def _transformers_steps(path: str, dtype: str, batch: int, prompt_len: int, context_len: int
                        ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                              attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
    context = torch.randint(0, vocab, (batch, context_len), generator=gen)
    with torch.inference_mode():
        cache = model(context, use_cache=True).past_key_values  # transformers' DynamicCache
    step_ids = torch.randint(0, vocab, (batch, 1), generator=gen)
    positions = torch.full((batch, 1), context_len)

    def prefill():
        with torch.inference_mode():
            return model(prompts, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()

    def decode():
        with torch.inference_mode():
            out = model(step_ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
            cache.crop(-1)  # drop the new token: the next call decodes the same position again
            return out.logits[:, -1].argmax(-1).tolist()

    return prefill, decode


def _vllm_missing() -> str | None:
    try:
        importlib.import_module("vllm")
    except Exception as err:  # not installed, or its import fails on this host
        return f"{type(err).__name__}: {err}"
    return None


def _generate_fns(path: str, dtype: str, frontends: tuple[str, ...], batch: int, prompt_len: int, new_tokens: int
                  ) -> dict[str, Callable[[], list[list[int]]]]:
    """Whole greedy generations, one callable per implementation (see the module docstring)."""
    import torch
    import transformers

    from dualop import models

    os.environ.setdefault("VLLM_PLUGINS", "")  # vLLM's own kernels (the dualop plugin filtered out)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process, one thread each
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs each engine's start on stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                           attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, hf.config.vocab_size, (batch, prompt_len), generator=gen)
    lists = prompts.tolist()

    def hf_generate():
        with torch.inference_mode():
            out = hf.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)
        return out[:, prompt_len:].tolist()

    fns: dict[str, Callable[[], list[list[int]]]] = {"transformers": hf_generate}
    limit = prompt_len + new_tokens
    for fe in frontends:
        model = models.from_pretrained(path, frontend=fe, dtype=dtype, max_model_len=limit, max_num_seqs=batch,
                                       max_num_batched_tokens=batch * prompt_len)
        fns[f"dualop-{fe}"] = functools.partial(model.generate, lists, new_tokens, stop_at_eos=False)
    from vllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for mode in ("eager", "compiled"):
        llm = LLM(model=path, enforce_eager=mode == "eager", skip_tokenizer_init=True, dtype=dtype,
                  max_model_len=max(limit, 64), seed=0)

        def vllm_generate(llm=llm):
            outs = llm.generate([{"prompt_token_ids": p} for p in lists], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        fns[f"vllm-{mode}"] = vllm_generate
    return fns


def bench_model(path: str | None = None, frontends: tuple[str, ...] = ("torch", "jax"), dtype: str = "float32",
                batch: int = 8, prompt_len: int = 64, context_len: int = 64, rounds: int = 7, warmup: int = 2,
                progress: bool = True, new_tokens: int = 16) -> list[dict[str, Any]]:
    """One record per (step, implementation): seconds per step (median over rounds), tokens per
    second, the spread and the paired ratio to transformers (see the module docstring)."""
    from dualop import models

    tmp = None
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="dualop-bench-model-")
        path = save_tiny_llama(os.path.join(tmp.name, "tiny-llama"))
    try:
        limit = max(prompt_len, context_len + 1)
        steps: dict[str, dict[str, Callable[[], Any]]] = {"prefill": {}, "decode": {}}
        steps["prefill"]["transformers"], steps["decode"]["transformers"] = _transformers_steps(
            path, dtype, batch, prompt_len, context_len)
        for fe in frontends:
            model = models.from_pretrained(path, frontend=fe, dtype=dtype, max_model_len=limit, max_num_seqs=batch,
                                           max_num_batched_tokens=batch * prompt_len)
            steps["prefill"][f"dualop-{fe}"] = model.benchmark_step(batch, prompt_len)
            # the cached context's values do not change the work; the warmup rounds compile jax's programs
            steps["decode"][f"dualop-{fe}"] = model.benchmark_step(batch, 1, context_len)
        records = []
        for kind, fns in steps.items():
            if progress:
                print(f"dualop bench --model: timing {kind} ({', '.join(fns)})", flush=True)
            times = interleaved(fns, rounds, warmup)
            tokens = batch * (prompt_len if kind == "prefill" else 1)
            for impl, samples in times.items():
                seconds = median(samples)
                records.append(dict(op="model", step=kind, impl=impl, dtype=dtype, batch=batch,
                                    tokens_per_step=tokens, context=0 if kind == "prefill" else context_len,
                                    seconds=seconds, tokens_per_second=tokens / seconds,
                                    spread=relative_range(samples),
                                    vs_transformers=paired_ratio(samples, times["transformers"])))
        if _vllm_missing() is None:
            fns = _generate_fns(path, dtype, frontends, batch, prompt_len, new_tokens)
            if progress:
                print(f"dualop bench --model: timing generate ({', '.join(fns)})", flush=True)
            tokens = {impl: fn() for impl, fn in fns.items()}  # each one's tokens (and its compile, if any)
            times = interleaved(fns, rounds, warmup)
            for impl, samples in times.items():
                seconds = median(samples)
                records.append(dict(op="model", step="generate", impl=impl, dtype=dtype, batch=batch,
                                    tokens_per_step=batch * new_tokens, context=prompt_len, seconds=seconds,
                                    tokens_per_second=batch * new_tokens / seconds, spread=relative_range(samples),
                                    vs_transformers=paired_ratio(samples, times["transformers"]),
                                    tokens_match_transformers=tokens[impl] == tokens["transformers"]))
        return records
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_model_bench(records: list[dict[str, Any]]) -> str:
    from dualop.bench.report import table

    rows = [{"step": f"{r['step']} ({r['batch']} x {r['tokens_per_step'] // r['batch']} new"
                     + (f", {r['context']} cached)" if r["step"] == "decode" else
                        f" after {r['context']})" if r["step"] == "generate" else ")"),
             "impl": r["impl"], "dtype": r["dtype"], "ms/step": f"{r['seconds'] * 1e3:.2f}",
             "tokens/s": f"{r['tokens_per_second']:.0f}", "spread": f"{r['spread']:.0%}",
             "time vs transformers": f"{r['vs_transformers']:.2f}",
             "tokens": {True: "= transformers", False: "DIFFER"}.get(r.get("tokens_match_transformers"), "")}
            for r in records]
    return table(rows, ["step", "impl", "dtype", "ms/step", "tokens/s", "spread", "time vs transformers", "tokens"])


def _weights_label(model: Any) -> str:
    """What a loaded checkpoint's linear weights are: its quantization method and schemes, or the
    model's float dtype."""
    quant = model.quantization
    if quant is None:
        return f"{model.dtype} (float)"
    schemes = sorted({q.describe() for q in quant.linears.values()})
    return f"{quant.method}: " + "; ".join(schemes)


def bench_decode(paths: list[str], frontend: str = "torch", dtype: str = "bfloat16", batches: tuple[int, ...] = (1, 4, 8),
                 context_len: int = 64, rounds: int = 7, warmup: int = 2, progress: bool = True
                 ) -> list[dict[str, Any]]:
    """One record per (batch, checkpoint): the decode step's seconds (median over rounds) with
    ``batch`` sequences after ``context_len`` cached tokens, and ``speedup``: the paired ratio of
    the first checkpoint's time to this one's (the first is the baseline, 1.0)."""
    from dualop import models

    if not paths:
        raise ValueError("bench_decode: give at least one checkpoint path (the first is the baseline)")
    if not batches or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batches):
        raise ValueError(f"bench_decode: batches must be positive ints, got {batches!r}")
    batches = tuple(dict.fromkeys(batches))  # each batch size once, in the order given
    if not isinstance(context_len, int) or context_len < 0:
        raise ValueError(f"bench_decode: context_len must be an int >= 0, got {context_len!r}")
    names = [os.path.basename(os.path.normpath(p)) or p for p in paths]
    if len(set(names)) != len(names):
        names = [os.path.normpath(p) for p in paths]  # two checkpoints of one name: their whole paths
    largest = max(batches)
    steps: dict[int, dict[str, Callable[[], Any]]] = {b: {} for b in batches}
    labels = {}
    for name, path in zip(names, paths):
        if progress:
            print(f"dualop bench --decode: loading {path}", flush=True)
        model = models.from_pretrained(path, frontend=frontend, dtype=dtype, max_model_len=context_len + 1,
                                       max_num_seqs=largest, max_num_batched_tokens=largest)
        labels[name] = _weights_label(model)
        for b in batches:
            steps[b][name] = model.benchmark_step(b, 1, context_len)
    records = []
    for b in batches:
        if progress:
            print(f"dualop bench --decode: timing batch {b} ({', '.join(names)})", flush=True)
        times = interleaved(steps[b], rounds, warmup)
        base = times[names[0]]
        for name in names:
            seconds = median(times[name])
            records.append(dict(op="model", step="decode", impl=name, weights=labels[name], frontend=frontend,
                                dtype=dtype, batch=b, context=context_len, seconds=seconds,
                                tokens_per_second=b / seconds, spread=relative_range(times[name]),
                                speedup=paired_ratio(base, times[name])))
    return records


def format_decode_bench(records: list[dict[str, Any]]) -> str:
    from dualop.bench.report import table

    rows = [{"batch": str(r["batch"]), "checkpoint": r["impl"], "weights": r["weights"],
             "ms/step": f"{r['seconds'] * 1e3:.2f}", "tokens/s": f"{r['tokens_per_second']:.1f}",
             "spread": f"{r['spread']:.0%}", "speedup": f"{r['speedup']:.2f}"}
            for r in records]
    return table(rows, ["batch", "checkpoint", "weights", "ms/step", "tokens/s", "spread", "speedup"])
