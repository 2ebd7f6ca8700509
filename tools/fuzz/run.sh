#!/usr/bin/env bash
# Builds the fuzz target with clang (libFuzzer + AddressSanitizer +
# UndefinedBehaviorSanitizer) and runs it, bounded, over the committed
# corpus. Ends with "1 passed, 0 failed" or "0 passed, 1 failed".
#   tools/fuzz/run.sh [--seconds=60] [--jobs=1] [--keep]   # --keep: add new inputs to the corpus (corpus.tar.xz)
# Outside Bazel on purpose: Bazel's one C++ toolchain is gcc's, and switching
# its compiler would reconfigure (and rebuild) everything else.
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=60
keep=0
for arg in "$@"; do
  case "$arg" in
    --seconds=*) seconds=${arg#--seconds=} ;;
    --keep) keep=1 ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
fail() { echo "fuzz: $*"; echo "0 passed, 1 failed"; exit 1; }

tools/install_deps.sh || fail "installing the build packages failed"
missing=()
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null || fail "cannot install ${missing[*]}"
fi

out=${FUZZ_OUT:-/tmp/specstate-fuzz}
mkdir -p "$out/gen" "$out/obj"
# (The gRPC stubs too: a transfer's destination calls its source.)
protoc -Iproto --cpp_out="$out/gen" --grpc_out="$out/gen" \
  --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" proto/specstate/v1/specstate.proto ||
  fail "protoc failed"
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -ffp-contract=off
       -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
       -I. -I"$out/gen" $(pkg-config --cflags protobuf grpc++))
# The engine's own sources, as its Bazel target has them in the CPU-only
# build (so that a moved or added file needs no edit here), and the target's.
mapfile -t sources < <(bazel query --repo_env=SPECSTATE_CUDA=0 --noshow_progress \
  'kind("source file", deps(//server/engine:engine))' 2>/dev/null |
  grep -E '^//(server|kernels)[/:]' | grep -E '\.cc$' | sed -e 's|^//||' -e 's|:|/|')
[ ${#sources[@]} -gt 10 ] || fail "bazel query found no sources of //server/engine:engine"
sources+=("$out/gen/specstate/v1/specstate.pb.cc" "$out/gen/specstate/v1/specstate.grpc.pb.cc"
          tools/fuzz/engine_fuzzer.cc)
objects=()
pids=()
for src in "${sources[@]}"; do
  obj="$out/obj/$(echo "$src" | tr '/' '_').o"
  objects+=("$obj")
  # Rebuilt when the source is newer (headers: a clean $out rebuilds all).
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ]; then
    clang++ "${flags[@]}" -c "$src" -o "$obj" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$(nproc)" ]; then wait "${pids[0]}" || fail "compiling failed"; pids=("${pids[@]:1}"); fi
  fi
done
for p in "${pids[@]}"; do wait "$p" || fail "compiling failed"; done
absl="absl_base absl_status absl_statusor absl_str_format absl_strings absl_synchronization
      absl_time absl_hash absl_raw_hash_set"
clang++ -fsanitize=fuzzer,address,undefined "${objects[@]}" -o "$out/engine_fuzzer" \
  $(pkg-config --libs protobuf grpc++ $absl) -ldl -lpthread || fail "linking failed"

# The corpus is one archive (hundreds of small inputs would crowd the tree).
corpus=tools/fuzz/corpus.tar.xz
work=$(mktemp -d /tmp/fuzz-corpus.XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -xJf "$corpus" -C "$work" || fail "cannot unpack $corpus"
echo "fuzz: $(ls "$work" | wc -l) corpus inputs, ${seconds} s"
# The pools are checked after every call; a crash, a sanitizer report or a
# changed pool on a rejected call ends the run with a non-zero status.
ASAN_OPTIONS=abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  "$out/engine_fuzzer" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix="$out/" "$work" 2>&1 | tail -n 25
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail "the fuzz target failed (exit $rc); the input is under $out/"
if [ "$keep" -eq 1 ]; then
  # Minimized by libFuzzer's merge, then packed reproducibly (sorted names,
  # no times or owners), so an unchanged corpus packs to the same bytes.
  merged=$(mktemp -d /tmp/fuzz-merged.XXXXXX)
  "$out/engine_fuzzer" -merge=1 "$merged" "$work" >/dev/null 2>&1
  tar --sort=name --mtime='@0' --owner=0 --group=0 --numeric-owner -C "$merged" \
    -cJf "$corpus" . || fail "cannot pack $corpus"
  echo "fuzz: corpus now $(ls "$merged" | wc -l) inputs"
  rm -rf "$merged"
fi
echo "1 passed, 0 failed"
