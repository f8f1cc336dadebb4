"""Vocabulary-parallel embedding and the LM head's weight layout: ``VocabParallelEmbedding``
(registered ``vocab_parallel_embedding``) and ``ParallelLMHead`` (``parallel_lm_head``), the
reference serving engine's ops.

``op = VocabParallelEmbedding(num_embeddings, embedding_dim, params_dtype=None,
org_num_embeddings=None, padding_size=64, tp=None)``; ``out = op(input_ids, weight_shard)``.

- The vocabulary is padded and split over the ``tp`` ranks as ``dualop.parallel.vocab_shard``
  says (the engine's layout: the base vocabulary padded to a multiple of ``padding_size``, then the
  added/LoRA ids, each part split evenly; a rank's shard is ``[its base rows | its added rows]``,
  padding rows included). ``weight_shard`` is this rank's ``[num_embeddings_per_partition,
  embedding_dim]`` rows (float32/bfloat16/float16).
- ``input_ids``: int32/int64, any shape, ids of the whole vocabulary in ``[0, num_embeddings)``.
  Ids outside this rank's shard (base or added range) give zero rows; the ranks' results are then
  summed (``tp.all_reduce``), so each id gets its one row: ``[*input_ids.shape, embedding_dim]``
  in the weight's dtype. At tp 1 this is ``F.embedding(input_ids, weight[:num_embeddings])``.
- ``tp``: a ``dualop.parallel.TensorParallel`` (default: ``current_tensor_parallel()`` at
  construction). Inside ``shard_map`` (``AxisTensorParallel``) the rank is traced: the shard bounds
  are then read from a small per-rank table by the traced rank, so one traced program serves every
  rank.

Id validation: a negative id or one ``>= num_embeddings`` is a ``ValueError`` where the ids' values
are at hand (torch CPU/CUDA tensors outside ``torch.compile`` and CUDA graph capture; jax arrays
outside a trace), before any result is returned: on the torch CPU the lookup checks the ids itself
(the C++ kernel in a first pass of its own, ``F.embedding`` as it gathers) and the op then names
the offending id; elsewhere the check reads ``min``/``max`` (on CUDA one small read-back, a device
sync per call). Traced or lazy ids (``jax.jit``, ``shard_map``, torch_xla, torchax) are not read: there every
path gives a zero row for an id outside the vocabulary (it is in no rank's shard).

``ParallelLMHead(num_embeddings, embedding_dim, bias=False, params_dtype=None,
org_num_embeddings=None, padding_size=64, tp=None)`` is the same weight layout for the output
projection; as in the engine it has no forward (the ``logits_processor`` op applies the LM head:
``LogitsProcessor(...)(head_weight_shard, hidden_states)``): calling it raises. Its layers
(``dualop.torch.layers`` / ``dualop.jax.layers``) hold the shard and can ``tie_weights`` to the
embedding.

Paths: Pallas (``kernels/pallas/embedding.py``: ids in SMEM, the weight left in HBM, one DMA per
needed row, the shard mask fused), Triton (``kernels/cuda/embedding.py``: token block x dim block
gather, masked rows zero), and on the torch CPU a C++ loop (``kernels/cpu/embedding.py``: per id
one row ``memcpy`` or a zero row, OpenMP over ids for large calls), or ``F.embedding`` itself when
the shard is the whole vocabulary (tp 1, no added ids: no mask to fuse). Measured here it matched
``F.embedding`` itself (which has no shard mask) and beat ``F.embedding`` of masked ids plus the
zeroing (the masks are 5 extra tensor passes: about 6x at 64 ids, 2x at 4096).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.backends.torch.triton_launch import call_triton
from dualop.backends.xla.jax_bridge import call_jax_function
from dualop.custom_op import CustomOp
from dualop.kernels import cost as cost_model
from dualop.kernels.cost import KernelCost
from dualop.kernels.registry import KernelRef
from dualop.ops._checks import check_array, check_optional_like, decline_if_recording, dtype_name
from dualop.parallel import TensorParallel, VocabShard, current_tensor_parallel, vocab_shard
from dualop.platforms import family_of, frontend_of
from dualop.spec import BenchCase, InputSpec, Serving

__all__ = ["VocabParallelEmbedding", "ParallelLMHead", "masked_vocab_lookup", "checkpoint_row_segments"]

_PALLAS_EMBEDDING = KernelRef("dualop.kernels.pallas.embedding", "vocab_embedding")
_TRITON_EMBEDDING = KernelRef("dualop.kernels.cuda.embedding", "vocab_embedding")
_ID_DTYPES = ("int32", "int64")


def _shard_bounds(shard: VocabShard) -> tuple[int, int, int, int, int]:
    """``(org_start, org_end, added_start, added_end, added_offset)`` of one rank: the engine's
    ``get_masked_input_and_mask`` arguments; an added id ``i`` sits at local row ``i - added_offset``
    (after this rank's base rows and their padding)."""
    added_offset = shard.added_vocab_start - shard.num_org_elements - shard.num_org_vocab_padding
    return (shard.org_vocab_start, shard.org_vocab_end, shard.added_vocab_start, shard.added_vocab_end, added_offset)


def masked_vocab_lookup(input_ids: Any, weight_shard: Any, bounds: Any) -> Any:
    """The engine's ``get_masked_input_and_mask`` then the lookup, frontend-neutral: ids in this
    rank's base or added range read their local row, every other id a zero row. ``bounds``: five
    ints or a length-5 int array (a traced rank's row of the shard table)."""
    xp = array_namespace(weight_shard)
    org_start, org_end, added_start, added_end, added_offset = (bounds[i] for i in range(5))
    in_org = (input_ids >= org_start) & (input_ids < org_end)
    in_added = (input_ids >= added_start) & (input_ids < added_end)
    valid = in_org | in_added
    local = xp.where(in_org, input_ids - org_start, input_ids - added_offset)
    rows = xp.take(weight_shard, xp.where(valid, local, 0 * input_ids), axis=0)
    zero = xp.asarray(0, like=weight_shard)
    return xp.where(xp.reshape(valid, (*valid.shape, 1)), rows, zero)


def checkpoint_row_segments(shard: VocabShard, checkpoint_rows: int, *, layer: str, param: str,
                            trailing: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """How a full checkpoint tensor fills one rank's shard, as ``(shard_row, checkpoint_row, count)``
    copies (every other row of the shard is zero): its base ids, then (when the checkpoint also
    holds the added ids, ``num_embeddings`` rows) its added ids after the base padding. A checkpoint
    of ``org_num_embeddings`` rows (the engine's: added/LoRA rows come from elsewhere) fills the
    base only. Any other row count is a ``ValueError`` naming ``layer``, ``param`` and the expected
    full shapes (``trailing``: the dims after the vocabulary one)."""
    if checkpoint_rows not in (shard.org_num_embeddings, shard.num_embeddings):
        shapes = {(shard.org_num_embeddings, *trailing), (shard.num_embeddings, *trailing)}
        raise ValueError(f"{layer}.weight_loader: the full tensor for parameter {param!r} has "
                         f"{checkpoint_rows} vocabulary rows; expected shape {' or '.join(map(str, sorted(shapes)))}")
    segments = [(0, shard.org_vocab_start, shard.num_org_elements)]
    if checkpoint_rows == shard.num_embeddings and shard.num_added_elements:
        segments.append((shard.num_org_elements_padded, shard.added_vocab_start, shard.num_added_elements))
    return [seg for seg in segments if seg[2] > 0]


def _known_id_range(input_ids: Any, frontend: str) -> tuple[int, int] | None:
    """``(min, max)`` of the ids where their values are at hand without tracing, a lazy graph or a
    CUDA graph capture (see the module docstring); None otherwise."""
    if frontend == "torch":
        import torch

        if input_ids.device.type not in ("cpu", "cuda") or torch.compiler.is_compiling():
            return None
        if isinstance(input_ids, torch._subclasses.FakeTensor):
            return None
        if input_ids.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        low, high = torch.aminmax(input_ids)
        return int(low), int(high)
    if frontend == "jax":
        import jax

        if isinstance(input_ids, jax.core.Tracer):
            return None
        return int(jax.numpy.min(input_ids)), int(jax.numpy.max(input_ids))
    return None


def _on_torch_cpu(input_ids: Any, frontend: str | None) -> bool:
    return frontend == "torch" and input_ids.device.type == "cpu"


@CustomOp.register("vocab_parallel_embedding")
class VocabParallelEmbedding(CustomOp):
    """Embedding lookup over a vocabulary sharded across tensor-parallel ranks (see the module
    docstring)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Any = None,
                 org_num_embeddings: int | None = None, padding_size: int = 64, tp: TensorParallel | None = None,
                 *, enforce_enable: bool = False) -> None:
        super().__init__(enforce_enable=enforce_enable)
        op = type(self).name or "vocab_parallel_embedding"
        if not isinstance(embedding_dim, int) or isinstance(embedding_dim, bool) or embedding_dim <= 0:
            raise ValueError(f"{op}: argument 'embedding_dim' must be a positive int, got {embedding_dim!r}")
        tp = current_tensor_parallel() if tp is None else tp
        if not isinstance(tp, TensorParallel):
            raise TypeError(f"{op}: argument 'tp' must be a dualop.parallel.TensorParallel or None, "
                            f"got {type(tp).__qualname__}")
        self.tp = tp
        self.num_embeddings, self.embedding_dim, self.params_dtype = num_embeddings, embedding_dim, params_dtype
        self.padding_size = padding_size
        # Every rank's shard: the one source of the layout (errors name the op and the argument).
        self.shards = tuple(vocab_shard(num_embeddings, org_num_embeddings, padding_size, tp.size, rank, op=op)
                            for rank in range(tp.size))
        first = self.shards[0]
        self.org_vocab_size = first.org_num_embeddings
        self.org_vocab_size_padded = first.org_vocab_size_padded
        self.num_embeddings_padded = first.num_embeddings_padded
        self.num_embeddings_per_partition = first.num_embeddings_per_partition
        self._bounds_table = tuple(_shard_bounds(s) for s in self.shards)
        # tp 1 and no added ids: every valid id is its own row, nothing to mask
        self._shard_is_the_vocabulary = tp.size == 1 and first.num_added_elements == 0

    def shard(self, rank: int | None = None) -> VocabShard:
        """Rank ``rank``'s (default: this rank's, when it is an int) ``VocabShard``."""
        return self.shards[self.tp.rank if rank is None else rank]

    def _bounds(self, like: Any, as_array: bool = False) -> Any:
        """This rank's five bounds: Python ints for an int rank, else (a traced rank, or
        ``as_array`` for a kernel argument) an int32 array on ``like``'s device."""
        rank = self.tp.rank
        if isinstance(rank, int):
            if not as_array:
                return self._bounds_table[rank]
            return array_namespace(like).asarray(self._bounds_table[rank], like=like, dtype=_int32(like))
        xp = array_namespace(like)
        return xp.take(xp.asarray(self._bounds_table, like=like, dtype=_int32(like)), rank, axis=0)

    def _finish(self, partial: Any) -> Any:
        """The one collective: sum this rank's rows (zeros for ids it does not hold) over the ranks."""
        return self.tp.all_reduce(partial)

    def check_inputs(self, input_ids: Any, weight_shard: Any = None) -> None:
        op = type(self).name
        fe = frontend_of(input_ids)
        if fe is None:
            raise TypeError(f"{op}: argument 'input_ids' must be a torch.Tensor or jax.Array, got "
                            f"{type(input_ids).__module__}.{type(input_ids).__qualname__}")
        if dtype_name(input_ids) not in _ID_DTYPES:
            raise TypeError(f"{op}: argument 'input_ids' has dtype {dtype_name(input_ids)}; expected int32 or int64")
        if weight_shard is None:
            raise ValueError(f"{op}: argument 'weight_shard' is required "
                             f"([{self.num_embeddings_per_partition}, {self.embedding_dim}])")
        check_array(op, "weight_shard", weight_shard, min_ndim=2)
        check_optional_like(op, "weight_shard", weight_shard, "input_ids", input_ids, fe,
                            shape=(self.num_embeddings_per_partition, self.embedding_dim))
        if not _on_torch_cpu(input_ids, fe):  # there the method that runs checks them (_check_torch_cpu_ids)
            self._check_id_values(input_ids, fe)

    def _check_id_values(self, input_ids: Any, fe: str) -> None:
        """The ids' range where their values are at hand (``_known_id_range``): a ``ValueError``
        naming the first offending extreme."""
        if input_ids.size if fe == "jax" else input_ids.numel():
            known = _known_id_range(input_ids, fe)
            if known is not None and (known[0] < 0 or known[1] >= self.num_embeddings):
                bad = known[0] if known[0] < 0 else known[1]
                raise ValueError(f"{type(self).name}: argument 'input_ids' holds id {bad}; expected ids in "
                                 f"[0, num_embeddings = {self.num_embeddings})")

    def _check_torch_cpu_ids(self, input_ids: Any) -> None:
        """Torch CPU ids skip check_inputs' value read, because forward_cpu's lookups check them
        themselves at no extra pass (the C++ kernel's first pass, ATen's ``F.embedding``); every
        other method that may get them reads them here."""
        if _on_torch_cpu(input_ids, frontend_of(input_ids)):
            self._check_id_values(input_ids, "torch")

    def forward_native(self, input_ids: Any, weight_shard: Any) -> Any:
        self._check_torch_cpu_ids(input_ids)
        return self._finish(masked_vocab_lookup(input_ids, weight_shard, self._bounds(input_ids)))


    def forward_cpu(self, input_ids: Any, weight_shard: Any) -> Any:
        """torch on the CPU: the C++ lookup (``kernels/cpu/embedding.py``), mask fused; while autograd
        records (it has no backward) the native body runs. When this rank's shard is the whole
        vocabulary (tp 1, no added ids) nothing is masked and an id is its row: then ATen's own
        ``F.embedding`` is the lookup (the C++ loop measured 13–16% slower than it at 4096 ids,
        docs/BENCHMARKS.md)."""
        from dualop.kernels.cpu.embedding import OutOfVocabulary, vocab_embedding

        decline_if_recording(type(self).name, weight_shard)
        if self._shard_is_the_vocabulary:
            import torch.nn.functional as F

            try:  # ATen checks every id against the unpadded rows: the id check costs nothing extra
                return F.embedding(input_ids, weight_shard[: self.num_embeddings])
            except IndexError:
                self._check_id_values(input_ids, "torch")  # the op's own error, naming the id
                raise
        try:
            rows = vocab_embedding(input_ids, weight_shard, self._bounds(input_ids), self.num_embeddings)
        except OutOfVocabulary:
            self._check_id_values(input_ids, "torch")  # names the offending id
            raise
        return self._finish(rows)

    def forward_cuda(self, input_ids: Any, weight_shard: Any) -> Any:
        self._check_torch_cpu_ids(input_ids)  # the interpreter's cell: Triton on CPU tensors
        fe = frontend_of(input_ids)
        return self._finish(call_triton(fe, _TRITON_EMBEDDING, input_ids, weight_shard, self._bounds(input_ids)))

    def forward_tpu(self, input_ids: Any, weight_shard: Any) -> Any:
        self._check_torch_cpu_ids(input_ids)
        fe = frontend_of(input_ids)
        if dtype_name(weight_shard) == "float16":  # seen refused by Mosaic: "Invalid vector register cast"
            raise NotImplementedError(f"{type(self).name}: the Pallas kernel takes float32 and bfloat16 tables "
                                      "(Mosaic refuses its 16-bit float16 unpacking)")
        if dtype_name(weight_shard) != "float32" and weight_shard.shape[0] % 2:
            raise NotImplementedError(f"{type(self).name}: the Pallas kernel reads 16-bit rows in pairs and needs an "
                                      f"even row count per shard (got {weight_shard.shape[0]})")
        bounds = self._bounds(input_ids, as_array=True)
        return self._finish(call_jax_function(fe, _PALLAS_EMBEDDING, input_ids, weight_shard, bounds,
                                        native=masked_vocab_lookup))

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"org_vocab_size={self.org_vocab_size}, num_embeddings_padded={self.num_embeddings_padded}, "
                f"tp_size={self.tp.size}")


