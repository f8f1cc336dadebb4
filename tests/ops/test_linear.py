"""The linear family (dualop.ops.linear, the torch and jax layers): native body against F.linear
and float64 numpy, the engine's output / bias rules, bad input, and every layer at tp 2 (two gloo
processes) and tp 2 and 4 (JAX, host devices) equal to tp 1 from the same full checkpoint loaded
through the weight_loaders."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dualop.testing import free_port
from dualop import testing
from dualop.parallel import TensorParallel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.abspath(__file__))

# (layer class name, constructor args, kwargs, how the checkpoint is loaded: "fused" = the whole
# tensor with loaded_shard_id None, "parts" = one call per output / q, k, v). Sizes divide by 4.
LAYER_CONFIGS = [
    ("ReplicatedLinear", (32, 24), {}, "fused"),
    ("ColumnParallelLinear", (32, 24), {"gather_output": True}, "fused"),
    ("ColumnParallelLinear", (32, 24), {"skip_bias_add": True}, "fused"),
    ("MergedColumnParallelLinear", (32, [16, 24]), {"gather_output": True}, "parts"),
    ("MergedColumnParallelLinear", (32, [16, 24]), {}, "fused"),
    ("QKVParallelLinear", (32, 4, 8, 2), {}, "parts"),  # 2 kv heads: replicated at tp 4
    ("QKVParallelLinear", (32, 4, 8, 2), {"bias": False}, "fused"),
    ("RowParallelLinear", (32, 24), {"input_is_parallel": False}, "fused"),
    ("RowParallelLinear", (32, 24), {}, "fused"),
    ("RowParallelLinear", (32, 24), {"reduce_results": False, "skip_bias_add": True}, "fused"),
    ("RowParallelLinear", (32, 24), {"bias": False, "reduce_results": False, "return_bias": False}, "fused"),
]
X_SHAPE = (2, 3, 32)


def checkpoint(index: int, op) -> dict:
    """The full checkpoint of config ``index``: weight [output_size, input_size] (fused rows in the
    engine's order), bias [output_size], and the input x."""
    rng = np.random.default_rng(100 + index)
    out, inp = op.output_size, op.input_size
    return {"weight": (rng.standard_normal((out, inp)) * inp ** -0.5).astype(np.float32),
            "bias": rng.standard_normal((out,)).astype(np.float32) if op.has_bias else None,
            "x": rng.standard_normal(X_SHAPE).astype(np.float32)}


def load_calls(op, kind: str, full: dict) -> list[tuple[str, np.ndarray, object]]:
    """``(param, loaded tensor, loaded_shard_id)`` calls that load ``full`` into a layer."""
    params = [("weight", full["weight"])] + ([("bias", full["bias"])] if full["bias"] is not None else [])
    if kind == "fused":
        return [(name, value, None) for name, value in params]
    if hasattr(op, "output_sizes"):
        ids, sizes = list(range(len(op.output_sizes))), op.output_sizes
    else:
        ids = ["q", "k", "v"]
        sizes = [n * op.head_size for n in (op.total_num_heads, op.total_num_kv_heads, op.total_num_kv_heads)]
    calls, start = [], 0
    for shard_id, size in zip(ids, sizes):
        calls += [(name, value[start:start + size], shard_id) for name, value in params]
        start += size
    return calls


def rank_columns(op, out1: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s output columns of a column-family op, from the tp-1 output (fused order)."""
    copies = op.checkpoint_layout("weight", None, rank)[2]
    return np.concatenate([out1[..., c.src_start:c.src_stop] for c in sorted(copies, key=lambda c: c.dst_start)], -1)


def expected_output(op, out1: np.ndarray) -> np.ndarray:
    """What the sharded layer's output holds for tp-1 output ``out1``: every rank's columns in rank
    order for the column family (gathered or split on the last dim), the whole output otherwise
    (the row layer's partial sums are compared after summing them)."""
    from dualop.ops import ColumnParallelLinear

    if isinstance(op, ColumnParallelLinear):
        return np.concatenate([rank_columns(op, out1, r) for r in range(op.tp.size)], -1)
    return out1


# --- the native body against implementations nobody here wrote ------------------------------------

@pytest.mark.reference
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_body_matches_float64_numpy_and_f_linear(dtype):
    import torch
    import torch.nn.functional as F

    from dualop.ops import ColumnParallelLinear

    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 5, 40)), rng.standard_normal((24, 40)) * 0.2, rng.standard_normal(24)
    op = ColumnParallelLinear(40, 24, tp=TensorParallel())
    cast = [testing.to_numpy(testing.to_frontend(a.astype(np.float32), "torch", dtype)).astype(np.float64)
            for a in (x, w, b)]
    want = cast[0] @ cast[1].T + cast[2]  # float64 over the same (rounded) inputs
    for fe in ("torch", "jax"):
        args = [testing.to_frontend(a.astype(np.float32), fe, dtype) for a in (x, w, b)]
        got, out_bias = op.forward_native(*args)
        assert out_bias is None and str(got.dtype).removeprefix("torch.") == dtype
        assert testing.compare(testing.to_numpy(got), want.astype(np.float32), dtype).ok, fe
    tx, tw, tb = (torch.from_numpy(a.astype(np.float32)) for a in (x, w, b))
    got = op.forward_native(tx, tw, tb)[0]
    assert testing.compare(got.numpy(), F.linear(tx, tw, tb).numpy(), "float32").ok


@pytest.mark.reference
def test_tp1_layers_match_f_linear_on_the_full_checkpoint():
    """Each torch layer at tp 1, loaded through its weight_loader, is F.linear of the checkpoint
    (the QKV/merged fused rows in the engine's order) with the engine's output tuple."""
    import torch
    import torch.nn.functional as F

    from dualop.torch import layers

    for index, (name, args, kwargs, kind) in enumerate(LAYER_CONFIGS):
        layer = getattr(layers, name)(*args, tp=TensorParallel(), **kwargs)
        full = checkpoint(index, layer.op)
        for param, value, shard_id in load_calls(layer.op, kind, full):
            layer.weight_loader(getattr(layer, param), torch.from_numpy(value), shard_id)
        x = torch.from_numpy(full["x"])
        out = layer(x)
        y, out_bias = out if layer.op.return_bias else (out, None)
        b = None if full["bias"] is None else torch.from_numpy(full["bias"])
        skip = kwargs.get("skip_bias_add", False)
        want = F.linear(x, torch.from_numpy(full["weight"]), None if skip else b)
        assert testing.compare(y.numpy(), want.numpy(), "float32").ok, (name, kwargs)
        assert (out_bias is None) == (not skip) and (out_bias is None or torch.equal(out_bias, b)), (name, kwargs)


# --- the engine's rules ---------------------------------------------------------------------------

def test_row_parallel_adds_the_bias_on_rank_zero_only():
    """Each rank takes its slice of a whole x; only rank 0's partial sum carries the bias (the
    identity reduce of this stand-in group shows each rank's own partial sum)."""
    import torch

    from dualop.ops import RowParallelLinear

    def group(rank_value):
        class Rank(TensorParallel):
            size = 2
            rank = rank_value

        return Rank()

    x, w, b = torch.randn(3, 16), torch.randn(8, 8), torch.randn(8)
    y0, _ = RowParallelLinear(16, 8, input_is_parallel=False, tp=group(0))(x, w, b)
    y1, _ = RowParallelLinear(16, 8, input_is_parallel=False, tp=group(1))(x, w, b)
    assert torch.allclose(y0, x[:, :8] @ w.T + b, atol=1e-5)
    assert torch.allclose(y1, x[:, 8:] @ w.T, atol=1e-5)


def test_return_bias_and_skip_bias_add():
    import torch

    from dualop.ops import ColumnParallelLinear, ReplicatedLinear

    x, w, b = torch.randn(2, 8), torch.randn(4, 8), torch.randn(4)
    y, out_bias = ColumnParallelLinear(8, 4, skip_bias_add=True)(x, w, b)
    assert out_bias is b and torch.allclose(y, x @ w.T, atol=1e-6)
    y = ReplicatedLinear(8, 4, return_bias=False)(x, w, b)
    assert isinstance(y, torch.Tensor) and torch.allclose(y, x @ w.T + b, atol=1e-6)


def test_disable_tp_keeps_the_whole_weight_on_every_rank():
    import torch

    from dualop.ops import ColumnParallelLinear, RowParallelLinear

    x, w = torch.randn(2, 8), torch.randn(10, 8)
    col = ColumnParallelLinear(8, 10, bias=False, disable_tp=True, tp=_TP4())
    assert col.tp.size == 1 and torch.allclose(col(x, w)[0], x @ w.T, atol=1e-6)
    row = RowParallelLinear(8, 10, bias=False, disable_tp=True, tp=_TP4())
    assert row.input_size_per_partition == 8


def test_torch_compile_of_a_tp1_op_is_its_custom_op_with_the_engines_tuple():
    """The (output, output_bias) tuple has a schema (``Tensor?[]``: the bias is None unless
    skip_bias_add), so a tp-1 op compiles to ``torch.ops.dualop.<name>`` and returns what eager does."""
    import torch

    from dualop import CustomOp, OpsConfig, set_config
    from dualop.backends.torch import library
    from dualop.ops import ColumnParallelLinear

    assert library.op_signature(CustomOp.op_registry["column_parallel_linear"]).schema == (
        "(Tensor x, Tensor weight, Tensor? bias, str ctor) -> Tensor?[]")
    x, w, b = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6)
    for skip in (False, True):
        op = ColumnParallelLinear(8, 6, skip_bias_add=skip)
        with set_config(OpsConfig(["all"])):
            torch._dynamo.reset()
            y, out_bias = torch.compile(lambda *a: op(*a), fullgraph=True)(x, w, b)
        want = torch.nn.functional.linear(x, w, None if skip else b)
        assert torch.allclose(y, want, atol=1e-5) and (out_bias is None) != skip
        assert out_bias is None or torch.equal(out_bias, b)


