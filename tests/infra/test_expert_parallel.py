"""Expert parallelism: ``modular_fused_moe``'s prepare/finalize, JAX's sharded MoE layer on 2, 4 and
8 host devices (a child process: the device count is fixed before jax starts) and torch's process
groups (2 and 4 gloo processes), each against the one-device result."""

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
from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import FusedMoEModularMethod, UnquantizedFusedMoEMethod, expert_blocks, expert_owner
from dualop.ops.moe_modular import Prepared, SingleDevicePrepareAndFinalize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _experts_problem(rng, tokens=7, experts=10, top_k=3, hidden=32, inter=16, activation="silu"):
    rows = 2 * inter if activation != "relu2" else inter
    return dict(
        x=rng.standard_normal((tokens, hidden)).astype(np.float32),
        weights=rng.random((tokens, top_k)).astype(np.float32),
        ids=np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]).astype(np.int32),
        w13=(rng.standard_normal((experts, rows, hidden)) * hidden ** -0.5).astype(np.float32),
        w2=(rng.standard_normal((experts, hidden, inter)) * inter ** -0.5).astype(np.float32),
        b13=(rng.standard_normal((experts, rows)) * 0.1).astype(np.float32),
        b2=(rng.standard_normal((experts, hidden)) * 0.1).astype(np.float32),
    )


_MANTISSA_BITS = {"bfloat16": 7, "float16": 10}


def ep_close(got, want32, dtype: str) -> bool:
    """Expert-parallel output ``got`` against one device's float32 result ``want32`` (the experts
    with ``float32_output``: the sum before its one cast).

    float32: the tolerance table (only the order of the float32 sums differs). 16-bit: the
    expert-parallel combine adds float32 partials and casts once, so ``got`` is ``want32`` cast to
    the dtype except where the other order of the float32 sums moves a value across a rounding
    boundary: every element within 1 unit in the last place of its own value, and at most 1% of
    them (or one element) not bitwise equal (measured: at most 0.05%; more than 1 unit would take
    a float32 sum cancelling by 2^16). Rounding each shard's share or pair before the sum, as the
    combine did before, fails both: 30-43% of the elements differ, by up to ~1900 units."""
    got, want32 = np.asarray(got, np.float32), np.asarray(want32, np.float32)
    if got.shape != want32.shape:
        return False
    if dtype == "float32":
        return bool(testing.compare(got, want32, dtype).ok)
    max_units, unequal = units_off(got, want32, dtype)
    return max_units <= 1 and unequal <= max(1, 0.01 * got.size)


def units_off(got, want32, dtype: str) -> tuple[float, int]:
    """(largest ``|got - round(want32)|`` in units in the last place of each element's own value,
    number of elements not equal to ``round(want32)``), ``round`` being the cast to ``dtype``."""
    import ml_dtypes  # numpy's bfloat16 (JAX's own), rounding to nearest even as every frontend casts

    got, want32 = np.asarray(got, np.float32), np.asarray(want32, np.float32)
    want = want32.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).astype(np.float32)
    magnitude = np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    ulp = 2.0 ** (np.floor(np.log2(magnitude)) - _MANTISSA_BITS[dtype])
    diff = np.abs(got - want)
    return float(np.max(diff / ulp, initial=0.0)), int(np.count_nonzero(diff))


# --- placement ---------------------------------------------------------------------------------


def test_expert_blocks_follow_the_engines_placement():
    # determine_expert_map: contiguous blocks, the first E % n ranks one expert more
    assert expert_blocks(10, 4) == ((0, 3), (3, 3), (6, 2), (8, 2))
    assert expert_blocks(16, 4) == ((0, 4), (4, 4), (8, 4), (12, 4))
    with pytest.raises(ValueError, match="modular_fused_moe: cannot place 3 experts on 4 shards"):
        expert_blocks(3, 4)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("experts, shards", [(10, 4), (16, 4), (7, 7), (9, 2), (5, 1)])
def test_expert_owner_agrees_with_the_blocks(frontend, experts, shards):
    from dualop.backends import array_namespace

    want = np.full(experts + 3, shards)  # ids -2, -1 and experts: no shard
    for shard, (start, count) in enumerate(expert_blocks(experts, shards)):
        want[start + 2:start + 2 + count] = shard
    ids = testing.to_frontend(np.arange(-2, experts + 1, dtype=np.int32), frontend, "int32")
    got = testing.to_numpy(expert_owner(array_namespace(ids), ids, experts, shards))
    np.testing.assert_array_equal(got, want)


