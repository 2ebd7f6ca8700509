#!/usr/bin/env bash
# Diagnostics of the service on the CUDA backend (used while bringing it up):
# short simulations timed one by one, the service under compute-sanitizer, and
# the service benchmark with SPECSTATE_TRACE=1.   diagnose.sh BUNDLE OUTDIR
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib" TEST_SRCDIR="$bundle/runfiles"
bin="$bundle/bin"; log="$out/diagnose.log"; : > "$log"
say() { echo "[$(date +%T.%N | cut -c1-12)] $*" >> "$log"; }
serve() {  # serve SOCKET LOGFILE [prefix...] -- flags
  local sock=$1 slog=$2; shift 2
  "$@" > "$slog" 2>&1 &
  for _ in $(seq 300); do [ -S "$sock" ] && return 0; sleep 0.1; done
  say "server did not come up"; return 1
}
sock=/tmp/d1.sock
SPECSTATE_TRACE=1 serve $sock "$out/server1.log" "$bin/specstated" --backend=cuda --listen=unix://$sock \
  --heads=8 --head_dim=128 --conv_dim=3072 --blocks=128 --max_rows=32
s1=$!
for mode in "" "--async" "--async --events"; do
  say "simulate $mode: start"
  timeout -k 3 45 "$bin/specstatectl" --server=unix://$sock simulate --steps=4 --requests=3 $mode >> "$log" 2>&1
  say "simulate $mode: exit $?"
done
kill $s1; wait $s1
sock=/tmp/d2.sock
serve $sock "$out/server2.log" "${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}" --tool memcheck \
  "$bin/specstated" --backend=cuda --listen=unix://$sock --layers=20 --heads=32 --head_dim=128 \
  --conv_dim=12288 --num_spec=3 --blocks=40 --max_rows=32
s2=$!
say "service_bench under memcheck: start"
timeout -k 3 100 "$bin/service_bench" --server=unix://$sock --iters=10 --steps=2 >> "$log" 2>&1
say "service_bench under memcheck: exit $?"
kill $s2; wait $s2
sock=/tmp/d3.sock
SPECSTATE_TRACE=1 serve $sock "$out/server3.log" "$bin/specstated" --backend=cuda --listen=unix://$sock \
  --layers=20 --heads=32 --head_dim=128 --conv_dim=12288 --num_spec=3 --blocks=300 --max_rows=256
s3=$!
say "service_bench: start"
timeout -k 3 120 "$bin/service_bench" --server=unix://$sock --iters=60 --steps=6 >> "$log" 2>&1
say "service_bench: exit $?"
kill $s3; wait $s3
say "done"
