"""The serving engine's way of handing a batch to its stateful layers, for dualop's torch layers.

The reference engine calls a stateful layer with its activations only (``mixer(hidden_states,
output)``, ``mla(positions, hidden_states)``): the batch's metadata comes from a context set around
the model's forward, and the layer's caches from its ``kv_cache`` attribute, which the engine binds
after allocating them. dualop's ops take both as arguments. The layers of ``dualop.torch.layers``
that own such caches (the mixers, multi-head latent attention) take the engine's call too, reading
the metadata set here and the caches bound to the layer::

    mixer.kv_cache = (conv_state, ssm_state)          # bound once, as the engine does
    with forward_context(cu_seqlens=cu, state_indices=slots, has_initial_state=init):
        mixer(hidden_states, output)                  # writes output, updates the caches in place

With no context set, such a call runs the whole batch as one new sequence with no cache (the
engine's profiling run does the same) and leaves any bound cache untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["ForwardContext", "forward_context", "get_forward_context", "SSM_FIELDS", "PAGED_FIELDS"]

# The metadata of dualop.ops.ssm_batch (state-space layers) and of ragged_paged_attention (paged
# attention layers: describing the batch after this step's tokens are cached), with slot_mapping.
SSM_FIELDS = ("cu_seqlens", "state_indices", "has_initial_state")
PAGED_FIELDS = ("slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """One step's batch metadata: a layer reads the fields of its kind (``SSM_FIELDS`` for the
    mixers, ``PAGED_FIELDS`` for paged attention), each as its op's argument of the same name."""

    cu_seqlens: Any = None
    state_indices: Any = None
    has_initial_state: Any = None
    slot_mapping: Any = None
    kv_lens: Any = None
    page_indices: Any = None
    cu_q_lens: Any = None
    num_seqs: Any = None

    def ssm(self) -> dict[str, Any]:
        """The state-space metadata (each may be None: as the mixer op takes it)."""
        return {name: getattr(self, name) for name in SSM_FIELDS}

    def paged(self, op: str) -> dict[str, Any]:
        """The paged-attention metadata; a ValueError naming ``op`` if the context lacks a field."""
        values = {name: getattr(self, name) for name in PAGED_FIELDS}
        if missing := [name for name, value in values.items() if value is None]:
            raise ValueError(f"{op}: the forward context has no {', '.join(missing)}; a paged-attention layer called "
                             f"the engine's way reads {', '.join(PAGED_FIELDS)} from forward_context(...)")
        return values


_stack: list[ForwardContext] = []


@contextlib.contextmanager
def forward_context(**metadata: Any) -> Iterator[ForwardContext]:
    """Set one step's metadata (``ForwardContext``'s fields by name) for the layers called inside."""
    unknown = sorted(set(metadata) - {f.name for f in dataclasses.fields(ForwardContext)})
    if unknown:
        raise TypeError(f"forward_context: unknown field(s) {unknown}; expected some of "
                        f"{list(SSM_FIELDS + PAGED_FIELDS)}")
    context = ForwardContext(**metadata)
    _stack.append(context)
    try:
        yield context
    finally:
        _stack.pop()


def get_forward_context() -> ForwardContext | None:
    """The innermost context set by ``forward_context``, or None outside one."""
    return _stack[-1] if _stack else None
