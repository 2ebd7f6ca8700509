"""Small encoders of specstate.v1's wire shared by Client and Session: the
health check's bytes (grpc.health.v1 without its generated stubs), a call's
ordering, its wait and signal, an index tensor's rows."""
from __future__ import annotations

from typing import Any, Optional, Union

import grpc

from specstate.errors import SpecStateError
from specstate.v1 import specstate_pb2 as pb

_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def health_request(service: str) -> bytes:
    """grpc.health.v1.HealthCheckRequest{service} in wire format (field 1, string)."""
    data = service.encode()
    out = bytearray(b"\x0a" if data else b"")
    if data:
        n = len(data)
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
        out += data
    return bytes(out)


def health_status(data: bytes) -> str:
    """The status name in a grpc.health.v1.HealthCheckResponse (field 1, enum)."""
    i, status = 0, 0
    while i < len(data):
        key = data[i]
        i += 1
        if key & 7 == 0:  # varint
            value, shift = 0, 0
            while True:
                b = data[i]
                i += 1
                value |= (b & 0x7F) << shift
                shift += 7
                if not b & 0x80:
                    break
            if key >> 3 == 1:
                status = value
        else:  # no other field is defined; stop at anything unexpected
            break
    return _HEALTH_STATUS.get(status, str(status))


def ordering_of(ordering: Union[None, str, int], wait: Any, signal: Any) -> int:
    if ordering is None:
        return pb.ASYNC if (wait is not None or signal is not None) else pb.ORDERING_UNSPECIFIED
    if isinstance(ordering, str):
        try:
            return {"sync": pb.SYNC, "async": pb.ASYNC}[ordering.lower()]
        except KeyError:
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"ordering {ordering!r}: expected 'sync' or 'async'") from None
    return int(ordering)


def signal_of(x: Any) -> Optional[pb.Signal]:
    """A Signal from a Doorbell, IpcEvent, Signal or torch interprocess event."""
    if x is None or isinstance(x, pb.Signal):
        return x
    if isinstance(x, pb.Doorbell):
        return pb.Signal(doorbell=x)
    if isinstance(x, pb.IpcEvent):
        return pb.Signal(event=x)
    if hasattr(x, "ipc_handle"):
        return pb.Signal(event=pb.IpcEvent(handle=bytes(x.ipc_handle())))
    raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"wait/signal: expected a Doorbell (session.doorbell(...)), an IpcEvent "
                         f"or a torch interprocess event, got {type(x).__name__}")


def rows_of(index: pb.IndexTensor) -> int:
    if index.HasField("values"):
        return int(index.values.shape[0]) if index.values.shape else len(index.values.values)
    return int(index.region.shape[0]) if index.region.shape else 0


def set_signals(request: Any, wait: Any, signal: Any) -> None:
    w, s = signal_of(wait), signal_of(signal)
    if w is not None:
        request.wait.CopyFrom(w)
    if s is not None:
        request.signal.CopyFrom(s)
