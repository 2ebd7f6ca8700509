#!/usr/bin/env bash
# Runs the GPU suites and benchmarks from a bundle made by tools/gpu/bundle.sh,
# on a machine with an NVIDIA GPU (no Bazel needed):
#   tools/gpu/run_suite.sh BUNDLE OUTDIR [tests|service|bench|tier|all|restart|transfer]
# (tier: the host tier's benchmark, tests/bench/host_tier_bench.cc;
# transfer: two CUDA services on this GPU with host tiers, Kimi-Linear's
# layout; in each commit mode the simulator moves a request's block to the
# other service and back over UCX every other step (FetchSaved), every state
# compared, and prints each call's latency; TRANSFER_STEPS (20) sizes it;
# not part of `all`;
# service: the service's GPU tests and the Python client's, not the kernels';
# GPU_SERVICE_FILTER is a gtest filter for gpu_service_test; restart: the kept
# pools on the GPU (issue 24): vmm_probe, then the restart drill on the CUDA
# backend without and with MPS, and again with commit_mode DEFERRED (its
# pending tokens kept) and FAST (its rings kept), and the kernels' commit
# journal, DEFERRED and FAST journal tests; not part of `all`. RESTART_STEPS
# (200), RESTART_EVERY (5) and RESTART_SERVICE_FLAGS size the drill;
# RESTART_MODES ("eager deferred fast") picks the drills.)
# Writes logs and tables into OUTDIR and prints a summary; exits non-zero when
# a test failed.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
what=${3:-all}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TEST_SRCDIR="$bundle/runfiles"
bin="$bundle/bin"
status=0
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

# No GPU, no suite: a run that skipped its GPU cases is not a pass.
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  note "no GPU is visible (nvidia-smi -L lists none): the GPU suites cannot run"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$summary"
# A GPU test that skipped itself (no device, no CUDA build) fails the suite.
no_skips() {  # LOG NAME
  local n
  n=$(grep -cE '^\[  SKIPPED \]|skipped=[0-9]+' "$1")
  if [ "$n" -gt 0 ]; then
    note "$2: $n skipped (a GPU suite must run every case): failed"
    status=1
  fi
}

if [ "$what" = all ] || [ "$what" = tests ]; then
  if [ ! -x "$bin/kda_kernels_gpu_test" ]; then note "kda_kernels_gpu_test: not in this bundle"; else
  timeout 300 "$bin/kda_kernels_gpu_test" --gtest_brief=1 > "$out/kernels.log" 2>&1
  rc=$?; note "kda_kernels_gpu_test: exit $rc, $(grep -E '^\[  (PASSED|FAILED) ' "$out/kernels.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
  no_skips "$out/kernels.log" kda_kernels_gpu_test
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -x "$sanitizer" ]; then
    timeout 240 "$sanitizer" --tool memcheck --error-exitcode 9 "$bin/kda_kernels_gpu_test" \
      --gtest_brief=1 --gtest_filter="${MEMCHECK_FILTER:-*/cuda}" > "$out/memcheck.log" 2>&1
    rc=$?; note "compute-sanitizer memcheck: exit $rc, $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  else
    note "compute-sanitizer: not found on this machine"
  fi
  fi
  # Commit mode FAST's CUDA kernels against the CPU ones, and the kernel
  # interface's CUDA backend in FAST against its CPU backend; memcheck on
  # short loops.
  if [ ! -x "$bin/fast_cuda_gpu_test" ]; then note "fast_cuda_gpu_test: not in this bundle"; else
  timeout 200 "$bin/fast_cuda_gpu_test" --gtest_brief=1 > "$out/fast_kernels.log" 2>&1
  rc=$?; note "fast_cuda_gpu_test: exit $rc, $(grep -E '^\[  (PASSED|FAILED) ' "$out/fast_kernels.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
  no_skips "$out/fast_kernels.log" fast_cuda_gpu_test
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -x "$sanitizer" ]; then
    FAST_CUDA_TEST_STEPS=6 timeout 200 "$sanitizer" --tool memcheck --error-exitcode 9 \
      "$bin/fast_cuda_gpu_test" --gtest_brief=1 > "$out/fast_memcheck.log" 2>&1
    rc=$?; note "compute-sanitizer memcheck (FAST): exit $rc, $(grep -E 'ERROR SUMMARY' "$out/fast_memcheck.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  fi
  fi
