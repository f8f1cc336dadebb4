#!/usr/bin/env bash
# The main job: build the environments if missing, then run `dualop check` in each
# (latest: torch and jax cells; xla: adds the torch_xla and torchax cells).
# Extra arguments go to `dualop check` (e.g. --ops rms_norm --dtypes float32).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/common.sh
source "$repo/scripts/common.sh"

status=0
for name in ${DUALOP_ENVS:-latest xla}; do
  env="$(bash "$repo/scripts/env.sh" "$name")"
  echo "== dualop check in the '$name' environment ($(env_versions "$env"))"
  "$env/bin/dualop" check "$@" || status=1
done
exit $status
