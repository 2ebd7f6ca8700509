#!/usr/bin/env bash
# Runs every test that needs no GPU: the default build, then again under
# AddressSanitizer + UndefinedBehaviorSanitizer, then the checks that run
# outside Bazel (the CI self-test of this script's counting, the fuzz targets'
# short runs, the soak test). Installs what it needs.
# Ends with one line "N passed, N failed" (", N skipped" when GPU cases were
# skipped), counted from this run's results only, and exits non-zero when
# anything failed or did not build.
#   tools/test.sh            # all of it
#   tools/test.sh --fast     # the default build's tests only, built without
#                            # CUDA (SPECSTATE_CUDA=0: no nvcc, a few minutes
#                            # cold); the full run compiles the CUDA code too
# SPECSTATE_TEST_TARGETS (default //...) picks the targets (the self-test uses it).
# GPU suites: bazel test --config=gpu //...   (see docs/gpu.md)
set -uo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh --tests || { echo "0 passed, 1 failed"; exit 1; }

targets=${SPECSTATE_TEST_TARGETS:-//...}
passed=0
failed=0
skipped=0

# bazel test with a build event file: the cases of this run's test.xml
# files, and a failure for every target that did not build or run. A Bazel
# failure that no count explains is one failure more.
run() {
  local name=$1; shift
  local events
  events=$(mktemp)
  echo "== bazel test $* $targets ($name)"
  bazel test "$@" --build_event_json_file="$events" $targets 2>&1 | tail -n 25
  local rc=${PIPESTATUS[0]}
  local result
  result=$(/usr/bin/python3 tools/count_tests.py "$events") || result="0 1 0"
  rm -f "$events"
  read -r p f s <<< "$result"
  # 4: no test targets matched; anything else non-zero is a failure.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 4 ] && [ "$f" -eq 0 ]; then
    echo "bazel test ($name) exited $rc with no failed test counted: counting it as a failure"
    f=1
  fi
  echo "-- $name: $p passed, $f failed, $s skipped"
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + s))
}

# A script that ends with its own "N passed, N failed" line.
run_script() {
  local name=$1; shift
  echo "== $name"
  local out
  out=$(mktemp)
  "$@" 2>&1 | tee "$out" | tail -n 15
  local rc=${PIPESTATUS[0]}
  local line
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
  rm -f "$out"
  local p=0 f=0
  if [ -n "$line" ]; then
    p=$(echo "$line" | awk '{print $1}')
    f=$(echo "$line" | awk '{print $3}')
  fi
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
  echo "-- $name: $p passed, $f failed"
  passed=$((passed + p))
  failed=$((failed + f))
}

if [ "${1:-}" = "--fast" ] && [ -z "${SPECSTATE_TEST_TARGETS:-}" ]; then
  # The CUDA kernels take most of a cold build and no test here runs them
  # (the GPU cases need a GPU): the quick tier builds the CPU backend only.
  # (The CI self-test's own --fast runs keep the build as it is.)
  run default --repo_env=SPECSTATE_CUDA=0
else
  run default
fi
if [ "${1:-}" != "--fast" ]; then
  run asan --config=asan
  if [ -z "${SPECSTATE_TEST_TARGETS:-}" ]; then
    run_script "CI self-test" tools/ci_selftest.sh
    run_script "fuzz (short runs)" tools/fuzz/run.sh --seconds="${SPECSTATE_FUZZ_SECONDS:-60}"
    run_script "soak" tools/soak.sh --seconds="${SPECSTATE_SOAK_SECONDS:-60}"
  fi
fi
line="$passed passed, $failed failed"
[ "$skipped" -gt 0 ] && line="$line, $skipped skipped"
echo "$line"
[ "$failed" -eq 0 ]
