"""The CUDA backend from torch: registering tensors, mapping the service's pools,
doorbells and interprocess events.

torch is imported lazily, only by the functions that need it; the pure logic
(:func:`parse_torch_ipc_handle`, :func:`region_from_share_cuda`,
:func:`expandable_segments_requested`) runs without it.

**Registering a torch tensor.** ``t.untyped_storage()._share_cuda_()`` returns
``(device, handle, storage_size_bytes, storage_offset_bytes, ...)``. With
torch's default caching allocator the handle is 66 bytes: a version byte, a
type byte ``b"c"``, then the 64-byte ``cudaIpcMemHandle_t`` of the allocator's
whole *segment*; the storage starts ``storage_offset_bytes`` into it. The
session registers that (handle, offset, size) as a region whose base is the
storage's first byte, so every tensor viewing that storage resolves into it.
With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` the handle is 30
bytes of type ``b"e"``: not a CUDA IPC handle, and the service cannot open it.
:func:`parse_torch_ipc_handle` raises :class:`ExpandableSegmentsError` then;
disable expandable segments, or allocate the shared buffers with
:class:`CudaBuffer` (plain ``cudaMalloc``) and take tensors from it.

**The service's pools** are one ``cudaMalloc`` allocation exported by its
64-byte ``cudaIpcMemHandle_t``. :class:`CudaPools` opens it with
``cudaIpcOpenMemHandle`` through ctypes on the CUDA runtime torch has loaded
(``libcudart``; ``SPECSTATE_CUDART=/path/libcudart.so`` overrides), and wraps
each pool as a torch tensor through ``__cuda_array_interface__`` (no copy).

**Ordering.** A doorbell is a 4-byte counter in a registered buffer: the
service waits for ``counter >= value`` / writes ``counter = value`` on its
stream. :func:`stream_write_value32` and :func:`stream_wait_value32` do the
same on a torch stream (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``
from the driver, libcuda). Interprocess events: :func:`event_signal` turns a
``torch.cuda.Event(interprocess=True)`` into a ``Signal``.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import grpc

from specstate import dtypes
from specstate.errors import ExpandableSegmentsError, SpecStateError
from specstate.v1 import specstate_pb2 as pb

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

_EXPANDABLE_MESSAGE = (
    "this tensor lives in one of torch's expandable segments "
    "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): its IPC handle is not a "
    "cudaIpcMemHandle_t and the service cannot open it. Disable expandable segments for this "
    "process, or allocate the buffers you share with specstate.cuda.CudaBuffer (plain "
    "cudaMalloc) and take tensors from it")


# ---------------------------------------------------------------------------
# Pure logic (no torch, no CUDA).

def parse_torch_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside a handle from torch's ``_share_cuda_()``.

    Accepts torch's 66-byte form (version byte, type ``b"c"``, 64 handle
    bytes) and the raw 64 bytes older torch versions returned. Raises
    :class:`ExpandableSegmentsError` for the expandable-segments form (type
    ``b"e"``, 30 bytes with torch 2.x) and INVALID_ARGUMENT for anything else.
    """
    handle = bytes(handle)
    if len(handle) == IPC_HANDLE_BYTES + 2 and handle[1:2] == b"c":
        return handle[2:]
    if (len(handle) >= 2 and handle[1:2] == b"e") or len(handle) == 30:
        raise ExpandableSegmentsError(_EXPANDABLE_MESSAGE)
    if len(handle) == IPC_HANDLE_BYTES:
        return handle
    kind = handle[1:2] if len(handle) >= 2 else b""
    raise SpecStateError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"unrecognised torch CUDA IPC handle: {len(handle)} bytes, type byte {kind!r} "
        f"(expected {IPC_HANDLE_BYTES + 2} bytes of type b'c')")


def expandable_segments_requested(env: Optional[Dict[str, str]] = None) -> bool:
    """Whether torch's allocator config asks for expandable segments.

    Reads ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` (comma-separated
    ``key:value`` pairs) from `env` (default ``os.environ``).
    """
    env = os.environ if env is None else env
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                return True
    return False


@dataclass(frozen=True)
class TorchRegion:
    """What RegisterRegion needs for a torch storage, and where it starts here."""

    cuda_ipc_handle: bytes  # 64 bytes, of the allocator segment
    device: int
    offset_bytes: int  # of the storage inside the segment
    byte_size: int  # of the storage
    address: int  # device address of the storage's first byte in this process


def region_from_share_cuda(shared: Sequence[Any], storage_address: int) -> TorchRegion:
    """A :class:`TorchRegion` from ``storage._share_cuda_()``'s tuple and ``storage.data_ptr()``."""
    if len(shared) < 4:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"_share_cuda_() returned {len(shared)} items, expected at least 4")
    device, handle, size_bytes, offset_bytes = shared[0], shared[1], shared[2], shared[3]
    return TorchRegion(parse_torch_ipc_handle(handle), int(device), int(offset_bytes),
                       int(size_bytes), int(storage_address))


