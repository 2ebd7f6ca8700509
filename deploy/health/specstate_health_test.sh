#!/usr/bin/env bash
# specstate-health against a real specstated: SERVING while it runs (exit 0),
# a failure for an unknown service and once the server has shut down (exit 1).
# The server also shows that the systemd example config parses and that
# SIGTERM stops it cleanly, as the unit and the pod expect.
set -euo pipefail
server=server/specstated
probe=deploy/health/specstate-health

# Socket paths are limited to 107 bytes; Bazel's temporary directory is deep.
dir=$(mktemp -d /tmp/specstate-health.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
addr="unix://$dir/s.sock"

fail() { echo "FAIL: $*" >&2; exit 1; }

# No server yet: unreachable is a failure, within the deadline.
if "$probe" --addr="$addr" --timeout_ms=500 >"$dir/out" 2>&1; then
  fail "probe succeeded with no server: $(cat "$dir/out")"
fi

# The systemd example config, through specstated's own parser, with a layout
# small enough for a unit test.
"$server" --config=deploy/systemd/specstate.json --backend=cpu --listen="$addr" \
  --layers=1 --heads=4 --head_dim=64 --conv_dim=768 --blocks=9 --max_rows=4 \
  >"$dir/server.log" 2>&1 &
pid=$!
for _ in $(seq 100); do
  [ -S "$dir/s.sock" ] && break
  kill -0 "$pid" 2>/dev/null || fail "specstated exited: $(cat "$dir/server.log")"
  sleep 0.1
done
[ -S "$dir/s.sock" ] || fail "no socket after 10 s: $(cat "$dir/server.log")"

out=$("$probe" --addr="$addr") || fail "probe failed on a serving server: $out"
[ "$out" = SERVING ] || fail "expected SERVING, got '$out'"
out=$("$probe" --addr="$addr" --service=specstate.v1.SpecState) || fail "service check failed: $out"
[ "$out" = SERVING ] || fail "expected SERVING for specstate.v1.SpecState, got '$out'"
if "$probe" --addr="$addr" --service=no.such.Service >"$dir/out" 2>&1; then
  fail "probe succeeded for an unknown service: $(cat "$dir/out")"
fi
grep -q "code 5" "$dir/out" || fail "unknown service: unexpected message: $(cat "$dir/out")"

kill -TERM "$pid"
wait "$pid" || fail "specstated exited with $? on SIGTERM"
pid=
if "$probe" --addr="$addr" --timeout_ms=500 >"$dir/out" 2>&1; then
  fail "probe succeeded after shutdown: $(cat "$dir/out")"
fi
echo "PASS"
