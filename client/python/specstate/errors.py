"""The exceptions every SpecState call raises.

Every failure is a :class:`SpecStateError` carrying its gRPC status code, and
also an instance of the subclass for the *family* of that code, by what a
scheduler must do about it:

- :class:`InvalidInput` (INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND,
  ALREADY_EXISTS): fix the call (a shape, a bound, a region name).
- :class:`FailedPrecondition` (FAILED_PRECONDITION): the order of calls is wrong.
- :class:`LostSteps` (a FailedPrecondition: a step in flight across a restart
  of specstated): re-run the step from Verify under a new step id.
- :class:`Unavailable` (UNAVAILABLE): ``resume()``, then re-run the step.
- :class:`Timeout` (DEADLINE_EXCEEDED): the service, or a doorbell, did not
  answer in time.
- :class:`ResourceExhausted` (RESOURCE_EXHAUSTED): fewer rows, smaller buffers.
- :class:`DataLoss` (DATA_LOSS): a region changed under a call.
- :class:`Internal` (INTERNAL, UNKNOWN and the rest): a bug or a device fault.

``SpecStateError(code, message)`` itself returns an instance of the code's
class, so ``except specstate.SpecStateError`` still catches everything and
``except specstate.Unavailable`` catches exactly the UNAVAILABLE ones,
whichever part of the package raised them.
"""
from __future__ import annotations

from typing import Any, Dict

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

    def __new__(cls, *args: Any, **kwargs: Any) -> "SpecStateError":
        # SpecStateError(code, message) is an instance of the code's family.
        if cls is SpecStateError:
            code = args[0] if args else kwargs.get("code")
            cls = _FAMILY.get(code, Internal)
        return super().__new__(cls)

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, method: str, address: str = "") -> "SpecStateError":
        """Wraps a ``grpc.RpcError`` raised by `method` (an instance of the code's family)."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else None) or str(error)
        if code == grpc.StatusCode.UNAVAILABLE and address:
            details = f"{details} (is specstated running at {address}?)"
        return SpecStateError(code, f"{method}: {details}")

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.code, self.message))


def _rebuild(cls: type, code: grpc.StatusCode, message: str) -> SpecStateError:
    error = Exception.__new__(cls)
    SpecStateError.__init__(error, code, message)
    return error


class InvalidInput(SpecStateError):
    """A malformed call: a dtype, shape, stride, index or count past its bound,
    an unknown region (INVALID_ARGUMENT, OUT_OF_RANGE, NOT_FOUND,
    ALREADY_EXISTS). Nothing was written; fix the input."""


class FailedPrecondition(SpecStateError):
    """The call is well formed but the state is not (FAILED_PRECONDITION): not
    the driver, parameters not loaded, a step not verified or already
    committed, a block with pending tokens given to another request."""


class LostSteps(FailedPrecondition):
    """A step that was in flight when specstated restarted (FAILED_PRECONDITION):
    nothing of it was committed; re-run it from Verify under a new step id."""


class Unavailable(SpecStateError):
    """specstated cannot be reached (UNAVAILABLE): after a restart with kept
    pools, ``session.resume()`` / ``runner.resume()``, then re-run the step."""


class Timeout(SpecStateError):
    """A deadline passed (DEADLINE_EXCEEDED): a call, or a doorbell the service
    did not signal in time."""


class ResourceExhausted(SpecStateError):
    """Out of memory or capacity (RESOURCE_EXHAUSTED)."""


class DataLoss(SpecStateError):
    """A region its owner truncated while a call used it (DATA_LOSS)."""


class Internal(SpecStateError):
    """INTERNAL, UNKNOWN and every other code: a bug or a device fault."""


_FAMILY: Dict[Any, type] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInput,
    grpc.StatusCode.OUT_OF_RANGE: InvalidInput,
    grpc.StatusCode.NOT_FOUND: InvalidInput,
    grpc.StatusCode.ALREADY_EXISTS: InvalidInput,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DATA_LOSS: DataLoss,
}


class ExpandableSegmentsError(FailedPrecondition):
    """A torch tensor lives in an expandable segment, which CUDA IPC cannot open.

    Raised (code FAILED_PRECONDITION) when a tensor's ``_share_cuda_()`` handle
    is of torch's expandable-segments kind (``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True``).
    """

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)