# ---------------------------------------------------------------------------
# torch.

def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415 (lazy on purpose)
    except ImportError:
        raise SpecStateError(grpc.StatusCode.UNAVAILABLE,
                             "the CUDA backend needs torch, which is not installed") from None
    if not torch.cuda.is_available():
        raise SpecStateError(grpc.StatusCode.UNAVAILABLE, "torch sees no CUDA device")
    return torch


def torch_region(tensor: Any) -> TorchRegion:
    """The region of a CUDA tensor's whole storage (see the module docstring)."""
    if not getattr(tensor, "is_cuda", False):
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT, "expected a CUDA tensor")
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT, "the tensor's storage is empty")
    try:
        shared = storage._share_cuda_()
    except RuntimeError as e:
        if expandable_segments_requested():
            raise ExpandableSegmentsError(_EXPANDABLE_MESSAGE) from e
        raise SpecStateError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"torch cannot share this tensor's storage: {e}") from e
    return region_from_share_cuda(shared, storage.data_ptr())


_TYPESTR = {dtypes.FP32: "<f4", dtypes.FP16: "<f2", dtypes.BF16: "<i2", dtypes.INT32: "<i4"}


class _CudaArray:
    """Device memory described by ``__cuda_array_interface__`` (holds `owner`)."""

    def __init__(self, address: int, shape: Sequence[int], strides_bytes: Sequence[int],
                 typestr: str, owner: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(int(s) for s in shape), "typestr": typestr,
            "data": (int(address), False), "strides": tuple(int(s) for s in strides_bytes),
            "version": 2}
        self._owner = owner


def tensor_at(address: int, shape: Sequence[int], dtype: int, device: int,
              strides: Optional[Sequence[int]] = None, owner: Any = None) -> Any:
    """A torch tensor over device memory at `address` (strides in elements; dense when None).

    `owner` is kept alive as long as the tensor.
    """
    torch = _torch()
    item = dtypes.itemsize(dtype)
    if strides is None:
        strides, step = [], 1
        for n in reversed(list(shape)):
            strides.insert(0, step)
            step *= int(n)
    cai = _CudaArray(address, shape, [s * item for s in strides], _TYPESTR[dtype], owner)
    t = torch.as_tensor(cai, device=f"cuda:{device}")
    return t.view(torch.bfloat16) if dtype == dtypes.BF16 else t


# ---------------------------------------------------------------------------
# The CUDA runtime and driver through ctypes.

class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]

    @classmethod
    def of(cls, handle: bytes) -> "_IpcMemHandle":
        if len(handle) != IPC_HANDLE_BYTES:
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES} bytes, "
                                 f"got {len(handle)}")
        return cls.from_buffer_copy(bytes(handle))


