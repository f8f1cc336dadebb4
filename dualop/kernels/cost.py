"""Cost models of dualop's kernels: the bytes each call must move, the flops and transcendentals it
does. One frontend-neutral place (no jax, torch or triton import), read by three consumers:

- the Pallas kernels, which pass these numbers to ``pl.CostEstimate`` (XLA's scheduler reads them);
- ``dualop bench``, whose achieved GB/s divides ``bytes_accessed`` by the measured time;
- ``dualop bench --roofline-only``, which divides them by a device's published peaks.

The Triton kernels read and write the same arrays once each, so the same numbers describe them.
Bytes count every input read once and every output written once (the roofline minimum), never a
re-read or a temporary; flops count float32 vector operations per element as written in the kernel.
"""

from __future__ import annotations

import dataclasses

from dualop.kernels.gate_math import GateSpec

__all__ = [
    "KernelCost",
    "rms_norm_cost",
    "gated_activation_cost",
    "rms_norm_gated_cost",
    "pointwise_activation_cost",
    "quant_fp8_cost",
    "row_amax_cost",
    "rotary_cost",
    "POINTWISE_COUNTS",
    "ragged_paged_attention_cost",
    "experts_used",
    "fused_moe_cost",
    "linear_cost",
    "logits_processor_cost",
    "embedding_gather_cost",
]


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one kernel call must do: the fields of ``pl.CostEstimate``, by the same names."""

    flops: int
    transcendentals: int
    bytes_accessed: int


def rms_norm_cost(rows: int, hidden: int, itemsize: int, has_weight: bool, has_residual: bool) -> KernelCost:
    """RMSNorm: read x (and residual) and the weight, write out (and the new residual); one rsqrt
    per row."""
    n = rows * hidden
    reads = n * itemsize * (2 if has_residual else 1) + (hidden * itemsize if has_weight else 0)
    writes = n * itemsize * (2 if has_residual else 1)
    flops = n * (3 + (1 if has_weight else 0) + (1 if has_residual else 0))
    return KernelCost(flops=flops, transcendentals=rows, bytes_accessed=reads + writes)


def gated_activation_cost(rows: int, d: int, itemsize: int, spec: GateSpec = GateSpec()) -> KernelCost:
    """``act(gate) * up``: read both halves (2d per row), write d per row."""
    n = rows * d
    transcendental = spec.activation not in ("fatrelu",)
    return KernelCost(
        flops=n * (8 if spec.sparsity else 6),
        transcendentals=n if transcendental else 0,
        bytes_accessed=3 * n * itemsize,
    )


def rms_norm_gated_cost(rows: int, hidden: int, group_size: int, itemsize: int, weight_itemsize: int,
                        has_z: bool) -> KernelCost:
    """Gated group RMSNorm: read x (and z) and the weight, write out."""
    n = rows * hidden
    reads = n * itemsize * (2 if has_z else 1) + hidden * weight_itemsize
    writes = n * itemsize
    # x*x, sum, x*inv_rms, *weight (+ z*sigmoid(z), and the gate product)
    flops = n * (4 + (3 if has_z else 0))
    transcendentals = rows * (hidden // group_size) + (n if has_z else 0)  # rsqrt per group, sigmoid
    return KernelCost(flops=flops, transcendentals=transcendentals, bytes_accessed=reads + writes)


# Pointwise activation -> (flops, transcendentals) per element, as the kernel body computes it.
POINTWISE_COUNTS: dict[str, tuple[int, int]] = {
    "gelu_new": (9, 1),
    "gelu": (5, 1),
    "gelu_fast": (9, 1),
    "quick_gelu": (4, 1),
    "relu2": (2, 0),
    "xielu": (12, 2),
}
# Pointwise activations that also read two float32 scalars (xIELU's slopes).
_POINTWISE_SCALAR_BYTES = {"xielu": 8}


def pointwise_activation_cost(n: int, itemsize: int, activation: str) -> KernelCost:
    """One read and one write of every element (plus the two xIELU scalars)."""
    if activation not in POINTWISE_COUNTS:
        raise ValueError(
            f"pointwise_activation_cost: activation {activation!r} is not one of {sorted(POINTWISE_COUNTS)}"
        )
    flops, trans = POINTWISE_COUNTS[activation]
    extra = _POINTWISE_SCALAR_BYTES.get(activation, 0)
    return KernelCost(flops=n * flops, transcendentals=n * trans, bytes_accessed=2 * n * itemsize + extra)


def quant_fp8_cost(rows: int, hidden: int, itemsize: int, n_scales: int) -> KernelCost:
    """Read x once, write x_q (one byte per element) and the float32 scales once."""
    n = rows * hidden
    return KernelCost(flops=6 * n, transcendentals=0, bytes_accessed=n * (itemsize + 1) + 4 * n_scales)


def row_amax_cost(rows: int, hidden: int, itemsize: int) -> KernelCost:
    """Per-row max |x| (quant_fp8's first pass over rows too wide for one block): read x once,
    write one float32 per row."""
    n = rows * hidden
    return KernelCost(flops=2 * n, transcendentals=0, bytes_accessed=n * itemsize + 4 * rows)


def encoder_attention_cost(segment_lengths: list[int], num_heads: int, num_kv_heads: int, head_size: int,
                           itemsize: int) -> KernelCost:
    """``mm_encoder_attn`` over packed segments: per segment of L tokens and per query head,
    ``q . k`` and ``P @ V`` (2 * L * L * D flops each) and one exp per logit; read q, k and v once,
    write the output once (the flash kernels never write the L x L logits)."""
    tokens = sum(segment_lengths)
    pairs = sum(n * n for n in segment_lengths)
    return KernelCost(
        flops=4 * pairs * num_heads * head_size,
        transcendentals=pairs * num_heads,
        bytes_accessed=tokens * head_size * itemsize * (2 * num_heads + 2 * num_kv_heads),
    )


def ragged_paged_attention_cost(q_rows: int, kv_tokens: int, pairs: int, num_q_heads: int, num_kv_heads: int,
                                head_dim: int, itemsize: int) -> KernelCost:
    """Ragged paged attention: read q and the K and V of the ``kv_tokens`` cached tokens its
    sequences attend to (each page once: decode is bound by these bytes), write the output.
    ``pairs``: (query row, visible KV position) pairs; per pair and query head, ``q . k`` and
    ``p . v`` (2 * head_dim multiply-adds each) and one exp."""
    reads = q_rows * num_q_heads * head_dim * itemsize + kv_tokens * 2 * num_kv_heads * head_dim * itemsize
    writes = q_rows * num_q_heads * head_dim * itemsize
    return KernelCost(flops=4 * pairs * num_q_heads * head_dim, transcendentals=pairs * num_q_heads,
                      bytes_accessed=reads + writes)


def ragged_paged_mla_attention_cost(q_rows: int, kv_tokens: int, pairs: int, num_heads: int, kv_lora_rank: int,
                                    rope_dim: int, itemsize: int) -> KernelCost:
    """Absorbed MLA over a paged latent cache: read ``q_latent`` (``L + R`` per head) and each
    cached latent row (``L + R``, one per token, shared by every head) once, write ``L`` per head.
    Per (query row, visible position) pair and head: ``q . row`` (``L + R`` multiply-adds) and
    ``p . row[:L]`` (``L``), one exp."""
    width = kv_lora_rank + rope_dim
    reads = q_rows * num_heads * width * itemsize + kv_tokens * width * itemsize
    writes = q_rows * num_heads * kv_lora_rank * itemsize
    return KernelCost(flops=2 * pairs * num_heads * (width + kv_lora_rank), transcendentals=pairs * num_heads,
                      bytes_accessed=reads + writes)


def rotary_cost(tokens: int, heads: int, head_size: int, rotary_dim: int, itemsize: int,
                cos_itemsize: int | None = None) -> KernelCost:
    """Rotary embedding of ``heads`` heads (query and key together) per token: read and write each
    head once, read one cos and one sin row (``rotary_dim / 2``) per token; 3 flops per rotated
    channel (2 mul, 1 add)."""
    n = tokens * heads * head_size
    cos_bytes = 2 * tokens * (rotary_dim // 2) * (cos_itemsize or itemsize)
    return KernelCost(flops=3 * tokens * heads * rotary_dim, transcendentals=0,
                      bytes_accessed=2 * n * itemsize + cos_bytes)


def experts_used(tokens: int, top_k: int, num_experts: int) -> float:
    """Expected number of distinct experts ``tokens`` tokens routed uniformly to ``top_k`` of
    ``num_experts`` each reach: the experts whose weights a call must read."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def fused_moe_cost(tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int, itemsize: int,
                   gated: bool = True) -> KernelCost:
    """The experts of an MoE layer as two grouped matmuls over the ``tokens * top_k`` routed rows:
    read x, the router logits and the weights of the experts in use (``experts_used``: decode is
    bound by these bytes), write the output. Per row ``2 * hidden * (w13 rows + intermediate)``
    flops and one transcendental per intermediate element (the activation)."""
    rows = tokens * top_k
    w13_rows = 2 * intermediate if gated else intermediate
    weight_bytes = round(experts_used(tokens, top_k, num_experts) * (w13_rows + intermediate) * hidden) * itemsize
    activations = 2 * tokens * hidden * itemsize + tokens * num_experts * itemsize
    return KernelCost(flops=2 * rows * hidden * (w13_rows + intermediate),
                      transcendentals=rows * intermediate if gated else 0,
                      bytes_accessed=weight_bytes + activations)


