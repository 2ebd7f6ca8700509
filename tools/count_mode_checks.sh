#!/usr/bin/env bash
# Where the product code looks at the commit mode outside the mode folders
# (issue 33: at most one dispatch per verb). Prints each site and a count:
#   tools/count_mode_checks.sh          # outside the mode folders
#   tools/count_mode_checks.sh --all    # everywhere, the mode folders too
# A "look" is a test of the mode's value or of something only one mode sets:
# IsFast/IsDeferred, a v1::EAGER/DEFERRED/FAST or kernels CommitMode value, a
# comparison of commit_mode(), a null test of FAST's rings or DEFERRED's
# pending table, a `bool fast` flag. Tests, comments and the mode folders
# (server/modes, kernels/eager, kernels/deferred, kernels/fast, the
# simulator's per-mode checkers) are not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern='IsFast\(|IsDeferred\(|v1::(EAGER|DEFERRED|FAST)\b|CommitMode::k[A-Z]|commit_mode\(\) *[!=]=|fast\.cursors *[!=]=|pending\.entries *[!=]=|\bbool fast\b|args\.fast\b|\b(fast|deferred)_? *[!=]= *nullptr'
mode_folders='^(server/modes/|kernels/eager/|kernels/deferred/|kernels/fast/|client/simulator/(deferred|fast)_checker)'
git ls-files 'server/*' 'kernels/*' 'client/*' 'keeper/*' \
  | grep -E '\.(cc|h|cu|cuh)$' | grep -vE '_test\.(cc|h)$|/testing/|_for_test\.h$' \
  | { if [ "${1:-}" = --all ]; then cat; else grep -vE "$mode_folders"; fi; } \
  | xargs grep -nE "$pattern" \
  | grep -vE '^[^:]+:[0-9]+: *//' > /tmp/mode_checks.$$ || true
cat /tmp/mode_checks.$$
echo "$(wc -l < /tmp/mode_checks.$$) looks at the commit mode in $(cut -d: -f1 /tmp/mode_checks.$$ | sort -u | wc -l) files"
rm -f /tmp/mode_checks.$$
