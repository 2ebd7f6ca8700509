"""Client and Session: the gRPC calls of specstate.v1.SpecState.

    client = Client("unix:///tmp/specstate.sock")
    layout = client.layout()
    with client.session("my-scheduler", drive=True) as session:
        session.register(buffer, "acts")
        step = session.next_step()
        session.verify(step, layer, q=q, k=k, v=v, g=g, beta=beta, o=o,
                       query_start_loc=[0, 3, 7], state_indices=[5, 9])
        session.commit(step, num_accepted=[2, 4])

Every failure raises :class:`SpecStateError` with the gRPC status code.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator, Optional, Union

import grpc
import numpy as np

from specstate import dtypes
from specstate.errors import SpecStateError
from specstate.regions import Region, RegionCache, describe, is_torch_tensor
from specstate.shm import MappedPools, SharedBuffer
from specstate.v1 import specstate_pb2 as pb
from specstate.v1 import specstate_pb2_grpc as pb_grpc

_log = logging.getLogger("specstate")

_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _health_request(service: str) -> bytes:
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


def _health_status(data: bytes) -> str:
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


def _ordering(ordering: Union[None, str, int], wait: Any, signal: Any) -> int:
    if ordering is None:
        return pb.ASYNC if (wait is not None or signal is not None) else pb.ORDERING_UNSPECIFIED
    if isinstance(ordering, str):
        try:
            return {"sync": pb.SYNC, "async": pb.ASYNC}[ordering.lower()]
        except KeyError:
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"ordering {ordering!r}: expected 'sync' or 'async'") from None
    return int(ordering)


def _signal(x: Any) -> Optional[pb.Signal]:
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


class Client:
    """A connection to specstated.

    Args:
        address: ``unix:///PATH`` or ``HOST:PORT`` (the forms of specstated --listen).
        connect_timeout: seconds to wait for the channel to come up;
            UNAVAILABLE when it does not.
        deadline: per-call deadline of unary calls, seconds.
    """

    def __init__(self, address: str, *, connect_timeout: float = 5.0,
                 deadline: float = 60.0) -> None:
        if not address:
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT, "server address is empty")
        self.address = address
        self.deadline = deadline
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 512 << 20)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise SpecStateError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot connect to specstated at {address} within {connect_timeout:g} s "
                "(is it running? see specstated --listen)") from None
        self.stub = pb_grpc.SpecStateStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=_health_request,
            response_deserializer=_health_status)

    def call(self, method: str, request: Any) -> Any:
        """Calls unary `method` ("GetLayout", ...) with the client's deadline."""
        try:
            return getattr(self.stub, method)(request, timeout=self.deadline)
        except grpc.RpcError as e:
            raise SpecStateError.from_rpc(e, method, self.address) from None

    # ---- read-only calls ----

    def layout(self) -> pb.Layout:
        """The service's layout (GetLayout)."""
        return self.call("GetLayout", pb.GetLayoutRequest())

    def export_pools(self) -> pb.ExportPoolsResponse:
        """How to map every pool (ExportPools)."""
        return self.call("ExportPools", pb.ExportPoolsRequest())

    def map_pools(self) -> Any:
        """The pools mapped into this process: numpy views (CPU backend,
        :class:`specstate.shm.MappedPools`) or torch tensors (CUDA backend,
        :class:`specstate.cuda.CudaPools`)."""
        export = self.export_pools()
        if export.backend == pb.CUDA:
            from specstate.cuda import CudaPools  # noqa: PLC0415 (needs torch)
            return CudaPools(export)
        return MappedPools(export)

    def read_state(self, layer: int, block: int, values: bool = False) -> pb.ReadStateResponse:
        """Summary (and with `values`, every value) of one block of one layer."""
        return self.call("ReadState", pb.ReadStateRequest(layer=layer, block=block, values=values))

    def stats(self) -> pb.Stats:
        """Counters and latency histograms (GetStats)."""
        return self.call("GetStats", pb.GetStatsRequest())

    def list_regions(self, session_id: str = "") -> pb.ListRegionsResponse:
        """Regions of one session, or of every session when `session_id` is empty."""
        return self.call("ListRegions", pb.ListRegionsRequest(session_id=session_id))

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check of `service` ("" = the server): "SERVING", "NOT_SERVING", ..."""
        try:
            return self._health(service, timeout=self.deadline)
        except grpc.RpcError as e:
            raise SpecStateError.from_rpc(e, "Health.Check", self.address) from None

    # ---- sessions ----

    def session(self, client_name: str, drive: bool = False, lease_ms: int = 0) -> "Session":
        """Opens a session (see :class:`Session`); with `drive`, FAILED_PRECONDITION
        naming the holder when another session drives."""
        return Session(self, client_name, drive=drive, lease_ms=lease_ms)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_STOP = object()


class Session:
    """A session: an open Session stream whose lease a background thread renews.

    Use it as a context manager, or call :meth:`close`, which unregisters the
    session's regions and closes the stream (the service then ends the
    session). Registered buffers are remembered in a region cache that turns
    arrays/tensors inside them into RegionTensors.
    """

    def __init__(self, client: Client, client_name: str, drive: bool = False,
                 lease_ms: int = 0) -> None:
        self.client = client
        self.client_name = client_name
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._requests.put(pb.SessionRequest(
            open=pb.OpenSession(client_name=client_name, lease_ms=lease_ms, drive=drive)))
        self._stream = client.stub.Session(self._request_iterator())
        try:
            event = next(self._stream)
        except grpc.RpcError as e:
            self._requests.put(_STOP)
            raise SpecStateError.from_rpc(e, "Session", client.address) from None
        except StopIteration:
            self._requests.put(_STOP)
            raise SpecStateError(grpc.StatusCode.UNKNOWN,
                                 "Session: the service closed the stream without a reply") from None
        self.id: str = event.session_id
        self.driving: bool = event.driving
        self.lease_ms: int = event.lease_ms
        self.regions = RegionCache()
        self._next_region = 0
        self._last_step = 0
        self._step_rows: dict = {}
        self._alive = True
        self._closed = False
        self._end_error: Optional[SpecStateError] = None
        self._stop = threading.Event()
        self._close_lock = threading.Lock()
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"specstate-renew-{self.id}")
        self._renewer.start()

    # ---- the stream ----

    def _request_iterator(self) -> Iterator[pb.SessionRequest]:
        while True:
            item = self._requests.get()
            if item is _STOP:
                return
            yield item

    def _renew_loop(self) -> None:
        # A third of the lease: two renewals may be late before it runs out.
        period = max(self.lease_ms, 30) / 3000.0
        while not self._stop.wait(period):
            self._requests.put(pb.SessionRequest(renew=pb.RenewLease()))
            try:
                event = next(self._stream)
                self.lease_ms = event.lease_ms or self.lease_ms
            except grpc.RpcError as e:
                self._end_error = SpecStateError.from_rpc(e, "Session", self.client.address)
                self._alive = False
                return
            except StopIteration:
                self._alive = False
                return

    @property
    def alive(self) -> bool:
        """Whether the lease is still being renewed (False once the server ended
        the session or the stream broke; :attr:`end_error` then says why)."""
        return self._alive and not self._closed

    @property
    def end_error(self) -> Optional[SpecStateError]:
        return self._end_error

    def close(self) -> None:
        """Unregisters the regions, closes the stream and stops the renewal thread.

        Idempotent; never raises (problems are logged to the "specstate" logger).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._renewer.join()
        if self._alive:
            for name in self.regions.names():
                try:
                    self.unregister(name)
                except SpecStateError as e:
                    _log.warning("closing session %s: %s", self.id, e)
        self._requests.put(_STOP)
        try:
            for _ in self._stream:
                pass
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                _log.info("session %s ended with %s: %s", self.id, e.code().name, e.details())
        self._alive = False

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- regions ----

    def register(self, buffer: Any, name: Optional[str] = None) -> str:
        """Registers a buffer as a region of this session and returns its name.

        `buffer` is a :class:`specstate.shm.SharedBuffer` (or a numpy array
        inside one: the whole buffer is registered), a
        :class:`specstate.cuda.CudaBuffer`, or a CUDA torch tensor (its whole
        storage is registered through ``_share_cuda_()``; see
        :mod:`specstate.cuda` for the expandable-segments caveat). A buffer
        already registered by this session returns its existing name.
        ALREADY_EXISTS when `name` is taken.
        """
        request = pb.RegisterRegionRequest(session_id=self.id)
        if isinstance(buffer, np.ndarray):
            owner = SharedBuffer.owning(buffer)
            if owner is None:
                raise SpecStateError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "this numpy array is not in a SharedBuffer: allocate it with "
                    "specstate.SharedBuffer(...).empty(...) to share it with the service")
            buffer = owner
        if isinstance(buffer, SharedBuffer):
            space, address, nbytes = "host", buffer.address, buffer.nbytes
            request.shm_name = buffer.name
            request.offset_bytes = 0
            request.byte_size = buffer.nbytes
        elif type(buffer).__name__ == "CudaBuffer":
            space, address, nbytes = f"cuda:{buffer.device}", buffer.address, buffer.nbytes
            request.cuda_ipc_handle = buffer.ipc_handle
            request.device = buffer.device
            request.offset_bytes = 0
            request.byte_size = buffer.nbytes
        elif is_torch_tensor(buffer) and buffer.is_cuda:
            from specstate.cuda import torch_region  # noqa: PLC0415 (needs torch)
            found = self.regions.find(buffer.data_ptr(), buffer.data_ptr() + 1,
                                      f"cuda:{buffer.device.index or 0}")
            if found is not None and name in (None, found.name):
                return found.name
            r = torch_region(buffer)
            space, address, nbytes = f"cuda:{r.device}", r.address, r.byte_size
            request.cuda_ipc_handle = r.cuda_ipc_handle
            request.device = r.device
            request.offset_bytes = r.offset_bytes
            request.byte_size = r.byte_size
        else:
            raise SpecStateError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cannot register a {type(buffer).__name__}: expected a SharedBuffer, a "
                "CudaBuffer or a CUDA torch tensor")
        same = self.regions.find_exact(address, nbytes, space)
        if same is not None and name in (None, same.name):
            return same.name
        if name is None:
            name = f"buffer-{self._next_region}"
            self._next_region += 1
        request.name = name
        self.client.call("RegisterRegion", request)
        self.regions.add(Region(name, address, nbytes, space, owner=buffer))
        return name

    def unregister(self, name: str) -> None:
        """Unregisters region `name`; returns once no enqueued work uses it."""
        try:
            self.client.call("UnregisterRegion",
                             pb.UnregisterRegionRequest(session_id=self.id, name=name))
        finally:
            self.regions.remove(name)

    def list_regions(self) -> pb.ListRegionsResponse:
        """This session's regions, as the service sees them."""
        return self.client.list_regions(self.id)

    def tensor(self, x: Any, dtype: Optional[int] = None) -> pb.RegionTensor:
        """The RegionTensor of array/tensor `x` (NOT_FOUND outside every registered buffer).

        numpy uint16 arrays are sent as BF16; pass ``dtype=specstate.FP16`` etc. to override.
        """
        return self.regions.tensor(x, dtype)

    def index(self, x: Any) -> Optional[pb.IndexTensor]:
        """An int32 IndexTensor: a region reference for an int32 array in a
        registered buffer, else the values inline (lists, small arrays)."""
        return self.regions.index(x)

    def doorbell(self, counter: Any, value: int) -> pb.Doorbell:
        """A Doorbell on `counter`: a 4-byte element (numpy uint32/int32 array
        element, or torch tensor element) in a registered buffer."""
        info = describe(counter, dtypes.INT32)
        if info.itemsize != 4:
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "a doorbell counter is one 4-byte element (uint32 or int32)")
        region = self.regions.find(info.address, info.address + 4, info.space)
        if region is None:
            raise SpecStateError(grpc.StatusCode.NOT_FOUND,
                                 "no registered buffer holds this doorbell counter")
        return pb.Doorbell(region=region.name, offset_bytes=info.address - region.address,
                           value=value & 0xFFFFFFFF)

    # ---- driving calls ----

    def next_step(self) -> int:
        """A fresh step id (increasing, unique within the session)."""
        self._last_step += 1
        return self._last_step

    def load_layer_params(self, layer: int, a_log: Any, dt_bias: Any,
                          lower_bound: Optional[float] = None) -> None:
        """Loads one KDA layer's gate parameters: `a_log` [H] and `dt_bias` [H*K], fp32
        (lists or arrays travel inline; fp32 arrays in a registered buffer by reference).
        FAILED_PRECONDITION on a GDN layout (``layout().layer_kind == GDN``): its g
        is the log-decay as the model computed it, and there is nothing to load."""
        request = pb.LoadLayerParamsRequest(session_id=self.id, layer=layer,
                                            a_log=self.regions.floats(a_log),
                                            dt_bias=self.regions.floats(dt_bias))
        if lower_bound is not None:
            request.lower_bound = lower_bound
        self.client.call("LoadLayerParams", request)

    def verify(self, step: int, layer: int, *, q: Any, k: Any, v: Any, g: Any, beta: Any,
               o: Any, query_start_loc: Any = None, state_indices: Any = None,
               num_rows: Optional[int] = None, ordering: Union[None, str, int] = None,
               wait: Any = None, signal: Any = None) -> pb.VerifyResponse:
        """Verifies one layer's speculative window of every row (Verify).

        q, k [T, H, K], v [T, HV, V], g (dense), beta [T, HV], o [T, HV, V]
        (dense, written): arrays/tensors in registered buffers, in the layout's
        activation dtype (numpy: float32, float16, or uint16 bf16 bits). H is
        ``layout().num_heads``, HV ``num_value_heads`` (0: H; KDA always has
        HV = H); g is [T, H, K] on KDA layouts and [T, HV] on GDN ones.
        `query_start_loc` [N+1] and `state_indices` [N] (or [N, C]) are
        required on the step's first Verify and may be omitted after;
        `num_rows` defaults to len(state_indices), then to the step's first
        call. ``ordering="async"`` (implied by `wait`/`signal`) returns once
        enqueued.
        """
        qsl = self.index(query_start_loc)
        idx = self.index(state_indices)
        if num_rows is None:
            if idx is not None:
                num_rows = _rows(idx)
            elif step in self._step_rows:
                num_rows = self._step_rows[step]
            else:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"num_rows: give state_indices on step {step}'s first Verify")
        self._step_rows = {step: num_rows}
        request = pb.VerifyRequest(
            session_id=self.id, step=step, layer=layer, num_rows=num_rows,
            q=self.tensor(q), k=self.tensor(k), v=self.tensor(v), g=self.tensor(g),
            beta=self.tensor(beta), o=self.tensor(o), ordering=_ordering(ordering, wait, signal))
        if qsl is not None:
            request.query_start_loc.CopyFrom(qsl)
        if idx is not None:
            request.state_indices.CopyFrom(idx)
        _set_signals(request, wait, signal)
        return self.client.call("Verify", request)

    def bind_verify_inputs(self, layer: int, *, q: Any, k: Any, v: Any, g: Any, beta: Any,
                           o: Any, query_start_loc: Any = None,
                           state_indices: Any = None) -> pb.BindVerifyInputsResponse:
        """Binds one layer's Verify tensors once, at their capacity (BindVerifyInputs).

        For a scheduler whose buffers stay at fixed addresses (as under CUDA
        graphs): :meth:`verify_bound` then sends only the counts, and the
        service uses the first `num_tokens` tokens and `num_rows` rows of these.
        q, k [max_tokens, H, K], v [max_tokens, HV, V], g (dense; KDA
        [max_tokens, H, K], GDN [max_tokens, HV]), beta [max_tokens, HV], o
        [max_tokens, HV, V] (dense): as in :meth:`verify`.
        `query_start_loc` [max_rows+1] and `state_indices` [max_rows] (or
        [max_rows, C]) are optional, together, and must be int32 arrays in a
        registered buffer: their values change every step, so inline values
        (lists, arrays outside every region) raise INVALID_ARGUMENT here,
        before any call. A layer bound without them cannot start a step (its
        bound Verify uses the step's copy). Binding a layer again replaces its
        binding; unregistering a bound buffer fails the layer's next bound
        Verify (FAILED_PRECONDITION) until it is bound again. The response
        gives ``max_tokens`` and ``max_rows`` (-1 without the indices).
        """
        request = pb.BindVerifyInputsRequest(
            session_id=self.id, layer=layer, q=self.tensor(q), k=self.tensor(k),
            v=self.tensor(v), g=self.tensor(g), beta=self.tensor(beta), o=self.tensor(o))
        for field, value in (("query_start_loc", query_start_loc),
                             ("state_indices", state_indices)):
            t = self.index(value)
            if t is None:
                continue
            # The binding is read at every later Verify: a snapshot of the
            # values would silently go stale.
            if not t.HasField("region"):
                raise SpecStateError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{field}: a binding's index tensors must be int32 arrays in a registered "
                    "buffer (inline values cannot change between steps)")
            getattr(request, field).CopyFrom(t)
        return self.client.call("BindVerifyInputs", request)

    def verify_bound(self, step: int, layer: int, *, num_tokens: int,
                     num_rows: Optional[int] = None, ordering: Union[None, str, int] = None,
                     wait: Any = None, signal: Any = None) -> pb.VerifyResponse:
        """Verify with the layer's bound tensors (:meth:`bind_verify_inputs`).

        Uses the first `num_tokens` tokens of the bound activations and, when
        the binding has them, the first `num_rows` + 1 and `num_rows` entries of
        its query_start_loc and state_indices, read when the call runs (write
        this step's values there first, or before `wait` is signalled). A layer
        bound without them relies on the step's copy, so it cannot be the
        step's first Verify. `num_rows` defaults to the step's earlier call
        (required on the step's first); a later :meth:`verify` of the step may
        omit it too. FAILED_PRECONDITION when the layer has no binding in this
        session; OUT_OF_RANGE past the binding's max_tokens / max_rows.
        Ordering, `wait` and `signal` as in :meth:`verify`.
        """
        if num_rows is None:
            if step not in self._step_rows:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"num_rows: give it on step {step}'s first Verify")
            num_rows = self._step_rows[step]
        self._step_rows = {step: num_rows}
        request = pb.VerifyRequest(
            session_id=self.id, step=step, layer=layer, num_rows=num_rows, bound_inputs=True,
            num_tokens=num_tokens, ordering=_ordering(ordering, wait, signal))
        _set_signals(request, wait, signal)
        return self.client.call("Verify", request)

    def commit(self, step: int, num_accepted: Any, *, request_indices: Any = None,
               block_table: Any = None, num_computed_tokens: Any = None,
               ordering: Union[None, str, int] = None, wait: Any = None,
               signal: Any = None) -> pb.CommitResponse:
        """Folds each row's accepted tokens into its conv and recurrent state, all
        layers (Commit). `num_accepted` [batch]; `request_indices` [N] maps spec
        rows to batch rows; align mode also takes `block_table` [batch, width]
        and `num_computed_tokens` [batch]. A retry of the same step with the same
        arguments returns the first result (``replayed_from_cache``)."""
        request = pb.CommitRequest(session_id=self.id, step=step,
                                   num_accepted=self.index(num_accepted),
                                   ordering=_ordering(ordering, wait, signal))
        for field, value in (("request_indices", request_indices), ("block_table", block_table),
                             ("num_computed_tokens", num_computed_tokens)):
            t = self.index(value)
            if t is not None:
                getattr(request, field).CopyFrom(t)
        _set_signals(request, wait, signal)
        return self.client.call("Commit", request)

    def record_state_blocks(self, step: int, *, idx_mapping: Any, num_sampled: Any,
                            num_computed_tokens: Any, block_table_width: int, state_idx: Any,
                            num_accepted: Any, request_indices: Any = None,
                            ordering: Union[None, str, int] = None, wait: Any = None,
                            signal: Any = None) -> pb.RecordStateBlocksResponse:
        """Align mode, after Commit: writes each request's state block column into
        `state_idx` and 1 into `num_accepted` ([reqs] int32 arrays in a
        registered buffer) (RecordStateBlocks)."""
        request = pb.RecordStateBlocksRequest(
            session_id=self.id, step=step, idx_mapping=self.index(idx_mapping),
            num_sampled=self.index(num_sampled), num_computed_tokens=self.index(num_computed_tokens),
            block_table_width=block_table_width, state_idx=self.tensor(state_idx, dtypes.INT32),
            num_accepted=self.tensor(num_accepted, dtypes.INT32),
            ordering=_ordering(ordering, wait, signal))
        t = self.index(request_indices)
        if t is not None:
            request.request_indices.CopyFrom(t)
        _set_signals(request, wait, signal)
        return self.client.call("RecordStateBlocks", request)


    def flush(self, blocks: Any = None, *, discard: bool = False, layer: Optional[int] = None,
              ordering: Union[None, str, int] = None, wait: Any = None,
              signal: Any = None) -> pb.FlushResponse:
        """Commit mode DEFERRED: replays the tokens a Commit left pending on
        `blocks` (int32 [n], inline or in a registered buffer; entries <= 0 are
        skipped) into the pools, or on every pending block when `blocks` is
        None (Flush). Call it before reading, copying, swapping or freeing a
        block yourself; with `discard`, the pending tokens are forgotten (a
        block being freed). `layer` limits it to one layer. Under EAGER it has
        nothing to do. OUT_OF_RANGE for a block past the pools."""
        request = pb.FlushRequest(session_id=self.id, discard=discard,
                                  ordering=_ordering(ordering, wait, signal))
        t = self.index(blocks)
        if t is not None:
            request.blocks.CopyFrom(t)
        if layer is not None:
            request.layer = layer
        _set_signals(request, wait, signal)
        return self.client.call("Flush", request)


def _rows(index: pb.IndexTensor) -> int:
    if index.HasField("values"):
        return int(index.values.shape[0]) if index.values.shape else len(index.values.values)
    return int(index.region.shape[0]) if index.region.shape else 0


def _set_signals(request: Any, wait: Any, signal: Any) -> None:
    w, s = _signal(wait), _signal(signal)
    if w is not None:
        request.wait.CopyFrom(w)
    if s is not None:
        request.signal.CopyFrom(s)
