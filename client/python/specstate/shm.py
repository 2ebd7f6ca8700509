"""POSIX shared memory for the CPU backend: buffers the scheduler shares with
the service, and the service's exported pools mapped as numpy views.

    buf = SharedBuffer(1 << 20)                  # shm_open + mmap, unlinked on close()
    q = buf.empty((T, H, K), np.uint16)          # bf16 bits (numpy has no bfloat16)
    session.register(buf, "acts")                # RegisterRegion(shm_name=buf.name)
    pools = MappedPools(client.export_pools())   # the service's pools
    pools.conv(0)[block]                         # [D, W] view, writable in place

The objects are opened with CPython's ``_posixshmem`` (the module behind
``multiprocessing.shared_memory``), not ``SharedMemory`` itself: before Python
3.13 its resource tracker unlinks every segment a process merely attached to
when that process exits, which would unlink the service's pools.
"""
from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
import time
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import _posixshmem  # CPython's shm_open / shm_unlink wrapper (POSIX only)
import grpc
import numpy as np

from specstate import dtypes
from specstate.errors import SpecStateError
from specstate.v1 import specstate_pb2 as pb

_counter = itertools.count()
_live_lock = threading.Lock()
_live: "weakref.WeakSet[SharedBuffer]" = weakref.WeakSet()


def _shm_error(what: str, err: OSError) -> SpecStateError:
    code = grpc.StatusCode.NOT_FOUND if isinstance(err, FileNotFoundError) else grpc.StatusCode.INTERNAL
    return SpecStateError(code, f"{what}: {err.strerror or err}")


def _release(mm: mmap.mmap, name: Optional[str]) -> None:
    if name is not None:
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:
            pass
    try:
        mm.close()
    except BufferError:
        pass  # numpy views are still alive: the mapping goes when they do


def array_address(a: np.ndarray) -> int:
    """The address of element 0 of a numpy array."""
    return int(a.__array_interface__["data"][0])


class SharedBuffer:
    """A POSIX shared-memory object mapped read-write into this process.

    `name` is the object's name ("/specstate-py-..."), what RegisterRegion's
    ``shm_name`` takes. Arrays are views into it: :meth:`ndarray` at a given
    offset, or :meth:`empty` / :meth:`zeros` which hand out consecutive aligned
    pieces. The object is unlinked by :meth:`close` (or when the buffer is
    garbage-collected or the process exits); views stay valid until they go.
    Represent bf16 data as ``np.uint16`` arrays of bf16 bits.
    """

    def __init__(self, nbytes: int, name: Optional[str] = None) -> None:
        if nbytes <= 0:
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT, f"nbytes = {nbytes} must be > 0")
        if name is None:
            name = f"/specstate-py-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        try:
            fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        except OSError as e:
            raise _shm_error(f"shm_open({name})", e) from None
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except OSError as e:
            _posixshmem.shm_unlink(name)
            raise _shm_error(f"sizing {name} to {nbytes} bytes", e) from None
        finally:
            os.close(fd)
        self.name = name
        self.nbytes = nbytes
        self._mm = mm
        self._bytes = np.frombuffer(mm, dtype=np.uint8)
        self.address = array_address(self._bytes)
        self._next = 0
        self._finalizer = weakref.finalize(self, _release, mm, name)
        with _live_lock:
            _live.add(self)

    # ---- views ----

    def ndarray(self, shape: Sequence[int], dtype: Any, offset: int = 0,
                strides: Optional[Sequence[int]] = None) -> np.ndarray:
        """A view of `shape` and `dtype` at byte `offset` (strides in bytes, dense when None)."""
        dt = np.dtype(dtype)
        return np.ndarray(tuple(shape), dtype=dt, buffer=self._bytes, offset=offset,
                          strides=None if strides is None else tuple(strides))

    def empty(self, shape: Sequence[int], dtype: Any, align: int = 256) -> np.ndarray:
        """The next free `align`-aligned piece as a dense array (contents undefined)."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        offset = (self._next + align - 1) // align * align
        if offset + count * dt.itemsize > self.nbytes:
            raise SpecStateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.name}: {count * dt.itemsize} more bytes do not fit "
                f"({offset} of {self.nbytes} used)")
        self._next = offset + count * dt.itemsize
        return self.ndarray(shape, dt, offset)

    def zeros(self, shape: Sequence[int], dtype: Any, align: int = 256) -> np.ndarray:
        """Like :meth:`empty`, zero-filled."""
        a = self.empty(shape, dtype, align)
        a[...] = 0
        return a

    def contains(self, address: int, nbytes: int = 1) -> bool:
        """Whether [address, address + nbytes) lies inside this buffer."""
        return self.address <= address and address + nbytes <= self.address + self.nbytes

    @staticmethod
    def owning(a: np.ndarray) -> Optional["SharedBuffer"]:
        """The live SharedBuffer whose memory holds array `a`'s first element, if any."""
        address = array_address(a)
        with _live_lock:
            for buf in list(_live):
                if buf.contains(address):
                    return buf
        return None

    # ---- life ----

    def close(self) -> None:
        """Unlinks the object and unmaps it (once no numpy view uses it any more)."""
        with _live_lock:
            _live.discard(self)
        self._finalizer()

    def __enter__(self) -> "SharedBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SharedBuffer({self.name!r}, {self.nbytes} bytes)"


