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

When specstated restarts with its pools kept (a specstate-keeper, or systemd's
file-descriptor store), a call raises UNAVAILABLE; ``session.resume()`` then
reconnects, opens the session again, puts back its regions, layer parameters
and bindings, and returns what the service kept (``Recover``). The step that
was in flight is refused afterwards (FAILED_PRECONDITION naming it): re-run it
under a new step id.

    try:
        session.commit(step, num_accepted=[2, 4])
    except SpecStateError as e:
        if e.code != grpc.StatusCode.UNAVAILABLE:
            raise
        kept = session.resume()   # re-prefill kept.lost_blocks; re-run the step
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from specstate import dtypes
from specstate.errors import LostSteps, SpecStateError
from specstate.regions import Region, RegionCache, describe, is_torch_tensor
from specstate.shm import MappedPools, SharedBuffer
from specstate.v1 import specstate_pb2 as pb
from specstate.v1 import specstate_pb2_grpc as pb_grpc
from specstate import wire

_log = logging.getLogger("specstate")

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
        # A restarted specstated is found again within a second (gRPC's
        # default reconnect backoff starts at 1 s and grows to 120 s).
        self._channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 512 << 20),
                              ("grpc.initial_reconnect_backoff_ms", 100),
                              ("grpc.min_reconnect_backoff_ms", 100),
                              ("grpc.max_reconnect_backoff_ms", 1000),
                              # A connection of its own, not one shared with
                              # another channel (to a service since restarted).
                              ("grpc.use_local_subchannel_pool", 1)])
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
            "/grpc.health.v1.Health/Check", request_serializer=wire.health_request,
            response_deserializer=wire.health_status)

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

    def list_saved(self) -> pb.ListSavedResponse:
        """The host tier's keys, most recently used first, and its capacity
        (ListSaved; capacity 0: no host tier)."""
        return self.call("ListSaved", pb.ListSavedRequest())

    def fetch_saved(self, source: str, keys: Sequence[str]) -> pb.FetchSavedResponse:
        """Transfers: `keys` saved on the service at `source` (its address)
        read into this service's host tier with UCX, bit for bit
        (FetchSaved); RestoreBlocks then writes them into blocks."""
        return self.call("FetchSaved", pb.FetchSavedRequest(source=source,
                                                            keys=[str(k) for k in keys]))

    def drop_saved(self, keys: Sequence[str]) -> int:
        """Forgets saved keys (DropSaved); how many were saved."""
        return int(self.call("DropSaved", pb.DropSavedRequest(keys=[str(k) for k in keys])).dropped)

    def recover(self, verify: bool = False) -> pb.RecoverResponse:
        """What the service kept across its last restart (Recover): the last
        committed step, the blocks an interrupted commit lost, bytes kept; with
        `verify`, the pools' bookkeeping re-checked (``problems``)."""
        return self.call("Recover", pb.RecoverRequest(verify=verify))

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
        self._drive = drive
        self._lease_request = lease_ms
        self.regions = RegionCache()
        self._next_region = 0
        self._last_step = 0
        self._step_rows: dict = {}
        self._closed = False
        self._close_lock = threading.Lock()
        # For resume(): what the session set up, and its steps.
        self._registrations: dict = {}  # name -> RegisterRegionRequest
        self._params: dict = {}         # layer -> LoadLayerParamsRequest
        self._bindings: dict = {}       # layer -> BindVerifyInputsRequest
        self._open_steps: set = set()   # sent, Commit not answered
        self._committed_steps: set = set()
        self._lost_steps: dict = {}     # step -> why every call of it is refused
        self._unrecordable: dict = {}   # step -> why RecordStateBlocks is refused
        self._open()

    def _open(self) -> None:
        """Opens the Session stream and starts the renewal thread."""
        self._requests: "queue.Queue[Any]" = queue.Queue()
        self._requests.put(pb.SessionRequest(
            open=pb.OpenSession(client_name=self.client_name, lease_ms=self._lease_request,
                                drive=self._drive)))
        self._stream = self.client.stub.Session(self._request_iterator(self._requests))
        try:
            event = next(self._stream)
        except grpc.RpcError as e:
            self._requests.put(_STOP)
            raise SpecStateError.from_rpc(e, "Session", self.client.address) from None
        except StopIteration:
            self._requests.put(_STOP)
            raise SpecStateError(grpc.StatusCode.UNKNOWN,
                                 "Session: the service closed the stream without a reply") from None
        self.id: str = event.session_id
        self.driving: bool = event.driving
        self.lease_ms: int = event.lease_ms
        self._alive = True
        self._end_error: Optional[SpecStateError] = None
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                         name=f"specstate-renew-{self.id}")
        self._renewer.start()

    # ---- the stream ----

    @staticmethod
    def _request_iterator(requests: "queue.Queue[Any]") -> Iterator[pb.SessionRequest]:
        while True:
            item = requests.get()
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
        self._registrations[name] = request
        return name

    def unregister(self, name: str) -> None:
        """Unregisters region `name`; returns once no enqueued work uses it."""
        try:
            self.client.call("UnregisterRegion",
                             pb.UnregisterRegionRequest(session_id=self.id, name=name))
        finally:
            self.regions.remove(name)
            self._registrations.pop(name, None)

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
        self._params[layer] = request

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
        request = self.verify_request(
            step, layer, q=q, k=k, v=v, g=g, beta=beta, o=o, query_start_loc=query_start_loc,
            state_indices=state_indices, num_rows=num_rows, ordering=ordering, wait=wait,
            signal=signal)
        return self._drive_call("Verify", request, step)

    def verify_request(self, step: int, layer: int, *, q: Any, k: Any, v: Any, g: Any,
                       beta: Any, o: Any, query_start_loc: Any = None, state_indices: Any = None,
                       num_rows: Optional[int] = None, ordering: Union[None, str, int] = None,
                       wait: Any = None, signal: Any = None) -> pb.VerifyRequest:
        """The VerifyRequest :meth:`verify` sends (arguments as there), built and
        checked client-side but not sent: for :meth:`submit_step`."""
        qsl = self.index(query_start_loc)
        idx = self.index(state_indices)
        if num_rows is None:
            if idx is not None:
                num_rows = wire.rows_of(idx)
            elif step in self._step_rows:
                num_rows = self._step_rows[step]
            else:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"num_rows: give state_indices on step {step}'s first Verify")
        self._step_rows = {step: num_rows}
        request = pb.VerifyRequest(
            session_id=self.id, step=step, layer=layer, num_rows=num_rows,
            q=self.tensor(q), k=self.tensor(k), v=self.tensor(v), g=self.tensor(g),
            beta=self.tensor(beta), o=self.tensor(o), ordering=wire.ordering_of(ordering, wait, signal))
        if qsl is not None:
            request.query_start_loc.CopyFrom(qsl)
        if idx is not None:
            request.state_indices.CopyFrom(idx)
        wire.set_signals(request, wait, signal)
        return request

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
        response = self.client.call("BindVerifyInputs", request)
        self._bindings[layer] = request
        return response

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
        request = self.verify_bound_request(step, layer, num_tokens=num_tokens,
                                            num_rows=num_rows, ordering=ordering, wait=wait,
                                            signal=signal)
        return self._drive_call("Verify", request, step)

    def verify_bound_request(self, step: int, layer: int, *, num_tokens: int,
                             num_rows: Optional[int] = None,
                             ordering: Union[None, str, int] = None, wait: Any = None,
                             signal: Any = None) -> pb.VerifyRequest:
        """The VerifyRequest :meth:`verify_bound` sends (arguments as there), not
        sent: for :meth:`submit_step`."""
        if num_rows is None:
            if step not in self._step_rows:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"num_rows: give it on step {step}'s first Verify")
            num_rows = self._step_rows[step]
        self._step_rows = {step: num_rows}
        request = pb.VerifyRequest(
            session_id=self.id, step=step, layer=layer, num_rows=num_rows, bound_inputs=True,
            num_tokens=num_tokens, ordering=wire.ordering_of(ordering, wait, signal))
        wire.set_signals(request, wait, signal)
        return request

    def commit(self, step: int, num_accepted: Any, *, request_indices: Any = None,
               block_table: Any = None, num_computed_tokens: Any = None,
               ordering: Union[None, str, int] = None, wait: Any = None,
               signal: Any = None) -> pb.CommitResponse:
        """Folds each row's accepted tokens into its conv and recurrent state, all
        layers (Commit). `num_accepted` [batch]; `request_indices` [N] maps spec
        rows to batch rows; align mode also takes `block_table` [batch, width]
        and `num_computed_tokens` [batch]. A retry of the same step with the same
        arguments returns the first result (``replayed_from_cache``)."""
        request = self.commit_request(step, num_accepted, request_indices=request_indices,
                                      block_table=block_table,
                                      num_computed_tokens=num_computed_tokens, ordering=ordering,
                                      wait=wait, signal=signal)
        return self._drive_call("Commit", request, step, commit=True)

    def commit_request(self, step: int, num_accepted: Any, *, request_indices: Any = None,
                       block_table: Any = None, num_computed_tokens: Any = None,
                       ordering: Union[None, str, int] = None, wait: Any = None,
                       signal: Any = None) -> pb.CommitRequest:
        """The CommitRequest :meth:`commit` sends (arguments as there), not sent:
        for :meth:`submit_step`."""
        request = pb.CommitRequest(session_id=self.id, step=step,
                                   num_accepted=self.index(num_accepted),
                                   ordering=wire.ordering_of(ordering, wait, signal))
        for field, value in (("request_indices", request_indices), ("block_table", block_table),
                             ("num_computed_tokens", num_computed_tokens)):
            t = self.index(value)
            if t is not None:
                getattr(request, field).CopyFrom(t)
        wire.set_signals(request, wait, signal)
        return request

    def submit_step(self, step: int, verifies: Any = (), commit: Any = None
                    ) -> pb.SubmitStepResponse:
        """Several calls of one step in one round trip (SubmitStep): its
        `verifies` in order, then `commit` if given, exactly as if sent one by
        one, each with its own ordering, wait and signal.

        Each entry of `verifies` is a ``VerifyRequest`` (from
        :meth:`verify_request` / :meth:`verify_bound_request`) or a dict of the
        keyword arguments of :meth:`verify_bound` (when it has ``num_tokens``)
        or of :meth:`verify` (with ``layer``; ``step`` is this call's).
        `commit` is a ``CommitRequest`` (:meth:`commit_request`), a dict of
        :meth:`commit`'s keyword arguments with ``num_accepted``, or None.
        The first call that fails stops the rest, and its error is the answer,
        prefixed with the call (``verifies[2]: ...``). At most
        ``4 * num_layers`` Verify calls (INVALID_ARGUMENT beyond). Returns
        the ``SubmitStepResponse`` (``verifies``: one reply each, in order;
        ``commit``: the Commit's reply when there was one).
        """
        request = pb.SubmitStepRequest(session_id=self.id)
        if isinstance(verifies, (dict, pb.VerifyRequest)):
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 "verifies: expected a list of VerifyRequests or dicts")
        for i, v in enumerate(verifies):
            if isinstance(v, dict):
                v = dict(v)
                try:
                    layer = v.pop("layer")
                except KeyError:
                    raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                         f"verifies[{i}]: no 'layer'") from None
                v = (self.verify_bound_request(step, layer, **v) if "num_tokens" in v
                     else self.verify_request(step, layer, **v))
            elif not isinstance(v, pb.VerifyRequest):
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"verifies[{i}]: expected a VerifyRequest or a dict, got "
                                     f"{type(v).__name__}")
            elif v.step != step:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"verifies[{i}]: step {v.step}, not this SubmitStep's {step}")
            request.verifies.append(v)
        if isinstance(commit, dict):
            c = dict(commit)
            try:
                accepted = c.pop("num_accepted")
            except KeyError:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     "commit: no 'num_accepted'") from None
            commit = self.commit_request(step, accepted, **c)
        if commit is not None:
            if not isinstance(commit, pb.CommitRequest):
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"commit: expected a CommitRequest or a dict, got "
                                     f"{type(commit).__name__}")
            if commit.step != step:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"commit: step {commit.step}, not this SubmitStep's {step}")
            request.commit.CopyFrom(commit)
        return self._drive_call("SubmitStep", request, step, commit=commit is not None)

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
            ordering=wire.ordering_of(ordering, wait, signal))
        t = self.index(request_indices)
        if t is not None:
            request.request_indices.CopyFrom(t)
        wire.set_signals(request, wait, signal)
        self._check_step(step, record=True)
        return self.client.call("RecordStateBlocks", request)

    # ---- restarts ----

    def _check_step(self, step: int, record: bool = False) -> None:
        why = self._lost_steps.get(step) or (self._unrecordable.get(step) if record else None)
        if why is not None:
            raise LostSteps(grpc.StatusCode.FAILED_PRECONDITION, why)

    def _drive_call(self, method: str, request: Any, step: int, commit: bool = False) -> Any:
        """A driving call, with the step bookkeeping :meth:`resume` needs."""
        self._check_step(step)
        try:
            response = self.client.call(method, request)
        except SpecStateError:
            if step not in self._committed_steps:
                self._open_steps.add(step)
            raise
        if commit:
            self._open_steps.discard(step)
            self._committed_steps.add(step)
            if len(self._committed_steps) > 64:
                self._committed_steps.discard(min(self._committed_steps))
        elif step not in self._committed_steps:
            self._open_steps.add(step)
            if len(self._open_steps) > 64:
                self._open_steps.discard(min(self._open_steps))
        return response

    @property
    def lost_steps(self) -> list:
        """The steps :meth:`resume` found in flight (refused from then on)."""
        return sorted(self._lost_steps)

    def _end_stream(self) -> None:
        self._stop.set()
        self._requests.put(_STOP)
        self._renewer.join()
        try:
            for _ in self._stream:
                pass
        except grpc.RpcError:
            pass  # it broke with the old service

    def _resume_once(self, deadline: float) -> pb.RecoverResponse:
        """One attempt of :meth:`resume`: Recover, a new session, its set-up."""
        self._end_stream()
        try:
            kept = self.client.stub.Recover(
                pb.RecoverRequest(), wait_for_ready=True,
                timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except grpc.RpcError as e:
            raise SpecStateError.from_rpc(e, "Recover") from None
        self._open()
        for name, request in list(self._registrations.items()):
            request.session_id = self.id
            try:
                self.client.call("RegisterRegion", request)
            except SpecStateError as e:
                raise SpecStateError(e.code, f"registering region {name!r} again: {e.message}") \
                    from None
        for layer, request in sorted(self._params.items()):
            request.session_id = self.id
            self.client.call("LoadLayerParams", request)
        for layer, request in sorted(self._bindings.items()):
            request.session_id = self.id
            self.client.call("BindVerifyInputs", request)
        return kept

    def resume(self, timeout: float = 60.0) -> pb.RecoverResponse:
        """After specstated restarted (a call raised UNAVAILABLE, or :attr:`alive`
        went False): waits for it, retrying with backoff (50 ms doubling to 1 s)
        for up to `timeout` seconds (DEADLINE_EXCEEDED after); opens a new
        session with this one's name, drive flag and lease (:attr:`id`
        changes); registers every buffer again under its name; sends each
        layer's last load_layer_params and bind_verify_inputs again; step ids
        continue. Returns what the service kept (``Recover``): the last
        committed step and the blocks an interrupted Commit lost (re-prefill
        them). Every step that had started and whose Commit was not answered is
        refused from then on (FAILED_PRECONDITION naming the step): re-run it
        from Verify under a new step id, unless ``last_committed_step`` is it.
        RecordStateBlocks of a step committed before the restart is refused
        too (compute its state_idx from the block table)."""
        deadline = time.monotonic() + timeout
        pause = 0.05
        while True:
            try:
                kept = self._resume_once(deadline)
                break
            except SpecStateError as e:
                # A connection that died with the old service fails a call once.
                if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() + pause >= deadline:
                    raise SpecStateError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"specstated at {self.client.address} did not answer again within "
                        f"{timeout:g} s (last: {e.message})") from None
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
        for step in sorted(self._open_steps):
            if not kept.kept:
                why = (f"step {step} was in flight when specstated restarted without its pools "
                       "(nothing kept them): every state is gone; re-prefill every request")
            elif kept.interrupted and kept.interrupted_step == step:
                why = (f"step {step}'s Commit was interrupted when specstated restarted: "
                       f"{len(kept.lost_blocks)} blocks are lost (Recover's lost_blocks: "
                       "re-prefill them), nothing else of it was committed; re-run it from "
                       "Verify under a new step id")
            elif step and kept.last_committed_step == step:
                why = (f"step {step} was committed before specstated restarted (Recover: last "
                       f"committed step {step}) but the answer was lost; its records did not "
                       "survive: go on with the next step")
            else:
                why = (f"step {step} was in flight when specstated restarted (the last committed "
                       f"step is {kept.last_committed_step}): nothing of it was committed and "
                       "its Verify records did not survive; re-run it from Verify under a new "
                       "step id")
            self._lost_steps[step] = why
        for step in self._committed_steps:
            self._unrecordable[step] = (
                f"step {step} was committed before specstated restarted; its RecordStateBlocks "
                "cannot run in the new session (the step's records are gone): compute state_idx "
                "from the block table")
        self._open_steps.clear()
        self._committed_steps.clear()
        return kept


    def flush(self, blocks: Any = None, *, discard: bool = False, layer: Optional[int] = None,
              ordering: Union[None, str, int] = None, wait: Any = None,
              signal: Any = None) -> pb.FlushResponse:
        """Commit mode DEFERRED: replays the tokens a Commit left pending on
        `blocks` (int32 [n], inline or in a registered buffer; entries <= 0 are
        skipped) into the pools, or on every pending block when `blocks` is
        None (Flush). Commit mode FAST: folds the blocks' rings of accepted
        tokens into the pools (every non-empty ring when None). Call it before
        reading, copying, swapping or freeing a block yourself; with
        `discard`, the pending tokens are forgotten (a block being freed).
        `layer` limits it to one layer. Under EAGER it has nothing to do.
        OUT_OF_RANGE for a block past the pools."""
        request = pb.FlushRequest(session_id=self.id, discard=discard,
                                  ordering=wire.ordering_of(ordering, wait, signal))
        t = self.index(blocks)
        if t is not None:
            request.blocks.CopyFrom(t)
        if layer is not None:
            request.layer = layer
        wire.set_signals(request, wait, signal)
        return self.client.call("Flush", request)


    def save_blocks(self, entries: Union[Dict[str, int], Sequence[Tuple[int, str]]], *,
                    ordering: Union[None, str, int] = None, wait: Any = None,
                    signal: Any = None) -> pb.SaveBlocksResponse:
        """The host tier (specstated --host_tier_bytes): copies blocks, every
        layer's recurrent and conv state as the commits so far left them,
        into host memory under keys (SaveBlocks). `entries`: {key: block} or
        [(block, key), ...]. Returns the keys evicted to make room and the
        bytes copied. The pools are not changed."""
        pairs = entries.items() if isinstance(entries, dict) else [(k, b) for b, k in entries]
        request = pb.SaveBlocksRequest(
            session_id=self.id, ordering=wire.ordering_of(ordering, wait, signal),
            entries=[pb.SaveEntry(block=int(b), key=str(k)) for k, b in pairs])
        wire.set_signals(request, wait, signal)
        return self.client.call("SaveBlocks", request)

    def restore_blocks(self, entries: Dict[str, int], *, ordering: Union[None, str, int] = None,
                       wait: Any = None, signal: Any = None) -> pb.RestoreBlocksResponse:
        """Writes saved keys back into blocks, bit for bit ({key: block};
        RestoreBlocks); what the mode kept unapplied for those blocks is
        forgotten first. NOT_FOUND for a key not saved; nothing is written."""
        request = pb.RestoreBlocksRequest(
            session_id=self.id, ordering=wire.ordering_of(ordering, wait, signal),
            entries=[pb.RestoreEntry(key=str(k), block=int(b)) for k, b in entries.items()])
        wire.set_signals(request, wait, signal)
        return self.client.call("RestoreBlocks", request)

    def mark_reprefilled(self, blocks: Sequence[int]) -> pb.MarkReprefilledResponse:
        """After a restart: the scheduler re-prefilled `blocks` (the
        ``lost_blocks`` of :meth:`resume`'s answer, or of ``recover``), so
        they are no longer reported lost, by this instance or after later
        restarts (MarkReprefilled). Returns the blocks still lost
        (``lost_blocks``). OUT_OF_RANGE for a block outside [1, num_blocks),
        INVALID_ARGUMENT for an empty list; nothing changes then."""
        request = pb.MarkReprefilledRequest(session_id=self.id,
                                            blocks=[int(b) for b in blocks])
        return self.client.call("MarkReprefilled", request)

