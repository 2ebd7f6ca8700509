#!/usr/bin/env bash
# A kernel change timed before and after on one GPU, the runs alternated
# (before, after, before, after, ...), in a bundle small enough for the
# device tool's 64 MiB carry (two kda_bench builds, no service).
#
# Here, after building the change (bazel build //tests/bench:kda_bench),
# with the build before it saved as a file (cp -L bazel-bin/tests/bench/kda_bench
# /tmp/kda_bench_before, before the change):
#   tools/gpu/kernel_ab.sh pack /tmp/kda_bench_before [DEST=.gpu]
#     -> DEST/kernel_ab.tar.xz (about 53 MB; carry DEST)
#   KERNEL_AB_EXTRA="bazel-bin/kernels/fast/fast_cuda_gpu_test" adds those
#   binaries to bin/ (the change's own test in the same call), packed with
#   xz -9e, whose 64 MiB window finds the kernels the binaries share (two
#   kda_bench and fast_cuda_gpu_test came to 52 MiB on 2026-12-08).
# There:
#   mkdir -p /tmp/ab && tar xJf .gpu/kernel_ab.tar.xz -C /tmp/ab
#   tools/gpu/kernel_ab.sh run /tmp/ab $OUT [ROUNDS=2] [kda_bench flags...]
#     -> OUT/before_R.md, OUT/after_R.md, OUT/compare.md (compare_bench.py:
#        cold L2, CUDA graph, each side the mean of its rounds, rewritten
#        after every round; the rows whose code did not change show the
#        runs' noise).
# Flags given replace the defaults: --iters=15 --fast_checkpoint_numerics=false
# --fast_fold_schedules=false (at N = 1 a run takes about 10 s on an H100; at
# N = 16, 64, 256 with --fast_verify_schedules=false about 200 s: one round a call).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "${1:-}" in
  pack)
    before=${2:?kernel_ab.sh pack BEFORE_KDA_BENCH [DEST]}
    [ -x "$before" ] || { echo "kernel_ab.sh: $before is not an executable" >&2; exit 2; }
    before=$(realpath "$before")
    mkdir -p "${3:-.gpu}"
    dest=$(realpath "${3:-.gpu}")
    cd "$here/../.."
    after=bazel-bin/tests/bench/kda_bench
    [ -x "$after" ] || { echo "kernel_ab.sh: build //tests/bench:kda_bench first" >&2; exit 2; }
    if cmp -s "$before" "$after"; then
      echo "kernel_ab.sh: $before and $after are the same binary: nothing to compare" >&2
      exit 2
    fi
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/bin" "$stage/lib"
    cp -L "$after" "$stage/bin/kda_bench"
    cp -L "$before" "$stage/bin/kda_bench_before"
    level=-6
    for extra in ${KERNEL_AB_EXTRA:-}; do
      [ -x "$extra" ] || { echo "kernel_ab.sh: $extra (KERNEL_AB_EXTRA) is not an executable" >&2; exit 2; }
      cp -L "$extra" "$stage/bin/"
      level=-9e
    done
    skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so)'
    for bin in "$stage"/bin/*; do
      ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
        [[ "$name" =~ $skip ]] && continue
        if [ -n "$path" ] && [ -e "$path" ]; then cp -Ln "$path" "$stage/lib/" 2>/dev/null || true; fi
      done
    done
    tar -C "$stage" -cf - bin lib | xz -T0 "$level" > "$dest/kernel_ab.tar.xz"
    bytes=$(stat -c %s "$dest/kernel_ab.tar.xz")
    echo "packed $((bytes / 1048576)) MiB into $dest/kernel_ab.tar.xz"
    if [ "$bytes" -gt $((60 * 1048576)) ]; then
      echo "kernel_ab.sh: over 60 MiB: the device tool carries 64 MiB with the tree" >&2
      exit 1
    fi
    ;;
  run)
    bundle=$(cd "${2:?kernel_ab.sh run BUNDLE OUT [ROUNDS] [FLAGS...]}" && pwd)
    out=${3:?kernel_ab.sh run BUNDLE OUT [ROUNDS] [FLAGS...]}
    rounds=${4:-2}
    shift $(($# < 4 ? $# : 4))
    flags=("$@")
    [ ${#flags[@]} -eq 0 ] && flags=(--iters=15 --fast_checkpoint_numerics=false
      --fast_fold_schedules=false)
    mkdir -p "$out"
    export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    pairs=()
    for r in $(seq 1 "$rounds"); do
      for side in before after; do
        bin=$bundle/bin/kda_bench
        [ "$side" = before ] && bin=$bundle/bin/kda_bench_before
        start=$SECONDS
        set +e
        timeout 280 "$bin" "${flags[@]}" > "$out/${side}_$r.md" 2>&1
        rc=$?
        set -e
        echo "$side $r: exit $rc in $((SECONDS - start)) s"
        [ "$rc" -eq 0 ] || exit "$rc"
      done
      pairs+=("$out/before_$r.md" "$out/after_$r.md")
      # After every round, so that a call cut short still brings back the
      # table of the rounds it finished.
      python3 "$here/compare_bench.py" "${pairs[@]}" > "$out/compare.md"
      echo "round $r: $(tail -n 1 "$out/compare.md")"
    done
    ;;
  *)
    sed -n '2,18p' "$0" >&2
    exit 2
    ;;
esac