def _int32(like: Any) -> Any:
    """The int32 dtype of ``like``'s frontend."""
    if family_of(frontend_of(like)) == "jax":
        import jax.numpy as jnp

        return jnp.int32
    import torch

    return torch.int32


@CustomOp.register("parallel_lm_head")
class ParallelLMHead(VocabParallelEmbedding):
    """The output projection's weight in the embedding's padded, rank-major layout; no forward:
    the ``logits_processor`` op applies it (as in the engine). ``bias`` records whether the
    layers hold a ``[num_embeddings_per_partition]`` bias shard."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, params_dtype: Any = None,
                 org_num_embeddings: int | None = None, padding_size: int = 64, tp: TensorParallel | None = None,
                 *, enforce_enable: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, org_num_embeddings, padding_size, tp,
                         enforce_enable=enforce_enable)
        self.bias = bool(bias)

    def _no_forward(self) -> RuntimeError:
        return RuntimeError("parallel_lm_head: the LM head has no forward (its weight is used by the logits "
                            "processor): call dualop.ops.LogitsProcessor(...)(lm_head_weight_shard, hidden_states)")

    def check_inputs(self, input_ids: Any, weight_shard: Any = None) -> None:
        raise self._no_forward()

    def forward_native(self, input_ids: Any, weight_shard: Any) -> Any:
        raise self._no_forward()


def check_cases():
    """Tiny vocabularies (tp 1): shapes are ``(tokens, num_embeddings, org_num_embeddings,
    embedding_dim)``; padding 64, so the table has padding rows (and, with added ids, padding
    between the base and the added rows); the ids cover the whole vocabulary."""
    import numpy as np

    from dualop.testing import OpCase, Pinned, normal

    def make_op(shape):
        tokens, vocab, org, dim = shape
        return VocabParallelEmbedding(vocab, dim, org_num_embeddings=org, padding_size=64)

    def make_inputs(shape, rng):
        tokens, vocab, org, dim = shape
        rows = make_op(shape).num_embeddings_per_partition
        ids = rng.integers(0, vocab, tokens).astype(np.int32)
        return (Pinned(ids, "int32"), normal((rows, dim), rng))

    return [
        OpCase("vocab_parallel_embedding", "vocab_parallel_embedding", make_op, make_inputs,
               ((0, 100, 100, 32), (1, 100, 100, 32), (37, 100, 100, 32), (21, 110, 100, 32), (64, 1026, 1010, 128))),
    ]


# --- spec: what dualop bench times and dualop compile builds (check_cases above) -----------


# --- vocab_parallel_embedding: the token embedding gather --------------------------------
# The bench size (tokens, D) is the ids' count and the embedding dim over Llama-3's vocabulary of
# 128256 rows (one device: the whole padded table): ``64xD`` is a decode step, ``4096xD`` a prefill
# (Llama-3-8B's D is 4096; the table then takes 1 GiB in bfloat16, 2 GiB in float32, so smoke runs
# here use a smaller D). Peers: ``F.embedding`` and ``jnp.take`` on the same table.
EMBEDDING_VOCAB = 128256


def _vocab_embedding(dim: int):
    from dualop.ops import VocabParallelEmbedding

    return VocabParallelEmbedding(EMBEDDING_VOCAB, dim)


def _vocab_embedding_inputs(shape, rng):
    from dualop.testing import Pinned

    tokens, dim = shape
    ids = Pinned(rng.integers(0, EMBEDDING_VOCAB, tokens).astype(np.int32), "int32")
    return (ids, rng.standard_normal((EMBEDDING_VOCAB, dim), dtype=np.float32))


def _vocab_embedding_cost(op, shape, itemsize) -> KernelCost:
    return cost_model.embedding_gather_cost(shape[0], shape[1], itemsize)


def _torch_embedding(op):
    import torch.nn.functional as F

    return lambda input_ids, weight: F.embedding(input_ids, weight)


def _jax_take(op):
    import jax.numpy as jnp

    return lambda input_ids, weight: jnp.take(weight, input_ids, axis=0)


def _serving_vocab_embedding_inputs(shape: tuple[int, ...]) -> tuple:
    from dualop.parallel import vocab_shard

    tokens, vocab, org, dim = shape
    rows = vocab_shard(vocab, org).num_embeddings_per_partition
    return (InputSpec((tokens,), "int32"), InputSpec((rows, dim), None))


def bench_cases():
    """Not run by default: the token embedding gather against F.embedding and jnp.take."""
    return [BenchCase("vocab_parallel_embedding", "vocab_parallel_embedding", _vocab_embedding,
                      _vocab_embedding_inputs, _vocab_embedding_cost, _torch_embedding, _jax_take, default=False)]


def serving():
    """(tokens, num_embeddings, org_num_embeddings, embedding_dim): Llama-3-70B's table (vocab
    128256, hidden 8192) at one device, a 16-token decode batch and an 8192-token prefill; the ids
    are int32, the table this rank's padded rows."""
    return {"vocab_parallel_embedding": Serving(((16, 128256, 128256, 8192), (8192, 128256, 128256, 8192)),
                                                _serving_vocab_embedding_inputs)}

# What the shared test sweeps know about these ops' check cases (``testing.with_notes``: keys are op
# names or case labels; traits as ``dualop.testing.TRAITS`` defines them).
CASE_NOTES = {"vocab_parallel_embedding": {"traits": {"case_shapes_only", "token_table"}}}
