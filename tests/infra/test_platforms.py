"""The one platform detector: frontends of arrays, platforms of frontends, the override."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import require_frontend

from dualop import CustomOp, OpsConfig, current_platform, dispatch_report, override_platform, set_config
from dualop import platforms

import jax  # noqa: E402  (both test environments have torch and jax: a broken install fails here)
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402


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


# ---- a torch tensor's platform follows its device ---------------------------------------------


class _Where(CustomOp):
    """Returns the platform whose method ran."""

    def forward_native(self, x):
        return "native"

    def forward_cpu(self, x):
        return "cpu"

    def forward_cuda(self, x):
        return "cuda"

    def forward_hip(self, x):
        return "rocm"

    def forward_xpu(self, x):
        return "xpu"

    def forward_tpu(self, x):
        return "tpu"


@pytest.fixture
def no_env_platform(monkeypatch):
    monkeypatch.delenv("DUALOP_PLATFORM", raising=False)
    platforms.invalidate()
    with set_config(OpsConfig(["all"])):
        yield


def _pretend_torch_platform(monkeypatch, platform: str) -> None:
    """A process whose torch platform is ``platform`` (as on a host with that device)."""
    monkeypatch.setitem(platforms._DETECTORS, "torch", lambda: platform)
    platforms.invalidate()


def test_cpu_tensor_on_a_cuda_host_runs_the_cpu_kernels(monkeypatch, no_env_platform):
    """End to end on real CPU tensors: the process says cuda, the tensor says cpu, and the tensor
    wins: RMSNorm takes forward_cpu (the C++ kernels), and its result is forward_native's."""
    from dualop.ops import RMSNorm
    from dualop.testing import compare, to_numpy

    _pretend_torch_platform(monkeypatch, "cuda")
    assert current_platform("torch") == "cuda"
    op = RMSNorm(384)
    x, w = torch.randn(13, 384), torch.rand(384) + 0.5
    for _ in range(2):  # resolving call, then the armed fast path
        got = op(x, w)
    assert compare(to_numpy(got), to_numpy(op.forward_native(x, w)), "float32").ok
    rows = [r for r in dispatch_report() if r["op"] == "rms_norm"]
    assert [(r["frontend"], r["platform"], r["method"]) for r in rows] == [("torch", "cpu", "forward_cpu")]


