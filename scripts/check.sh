#!/usr/bin/env bash
# The main job: build the environments if missing, then run `dualop check` in each (latest: torch
# and jax cells; xla: adds the torch_xla and torchax cells).
# By default the quick sweep: every op case in every cell this host reaches at its first shape, in
# both dtypes, each cell in one environment (the xla one adds the torch_xla and torchax cells), and
# a tiny model's greedy tokens through the kernel paths against transformers, with which ops ran a
# kernel; the environments run side by side (each one busy thread) and each prints its report when
# it ends. `--full` runs every shape of every case in every cell of both, in turn, with progress
# bars (about an hour on 2 cores); DUALOP_CHECK_SERIAL=1 runs the quick sweep in turn too.
# Other arguments go to `dualop check` (e.g. --ops rms_norm --dtypes float32).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/common.sh
source "$repo/scripts/common.sh"

mode=(--quick)
args=()
chose_frontends=0
for arg in "$@"; do
  if [ "$arg" = --full ]; then mode=(); else args+=("$arg"); fi
  case "$arg" in --frontends|--frontends=*) chose_frontends=1 ;; esac
done
envs="${DUALOP_ENVS:-latest xla}"
start=$SECONDS
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
build_envs "$out" $envs

# One environment's check; its exit status goes to $out/$name.status.
run_env() {
  local name="$1" env rc=0 only=(); shift
  env="$(cat "$out/$name.path")"
  # The quick sweep runs each cell once: in 'xla' only what 'latest' cannot reach (the torch bridges).
  if [ "$name" = xla ] && [ ${#mode[@]} -gt 0 ] && [ "$chose_frontends" = 0 ] && grep -qw latest <<<"$envs"; then
    only=(--frontends torch_xla,torchax)
  fi
  local flags="${mode[*]} ${only[*]}"
  flags="${flags% }"
  echo "== dualop check${flags:+ $flags} in the '$name' environment ($(env_versions "$env"))"
  "$env/bin/dualop" check "${mode[@]}" "${only[@]}" "$@" || rc=$?
  echo "$rc" >"$out/$name.status"
}

if [ ${#mode[@]} -gt 0 ] && [ "$(wc -w <<<"$envs")" -gt 1 ] && [ -z "${DUALOP_CHECK_SERIAL:-}" ]; then
  echo "== the quick sweep in each environment ($envs), side by side; each report follows when it ends"
  pids=()
  for name in $envs; do
    run_env "$name" --no-progress "${args[@]}" >"$out/$name.log" 2>&1 &
    pids+=("$!")
  done
  remaining=($envs)
  while [ ${#remaining[@]} -gt 0 ]; do
    sleep 2
    still=()
    for name in "${remaining[@]}"; do
      if [ -f "$out/$name.status" ]; then
        cat "$out/$name.log"
        echo "== '$name' done after $((SECONDS - start)) s"
      else
        still+=("$name")
      fi
    done
    remaining=("${still[@]+"${still[@]}"}")
  done
  for pid in "${pids[@]}"; do wait "$pid" || true; done
else
  for name in $envs; do run_env "$name" "${args[@]}"; done
fi

status=0
for name in $envs; do
  [ "$(cat "$out/$name.status" 2>/dev/null || echo 1)" = 0 ] || status=1
done
if [ ${#mode[@]} -gt 0 ]; then
  echo "== quick sweep done in $((SECONDS - start)) s (exit $status); every shape of every case: bash scripts/check.sh --full"
fi
exit $status
