#!/usr/bin/env bash
# The first five minutes: builds SpecState, starts the service (CPU backend
# unless a GPU is present) with a small layout, and drives it with the
# scheduler simulator, which checks every committed state bit for bit against
# its own stock spec path. Installs what it needs.
#   tools/quickstart.sh [simulate flags, e.g. --steps=100 --async]
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
echo "building (the first build takes a few minutes)..."
bazel build //server:specstated //client/cli:specstatectl 2>&1 | tail -n 2
dir=$(mktemp -d /tmp/specstate-XXXXXX)
address="unix://$dir/specstate.sock"
bazel-bin/server/specstated --listen="$address" > "$dir/specstated.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -S "$dir/specstate.sock" ] && break; sleep 0.1; done
grep -h "serving on" "$dir/specstated.log" || { cat "$dir/specstated.log"; exit 1; }
ctl() { bazel-bin/client/cli/specstatectl --server="$address" "$@"; }
echo; echo "$ specstatectl health"; ctl health
echo; echo "$ specstatectl layout"; ctl layout
echo; echo "$ specstatectl simulate --steps=50 --requests=8 $*"
ctl simulate --steps=50 --requests=8 "$@"
echo; echo "$ specstatectl stats"; ctl stats
