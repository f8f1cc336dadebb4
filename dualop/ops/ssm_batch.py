"""The serving batch of the state-space ops: sequences packed along the token axis, each with a
slot in a state cache. One place for its defaults and its checks (every Mamba-family op calls
``ssm_batch`` in ``check_inputs`` and its methods read the result).

The contract (the README's "State cache for serving"):

- ``x`` packs the tokens of B sequences along its first axis, T tokens in all.
  ``cu_seqlens`` ``[B + 1]`` (int32/int64): sequence ``b`` is tokens
  ``cu_seqlens[b] : cu_seqlens[b + 1]``; it starts at 0, ends at T and strictly increases (every
  sequence has a token). None: one sequence of all T tokens.
- A state cache ``[S, *state_shape]`` (float32/bfloat16/float16) holds S slots.
  ``state_indices`` ``[B]`` (int32/int64) gives each sequence's slot, or -1 for a padding sequence
  (a CUDA-graph or bucket filler): its outputs are zeros and no state is written. Two sequences
  may not share a slot. None: sequence ``b`` uses slot ``b``.
- ``has_initial_state`` ``[B]`` (bool): start from the slot's cached state (a prefill that
  continues, or a decode step), else from zeros (a new sequence). None: True for every sequence
  when a cache is given, False when none is.
- After the call each sequence's slot holds its state after its last token. torch: the cache is
  updated in place (and returned); jax: a new cache is returned (donate the old one under ``jit``
  to reuse its memory). With no cache given, the op returns the final states as a fresh
  ``[B, *state_shape]`` float32 array.
- Decode is the same call with one token per sequence (T == B): the ops then take their
  single-step kernels.

Values are checked (a ``ValueError`` before any kernel runs) where they can be read without a
trace, a lazy graph or a CUDA-graph capture (``dualop.ops._checks.concrete_values``). Metadata whose
values could not be read is made safe here, for the native body and every kernel alike
(``ssm_math.sanitize_metadata``): ``cu_seqlens`` starts at 0, is clamped into ``[0, T]`` and made
non-decreasing, so tokens past ``cu_seqlens[B]`` belong to no sequence (zero outputs, nothing read or
written) and a sequence may be empty (its slot gets its starting state); a slot outside the cache is
padding. The kernels also clamp every index they read, so a direct call with bad metadata reads and
writes nothing out of bounds.

Every check of every argument runs here, before anything is written: a torch cache must also be on
the inputs' device, its memory free of overlapping elements (an ``expand``-ed view would take two
writes in one place) and, while autograd records, not a leaf that requires grad (which torch cannot
update in place). The metadata of a torch call comes back contiguous (a strided column of a
metadata buffer is copied, ``[B]`` elements), so kernels may read it with unit stride.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dualop.backends import array_namespace
from dualop.kernels import ssm_math
from dualop.ops._checks import FLOAT_DTYPES, concrete_values, dtype_name
from dualop.platforms import family_of, frontend_of

__all__ = ["SSMBatch", "ssm_batch", "random_serving_batch"]

_INDEX_DTYPES = ("int32", "int64")


@dataclasses.dataclass(frozen=True)
class SSMBatch:
    """A validated serving batch: int32 ``cu_seqlens`` ``[B + 1]`` and ``state_indices`` ``[B]``,
    bool ``has_initial_state`` ``[B]`` (arrays of the call's frontend, on its device), the cache
    (given, or fresh zeros) and the static counts."""

    cu_seqlens: Any
    state_indices: Any
    has_initial_state: Any
    state: Any
    num_seqs: int
    num_tokens: int
    state_given: bool

    @property
    def decode(self) -> bool:
        """One token per sequence: the single-step kernels' case."""
        return self.num_tokens == self.num_seqs


def _check_device(op: str, arg: str, a: Any, x: Any, fe: str) -> None:
    """A torch array must be on the inputs' device (a kernel would read a pointer of another)."""
    if fe == "torch" and frontend_of(a) == "torch" and a.device != x.device:
        raise ValueError(f"{op}: argument '{arg}' is on {a.device} but the inputs are on {x.device}; expected the "
                         f"same device")


def _may_overlap(t: Any) -> bool:
    """Whether two elements of a strided torch tensor may share memory (an ``expand``-ed view):
    not provably disjoint by its strides, each at least the extent of the smaller ones."""
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _check_cache_writable(op: str, name: str, state: Any, x: Any, fe: str) -> None:
    """What an in-place write of a torch cache needs, checked before any op writes a cache."""
    if family_of(fe) != "torch":
        return
    import torch

    if frontend_of(state) != fe:
        raise ValueError(f"{op}: argument '{name}' is a {frontend_of(state)} tensor but the inputs are "
                         f"{fe} tensors; expected the same device")
    _check_device(op, name, state, x, fe)
    if fe == "torch" and _may_overlap(state):
        raise ValueError(f"{op}: argument '{name}' has overlapping memory (strides {tuple(state.stride())} for "
                         f"shape {tuple(state.shape)}, e.g. an expanded view); expected a cache each of whose "
                         f"elements has its own memory (it is updated in place)")
    if torch.is_grad_enabled() and state.requires_grad and state.is_leaf:
        raise ValueError(f"{op}: argument '{name}' is a leaf tensor that requires grad, which torch cannot update "
                         f"in place; pass it detached (or call under torch.no_grad())")


def _check_index_array(op: str, arg: str, a: Any, fe: str, dtypes: tuple[str, ...], length: int | None,
                       x: Any = None) -> None:
    if frontend_of(a) is None or family_of(frontend_of(a)) != family_of(fe):
        raise TypeError(f"{op}: argument '{arg}' must be an array of the same frontend as the inputs ({fe}), "
                        f"got {type(a).__module__}.{type(a).__qualname__}")
    if x is not None:
        _check_device(op, arg, a, x, fe)
    if dtype_name(a) not in dtypes:
        raise TypeError(f"{op}: argument '{arg}' has dtype {dtype_name(a)}; expected {' or '.join(dtypes)}")
    if a.ndim != 1 or (length is not None and a.shape[0] != length):
        want = f"[{length}]" if length is not None else "a 1-D array"
        raise ValueError(f"{op}: argument '{arg}' has shape {tuple(a.shape)}; expected {want}")


def _values(a: Any) -> np.ndarray | None:
    if frontend_of(a) == "torch":
        import torch

        if torch.compiler.is_compiling() or isinstance(a, torch._subclasses.FakeTensor):
            return None
    return concrete_values(a)


def ssm_batch(op: str, x: Any, cu_seqlens: Any, state_indices: Any, has_initial_state: Any, state: Any,
              state_name: str, state_shape: tuple[int, ...]) -> SSMBatch:
    """Validate and complete one call's serving metadata (see the module docstring).

    ``x`` is the packed token array (its first axis is T); ``state`` the cache argument named
    ``state_name`` in errors, of shape ``[S, *state_shape]`` or None. Raises ``TypeError`` /
    ``ValueError`` naming ``op`` and the argument.
    """
    fe = frontend_of(x)
    xp = array_namespace(x)
    num_tokens = int(x.shape[0])
    cu_traced = False
    if cu_seqlens is None:
        num_seqs = 1
        cu = xp.arange(2, like=x, dtype=xp.int32) * num_tokens  # [0, T], made on x's device (no host copy)
    else:
        _check_index_array(op, "cu_seqlens", cu_seqlens, fe, _INDEX_DTYPES, None, x)
        num_seqs = int(cu_seqlens.shape[0]) - 1
        if num_seqs < 1:
            raise ValueError(f"{op}: argument 'cu_seqlens' needs at least 2 entries (one sequence), got "
                             f"shape {tuple(cu_seqlens.shape)}")
        cu = xp.astype(cu_seqlens, xp.int32)
        values = _values(cu_seqlens)
        cu_traced = values is None
        if values is not None:
            if values[0] != 0 or values[-1] != num_tokens:
                raise ValueError(f"{op}: argument 'cu_seqlens' must start at 0 and end at the token count "
                                 f"{num_tokens}, got {values[0]} ... {values[-1]}")
            steps = np.diff(values)
            if (steps <= 0).any():
                b = int(np.argmax(steps <= 0))
                raise ValueError(f"{op}: argument 'cu_seqlens' must strictly increase (every sequence has a "
                                 f"token); entries {b} and {b + 1} are {values[b]} and {values[b + 1]}")
    if num_tokens < num_seqs:
        raise ValueError(f"{op}: {num_seqs} sequences need at least as many tokens, x has {num_tokens}")

    state_given = state is not None
    if state_given:
        if frontend_of(state) is None or family_of(frontend_of(state)) != family_of(fe):
            raise TypeError(f"{op}: argument '{state_name}' must be an array of the same frontend as the inputs")
        if dtype_name(state) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: argument '{state_name}' has dtype {dtype_name(state)}; expected one of "
                            f"{', '.join(sorted(FLOAT_DTYPES))}")
        if state.ndim != 1 + len(state_shape) or tuple(state.shape[1:]) != tuple(state_shape):
            want = ", ".join(map(str, state_shape))
            raise ValueError(f"{op}: argument '{state_name}' has shape {tuple(state.shape)}; expected "
                             f"[slots, {want}] for this layer")
        _check_cache_writable(op, state_name, state, x, fe)
    slots = int(state.shape[0]) if state_given else num_seqs

    if state_indices is None:
        if slots < num_seqs:
            raise ValueError(f"{op}: {num_seqs} sequences and no 'state_indices' need at least {num_seqs} slots "
                             f"in '{state_name}', which has {slots}")
        idx = xp.arange(num_seqs, like=x, dtype=xp.int32)
        slots_traced = False
    else:
        _check_index_array(op, "state_indices", state_indices, fe, _INDEX_DTYPES, num_seqs, x)
        idx = xp.astype(state_indices, xp.int32)
        values = _values(state_indices)
        slots_traced = values is None
        if values is not None:
            bad = values[(values < -1) | (values >= slots)]
            if bad.size:
                raise ValueError(f"{op}: argument 'state_indices' holds slot {int(bad[0])}; expected -1 (padding) "
                                 f"or a slot in [0, {slots}) of '{state_name}'")
            used = values[values >= 0]
            if np.unique(used).size != used.size:
                raise ValueError(f"{op}: argument 'state_indices' gives two sequences the same slot")

    if has_initial_state is None:
        init = xp.arange(num_seqs, like=x, dtype=xp.int32) >= (0 if state_given else num_seqs)  # all True / all False
    else:
        _check_index_array(op, "has_initial_state", has_initial_state, fe, ("bool",), num_seqs, x)
        init = has_initial_state
        values = _values(has_initial_state) if not state_given else None
        if values is not None and values.any():
            raise ValueError(f"{op}: argument 'has_initial_state' is True for a sequence but no "
                             f"'{state_name}' cache holds its state")

    if cu_traced or slots_traced:
        cu, idx = ssm_math.sanitize_metadata(xp, cu, idx, num_tokens, slots)
    if family_of(fe) == "torch":  # kernels read the metadata with unit stride
        cu, idx, init = cu.contiguous(), idx.contiguous(), init.contiguous()
    if not state_given:
        state = xp.zeros((num_seqs, *state_shape), like=x, dtype=xp.float32)
    return SSMBatch(cu, idx, init, state, num_seqs, num_tokens, state_given)


