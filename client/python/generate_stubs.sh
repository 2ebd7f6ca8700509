#!/bin/sh
# Generates specstate/v1/specstate_pb2.py and specstate_pb2_grpc.py next to
# this script from proto/specstate/v1/specstate.proto, for using or installing
# the package outside Bazel (Bazel generates its own copies):
#
#   client/python/generate_stubs.sh && pip install client/python
#
# Uses `$PYTHON -m grpc_tools.protoc` when grpcio-tools is installed
# (PYTHON defaults to python3), else protoc and grpc_python_plugin from PATH
# (Debian: apt-get install protobuf-compiler protobuf-compiler-grpc).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
proto_root=${SPECSTATE_PROTO_ROOT:-$here/../../proto}
proto=specstate/v1/specstate.proto
python=${PYTHON:-python3}
if [ ! -f "$proto_root/$proto" ]; then
  echo "generate_stubs.sh: $proto_root/$proto not found (set SPECSTATE_PROTO_ROOT)" >&2
  exit 1
fi
if "$python" -c "import grpc_tools.protoc" 2>/dev/null; then
  "$python" -m grpc_tools.protoc -I"$proto_root" --python_out="$here" --grpc_python_out="$here" \
    "$proto_root/$proto"
elif command -v protoc >/dev/null && command -v grpc_python_plugin >/dev/null; then
  protoc -I"$proto_root" --python_out="$here" --grpc_out="$here" \
    --plugin=protoc-gen-grpc="$(command -v grpc_python_plugin)" "$proto_root/$proto"
else
  echo "generate_stubs.sh: need grpcio-tools (pip install grpcio-tools) or protoc and" \
       "grpc_python_plugin (apt-get install protobuf-compiler protobuf-compiler-grpc)" >&2
  exit 1
fi
echo "generated $here/specstate/v1/specstate_pb2.py and specstate_pb2_grpc.py"
