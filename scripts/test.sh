#!/usr/bin/env bash
# The whole test suite, in both environments (built here when missing). Extra arguments go to pytest.
# Without extra arguments it then runs `dualop compile --targets v5e,v6e,sm90,gfx942` in the latest
# environment (the real TPU and GPU compilers on every kernel variant; counted as one item).
# Ends with one line "total: N passed, N failed, N skipped" over all of it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/common.sh
source "$repo/scripts/common.sh"

results="$(mktemp -d)"
trap 'rm -rf "$results"' EXIT
status=0
for name in ${DUALOP_ENVS:-latest xla}; do
  env="$(bash "$repo/scripts/env.sh" "$name")"
  echo "== tests in the '$name' environment ($(env_versions "$env"))"
  (cd "$repo" && DUALOP_TEST_ENV="$name" "$env/bin/python" -m pytest -p no:cacheprovider \
      --junitxml="$results/$name.xml" "$@") || status=$?
done
compile_result=""
case " ${DUALOP_ENVS:-latest xla} " in
  *" latest "*)
    if [ $# -eq 0 ]; then
      env="$(bash "$repo/scripts/env.sh" latest)"
      echo "== dualop compile in the 'latest' environment (XLA:TPU/Mosaic and Triton; nothing runs)"
      start=$SECONDS
      if "$env/bin/dualop" compile --targets v5e,v6e,sm90,gfx942 --no-progress; then
        compile_result=passed
      else
        compile_result=failed
        status=1
      fi
      echo "dualop compile: $compile_result in $((SECONDS - start))s"
    fi
    ;;
esac
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