def linear_cost(tokens: int, in_features: int, out_features: int, itemsize: int, has_bias: bool) -> KernelCost:
    """``x @ weight.T (+ bias)``: read x and the weight (and bias) once, write the output; two flops
    per multiply-add (the vendor GEMM's, on the matrix units)."""
    reads = (tokens * in_features + out_features * in_features + (out_features if has_bias else 0)) * itemsize
    return KernelCost(flops=2 * tokens * in_features * out_features, transcendentals=0,
                      bytes_accessed=reads + tokens * out_features * itemsize)
def logits_processor_cost(tokens: int, hidden: int, vocab: int, itemsize: int, has_bias: bool = False,
                          soft_cap: bool = False) -> KernelCost:
    """The LM head's fused logits: read the hidden states ``[T, H]`` and the weight rows ``[V, H]``
    once (the weight dominates a decode step), write the logits ``[T, V]`` once; ``2 T H V`` matmul
    flops plus the epilogue (bias, ``/ c``, ``* c``, ``* scale``) and one tanh per logit when capped."""
    n = tokens * vocab
    reads = (tokens * hidden + vocab * hidden + (vocab if has_bias else 0)) * itemsize
    return KernelCost(flops=2 * tokens * hidden * vocab + n * (4 if soft_cap else 2),
                      transcendentals=n if soft_cap else 0, bytes_accessed=reads + n * itemsize)


