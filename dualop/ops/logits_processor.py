"""The logits processor: the LM head's matmul, the vocabulary gather over tensor parallelism, the
cut to the base vocabulary, and the final soft cap and scale."""

from __future__ import annotations

import functools
import math
from typing import Any

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels.cpu.linear import is_packed, matmul as packed_matmul, unpacked
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.logits_math import LogitsSpec, cap_and_scale
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, decline_if_recording
from dualop.parallel import TensorParallel, current_tensor_parallel, vocab_shard, vocab_token_ids
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving, float32_normal as _normal, rows_of
from dualop.testing import KERNEL_CELLS

__all__ = ["LogitsProcessor"]

_PALLAS_LOGITS = KernelRef("dualop.kernels.pallas.logits_processor", "logits_processor")
_TRITON_LOGITS = KernelRef("dualop.kernels.cuda.logits_processor", "logits_processor")
_CPU_LOGITS = KernelRef("dualop.kernels.cpu.logits_processor", "logits_processor")


def _positive_int(op: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{op}: argument {name!r} must be a positive int, got {value!r}")
    return value


@CustomOp.register("logits_processor")
class LogitsProcessor(CustomOp):
    """``op(lm_head_weight, hidden_states, embedding_bias=None)`` -> logits ``[..., org_vocab_size]``.

    Per rank, as the engine's: ``hidden_states @ W_shardᵀ (+ bias shard)`` with float32
    accumulation, the ranks' logits gathered along the vocabulary (``tp.all_gather``), cut to
    the ``org_vocab_size`` base tokens, soft-capped (``tanh(l / c) * c``) when ``soft_cap`` is
    set, then multiplied by ``scale``; float32 throughout, one cast to the input dtype (with no
    soft cap and scale 1, torch callers get the vendor's 16-bit matmul, which accumulates in
    float32 and rounds once). On one device the matmul covers only the ``org_vocab_size`` base rows
    (the output needs no cut); at tp > 1 each rank covers its padded base rows.

    ``lm_head_weight`` is this rank's LM-head rows ``[V_pad / tp, H]`` in the vocabulary-parallel
    layout of ``dualop.parallel.vocab_shard(vocab_size, org_vocab_size, padding_size, tp.size,
    rank)`` (``VocabParallelEmbedding`` / ``ParallelLMHead``): its base rows (padding rows
    included, zero), then its added (LoRA) rows; ``embedding_bias`` is the matching bias shard.

    Added vocabulary at tp > 1: the engine gathers the ranks' whole shards and cuts
    ``[:org_vocab_size]``, which at tp > 1 takes rank 0's added rows into the base range. Here each
    rank keeps only its base rows (the first ``num_org_elements_padded`` of its shard; the matmul
    skips the added rows) before the gather, so the gathered logits are the padded base vocabulary
    in token order and the cut is right at every tp (at tp 1, or with no added vocabulary, the
    same result as the engine's).

    The soft cap and scale are applied to each rank's logits before the gather (they are
    elementwise, so the result is the same), where the kernels fuse them into the matmul's epilogue
    and the gather moves the final values in the input dtype.

    ``logits_as_input=True``: ``hidden_states`` are already the logits; no matmul, no gather, no
    cut (as the engine), only the soft cap and scale. ``lm_head_weight`` is then not read, but
    dispatch reads the frontend off the first argument: pass a float array of ``hidden_states``'
    frontend and device there (the logits again); anything else is refused.

    Paths: a fused kernel (the matmul with bias, soft cap and scale in its epilogue, one write of
    the logits) where there is an epilogue: Pallas on TPU, Triton on CUDA/ROCm, ``F.linear`` then
    the epilogue as one compiled pass on the torch CPU. With no soft cap and scale 1.0 the logits
    are the plain matmul: every kernel declines and the native body runs the vendor's matmul.
    """

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0,
                 logits_as_input: bool = False, soft_cap: float | None = None, *, padding_size: int = 64,
                 tp: TensorParallel | None = None, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = "logits_processor"
        self.vocab_size = _positive_int(op, "vocab_size", vocab_size)
        org = vocab_size if org_vocab_size is None else _positive_int(op, "org_vocab_size", org_vocab_size)
        if org > vocab_size:
            raise ValueError(f"{op}: argument 'org_vocab_size' is {org}; expected at most vocab_size={vocab_size}")
        self.org_vocab_size = org
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"{op}: argument 'scale' must be a finite float, got {scale!r}")
        if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float))
                                     or not soft_cap > 0):
            raise ValueError(f"{op}: argument 'soft_cap' must be None or a float > 0, got {soft_cap!r}")
        if soft_cap is not None and not math.isfinite(soft_cap):
            raise ValueError(f"{op}: argument 'soft_cap' must be None or a float > 0, got {soft_cap!r}; expected a "
                             f"finite value (tanh(l / inf) * inf is NaN)")
        self.scale = float(scale)
        self.soft_cap = None if soft_cap is None else float(soft_cap)
        self.logits_as_input = bool(logits_as_input)
        self.padding_size = _positive_int(op, "padding_size", padding_size)
        if tp is not None and not isinstance(tp, TensorParallel):
            raise TypeError(f"{op}: argument 'tp' must be a dualop.parallel.TensorParallel or None, "
                            f"got {type(tp).__qualname__}")
        self.tp = current_tensor_parallel() if tp is None else tp
        # Sizes only (they are the same on every rank; inside shard_map the rank is traced).
        shard = vocab_shard(self.vocab_size, org, self.padding_size, self.tp.size, 0, op=op)
        self.shard_rows = shard.num_embeddings_per_partition  # rows of each rank's weight shard
        self.base_rows = shard.num_org_elements_padded  # its base rows, the ones the output keeps
        # The columns each rank computes: its base rows; on one device just the base vocabulary
        # (the kernel then writes the output itself, no cut and copy after it).
        self.local_rows = org if self.tp.size == 1 else self.base_rows
        self.spec = LogitsSpec(soft_cap=self.soft_cap, scale=self.scale)

    # ------------------------------------------------------------------ checks

    def check_inputs(self, lm_head_weight: Any, hidden_states: Any, embedding_bias: Any = None) -> None:
        op = type(self).name
        fe = check_array(op, "hidden_states", hidden_states)
        if self.logits_as_input:
            if embedding_bias is not None:
                raise ValueError(f"{op}: argument 'embedding_bias' must be None with logits_as_input=True (the "
                                 "logits are given; the engine adds no bias to them)")
            # unused, but dispatch picks the path by its frontend and device: they must be hidden_states'
            if lm_head_weight is None:
                raise ValueError(f"{op}: argument 'lm_head_weight' is required with logits_as_input=True too (it is "
                                 "not read, but dispatch reads the frontend off it): pass the logits again")
            check_optional_like(op, "lm_head_weight", lm_head_weight, "hidden_states", hidden_states, fe,
                                shape=tuple(lm_head_weight.shape))
            return
        if lm_head_weight is None:
            raise ValueError(f"{op}: argument 'lm_head_weight' is required (this rank's [{self.shard_rows}, H] shard)")
        check_optional_like(op, "lm_head_weight", lm_head_weight, "hidden_states", hidden_states, fe,
                            shape=tuple(lm_head_weight.shape), same_dtype=True)
        hidden = hidden_states.shape[-1]
        if lm_head_weight.ndim != 2 or lm_head_weight.shape[1] != hidden:
            raise ValueError(f"{op}: argument 'lm_head_weight' has shape {tuple(lm_head_weight.shape)}; expected "
                             f"[rows, {hidden}] (the width of 'hidden_states')")
        if lm_head_weight.shape[0] != self.shard_rows:
            raise ValueError(
                f"{op}: argument 'lm_head_weight' has {lm_head_weight.shape[0]} rows; expected {self.shard_rows}: "
                f"one rank's shard of vocab_size={self.vocab_size} (org_vocab_size={self.org_vocab_size}, "
                f"padding_size={self.padding_size}) over tensor-parallel size {self.tp.size}")
        check_optional_like(op, "embedding_bias", embedding_bias, "hidden_states", hidden_states, fe,
                            shape=(self.shard_rows,), same_dtype=True)

    # ------------------------------------------------------------------ bodies

    def _local_logits(self, lm_head_weight: Any, hidden_states: Any, embedding_bias: Any = None) -> Any:
        """This rank's base-vocabulary logits ``[..., local_rows]``, soft-capped and scaled, in the
        input dtype: what the kernels compute (and the VJP their JAX callers differentiate)."""
        xp = array_namespace(hidden_states)
        dtype = hidden_states.dtype
        if self.logits_as_input:
            logits = xp.astype(hidden_states, xp.float32)
        else:
            bias = None if embedding_bias is None else embedding_bias[: self.local_rows]
            if is_packed(lm_head_weight):  # packed for oneDNN by its owner (kernels/cpu/linear.py)
                if lm_head_weight.shape[0] == self.local_rows and not self.spec.has_epilogue:
                    return packed_matmul(hidden_states, lm_head_weight, bias)
                lm_head_weight = unpacked(lm_head_weight)
            weight = lm_head_weight[: self.local_rows]
            if not self.spec.has_epilogue and family_of(frontend_of(hidden_states)) == "torch":
                # the plain matmul: the vendor's, float32 accumulation and one rounding (no copies)
                import torch.nn.functional as F

                return F.linear(hidden_states, weight, bias)
            logits = _matmul_f32(hidden_states, weight)
            if bias is not None:
                logits = logits + xp.astype(bias, xp.float32)
        return xp.astype(cap_and_scale(xp, logits, self.spec), dtype)

    def _finish(self, local_logits: Any) -> Any:
        """The one place the collective runs: gather the ranks' base logits along the vocabulary
        and cut the padding off (nothing for ``logits_as_input``, as the engine)."""
        if self.logits_as_input:
            return local_logits
        logits = self.tp.all_gather(local_logits, dim=-1)
        return logits if logits.shape[-1] == self.org_vocab_size else logits[..., : self.org_vocab_size]

    def forward_native(self, lm_head_weight: Any, hidden_states: Any, embedding_bias: Any = None) -> Any:
        return self._finish(self._local_logits(lm_head_weight, hidden_states, embedding_bias))

    def _no_kernel(self) -> str | None:
        """Why this configuration has no fused kernel on any platform, or None."""
        if self.logits_as_input:
            return "logits_as_input: no matmul to fuse into; the native body's elementwise soft cap and scale"
        if not self.spec.has_epilogue:
            return "no soft cap and scale 1.0: the logits are the plain matmul, the vendor's in the native body"
        return None

    def _require_kernel(self) -> None:
        """The kernel methods decline (NotImplementedError) what ``_no_kernel`` names also when
        called directly (``dualop compile`` builds forward_tpu / forward_cuda without dispatch)."""
        why = self._no_kernel()
        if why is not None:
            raise NotImplementedError(why)

    def declines(self, method: str, frontend: str) -> str | None:
        return self._no_kernel()

    def forward_cpu(self, lm_head_weight: Any, hidden_states: Any, embedding_bias: Any = None) -> Any:
        """torch on the CPU: ``F.linear`` (oneDNN/MKL, float32 accumulation), then the soft cap and
        scale in one compiled pass over its output (``kernels/cpu/logits_processor``)."""
        self._require_kernel()
        decline_if_recording(type(self).name, lm_head_weight, hidden_states, embedding_bias)
        local = _CPU_LOGITS(lm_head_weight, hidden_states, embedding_bias, spec=self.spec, rows=self.local_rows)
        return self._finish(local)

    def forward_cuda(self, lm_head_weight: Any, hidden_states: Any, embedding_bias: Any = None) -> Any:
        self._require_kernel()
        local = call_triton(frontend_of(hidden_states), _TRITON_LOGITS, lm_head_weight, hidden_states,
                            embedding_bias, spec=self.spec, rows=self.local_rows)
        return self._finish(local)

    def forward_tpu(self, lm_head_weight: Any, hidden_states: Any, embedding_bias: Any = None) -> Any:
        self._require_kernel()
        local = call_jax_function(frontend_of(hidden_states), _PALLAS_LOGITS, lm_head_weight, hidden_states,
                            embedding_bias, spec=self.spec, rows=self.local_rows, native=self._local_logits)
        return self._finish(local)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, org_vocab_size={self.org_vocab_size}, scale={self.scale}, "
                f"logits_as_input={self.logits_as_input}, soft_cap={self.soft_cap}, tp={self.tp.size}")