# --- bad input: one rule each ---------------------------------------------------------------------

class _TP4(TensorParallel):
    size = 4


def test_tp_not_dividing_output_size():
    from dualop.ops import ColumnParallelLinear

    with pytest.raises(ValueError, match="column_parallel_linear: argument 'output_size' is 10, which the "
                                         "tensor-parallel size 4 does not divide"):
        ColumnParallelLinear(8, 10, tp=_TP4())


def test_tp_not_dividing_input_size():
    from dualop.ops import RowParallelLinear

    with pytest.raises(ValueError, match="row_parallel_linear: argument 'input_size' is 6, which the "
                                         "tensor-parallel size 4 does not divide"):
        RowParallelLinear(6, 8, tp=_TP4())


def test_tp_not_dividing_merged_outputs():
    from dualop.ops import MergedColumnParallelLinear

    with pytest.raises(ValueError, match=r"merged_column_parallel_linear: output_sizes\[0\] is 6, which the "
                                         r"tensor-parallel size 4 does not divide"):
        MergedColumnParallelLinear(8, [6, 10], tp=_TP4())


def test_tp_not_dividing_head_counts():
    from dualop.ops import QKVParallelLinear

    with pytest.raises(ValueError, match="qkv_parallel_linear: total_num_heads is 6, which the tensor-parallel "
                                         "size 4 does not divide"):
        QKVParallelLinear(32, 8, 6, 2, tp=_TP4())
    with pytest.raises(ValueError, match="qkv_parallel_linear: the tensor-parallel size .*replicating 3 kv heads"):
        QKVParallelLinear(32, 8, 12, 3, tp=_TP4())


