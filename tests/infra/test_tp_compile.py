"""Every tensor-parallel layer of ``dualop compile`` (``SHARDED_LAYERS``: the linear projections,
the vocabulary-parallel embedding and the logits processor) built by XLA:TPU for four v5e chips
and eight v6e chips, with exactly the collectives its shapes call for; nothing runs."""

from __future__ import annotations

import pytest

from dualop.parallel import pad_vocab_size

TP_OPS = ("column_parallel_linear", "row_parallel_linear", "vocab_parallel_embedding", "logits_processor")
CHIPS = {"v5e:2x2": 4, "v6e:2x4": 8}


def _tp_layers():
    from dualop.aot import sharded

    return [layer for layer in sharded.SHARDED_LAYERS if layer.op in TP_OPS]


def _expected(label: str, shape: tuple[int, ...], chips: int) -> dict[str, tuple[int, int]]:
    """kind -> (operand bytes, result bytes) per device, bfloat16 (2 bytes)."""
    if label in ("column_parallel_linear[qkv]", "column_parallel_linear[gate_up]"):
        return {}  # the output stays split over the chips: no collective
    if label == "column_parallel_linear[gather]":
        tokens, _, out = shape
        return {"all-gather": (tokens * out // chips * 2, tokens * out * 2)}
    if label.startswith("row_parallel_linear"):
        tokens, _, out = shape
        return {"all-reduce": (tokens * out * 2, tokens * out * 2)}
    if label.startswith("vocab_parallel_embedding"):
        tokens, _, _, dim = shape
        return {"all-reduce": (tokens * dim * 2, tokens * dim * 2)}
    if label.startswith("logits_processor"):
        tokens, _, vocab = shape
        per_chip = pad_vocab_size(vocab, 64) // chips
        return {"all-gather": (tokens * per_chip * 2, tokens * per_chip * chips * 2)}
    raise AssertionError(f"no expectation for {label}")


def test_every_tensor_parallel_op_has_a_sharded_layer():
    assert {layer.op for layer in _tp_layers()} == set(TP_OPS)
    for layer in _tp_layers():  # each has Llama-3-70B-like model sizes for --sharded-serving
        assert layer.serving_shapes, layer.label


@pytest.mark.latest_only
@pytest.mark.parametrize("target", sorted(CHIPS))
def test_tensor_parallel_layers_compile_with_their_collectives(target):
    from dualop.aot import sharded, tpu

    why = tpu.tpu_available()
    if why is not None:
        pytest.skip(f"TPU compiles need libtpu, installed in the latest environment only: {why}")
    for layer in _tp_layers():
        (shape,) = layer.shapes
        with tpu.quiet_native_stderr():
            result = sharded.compile_layer(layer, shape, "bfloat16", target)
        assert result.status == "ok", (layer.label, result.message)
        got = {c["kind"]: (c["operand_bytes"], c["bytes"]) for c in result.collectives}
        assert got == _expected(layer.label, shape, CHIPS[target]), (layer.label, result.collectives)
        assert all(c["count"] == 1 for c in result.collectives), (layer.label, result.collectives)
