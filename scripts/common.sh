# Shared by scripts/check.sh and scripts/test.sh (sourced).
# No accelerator here: torch_xla uses its CPU client, and Triton its interpreter, unless the caller says otherwise.
if ! ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then
  export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
fi
if ! command -v nvidia-smi >/dev/null 2>&1 && ! command -v rocm-smi >/dev/null 2>&1; then
  export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# On a host with no TPU, torch_tpu, libtpu and jax are kept from looking for one by dualop itself
# when it is imported (dualop.platforms.keep_tpu_runtimes_off_without_tpu).

env_versions() {
  "$1/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md
out = []
for pkg in ("torch", "torch_xla", "jax", "triton", "torchax", "flax"):
    try:
        out.append(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        pass
print(", ".join(out))
PY
}
