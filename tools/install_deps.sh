#!/usr/bin/env bash
# Installs the Debian 12 packages SpecState builds and tests with (offline
# Bazel, gRPC, protobuf, Abseil, GoogleTest, prometheus-cpp, Python's grpcio
# and numpy); with --tests also CPU torch, for the Python integration kit's
# tests (tools/test.sh passes it; the quick start and the image build do not
# need it).
# Safe to run again: apt-get skips what is there.
set -euo pipefail
packages=(
  bazel-bootstrap bazel-rules-java
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libgtest-dev libgmock-dev prometheus-cpp-dev pkg-config g++
  libucx-dev
  python3 python3-grpcio python3-protobuf python3-numpy python3-yaml
)
if [ "${1:-}" = "--tests" ]; then
  packages+=(python3-torch)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing: ${missing[*]}" >&2
$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