# --- the op on one device ------------------------------------------------------------------------


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2"])
def test_single_device_equals_the_experts_op(frontend, activation):
    p = _experts_problem(np.random.default_rng(3), activation=activation)
    args = [testing.to_frontend(p[k], frontend, "float32") for k in ("x", "weights")]
    args += [testing.to_frontend(p["ids"], frontend, "int32")]
    args += [testing.to_frontend(p[k], frontend, "float32") for k in ("w13", "w2", "b13", "b2")]
    got = FusedMoEModularMethod(activation=activation)(*args)
    # the same experts path as the experts op dispatched here (bit for bit), and the native body
    # within the tolerance table
    same_path = UnquantizedFusedMoEMethod(activation)(*args)
    np.testing.assert_array_equal(testing.to_numpy(got), testing.to_numpy(same_path))
    want = UnquantizedFusedMoEMethod(activation).forward_native(*args)
    assert testing.compare(testing.to_numpy(got), testing.to_numpy(want), "float32").ok


class _CountingPrepare(SingleDevicePrepareAndFinalize):
    """Stands for a prepare that communicates (all-to-all): counts its calls."""

    calls = 0
    prepare_communicates = True

    def prepare(self, *args, **kwargs) -> Prepared:
        type(self).calls += 1
        return super().prepare(*args, **kwargs)


def test_a_declining_experts_kernel_does_not_repeat_prepare(monkeypatch):
    """A kernel that declines is replaced by the experts' native body on the prepared rows: the
    prepare (a collective under expert parallelism) runs once, and the report says why."""

    def forward_cpu(self, *args):
        raise NotImplementedError("not this call")

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "forward_cpu", forward_cpu)
    p = _experts_problem(np.random.default_rng(4))
    args = [testing.to_frontend(p[k], "torch", "float32") for k in ("x", "weights")]
    args += [testing.to_frontend(p["ids"], "torch", "int32"), testing.to_frontend(p["w13"], "torch", "float32"),
             testing.to_frontend(p["w2"], "torch", "float32")]
    _CountingPrepare.calls = 0
    op = FusedMoEModularMethod(_CountingPrepare())
    with override_platform("cpu"), set_config(OpsConfig(["all"])):
        got = op(*args)
        method, reason = op.last_run("torch")
    assert _CountingPrepare.calls == 1
    assert method == "forward_native" and "forward_cpu declined this call (not this call)" in reason
    want = UnquantizedFusedMoEMethod().forward_native(*args)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("frontend, platform, method", [("torch", "cpu", "forward_cpu"), ("jax", "tpu", "forward_tpu"),
                                                       ("torch_xla", "tpu", "forward_tpu"),
                                                       ("torchax", "tpu", "forward_tpu")])
def test_the_cell_counts_the_experts_kernel(monkeypatch, frontend, platform, method):
    """With an experts kernel in place (here a stand-in computing the native body), the modular
    op's cell runs it between prepare and finalize and passes as a kernel cell."""
    from conftest import require_frontend
    from dualop import check

    require_frontend(frontend)

    ran = []

    def stand_in(self, *args):
        ran.append(len(args))
        return self.forward_native(*args)

    monkeypatch.setattr(UnquantizedFusedMoEMethod, method, stand_in)
    case = next(testing.cases_for(["modular_fused_moe"]))
    result = check._run_cell(case, frontend, platform, "float32", seed=0)
    assert (result.method, result.status) == (method, "pass"), result.detail
    assert ran and set(ran) == {8}


def test_a_declining_experts_kernel_reruns_a_single_device_op_natively(monkeypatch):
    """Nothing was sent, so the dispatcher's usual fallback applies (and ``dualop compile`` sees the
    decline as n/a rather than a build of the native body)."""

    def forward_tpu(self, *args):
        raise NotImplementedError("no kernel")

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "forward_tpu", forward_tpu)
    p = _experts_problem(np.random.default_rng(6))
    args = [testing.to_frontend(p[k], "jax", "float32") for k in ("x", "weights")]
    args += [testing.to_frontend(p["ids"], "jax", "int32"), testing.to_frontend(p["w13"], "jax", "float32"),
             testing.to_frontend(p["w2"], "jax", "float32")]
    op = FusedMoEModularMethod()
    with pytest.raises(NotImplementedError, match="no kernel"):
        op.forward_tpu(*args)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        op(*args)
        method, reason = op.last_run("jax")
    assert method == "forward_native" and "forward_tpu declined this call (no kernel)" in reason


