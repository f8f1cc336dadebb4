"""A causal language model over dualop ops, and the loop that serves it: ``CausalLM``.

``CausalLM`` holds the parameters, the caches and the compiled step of one model; a family
(``dualop.models.llama``, ...) supplies ``build_ops``, ``param_plan``, ``cache_plan`` and
``forward(params, batch, caches) -> (logits, caches)``, written once for both frontends.

The serving loop is the reference engine's, in miniature:

- a paged KV cache: ``num_pages`` pages of ``page_size`` tokens per attention layer, each sequence
  owning a row of ``page_indices``; the step writes its new K/V with ``reshape_and_cache`` and
  attends with ``ragged_paged_attention``;
- continuous batching: up to ``max_num_seqs`` sequences run at once; each step every running
  sequence gets its next chunk of up to ``max_num_batched_tokens`` tokens in all (a decode is one
  token, a prompt is cut into chunks), so one step mixes prefill, chunked prefill and decode; a
  finished sequence frees its pages and its slot, and a waiting prompt takes them;
- greedy sampling: the argmax of each sequence's last row, once its prompt is in the cache;
- the KV cache's dtype (``ServingConfig.kv_cache_dtype``, the engine's names): "auto" is the
  model's; "fp8" / "fp8_e4m3" (float8_e4m3fn) and "fp8_e5m2" (float8_e5m2) allocate the paged KV
  caches in fp8 and pass ``kv_cache_dtype`` and each layer's ``k_scale`` / ``v_scale`` to
  ``reshape_and_cache`` and ``ragged_paged_attention`` (``kv_cache_options``; an MLA model's
  latent cache: ``kv_cache_dtype`` and ``k_scale`` to ``multi_head_latent_attention``); the scales are the
  checkpoint's ``<layer>.*.k_scale`` / ``v_scale`` (or ``k_proj.output_scale`` /
  ``v_proj.output_scale``) where it has them, else 1.0, as the engine reads them.

A step's arrays (``StepBatch``) are int32: ``input_ids``, ``positions`` (``[T]``, or
``[position_rows, T]`` for a family with several position rows, e.g. mrope's temporal/height/width)
and ``slot_mapping`` (``[T]``, padding slots -1), ``kv_lens`` ``[S]``, ``page_indices`` ``[S, pages_per_seq]``,
``cu_q_lens`` ``[S + 1]``, ``num_seqs`` ``[1]``, ``logits_indices`` (the rows whose logits are
wanted) and, for state-space layers, ``state_indices`` ``[S]`` (each sequence's state slot) and
``has_initial_state`` ``[S]``; a family may add arrays of its own (``step_inputs``, e.g. a
multimodal model's encoder outputs). For jax, T is padded to a power of two (at least 16) and S to
``max_num_seqs``, so a generation compiles a few programs, not one per step. A model with state
caches (``has_state_cache``) gets S = ``max_num_seqs + 1`` rounded up to a multiple of 8 instead,
each padding sequence slot -1 and at least one padding token, and T = S in a decode step (the
state-space ops' serving contract: no empty sequence, T == S only when every sequence is one token,
their decode kernels' case; a multiple of 8 keeps that T in whole sublane rows on a TPU).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dualop.models.checkpoint import Checkpoint
from dualop.models.frontends import CacheSpec, Frontend
from dualop.models.params import Param, with_quantization
from dualop.models.quantized import read_quantization
from dualop.ops.kv_cache import KV_CACHE_DTYPES

__all__ = ["CausalLM", "ServingConfig", "StepStats"]


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """The cache and batching limits of a model: ``max_model_len`` (prompt plus generated tokens
    per sequence), ``max_num_seqs`` (sequences in the batch at once), ``max_num_batched_tokens``
    (tokens per step), ``page_size`` (tokens per KV page), ``kv_cache_dtype`` (the paged KV
    cache's dtype by the engine's name: ``KV_CACHE_DTYPES``)."""

    max_model_len: int = 512
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    page_size: int = 16
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "kv_cache_dtype":
                if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
                    raise ValueError(f"from_pretrained: kv_cache_dtype must be one of "
                                     f"{', '.join(repr(k) for k in KV_CACHE_DTYPES)}, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"from_pretrained: {field.name} must be a positive int, got {value!r}")

    def prompt_overflow(self, length: int, max_new_tokens: int,
                        names: tuple[str, str] = ("max_new_tokens", "max_model_len")) -> str | None:
        """Why a prompt of ``length`` tokens cannot generate ``max_new_tokens`` more within
        ``max_model_len`` (the end of a sentence whose subject is the prompt), or None if it can. ``names`` are how the message names the two limits:
        ``from_pretrained``'s and ``generate``'s arguments, or the ``dualop generate`` flags."""
        if length + max_new_tokens <= self.max_model_len:
            return None
        new, limit = names
        return (f"has {length} tokens; with {new}={max_new_tokens} that exceeds {limit}={self.max_model_len} (the "
                "KV cache's length per sequence)")

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def num_pages(self) -> int:
        return self.max_num_seqs * self.pages_per_seq


@dataclasses.dataclass
class StepStats:
    """One step of ``generate``: tokens in it, how many were prefill, sequences, seconds."""

    tokens: int
    prefill_tokens: int
    sequences: int
    seconds: float


@dataclasses.dataclass
class _Sequence:
    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    computed: int = 0
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    had_state: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the family's per-sequence inputs

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class CausalLM:
    """A model built from a checkpoint: ``logits(input_ids)`` and ``generate(prompts, max_new_tokens)``
    (see the module docstring). Made by ``dualop.models.from_pretrained``."""

    architectures: tuple[str, ...] = ()
    has_kv_cache = True
    has_state_cache = False
    position_rows = 0  # 0: a step's positions are [T]; R > 0: [R, T] (``token_positions``)
    _fp8_kv: _Fp8KvCache | None = None  # an fp8 paged KV cache (``kv_cache_options``); None: the model's dtype

    def __init__(self, ckpt: Checkpoint, frontend: Frontend, dtype: str, serving: ServingConfig,
                 progress: Callable[[str], None] | None = None, *, weight_only: bool = False) -> None:
        plan = self._setup(ckpt.config, frontend, dtype, serving, ckpt.path)
        # quantized layers (a layout dualop cannot follow refused here, before anything is read)
        self.quantization = read_quantization(ckpt)
        plan = self.plan = with_quantization(plan, self.quantization, frontend.tp_size, weight_only)
        expected: dict[str, tuple[int, ...]] = {}
        for p in plan:
            expected.update(p.expected)
        ckpt.check(expected)  # every tensor and shape before anything is read
        if self._fp8_kv is not None:
            self._fp8_kv.read_scales(ckpt, getattr(self, "layers_prefix", "model.layers."))
        self.params = frontend.load_params(plan, lambda name: ckpt.get(name, frontend.framework), dtype,
                                           self.keep_float32, progress)
        ckpt.close()
        self.caches = [frontend.zeros(spec) for spec in self.cache_specs]
        self._step = frontend.compile(self.forward, {p.name: p.split_dim for p in plan}, self.cache_specs)
        self.last_step_stats: list[StepStats] = []

    def _setup(self, config: dict[str, Any], frontend: Frontend, dtype: str, serving: ServingConfig,
               path: str | None) -> list[Param]:
        """Everything but the arrays: the config, the ops, the parameter and cache plans."""
        self.checkpoint_path = path
        self.hf_config = config
        self.frontend, self.dtype, self.serving = frontend, dtype, serving
        self.tp = frontend.tp
        self.parse_config(config)
        self.build_ops()
        self.plan = self.param_plan()
        self.cache_specs = self.cache_plan()
        self._fp8_kv = _Fp8KvCache.install(self, serving.kv_cache_dtype)
        self.eos_token_ids = self._eos_ids(config.get("eos_token_id"))
        return self.plan

    @classmethod
    def abstract(cls, config: dict[str, Any], frontend: Frontend, dtype: str, serving: ServingConfig) -> CausalLM:
        """The model of ``config`` with no arrays: its ops, parameter plan (``plan``) and cache plan
        (``cache_specs``), for building its step from shapes alone (``dualop compile --model``)."""
        model = cls.__new__(cls)
        model._setup(config, frontend, dtype, serving, None)
        return model

    # -- what a family supplies ---------------------------------------------------------------

    def parse_config(self, config: dict[str, Any]) -> None:
        raise NotImplementedError

    def build_ops(self) -> None:
        raise NotImplementedError

    def param_plan(self) -> list[Param]:
        raise NotImplementedError

    def cache_plan(self) -> list[CacheSpec]:
        raise NotImplementedError

    def forward(self, params: dict[str, Any], batch: dict[str, Any], caches: list[Any]) -> tuple[Any, list[Any]]:
        raise NotImplementedError

    def keep_float32(self, name: str) -> bool:
        """Parameters kept in float32 whatever the model dtype (e.g. a router's correction bias)."""
        return False

    def token_positions(self, seq: _Sequence, start: int, n: int) -> np.ndarray:
        """The rope positions of ``seq``'s tokens ``start .. start + n``: their indices, ``[n]``
        (``[position_rows, n]``, every row the same, when ``position_rows``). Families whose
        positions are not the indices (mrope with images) override this."""
        pos = np.arange(start, start + n)
        return pos if not self.position_rows else np.broadcast_to(pos, (self.position_rows, n))

    def step_inputs(self, entries: list[tuple[_Sequence, int]], t_pad: int) -> dict[str, Any]:
        """Arrays of the family's own (already the frontend's) added to a step's batch, for
        ``entries`` = [(sequence, tokens)] laid out in order over ``t_pad`` rows; none by default."""
        return {}

    # -- shared helpers --------------------------------------------------------------------------

    @staticmethod
    def _eos_ids(value: Any) -> frozenset[int]:
        if value is None:
            return frozenset()
        return frozenset(value if isinstance(value, (list, tuple)) else [value])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def _pad_tokens(self, n: int) -> int:
        if self.frontend.name != "jax":
            return n
        return max(16, 1 << (n - 1).bit_length())

    @staticmethod
    def _pad_state_batch(cu: np.ndarray, state_indices: np.ndarray, num: int, t_pad: int) -> None:
        """Make the padding of a step a batch the state-space ops accept (``dualop.ops.ssm_batch``):
        every padding sequence gets slot -1 (it reads and writes no state) and at least one of the
        padding tokens (the last takes the rest), so ``cu_q_lens`` strictly increases to T, and
        T == S only when every sequence is one token (the ops' decode case). Attention ignores
        sequences past ``num_seqs``, so this changes nothing for it."""
        s_pad = state_indices.shape[0]
        state_indices[num:] = -1
        if s_pad > num:
            cu[num + 1:s_pad] = cu[num] + np.arange(1, s_pad - num)
            cu[s_pad] = t_pad

    def _run(self, entries: list[tuple[_Sequence, int]], logits_rows: Sequence[int] | None) -> Any:
        """One step over ``entries`` = [(sequence, tokens to compute)]; returns the logits of the
        rows ``logits_rows`` (default: each sequence's last row)."""
        s_max, page_size = self.serving.max_num_seqs, self.serving.page_size
        t, num = sum(n for _, n in entries), len(entries)
        if self.frontend.name != "jax":
            t_pad, s_pad = t, num
        elif not self.has_state_cache:
            t_pad, s_pad = self._pad_tokens(t), s_max
        else:  # see _pad_state_batch: a padding sequence always exists; a decode step has T == S
            s_pad = -(-(s_max + 1) // 8) * 8  # whole sublane rows: a decode step's T on a TPU
            t_pad = s_pad if t == num else self._pad_tokens(t + s_pad - num)
        ids = np.zeros(t_pad, np.int32)
        positions = np.zeros((self.position_rows, t_pad) if self.position_rows else t_pad, np.int32)
        slots = np.full(t_pad, -1, np.int32)
        kv_lens = np.zeros(s_pad, np.int32)
        pages = np.zeros((s_pad, self.serving.pages_per_seq), np.int32)
        cu = np.zeros(s_pad + 1, np.int32)
        state_indices = np.zeros(s_pad, np.int32)
        has_state = np.zeros(s_pad, np.int32)
        last_rows = []
        row = 0
        for i, (seq, n) in enumerate(entries):
            pos = np.arange(seq.computed, seq.computed + n)
            ids[row:row + n] = seq.tokens[seq.computed:seq.computed + n]
            positions[..., row:row + n] = self.token_positions(seq, seq.computed, n)
            table = np.asarray(seq.pages, np.int32)
            slots[row:row + n] = table[pos // page_size] * page_size + pos % page_size
            kv_lens[i] = seq.computed + n
            pages[i, :len(seq.pages)] = table
            state_indices[i] = seq.slot
            has_state[i] = seq.computed > 0
            row += n
            cu[i + 1] = row
            last_rows.append(row - 1)
        cu[len(entries) + 1:] = row
        if self.has_state_cache:
            self._pad_state_batch(cu, state_indices, num, t_pad)
        if logits_rows is None:
            logits_rows = last_rows + [0] * (s_pad - len(last_rows))
        elif self.frontend.name == "jax":
            logits_rows = list(logits_rows) + [0] * (t_pad - len(logits_rows))
        fe = self.frontend
        batch = dict(input_ids=ids, positions=positions, slot_mapping=slots, kv_lens=kv_lens, page_indices=pages,
                     cu_q_lens=cu, num_seqs=np.asarray([len(entries)]), logits_indices=np.asarray(logits_rows))
        if self.has_state_cache:
            batch.update(state_indices=state_indices, has_initial_state=has_state)
        batch = {k: fe.int_array(v) for k, v in batch.items()}
        batch.update(self.step_inputs(entries, t_pad))
        logits, self.caches = self._step(self.params, batch, self.caches)
        return logits

    def _check_tokens(self, what: str, ids: Sequence[int]) -> list[int]:
        out = []
        for token in ids:
            is_int = isinstance(token, (int, np.integer)) and not isinstance(token, bool)
            value = int(token) if is_int else -1
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{self.architectures[0]}: {what} holds token id {token!r}; expected ints in "
                                 f"[0, {self.vocab_size})")
            out.append(value)
        return out

    # -- the public calls ------------------------------------------------------------------------

    def logits(self, input_ids: Any) -> Any:
        """``[T, vocab]`` logits of one sequence (a list of ints or a 1-D array), no cache kept,
        in the frontend's array type and the model's dtype."""
        return self._sequence_logits(self._prompt_ids(input_ids))

    def _prompt_ids(self, input_ids: Any) -> list[int]:
        """``logits``' ``input_ids`` checked: one non-empty sequence of token ids within the vocabulary
        and ``max_model_len``."""
        name = self.architectures[0]
        if isinstance(input_ids, (str, bytes)):
            raise TypeError(f"{name}.logits: input_ids must be a list of ints or a 1-D integer array, got a string")
        flat = np.asarray(input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids, dtype=object)
        if flat.ndim != 1:
            raise ValueError(f"{name}.logits: input_ids must be one sequence (1-D), got shape {flat.shape}")
        ids = self._check_tokens("input_ids", flat.tolist())
        if not ids:
            raise ValueError(f"{name}.logits: input_ids is empty")
        limit = self.serving.max_model_len
        if len(ids) > limit:
            raise ValueError(f"{name}.logits: {len(ids)} tokens exceed max_model_len={limit} "
                             "(the KV cache's length per sequence; pass a larger max_model_len to from_pretrained)")
        return ids

    def _sequence_logits(self, ids: list[int], extra: dict[str, Any] | None = None) -> Any:
        """The logits of every row of one checked sequence (``extra``: the family's per-sequence inputs)."""
        seq = _Sequence(0, ids, len(ids), 0, slot=0, pages=list(range(-(-len(ids) // self.serving.page_size))),
                        extra=dict(extra or {}))
        logits = self._run([(seq, len(ids))], list(range(len(ids))))
        return logits[:len(ids)]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 stop_at_eos: bool = True) -> list[list[int]]:
        """Greedy decoding of every prompt (lists of token ids, any lengths); returns the generated
        ids of each, in order: ``max_new_tokens`` of them, fewer when the model emits an
        end-of-sequence id first (kept, as transformers does; ``stop_at_eos=False`` ignores it).
        Per-step statistics land in ``last_step_stats``."""
        return self._generate(self._new_sequences(prompts, max_new_tokens), stop_at_eos)

    def _new_sequences(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[_Sequence]:
        """``generate``'s arguments checked, one ``_Sequence`` per prompt."""
        name = self.architectures[0]
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"{name}.generate: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"{name}.generate: prompts must be a list of token-id lists, got {type(prompts).__name__}")
        seqs = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
                raise TypeError(f"{name}.generate: prompt {i} must be a list of token ids, got {type(prompt).__name__}")
            ids = self._check_tokens(f"prompt {i}", prompt)
            if not ids:
                raise ValueError(f"{name}.generate: prompt {i} is empty")
            overflow = self.serving.prompt_overflow(len(ids), max_new_tokens)
            if overflow:
                raise ValueError(f"{name}.generate: prompt {i} {overflow}; pass a larger max_model_len to "
                                 "from_pretrained")
            seqs.append(_Sequence(i, ids, len(ids), max_new_tokens))
        return seqs

    def _generate(self, seqs: list[_Sequence], stop_at_eos: bool) -> list[list[int]]:
        """The serving loop over checked sequences (see ``generate``)."""
        waiting = collections.deque(seqs)
        running: list[_Sequence] = []
        free_slots = list(range(self.serving.max_num_seqs))
        free_pages = list(range(self.serving.num_pages))
        page_size, budget_per_step = self.serving.page_size, self.serving.max_num_batched_tokens
        self.last_step_stats = []
        while waiting or running:
            while waiting and free_slots:
                seq = waiting.popleft()
                seq.slot = free_slots.pop(0)
                running.append(seq)
            entries, budget = [], budget_per_step
            for seq in running:  # decodes before prompt chunks: a running sequence is never starved
                n = min(len(seq.tokens) - seq.computed, budget)
                if n == 0:
                    continue
                need = -(-(seq.computed + n) // page_size) - len(seq.pages)
                seq.pages.extend(free_pages.pop(0) for _ in range(need))
                entries.append((seq, n))
                budget -= n
            entries.sort(key=lambda e: e[1] > 1)  # decode rows first, then prefill chunks
            start = time.perf_counter()
            logits = self._run(entries, None)
            tokens = self.frontend.argmax(logits)
            prefill = 0
            for i, (seq, n) in enumerate(entries):
                prefill += max(0, min(seq.computed + n, seq.prompt_len) - seq.computed)
                seq.computed += n
                if seq.computed < len(seq.tokens):
                    continue  # a prompt chunk: no token yet
                token = tokens[i]
                seq.tokens.append(token)
                if seq.generated >= seq.max_new_tokens or (stop_at_eos and token in self.eos_token_ids):
                    running.remove(seq)
                    free_pages.extend(seq.pages)
                    free_slots.append(seq.slot)
                    seq.pages = []
            self.last_step_stats.append(StepStats(sum(n for _, n in entries), prefill, len(entries),
                                                  time.perf_counter() - start))
        return [seq.tokens[seq.prompt_len:] for seq in seqs]

    def benchmark_step(self, num_seqs: int, new_tokens: int, context_len: int = 0) -> Callable[[], list[int]]:
        """A callable that runs one step of ``num_seqs`` sequences, each computing ``new_tokens``
        tokens after ``context_len`` cached ones (a prefill: ``context_len`` 0; a decode step:
        ``new_tokens`` 1), and returns the greedy tokens (so the step is finished when it returns).
        Every call writes the same cache slots: the shape of the work stays fixed, for timing."""
        s = self.serving
        name = self.architectures[0]
        if not 1 <= num_seqs <= s.max_num_seqs or new_tokens < 1 or context_len < 0:
            raise ValueError(f"{name}.benchmark_step: need 1 <= num_seqs <= max_num_seqs={s.max_num_seqs}, "
                             f"new_tokens >= 1, context_len >= 0; got {num_seqs}, {new_tokens}, {context_len}")
        total = context_len + new_tokens
        if total > s.max_model_len or num_seqs * new_tokens > max(s.max_num_batched_tokens, num_seqs):
            raise ValueError(f"{name}.benchmark_step: {num_seqs} x {new_tokens} new tokens after {context_len} "
                             f"exceed max_model_len={s.max_model_len} or max_num_batched_tokens="
                             f"{s.max_num_batched_tokens}")
        pages = -(-total // s.page_size)
        rng = np.random.default_rng(0)
        entries = []
        for i in range(num_seqs):
            seq = _Sequence(i, rng.integers(0, self.vocab_size, total).tolist(), total, 0, computed=context_len,
                            slot=i, pages=list(range(i * s.pages_per_seq, i * s.pages_per_seq + pages)))
            entries.append((seq, new_tokens))

        def step() -> list[int]:
            return self.frontend.argmax(self._run(entries, None))[:num_seqs]

        return step

    def kv_cache_options(self, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The keyword arguments layer ``layer`` passes ``reshape_and_cache`` and
        ``ragged_paged_attention`` for the cache's dtype: none for "auto"; for an fp8 cache its
        ``kv_cache_dtype`` and the layer's ``k_scale`` / ``v_scale``."""
        return ({}, {}) if self._fp8_kv is None else self._fp8_kv.options(layer)

    def __repr__(self) -> str:
        # The checkpoint's architecture only where it is not this class's own name (Qwen3 on the Llama body).
        arch = self.architectures[0]
        named = f"architecture={arch!r}, " if arch != type(self).__name__ else ""
        return (f"{type(self).__name__}({named}frontend={self.frontend.name!r}, dtype={self.dtype!r}, "
                f"tp={self.frontend.tp_size}, params={len(self.params)})")


_KV_SCALE_NAMES = {"k": (".k_scale", ".k_proj.output_scale"), "v": (".v_scale", ".v_proj.output_scale")}


class _Fp8KvCache:
    """An fp8 paged KV cache: the ``kv.<i>`` cache specs get the fp8 dtype, and each layer's
    attention passes ``kv_cache_dtype`` and its ``k_scale`` / ``v_scale`` (Python floats: the
    attention kernels take them as static values) to ``reshape_and_cache`` and
    ``ragged_paged_attention`` (``CausalLM.kv_cache_options``)."""

    def __init__(self, kv_cache_dtype: str) -> None:
        self.kv_cache_dtype = kv_cache_dtype
        self.scales: dict[int, dict[str, float]] = {}

    @classmethod
    def install(cls, model: CausalLM, kv_cache_dtype: str) -> _Fp8KvCache | None:
        """Re-type ``model``'s KV cache specs for ``kv_cache_dtype`` (None for "auto"); a family
        whose attention does not write ``kv.<i>`` caches with ``reshape_and_cache`` is refused."""
        cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
        if cache_dtype is None:
            return None
        from dualop.ops import MultiHeadLatentAttention, RaggedPagedAttention, ReshapeAndCache

        latent = isinstance(getattr(model, "mla", None), MultiHeadLatentAttention)
        pattern = r"latent\.\d+" if latent else r"kv\.\d+"
        kv = [i for i, spec in enumerate(model.cache_specs) if re.fullmatch(pattern, spec.name)]
        paged_kv = isinstance(getattr(model, "cache_write", None), ReshapeAndCache) and \
            isinstance(getattr(model, "attention", None), RaggedPagedAttention)
        if not kv or not (latent or paged_kv):
            raise ValueError(f"from_pretrained: kv_cache_dtype={kv_cache_dtype!r} is not supported for "
                             f"{type(model).__name__}: its attention does not write a paged K/V cache with "
                             f"reshape_and_cache or a latent cache with concat_and_cache_mla "
                             f"(use kv_cache_dtype='auto')")
        for i in kv:
            model.cache_specs[i] = dataclasses.replace(model.cache_specs[i], dtype=cache_dtype)
        return cls(kv_cache_dtype)

    def options(self, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(``reshape_and_cache``'s, ``ragged_paged_attention``'s) keyword arguments for ``layer``."""
        scales = self.layer_scales(layer)
        return {"kv_cache_dtype": self.kv_cache_dtype, **scales}, scales

    def latent_options(self, layer: int) -> dict[str, Any]:
        """``multi_head_latent_attention``'s keyword arguments for ``layer``: the engine's fp8 MLA
        cache has one scale, the layer's ``k_scale``, for the write and the read."""
        return {"kv_cache_dtype": self.kv_cache_dtype, "k_scale": self.layer_scales(layer)["k_scale"]}

    def layer_scales(self, layer: int) -> dict[str, float]:
        return self.scales.get(layer, {"k_scale": 1.0, "v_scale": 1.0})

    def read_scales(self, ckpt: Checkpoint, layers_prefix: str) -> None:
        """Each layer's ``k_scale`` / ``v_scale`` from the checkpoint (one element, positive and
        finite), 1.0 where it has none."""
        pattern = re.compile(re.escape(layers_prefix) + r"(\d+)\.")
        for name, shape in ckpt.shapes.items():
            match = pattern.match(name)
            which = next((kv for kv, ends in _KV_SCALE_NAMES.items() if name.endswith(ends)), None)
            if match is None or which is None:
                continue
            value = np.asarray(ckpt.get(name, "numpy"), dtype=np.float64).reshape(-1)
            if value.size != 1 or not np.isfinite(value[0]) or value[0] <= 0:
                raise ValueError(f"from_pretrained: checkpoint tensor {name!r} (shape {shape}) is not a KV cache "
                                 f"scale: one positive, finite value expected")
            layer = self.scales.setdefault(int(match.group(1)), {"k_scale": 1.0, "v_scale": 1.0})
            layer[f"{which}_scale"] = float(value[0])
