#!/usr/bin/env bash
# A change that must not change the kernels, checked on one GPU in one go:
# kda_bench of the build before (bin/kda_bench_before) and after
# (bin/kda_bench) back to back, then the GPU suites most likely to catch a
# moved kernel (the kernels against the CPU backend, FAST's CUDA kernels, the
# service from another process, the kit's resume case), then memcheck.
#   tools/gpu/ab_check.sh BUNDLE OUTDIR
# BUNDLE: a tools/gpu/bundle.sh bundle with kda_bench_before added to bin/
# (a step whose binaries the bundle lacks is skipped and said so: split a
# bundle over two calls where it passes the 64 MiB carry).
# AB_BENCH_FLAGS (default --shapes=kimi_linear --iters=15) go to both
# benchmarks; AB_BEFORE_FLAGS to the old one only (flags it still has).
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
bin=$bundle/bin
summary=$out/summary.txt
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$summary"
export TEST_SRCDIR=$bundle/runfiles
run() {  # NAME LIMIT COMMAND...  (the C++ binaries get the bundled libraries)
  local name=$1 limit=$2; shift 2
  for arg in "$@"; do  # a bundle may carry part of the binaries (the 64 MiB carry)
    case "$arg" in "$bin"/*) [ -x "$arg" ] || { note "$name: not in this bundle"; return; } ;; esac
  done
  local start=$SECONDS
  LD_LIBRARY_PATH=$bundle/lib timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  note "$name: exit $rc in $((SECONDS - start)) s $(grep -E '^\[  (PASSED|FAILED) |ERROR SUMMARY' "$out/$name.log" | tr '\n' ' ')"
}
flags=${AB_BENCH_FLAGS:---shapes=kimi_linear --iters=15}
# shellcheck disable=SC2086
run kda_bench_before 120 "$bin/kda_bench_before" $flags ${AB_BEFORE_FLAGS:-}
# shellcheck disable=SC2086
run kda_bench_after 120 "$bin/kda_bench" $flags
run kernels_gpu 180 "$bin/kda_kernels_gpu_test" --gtest_brief=1
run fast_cuda_gpu 150 "$bin/fast_cuda_gpu_test" --gtest_brief=1
run gpu_service 200 "$bin/gpu_service_test" --gtest_brief=1
if [ -x "$bin/specstated" ]; then
keeper=$(mktemp -d)/specstate-keeper
printf '#!/bin/sh\nLD_LIBRARY_PATH="%s/lib" exec "%s/bin/specstate-keeper" "$@"\n' "$bundle" "$bundle" > "$keeper"
chmod +x "$keeper"
start=$SECONDS
(SPECSTATED=$bundle/specstated SPECSTATE_KEEPER=$keeper PYTHONPATH=$bundle/python PYTHONUNBUFFERED=1 \
  timeout 120 python3 "$bundle/python/tests/kit_gpu_test.py" KeptPoolsResumeCudaTest) > "$out/kit_resume.log" 2>&1
note "kit_gpu_test KeptPoolsResumeCudaTest: exit $? in $((SECONDS - start)) s $(grep -E '^(Ran|OK|FAILED)' "$out/kit_resume.log" | tr '\n' ' ')"
fi
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
FAST_CUDA_TEST_STEPS=6 run fast_memcheck 150 "$sanitizer" --tool memcheck --error-exitcode 9 \
  "$bin/fast_cuda_gpu_test" --gtest_brief=1
run kernels_memcheck 200 "$sanitizer" --tool memcheck --error-exitcode 9 "$bin/kda_kernels_gpu_test" \
  --gtest_brief=1 --gtest_filter="${MEMCHECK_FILTER:-*/cuda}"
