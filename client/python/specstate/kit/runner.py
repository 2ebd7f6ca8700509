"""The driving side of the kit: :class:`Runner` (the session, the bound
buffers, the doorbells) and the :class:`Step` it starts (see
:mod:`specstate.kit` for the per-step sequence and the doorbell protocol)."""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import grpc
import numpy as np

try:
    import torch
except ImportError as _e:  # pragma: no cover - depends on the install
    raise ImportError("specstate.kit needs torch (Debian: apt-get install python3-torch; "
                      "or pip install torch)") from _e

from specstate.errors import (FailedPrecondition, InvalidInput, SpecStateError, Timeout,
                              Unavailable)
from specstate.kit.pools import _NUMPY_FOR_TORCH, StatePools, torch_dtype
from specstate.shm import SharedBuffer
from specstate.v1 import specstate_pb2 as pb

_log = logging.getLogger("specstate.kit")


# The names of one layer's bound Verify tensors, in the order Verify takes them.
_INPUTS = ("q", "k", "v", "g", "beta")


class _Arena:
    """One registered buffer cut into named torch tensors (CPU: shared memory
    through numpy; CUDA: a CudaBuffer)."""

    def __init__(self, specs: Sequence[tuple], device: "torch.device") -> None:
        self.offsets: Dict[str, int] = {}
        nbytes = 0
        for name, shape, dtype in specs:
            nbytes = (nbytes + 255) // 256 * 256
            self.offsets[name] = nbytes
            count = 1
            for n in shape:
                count *= int(n)
            nbytes += count * torch.tensor([], dtype=dtype).element_size()
        self.nbytes = max(nbytes, 256)
        self.device = device
        self.tensors: Dict[str, Any] = {}
        self.host: Dict[str, np.ndarray] = {}  # CPU: the numpy views
        if device.type == "cuda":
            from specstate.cuda import CudaBuffer  # noqa: PLC0415
            self.buffer: Any = CudaBuffer(self.nbytes, device.index or 0)
            for name, shape, dtype in specs:
                self.tensors[name] = self.buffer.tensor(shape, dtype, self.offsets[name])
        else:
            self.buffer = SharedBuffer(self.nbytes)
            for name, shape, dtype in specs:
                a = self.buffer.ndarray(shape, _NUMPY_FOR_TORCH[dtype], self.offsets[name])
                a[...] = 0
                self.host[name] = a
                t = torch.from_numpy(a)
                self.tensors[name] = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t

    def close(self) -> None:
        self.tensors.clear()
        self.host.clear()
        self.buffer.close()