fi
if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = service ]; then
  timeout 300 "$bin/gpu_service_test" --gtest_brief=1 --gtest_filter="${GPU_SERVICE_FILTER:-*}" \
    > "$out/gpu_service.log" 2>&1
  rc=$?; note "gpu_service_test: exit $rc, $(grep -E '^\[  (PASSED|FAILED) ' "$out/gpu_service.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
  no_skips "$out/gpu_service.log" gpu_service_test
  # The Python client with torch tensors; the Python process keeps its own
  # libraries (LD_LIBRARY_PATH only for the launched specstated).
  if [ -d "$bundle/python" ]; then
    (unset LD_LIBRARY_PATH; SPECSTATED="$bundle/specstated" PYTHONPATH="$bundle/python" \
      PYTHONUNBUFFERED=1 timeout 240 python3 "$bundle/python/tests/gpu_test.py") > "$out/python_gpu.log" 2>&1
    rc=$?; note "python gpu_test: exit $rc, $(grep -E '^(Ran|OK|FAILED)' "$out/python_gpu.log" | tr '\n' ' ')"
    [ $rc -eq 0 ] || status=1
    no_skips "$out/python_gpu.log" "python gpu_test"
    # The integration kit (specstate.kit) on torch CUDA tensors: the Runner
    # against the float64 reference, a step captured in a CUDA graph, the KDA
    # example; then the example on its own server with --check, larger.
    # (its resume test starts a specstate-keeper, which needs the bundled libraries)
    keeper=$(mktemp -d /tmp/ssXXXXXX)/specstate-keeper
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s/lib" exec "%s/bin/specstate-keeper" "$@"\n' "$bundle" "$bundle" > "$keeper"
    chmod +x "$keeper"
    (unset LD_LIBRARY_PATH; SPECSTATED="$bundle/specstated" SPECSTATE_KEEPER="$keeper" \
      PYTHONPATH="$bundle/python" PYTHONUNBUFFERED=1 timeout 300 python3 "$bundle/python/tests/kit_gpu_test.py") \
      > "$out/python_kit_gpu.log" 2>&1
    rc=$?; note "python kit_gpu_test: exit $rc, $(grep -E '^(Ran|OK|FAILED)' "$out/python_kit_gpu.log" | tr '\n' ' ')"
    [ $rc -eq 0 ] || status=1
    no_skips "$out/python_kit_gpu.log" "python kit_gpu_test"
    sock=$(mktemp -d /tmp/ssXXXXXX)/s.sock
    "$bundle/specstated" --backend=cuda --listen="unix://$sock" --layers=4 --heads=4 --head_dim=128 \
      --conv_dim=1536 --num_spec=3 --blocks=64 --max_rows=16 --activation_dtype=fp32 \
      --state_dtype=fp32 > "$out/kda_decode_server.log" 2>&1 &
    server=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    (unset LD_LIBRARY_PATH; PYTHONPATH="$bundle/python" CUDA_MODULE_LOADING=EAGER timeout 240 \
      python3 "$bundle/python/examples/kda_decode.py" --server="unix://$sock" --requests=24 \
      --slots=16 --tokens=128 --check) > "$out/kda_decode.log" 2>&1
    rc=$?; note "kda_decode --check (CUDA): exit $rc, $(grep -E '^(speculative|reference|tokens equal|PASS|FAIL)' "$out/kda_decode.log" | tr '\n' ' ')"
    [ $rc -eq 0 ] || status=1
    kill $server; wait $server 2>/dev/null
  fi
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 240 "$bin/kda_bench" ${KDA_BENCH_FLAGS:-} > "$out/kda_bench.md" 2>&1
  note "kda_bench: exit $?"
  # The service with the Kimi-Linear layout, for the service benchmark.
  sock=$(mktemp -d /tmp/ssXXXXXX)/s.sock
  "$bin/specstated" --backend=cuda --listen="unix://$sock" --layers=20 --heads=32 --head_dim=128 \
    --conv_dim=12288 --conv_kernel=4 --num_spec=3 --blocks=300 --max_rows=256 \
    > "$out/service_bench_server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  timeout 200 "$bin/service_bench" --server="unix://$sock" ${SERVICE_BENCH_FLAGS:-} > "$out/service_bench.md" 2>&1
  note "service_bench: exit $?"
  kill $server; wait $server 2>/dev/null
fi
if [ "$what" = all ] || [ "$what" = tier ]; then
  # The host tier: SaveBlocks / RestoreBlocks of Kimi-Linear blocks (20
  # layers, 2 MiB + 144 KiB each) against the copy engine's ceilings, every
  # restored block checked (tests/bench/host_tier_bench.cc).
  if [ ! -x "$bin/host_tier_bench" ]; then note "host_tier_bench: not in this bundle"; else
  sock=$(mktemp -d /tmp/ssXXXXXX)/s.sock
  "$bin/specstated" --backend=cuda --listen="unix://$sock" --model=kimi-linear-48b-a3b --blocks=72 \
    --max_rows=16 --host_tier_bytes=${HOST_TIER_BYTES:-3GiB} > "$out/host_tier_server.log" 2>&1 &
  server=$!
  for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
  timeout 240 "$bin/host_tier_bench" --server="unix://$sock" ${HOST_TIER_BENCH_FLAGS:-} \
    > "$out/host_tier_bench.md" 2>&1
  rc=$?; note "host_tier_bench: exit $rc"
  [ $rc -eq 0 ] || status=1
  kill $server; wait $server 2>/dev/null
  fi