def _matmul_f32(hidden_states: Any, weight: Any) -> Any:
    """``hidden_states @ weightᵀ`` in float32: jax multiplies the inputs as they are with float32
    accumulation (no copies on TPU and GPUs; full precision); torch multiplies float32 copies (a
    16-bit torch matmul would round its output)."""
    if family_of(frontend_of(hidden_states)) == "jax":
        import jax
        import jax.numpy as jnp

        if hidden_states.dtype != jnp.float32 and _cpu_lacks_mixed_dot():
            # the upcast is exact; it costs a float32 copy of the weight per call
            hidden_states, weight = hidden_states.astype(jnp.float32), weight.astype(jnp.float32)
        # float32 at full precision (XLA:TPU would otherwise multiply it in bfloat16 passes); 16-bit
        # products are exact in float32 at the default precision
        precision = jax.lax.Precision.HIGHEST if hidden_states.dtype == jnp.float32 else None
        return jax.lax.dot_general(hidden_states, weight, (((hidden_states.ndim - 1,), (1,)), ((), ())),
                                   precision=precision, preferred_element_type=jnp.float32)
    import torch
    import torch.nn.functional as F

    return F.linear(hidden_states.to(torch.float32), weight.to(torch.float32))


@functools.lru_cache(maxsize=None)
def _cpu_lacks_mixed_dot() -> bool:
    """XLA:CPU of jax < 0.8 (the xla environment's 0.7) has no 16-bit x 16-bit = float32 dot
    ("Unsupported element type for DotThunk"); newer jax and TPUs/GPUs do."""
    import jax

    version = tuple(int(p) for p in jax.__version__.split(".")[:2] if p.isdigit())
    return version < (0, 8) and jax.default_backend() == "cpu"