def test_reduce_results_false_with_bias_is_the_engines_error():
    from dualop.ops import RowParallelLinear

    with pytest.raises(ValueError, match="When not reduce the results, adding bias to the results can lead to "
                                         "incorrect results"):
        RowParallelLinear(8, 8, reduce_results=False)


def test_x_with_the_wrong_last_dim():
    import torch

    from dualop.ops import RowParallelLinear

    op = RowParallelLinear(16, 8, bias=False, tp=_TP4())
    with pytest.raises(ValueError, match=r"row_parallel_linear: argument 'x' has last dim 16; expected 4 "
                                         r"\(input features on this rank: input_is_parallel"):
        op(torch.randn(2, 16), torch.randn(8, 4))


def test_weight_of_the_wrong_shard_shape():
    import torch

    from dualop.ops import ColumnParallelLinear

    with pytest.raises(ValueError, match=r"column_parallel_linear: argument 'weight' has shape \(8, 8\); "
                                         r"expected \(2, 8\)"):
        ColumnParallelLinear(8, 8, tp=_TP4(), bias=False)(torch.randn(2, 8), torch.randn(8, 8))


def test_weight_loader_rejects_a_full_tensor_of_the_wrong_shape():
    import torch

    from dualop.torch.layers import QKVParallelLinear

    layer = QKVParallelLinear(32, 4, 8, 2, tp=TensorParallel())
    with pytest.raises(ValueError, match=r"QKVParallelLinear.weight_loader: 'weight' \(loaded_shard_id 'k'\) got "
                                         r"shape \(4, 32\); expected the full checkpoint shape \(8, 32\)"):
        layer.weight_loader(layer.weight, torch.zeros(4, 32), "k")


def test_jax_weight_loader_rejects_a_full_tensor_of_the_wrong_shape():
    from dualop.jax.layers import RowParallelLinear

    layer = RowParallelLinear(16, 8)
    with pytest.raises(ValueError, match=r"RowParallelLinear.weight_loader: 'weight' got shape \(8, 8\); "
                                         r"expected the full checkpoint shape \(8, 16\)"):
        layer.weight_loader("weight", np.zeros((8, 8), np.float32))


def test_unknown_loaded_shard_id():
    from dualop.ops import MergedColumnParallelLinear

    with pytest.raises(ValueError, match=r"merged_column_parallel_linear: loaded_shard_id must be None or an int "
                                         r"in \[0, 2\), got 'q'"):
        MergedColumnParallelLinear(8, [4, 4]).checkpoint_layout("weight", "q")


