#!/usr/bin/env bash
# Prints `specstatectl simulate`'s reports over a matrix of layouts and
# simulate flags (KDA with fp32, bf16 and fp16 activations and bf16 state,
# the plain gate, GDN, align mode, SYNC, ASYNC, SubmitStep, bound inputs,
# commit modes EAGER, DEFERRED and FAST, a planted corruption that must FAIL, the
# crash tests, refused options, tensor parallelism over two services, and
# restart drills), each against fresh CPU-backend specstated processes (a
# drill starts its own, with a keeper). What varies from run to run is
# masked: the latency numbers (the calls are kept), the run directories
# (DIR), the binary's path, log times, a drill's timings (N ms), and under tensor parallelism the progress
# lines before the last (each sums the ranks' latest counts, which depend on
# how far each rank's thread has got). So two runs of one build print the
# same bytes, and a diff of two builds' output shows any change of the
# simulator's behaviour:
#
#   tools/simulate_matrix.sh > /tmp/before.txt
#   ... change the simulator, rebuild ...
#   tools/simulate_matrix.sh > /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt
#
# With an argument, only the configurations whose names start with it
# (`tools/simulate_matrix.sh fast-1000`: the runs of docs/results/
# simulate_fast_cpu_1000.md).
#
# Builds nothing: run `bazel build //server:specstated //client/cli:specstatectl
# //keeper:specstate-keeper` first, or set SPECSTATED, SPECSTATECTL and
# SPECSTATE_KEEPER to the binaries. Takes about 2 minutes (the FAST 1,000-step
# runs take most of it).
# Exit status: 0 once every configuration ran (whatever its verdict, which
# is part of the output), 1 when a service did not start.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
server_bin=${SPECSTATED:-$here/bazel-bin/server/specstated}
ctl_bin=${SPECSTATECTL:-$here/bazel-bin/client/cli/specstatectl}
keeper_bin=${SPECSTATE_KEEPER:-$here/bazel-bin/keeper/specstate-keeper}
for bin in "$server_bin" "$ctl_bin" "$keeper_bin"; do
  [ -x "$bin" ] || { echo "simulate_matrix.sh: no $bin: build it first" >&2; exit 1; }
done
dir=$(mktemp -d /tmp/simmatrix-XXXXXX)
pids=()
stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  pids=()
}
trap 'stop; rm -rf "$dir"' EXIT

# run NAME RANKS "SPECSTATED FLAGS" SIMULATE FLAGS...
# RANKS 0: no service here (a restart drill starts its own).
only=${1:-}
run() {
  local name=$1 ranks=$2 server_flags=$3
  shift 3
  [[ $name == "$only"* ]] || return 0
  local addresses=() r sock
  for ((r = 0; r < ranks; r++)); do
    sock="$dir/$name-$r.sock"
    # shellcheck disable=SC2086  # the flags are words
    "$server_bin" --backend=cpu --listen="unix://$sock" $server_flags > "$dir/$name-$r.log" 2>&1 &
    pids+=($!)
    addresses+=("unix://$sock")
  done
  for ((r = 0; r < ranks; r++)); do
    for _ in $(seq 300); do [ -S "$dir/$name-$r.sock" ] && break; sleep 0.1; done
    if [ ! -S "$dir/$name-$r.sock" ]; then
      echo "simulate_matrix.sh: $name: rank $r did not start:" >&2
      cat "$dir/$name-$r.log" >&2
      exit 1
    fi
  done
  local target
  if [ "$ranks" -eq 0 ]; then
    target=--specstated=$server_bin
    set -- --keeper_binary="$keeper_bin" "$@"
  elif [ "$ranks" -eq 1 ]; then
    target=--server=${addresses[0]}
  else
    target=--servers=$(IFS=,; echo "${addresses[*]}")
  fi
  echo "== $name: specstated $server_flags | simulate $(printf '%s ' "$@" | sed 's/--keeper_binary=[^ ]* //')"
  # In the background, so that the shell does not report the crash tests' SIGKILL.
  "$ctl_bin" "$target" simulate "$@" > "$dir/out" 2>&1 &
  wait $! 2>/dev/null
  local rc=$?
  local progress=''
  if [ "$ranks" -gt 1 ]; then
    progress='/^step ([0-9]+)\/\1:/!s/^(step [0-9]+\/[0-9]+:) [0-9]+ comparisons, [0-9]+ mismatches$/\1 C comparisons, M mismatches/'
  fi
  # Latency rows: "  RPC   calls  p50  p99  mean"; the RPC and its calls stay.
  sed -E -e "s#$dir#DIR#g" -e "s#$server_bin#SPECSTATED#g" -e "$progress" \
    -e 's#/tmp/specstate-drill-[A-Za-z0-9]+#DIR#g' -e '/^restart drill: [0-9]/s/[0-9.]+ ms/N ms/g' \
    -e 's/^([EWI]) [0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:.]+ /\1 TIME /' \
    -e 's/^(  .+ +[0-9]+) +[0-9]+\.[0-9] +[0-9]+\.[0-9] +[0-9]+\.[0-9]$/\1 p50 p99 mean/' "$dir/out"
  echo "exit $rc"
  stop
}