def _loaded_library(stem: str) -> Optional[str]:
    """The path of an already-loaded shared library whose name starts with `stem`."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


class _Cuda:
    """The few CUDA runtime and driver calls this module makes."""

    _instance: Optional["_Cuda"] = None

    @classmethod
    def get(cls) -> "_Cuda":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        torch = _torch()
        torch.cuda.init()  # loads torch's libcudart, so we share its runtime
        candidates = [os.environ.get("SPECSTATE_CUDART"), _loaded_library("libcudart.so"),
                      "libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
        self.rt = None
        for c in candidates:
            if not c:
                continue
            try:
                self.rt = ctypes.CDLL(c)
                break
            except OSError:
                continue
        if self.rt is None:
            raise SpecStateError(grpc.StatusCode.UNAVAILABLE,
                                 "cannot load the CUDA runtime (libcudart): set "
                                 "SPECSTATE_CUDART=/path/to/libcudart.so")
        rt = self.rt
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle,
                                            ctypes.c_uint]
        rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_void_p]
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        rt.cudaFree.argtypes = [ctypes.c_void_p]
        rt.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        self._driver: Any = None

    def check(self, err: int, what: str) -> None:
        if err != 0:
            raise SpecStateError(grpc.StatusCode.INTERNAL,
                                 f"{what}: {self.rt.cudaGetErrorString(err).decode()}")

    def on_device(self, device: int) -> "_DeviceScope":
        return _DeviceScope(self, device)

    def driver(self) -> Any:
        if self._driver is None:
            try:
                self._driver = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise SpecStateError(grpc.StatusCode.UNAVAILABLE,
                                     f"cannot load the CUDA driver (libcuda.so.1): {e}") from None
        return self._driver


class _DeviceScope:
    """Sets the current device for a block and restores the previous one."""

    def __init__(self, cuda: _Cuda, device: int) -> None:
        self.cuda, self.device, self.previous = cuda, device, ctypes.c_int(0)

    def __enter__(self) -> None:
        self.cuda.check(self.cuda.rt.cudaGetDevice(ctypes.byref(self.previous)), "cudaGetDevice")
        self.cuda.check(self.cuda.rt.cudaSetDevice(self.device), "cudaSetDevice")

    def __exit__(self, *exc: Any) -> None:
        self.cuda.rt.cudaSetDevice(self.previous.value)


class CudaBuffer:
    """Device memory from plain ``cudaMalloc``, shareable by CUDA IPC whatever
    torch's allocator settings; tensors are views into it.

        buf = CudaBuffer(64 << 20, device=0)
        q = buf.empty((T, H, K), torch.bfloat16)
        session.register(buf, "acts")
    """

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self._cuda = _Cuda.get()
        self.nbytes, self.device = int(nbytes), int(device)
        ptr = ctypes.c_void_p()
        handle = _IpcMemHandle()
        with self._cuda.on_device(self.device):
            self._cuda.check(self._cuda.rt.cudaMalloc(ctypes.byref(ptr), self.nbytes), "cudaMalloc")
            self.address = int(ptr.value)
            self._cuda.check(self._cuda.rt.cudaMemset(ptr, 0, self.nbytes), "cudaMemset")
            self._cuda.check(self._cuda.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            self._cuda.check(self._cuda.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ptr),
                             "cudaIpcGetMemHandle")
        self.ipc_handle = bytes(handle.reserved)
        self._next = 0
        self._closed = False

    def tensor(self, shape: Sequence[int], dtype: Any, offset: int = 0) -> Any:
        """A dense torch tensor of `shape` and torch `dtype` at byte `offset`."""
        d = dtypes.of_torch(dtype)
        count = 1
        for n in shape:
            count *= int(n)
        if offset < 0 or offset + count * dtypes.itemsize(d) > self.nbytes:
            raise SpecStateError(grpc.StatusCode.OUT_OF_RANGE,
                                 f"{count} elements at offset {offset} exceed the buffer's "
                                 f"{self.nbytes} bytes")
        return tensor_at(self.address + offset, shape, d, self.device, owner=self)

    def empty(self, shape: Sequence[int], dtype: Any, align: int = 256) -> Any:
        """The next free `align`-aligned piece as a dense tensor (zero at allocation)."""
        d = dtypes.of_torch(dtype)
        count = 1
        for n in shape:
            count *= int(n)
        offset = (self._next + align - 1) // align * align
        t = self.tensor(shape, dtype, offset)
        self._next = offset + count * dtypes.itemsize(d)
        return t

    def close(self) -> None:
        """Frees the memory (unregister it first; tensors from it must not be used after)."""
        if not self._closed:
            self._closed = True
            self._cuda.rt.cudaFree(ctypes.c_void_p(self.address))


class CudaPools:
    """The service's exported pools (CUDA backend) as torch tensors, opened by IPC handle.

    ``recurrent(layer)`` is ``[blocks, HV, V, K]`` (HV value heads) in the
    state dtype and ``conv(layer)`` ``[blocks, D, W]`` in the activation dtype;
    both alias the service's memory (the conv update runs in place on them).
    """

    def __init__(self, export: pb.ExportPoolsResponse, device: Optional[int] = None) -> None:
        self._vmm = None  # (handle, bytes) of kept pools imported by descriptor
        vmm = bool(export.pools_fd_socket)  # kept pools: the descriptor, not an IPC handle
        if not vmm and len(export.cuda_ipc_handle) != IPC_HANDLE_BYTES:
            raise SpecStateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the service exports its pools by shared-memory name (CPU backend): map them "
                "with specstate.shm.MappedPools")
        self._cuda = _Cuda.get()
        self.export = export
        self.device = export.device if device is None else device
        base = ctypes.c_void_p()
        with self._cuda.on_device(self.device):
            if vmm:
                base.value = self._import_kept(export)
            else:
                self._cuda.check(self._cuda.rt.cudaIpcOpenMemHandle(
                    ctypes.byref(base), _IpcMemHandle.of(export.cuda_ipc_handle), 1),  # LazyEnablePeerAccess
                    "cudaIpcOpenMemHandle of the service's pools")
        self.address = int(base.value)
        self._views: Dict[Tuple[int, str], Any] = {}
        for p in export.pools:
            self._views[(p.layer, p.kind)] = tensor_at(
                self.address + p.offset_bytes, list(p.shape), p.dtype, self.device,
                strides=list(p.strides), owner=self)
        self._closed = False

    def view(self, layer: int, kind: str) -> Any:
        try:
            return self._views[(layer, kind)]
        except KeyError:
            raise SpecStateError(grpc.StatusCode.NOT_FOUND,
                                 f"the service exports no {kind} pool for layer {layer}") from None

    def recurrent(self, layer: int) -> Any:
        return self.view(layer, "recurrent")

    def conv(self, layer: int) -> Any:
        return self.view(layer, "conv")

    def _import_kept(self, export: pb.ExportPoolsResponse) -> int:
        """Kept pools (a cuMemCreate allocation, which cudaIpcGetMemHandle cannot
        export): the descriptor from ``pools_fd_socket`` imported, mapped
        read-write on this device. Returns the mapping's address."""
        import socket  # noqa: PLC0415
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(10.0)
            sock.connect(export.pools_fd_socket)
            _, fds, _, _ = socket.recv_fds(sock, 4096, 4)
        except OSError as e:
            raise SpecStateError(grpc.StatusCode.UNAVAILABLE,
                                 f"the pools' descriptor from {export.pools_fd_socket}: {e}") from None
        finally:
            sock.close()
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise SpecStateError(grpc.StatusCode.DATA_LOSS,
                                 f"{export.pools_fd_socket} sent {len(fds)} descriptors")
        drv = self._cuda.driver()
        self._cuda.rt.cudaFree(None)  # the primary context, current for the driver calls

        def check(err: int, what: str) -> None:
            if err != 0:
                name = ctypes.c_char_p()
                drv.cuGetErrorName(err, ctypes.byref(name))
                raise SpecStateError(grpc.StatusCode.INTERNAL,
                                     f"{what}: {(name.value or b'').decode()} ({err})")

        handle = ctypes.c_ulonglong()
        try:
            check(drv.cuMemImportFromShareableHandle(  # 1: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ctypes.byref(handle), ctypes.c_void_p(fds[0]), 1),
                "cuMemImportFromShareableHandle of the pools")
        finally:
            os.close(fds[0])  # the imported handle holds the allocation
        size = ctypes.c_size_t(export.pools_fd_bytes)
        base = ctypes.c_ulonglong()
        check(drv.cuMemAddressReserve(ctypes.byref(base), size, ctypes.c_size_t(0),
                                      ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)),
              "cuMemAddressReserve")
        check(drv.cuMemMap(base, size, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)),
              "cuMemMap of the pools")

        class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]

        # CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
        desc = _AccessDesc(1, self.device, 3)
        check(drv.cuMemSetAccess(base, size, ctypes.byref(desc), ctypes.c_size_t(1)),
              "cuMemSetAccess")
        self._vmm = (handle, size)
        return int(base.value)

    def close(self) -> None:
        """Closes the IPC mapping (the tensors must not be used after)."""
        if not self._closed:
            self._closed = True
            self._views.clear()
            if self._vmm is not None:
                drv = self._cuda.driver()
                handle, size = self._vmm
                drv.cuMemUnmap(ctypes.c_ulonglong(self.address), size)
                drv.cuMemAddressFree(ctypes.c_ulonglong(self.address), size)
                drv.cuMemRelease(handle)
            else:
                self._cuda.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(self.address))