# --- torch: tp 2 over two gloo processes == tp 1 ---------------------------------------------------


def _torch_layers_at_tp(rank: int, world: int, port: int) -> None:
    import torch

    from dualop.torch import layers
    from dualop.torch import parallel as tparallel

    with testing.gloo_group(rank, world, port):
        tp = tparallel.init_tensor_parallel_group()
        for index, (name, args, kwargs, kind) in enumerate(LAYER_CONFIGS):
            one = getattr(layers, name)(*args, tp=TensorParallel(), **kwargs)
            many = getattr(layers, name)(*args, **kwargs)  # the current group
            assert many.tp is tp
            full = checkpoint(index, one.op)
            for layer in (one, many):
                for param, value, shard_id in load_calls(layer.op, kind, full):
                    layer.weight_loader(getattr(layer, param), torch.from_numpy(value), shard_id)
            x = torch.from_numpy(full["x"])
            out1, out = one(x), None
            op = many.op
            if name == "RowParallelLinear" and op.input_is_parallel:
                out = many(x[..., rank * 16:(rank + 1) * 16].contiguous())
            else:
                out = many(x)
            y1, b1 = out1 if op.return_bias else (out1, None)
            y, b = out if op.return_bias else (out, None)
            if name == "RowParallelLinear" and not op.reduce_results:
                y = tp.all_reduce(y)  # the partial sums
            elif name != "RowParallelLinear" and name != "ReplicatedLinear" and not op.gather_output:
                y = tp.all_gather(y)
            want = expected_output(op, y1.numpy())
            cmp = testing.compare(y.numpy(), want, "float32")
            assert cmp.ok, (name, kwargs, rank, cmp)
            if b1 is not None:
                whole_b = tp.all_gather(b) if op.bias_split else b
                assert np.array_equal(whole_b.numpy(), expected_output(op, b1.numpy())), (name, kwargs)
            else:
                assert b is None


def test_torch_layers_at_tp2_equal_tp1():
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_torch_layers_at_tp, args=(2, free_port()), nprocs=2, join=True)


# --- jax: tp 2 and 4 of 8 host devices == tp 1 (one subprocess) -------------------------------------

_JAX_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    from dualop import testing
    from dualop.jax import layers
    from dualop.jax.parallel import tensor_parallel_mesh
    from test_linear import LAYER_CONFIGS, checkpoint, expected_output, load_calls

    results = []
    for n in (2, 4):
        mesh = tensor_parallel_mesh(n)
        for index, (name, args, kwargs, kind) in enumerate(LAYER_CONFIGS):
            one = getattr(layers, name)(*args, **kwargs)
            many = getattr(layers, name)(*args, mesh=mesh, **kwargs)
            full = checkpoint(index, one.op)
            for layer in (one, many):
                for param, value, shard_id in load_calls(layer.op, kind, full):
                    layer.weight_loader(param, value, shard_id)
            op, x = many.op, jnp.asarray(full["x"])
            if name == "RowParallelLinear" and op.input_is_parallel:
                from jax.sharding import NamedSharding, PartitionSpec
                x = jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, None, "tp")))
            out1, out = one(x), many(x)
            y1, b1 = out1 if op.return_bias else (out1, None)
            y, b = out if op.return_bias else (out, None)
            y = np.asarray(y)
            if name == "RowParallelLinear" and not op.reduce_results:
                y = y.sum(0)  # the ranks' partial sums
            cmp = testing.compare(y, expected_output(op, np.asarray(y1)), "float32")
            bias_ok = (b is None and b1 is None) or np.array_equal(np.asarray(b), expected_output(op, np.asarray(b1)))
            sharded = list(many.weight[...].sharding.spec) if op.weight_split_dim is not None else "replicated"
            results.append(dict(n=n, name=name, kwargs=repr(kwargs), ok=bool(cmp.ok), max_abs=cmp.max_abs,
                                bias_ok=bool(bias_ok), spec=sharded))
    print("RESULTS " + json.dumps(results))
""")


def test_jax_layers_at_tp2_and_tp4_equal_tp1():
    importlib.import_module("jax")
    importlib.import_module("flax")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 2 * len(LAYER_CONFIGS)
    bad = [r for r in results if not (r["ok"] and r["bias_ok"])]
    assert not bad, bad
    # the weights really are split over the axis (column family on rows, row-parallel on columns)
    specs = {(r["n"], r["name"]): r["spec"] for r in results}
    assert specs[(4, "QKVParallelLinear")] == ["tp", None]
    assert specs[(2, "RowParallelLinear")] == [None, "tp"]
    assert specs[(2, "ReplicatedLinear")] == "replicated"
