#!/usr/bin/env bash
# The one device call that decides FAST's Verify schedules (issue 34): which
# FastVerifySchedule the launcher serves by default. Run from a checkout on a
# GPU machine, with the extracted tools/gpu/bundle.sh bundle built with
#   BUNDLE_TARGETS="//server:specstated //client/cli:specstatectl \
#     //keeper:specstate-keeper //kernels/fast:fast_cuda_gpu_test \
#     //tests/bench:kda_bench" tools/gpu/bundle.sh .gpu
# (about 42 MB: under the device tool's 64 MiB carry):
#   tools/gpu/fast_schedules_run.sh BUNDLE OUTDIR [DEADLINE_S=540] [LAST_STEP=4]
# (LAST_STEP=1: the tests alone, for a call short of device time.)
# Steps in the order of what they decide, each under its own time limit, so
# that a call cut short still returns the first ones; at most 8 files (what
# the device tool brings back):
#  1. gpu_test.txt: fast_cuda_gpu_test (every Verify schedule's cases bit
#     for bit against the loaded pass: the piped pass with bf16 state rows
#     and with the TMA's bulk copies, the checkpoint's L2 prefetch, the
#     staged kernel's ring values per row and spread and its window loaded
#     with the row's cursor and after it, at every split; every
#     Commit under every fold schedule, unstaged, staged and pipelined, and
#     Materialize's served (unstaged) folds and pipelined ones, bit for bit), then the same
#     under memcheck on 3-step loops. Its last
#     line says whether the piped bf16 cases passed: Piping::kAuto, the
#     default since they first did (verify_plan.h), pipes bf16 state rows.
#  2. kda_bench.md: every shape, N = 1, 16, 64, 256, both state dtypes,
#     every mode and every schedule row (cold L2, CUDA graph; at N = 1 the
#     staged Verify's ring values summed per row beside the served spread,
#     schedule_table.py --set=ring_values --ns=1, and its window loaded
#     after the cursor beside the served load with it, --set=window_loads;
#     the floors at every N, --set=floors), the folds
#     alone under each FastFoldSchedule and what a folded row costs;
#     tables.md: its summary table (summary_table.py, docs/benchmarks.md's
#     lead table) and the schedules side by side at N = 64 and 256
#     (schedule_table.py --set=piped, --set=prefetch_checkpoint), the bulk
#     copies' rows only where step 1 passed with them.
#  3. ncu_fold_pipelined.txt, fold_pipelined_regions.md,
#     ncu_fold_unstaged.txt, fold_unstaged_regions.md: Nsight Compute of
#     Commit's fold kernel, pipelined and not, Kimi-Linear fp32 state at
#     N = 256 (what bounds it).
#  4. n1_kernels.csv: every kernel's duration in Kimi-Linear's N = 1 step
#     (ncu, one metric; launches serialized), what the N = 1 step is made of.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
deadline=${3:-540}
last_step=${4:-4}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export TEST_SRCDIR="$bundle/runfiles"
bin="$bundle/bin"
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# The profiles' scratch (reports, SASS tables) stays out of OUTDIR.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }

# 1. The bit-identity cases, then memcheck. If the first run fails (or
# hangs) it runs again without the TMA's bulk copies (PipeCopies::kBulk,
# the newest schedule), so that their failure cannot hide the verdict on
# the others, and kda_bench then leaves their rows out.
test_bin="$bin/fast_cuda_gpu_test"
{
  nvidia-smi -L
  timeout 120 "$test_bin"
  rc=$?
  echo "fast_cuda_gpu_test: exit $rc"
  bulk=1
  if [ "$rc" -ne 0 ]; then
    bulk=0
    echo "=== again without the TMA's bulk copies (FAST_CUDA_TEST_BULK_COPIES=0)"
    FAST_CUDA_TEST_BULK_COPIES=0 timeout 120 "$test_bin"
    echo "fast_cuda_gpu_test without bulk copies: exit $?"
  fi
  echo "=== memcheck (FAST_CUDA_TEST_STEPS=3)"
  FAST_CUDA_TEST_BULK_COPIES=$bulk FAST_CUDA_TEST_STEPS=3 timeout 90 "$cs" --tool memcheck \
    --leak-check no "$test_bin"
  echo "memcheck: exit $?"
  echo "bulk copies tested: $bulk"
} > "$out/gpu_test.txt" 2>&1
bulk=$(sed -n 's/^bulk copies tested: //p' "$out/gpu_test.txt")
bf16_ok=$(grep -c -E '^\[ +OK \] .*KDA_safe_bf16act_bf16state_K128_Q4_F4_(large_grid_)?3xtf32' \
  "$out/gpu_test.txt")