def check_cases():
    """Shapes are the hidden states' (``[..., H]``); each case has its vocabulary (1000 pads to
    1024: two 512-row vocab blocks; 300 with 16 added tokens: base rows 320 of a 384-row shard). The
    weight is the tp-1 shard (``[V_pad, H]``, padding rows zero); logits of a few units, so a soft
    cap of 4-5 bends them."""
    import numpy as np

    from dualop.testing import NORM_SHAPES, OpCase, normal

    def inputs(vocab: int, org: int | None = None, bias: bool = False, logits: bool = False):
        def make(shape, rng):
            if logits:  # the first argument is only read for its frontend: pass the logits there too
                x = normal((*shape[:-1], vocab), rng, 6.0)
                return (x, x, normal((vocab,), rng) if bias else None)
            hidden = shape[-1]
            layout = vocab_shard(vocab, org, 64, 1, 0)
            weight = np.zeros((layout.num_embeddings_per_partition, hidden), np.float32)
            rows = [i for i, t in enumerate(vocab_token_ids(layout)) if t >= 0]
            weight[rows] = normal((len(rows), hidden), rng, 3.0 / hidden ** 0.5)
            b = normal((layout.num_embeddings_per_partition,), rng) if bias else None
            return (weight, normal(shape, rng), b)

        return make

    return [
        OpCase("logits_processor", "logits_processor[plain]", lambda s: LogitsProcessor(1000), inputs(1000),
               NORM_SHAPES),
        OpCase("logits_processor", "logits_processor[logits_as_input]",
               lambda s: LogitsProcessor(1000, scale=0.5, logits_as_input=True, soft_cap=5.0),
               inputs(1000, logits=True), NORM_SHAPES),
        OpCase("logits_processor", "logits_processor[soft_cap,scale,bias,added_vocab]",
               lambda s: LogitsProcessor(300, 284, 0.5, soft_cap=4.0), inputs(300, 284, bias=True), NORM_SHAPES),
        OpCase("logits_processor", "logits_processor[soft_cap]", lambda s: LogitsProcessor(1000, soft_cap=5.0),
               inputs(1000), NORM_SHAPES),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- logits processor -------------------------------------------------------------------
# The LM head's logits with Gemma-2's final soft cap (30) on hidden states of (tokens, hidden): a
# 32000-token vocabulary (Llama-2 / Mistral; pass smaller hidden sizes on a small host), decode
# ``--sizes 16x4096`` and prefill ``512x4096``. The weight read dominates decode (the roofline's
# bytes are the weight's); peers: F.linear then the cap in float32 (torch), a dot with float32
# accumulation then the cap (jax), and torch.compile of the native body (the bench's torch-compile).
LOGITS_VOCAB, LOGITS_SOFT_CAP = 32000, 30.0


def _logits_processor(hidden: int):
    from dualop.ops import LogitsProcessor

    return LogitsProcessor(LOGITS_VOCAB, soft_cap=LOGITS_SOFT_CAP)


def _logits_inputs(shape, rng):
    from dualop.parallel import pad_vocab_size

    hidden = shape[-1]
    weight = _normal((pad_vocab_size(LOGITS_VOCAB), hidden), rng, 3.0 / hidden ** 0.5)
    weight[LOGITS_VOCAB:] = 0.0  # the padding rows of the vocabulary-parallel layout
    return (weight, _normal(shape, rng))


def _logits_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.logits_processor_cost(rows_of(shape), shape[-1], op.org_vocab_size, itemsize, False, True)


def _torch_logits(op):
    import torch
    import torch.nn.functional as F

    cap, vocab = op.soft_cap, op.org_vocab_size

    def logits(weight, hidden_states):
        y = F.linear(hidden_states, weight[:vocab]).float()
        return (torch.tanh(y / cap) * cap).to(hidden_states.dtype)

    return logits


def _jax_logits(op):
    import jax
    import jax.numpy as jnp

    cap, vocab = op.soft_cap, op.org_vocab_size

    def logits(weight, hidden_states):
        y = jax.lax.dot_general(hidden_states, weight[:vocab], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return (jnp.tanh(y / cap) * cap).astype(hidden_states.dtype)

    return logits


def _logits_processor_inputs(shape: tuple[int, ...]) -> tuple:
    tokens, hidden, vocab = shape
    from dualop.parallel import pad_vocab_size

    return (InputSpec((pad_vocab_size(vocab, 64), hidden), None), InputSpec((tokens, hidden), None), None)


def _logits_processor_op(shape: tuple[int, ...]):
    from dualop.ops import LogitsProcessor

    return LogitsProcessor(shape[2], soft_cap=30.0)


def bench_cases():
    """Not run by default: the LM head with Gemma-2's soft cap against F.linear then the cap (torch)
    and a float32-accumulating dot then the cap (jax)."""
    return [BenchCase("logits_processor[soft_cap]", "logits_processor", _logits_processor, _logits_inputs,
                      _logits_cost, _torch_logits, _jax_logits, default=False, matrix=True)]


def serving():
    """(tokens, hidden, vocab): one chip's whole LM head with the fused soft cap of Gemma-2 (30):
    Gemma-2-27B (hidden 4608, vocab 256000) and Llama-3-70B's width (hidden 8192, vocab 128256;
    Llama itself has no cap, and its plain logits decline to XLA's dot, so the cap stands for any
    epilogue at that width); a 16-token decode batch and an 8192-token prefill, in bfloat16 (a
    float32 LM head at these sizes is not served)."""
    return {"logits_processor": Serving(
        ((16, 8192, 128256), (8192, 8192, 128256), (16, 4608, 256000), (8192, 4608, 256000)),
        _logits_processor_inputs, {"logits_processor[soft_cap]": _logits_processor_op}, ("bfloat16",),
        ("logits_processor[soft_cap]",))}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {
    "logits_processor": {"traits": {"contraction"}},
    "logits_processor[soft_cap]": {"traits": {"soft_capped"}},
    "logits_processor[soft_cap,scale,bias,added_vocab]": {"traits": {"soft_capped"}},
    # a plain matmul (no soft cap, scale 1) is the vendor's; logits given as input leave only an
    # elementwise epilogue: every kernel cell declines both, to the native body
    "logits_processor[plain]": {"native_cells": {(f, p): "the logits are the plain matmul" for f, p, _ in KERNEL_CELLS}},
    "logits_processor[logits_as_input]": {"native_cells": {(f, p): "logits_as_input: no matmul to fuse into"
                                                            for f, p, _ in KERNEL_CELLS}},
}
