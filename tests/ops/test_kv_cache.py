"""reshape_and_cache (ReshapeAndCache): every path (torch native, the torch CPU path, the Triton
kernel, the Pallas kernel in both interpret modes, the jax native body) against a float64 numpy
scatter written here independently; torch updates the cache in place and returns it, jax returns a
new array and leaves its input alone; the two frontends give identical caches; padding slots and
untouched rows stay as they were; bad input is refused before any kernel."""

from __future__ import annotations

import numpy as np
import pytest

import jax  # noqa: E402  (both test environments have jax and torch: a broken install fails here)
import torch  # noqa: E402

from conftest import require_frontend
from dualop import OpsConfig, override_platform, set_config, testing
from dualop.ops import ReshapeAndCache

jnp = jax.numpy
# (frontend, platform, the method that must run)
TORCH_PATHS = [("cpu", "forward_cpu"), ("cuda", "forward_cuda")]


def numpy_reference(key, value, kv_pages, slots):
    """float64 scatter, one token at a time: K head h -> combined head 2h, V head h -> 2h+1;
    slots outside [0, num_pages * page_size) are skipped."""
    out = np.array(kv_pages, dtype=np.float64)
    num_pages, page_size = out.shape[:2]
    for t, slot in enumerate(np.asarray(slots).tolist()):
        if 0 <= slot < num_pages * page_size:
            page, offset = divmod(slot, page_size)
            out[page, offset, 0::2] = key[t]
            out[page, offset, 1::2] = value[t]
    return out


def make_batch(tokens=11, heads=2, head_dim=64, num_pages=5, page_size=4, dtype=torch.float32, seed=0,
               padding=3):
    """float32 numpy key, value, cache (values exact in ``dtype``) and int32 slots: distinct slots
    in random order, ``padding`` of them -1."""
    rng = np.random.default_rng(seed)

    def exact(shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype).float().numpy()

    slots = rng.permutation(num_pages * page_size)[:tokens].astype(np.int32)
    slots[rng.choice(tokens, padding, replace=False)] = -1
    return (exact((tokens, heads, head_dim)), exact((tokens, heads, head_dim)),
            exact((num_pages, page_size, 2 * heads, head_dim)), slots)


def _torch(arrays, dtype):
    key, value, cache, slots = arrays
    return (*(torch.from_numpy(a.copy()).to(dtype) for a in (key, value, cache)), torch.from_numpy(slots.copy()))