bf16_runs=$(grep -c -E '^\[ RUN +\] .*KDA_safe_bf16act_bf16state_K128_Q4_F4_(large_grid_)?3xtf32' \
  "$out/gpu_test.txt")
# Two cases, each run twice or three times (plain, again without the bulk
# copies if the first run failed, under memcheck).
echo "piped pass, bf16 state rows: $bf16_ok of $bf16_runs runs passed" >> "$out/gpu_test.txt"
echo "1. tests: $(elapsed) s"
grep -E '^\[  (PASSED|FAILED) |exit [0-9]+|ERROR SUMMARY|of [0-9]+ runs|bulk copies tested' \
  "$out/gpu_test.txt"

[ "$last_step" -le 1 ] && exit 0

# 2. The benchmark and its tables.
bulk_flag=--fast_bulk_copies=$([ "$bulk" = 1 ] && echo true || echo false)
timeout 360 "$bin/kda_bench" --iters=15 --fast_checkpoint_numerics=false "$bulk_flag" \
  > "$out/kda_bench.md" 2>&1
echo "2. kda_bench: exit $?, $(elapsed) s"
{
  echo "## Summary (summary_table.py)"
  python3 "$here/summary_table.py" "$out/kda_bench.md"
  for set in piped prefetch_checkpoint; do
    echo
    echo "## Schedules: --set=$set (schedule_table.py, N = 64, 256)"
    python3 "$here/schedule_table.py" "$out/kda_bench.md" --set="$set" --ns=64,256
  done
  echo
  echo "## Schedules: --set=ring_values (schedule_table.py, N = 1)"
  python3 "$here/schedule_table.py" "$out/kda_bench.md" --set=ring_values --ns=1
  echo
  echo "## Schedules: --set=window_loads (schedule_table.py, N = 1)"
  python3 "$here/schedule_table.py" "$out/kda_bench.md" --set=window_loads --ns=1
  echo
  echo "## Floors: --set=floors (schedule_table.py, every N)"
  python3 "$here/schedule_table.py" "$out/kda_bench.md" --set=floors --ns=1,16,64,256
} > "$out/tables.md" 2>&1

[ "$last_step" -le 2 ] && exit 0

# 3. Commit's fold kernel at N = 256, pipelined (the served schedule) and
# unstaged (kda_bench's direct-call rows launch it), fp32 state rows
# (template arguments: FastFoldSchedule::Staging 3 and 1).
for which in pipelined:3 unstaged:1; do
  stem=fold_${which%%:*}
  VERIFY_REGEX=none FOLD_REGEX="FastFoldKernel.*FoldModeE0E.*StagingE${which##*:}E" FOLD_SKIP=2 \
    FOLD_STEM="$stem" timeout 130 bash "$here/profile_fast.sh" "$bundle" "$scratch/$stem" 256 \
    > /dev/null 2>&1
  cp "$scratch/$stem/ncu_$stem.txt" "$out/" 2>/dev/null
  cp "$scratch/$stem/${stem}_regions.md" "$out/" 2>/dev/null
  echo "3. $stem profile: $(elapsed) s"
done

# 4. Kimi-Linear's N = 1 step, kernel by kernel, time left.
left=$((deadline - $(elapsed)))
if [ "$left" -gt 30 ]; then
  timeout "$((left < 75 ? left : 75))" "$ncu" --clock-control none \
    --metrics gpu__time_duration.sum --csv "$bin/kda_bench" \
    --shapes=kimi_linear --ns=1 --iters=1 --cold=false --fast_checkpoint_numerics=false \
    --fast_snapshots=2 --state_dtypes=fp32 --fast_verify_schedules=false \
    --fast_fold_schedules=false > "$out/n1_kernels.csv" 2>&1
  echo "4. N = 1 kernels: exit $?, $(elapsed) s"
fi
