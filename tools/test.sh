#!/usr/bin/env bash
# Runs every test that needs no GPU: the default build, then again under
# AddressSanitizer + UndefinedBehaviorSanitizer. Installs what it needs.
# Ends with one line "N passed, N failed" counted from the test results.
#   tools/test.sh            # both
#   tools/test.sh --fast     # the default build only
# GPU suites: bazel test --config=gpu //...   (see docs/gpu.md)
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh || { echo "0 passed, 1 failed"; exit 1; }

passed=0
failed=0
# Counts test cases from the JUnit XML Bazel leaves for each test target; a
# target without cases (it could not run) counts as one failure.
count() {
  local logs=$1
  local result
  result=$(/usr/bin/python3 tools/count_tests.py "$logs") || result="0 1"
  passed=$((passed + ${result% *}))
  failed=$((failed + ${result#* }))
}

run() {
  local name=$1; shift
  echo "== bazel test $* //... ($name)"
  bazel test "$@" //... 2>&1 | tail -n 25
  count "$(bazel info "$@" bazel-testlogs 2>/dev/null)"
}

run default
if [ "${1:-}" != "--fast" ]; then
  run asan --config=asan
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
