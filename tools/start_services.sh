#!/usr/bin/env bash
# Starts one specstated per device for tensor parallelism: rank r on device r,
# listening on DIR/specstate-r.sock, its pid in DIR/specstate-r.pid and its
# output in DIR/specstate-r.log. Every rank gets the same flags (a rank's part
# of the model: H/TP heads, HV/TP value heads, D/TP conv channels). Runs in
# the foreground until SIGINT/SIGTERM/SIGHUP, then stops every rank (SIGTERM,
# SIGKILL after 20 s) and exits 0; if a rank exits on its own, stops the
# others and exits 1 (a tensor-parallel group is of use only whole).
#
#   tools/start_services.sh 2 --backend=cuda --config=/etc/specstate/specstate-tp.json
#   tools/start_services.sh 2 --backend=cpu --heads=2 --conv_dim=384     # for tests
#
# Once every rank listens on its socket it prints one line
#   servers=unix://DIR/specstate-0.sock,unix://DIR/specstate-1.sock
# to stdout, for `specstatectl simulate --servers=...` or a scheduler.
#
# Environment: SPECSTATED, the binary (default: bazel-bin/server/specstated of
# this checkout, else specstated on the PATH); SPECSTATE_RUN_DIR, the
# directory (default /tmp/specstate-tp-$UID; made 0700: the sockets are
# owner-only anyway); SPECSTATE_START_TIMEOUT, seconds to wait for the ranks
# to come up (default 120: a large layout takes a while to allocate).
# Exit status: 0 after a requested stop, 1 on a failure, 2 on bad usage.
set -uo pipefail

usage() {
  sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
[ $# -ge 1 ] || usage
ranks=$1
shift
case "$ranks" in
  '' | *[!0-9]* | 0) echo "start_services.sh: the number of ranks must be a positive integer, got '$ranks'" >&2; exit 2 ;;
esac
for flag in "$@"; do
  case "$flag" in
    --device=* | --device | --listen=* | --listen)
      echo "start_services.sh: $flag: the script sets --device and --listen per rank" >&2
      exit 2 ;;
  esac
done

here=$(cd "$(dirname "$0")/.." && pwd)
bin=${SPECSTATED:-}
if [ -z "$bin" ]; then
  if [ -x "$here/bazel-bin/server/specstated" ]; then
    bin=$here/bazel-bin/server/specstated
  else
    bin=$(command -v specstated || true)
  fi
fi
[ -n "$bin" ] && [ -x "$bin" ] ||
  { echo "start_services.sh: no specstated: build //server:specstated or set SPECSTATED" >&2; exit 1; }
dir=${SPECSTATE_RUN_DIR:-/tmp/specstate-tp-$(id -u)}
timeout=${SPECSTATE_START_TIMEOUT:-120}
mkdir -p "$dir" && chmod 0700 "$dir" || exit 1

# Another group in this directory?
for ((r = 0; r < ranks; r++)); do
  if [ -f "$dir/specstate-$r.pid" ] && kill -0 "$(cat "$dir/specstate-$r.pid")" 2>/dev/null; then
    echo "start_services.sh: rank $r already runs (pid $(cat "$dir/specstate-$r.pid"), $dir)" >&2
    exit 1
  fi
done

pids=()
stop_all() {
  local r pid
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for ((i = 0; i < 200; i++)); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
  for ((r = 0; r < ${#pids[@]}; r++)); do rm -f "$dir/specstate-$r.pid"; done
}
stopping=0
on_signal() {
  stopping=1
  echo "start_services.sh: stopping $ranks ranks" >&2
  stop_all
  exit 0
}
trap on_signal INT TERM HUP

# A socket left by a killed run is replaced by specstated (it removes a stale
# socket no server answers on): wait for sockets newer than this mark.
touch "$dir/.started"
servers=
for ((r = 0; r < ranks; r++)); do
  sock=$dir/specstate-$r.sock
  "$bin" --device="$r" --listen="unix://$sock" "$@" >"$dir/specstate-$r.log" 2>&1 </dev/null &
  pids+=($!)
  echo "${pids[$r]}" >"$dir/specstate-$r.pid"
  servers=${servers:+$servers,}unix://$sock
done

# Up when every rank's socket exists (specstated binds it once its pools are
# allocated, then serves).
deadline=$((SECONDS + timeout))
for ((r = 0; r < ranks; r++)); do
  until [ -S "$dir/specstate-$r.sock" ] && [ "$dir/specstate-$r.sock" -nt "$dir/.started" ]; do
    if ! kill -0 "${pids[$r]}" 2>/dev/null; then
      echo "start_services.sh: rank $r (device $r) exited while starting; its log:" >&2
      tail -n 20 "$dir/specstate-$r.log" >&2
      stop_all
      exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      echo "start_services.sh: rank $r did not come up within $timeout s ($dir/specstate-$r.log)" >&2
      stop_all
      exit 1
    fi
    sleep 0.1
  done
done
for ((r = 0; r < ranks; r++)); do
  echo "start_services.sh: rank $r: device $r, unix://$dir/specstate-$r.sock, pid ${pids[$r]}, log $dir/specstate-$r.log" >&2
done
echo "servers=$servers"

# Until a signal, or until a rank exits on its own.
while :; do
  wait -n "${pids[@]}"
  status=$?
  [ $stopping = 1 ] && exit 0
  for ((r = 0; r < ranks; r++)); do
    if ! kill -0 "${pids[$r]}" 2>/dev/null; then
      echo "start_services.sh: rank $r (pid ${pids[$r]}) exited with status $status; stopping the others; its log:" >&2
      tail -n 20 "$dir/specstate-$r.log" >&2
      stop_all
      exit 1
    fi
  done
done