def patch_embed_cost(patches: int, patch_size: int, out_channels: int, itemsize: int, bias: bool,
                     input_elements: int | None = None) -> KernelCost:
    """A patch embedding as one matmul: read x (``input_elements``, default every patch's
    ``patch_size`` values), the ``[out, patch_size]`` weight and the bias, write ``[patches, out]``;
    ``2 * patch_size * out`` flops per patch."""
    x = patches * patch_size if input_elements is None else input_elements
    return KernelCost(flops=2 * patches * patch_size * out_channels, transcendentals=0,
                      bytes_accessed=(x + out_channels * patch_size + (out_channels if bias else 0)
                                      + patches * out_channels) * itemsize)


__all__ += ["patch_embed_cost"]
def embedding_gather_cost(tokens: int, dim: int, itemsize: int) -> KernelCost:
    """Vocabulary embedding lookup: read the ids (int32) and one weight row per token, write the
    ``[tokens, dim]`` output (the roofline minimum: every token's row fetched, none cached)."""
    return KernelCost(flops=0, transcendentals=0, bytes_accessed=2 * tokens * dim * itemsize + 4 * tokens)


def causal_conv1d_cost(tokens: int, dim: int, seqs: int, kernel_size: int, itemsize: int, silu: bool) -> KernelCost:
    """Depthwise causal conv1d over packed sequences: read x and write y, read each
    sequence's float32 starting state and write its final state (``K - 1`` values per channel),
    read the float32 weight and bias; a multiply-add per tap, one sigmoid per output with SiLU."""
    n = tokens * dim
    states = 2 * seqs * dim * (kernel_size - 1) * 4
    return KernelCost(flops=2 * kernel_size * n, transcendentals=n if silu else 0,
                      bytes_accessed=2 * n * itemsize + states + (kernel_size + 1) * dim * 4)


