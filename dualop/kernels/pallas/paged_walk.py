"""The walk a Pallas paged-attention grid step makes over a ragged batch (shared by
``ragged_paged_attention`` and ``ragged_paged_mla_attention``).

A grid step owns query rows ``[q_start, q_start + block_q)``. It visits, in order, every sequence
whose rows meet the block and, for each, only the KV blocks (``kv_tokens`` positions each) some of
those rows can see (causal and sliding-window limits; all blocks up to ``kv_len`` when masked
positions count, see ``masked_positions_vanish``). The pages of each (sequence, KV block) step are
copied from HBM into one of two VMEM buffer sets, the next step's copies started before the
current step is computed (double buffering, also across sequences). Metadata comes from SMEM
(scalar prefetch) and is clamped, so no integer value makes the walk read out of bounds:
sequence ids stop at ``min(num_seqs[0], S)``, ``kv_lens`` are clipped to ``[0, max_kv]`` and the
wrappers pass ``cu_q_lens`` through ``ordered_cu_q_lens``.

Loop conditions read no refs (the generic interpreter of JAX 0.7 cannot discharge them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["SequenceWalk", "ordered_cu_q_lens"]


def ordered_cu_q_lens(cu_q_lens: Any, num_tokens: int) -> jax.Array:
    """``cu_q_lens`` clipped to ``[0, T]`` and made non-decreasing (a running max), as every path
    reads it (``ops/attention.py``): traced metadata past T or out of order then gives each row at
    most one sequence, the same one the native body gives it."""
    return jax.lax.cummax(jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens), axis=0)


@dataclasses.dataclass(frozen=True)
class SequenceWalk:
    """One grid step's view of the batch metadata (refs in SMEM) and its row block."""

    kv_lens_ref: Any
    cu_q_lens_ref: Any
    num_seqs_ref: Any
    q_start: Any  # first query row of the block (traced)
    block_q: int
    max_seqs: int
    max_kv: int  # pages_per_seq * page_size
    kv_tokens: int  # KV positions per block
    skip_masked: bool  # masked positions weigh 0: only visible KV blocks are visited
    sliding_window: int | None = None

    @property
    def q_end(self):
        return self.q_start + self.block_q

    def n_seqs(self):
        return jnp.clip(self.num_seqs_ref[0], 0, self.max_seqs)

    def live(self, s):
        """Whether sequence ``s`` exists and starts before this block ends (later ones cannot meet it)."""
        return (s < self.n_seqs()) & (self.cu_q_lens_ref[jnp.minimum(s, self.max_seqs)] < self.q_end)

    def seq_info(self, s):
        """Sequence ``s``'s rows in this block [row_lo, row_hi), its (clipped) kv_len, and the
        offset that turns a global row into its KV position."""
        s = jnp.minimum(s, self.max_seqs - 1)
        cu0, cu1 = self.cu_q_lens_ref[s], self.cu_q_lens_ref[s + 1]
        kv_len = jnp.clip(self.kv_lens_ref[s], 0, self.max_kv)
        row_lo, row_hi = jnp.maximum(self.q_start, cu0), jnp.minimum(self.q_end, cu1)
        pos_of_row0 = kv_len - (cu1 - cu0) - cu0  # position of global row t is t + this
        return row_lo, row_hi, kv_len, pos_of_row0

    def kv_blocks(self, s):
        """[first, end) KV blocks of sequence ``s`` its rows in this block can see; empty (first >=
        end) when it has no rows here."""
        row_lo, row_hi, kv_len, pos_of_row0 = self.seq_info(s)
        seen_end, seen_start = kv_len, 0
        if self.skip_masked:
            seen_end = jnp.clip(row_hi - 1 + pos_of_row0 + 1, 0, kv_len)
            if self.sliding_window is not None:
                seen_start = jnp.clip(row_lo + pos_of_row0 - self.sliding_window + 1, 0, seen_end)
        first = jax.lax.div(seen_start, self.kv_tokens)  # non-negative: truncation is floor
        end = jax.lax.div(seen_end + (self.kv_tokens - 1), self.kv_tokens)
        return first, jnp.where(row_hi > row_lo, end, first)

    def busy_from(self, s):
        """The first sequence from ``s`` on with KV blocks to visit (or one that is not live)."""

        def idle(s):
            first, end = self.kv_blocks(s)
            return self.live(s) & (first >= end)

        return jax.lax.while_loop(lambda c: c[1], lambda c: (c[0] + 1, idle(c[0] + 1)), (s, idle(s)))[0]

    def advance(self, s, kb):
        """The (sequence, KV block) step after (s, kb)."""
        _, end = self.kv_blocks(s)
        nxt = self.busy_from(s + 1)
        on = kb + 1 < end
        return jnp.where(on, s, nxt), jnp.where(on, kb + 1, self.kv_blocks(nxt)[0])

    def run(self, start: Callable, wait: Callable, compute: Callable, bufs_a: Any, bufs_b: Any, sem_a: Any,
            sem_b: Any) -> None:
        """Visit every (sequence, KV block) step: ``start(s, kb, bufs, sem)`` begins its page
        copies, ``wait(s, kb, bufs, sem)`` awaits them, ``compute(s, kb, bufs)`` folds them in.
        Steps alternate between buffer sets A and B; each step's successor is started first."""
        s0 = self.busy_from(0)
        kb0 = self.kv_blocks(s0)[0]
        live = self.live

        @pl.when(live(s0))
        def _():
            start(s0, kb0, bufs_a, sem_a)

        def two_steps(carry):
            """Compute the step in buffer A (its copy already started) and the next one in B,
            starting each following step's copy before computing the current one."""
            s, kb, _ = carry
            s_b, kb_b = self.advance(s, kb)

            @pl.when(live(s_b))
            def _():
                start(s_b, kb_b, bufs_b, sem_b)

            wait(s, kb, bufs_a, sem_a)
            compute(s, kb, bufs_a)
            s_a, kb_a = self.advance(s_b, kb_b)

            @pl.when(live(s_b))
            def _():
                @pl.when(live(s_a))
                def _():
                    start(s_a, kb_a, bufs_a, sem_a)

                wait(s_b, kb_b, bufs_b, sem_b)
                compute(s_b, kb_b, bufs_b)

            s_next = jnp.where(live(s_b), s_a, s_b)
            return s_next, kb_a, live(s_next)

        jax.lax.while_loop(lambda c: c[2], two_steps, (s0, kb0, live(s0)))
