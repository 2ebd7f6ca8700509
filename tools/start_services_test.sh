#!/usr/bin/env bash
# tools/start_services.sh with two CPU-backend ranks of a 4-head model: both
# come up (pid, log, socket per rank), `specstatectl simulate --servers=...`
# passes on them, SIGTERM stops both and the script exits 0; a rank that dies
# takes the group down (exit 1); bad usage exits 2.
set -euo pipefail
script=tools/start_services.sh
export SPECSTATED=$PWD/server/specstated
ctl=client/cli/specstatectl

# Socket paths are limited to 107 bytes; Bazel's temporary directory is deep.
dir=$(mktemp -d /tmp/specstate-tp.XXXXXX)
group=
cleanup() {
  [ -n "$group" ] && kill "$group" 2>/dev/null || true
  for f in "$dir"/run/*.pid; do [ -f "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
  rm -rf "$dir"
}
trap cleanup EXIT
export SPECSTATE_RUN_DIR=$dir/run
fail() { echo "FAIL: $*" >&2; [ -f "$dir/err" ] && cat "$dir/err" >&2; exit 1; }

# The servers= line, once the group is up.
wait_ready() {
  for _ in $(seq 300); do
    grep -q '^servers=' "$dir/out" 2>/dev/null && return 0
    kill -0 "$group" 2>/dev/null || fail "start_services.sh exited early"
    sleep 0.1
  done
  fail "start_services.sh printed no servers= line within 30 s"
}

# Bad usage.
for args in "" "0" "x" "2 --device=1" "2 --listen=unix:///tmp/x.sock"; do
  # shellcheck disable=SC2086
  if "$script" $args >/dev/null 2>"$dir/err"; then fail "accepted '$args'"; else rc=$?; fi
  [ "$rc" = 2 ] || fail "'$args' exited $rc, not 2"
done

# Two ranks, then SIGTERM.
"$script" 2 --backend=cpu --heads=2 --conv_dim=384 --layers=2 >"$dir/out" 2>"$dir/err" &
group=$!
wait_ready
servers=$(sed -n 's/^servers=//p' "$dir/out")
[ "$servers" = "unix://$dir/run/specstate-0.sock,unix://$dir/run/specstate-1.sock" ] ||
  fail "servers=$servers"
pids=()
for r in 0 1; do
  [ -S "$dir/run/specstate-$r.sock" ] || fail "no socket for rank $r"
  [ -s "$dir/run/specstate-$r.log" ] || fail "no log for rank $r"
  pid=$(cat "$dir/run/specstate-$r.pid") || fail "no pid file for rank $r"
  kill -0 "$pid" || fail "rank $r (pid $pid) is not running"
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--device=$r --listen=unix://$dir/run/specstate-$r.sock --backend=cpu" ||
    fail "rank $r's flags: $(tr '\0' ' ' <"/proc/$pid/cmdline")"
  pids+=("$pid")
done
# A second group in the same directory is refused.
if "$script" 2 --backend=cpu >/dev/null 2>"$dir/err2"; then fail "a second group started"; fi
grep -q "rank 0 already runs" "$dir/err2" || fail "second group: $(cat "$dir/err2")"

"$ctl" --servers="$servers" simulate --steps=4 --requests=2 >"$dir/sim" 2>&1 ||
  fail "simulate: $(cat "$dir/sim")"
grep -q "verdict: PASS: .* of the 2 ranks bit-identical" "$dir/sim" || fail "$(cat "$dir/sim")"

kill -TERM "$group"
rc=0
wait "$group" || rc=$?
group=
[ "$rc" = 0 ] || fail "start_services.sh exited $rc after SIGTERM"
for pid in "${pids[@]}"; do
  if kill -0 "$pid" 2>/dev/null; then fail "pid $pid still runs after the stop"; fi
done
for r in 0 1; do
  [ ! -e "$dir/run/specstate-$r.pid" ] || fail "pid file of rank $r left behind"
  [ ! -e "$dir/run/specstate-$r.sock" ] || fail "socket of rank $r left behind"
done

# A rank that dies takes the others down. (The first group's out file goes
# first: the background start truncates it only when it runs, and
# wait_ready must not read the old servers= line.)
rm -f "$dir/out"
"$script" 2 --backend=cpu --heads=2 --conv_dim=384 --layers=2 >"$dir/out" 2>"$dir/err" &
group=$!
wait_ready
one=$(cat "$dir/run/specstate-1.pid")
zero=$(cat "$dir/run/specstate-0.pid")
kill -KILL "$one"
rc=0
wait "$group" || rc=$?
group=
[ "$rc" = 1 ] || fail "start_services.sh exited $rc when rank 1 died, not 1"
grep -q "rank 1 (pid $one) exited" "$dir/err" || fail "no word of rank 1: $(cat "$dir/err")"
if kill -0 "$zero" 2>/dev/null; then fail "rank 0 still runs after rank 1 died"; fi

# A rank that cannot start (an invalid layout) is reported with its log.
rc=0
"$script" 1 --backend=cpu --head_dim=100 >"$dir/out" 2>"$dir/err" || rc=$?
[ "$rc" = 1 ] || fail "an invalid layout exited $rc, not 1"
grep -q "rank 0 (device 0) exited while starting" "$dir/err" || fail "$(cat "$dir/err")"
grep -q "head_dim" "$dir/err" || fail "the log's reason: $(cat "$dir/err")"
echo PASS