class MappedPools:
    """The service's exported pools (CPU backend), mapped as numpy views.

    ``recurrent(layer)`` is ``[blocks, HV, V, K]`` (HV value heads) in the
    state dtype and ``conv(layer)`` is ``[blocks, D, W]`` in the activation
    dtype, both writable in place (bf16 as uint16 bits). The views alias the service's
    memory: read them only when no call that writes them is in flight.
    """

    def __init__(self, export: pb.ExportPoolsResponse) -> None:
        if not export.shm_path:
            raise SpecStateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the service exports its pools by CUDA IPC handle (CUDA backend): map them with "
                "specstate.cuda.CudaPools")
        try:
            # A sealed memfd of the service's, by its /proc path.
            fd = os.open(export.shm_path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise _shm_error(f"open({export.shm_path}) of the service's pools", e) from None
        try:
            mm = mmap.mmap(fd, export.allocation_bytes)
        except OSError as e:
            raise _shm_error(f"mmap of the service's pools ({export.shm_path})", e) from None
        finally:
            os.close(fd)
        self.export = export
        self._mm = mm
        self._bytes = np.frombuffer(mm, dtype=np.uint8)
        self._finalizer = weakref.finalize(self, _release, mm, None)
        self._views: Dict[Tuple[int, str], np.ndarray] = {}
        for p in export.pools:
            dt = dtypes.numpy_dtype(p.dtype)
            self._views[(p.layer, p.kind)] = np.ndarray(
                tuple(p.shape), dtype=dt, buffer=self._bytes, offset=p.offset_bytes,
                strides=tuple(s * dt.itemsize for s in p.strides))

    def view(self, layer: int, kind: str) -> np.ndarray:
        """Layer `layer`'s pool of `kind` ("recurrent" or "conv")."""
        try:
            return self._views[(layer, kind)]
        except KeyError:
            raise SpecStateError(grpc.StatusCode.NOT_FOUND,
                                 f"the service exports no {kind} pool for layer {layer}") from None

    def recurrent(self, layer: int) -> np.ndarray:
        """``[blocks, HV, V, K]`` recurrent states of `layer` (one per value head)."""
        return self.view(layer, "recurrent")

    def conv(self, layer: int) -> np.ndarray:
        """``[blocks, D, W]`` conv states of `layer`."""
        return self.view(layer, "conv")

    def snapshot(self) -> bytes:
        """A copy of every pool's bytes (for before/after comparisons)."""
        return self._bytes.tobytes()

    def close(self) -> None:
        """Unmaps the pools (once no view is alive)."""
        self._views.clear()
        self._finalizer()

    def __enter__(self) -> "MappedPools":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def ring(counter: np.ndarray, value: int) -> None:
    """Sets a doorbell counter (a 4-byte element in a registered buffer) to `value`."""
    counter[...] = np.uint32(value).astype(counter.dtype)


def wait_counter(counter: np.ndarray, value: int, timeout: float = 60.0,
                 poll: float = 50e-6) -> None:
    """Waits until a doorbell counter in shared memory is >= `value` (unsigned).

    DEADLINE_EXCEEDED after `timeout` seconds.
    """
    target = value & 0xFFFFFFFF
    deadline = time.monotonic() + timeout
    word = counter.reshape(()).view(np.uint32) if counter.dtype != np.uint32 else counter.reshape(())
    while int(word) < target:
        if time.monotonic() > deadline:
            raise SpecStateError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"the doorbell did not reach {target} within {timeout:g} s "
                                 f"(it holds {int(word)})")
        time.sleep(poll)
