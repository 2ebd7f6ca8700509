#!/usr/bin/env bash
# Commit mode FAST on the CUDA backend over the layouts of issue 23's
# accuracy contract: fold_every 4, 8 and 16 x KDA (safe gate, plain gate) and
# GDN x fp32 and bf16 state, every pair of those covered (9 runs; align mode
# in two), each `specstatectl simulate --commit_mode=fast --steps=1000`
# against a fresh specstated, whose verdict judges FAST by the contract
# against the float64 reference (docs/semantics.md, "Fast mode (FAST):
# accuracy"). On a machine with an NVIDIA GPU, from a tools/gpu/bundle.sh
# bundle unpacked at BUNDLE:
#   tools/gpu/fast_matrix.sh BUNDLE OUTDIR
# Prints each run's report (latency lines dropped); exits non-zero when a
# verdict is not PASS. BACKEND=cpu and STEPS=N (default 1000) are for a dry
# run on a machine without a GPU.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
backend=${BACKEND:-cuda}
steps=${STEPS:-1000}
status=0
n=0
run() {  # SPECSTATED FLAGS...
  n=$((n + 1))
  local sock="$out/s$n.sock"
  "$bundle/bin/specstated" --backend="$backend" --commit_mode=fast --listen="unix://$sock" "$@" \
    > "$out/server$n.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
  echo "== specstated --backend=$backend --commit_mode=fast $* | simulate --commit_mode=fast --steps=$steps --requests=4 --seed=23"
  "$bundle/bin/specstatectl" --server="unix://$sock" simulate --commit_mode=fast --steps="$steps" \
    --requests=4 --seed=23 > "$out/run$n.txt" 2>&1
  local rc=$?
  grep -vE '^step [0-9]+/|^latency per RPC|^  [A-Za-z( ),]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$' "$out/run$n.txt"
  echo "exit $rc"
  grep -q 'verdict: PASS' "$out/run$n.txt" || status=1
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}
align="--cache_mode=align --mamba_block_size=16 --blocks=1200"
run --fold_every=4 --activation_dtype=fp32
run --fold_every=4 --kda_gate=plain --state_dtype=bf16
run --fold_every=4 --kind=gdn --heads=2 --value_heads=4 --state_dtype=bf16
run --fold_every=8 --state_dtype=bf16
run --fold_every=8 --kda_gate=plain --state_dtype=bf16 $align
run --fold_every=8 --kind=gdn --heads=2 --value_heads=4 $align
run --fold_every=16 --activation_dtype=fp32
run --fold_every=16 --kda_gate=plain --state_dtype=bf16
run --fold_every=16 --kind=gdn --heads=2 --value_heads=4 --activation_dtype=fp32
exit $status