def test_bad_input_names_this_op():
    import torch

    p = _experts_problem(np.random.default_rng(5))
    x, w, ids = torch.from_numpy(p["x"]), torch.from_numpy(p["weights"]), torch.from_numpy(p["ids"])
    w13, w2 = torch.from_numpy(p["w13"]), torch.from_numpy(p["w2"])
    with pytest.raises(ValueError, match="modular_fused_moe: argument 'w2' has shape"):
        FusedMoEModularMethod()(x, w, ids, w13, w2[:, :-1])
    with pytest.raises(ValueError, match=r"modular_fused_moe: argument 'topk_ids' holds expert 10"):
        FusedMoEModularMethod()(x, w, ids.clone().fill_(10), w13, w2)
    with pytest.raises(TypeError, match="modular_fused_moe: argument 'prepare_finalize' must be a PrepareAndFinalize"):
        FusedMoEModularMethod(object())


# --- JAX: shard_map over 2, 4 and 8 host devices -------------------------------------------------

_JAX_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh
    from dualop import testing
    from dualop.ops import FusedMoE, UnquantizedFusedMoEMethod
    from dualop.jax.expert_parallel import expert_parallel_moe
    from test_expert_parallel import ep_close, units_off

    rng = np.random.default_rng(0)
    E, H, I = 16, 128, 64
    layers = {  # name: (op, has biases, correction bias, shard counts)
        "silu,k4": (FusedMoE(E, 4, H, I), False, False, (2, 8)),
        "grouped,sigmoid,swigluoai,bias": (FusedMoE(E, 3, H, I, use_grouped_topk=True, num_expert_group=4,
                                                    topk_group=2, scoring_func="sigmoid",
                                                    routed_scaling_factor=2.5, activation="swigluoai",
                                                    has_bias=True), True, True, (8,)),
    }
    out = []
    for name, (op, bias, correction, shard_counts) in layers.items():
        for dtype in ("float32", "bfloat16"):
            dt = jnp.dtype(dtype)
            T = 13
            x = jnp.asarray(rng.standard_normal((T, H)), dt)
            logits = jnp.asarray(rng.standard_normal((T, E)) * 2, dt)
            w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) * H ** -0.5, dt)
            w2 = jnp.asarray(rng.standard_normal((E, H, I)) * I ** -0.5, dt)
            b13 = jnp.asarray(rng.standard_normal((E, 2 * I)) * 0.1, dt) if bias else None
            b2 = jnp.asarray(rng.standard_normal((E, H)) * 0.1, dt) if bias else None
            corr = jnp.asarray(rng.standard_normal(E) * 0.5, jnp.float32) if correction else None
            # one device: the same routing and experts, the experts' float32 sum before its cast
            experts32 = UnquantizedFusedMoEMethod(op.activation, op.apply_router_weight_on_input, float32_output=True)
            want = np.asarray(experts32(x, *op.route(x, logits, corr), w13, w2, b13, b2))
            assert want.dtype == np.float32
            for n in shard_counts:
                mesh = Mesh(np.array(jax.devices()[:n]), ("ep",))
                for mode in ("all_to_all", "psum"):
                    run = jax.jit(lambda *a: expert_parallel_moe(mesh, "ep", *a, op=op, mode=mode))
                    got = np.asarray(run(x, logits, w13, w2, b13, b2, corr).astype(jnp.float32))
                    out.append(dict(layer=name, dtype=dtype, shards=n, mode=mode, ok=bool(ep_close(got, want, dtype)),
                                    max_abs=float(np.max(np.abs(got - want))),
                                    units_off=None if dtype == "float32" else units_off(got, want, dtype)))

    # no tokens, and one token on 8 shards (all_to_all pads it to 8)
    op = layers["silu,k4"][0]
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) * H ** -0.5, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, H, I)) * I ** -0.5, jnp.float32)
    for T in (0, 1):
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
        want = np.asarray(op(x, logits, w13, w2))
        for mode in ("all_to_all", "psum"):
            got = np.asarray(expert_parallel_moe(mesh, "ep", x, logits, w13, w2, op=op, mode=mode))
            out.append(dict(layer=f"tokens{T}", dtype="float32", shards=8, mode=mode,
                            ok=got.shape == want.shape and bool(ep_close(got, want, "float32")),
                            max_abs=float(np.max(np.abs(got - want), initial=0.0))))

    # capacity: pairs past it are dropped (stable order per source shard and destination)
    op, n, T = FusedMoE(E, 4, H, I), 4, 16
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((T, E)) * 2, jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((E, 2 * I, H)) * H ** -0.5, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, H, I)) * I ** -0.5, jnp.float32)
    weights, ids = op.route(x, logits)
    ids_np, per_shard = np.asarray(ids), T // n
    slots = np.zeros(ids_np.shape, np.int64)
    for s in range(n):
        seen = {}
        for t in range(s * per_shard, (s + 1) * per_shard):
            for j in range(ids_np.shape[1]):
                owner = ids_np[t, j] // (E // n)
                slots[t, j] = seen.get(owner, 0)
                seen[owner] = slots[t, j] + 1
    mesh = Mesh(np.array(jax.devices()[:n]), ("ep",))
    experts = UnquantizedFusedMoEMethod()
    for capacity in (int(slots.max()) + 1, int(slots.max())):
        kept = jnp.asarray(slots < capacity, jnp.float32)
        want = np.asarray(experts.forward_native(x, weights * kept, ids, w13, w2))
        got = np.asarray(jax.jit(lambda *a: expert_parallel_moe(mesh, "ep", *a, op=op, capacity=capacity))(
            x, logits, w13, w2))
        out.append(dict(layer="capacity", capacity=capacity, dropped=int((slots >= capacity).sum()),
                        ok=bool(testing.compare(got, want, "float32").ok), max_abs=float(np.max(np.abs(got - want)))))
    print("RESULTS " + json.dumps(out))