def _as_index(x: Any, what: str) -> "torch.Tensor":
    """An int tensor (any device) from a tensor, array or list of integers."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what}: expected integers, got a {x.dtype} tensor")
        return x
    a = np.asarray(x)
    if a.size and a.dtype.kind not in "iu":
        raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}: expected integers, got {a.dtype}")
    return torch.from_numpy(a.astype(np.int64).reshape(a.shape))


class Runner:
    """Drives specstated from an engine (see the module docstring).

    Args:
        client: a :class:`specstate.Client`.
        name: the driving session's client name.
        max_tokens: tokens a step may verify at most (the bound buffers'
            capacity, e.g. ``max_rows * (num_spec + 1)``).
        max_rows: rows a step may verify at most (default: the layout's
            ``max_rows``, which is also the bound).
        device: the engine's device (default: ``cpu`` on the CPU backend,
            ``cuda:<layout.device>`` on the CUDA backend).
        ordering: ``"async"`` (doorbells, one SubmitStep a step) or ``"sync"``.
        max_batch: rows of a Commit's batch at most (num_accepted,
            num_computed_tokens; default max_rows).
        block_table_width: align mode: columns of the block-table buffer
            (0: block tables travel inline, host tensors or lists only).
        lease_ms: the session's lease (0: the service's default).
        doorbell_timeout: CPU backend: seconds a host wait for a doorbell
            may take before :class:`Timeout`.

    The session is open and every layer bound when the constructor returns.
    ``InvalidInput`` (OUT_OF_RANGE) when max_rows passes the layout's, or a
    count is below 1.
    """

    def __init__(self, client: Any, name: str = "scheduler", *, max_tokens: int,
                 max_rows: Optional[int] = None, device: Any = None, ordering: str = "async",
                 max_batch: Optional[int] = None, block_table_width: int = 0,
                 lease_ms: int = 0, doorbell_timeout: float = 60.0) -> None:
        self.client = client
        self.layout: pb.Layout = client.layout()
        lo = self.layout
        self.cuda = lo.backend == pb.CUDA
        if ordering not in ("async", "sync"):
            raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                               f"ordering {ordering!r}: expected 'async' or 'sync'")
        self.ordering = ordering
        self.max_rows = lo.max_rows if max_rows is None else int(max_rows)
        if not 1 <= self.max_rows <= lo.max_rows:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"max_rows = {self.max_rows} is out of range: must be in "
                               f"[1, {lo.max_rows}] (the layout's max_rows)")
        self.max_tokens = int(max_tokens)
        if self.max_tokens < 1:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"max_tokens = {self.max_tokens} must be >= 1")
        self.max_batch = self.max_rows if max_batch is None else int(max_batch)
        if self.max_batch < self.max_rows:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"max_batch = {self.max_batch} must be >= max_rows "
                               f"({self.max_rows})")
        if block_table_width < 0:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"block_table_width = {block_table_width} must be >= 0")
        self.block_table_width = int(block_table_width)
        self.doorbell_timeout = float(doorbell_timeout)
        if device is None:
            device = torch.device("cuda", lo.device) if self.cuda else torch.device("cpu")
        self.device = torch.device(device)
        if (self.device.type == "cuda") != self.cuda:
            raise InvalidInput(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"device {self.device}: the service runs the "
                f"{pb.Backend.Name(lo.backend)} backend, whose buffers are "
                f"{'CUDA memory' if self.cuda else 'host shared memory'}")
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", lo.device)
        self.num_layers = lo.num_layers
        self.H, self.K = lo.num_heads, lo.head_dim
        self.HV = lo.num_value_heads or lo.num_heads
        self.gdn = lo.layer_kind == pb.GDN
        self.Q = lo.num_spec + 1
        self.commit_mode = lo.commit_mode
        self.act_dtype = torch_dtype(lo.activation_dtype)
        self.closed = False

        T, R, B, L = self.max_tokens, self.max_rows, self.max_batch, self.num_layers
        g_shape = (T, self.HV) if self.gdn else (T, self.H, self.K)
        specs: List[tuple] = []
        for layer in range(L):
            specs += [(f"q{layer}", (T, self.H, self.K), self.act_dtype),
                      (f"k{layer}", (T, self.H, self.K), self.act_dtype),
                      (f"v{layer}", (T, self.HV, self.K), self.act_dtype),
                      (f"g{layer}", g_shape, self.act_dtype),
                      (f"beta{layer}", (T, self.HV), self.act_dtype),
                      (f"o{layer}", (T, self.HV, self.K), self.act_dtype)]
        specs += [("query_start_loc", (R + 1,), torch.int32),
                  ("state_indices", (R,), torch.int32),
                  ("num_accepted", (B,), torch.int32),
                  ("request_indices", (R,), torch.int32),
                  ("num_computed_tokens", (B,), torch.int32),
                  ("state_idx_out", (B,), torch.int32),
                  ("num_accepted_out", (B,), torch.int32),
                  # ready[0..L), done[0..L), commit-ready, commit-done
                  ("doorbells", (2 * L + 2,), torch.int32)]
        if self.block_table_width:
            specs.append(("block_table", (B, self.block_table_width), torch.int32))
        self._arena = _Arena(specs, self.device)
        a = self._arena.tensors
        self.query_start_loc = a["query_start_loc"]
        self.state_indices = a["state_indices"]
        self.num_accepted = a["num_accepted"]
        self._request_indices = a["request_indices"]
        self._num_computed = a["num_computed_tokens"]
        self._block_table = a.get("block_table")
        self._bells = a["doorbells"]
        if self.cuda:
            self._arena.tensors["doorbells"].zero_()
            torch.cuda.synchronize(self.device)
            # resume()'s stream, made now: with the caller's stream parked on a
            # dead service's doorbell, making a stream blocked in the driver
            # (torch.cuda.Stream, seen on the H100).
            self._release_stream = torch.cuda.Stream(self.device)
        self._layers = [{n: a[f"{n}{layer}"] for n in _INPUTS + ("o",)} for layer in range(L)]
        self._pools: Optional[StatePools] = None
        self._open_step: Optional[Step] = None
        self.last_recover: Optional[pb.RecoverResponse] = None

        self.session = client.session(name, drive=True, lease_ms=lease_ms)
        try:
            self.session.register(self._arena.buffer, f"{name}-kit")
            self._ready_bells = [self.session.doorbell(self._bells[i:i + 1], 1) for i in range(L)]
            self._done_bells = [self.session.doorbell(self._bells[L + i:L + i + 1], 1)
                                for i in range(L)]
            self._commit_ready = self.session.doorbell(self._bells[2 * L:2 * L + 1], 1)
            self._commit_done = self.session.doorbell(self._bells[2 * L + 1:2 * L + 2], 1)
            for layer in range(L):
                self.session.bind_verify_inputs(
                    layer, **self._layers[layer], query_start_loc=self.query_start_loc,
                    state_indices=self.state_indices)
        except BaseException:
            self.session.close()
            self._arena.close()
            raise

    # ---- set-up ----

    @property
    def pools(self) -> StatePools:
        """The service's pools as torch tensors (a :class:`StatePools`, made on first use)."""
        if self._pools is None:
            self._pools = StatePools(self.client)
        return self._pools

    def load_layer_params(self, layer: int, a_log: Any, dt_bias: Any,
                          lower_bound: Optional[float] = None) -> None:
        """KDA: one layer's gate parameters, A_log ``[H]`` and dt_bias ``[H*K]``
        (torch tensors on any device, arrays or lists; sent as fp32). Kept for
        :meth:`resume`. FAILED_PRECONDITION on a GDN layout."""
        def host(x: Any) -> np.ndarray:
            if isinstance(x, torch.Tensor):
                x = x.detach().float().cpu().numpy()
            return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)

        a, d = host(a_log), host(dt_bias)
        if a.shape[0] != self.H:
            raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                               f"a_log: {a.shape[0]} values, expected H = {self.H}")
        if d.shape[0] != self.H * self.K:
            raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                               f"dt_bias: {d.shape[0]} values, expected H * K = "
                               f"{self.H * self.K}")
        self.session.load_layer_params(layer, a, d, lower_bound=lower_bound)

    def inputs(self, layer: int) -> Dict[str, "torch.Tensor"]:
        """Layer `layer`'s bound tensors at capacity: q, k ``[max_tokens, H, K]``,
        v ``[max_tokens, HV, V]``, g (KDA ``[max_tokens, H, K]``, GDN
        ``[max_tokens, HV]``), beta ``[max_tokens, HV]``, o ``[max_tokens, HV, V]``."""
        if not 0 <= layer < self.num_layers:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"layer {layer} is out of range: the service holds "
                               f"{self.num_layers} layers")
        return dict(self._layers[layer])

    # ---- steps ----

    def _counts(self, query_start_loc: Any, state_indices: Any,
                num_tokens: Optional[int]) -> tuple:
        qsl = _as_index(query_start_loc, "query_start_loc")
        idx = _as_index(state_indices, "state_indices")
        if idx.dim() != 1:
            raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                               f"state_indices: shape {list(idx.shape)}, expected [num_rows]")
        rows = int(idx.shape[0])
        self._check_rows(rows, "state_indices")
        if tuple(qsl.shape) != (rows + 1,):
            raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                               f"query_start_loc: shape {list(qsl.shape)}, expected "
                               f"[{rows + 1}] (num_rows + 1)")
        if num_tokens is None:
            tokens = int(qsl[rows])
        else:
            tokens = int(num_tokens)
            if not qsl.is_cuda and int(qsl[rows]) != tokens:  # (free to check on the host)
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"num_tokens = {tokens} but query_start_loc[{rows}] = "
                                   f"{int(qsl[rows])}: they must be equal")
        self._check_tokens(tokens, f" (query_start_loc[{rows}])")
        return qsl, idx, rows, tokens

    def _check_graphs(self, what: str) -> None:
        if not self.cuda:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"{what}: CUDA graphs need the CUDA backend (this service "
                                     "runs the CPU backend: use begin_step)")
        if self.ordering != "async":
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"{what} needs ordering='async' (doorbells)")

    def _check_rows(self, rows: int, what: str) -> None:
        if not 1 <= rows <= self.max_rows:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"{what}: {rows} rows is out of range: must be in "
                               f"[1, {self.max_rows}] (the Runner's max_rows)")

    def _check_tokens(self, tokens: int, what: str = "") -> None:
        if not 1 <= tokens <= self.max_tokens:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"num_tokens = {tokens}{what} is out of range: must be in "
                               f"[1, {self.max_tokens}] (the Runner's max_tokens)")

    def _begin(self) -> None:
        if self.closed:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     "the Runner is closed")
        if self._open_step is not None:
            raise FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {self._open_step.id} is still open: commit or abandon it first")

    def begin_step(self, query_start_loc: Any, state_indices: Any, *,
                   num_tokens: Optional[int] = None) -> "Step":
        """Starts a decode step: `query_start_loc` ``[N+1]`` (row n's tokens are
        ``[qsl[n], qsl[n+1])``, at most Q each) and `state_indices` ``[N]`` (each
        row's checkpoint block), int tensors on any device, arrays or lists,
        written into the bound index buffers (CUDA: on the current stream).
        `num_tokens` is ``qsl[N]`` (read from the tensor when not given: a host
        synchronization for a CUDA tensor). ASYNC: sends every layer's Verify
        in one SubmitStep. Returns the :class:`Step`."""
        self._begin()
        qsl, idx, rows, tokens = self._counts(query_start_loc, state_indices, num_tokens)
        self.query_start_loc[:rows + 1].copy_(qsl, non_blocking=True)
        self.state_indices[:rows].copy_(idx, non_blocking=True)
        step = Step(self, self.session.next_step(), rows, tokens, mode="live")
        if self.ordering == "async":
            self._submit(step.id, rows, tokens, commit_batch=None)
        self._open_step = step
        return step

    def _submit(self, step: int, rows: int, tokens: int, commit_batch: Optional[int]) -> Any:
        verifies = [self.session.verify_bound_request(
            step, layer, num_tokens=tokens, num_rows=rows, wait=self._ready_bells[layer],
            signal=self._done_bells[layer]) for layer in range(self.num_layers)]
        commit = None
        if commit_batch is not None:
            commit = self.session.commit_request(
                step, self.num_accepted[:commit_batch], wait=self._commit_ready,
                signal=self._commit_done)
        return self.session.submit_step(step, verifies, commit)

    def capture_step(self, num_tokens: int, num_rows: int) -> "Step":
        """A step for CUDA-graph capture (ASYNC only): its ``verify`` and
        ``commit`` enqueue their copies and doorbell writes and waits on the
        current stream and send nothing. Capture them inside
        ``torch.cuda.graph(g)``; then, every step, write the step's indices into
        :attr:`query_start_loc` / :attr:`state_indices` (and the graph writes
        :attr:`num_accepted`), call :meth:`replay_step` and ``g.replay()``."""
        self._check_graphs("capture_step")
        self._check_rows(num_rows, "num_rows")
        self._check_tokens(num_tokens)
        return Step(self, 0, num_rows, num_tokens, mode="capture")

    def replay_step(self, num_tokens: int, num_rows: int,
                    commit_batch: Optional[int] = None) -> pb.SubmitStepResponse:
        """Sends one step whose stream work is a captured graph
        (:meth:`capture_step`): every layer's Verify and, with `commit_batch`,
        the Commit of the first `commit_batch` entries of :attr:`num_accepted`,
        in ONE SubmitStep, all ASYNC on the kit's doorbells. Call it before
        the graph's replay. Returns the response (every call ``enqueued``);
        errors the service finds while running them come with the next call."""
        self._check_graphs("replay_step")
        self._begin()
        self._check_rows(num_rows, "num_rows")
        self._check_tokens(num_tokens)
        if commit_batch is not None and not 1 <= commit_batch <= self.max_batch:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"commit_batch = {commit_batch} is out of range: must be in "
                               f"[1, {self.max_batch}] (the Runner's max_batch)")
        return self._submit(self.session.next_step(), num_rows, num_tokens, commit_batch)

    # ---- doorbells ----

    def _ring(self, index: int, value: int, stream: Any) -> None:
        if self.cuda:
            from specstate import cuda  # noqa: PLC0415
            cuda.stream_write_value32(self._bells[index:index + 1], value, stream)
        else:
            self._arena.host["doorbells"][index] = value

    def _wait(self, index: int, stream: Any, what: str) -> None:
        """Waits for doorbell `index` to reach 1 (CUDA: on the stream; CPU: here)."""
        if self.cuda:
            from specstate import cuda  # noqa: PLC0415
            cuda.stream_wait_value32(self._bells[index:index + 1], 1, stream)
            return
        word = self._arena.host["doorbells"][index:index + 1].view(np.uint32).reshape(())
        start = time.monotonic()
        spins = 0
        while int(word) < 1:
            spins += 1
            if spins < 2000:
                continue
            time.sleep(20e-6)
            if spins % 256:
                continue
            if not self.session.alive:
                err = self.session.end_error
                raise Unavailable(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{what}: the session ended while waiting for the service"
                    f"{f' ({err.message})' if err is not None else ''}: runner.resume() once "
                    "specstated is back")
            if time.monotonic() - start > self.doorbell_timeout:
                raise Timeout(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"{what}: the service did not signal within "
                              f"{self.doorbell_timeout:g} s (doorbell_timeout)")

    def _stream(self, stream: Any) -> Any:
        if not self.cuda:
            return None
        return torch.cuda.current_stream(self.device) if stream is None else stream

    # ---- blocks ----

    def _block_list(self, blocks: Any) -> Optional[List[int]]:
        if blocks is None:
            return None
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.detach().cpu().reshape(-1).tolist()
        elif isinstance(blocks, (int, np.integer)):
            blocks = [int(blocks)]
        return [int(b) for b in blocks]

    def flush(self, blocks: Any = None, *, discard: bool = False) -> pb.FlushResponse:
        """Commit modes DEFERRED and FAST: makes `blocks` (ints; None: every
        block) current in the pools (SYNC), or with `discard` forgets their
        pending tokens. Call it before reading, copying or swapping a block
        yourself (a preemption, align mode's copy into a new block, a prefix
        copy). EAGER: nothing is pending and it returns at once (one RPC).
        OUT_OF_RANGE (:class:`InvalidInput`) for a block past the pools."""
        self._check_open()
        if self.cuda:  # the engine's writes to the blocks come first
            torch.cuda.current_stream(self.device).synchronize()
        return self.session.flush(self._block_list(blocks), discard=discard)

    def free(self, blocks: Any) -> None:
        """A request's end (or preemption without swap): its `blocks` are handed
        back. DEFERRED / FAST: Flush with discard (a later request's prefill
        into the block must not inherit the pending tokens or ring); EAGER:
        nothing to do, no RPC."""
        if self.commit_mode in (pb.DEFERRED, pb.FAST):
            self.flush(blocks, discard=True)
        else:
            self._check_open()

    def record_state_blocks(self, step: Any, *, idx_mapping: Any, num_sampled: Any,
                            num_computed_tokens: Any, block_table_width: int) -> tuple:
        """Align mode, after the step's Commit: each request's state block column
        and its accepted count reset to 1 (RecordStateBlocks, SYNC). Returns
        ``(state_idx, num_accepted)``: views ``[reqs]`` of the Runner's buffers."""
        self._check_open()
        step_id = step.id if isinstance(step, Step) else int(step)
        mapping = _as_index(idx_mapping, "idx_mapping").reshape(-1)
        reqs = int(mapping.shape[0])
        if not 1 <= reqs <= self.max_batch:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"idx_mapping: {reqs} requests is out of range: must be in "
                               f"[1, {self.max_batch}] (the Runner's max_batch)")
        state_idx = self._arena.tensors["state_idx_out"][:reqs]
        accepted = self._arena.tensors["num_accepted_out"][:reqs]
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.session.record_state_blocks(
            step_id, idx_mapping=self._host_ints(mapping),
            num_sampled=self._host_ints(_as_index(num_sampled, "num_sampled")),
            num_computed_tokens=self._host_ints(_as_index(num_computed_tokens,
                                                          "num_computed_tokens")),
            block_table_width=block_table_width, state_idx=state_idx, num_accepted=accepted)
        return state_idx, accepted

    @staticmethod
    def _host_ints(t: "torch.Tensor") -> np.ndarray:
        return t.detach().cpu().numpy().astype(np.int64)

    # ---- life ----

    def _check_open(self) -> None:
        if self.closed:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "the Runner is closed")

    def resume(self, timeout: float = 60.0) -> List[int]:
        """After specstated restarted with its pools kept (a call raised
        :class:`Unavailable`): waits for it, opens the session again,
        re-registers the buffer, reloads the layer parameters and re-binds
        every layer (``Session.resume``); the step in flight is dropped (its
        id is refused from now on: :class:`LostSteps`). CUDA: a wait the
        caller's stream had parked on the old service's doorbells is released
        and every counter reset. Returns the blocks to re-prefill
        (``Recover.lost_blocks``; the whole :class:`pb.RecoverResponse` is in
        :attr:`last_recover`). Re-run the dropped step under a new id."""
        self._check_open()
        self._open_step = None
        if self.cuda:
            # Release stream waits the dead service will never signal, let the
            # caller's streams drain, then put every counter back to 0.
            from specstate import cuda  # noqa: PLC0415
            L = self.num_layers
            for i in list(range(L, 2 * L)) + [2 * L + 1]:
                cuda.stream_write_value32(self._bells[i:i + 1], 1, self._release_stream)
            torch.cuda.synchronize(self.device)
            self._bells.zero_()
            torch.cuda.synchronize(self.device)
        else:
            self._arena.host["doorbells"][...] = 0
        kept = self.session.resume(timeout=timeout)
        self.last_recover = kept
        if not kept.kept:
            return []
        return [int(b) for b in kept.lost_blocks]

    def close(self) -> None:
        """Abandons a step still open, ends the session (the service flushes
        DEFERRED / FAST blocks then) and frees the buffers; the pools' mapping
        too, when :attr:`pools` was used."""
        if self.closed:
            return
        if self._open_step is not None:
            # ASYNC: the service's queue holds the step's Verify calls, waiting on
            # doorbells; ring them, or unregistering the buffer would wait on them.
            try:
                self._open_step.abandon()
            except SpecStateError as e:  # the service is gone: nothing waits
                _log.info("closing the Runner: abandoning step %s: %s", self._open_step.id, e)
        self.closed = True
        self._open_step = None
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.session.close()
        finally:
            if self._pools is not None:
                self._pools.close()
                self._pools = None
            self._arena.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Step:
    """One decode step of a :class:`Runner` (from :meth:`Runner.begin_step` or
    :meth:`Runner.capture_step`): ``id``, ``num_rows``, ``num_tokens``."""

    def __init__(self, runner: Runner, step_id: int, rows: int, tokens: int, mode: str) -> None:
        self.runner = runner
        self.id = step_id
        self.num_rows = rows
        self.num_tokens = tokens
        self.mode = mode  # "live" or "capture"
        self._next_layer = 0
        self.done = False

    def inputs(self, layer: int) -> Dict[str, "torch.Tensor"]:
        """The bound views of layer `layer` for this step's tokens: q, k, v, g,
        beta and o, each ``[num_tokens, ...]``. A model that writes its
        projections into these directly passes them to :meth:`verify`, which then
        copies nothing."""
        return {n: t[:self.num_tokens] for n, t in self.runner.inputs(layer).items()}

    def _expected(self) -> Dict[str, tuple]:
        r, T = self.runner, self.num_tokens
        return {"q": (T, r.H, r.K), "k": (T, r.H, r.K), "v": (T, r.HV, r.K),
                "g": (T, r.HV) if r.gdn else (T, r.H, r.K), "beta": (T, r.HV)}

    def _live(self, what: str) -> None:
        if self.done:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"{what}: step {self.id} is over (committed or abandoned)")
        if self.mode == "live" and self.runner._open_step is not self:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"{what}: step {self.id} is no longer the Runner's open step "
                                     "(a resume() dropped it: re-run it under a new step)")

    def verify(self, layer: int, q: Any, k: Any, v: Any, g: Any, beta: Any, *,
               stream: Any = None) -> "torch.Tensor":
        """Verifies layer `layer` of this step (layers in order, each once):
        q, k ``[T, H, K]``, v ``[T, HV, V]``, g (KDA ``[T, H, K]``, GDN
        ``[T, HV]``), beta ``[T, HV]``, T = ``num_tokens``: torch tensors of
        any float dtype and device (copied into the bound buffers, converted
        to the activation dtype) or the bound views themselves
        (:meth:`inputs`: no copy). Returns o ``[T, HV, V]``, a view of the
        bound output, ready on the caller's stream (CUDA) or here (CPU)."""
        r = self.runner
        self._live(f"verify of layer {layer}")
        if layer != self._next_layer:
            if 0 <= layer < r.num_layers and layer < self._next_layer:
                why = f"layer {layer} was verified already in step {self.id}"
            else:
                why = (f"layer {self._next_layer} comes next (the service runs a step's "
                       f"layers in order, 0 to {r.num_layers - 1})")
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"verify of layer {layer}: {why}")
        views = self.inputs(layer)
        given = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
        expected = self._expected()
        for name, x in given.items():
            if not isinstance(x, torch.Tensor):
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"verify of layer {layer}: {name}: expected a torch tensor, "
                                   f"got {type(x).__name__}")
            if tuple(x.shape) != expected[name]:
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"verify of layer {layer}: {name}: shape {list(x.shape)}, "
                                   f"expected {list(expected[name])} (T = num_tokens "
                                   f"{self.num_tokens}, H {r.H}, HV {r.HV}, K {r.K})")
        for name, x in given.items():
            view = views[name]
            if (x.data_ptr() == view.data_ptr() and x.dtype == view.dtype
                    and x.device == view.device and x.stride() == view.stride()):
                continue  # written in place
            view.copy_(x, non_blocking=True)
        stream = r._stream(stream)
        if r.ordering == "async":
            L = r.num_layers
            r._ring(layer, 1, stream)
            r._wait(L + layer, stream, f"step {self.id}, layer {layer}'s Verify")
            r._ring(layer, 0, stream)
            r._ring(L + layer, 0, stream)
        else:
            if r.cuda:
                stream.synchronize()
            r.session.verify_bound(self.id, layer, num_tokens=self.num_tokens,
                                   num_rows=self.num_rows)
        self._next_layer += 1
        return views["o"]

    def commit(self, num_accepted: Any, *, request_indices: Any = None, block_table: Any = None,
               num_computed_tokens: Any = None, stream: Any = None) -> Optional[pb.CommitResponse]:
        """Commits the step after rejection sampling: `num_accepted` ``[batch]``
        (tokens of each row's window whose state is kept, >= 1 for a spec row;
        int tensor on any device, array or list); `request_indices` ``[N]``
        maps the step's rows to batch rows (default: row n is batch row n);
        align mode: `block_table` ``[batch, width]`` and `num_computed_tokens`
        ``[batch]``. Every layer must have been verified. Returns the
        ``CommitResponse`` (ASYNC: ``enqueued``; a capture step: None)."""
        r = self.runner
        self._live("commit")
        if self._next_layer != r.num_layers:
            raise FailedPrecondition(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"commit of step {self.id}: layers {self._next_layer} to {r.num_layers - 1} "
                "were not verified (verify every layer, or abandon() the step)")
        acc = _as_index(num_accepted, "num_accepted").reshape(-1)
        batch = int(acc.shape[0])
        if not 1 <= batch <= r.max_batch:
            raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                               f"num_accepted: batch of {batch} is out of range: must be in "
                               f"[1, {r.max_batch}] (the Runner's max_batch)")
        r.num_accepted[:batch].copy_(acc, non_blocking=True)
        kwargs: Dict[str, Any] = {}
        if request_indices is not None:
            ri = _as_index(request_indices, "request_indices").reshape(-1)
            if int(ri.shape[0]) != self.num_rows:
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"request_indices: {int(ri.shape[0])} entries, expected "
                                   f"num_rows = {self.num_rows}")
            r._request_indices[:self.num_rows].copy_(ri, non_blocking=True)
            kwargs["request_indices"] = r._request_indices[:self.num_rows]
        if num_computed_tokens is not None:
            nc = _as_index(num_computed_tokens, "num_computed_tokens").reshape(-1)
            if int(nc.shape[0]) != batch:
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"num_computed_tokens: {int(nc.shape[0])} entries, expected "
                                   f"the batch's {batch}")
            r._num_computed[:batch].copy_(nc, non_blocking=True)
            kwargs["num_computed_tokens"] = r._num_computed[:batch]
        if block_table is not None:
            bt = _as_index(block_table, "block_table")
            if bt.dim() != 2 or int(bt.shape[0]) != batch:
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"block_table: shape {list(bt.shape)}, expected "
                                   f"[{batch}, width]")
            width = int(bt.shape[1])
            if r._block_table is not None:
                if width > r.block_table_width:
                    raise InvalidInput(grpc.StatusCode.OUT_OF_RANGE,
                                       f"block_table: width {width} is above the Runner's "
                                       f"block_table_width {r.block_table_width}")
                view = r._block_table[:batch, :width]
                view.copy_(bt, non_blocking=True)
                kwargs["block_table"] = view
            elif bt.is_cuda:
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   "block_table: a CUDA tensor needs Runner(block_table_width=...)"
                                   " (a bound buffer for it)")
            else:
                kwargs["block_table"] = bt.numpy().astype(np.int64).tolist()
        stream = r._stream(stream)
        if self.mode == "capture":
            if kwargs:
                raise InvalidInput(grpc.StatusCode.INVALID_ARGUMENT,
                                   "a captured step commits num_accepted only (replay_step's "
                                   "Commit takes no other arguments)")
            r._ring(2 * r.num_layers, 1, stream)
            r._wait(2 * r.num_layers + 1, stream, "commit")
            r._ring(2 * r.num_layers, 0, stream)
            r._ring(2 * r.num_layers + 1, 0, stream)
            self.done = True
            return None
        # From here on the step ends, whatever the Commit answers.
        self.done = True
        r._open_step = None
        if r.ordering == "async":
            ready, done = 2 * r.num_layers, 2 * r.num_layers + 1
            r._ring(ready, 1, stream)
            try:
                response = r.session.commit(self.id, r.num_accepted[:batch],
                                            wait=r._commit_ready, signal=r._commit_done, **kwargs)
            except BaseException:
                r._ring(ready, 0, stream)
                raise
            r._wait(done, stream, f"step {self.id}'s Commit")
            r._ring(ready, 0, stream)
            r._ring(done, 0, stream)
            return response
        if r.cuda:
            stream.synchronize()
        return r.session.commit(self.id, r.num_accepted[:batch], **kwargs)

    def abandon(self, *, stream: Any = None) -> None:
        """Ends the step without a Commit (nothing of it is committed). ASYNC:
        the layers not verified yet are run on whatever their buffers hold (the
        service's queue waits on their doorbells), so the next step starts
        clean; no state is written by them."""
        r = self.runner
        if self.done:
            return
        stream = r._stream(stream)
        if r.ordering == "async" and self.mode == "live" and r._open_step is self:
            L = r.num_layers
            for layer in range(self._next_layer, L):
                r._ring(layer, 1, stream)
                r._wait(L + layer, stream, f"abandoning step {self.id}, layer {layer}")
                r._ring(layer, 0, stream)
                r._ring(L + layer, 0, stream)
            self._next_layer = L
        self.done = True
        if r._open_step is self:
            r._open_step = None
