#!/usr/bin/env bash
# The whole test suite, in both environments (built here when missing). Extra arguments go to pytest.
# Ends with one line "total: N passed, N failed, N skipped" over both runs.
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
python3 - "$results" <<'PY'
import sys, glob, xml.etree.ElementTree as ET
passed = failed = skipped = 0
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
