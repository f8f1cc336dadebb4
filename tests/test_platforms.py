"""The one platform detector: frontends of arrays, platforms of frontends, the override."""

from __future__ import annotations

import pytest

from dualop import current_platform, override_platform
from dualop import platforms

torch = pytest.importorskip("torch", reason="torch is part of both test environments (dualop[torch], dualop[jax])")
jnp = pytest.importorskip("jax.numpy", reason="jax.numpy is part of both test environments (dualop[torch], dualop[jax])")
jax = pytest.importorskip("jax", reason="jax is part of both test environments (dualop[torch], dualop[jax])")


def test_frontend_of_arrays_and_tracers():
    assert platforms.frontend_of(torch.zeros(1)) == "torch"
    assert platforms.frontend_of(jnp.zeros(1)) == "jax"
    seen = []
    jax.jit(lambda a: seen.append(platforms.frontend_of(a)) or a)(jnp.zeros(2))
    jax.vmap(lambda a: seen.append(platforms.frontend_of(a)) or a)(jnp.zeros((2, 2)))
    assert seen == ["jax", "jax"]
    assert platforms.frontend_of([1.0]) is None and platforms.frontend_of(None) is None


def test_this_machine_is_cpu_for_both_frontends(monkeypatch):
    monkeypatch.delenv("DUALOP_PLATFORM", raising=False)
    platforms.invalidate()
    assert current_platform("torch") == "cpu"
    assert current_platform("jax") == "cpu"


@pytest.mark.parametrize("value, expected", [("tpu", "tpu"), ("CUDA", "cuda"), ("hip", "rocm"), ("oot", "oot")])
def test_env_override(monkeypatch, value, expected):
    monkeypatch.setenv("DUALOP_PLATFORM", value)
    platforms.invalidate()
    assert current_platform("torch") == expected == current_platform("jax")


def test_env_override_rejects_unknown_platforms(monkeypatch):
    monkeypatch.setenv("DUALOP_PLATFORM", "npu")
    with pytest.raises(ValueError, match=r"DUALOP_PLATFORM='npu' is not a platform"):
        current_platform("torch")


def test_override_platform_context_nests_and_restores():
    base = current_platform("jax")
    with override_platform("tpu"):
        assert current_platform("jax") == "tpu"
        with override_platform("cuda"):
            assert current_platform("torch") == "cuda"
        assert current_platform("torch") == "tpu"
    assert current_platform("jax") == base
    with pytest.raises(ValueError):
        with override_platform("gpu"):
            pass


def test_unknown_frontend():
    with pytest.raises(ValueError, match="unknown frontend 'numpy'"):
        current_platform("numpy")
