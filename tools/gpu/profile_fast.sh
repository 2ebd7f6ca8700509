#!/usr/bin/env bash
# Profiles commit mode FAST's kernels with Nsight Compute on a GPU machine,
# from a folder holding bin/kda_bench and lib/ (tools/gpu/bundle.sh's bundle,
# or /work/shared/tools/bundle-with-libs.sh DEST bazel-bin/tests/bench/kda_bench):
#   tools/gpu/profile_fast.sh BUNDLE OUTDIR [N=256]
# Writes, for Kimi-Linear at N requests (F = 4, the kernel interface's verify
# as the service runs it, and a 20-layer commit's fold):
#   OUTDIR/ncu_fast_verify.txt, OUTDIR/ncu_fast_fold.txt: speed of light,
#     occupancy, stall reasons, instruction mix, memory;
#   OUTDIR/fast_verify_source.csv, OUTDIR/fast_fold_source.csv: per SASS
#     instruction, executed count and warp stall samples, to find which
#     phase the time goes to; OUTDIR/fast_verify_regions.md,
#     OUTDIR/fast_fold_regions.md: those samples summed between barriers
#     (tools/gpu/stall_regions.py).
# VERIFY_REGEX picks the Verify kernel (mangled name; default any, the first
# launched after VERIFY_SKIP = 4; "FastVerifyKernel.*Lb1E" the staged
# schedule's, which kda_bench's schedule rows launch); VERIFY_REGEX=none
# skips it. FOLD_REGEX (default any commit fold, FOLD_SKIP = 4) picks the
# fold kernel: "FastFoldKernel.*FoldModeE0E.*StagingE3E" the pipelined one,
# "...StagingE1E" the unstaged one (kda_bench's fold schedule rows launch both);
# FOLD_STEM names its outputs (default fast_fold); FOLD_REGEX=none skips it.
# Clocks are left as they run (--clock-control none).
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
n=${3:-256}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis"
bench=("$bundle/bin/kda_bench" --shapes=kimi_linear --ns="$n" --iters=3 --sweep=false --before=false
  --cold=false --fast_checkpoint_numerics=false --fast_snapshots=2)
# name regex (mangled), launches to skip (warm-up), output stem
profile() {
  local regex=$1 skip=$2 stem=$3
  # shellcheck disable=SC2086
  timeout 200 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:$regex" \
    --launch-skip "$skip" --launch-count 1 $sections --print-details all "${bench[@]}" \
    > "$out/ncu_$stem.txt" 2>&1
  echo "ncu $stem: exit $?"
  timeout 200 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:$regex" \
    --launch-skip "$skip" --launch-count 1 --section SourceCounters --section WarpStateStats \
    --export "$out/$stem" --force-overwrite "${bench[@]}" > /dev/null 2>&1 &&
    "$ncu" --import "$out/$stem.ncu-rep" --page source --csv --print-source sass \
      > "$out/${stem}_source.csv" 2>&1
  echo "ncu $stem source: exit $?"
  rm -f "$out/$stem.ncu-rep"
  python3 "$(dirname "$0")/stall_regions.py" "$out/${stem}_source.csv" "$stem, N = $n" \
    > "$out/${stem}_regions.md"
}
if [ "${VERIFY_REGEX:-}" != none ]; then
  profile "${VERIFY_REGEX:-FastVerifyKernel}" "${VERIFY_SKIP:-4}" fast_verify
fi
if [ "${FOLD_REGEX:-}" != none ]; then
  profile "${FOLD_REGEX:-FastFoldKernel.*FoldModeE0}" "${FOLD_SKIP:-4}" "${FOLD_STEM:-fast_fold}"
fi
