#!/usr/bin/env bash
# Profiles the recurrent kernel with Nsight Compute on a GPU machine, from a
# bundle made by tools/gpu/bundle.sh:
#   tools/gpu/profile_kernels.sh BUNDLE OUTDIR [KERNEL_REGEX=Pipelined]
# Writes OUTDIR/ncu_verify.txt (Kimi-Linear verify, N=256: speed of light,
# occupancy, stall reasons, instruction mix, pipe use), OUTDIR/ncu_commit.txt
# (the replay of a 20-layer commit, N=256), OUTDIR/ncu_deferred_verify.txt
# (commit mode DEFERRED's fused verify, N=256: the same sections),
# OUTDIR/ncu_deferred_n1.txt (every kernel of DEFERRED's N=1 verify and
# 20-layer commit with its duration) and, where cuobjdump exists, the
# SASS instruction counts of the verify kernel (OUTDIR/sass_verify.txt), and
# the executed count of each of its instructions (OUTDIR/verify_source.csv).
# Clocks are left as they run (--clock-control none), so durations compare
# with kda_bench's.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
regex=${3:-Pipelined}
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis"
bench=("$bundle/bin/kda_bench" --shapes=kimi_linear --ns=256 --iters=3 --sweep=false --before=false
  --cold=false)
# kda_bench runs verify, then stock, then commit per N: the first verify
# launches are warm-up, so skip a few.
# shellcheck disable=SC2086
timeout 200 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:${regex}.*ModeE1" --launch-skip 4 \
  --launch-count 1 $sections --print-details all "${bench[@]}" > "$out/ncu_verify.txt" 2>&1
echo "ncu verify: exit $?"
# Per SASS instruction: executed counts and stall samples of the same kernel
# (OUTDIR/verify_source.csv), to find where the instructions go.
timeout 200 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:${regex}.*ModeE1" \
  --launch-skip 4 --launch-count 1 --section SourceCounters --section WarpStateStats \
  --export "$out/verify_source" --force-overwrite "${bench[@]}" > /dev/null 2>&1 &&
  "$ncu" --import "$out/verify_source.ncu-rep" --page source --csv --print-source sass \
    > "$out/verify_source.csv" 2>&1
echo "ncu verify source: exit $?"
rm -f "$out/verify_source.ncu-rep"
# shellcheck disable=SC2086
timeout 200 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:${regex}.*ModeE2" --launch-skip 2 \
  --launch-count 1 $sections --print-details all "${bench[@]}" > "$out/ncu_commit.txt" 2>&1
echo "ncu commit: exit $?"
# DEFERRED (kda_bench --eager=false): the fused verify (mode 3,
# kReplayVerify), after its warm-up runs.
deferred=("$bundle/bin/kda_bench" --shapes=kimi_linear --iters=3 --sweep=false --before=false
  --cold=false --eager=false)
# shellcheck disable=SC2086
timeout 200 "$ncu" --clock-control none --kernel-name-base mangled --kernel-name "regex:${regex}.*ModeE3" --launch-skip 4 \
  --launch-count 1 $sections --print-details all "${deferred[@]}" --ns=256 > "$out/ncu_deferred_verify.txt" 2>&1
echo "ncu DEFERRED verify: exit $?"
# N=1: every kernel's duration (check, fused verify; plan, conv, replay list).
timeout 200 "$ncu" --clock-control none --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread \
  "${deferred[@]}" --ns=1 > "$out/ncu_deferred_n1.txt" 2>&1
echo "ncu DEFERRED N=1: exit $?"
cuobjdump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
if [ -x "$cuobjdump" ]; then
  # The production verify kernel (bf16 activations, fp32 state, K = 128):
  # instructions by opcode, over the whole kernel and in its largest block.
  "$cuobjdump" -sass "$bundle/bin/kda_bench" |
    awk -v re="${regex}.*ModeE1ENS_8BFloat16EfLi128.*LayoutILi8ELi2" '/Function :/ {f = ($0 ~ re)} f' \
    > "$out/sass_verify.sass"
  {
    echo "instructions: $(grep -cE '^\s+/\*[0-9a-f]{4,}\*/' "$out/sass_verify.sass")"
    grep -oE '^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9]+' "$out/sass_verify.sass" |
      awk '{print $NF}' | sort | uniq -c | sort -rn | head -30
  } > "$out/sass_verify.txt"
  echo "sass: $(head -1 "$out/sass_verify.txt")"
fi