fi
if [ "$what" = transfer ]; then
  dir=$(mktemp -d /tmp/ss-transfer.XXXXXX)
  serve() {  # NAME MODE: a CUDA specstated with a host tier, serving on DIR/NAME.sock
    "$bin/specstated" --backend=cuda --listen="unix://$dir/$1.sock" --commit_mode="$2" \
      --model=kimi-linear-48b-a3b --blocks=16 --max_rows=4 --host_tier_bytes=2GiB \
      > "$out/transfer_$2_$1.log" 2>&1 &
    echo $!
  }
  for mode in ${TRANSFER_MODES:-eager deferred fast}; do
    a=$(serve a "$mode"); b=$(serve b "$mode")
    for _ in $(seq 120); do
      "$bin/specstatectl" --server="unix://$dir/a.sock" health > /dev/null 2>&1 &&
        "$bin/specstatectl" --server="unix://$dir/b.sock" health > /dev/null 2>&1 && break
      sleep 1
    done
    timeout 400 "$bin/specstatectl" simulate --server="unix://$dir/a.sock" \
      --transfer_peer="unix://$dir/b.sock" --transfer_every=2 --steps="${TRANSFER_STEPS:-20}" \
      --requests=2 --commit_mode="$mode" > "$out/transfer_$mode.log" 2>&1
    rc=$?; note "transfer simulation ($mode): exit $rc"
    grep -E '^(verdict|transfers)|SaveBlocks|FetchSaved|RestoreBlocks' "$out/transfer_$mode.log" | tee -a "$summary"
    [ $rc -eq 0 ] || status=1
    kill "$a" "$b"; wait "$a" "$b" 2> /dev/null
  done
  rm -rf "$dir"
fi

if [ "$what" = restart ]; then
  # 1. What the driver does with a cuMemCreate allocation whose descriptor
  #    outlives its creator; whether cudaIpcGetMemHandle covers it.
  timeout 120 "$bin/vmm_probe" > "$out/vmm_probe.txt" 2>&1
  rc=$?; note "vmm_probe: exit $rc"
  grep '^probe:' "$out/vmm_probe.txt" | tee -a "$summary"
  [ $rc -eq 0 ] || status=1
  # 2. The commit journal on the GPU (CommitJournalTest.*/cuda): a commit
  #    lists its blocks before its first write and marks them after its last.
  timeout 300 "$bin/kda_kernels_gpu_test" --gtest_brief=1 --gtest_filter='*CommitJournal*:*Deferred*' \
    > "$out/commit_journal.log" 2>&1
  rc=$?; note "kda_kernels_gpu_test CommitJournal*:Deferred*: exit $rc, $(grep -E '^\[  (PASSED|FAILED) ' "$out/commit_journal.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
  no_skips "$out/commit_journal.log" "CommitJournal*:Deferred*"
  # FAST's journals through the kernel interface: the CUDA backend writes
  # the commit journal and the fold journal as the CPU backend does.
  timeout 300 "$bin/fast_cuda_gpu_test" --gtest_brief=1 --gtest_filter='FastCudaInterfaceTest.*' \
    > "$out/fast_journal.log" 2>&1
  rc=$?; note "fast_cuda_gpu_test FastCudaInterfaceTest.*: exit $rc, $(grep -E '^\[  (PASSED|FAILED) ' "$out/fast_journal.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || status=1
  no_skips "$out/fast_journal.log" "FastCudaInterfaceTest.*"
  # 3. The drill on the CUDA backend: its own keeper and specstated, killed
  #    between calls, inside Verify and right after a Commit's kernels were
  #    enqueued (they run on while the process dies), started again; every
  #    state compared bit for bit with the stock path; the report says the
  #    restart times and the bytes kept.
  drill() {  # NAME [specstatectl flags]
    local name=$1; shift
    timeout 580 "$bin/specstatectl" simulate --restart_every="${RESTART_EVERY:-5}" \
      --steps="${RESTART_STEPS:-200}" --requests=8 "$@" \
      --service_flags="--backend=cuda ${RESTART_SERVICE_FLAGS:---layers=8 --heads=16 --head_dim=128 --conv_dim=4096 --blocks=64 --max_rows=16}" \
      --specstated="$bin/specstated" --keeper_binary="$bin/specstate-keeper" \
      > "$out/restart_drill_$name.log" 2>&1
    rc=$?; note "restart drill ($name): exit $rc"
    grep -E '^(restart drill|verdict)' "$out/restart_drill_$name.log" | tee -a "$summary"
    [ $rc -eq 0 ] || status=1
  }
  modes=" ${RESTART_MODES:-eager deferred fast} "
  [[ $modes == *" eager "* ]] && drill no_mps
  [[ $modes == *" deferred "* ]] && drill deferred --commit_mode=deferred
  [[ $modes == *" fast "* ]] && drill fast --commit_mode=fast
  if [[ $modes == *" eager "* ]] && command -v nvidia-cuda-mps-control > /dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/ss-restart-mps CUDA_MPS_LOG_DIRECTORY=/tmp/ss-restart-mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    if nvidia-cuda-mps-control -d; then
      drill mps
      echo quit | nvidia-cuda-mps-control; sleep 1
    else
      note "restart drill (mps): the MPS daemon did not start"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    note "restart drill (mps): nvidia-cuda-mps-control not found"
  fi
fi
exit $status
