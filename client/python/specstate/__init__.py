"""Python client of SpecState, the speculative-decoding state service (specstated).

    import specstate
    client = specstate.Client("unix:///tmp/specstate.sock")
    with client.session("my-scheduler", drive=True) as session:
        ...

Tensor parallelism (one service per GPU): ``specstate.connect_ranks([addr0,
addr1, ...])`` gives one Client per rank, the layouts checked to be the equal
parts of one model (:mod:`specstate.ranks`).

Modules: :mod:`specstate.client` (Client, Session), :mod:`specstate.shm`
(POSIX shared memory and the pools on the CPU backend), :mod:`specstate.cuda`
(torch / CUDA backend; imports torch lazily), :mod:`specstate.kit` (the
integration kit for an inference engine in torch: the pools as torch tensors,
a Runner that drives a decode step; imported on first use, needs torch),
:mod:`specstate.errors` (SpecStateError and its families: InvalidInput,
FailedPrecondition, LostSteps, Unavailable, Timeout, ...), :mod:`specstate.dtypes` (the
wire dtypes; numpy bf16 is uint16 bits), :mod:`specstate.v1` (generated
protobuf / gRPC modules: ``specstate.v1.specstate_pb2``).
"""
try:
    from specstate.v1 import specstate_pb2 as pb  # noqa: F401
    from specstate.v1 import specstate_pb2_grpc  # noqa: F401
except ImportError as _e:  # pragma: no cover - depends on the install
    if "specstate_pb2" not in str(_e):
        raise
    raise ImportError(
        "specstate.v1.specstate_pb2 is missing: generate the stubs with "
        "client/python/generate_stubs.sh (or build //client/python:specstate with Bazel)") from _e

from specstate.client import Client, Session
from specstate.dtypes import BF16, FP16, FP32, INT32, from_bfloat16, to_bfloat16
from specstate.errors import (DataLoss, ExpandableSegmentsError, FailedPrecondition, Internal,
                              InvalidInput, LostSteps, ResourceExhausted, SpecStateError, Timeout,
                              Unavailable)
from specstate.ranks import check_rank_layouts, connect_ranks
from specstate.shm import MappedPools, SharedBuffer, ring, wait_counter

__all__ = [
    "BF16", "FP16", "FP32", "INT32", "Client", "DataLoss", "ExpandableSegmentsError",
    "FailedPrecondition", "Internal", "InvalidInput", "LostSteps", "MappedPools",
    "ResourceExhausted", "Session", "SharedBuffer", "SpecStateError", "Timeout", "Unavailable",
    "check_rank_layouts", "connect_ranks", "from_bfloat16", "pb", "ring", "to_bfloat16",
    "wait_counter",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # specstate.kit needs torch: imported on first use, so the package imports without it.
    if name == "kit":
        import importlib  # noqa: PLC0415
        return importlib.import_module("specstate.kit")
    raise AttributeError(f"module 'specstate' has no attribute {name!r}")
