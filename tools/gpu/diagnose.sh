#!/usr/bin/env bash
# Diagnostics of the service on the CUDA backend, from a bundle made by
# tools/gpu/bundle.sh:   diagnose.sh BUNDLE OUTDIR [align|handoff|bench|breakdown|timeline|mutex|pinning|ab|repeat|all]
#   align: short simulations that isolate one factor each (cache mode, state
#          and activation dtypes, shape, ordering), each under a time limit,
#          with SPECSTATE_TRACE=1 on both sides so a stall shows its phase.
#   bench: service_bench --breakdown without and then with MPS (a private MPS daemon,
#          CUDA_MPS_PIPE_DIRECTORY under /tmp, stopped at the end), to tell
#          whether the step's cost is switching between two GPU contexts;
#          and gpu_service_test under MPS.
#   breakdown: under MPS only, service_bench --breakdown (the N=1 step without
#          its Commit and with a longer model kernel), then again with the
#          server's SPECSTATE_TRACE=1 (the submitter's timings per call).
#   timeline: under MPS, service_bench --breakdown with both processes traced
#          by libcupti_trace.so; timeline.md has the median gaps and
#          durations between the model kernel and the next, per pattern.
#   mutex: under MPS, service_bench twice with Abseil's mutex deadlock detector
#          on and twice with it off, in both processes.
#   pinning: under MPS, service_bench alternately with both processes
#          unpinned and pinned to cores of their own (PIN_SERVER, PIN_CLIENT:
#          taskset CPU lists), twice each.
#   ab: under MPS, service_bench alternately with specstated's environment
#          variable AB_ENV at each of AB_VALUES, AB_ROUNDS (2) times each.
#   repeat: under MPS, service_bench REPEATS (6) times, each against a fresh
#          specstated: the spread of the ASYNC Verify's distance to the echo.
#   handoff: handoff_bench (what a doorbell handoff between two streams costs)
#          in one process and in two, without and with MPS.
#   modes: under MPS, service_bench against a specstated in each commit mode
#          (EAGER, then DEFERRED; the Kimi-Linear layout): service_bench_eager.md
#          and service_bench_deferred.md (its in-process loop is EAGER's kernels).
# SERVER_FLAGS adds flags to every specstated started here.
# Everything lands in OUTDIR/diagnose.log and OUTDIR/logs.tgz.
set -uo pipefail
bundle=$(cd "$1" && pwd); out=$2; what=${3:-all}; mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib" TEST_SRCDIR="$bundle/runfiles"
bin="$bundle/bin"; log="$out/diagnose.log"; : > "$log"
logs=$(mktemp -d /tmp/diagXXXX)
# The Kimi-Linear layout of every service_bench run.
big="--layers=20 --heads=32 --head_dim=128 --conv_dim=12288 --num_spec=3 --blocks=300 --max_rows=256"
say() { echo "[$(date +%T.%N | cut -c1-12)] $*" | tee -a "$log"; }
serve() {  # serve NAME -- specstated flags; sets $sock and $server
  local name=$1; shift
  sock=/tmp/$name.sock; rm -f "$sock"
  SPECSTATE_TRACE=${SERVER_TRACE:-1} ${SERVER_WRAPPER:-} "$bin/specstated" --backend=cuda --listen="unix://$sock" "$@" ${SERVER_FLAGS:-} \
    > "$logs/$name.server.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do [ -S "$sock" ] && return 0; sleep 0.1; done
  say "$name: server did not come up"; return 1
}
stop() { kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; }
simulate() {  # simulate NAME LIMIT_S -- simulate flags
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s.%N)
  SPECSTATE_TRACE=1 timeout -k 2 "$limit" "$bin/specstatectl" --server="unix://$sock" simulate "$@" \
    > "$logs/$name.sim.log" 2>&1
  local rc=$?
  say "$name: exit $rc after $(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}") s; $(grep -E 'verdict|rror' "$logs/$name.sim.log" | head -2 | tr '\n' ' ')"
  if [ $rc -ne 0 ]; then
    say "$name: last phases: $(grep '\[simulate' "$logs/$name.sim.log" | tail -3 | tr '\n' '|')"
    say "$name: server's last lines: $(tail -4 "$logs/$name.server.log" | tr '\n' '|')"
  fi
}
echo_rows() {  # the ASYNC Verify's distance to the echo, from a service_bench output
  grep -h -E '^\| (tensors sent|bound inputs) \|' "$1" | tail -2 |
    awk -F'|' '{gsub(/ /, "", $5); gsub(/ /, "", $6); printf "%s: %s us (handler %s); ", $2, $5, $6}'
}
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ss-mps CUDA_MPS_LOG_DIRECTORY=/tmp/ss-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  if ! nvidia-cuda-mps-control -d; then say "MPS: cannot start the daemon"; return 1; fi
  say "MPS: daemon started"
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control; sleep 1
  cp -r $CUDA_MPS_LOG_DIRECTORY "$logs/mps-log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$log"