def plamo2_mamba_mixer_cost(tokens: int, seqs: int, hidden: int, heads: int, head_dim: int, state: int, rank: int,
                            conv_kernel: int, itemsize: int) -> KernelCost:
    """PLaMo 2's Mamba mixer, one call: read the tokens and every weight once, write the output,
    read and write each sequence's conv and SSM state slots; flops of the four projections, the
    depthwise conv and the SSD recurrence (decay, input, output per state element); per token one
    exp and one softplus per head and two sigmoids (conv, gate) per channel."""
    inner = heads * head_dim
    weights = (2 * inner * hidden + inner * conv_kernel + (2 * state + rank) * inner + heads * rank + 3 * heads
               + rank + 2 * state + hidden * inner)
    states = seqs * (inner * (conv_kernel - 1) + heads * head_dim * state)
    matmul = 2 * tokens * (2 * inner * hidden + (2 * state + rank) * inner + rank * heads + inner * hidden)
    scan = tokens * heads * head_dim * state * 5
    return KernelCost(flops=matmul + 2 * tokens * inner * conv_kernel + scan,
                      transcendentals=tokens * (2 * heads + 2 * inner),
                      bytes_accessed=(2 * tokens * hidden + weights + 2 * states) * itemsize)


__all__ += ["plamo2_mamba_mixer_cost"]


def short_conv_cost(tokens: int, hidden: int, seqs: int, conv_kernel: int, itemsize: int) -> KernelCost:
    """LFM2's short conv block, one call: read the tokens and the three weights once, write the
    output, read and write each sequence's float32 conv state (``L - 1`` values per channel); flops
    of the two projections (``3H x H`` and ``H x H``), the depthwise conv and the two gates."""
    weights = (4 * hidden + conv_kernel) * hidden
    states = 2 * seqs * hidden * (conv_kernel - 1) * 4
    return KernelCost(flops=2 * tokens * hidden * (4 * hidden + conv_kernel + 1), transcendentals=0,
                      bytes_accessed=(2 * tokens * hidden + weights) * itemsize + states)


__all__ += ["short_conv_cost"]


def selective_scan_cost(tokens: int, dim: int, state_size: int, seqs: int, itemsize: int,
                        has_z: bool = True) -> KernelCost:
    """Mamba-1's selective scan: read x, dt (and z) ``[T, I]``, B and C ``[T, N]``, A ``[I, N]``, each
    sequence's initial state and write its final state (float32 ``[I, N]``), write y; per (token,
    channel, state) one exp and about five flops (the decay product, the input term, the C sum)."""
    rows = tokens * dim
    states = seqs * dim * state_size * 4 * 2
    reads = rows * itemsize * (3 if has_z else 2) + 2 * tokens * state_size * itemsize + dim * state_size * 4
    return KernelCost(flops=5 * rows * state_size + 6 * rows, transcendentals=rows * state_size + rows * (2 if has_z else 1),
                      bytes_accessed=reads + rows * itemsize + states)


__all__ += ["selective_scan_cost"]


def ssd_chunk_scan_cost(tokens: int, heads: int, head_dim: int, state: int, groups: int, seqs: int, chunk: int,
                        itemsize: int) -> KernelCost:
    """Mamba-2's chunked SSD scan: per token and head the matmuls C Bᵀ and its product with x over
    the chunk, the segment sums (a chunk-wide product), and per sequence the entering state's
    output and the chunk-end state (``2 T H (L (N + P + L) + 2 P N)`` flops); the exps of the
    masks; x, z, y, B, C, dt moved once and each sequence's initial and final float32 state."""
    flops = 2 * tokens * heads * (chunk * (state + head_dim + chunk) + 2 * head_dim * state)
    moved = (3 * tokens * heads * head_dim * itemsize + 2 * tokens * groups * state * itemsize
             + tokens * heads * itemsize + 2 * seqs * heads * head_dim * state * 4)
    return KernelCost(flops=flops, transcendentals=tokens * heads * (chunk + 2), bytes_accessed=moved)