def random_serving_batch(tokens: int, sequences: int, rng, *, padding: bool = True):
    """Random serving metadata for ``sequences`` sequences over ``tokens`` tokens (numpy): int32
    ``cu_seqlens`` (every sequence non-empty), ``state_indices`` (distinct slots out of
    ``2 * sequences + 1``, one padding -1 when ``padding`` and B > 1), ``has_initial_state`` and the
    slot count. The check cases, tests and bench cases of the state-space ops draw their batches here."""
    if sequences == tokens:
        lengths = np.ones(sequences, np.int64)
    else:
        cuts = np.sort(rng.choice(np.arange(1, tokens), sequences - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [tokens]]))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    slots = rng.permutation(2 * sequences + 1)[:sequences].astype(np.int32)
    if padding and sequences > 1:
        slots[rng.integers(sequences)] = -1
    init = rng.random(sequences) < 0.6
    return cu, slots, init, 2 * sequences + 1


def fresh_equal_sequences(tokens: int, seqs: int) -> tuple:
    """Serving metadata of ``seqs`` new sequences of equal length packed in ``tokens`` (slot b for
    sequence b, no initial state): ``(cu_seqlens, state_indices, has_initial_state)``, pinned."""
    from dualop.testing import Pinned

    if seqs < 1 or tokens % seqs:
        raise ValueError(f"bench: {tokens} tokens do not split into {seqs} equal sequences")
    return (Pinned(np.arange(0, tokens + 1, tokens // seqs, dtype=np.int32), "int32"),
            Pinned(np.arange(seqs, dtype=np.int32), "int32"), Pinned(np.zeros(seqs, bool), "bool"))


def conv_sequences(split: str, tokens: int) -> int:
    """How a bench case splits ``tokens``: one sequence, up to eight, or one token each (decode)."""
    return {"prefill": 1, "prefill_8seq": min(8, tokens), "decode": tokens}[split]