if [ "$what" = all ] || [ "$what" = align ]; then
  small="--heads=4 --head_dim=64"
  # name | server flags | simulate flags
  while IFS='|' read -r name sflags mflags; do
    [ -z "$name" ] && continue
    serve "$name" $sflags || continue
    simulate "$name" 40 $mflags
    stop
  done <<EOF
none_small_bf16state_async|$small --blocks=600 --state_dtype=bf16 --activation_dtype=fp16|--steps=6 --requests=8 --async
align_fp32_sync|$small --cache_mode=align --mamba_block_size=8 --blocks=600|--steps=6 --requests=8
align_fp32_async|$small --cache_mode=align --mamba_block_size=8 --blocks=600|--steps=6 --requests=8 --async
align_bf16state_sync|$small --cache_mode=align --mamba_block_size=8 --blocks=600 --state_dtype=bf16 --activation_dtype=fp16|--steps=6 --requests=8
align_test_config|$small --cache_mode=align --mamba_block_size=8 --blocks=600 --state_dtype=bf16 --activation_dtype=fp16|--steps=30 --requests=8 --async
EOF
fi

if [ "$what" = all ] || [ "$what" = handoff ]; then
  for mps in off on; do
    if [ $mps = on ]; then mps_start || break; fi
    for p in 1 2; do
      timeout -k 2 60 "$bin/handoff_bench" --processes=$p --iters=300 \
        > "$out/handoff_${p}proc_mps_$mps.md" 2> "$logs/handoff_${p}proc_mps_$mps.err"
      say "handoff_bench, $p process(es), MPS $mps: exit $?"
    done
    if [ $mps = on ]; then mps_stop; fi
  done
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  for mps in off on; do
    if [ $mps = on ]; then mps_start || break; fi
    SERVER_TRACE=0 serve "bench_mps_$mps" $big || continue
    say "service_bench, MPS $mps: start"
    timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=200 --steps=20 --breakdown \
      > "$out/service_bench_mps_$mps.md" 2> "$logs/bench_mps_$mps.err"
    say "service_bench, MPS $mps: exit $?"
    stop
    if [ $mps = on ] && [ -x "$bin/gpu_service_test" ]; then
      SPECSTATE_EXPECT_MPS=1 timeout -k 2 120 "$bin/gpu_service_test" --gtest_brief=1 > "$logs/gpu_service_mps.log" 2>&1
      say "gpu_service_test under MPS: exit $?, $(grep -E '^\[  (PASSED|FAILED) ' "$logs/gpu_service_mps.log" | tr '\n' ' ')"
    fi
    if [ $mps = on ]; then mps_stop; fi
  done
fi
if [ "$what" = all ] || [ "$what" = modes ]; then
  mps_start
  for mode in eager deferred; do
    SERVER_TRACE=0 serve "modes_$mode" $big --commit_mode=$mode || continue
    say "service_bench, commit mode $mode, MPS on: start"
    timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=200 --steps=20 \
      > "$out/service_bench_$mode.md" 2> "$logs/modes_$mode.err"
    say "service_bench, commit mode $mode: exit $?"
    stop
  done
  mps_stop
fi
if [ "$what" = timeline ]; then
  mps_start
  CUDA_INJECTION64_PATH="$bin/libcupti_trace.so" SPECSTATE_CUPTI_OUT="$logs/server.csv" \
    SERVER_TRACE=0 serve timeline $big
  CUDA_INJECTION64_PATH="$bin/libcupti_trace.so" SPECSTATE_CUPTI_OUT="$logs/client.csv" \
    timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=50 --steps=20 --breakdown \
    > "$out/service_bench_timeline.md" 2> "$logs/timeline.err"
  say "service_bench traced: exit $?"
  stop
  mps_stop
  python3 "$bundle/timeline.py" "$logs/server.csv" "$logs/client.csv" --positions > "$out/timeline.md"
  say "timeline: exit $?, $(wc -l < "$logs/server.csv") server and $(wc -l < "$logs/client.csv") client records"