""")


def _child_env() -> dict[str, str]:
    path = [ROOT, os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


@pytest.mark.once_in_xla  # the sharding logic is dualop's; one jax (50 s a run) is enough
def test_jax_expert_parallel_matches_one_device():
    importlib.import_module("jax")
    proc = subprocess.run([sys.executable, "-c", _JAX_SCRIPT], env=_child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    assert len(results) == 2 * 2 * (2 + 1) + 2 * 2 + 2
    assert [r for r in results if not r["ok"] and r["layer"] != "capacity"] == []
    exact, short = [r for r in results if r["layer"] == "capacity"]
    assert exact["dropped"] == 0 and exact["ok"], exact
    assert short["dropped"] > 0 and short["ok"], short  # the same as zeroing the dropped pairs' weights


def test_jax_expert_parallel_rejects_bad_arguments():
    jax = importlib.import_module("jax")
    from jax.sharding import Mesh

    from dualop.jax.expert_parallel import expert_parallel_moe
    from dualop.ops import FusedMoE

    jnp = jax.numpy
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    op = FusedMoE(4, 2, 8, 4)
    x, logits = jnp.zeros((3, 8)), jnp.zeros((3, 4))
    w13, w2 = jnp.zeros((4, 8, 8)), jnp.zeros((4, 8, 4))
    with pytest.raises(ValueError, match="expert_parallel_moe: argument 'mode' is 'ring'"):
        expert_parallel_moe(mesh, "ep", x, logits, w13, w2, op=op, mode="ring")
    with pytest.raises(ValueError, match="expert_parallel_moe: axis 'tp' is not an axis of the mesh"):
        expert_parallel_moe(mesh, "tp", x, logits, w13, w2, op=op)
    with pytest.raises(ValueError, match="expert_parallel_moe: 'w13' holds 2 experts"):
        expert_parallel_moe(mesh, "ep", x, logits, w13[:2], w2[:2], op=op)
    with pytest.raises(ValueError, match="expert_parallel_moe: argument 'capacity' must be a positive int"):
        expert_parallel_moe(mesh, "ep", x, logits, w13, w2, op=op, capacity=0)
    from dualop.ops import TransformersFusedMoE

    with pytest.raises(TypeError, match="expert_parallel_moe: argument 'op' must be a dualop.ops.FusedMoE"):
        expert_parallel_moe(mesh, "ep", x, logits, w13, w2, op=TransformersFusedMoE(4, 2, 8, 4))


# --- torch: 2 and 4 gloo processes ---------------------------------------------------------------


def _torch_rank(rank: int, world: int, port: int) -> None:
    """One rank: the one-process result, then the all-reduce and all-to-all forms over gloo; on
    the "cuda" platform the experts are the Triton kernels (interpreted here on CPU tensors)."""
    from dualop.torch import expert_parallel as ep

    with testing.gloo_group(rank, world, port):
        group = ep.init_expert_parallel_group()
        for platform in ("cpu", "cuda"):
            with override_platform(platform), set_config(OpsConfig(["all"])):
                _torch_rank_checks(rank, world, group, platform)


def _torch_rank_checks(rank: int, world: int, group, platform: str) -> None:
    import torch

    from dualop.torch import expert_parallel as ep

    experts = 10  # uneven blocks over 4 ranks: 3, 3, 2, 2
    for activation in ("silu",) if world == 2 else ("swigluoai",):
        p = _experts_problem(np.random.default_rng(11), tokens=9, experts=experts, activation=activation)
        for dtype in ("float32", "bfloat16"):
            t = {k: testing.to_frontend(v, "torch", "int32" if k == "ids" else dtype) for k, v in p.items()}
            t["weights"] = torch.from_numpy(p["weights"])
            whole = (t["w13"], t["w2"], t["b13"], t["b2"])
            # one process, the same experts path: its float32 sum, before its one cast (the kernels'
            # own rounding, e.g. Triton's hi/lo halves, is theirs to test against the native body)
            one_process = UnquantizedFusedMoEMethod(activation, float32_output=True)
            want = one_process(t["x"], t["weights"], t["ids"], *whole)
            assert want.dtype == torch.float32
            _, expert_map = ep.expert_map_for_rank(experts, world, rank)
            mine = [ep.local_experts(w, experts, world, rank) for w in whole]

            reduce_op = FusedMoEModularMethod(ep.AllReducePrepareAndFinalize(group), activation)
            got = reduce_op(t["x"], t["weights"], t["ids"], *mine, expert_map)
            assert ep_close(got.float().numpy(), want.numpy(), dtype), (
                "all_reduce", activation, dtype, rank, dtype != "float32" and units_off(got.float(), want, dtype))

            # all-to-all: uneven token shards, the last rank's possibly empty
            bounds = [min(len(t["x"]), 3 * r) for r in range(world)] + [len(t["x"])]
            lo, hi = bounds[rank], bounds[rank + 1]
            a2a_op = FusedMoEModularMethod(ep.AllToAllPrepareAndFinalize(group), activation)
            got = a2a_op(t["x"][lo:hi], t["weights"][lo:hi], t["ids"][lo:hi], *mine, expert_map)
            assert ep_close(got.float().numpy(), want[lo:hi].numpy(), dtype), (
                "all_to_all", activation, dtype, rank,
                dtype != "float32" and units_off(got.float(), want[lo:hi], dtype))
            if platform == "cuda":  # the Triton experts ran (between prepare and finalize)
                for op in (one_process, reduce_op, a2a_op):
                    assert op.last_run("torch", "cuda")[0] == "forward_cuda", op.last_run("torch", "cuda")


@pytest.mark.parametrize("world", [2, 4])
def test_torch_expert_parallel_matches_one_process(world):
    torch = importlib.import_module("torch")
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    mp.spawn(_torch_rank, args=(world, free_port()), nprocs=world, join=True)


def test_torch_expert_map_for_rank():
    from dualop.torch.expert_parallel import expert_map_for_rank, local_experts

    count, expert_map = expert_map_for_rank(10, 4, 2)
    assert count == 2 and expert_map.tolist() == [-1] * 6 + [0, 1, -1, -1]
    import torch

    w = torch.arange(10.0)[:, None]
    assert local_experts(w, 10, 4, 0).flatten().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="ep_rank 4 is outside"):
        expert_map_for_rank(10, 4, 4)


# --- dualop compile: the sharded layers on multi-chip topologies ---------------------------------


def test_multichip_targets_are_accepted_and_unknown_ones_named():
    from dualop import aot

    assert aot.check_targets(["v5e", "v5e:2x2", "v6e:2x4"]) == ["v5e", "v5e:2x2", "v6e:2x4"]
    with pytest.raises(ValueError, match=r"unknown target\(s\) \['v9:2x2'\].*v5e:2x2 or v6e:2x4"):
        aot.check_targets(["v9:2x2"])


@pytest.mark.latest_only
@pytest.mark.parametrize("label", ["fused_moe[ep,all_to_all]", "fused_moe[ep,psum]"])
def test_the_expert_parallel_layer_compiles_for_v5e_2x2(label):
    """The small expert-parallel layer (64 experts) built by XLA:TPU for four v5e chips: the
    all-to-all or psum collectives and the experts in one program; nothing runs."""
    from dualop.aot import sharded, tpu

    why = tpu.tpu_available()
    if why is not None:
        pytest.skip(f"TPU compiles need libtpu, installed in the latest environment only: {why}")
    import jax
    from jax.sharding import Mesh

    layer = next(layer for layer in sharded.SHARDED_LAYERS if layer.label == label)
    (shape,) = layer.shapes  # the small layer
    with tpu.quiet_native_stderr():
        result = sharded.compile_layer(layer, shape, "bfloat16", "v5e:2x2")
        fn, args = layer.build(Mesh(np.array(tpu.topology_devices("v5e:2x2")), ("x",)), shape, "bfloat16")
        program = jax.jit(fn).trace(*args).lower().as_text()
    assert result.status == "ok", result.message
    collective = "all_to_all" if label.endswith("all_to_all]") else "all_reduce"
    assert f"stablehlo.{collective}" in program or f"mhlo.{collective}" in program
