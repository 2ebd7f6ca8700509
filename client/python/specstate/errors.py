"""The exception every SpecState call raises."""
from __future__ import annotations

import grpc


class SpecStateError(Exception):
    """An error of the service or of this client, with its gRPC status code.

    Attributes:
        code: a ``grpc.StatusCode`` (the service's code; UNAVAILABLE when the
            server cannot be reached; client-side checks use the code the
            service would use: INVALID_ARGUMENT, NOT_FOUND, ...).
        message: the human-readable message (the service's message names the
            field, the row and the bound that failed).
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, method: str, address: str = "") -> "SpecStateError":
        """Wraps a ``grpc.RpcError`` raised by `method`."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else None) or str(error)
        if code == grpc.StatusCode.UNAVAILABLE and address:
            details = f"{details} (is specstated running at {address}?)"
        return cls(code, f"{method}: {details}")


class ExpandableSegmentsError(SpecStateError):
    """A torch tensor lives in an expandable segment, which CUDA IPC cannot open.

    Raised (code FAILED_PRECONDITION) when a tensor's ``_share_cuda_()`` handle
    is of torch's expandable-segments kind (``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True``).
    """

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)