def _stream_handle(stream: Any) -> int:
    if stream is None:
        return int(_torch().cuda.current_stream().cuda_stream)
    return int(getattr(stream, "cuda_stream", stream))


def _address(counter: Any) -> int:
    return int(counter.data_ptr()) if hasattr(counter, "data_ptr") else int(counter)


def _driver_call(name: str, *args: Any) -> None:
    cuda = _Cuda.get()
    driver = cuda.driver()
    fn = getattr(driver, name + "_v2", None) or getattr(driver, name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    err = fn(*args)
    if err != 0:
        raise SpecStateError(grpc.StatusCode.INTERNAL, f"{name} failed with CUresult {err}")


def stream_write_value32(counter: Any, value: int, stream: Any = None) -> None:
    """Enqueues ``*counter = value`` on `stream` (default: torch's current stream).

    `counter` is a 4-byte tensor element in a registered buffer, or a device address.
    """
    _driver_call("cuStreamWriteValue32", ctypes.c_void_p(_stream_handle(stream)),
                 _address(counter), value & 0xFFFFFFFF, 0)


def stream_wait_value32(counter: Any, value: int, stream: Any = None) -> None:
    """Makes `stream` wait until ``*counter >= value`` (CU_STREAM_WAIT_VALUE_GEQ)."""
    _driver_call("cuStreamWaitValue32", ctypes.c_void_p(_stream_handle(stream)),
                 _address(counter), value & 0xFFFFFFFF, 0)


def event_signal(event: Any) -> pb.Signal:
    """A ``Signal`` of a ``torch.cuda.Event(interprocess=True)`` (its 64-byte IPC handle)."""
    handle = event.ipc_handle() if hasattr(event, "ipc_handle") else bytes(event)
    return pb.Signal(event=pb.IpcEvent(handle=bytes(handle)))
