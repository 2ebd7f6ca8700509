#!/usr/bin/env bash
# Runs the GPU suites and benchmarks from a bundle made by tools/gpu/bundle.sh,
# on a machine with an NVIDIA GPU (no Bazel needed):
#   tools/gpu/run_suite.sh BUNDLE OUTDIR [tests|service|bench|all]
# (service: the service's GPU tests and the Python client's, not the kernels';
# GPU_SERVICE_FILTER is a gtest filter for gpu_service_test)
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
exit $status
