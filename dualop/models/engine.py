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
- greedy sampling: the argmax of each sequence's last row, once its prompt is in the cache.

A step's arrays (``StepBatch``) are int32: ``input_ids``, ``positions`` and ``slot_mapping``
(``[T]``, padding slots -1), ``kv_lens`` ``[S]``, ``page_indices`` ``[S, pages_per_seq]``,
``cu_q_lens`` ``[S + 1]``, ``num_seqs`` ``[1]``, ``logits_indices`` (the rows whose logits are
wanted) and, for state-space layers, ``state_indices`` ``[S]`` (each sequence's state slot) and
``has_initial_state`` ``[S]``. For jax, T is padded to a power of two (at least 16) and S to
``max_num_seqs``, so a generation compiles a few programs, not one per step. A model with state
caches (``has_state_cache``) gets S = ``max_num_seqs + 1`` rounded up to a multiple of 8 instead,
each padding sequence slot -1 and at least one padding token, and T = S in a decode step (the
state-space ops' serving contract: no empty sequence, T == S only when every sequence is one token,
their decode kernels' case; a multiple of 8 keeps that T in whole sublane rows on a TPU).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dualop.models.checkpoint import Checkpoint
from dualop.models.frontends import CacheSpec, Frontend
from dualop.models.params import Param

__all__ = ["CausalLM", "ServingConfig", "StepStats"]


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """The cache and batching limits of a model: ``max_model_len`` (prompt plus generated tokens
    per sequence), ``max_num_seqs`` (sequences in the batch at once), ``max_num_batched_tokens``
    (tokens per step), ``page_size`` (tokens per KV page)."""

    max_model_len: int = 512
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    page_size: int = 16

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"from_pretrained: {field.name} must be a positive int, got {value!r}")

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

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class CausalLM:
    """A model built from a checkpoint: ``logits(input_ids)`` and ``generate(prompts, max_new_tokens)``
    (see the module docstring). Made by ``dualop.models.from_pretrained``."""

    architectures: tuple[str, ...] = ()
    has_kv_cache = True
    has_state_cache = False

    def __init__(self, ckpt: Checkpoint, frontend: Frontend, dtype: str, serving: ServingConfig,
                 progress: Callable[[str], None] | None = None) -> None:
        self.checkpoint_path = ckpt.path
        self.hf_config = ckpt.config
        self.frontend, self.dtype, self.serving = frontend, dtype, serving
        self.tp = frontend.tp
        self.parse_config(ckpt.config)
        self.build_ops()
        plan = self.param_plan()
        expected: dict[str, tuple[int, ...]] = {}
        for p in plan:
            expected.update(p.expected)
        ckpt.check(expected)  # every tensor and shape before anything is read
        self.params = frontend.load_params(plan, lambda name: ckpt.get(name, frontend.framework), dtype,
                                           self.keep_float32, progress)
        ckpt.close()
        self.cache_specs = self.cache_plan()
        self.caches = [frontend.zeros(spec) for spec in self.cache_specs]
        self._step = frontend.compile(self.forward, {p.name: p.split_dim for p in plan}, self.cache_specs)
        self.eos_token_ids = self._eos_ids(ckpt.config.get("eos_token_id"))
        self.last_step_stats: list[StepStats] = []

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
        positions = np.zeros(t_pad, np.int32)
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
            positions[row:row + n] = pos
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
        logits, self.caches = self._step(self.params, batch, self.caches)
        return logits

    def _check_tokens(self, what: str, ids: Sequence[int]) -> list[int]:
        out = []
        for token in ids:
            value = int(token)
            if value != token or not 0 <= value < self.vocab_size:
                raise ValueError(f"{self.architectures[0]}: {what} holds token id {token!r}; expected ints in "
                                 f"[0, {self.vocab_size})")
            out.append(value)
        return out

    # -- the public calls ------------------------------------------------------------------------

    def logits(self, input_ids: Any) -> Any:
        """``[T, vocab]`` logits of one sequence (a list of ints or a 1-D array), no cache kept,
        in the frontend's array type and the model's dtype."""
        ids = self._check_tokens("input_ids", np.asarray(input_ids).reshape(-1).tolist()
                                 if not isinstance(input_ids, list) else input_ids)
        if np.asarray(input_ids).ndim > 1:
            raise ValueError(f"{self.architectures[0]}.logits: input_ids must be one sequence (1-D), got shape "
                             f"{tuple(np.asarray(input_ids).shape)}")
        if not ids:
            raise ValueError(f"{self.architectures[0]}.logits: input_ids is empty")
        limit = self.serving.max_model_len
        if len(ids) > limit:
            raise ValueError(f"{self.architectures[0]}.logits: {len(ids)} tokens exceed max_model_len={limit} "
                             "(the KV cache's length per sequence; pass a larger max_model_len to from_pretrained)")
        seq = _Sequence(0, ids, len(ids), 0, slot=0, pages=list(range(-(-len(ids) // self.serving.page_size))))
        logits = self._run([(seq, len(ids))], list(range(len(ids))))
        return logits[:len(ids)]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 stop_at_eos: bool = True) -> list[list[int]]:
        """Greedy decoding of every prompt (lists of token ids, any lengths); returns the generated
        ids of each, in order: ``max_new_tokens`` of them, fewer when the model emits an
        end-of-sequence id first (kept, as transformers does; ``stop_at_eos=False`` ignores it).
        Per-step statistics land in ``last_step_stats``."""
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
            if len(ids) + max_new_tokens > self.serving.max_model_len:
                raise ValueError(f"{name}.generate: prompt {i} has {len(ids)} tokens; with max_new_tokens="
                                 f"{max_new_tokens} that exceeds max_model_len={self.serving.max_model_len} (the KV "
                                 "cache's length per sequence; pass a larger max_model_len to from_pretrained)")
            seqs.append(_Sequence(i, ids, len(ids), max_new_tokens))
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

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.architectures[0]}, frontend={self.frontend.name!r}, dtype={self.dtype!r}, "
                f"tp={self.frontend.tp_size}, params={len(self.params)})")
