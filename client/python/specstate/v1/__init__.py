"""Generated protobuf and gRPC modules of the specstate.v1 wire contract.

`specstate_pb2.py` and `specstate_pb2_grpc.py` are generated, not committed:
Bazel's //client/python:stubs genrule writes them, and
client/python/generate_stubs.sh does it for installs outside Bazel.
"""
