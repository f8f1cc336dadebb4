"""fused_moe in bfloat16 on the CPU against transformers' ``MixtralExperts`` run in bfloat16 (eager),
interleaved in one process: the comparison docs/BENCHMARKS.md's MoE tables report.

``dualop bench`` cannot time this peer: it only times peers that compute the op's value, and the
bfloat16 block rounds its intermediate (see docs/BENCHMARKS.md), so it is timed here. Both sides get the
same weights and inputs and glibc set to reuse freed memory, as ``dualop bench`` does.

    python scripts/bench_moe_bf16_peer.py --threads 1 --rounds 8 --tokens 1,64,512 --families mixtral,qwen3
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def _peer(op, w13, w2):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=op.hidden_size, intermediate_size=op.intermediate_size,
                           num_local_experts=op.num_experts, num_experts_per_tok=op.top_k)
    config._experts_implementation = "eager"
    experts = MixtralExperts(config).requires_grad_(False).to(torch.bfloat16)
    experts.gate_up_proj.data, experts.down_proj.data = w13, w2

    def run(x, logits):
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), op.top_k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        return experts(x, ids, weights)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", default="1,64,512", help="comma-separated token counts")
    parser.add_argument("--families", default="mixtral,qwen3", help="comma-separated: mixtral, qwen3")
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from dualop.ops import moe
    from dualop.bench.memory import reuse_freed_memory

    if not reuse_freed_memory():
        raise SystemExit("could not set glibc to reuse freed memory (dualop bench's setting)")
    for family in args.families.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            op = moe._moe_op(family)(args.hidden)
            arrays = moe._moe_inputs(family)((tokens, args.hidden), np.random.default_rng(0))
            x, logits, w13, w2 = (torch.tensor(np.asarray(a, np.float32)).bfloat16() for a in arrays)
            peer = _peer(op, w13, w2)
            impls = {"dualop": lambda: op(x, logits, w13, w2), "transformers-bf16": lambda: peer(x, logits)}
            times: dict[str, list[float]] = {name: [] for name in impls}
            for fn in impls.values():
                fn()
            for r in range(args.rounds):  # alternate the order each round: load drifts hit both sides
                for name in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
                    start = time.perf_counter()
                    impls[name]()
                    times[name].append(time.perf_counter() - start)
            flops = 2 * tokens * op.top_k * 3 * args.hidden * op.intermediate_size
            median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            ratio = statistics.median(a / b for a, b in zip(times["dualop"], times["transformers-bf16"]))
            print(f"{family:8s} T={tokens:4d} threads={args.threads}: "
                  + "  ".join(f"{name} {ms:.2f} ms ({flops / ms / 1e6:.0f} useful GFLOP/s)" for name, ms in median_ms.items())
                  + f"  dualop/peer (median of per-round ratios) {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
