#!/usr/bin/env bash
# Proves that tools/test.sh never reports a green count over a failure: in a
# temporary copy of the build set-up, a small test package goes through
# scenarios (passing and skipped cases, a failing case, a test that crashes,
# a test that no longer compiles, a test target removed after it ran) and the
# script's closing line and exit status are checked for each. Ends with
# "N passed, N failed" (one case per scenario).
#   tools/ci_selftest.sh
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ci-selftest.XXXXXX)
trap 'cd /; (cd "$work" && bazel shutdown >/dev/null 2>&1); rm -rf "$work"' EXIT
cd "$repo"
# The build set-up, and the scripts under test; no sources of the project.
cp -r WORKSPACE .bazelrc BUILD bazel third_party "$work/"
mkdir -p "$work/tools" "$work/selftest"
cp tools/test.sh tools/count_tests.py tools/install_deps.sh tools/BUILD tools/lsan.supp "$work/tools/"
cd "$work"

passed=0
failed=0
# scenario NAME EXPECTED_LINE EXPECTED_EXIT(0|nonzero)
scenario() {
  local name=$1 want_line=$2 want_exit=$3
  local out rc line
  out=$(SPECSTATE_TEST_TARGETS=//selftest/... tools/test.sh --fast 2>&1)
  rc=$?
  line=$(echo "$out" | tail -n 1)
  local exit_ok=0
  if [ "$want_exit" = 0 ]; then [ "$rc" -eq 0 ] && exit_ok=1; else [ "$rc" -ne 0 ] && exit_ok=1; fi
  if [ "$line" = "$want_line" ] && [ "$exit_ok" -eq 1 ]; then
    echo "ok: $name: \"$line\", exit $rc"
    passed=$((passed + 1))
  else
    echo "FAILED: $name: \"$line\", exit $rc; expected \"$want_line\", exit $want_exit"
    echo "$out" | tail -n 30 | sed 's/^/    /'
    failed=$((failed + 1))
  fi
}

gtest_target() {  # NAME: a cc_test of selftest/NAME.cc
  cat >> selftest/BUILD <<EOF
cc_test(
    name = "$1",
    srcs = ["$1.cc"],
    deps = ["@system_libs//:gtest", "@system_libs//:gtest_main"],
)
EOF
}

cat > selftest/good_test.cc <<'EOF'
#include "gtest/gtest.h"
TEST(Good, One) { EXPECT_EQ(1 + 1, 2); }
TEST(Good, Two) { EXPECT_TRUE(true); }
TEST(Good, NeedsAGpu) { GTEST_SKIP() << "no GPU here"; }
EOF
: > selftest/BUILD
gtest_target good_test
scenario "passing and skipped cases" "2 passed, 0 failed, 1 skipped" 0

cat > selftest/failing_test.cc <<'EOF'
#include "gtest/gtest.h"
TEST(Failing, Fails) { EXPECT_EQ(1 + 1, 3); }
EOF
gtest_target failing_test
scenario "a failing case" "2 passed, 1 failed, 1 skipped" nonzero

cat > selftest/failing_test.cc <<'EOF'
#include <cstdlib>
#include "gtest/gtest.h"
TEST(Crashing, Aborts) { std::abort(); }
EOF
scenario "a test that crashes" "2 passed, 1 failed, 1 skipped" nonzero

# good_test no longer compiles: its test.xml from the runs above is still in
# bazel-testlogs and must not be counted.
echo 'TEST(Good, One) { this does not compile }' >> selftest/good_test.cc
: > selftest/BUILD
gtest_target good_test
scenario "a test that does not compile (its old results stay on disk)" "0 passed, 1 failed" nonzero

# good_test is gone: only what this run ran counts.
cat > selftest/other_test.cc <<'EOF'
#include "gtest/gtest.h"
TEST(Other, Passes) { EXPECT_EQ(2 * 2, 4); }
EOF
: > selftest/BUILD
gtest_target other_test
scenario "a removed target's results are not counted" "1 passed, 0 failed" 0

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