def test_fake_cuda_tensors_take_the_cuda_path_beside_cpu_tensors(no_env_platform):
    """FakeTensorMode makes tensors that claim a CUDA device on a host without one; one op
    instance alternates between them and fake CPU tensors (the same Python type), so the fast
    path must tell the devices apart."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = _Where()
    with FakeTensorMode():
        on_cuda, on_cpu = torch.empty(2, device="cuda"), torch.empty(2)
        assert type(on_cuda) is type(on_cpu)
        assert [op(t) for t in (on_cuda, on_cpu, on_cuda, on_cpu)] == ["cuda", "cpu", "cuda", "cpu"]
        assert platforms.platform_of(on_cuda) == "cuda" and platforms.frontend_of(on_cuda) == "torch"


def test_cuda_tensors_of_a_rocm_build_take_the_hip_path(monkeypatch, no_env_platform):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    platforms.invalidate()
    with FakeTensorMode():
        assert _Where()(torch.empty(2, device="cuda")) == "rocm"


def test_fast_path_checks_the_device_where_devices_differ(monkeypatch, no_env_platform):
    """Simulated host whose second device type (here 'meta', standing in for an XPU) has its own
    platform: plain tensors of both devices share one type, and each call takes its own path."""
    original = platforms._torch_device_platform
    monkeypatch.setattr(platforms, "_torch_devices_vary", lambda: True)
    monkeypatch.setattr(platforms, "_torch_device_platform", lambda x: "xpu" if x.is_meta else original(x))
    platforms.invalidate()
    op = _Where()
    cpu, meta = torch.zeros(2), torch.empty(2, device="meta")
    assert [op(t) for t in (cpu, cpu, meta, meta, cpu)] == ["cpu", "cpu", "xpu", "xpu", "cpu"]
    assert op._armed.array_type is torch.Tensor and op._armed.probe is not None  # armed, with a device probe


def test_fast_path_checks_the_device_only_where_devices_can_differ(no_env_platform):
    """This machine has no GPU, XPU or TPU: only an imported torch_xla (or a torch_tpu ``tpu``
    device, which tests/infra/test_torch_tpu.py names for fake tensors) makes torch tensors' devices
    differ, so only then does the fast path pay for a device probe. Meta tensors dispatch as CPU
    tensors do."""
    vary = "torch_xla" in sys.modules or torch._C._get_privateuse1_backend_name() == "tpu"
    assert platforms._torch_devices_vary() is vary
    op = _Where()
    assert op(torch.zeros(2)) == "cpu" and (op._armed.probe is not None) is vary
    assert op(torch.empty(2, device="meta")) == "cpu"
    assert platforms.platform_of(torch.empty(2, device="meta")) == "cpu"


@pytest.mark.xla_only
def test_importing_torch_xla_later_rearms_the_fast_path_with_a_probe():
    """A process that dispatched CPU tensors before importing torch_xla: the import bumps the
    dispatch generation, so the next call resolves again and the fast path checks the device."""
    code = (
        "import torch, dualop\n"
        "from dualop import CustomOp, platforms\n"
        "from dualop.custom_op import Serves\n"
        "class Where(CustomOp):\n"
        "    serves = {'forward_cpu': Serves(('torch', 'torch_xla'))}  # PJRT's CPU tensors too\n"
        "    def forward_native(self, x): return 'native'\n"
        "    def forward_cpu(self, x): return 'cpu'\n"
        "    def forward_tpu(self, x): return 'tpu'\n"
        "op = Where()\n"
        "assert op(torch.zeros(2)) == 'cpu' and op._armed.probe is None\n"
        "gen = platforms.dispatch_generation()\n"
        "import torch_xla\n"
        "assert platforms.dispatch_generation() > gen\n"
        "xla = torch.zeros(2).to(torch_xla.device())\n"
        "assert op(torch.zeros(2)) == 'cpu' and op._armed.probe is not None\n"
        "assert op(xla) == 'cpu' and op(torch.zeros(2)) == 'cpu'  # PJRT's CPU device here\n"
        "rows = {(r['frontend'], r['platform']) for r in dualop.dispatch_report()}\n"
        "assert rows == {('torch', 'cpu'), ('torch_xla', 'cpu')}, rows\n"
        "print('ok')\n"
    )
    require_frontend("torch_xla")
    env = {k: v for k, v in os.environ.items() if k != "DUALOP_PLATFORM"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_override_still_decides_for_every_tensor(monkeypatch, no_env_platform):
    """DUALOP_PLATFORM=cuda sends CPU tensors to forward_cuda (how the Triton kernels are tested
    here under the interpreter)."""
    monkeypatch.setenv("DUALOP_PLATFORM", "cuda")
    platforms.invalidate()
    assert _Where()(torch.zeros(2)) == "cuda"
    with override_platform("tpu"):
        assert _Where()(torch.zeros(2)) == "tpu"


def test_platform_plugin_keeps_its_place(monkeypatch, no_env_platform):
    """A platform plugin's answer comes after DUALOP_PLATFORM and before the tensor's device."""
    monkeypatch.setattr(platforms, "_plugin_platform", lambda: "oot")
    platforms.invalidate()
    assert platforms.platform_of(torch.zeros(2)) == "oot"
    with override_platform("cpu"):
        assert platforms.platform_of(torch.zeros(2)) == "cpu"


def test_jax_follows_the_process_platform(monkeypatch, no_env_platform):
    monkeypatch.setitem(platforms._DETECTORS, "jax", lambda: "tpu")
    platforms.invalidate()
    assert platforms.platform_of(jnp.zeros(2)) == "tpu"
    assert platforms.platform_of(torch.zeros(2)) == "cpu"


@pytest.mark.xla_only
def test_xla_tensors_dispatch_apart_from_cpu_tensors(no_env_platform):
    """One op instance, CPU and XLA tensors alternating: each resolves for its own frontend."""
    require_frontend("torch_xla")
    import torch_xla

    op = _Where()
    cpu, xla = torch.zeros(2), torch.zeros(2).to(torch_xla.device())
    assert platforms.frontend_of(xla) == "torch_xla" and platforms.frontend_of(cpu) == "torch"
    with override_platform("tpu"):
        assert [op(t) for t in (cpu, xla, cpu, xla)] == ["tpu"] * 4
    rows = {(r["frontend"], r["platform"]) for r in dispatch_report()}
    assert rows == {("torch", "tpu"), ("torch_xla", "tpu")}


def test_tpu_runtimes_stay_idle_on_a_host_without_tpu():
    """With no TPU attached, dualop (at import) keeps torch_tpu's autoload off where it is installed and
    libtpu from its metadata-server retries; jax is kept on the CPU exactly when libtpu is
    installed (the latest environment), and a variable the caller set is left alone."""
    import importlib.util
    import json

    if platforms.tpu_attached():
        pytest.skip("this host has a TPU: the function leaves everything alone there")
    names = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "TPU_SKIP_MDS_QUERY", "ALLOW_MULTIPLE_LIBTPU_LOAD", "JAX_PLATFORMS")
    code = (
        "import json, os\n"
        "from dualop.platforms import keep_tpu_runtimes_off_without_tpu as f\n"
        "f()\n"
        f"print(json.dumps({{n: os.environ.get(n) for n in {names!r}}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in names}
    got = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    has_libtpu = importlib.util.find_spec("libtpu") is not None
    has_torch_tpu = importlib.util.find_spec("torch_tpu") is not None
    assert got == {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0" if has_torch_tpu else None, "TPU_SKIP_MDS_QUERY": "1",
                   "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "cpu" if has_libtpu else None}
    env["JAX_PLATFORMS"] = "cpu,tpu"
    got = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert got["JAX_PLATFORMS"] == "cpu,tpu"