small="--heads=2 --conv_dim=128 --layers=3"
align="--cache_mode=align --mamba_block_size=8 --blocks=400"
gdn="--kind=gdn --heads=2 --value_heads=4"
run kda-sync 1 "" --steps=30 --requests=8
run kda-bf16-state 1 "--state_dtype=bf16" --steps=30 --requests=8 --seed=2
run kda-fp32-act 1 "--activation_dtype=fp32 $small" --steps=30 --requests=6
run kda-fp16-act 1 "--activation_dtype=fp16 --num_spec=2 $small" --steps=30 --requests=6 --seed=3
run kda-plain-gate 1 "--kda_gate=plain" --steps=25 --requests=8
run gdn 1 "$gdn" --steps=30 --requests=8
run gdn-bf16-async 1 "$gdn --state_dtype=bf16" --steps=20 --async
run kda-align 1 "$align" --steps=30 --requests=8
run gdn-align-bound 1 "$gdn $align" --steps=30 --requests=8 --bound_inputs
run kda-async 1 "" --steps=30 --requests=8 --async --seed=4
run kda-submitstep 1 "" --steps=20 --requests=8 --batch
run kda-async-submitstep-bound 1 "$align" --steps=25 --requests=8 --async --batch --bound_inputs
run kda-bound 1 "$small" --steps=30 --requests=8 --bound_inputs --finish_probability=0.4
run kda-full-batch 1 "--max_rows=8 $small" --steps=20 --requests=8 --seed=5
run kda-corrupt 1 "" --steps=20 --requests=4 --corrupt_after_step=5
run kda-too-many-rows 1 "$small" --requests=17
run kda-events-on-cpu 1 "$small" --steps=5 --async --events
run tp2-kda 2 "--heads=2 --conv_dim=384" --steps=20 --requests=6
run tp2-gdn-align-async 2 "--kind=gdn --heads=1 --value_heads=2 --conv_dim=64 $align" --steps=20 --requests=6 --async
run tp2-kda-plain-bound-batch 2 "--heads=2 --conv_dim=64 --kda_gate=plain --state_dtype=bf16" --steps=20 --bound_inputs --batch
run tp2-corrupt-rank1 2 "--heads=2 --conv_dim=64" --steps=15 --corrupt_after_step=4 --corrupt_rank=1
run tp2-crash-refused 2 "--heads=2 --conv_dim=64" --steps=5 --crash_after_verify_step=2
run kda-crash-after-verify 1 "$small" --steps=10 --crash_after_verify_step=3
run kda-abandon-commit 1 "$align" --steps=10 --abandon_commit_at_step=4 --async
deferred="--commit_mode=deferred"
run deferred-sync 1 "$deferred" --steps=30 --requests=8 --commit_mode=deferred
run deferred-async-bound-bf16 1 "$deferred --state_dtype=bf16" --steps=30 --async --bound_inputs
run deferred-align 1 "$deferred $align" --steps=30 --requests=8
run deferred-gdn-submitstep 1 "$deferred $gdn" --steps=30 --requests=6 --batch --seed=6
run deferred-corrupt 1 "$deferred" --steps=20 --corrupt_after_step=5
run deferred-refused-by-eager 1 "" --steps=5 --commit_mode=deferred
run tp2-deferred-align 2 "$deferred --heads=2 --conv_dim=64 $align" --steps=20 --requests=6
run restart-eager 0 "" --restart_every=4 --steps=24 --requests=4
run restart-align 0 "" --restart_every=3 --steps=20 --requests=4 "--service_flags=$align"
run restart-gdn-bound 0 "" --restart_every=5 --steps=20 --bound_inputs "--service_flags=$gdn"
run restart-async-refused 0 "" --restart_every=4 --steps=5 --async
run restart-deferred-refused 0 "" --restart_every=4 --steps=5 "--service_flags=$deferred"
fast="--commit_mode=fast"
run fast-sync 1 "$fast --fold_every=4" --steps=40 --requests=8 --commit_mode=fast
run fast-fp32-act-bound 1 "$fast --fold_every=8 --activation_dtype=fp32 $small" --steps=40 --bound_inputs
run fast-align-bf16-async 1 "$fast --fold_every=2 --state_dtype=bf16 $align" --steps=40 --requests=8 --async --batch
run fast-gdn 1 "$fast --fold_every=16 $gdn" --steps=40 --requests=6
run fast-corrupt 1 "$fast" --steps=20 --corrupt_after_step=5
run fast-refused-by-eager 1 "" --steps=5 --commit_mode=fast
run fast-refused-under-tp 2 "$fast --heads=2 --conv_dim=64" --steps=5
run fast-1000-kda-fp32-act 1 "$fast --fold_every=4 --activation_dtype=fp32" --steps=1000 --requests=4 --seed=23
run fast-1000-kda-bf16-state-align 1 "$fast --fold_every=8 --state_dtype=bf16 --kda_gate=plain --cache_mode=align --mamba_block_size=16 --blocks=1200" --steps=1000 --requests=4 --seed=23
run fast-1000-gdn-f16 1 "$fast --fold_every=16 --activation_dtype=fp32 $gdn" --steps=1000 --requests=4 --seed=23
