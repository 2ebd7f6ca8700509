#!/usr/bin/env bash
# Where the product code looks at the commit mode outside the mode folders
# (issue 33: at most one dispatch per verb). Prints each site and a count:
#   tools/count_mode_checks.sh          # outside the mode folders
#   tools/count_mode_checks.sh --all    # everywhere, the mode folders too
# A "look" is a test of the mode's value or of something only one mode sets:
# IsFast/IsDeferred, a comparison with (or case of) a v1 or kernels commit
# mode, a switch on a mode, a null test of FAST's rings, DEFERRED's pending
# table or a mode's checker, an if on a fast/deferred flag. (A switch is one
# dispatch, however many cases it has.) Tests, comments and the mode folders
# (server/modes, kernels/eager, kernels/deferred, kernels/fast, the
# simulator's per-mode checkers) are not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
pattern='IsFast\(|IsDeferred\(|[!=]= *v1::(EAGER|DEFERRED|FAST)\b|case v1::(EAGER|DEFERRED|FAST)\b|[!=]= *(kernels::)?CommitMode::k|switch \([^)]*\bmode\b[^)]*\)|fast\.cursors *[!=]=|pending\.entries *[!=]=|\b(deferred|fast)_? *[!=]= *nullptr|if \(([a-z_]+\.)?(fast|deferred)\)'
mode_folders='^(server/modes/|kernels/eager/|kernels/deferred/|kernels/fast/|client/simulator/(deferred|fast)_checker)'
git ls-files 'server/*' 'kernels/*' 'client/*' 'keeper/*' \
  | grep -E '\.(cc|h|cu|cuh)$' | grep -vE '_test\.(cc|h)$|/testing/|_for_test\.h$' \
  | { if [ "${1:-}" = --all ]; then cat; else grep -vE "$mode_folders"; fi; } \
  | xargs grep -nE "$pattern" \
  | grep -vE '^[^:]+:[0-9]+: *//' > /tmp/mode_checks.$$ || true
cat /tmp/mode_checks.$$
echo "$(wc -l < /tmp/mode_checks.$$) looks at the commit mode in $(cut -d: -f1 /tmp/mode_checks.$$ | sort -u | wc -l) files"
rm -f /tmp/mode_checks.$$
