#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries and bundles them, with the shared
# libraries they need (all but the C runtime and the driver), into
# DEST/bundle.tar.xz, which runs on a GPU machine without Bazel:
#   tools/gpu/bundle.sh [DEST=.gpu]
# Then, there:
#   python3 -c "import tarfile; tarfile.open('DEST/bundle.tar.xz').extractall('/tmp/b')"
#   /tmp/b/run_suite.sh /tmp/b OUTDIR
# xz -9e's 64 MiB window finds the kernels every binary links (each ~35 MB
# of mostly CUDA code) once: six binaries come to ~30-55 MB, under the
# device tool's 64 MiB carry, where gzip made ~94 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.gpu}
default_targets="//server:specstated //client/cli:specstatectl //kernels:kda_kernels_gpu_test
  //tests/integration:gpu_service_test //tests/bench:kda_bench //tests/bench:service_bench //tests/bench:handoff_bench
  //tools/gpu/trace:libcupti_trace.so //keeper:specstate-keeper //tools/gpu:vmm_probe
  //kernels/fast:fast_cuda_gpu_test //tests/bench:fast_bench //tests/bench:host_tier_bench"
read -r -a targets <<< "$(echo ${BUNDLE_TARGETS:-$default_targets})"
bazel build "${targets[@]}"
final=$dest
dest=$(mktemp -d)
mkdir -p "$dest/bin" "$dest/lib" "$dest/runfiles/specstate/server" "$dest/runfiles/specstate/client/cli" \
  "$dest/runfiles/specstate/keeper"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so)'
for target in "${targets[@]}"; do
  bin="bazel-bin/$(echo "${target#//}" | tr ':' '/')"
  cp -L "$bin" "$dest/bin/"
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -n "$path" ] && [ -e "$path" ] && cp -Ln "$path" "$dest/lib/" 2>/dev/null || true
  done
done
# UCX, which specstated loads at its first transfer (dlopen: no ldd sees it),
# with its transport modules where libucs looks for them (lib/ucx) and what
# they link.
ucx=$(ldconfig -p | awk '/libucp\.so\.0 / {p = $NF} END {print p}')
if [ -n "$ucx" ]; then
  mkdir -p "$dest/lib/ucx"
  cp -Ln "$ucx" "$dest/lib/"
  cp -Ln "$(dirname "$ucx")"/ucx/*.so.0 "$dest/lib/ucx/"
  for so in "$ucx" "$(dirname "$ucx")"/ucx/*.so.0; do
    ldd "$so" | awk '/=>/ {print $1, $3}' | while read -r name path; do
      [[ "$name" =~ $skip ]] && continue
      [ -n "$path" ] && [ -e "$path" ] && cp -Ln "$path" "$dest/lib/" 2>/dev/null || true
    done
  done
else
  echo "bundle.sh: no libucp.so.0 here (libucx-dev): the bundle's transfers will be UNAVAILABLE" >&2
fi
# Tests find the server and the CLI through their runfiles, as under Bazel
# (hard links: the archive holds each binary once). A BUNDLE_TARGETS without
# them (kernel benchmarks only) leaves them out.
for runfile in server/specstated client/cli/specstatectl keeper/specstate-keeper; do
  bin="$dest/bin/$(basename "$runfile")"
  if [ -e "$bin" ]; then ln "$bin" "$dest/runfiles/specstate/$(dirname "$runfile")/"; fi
done
cp tools/gpu/run_suite.sh tools/gpu/examples.sh tools/gpu/diagnose.sh tools/gpu/profile_kernels.sh tools/gpu/ab_servers.sh \
  tools/gpu/trace/timeline.py tools/start_services.sh "$dest/"
# The Python client with freshly generated stubs and its tests, and a
# specstated launcher that finds the bundled libraries (the Python process
# itself must not load them: torch and grpcio bring their own).
mkdir -p "$dest/python"
cp -r client/python/specstate client/python/tests client/python/examples "$dest/python/"
find "$dest/python" -name __pycache__ -prune -exec rm -rf {} +
SPECSTATE_PROTO_ROOT=$PWD/proto sh client/python/generate_stubs.sh
mv client/python/specstate/v1/specstate_pb2*.py "$dest/python/specstate/v1/"
cat > "$dest/specstated" <<'LAUNCHER'
#!/bin/sh
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/specstated" "$@"
LAUNCHER
chmod +x "$dest/specstated"
rm -rf "$final"
mkdir -p "$final"
tar -C "$dest" -cf - . | xz -T0 -9e > "$final/bundle.tar.xz"
rm -rf "$dest"
du -sh "$final/bundle.tar.xz" | awk '{print "bundled " $1 " into " $2}'