def _jax(arrays, dtype):
    key, value, cache, slots = arrays
    jdtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    return (*(jnp.asarray(a, jdtype) for a in (key, value, cache)), jnp.asarray(slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("platform, method", TORCH_PATHS + [("cpu", "forward_native")])
def test_torch_paths_match_numpy_and_update_in_place(platform, method, dtype):
    arrays = make_batch(dtype=dtype)
    key, value, cache, slots = _torch(arrays, dtype)
    op = ReshapeAndCache()
    with override_platform(platform), set_config(OpsConfig(["all"] if method != "forward_native" else ["none"])):
        op.last_fallback = None
        out = op(key, value, cache, slots)
        assert op.last_run("torch", platform)[0] == method
    assert out is cache  # in place: the same tensor, updated
    np.testing.assert_array_equal(out.double().numpy(), numpy_reference(*arrays))


@pytest.mark.latest_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interpret", ["generic", "tpu"])
def test_pallas_kernel_matches_numpy_in_both_interpret_modes(interpret, dtype):
    from dualop.kernels.pallas.common import interpret_mode
    from dualop.kernels.pallas.reshape_and_cache import reshape_and_cache

    mode = True if interpret == "generic" else interpret_mode("jax")
    if interpret == "tpu" and mode is True:
        pytest.skip(f"jax {jax.__version__} has no TPU interpret mode dualop can use (needs 0.8+); the generic one ran")
    arrays = make_batch(tokens=40, num_pages=12, dtype=dtype, padding=7)  # two grid steps of 32 tokens
    key, value, cache, slots = _jax(arrays, dtype)
    out = reshape_and_cache(key, value, cache, slots, interpret=mode)
    np.testing.assert_array_equal(np.asarray(out, np.float64), numpy_reference(*arrays))
    np.testing.assert_array_equal(np.asarray(cache, np.float32), arrays[2])  # the input is unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jax_returns_a_new_cache_and_both_frontends_agree(dtype):
    arrays = make_batch(tokens=9, heads=4, head_dim=32, dtype=dtype, seed=3)
    op = ReshapeAndCache()
    outs = {}
    for platform in ("tpu", "cpu"):
        jarrays = _jax(arrays, dtype)
        with override_platform(platform), set_config(OpsConfig(["all"])):
            outs[platform] = op(*jarrays)
        np.testing.assert_array_equal(np.asarray(jarrays[2], np.float32), arrays[2])
    targs = _torch(arrays, dtype)
    torch_out = op(*targs)
    want = numpy_reference(*arrays)
    for out in outs.values():
        np.testing.assert_array_equal(np.asarray(out, np.float64), want)
        # identical caches, bit for bit, in both frontends
        assert np.array_equal(np.asarray(out.astype(jnp.float32)), torch_out.float().numpy())


def test_jit_with_a_donated_cache():
    """Under jax.jit the cache is donated (``donate_argnums``) so XLA may write it in place; the
    result is the same."""
    arrays = make_batch(seed=5)
    op = ReshapeAndCache()
    step = jax.jit(lambda k, v, c, s: op(k, v, c, s), donate_argnums=2)
    with override_platform("tpu"), set_config(OpsConfig(["all"])):
        out = step(*_jax(arrays, torch.float32))
    np.testing.assert_array_equal(np.asarray(out, np.float64), numpy_reference(*arrays))


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_padding_and_untouched_rows_keep_their_values(platform):
    """All tokens padding: the cache is bit-identical; otherwise exactly the kept slots change."""
    arrays = make_batch(tokens=6, padding=6, seed=2)
    key, value, cache, slots = _torch(arrays, torch.float32)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        ReshapeAndCache()(key, value, cache, slots)
    assert np.array_equal(cache.numpy(), arrays[2])

    arrays = make_batch(tokens=6, padding=2, seed=2)
    key, value, cache, slots = _torch(arrays, torch.float32)
    with override_platform(platform), set_config(OpsConfig(["all"])):
        ReshapeAndCache()(key, value, cache, slots)
    changed = np.any(cache.numpy() != arrays[2], axis=(2, 3)).reshape(-1)
    assert set(np.flatnonzero(changed)) == {int(s) for s in arrays[3] if s >= 0}


def test_triton_kernel_reads_strided_key_and_int64_slots():
    from dualop.kernels.cuda.reshape_and_cache import reshape_and_cache

    arrays = make_batch(tokens=5, heads=3, head_dim=40, padding=1, seed=8)
    key, value, cache, slots = _torch(arrays, torch.float32)
    wide = torch.zeros((5, 6, 40))
    wide[:, ::2] = key
    out = reshape_and_cache(wide[:, ::2], value, cache, slots.to(torch.int64))
    assert out is cache
    np.testing.assert_array_equal(cache.double().numpy(), numpy_reference(*arrays))


@pytest.mark.parametrize("frontend", ["torch_xla", "torchax"])
def test_torch_on_xla_devices_updates_in_place(frontend):
    """torch_xla and torchax reach the Pallas kernel, which returns a new array: it is written
    back with ``copy_``, so the caller's tensor holds the update, identical to the jax result."""
    require_frontend(frontend)
    arrays = make_batch(seed=4)
    with testing.frontend_context(frontend):
        args = [testing.to_frontend(a if i < 3 else testing.Pinned(a, "int32"), frontend, "float32")
                for i, a in enumerate(arrays)]
        op = ReshapeAndCache()
        with override_platform("tpu"), set_config(OpsConfig(["all"])):
            out = op(*args)
            assert op.last_run(frontend, "tpu")[0] == "forward_tpu"
        assert out is args[2]
        got = testing.to_numpy(args[2])
    np.testing.assert_array_equal(got.astype(np.float64), numpy_reference(*arrays))


def test_zero_tokens_leave_the_cache_alone():
    arrays = make_batch(tokens=0, padding=0)
    for platform in ("cpu", "cuda"):
        key, value, cache, slots = _torch(arrays, torch.float32)
        with override_platform(platform), set_config(OpsConfig(["all"])):
            assert ReshapeAndCache()(key, value, cache, slots) is cache
        assert np.array_equal(cache.numpy(), arrays[2])


def _bad(change):
    key, value, cache, slots = _torch(make_batch(), torch.float32)
    args = dict(key=key, value=value, kv_pages=cache, slot_mapping=slots)
    change(args)
    return args


@pytest.mark.parametrize("change, error, message", [
    (lambda a: a.update(value=a["value"].to(torch.bfloat16)), TypeError, "'value' has dtype bfloat16; expected float32"),
    (lambda a: a.update(kv_pages=a["kv_pages"].to(torch.bfloat16)), TypeError, "'kv_pages' has dtype bfloat16"),
    (lambda a: a.update(kv_pages=a["kv_pages"][:, :, :2]), ValueError, r"'kv_pages' has shape \(5, 4, 2, 64\); expected \(5, 4, 4, 64\)"),
    (lambda a: a.update(key=a["key"][None]), ValueError, "'key' must be \\[tokens, num_kv_heads, head_dim\\]"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), TypeError, "'slot_mapping' has dtype float32; expected int32 or int64"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), ValueError, r"'slot_mapping' has shape \(3,\); expected \(11,\)"),
    (lambda a: a["slot_mapping"].__setitem__(0, 20), ValueError, "holds slot 20; expected slots below num_pages \\* page_size = 20"),
    (lambda a: a.update(slot_mapping=jnp.zeros(11, jnp.int32)), TypeError, "'slot_mapping' is a jax array but 'key' is a torch array"),
])
def test_bad_input_is_refused_before_any_kernel(change, error, message, monkeypatch):
    from dualop.kernels.cuda import reshape_and_cache as triton_kernel

    def never(*args, **kwargs):
        raise AssertionError("the kernel ran on bad input")

    monkeypatch.setattr(triton_kernel, "reshape_and_cache", never)
    with override_platform("cuda"), set_config(OpsConfig(["all"])):
        with pytest.raises(error, match=f"reshape_and_cache: .*{message}"):
            ReshapeAndCache()(**_bad(change))