fi

if [ "$what" = mutex ]; then
  # Abseil's mutex deadlock detector on and off in both processes (Debian's
  # Abseil is built without NDEBUG, so it is on unless a process turns it off).
  mps_start
  for detect in 1 0 1 0; do
    SPECSTATE_DEADLOCK_DETECTION=$detect SERVER_TRACE=0 serve "mutex_detect_$detect" $big || continue
    fast=true; [ $detect = 1 ] && fast=false
    timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=300 --steps=20 \
      --fast_mutexes=$fast >> "$out/service_bench_detect_$detect.md" 2>> "$logs/mutex_$detect.err"
    say "service_bench, deadlock detection $detect: exit $?, $(echo_rows "$out/service_bench_detect_$detect.md")"
    stop
  done
  mps_stop
fi

if [ "$what" = pinning ]; then
  # Whether an RPC landing on a cold core is what the ASYNC Verify's distance
  # to the echo is made of: service_bench with both processes free to run
  # anywhere, then with each pinned to a few cores of its own (taskset),
  # alternately. PIN_SERVER and PIN_CLIENT are taskset CPU lists.
  mps_start
  for pinned in 0 1 0 1; do
    server_pin=""; client_pin=""
    if [ $pinned = 1 ]; then
      server_pin="taskset -c ${PIN_SERVER:-2-5}"; client_pin="taskset -c ${PIN_CLIENT:-8-11}"
    fi
    SERVER_WRAPPER=$server_pin SERVER_TRACE=0 serve "pinned_$pinned" $big || continue
    timeout -k 2 150 $client_pin "$bin/service_bench" --server="unix://$sock" --iters=300 --steps=20 \
      >> "$out/service_bench_pinned_$pinned.md" 2>> "$logs/pinned_$pinned.err"
    say "service_bench, pinned $pinned: exit $?, $(echo_rows "$out/service_bench_pinned_$pinned.md")"
    stop
  done
  mps_stop
fi

if [ "$what" = ab ]; then
  # One setting of specstated's environment against another: AB_ENV=NAME,
  # AB_VALUES="A B" (each started fresh, alternately, AB_ROUNDS times each).
  mps_start
  for round in $(seq ${AB_ROUNDS:-2}); do
    for value in ${AB_VALUES:?}; do
      SERVER_WRAPPER="env ${AB_ENV:?}=$value" SERVER_TRACE=0 serve "ab_$value" $big || continue
      timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=300 --steps=20 \
        >> "$out/service_bench_${AB_ENV}_$value.md" 2>> "$logs/ab_$value.err"
      rc=$?; f="$out/service_bench_${AB_ENV}_$value.md"
      say "service_bench, $AB_ENV=$value: exit $rc, $(echo_rows "$f") SubmitStep p50 $(grep -h 'SubmitStep of' "$f" | tail -1 | cut -d'|' -f4)"
      stop
    done
  done
  mps_stop
fi

if [ "$what" = repeat ]; then
  mps_start
  for round in $(seq ${REPEATS:-6}); do
    SERVER_TRACE=0 serve "repeat_$round" $big || continue
    timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=300 --steps=20 \
      >> "$out/service_bench_repeats.md" 2>> "$logs/repeat.err"
    say "service_bench, run $round: exit $?, $(echo_rows "$out/service_bench_repeats.md") step N=1 $(grep -h '^| decode step | 1 |' "$out/service_bench_repeats.md" | tail -1 | cut -d'|' -f7)"
    stop
  done
  mps_stop
fi

if [ "$what" = breakdown ]; then
  mps_start
  for trace in ${BREAKDOWN_TRACE:-0 1}; do
    SERVER_TRACE=$trace serve "breakdown_trace_$trace" $big || continue
    timeout -k 2 150 "$bin/service_bench" --server="unix://$sock" --iters=200 --steps=20 --breakdown \
      > "$out/service_bench_breakdown_trace_$trace.md" 2> "$logs/breakdown_trace_$trace.err"
    say "service_bench --breakdown, server trace $trace: exit $?"
    stop
  done
  mps_stop
fi

tar -C "$logs" -czf "$out/logs.tgz" .
say "done"
