#!/usr/bin/env bash
# The whole test suite, in its three environments (built here when missing): the suite split between
# 'latest' and 'xla', and dualop inside vLLM in 'vllm'; side by side unless DUALOP_TEST_SERIAL is set. Extra arguments go to pytest. Without extra arguments the latest
# environment also runs `dualop compile --targets v5e,v6e,sm90,gfx942 --serving-dtypes bfloat16 --serving-targets v5e,sm90,gfx942`
# (the real TPU and GPU compilers on every kernel variant at its check shapes in float32 and bfloat16 for
# every target, and at serving shapes in bfloat16, the serving dtype, on v5e, the TPU generation with
# the smaller scoped VMEM, and both GPUs; counted as one item), as a stream beside the test
# runs (it needs no test's result, and the 2-core CI host then stays busy until the end).
# Ends with one line "total: N passed, N failed, N skipped" over all of it. With DUALOP_TEST_RESULTS
# set to a directory, each environment's JUnit report (every test's time) is kept there.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/common.sh
source "$repo/scripts/common.sh"

results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
envs="${DUALOP_ENVS:-latest xla vllm}"
build_envs "$results" $envs

# One environment's pytest; writes its exit status to $results/$name.status.
run_env() {
  local name="$1" env rc=0; shift
  env="$(cat "$results/$name.path")"
  echo "== tests in the '$name' environment ($(env_versions "$env"))"
  (cd "$repo" && DUALOP_TEST_ENV="$name" "$env/bin/python" -m pytest -p no:cacheprovider \
      --junitxml="$results/$name.xml" "$@") || rc=$?
  echo "$rc" >"$results/$name.status"
}

# dualop compile in the latest environment; writes passed/failed to $results/compile.
run_compile() {
  local env start=$SECONDS result=passed
  env="$(cat "$results/latest.path")"
  echo "== dualop compile in the 'latest' environment (XLA:TPU/Mosaic and Triton; nothing runs)"
  (cd "$repo" && "$env/bin/dualop" compile --targets v5e,v6e,sm90,gfx942 --serving-dtypes bfloat16 \
      --serving-targets v5e,sm90,gfx942 --no-progress) || result=failed
  echo "dualop compile: $result in $((SECONDS - start))s"
  echo "$result" >"$results/compile"
}
compile_too=0
if [ $# -eq 0 ] && grep -qw latest <<<"$envs"; then compile_too=1; fi

status=0
if [ "$(wc -w <<<"$envs")" -gt 1 ] && [ -z "${DUALOP_TEST_SERIAL:-}" ]; then
  # The environments (and dualop compile) run side by side: each is mostly one busy Python
  # thread, so a 2-core machine stays busy until the last one ends. Their output streams live,
  # each line prefixed with its stream's name.
  echo "== the environments ($envs) run side by side; DUALOP_TEST_SERIAL=1 runs them in turn"
  pids=()
  for name in $envs; do
    run_env "$name" "$@" 2>&1 | sed -u "s/^/[$name] /" &
    pids+=("$!")
  done
  if [ "$compile_too" = 1 ]; then
    run_compile 2>&1 | sed -u "s/^/[compile] /" &
    pids+=("$!")
  fi
  for pid in "${pids[@]}"; do wait "$pid" || true; done
else
  for name in $envs; do run_env "$name" "$@"; done
  if [ "$compile_too" = 1 ]; then run_compile; fi
fi
for name in $envs; do
  [ "$(cat "$results/$name.status" 2>/dev/null || echo 1)" = 0 ] || status=1
done
if [ -n "${DUALOP_TEST_RESULTS:-}" ]; then
  mkdir -p "$DUALOP_TEST_RESULTS" && cp "$results"/*.xml "$DUALOP_TEST_RESULTS"/ 2>/dev/null || true
fi
compile_result="$(cat "$results/compile" 2>/dev/null || true)"
if [ "$compile_too" = 1 ] && [ "$compile_result" != passed ]; then status=1; fi
python3 - "$results" "$compile_result" <<'PY'
import sys, glob, xml.etree.ElementTree as ET
passed = int(sys.argv[2] == "passed")
failed = int(sys.argv[2] == "failed")
skipped = 0
for path in glob.glob(sys.argv[1] + "/*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skip = int(suite.get("skipped", 0))
        passed += tests - fail - skip
        failed += fail
        skipped += skip
print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
PY
exit $status
