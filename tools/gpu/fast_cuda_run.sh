#!/usr/bin/env bash
# One device run for the FAST CUDA kernels (issue 23):
#   tools/gpu/fast_cuda_run.sh BUNDLE OUTDIR
# BUNDLE: bundle-with-libs.sh's folder holding fast_cuda_gpu_test and
# fast_bench. Writes OUTDIR/gpu_test.txt, bench.txt, ncu_fast_verify.txt and
# memcheck.txt, each step under its own time limit.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi -L > "$out/device.txt" 2>&1
timeout 100 "$bundle/bin/fast_cuda_gpu_test" > "$out/gpu_test.txt" 2>&1
echo "gpu test: exit $?"
tail -5 "$out/gpu_test.txt"
timeout 150 "$bundle/bin/fast_bench" --iters=15 --snapshots=6 > "$out/bench.txt" 2>&1
echo "bench: exit $?"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 60 "$ncu" --clock-control none --kernel-name regex:FastVerifyKernel --launch-skip 1 \
  --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  --metrics dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active \
  "$bundle/bin/fast_bench" --verify_only > "$out/ncu_fast_verify.txt" 2>&1
echo "ncu: exit $?"
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
FAST_CUDA_TEST_STEPS=6 timeout 80 "$cs" --tool memcheck --leak-check no "$bundle/bin/fast_cuda_gpu_test" \
  --gtest_filter='*K64*:*HV4*:*F16*:*K256_Q2*:*align*:*Interface*' > "$out/memcheck.txt" 2>&1
echo "memcheck: exit $?"
tail -3 "$out/memcheck.txt"
