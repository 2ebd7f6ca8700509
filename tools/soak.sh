#!/usr/bin/env bash
# Soak test: several client processes drive and read one specstated (CPU
# backend) over a real socket for a while, some killed and restarted as they
# go (tests/soak/soak.cc says what each role does); then every passed run is
# replayed in order on a fresh server, whose pools must equal the first's
# byte for byte. Ends with "N passed, N failed" (one per check).
#   tools/soak.sh [--seconds=60]
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=60
for arg in "$@"; do
  case "$arg" in
    --seconds=*) seconds=${arg#--seconds=} ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
bazel build //server:specstated //tests/soak:soak >/dev/null 2>&1 ||
  { echo "soak: the build failed"; echo "0 passed, 1 failed"; exit 1; }
bin=$(bazel info bazel-bin 2>/dev/null)
work=$(mktemp -d /tmp/soak.XXXXXX)
pids=()
trap 'kill -9 "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
layout=(--backend=cpu --layers=3 --heads=2 --head_dim=64 --blocks=96 --max_rows=6
        --cache_mode=align --mamba_block_size=8 --default_lease_ms=2000)
passed=0
failed=0
check() {  # NAME CONDITION...
  local name=$1; shift
  if "$@"; then echo "ok: $name"; passed=$((passed + 1)); else echo "FAILED: $name"; failed=$((failed + 1)); fi
}

serve() {  # DIR: starts specstated listening in DIR; sets server_pid
  "$bin/server/specstated" "${layout[@]}" --listen="unix://$1/s.sock" > "$1/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 100); do [ -S "$1/s.sock" ] && return 0; sleep 0.1; done
  return 1
}

mkdir -p "$work/a" "$work/b"
serve "$work/a" || { cat "$work/a/server.log"; echo "0 passed, 1 failed"; exit 1; }
first=$server_pid
pids+=("$first")
addr="unix://$work/a/s.sock"
soak() { "$bin/tests/soak/soak" --server="$addr" --stop="$work/stop" "$@"; }

# role NAME ARGS...: keeps one such process alive until the stop file exists,
# and ends with one that ran to the stop file (every process does at least
# one round and then prints "ROLE: N rounds"; a process killed just before
# the stop file appeared is followed by one more).
roles=()
role() {
  local name=$1; shift
  (
    while :; do
      soak "$@" --seed=$((RANDOM * 32768 + RANDOM)) >> "$work/$name.log" 2>&1
      rc=$?
      # 137: we killed it (readers and hostile clients only); 0: a driver's
      # turn ended abruptly on purpose, or the stop file.
      if [ $rc -ne 0 ] && [ $rc -ne 137 ]; then echo "$name exited $rc" >> "$work/failures"; fi
      if [ -e "$work/stop" ] && [ $rc -ne 137 ]; then break; fi
    done
  ) &
  roles+=($!)
  pids+=($!)
}
role driver1 --role=driver --log="$work/runs" --lock="$work/lock"
role driver2 --role=driver --log="$work/runs" --lock="$work/lock"
role contender --role=contender
role reader1 --role=reader
role reader2 --role=reader
role hostile --role=hostile

end=$((SECONDS + seconds))
while [ $SECONDS -lt $end ]; do
  sleep 3
  # SIGKILL a reader or a hostile client mid-call; its loop starts another.
  victim=$(pgrep -f -- "--role=(reader|hostile)" | shuf -n 1)
  [ -n "$victim" ] && kill -9 "$victim" 2>/dev/null
done
touch "$work/stop"
for p in "${roles[@]}"; do wait "$p"; done

check "the service survived every client" kill -0 "$first"
runs=$(wc -l < "$work/runs" 2>/dev/null || echo 0)
echo "soak: $runs runs passed their bit-for-bit checks; $(grep -h 'rounds' "$work"/*.log | tr '\n' ';')"
check "the drivers ran (at least 5 runs)" [ "$runs" -ge 5 ]
check "every client got the answers its role expects" [ ! -s "$work/failures" ]
# Every participant works: each of its processes that ended (not killed)
# printed "ROLE: N rounds" with N >= 1, and at least one did.
did_work() {  # LOG
  local counts
  counts=$(grep -hoE '^[a-z]+: [0-9]+ rounds' "$1" 2>/dev/null | awk '{print $2}')
  [ -n "$counts" ] && ! echo "$counts" | grep -qx 0
}
for name in driver1 driver2 contender reader1 reader2 hostile; do
  check "$name did work in every process that ended ($(grep -hoE '^[a-z]+: [0-9]+ rounds' \
    "$work/$name.log" 2>/dev/null | awk '{print $2}' | tr '\n' ' ' | sed 's/ $//'))" \
    did_work "$work/$name.log"
done
[ -s "$work/failures" ] && { cat "$work/failures"; grep -h "soak " "$work"/*.log | head -5; }
before=$(soak --role=hash | awk '{print $2}')
kill "$first"; wait "$first" 2>/dev/null

serve "$work/b" || { cat "$work/b/server.log"; }
pids+=("$server_pid")
addr="unix://$work/b/s.sock"
soak --role=replay --log="$work/runs" > "$work/replay.log" 2>&1
check "the replay passed" [ $? -eq 0 ]
after=$(soak --role=hash | awk '{print $2}')
echo "soak: pools $before after the soak, $after after the replay"
same_pools() { [ -n "$before" ] && [ "$before" = "$after" ]; }
check "the replayed pools equal the soaked ones byte for byte" same_pools
kill "$server_pid"; wait "$server_pid" 2>/dev/null
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
