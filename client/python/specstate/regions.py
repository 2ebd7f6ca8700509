"""The region cache: turns arrays and tensors into references into registered regions.

A call carries tensors as ``RegionTensor`` = region name + byte offset +
dtype + shape + strides (in elements). The cache knows every buffer this
session registered (its address range in this process) and finds the one that
holds a numpy array (CPU backend, shared memory) or a torch tensor (CUDA
backend: device addresses; CPU torch tensors in shared memory work too).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from specstate import dtypes
from specstate.errors import SpecStateError
from specstate.shm import array_address
from specstate.v1 import specstate_pb2 as pb


def is_torch_tensor(x: Any) -> bool:
    """Whether `x` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


@dataclass
class ArrayInfo:
    """Where an array or tensor lives: address of element 0, strides, dtype."""

    address: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]  # elements
    itemsize: int
    dtype: int  # specstate.v1.DType
    space: str  # "host" or "cuda:N"

    def extent(self) -> Tuple[int, int]:
        """[first, last) byte addresses the array touches."""
        lo = hi = 0
        for n, s in zip(self.shape, self.strides):
            if n == 0:
                return self.address, self.address
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
        return self.address + lo * self.itemsize, self.address + (hi + 1) * self.itemsize


def describe(x: Any, dtype: Optional[int] = None) -> ArrayInfo:
    """Address, shape, strides and dtype of a numpy array or torch tensor."""
    if isinstance(x, np.ndarray):
        d = dtypes.of_numpy(x.dtype) if dtype is None else dtype
        item = x.dtype.itemsize
        for s in x.strides:
            if s % item:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"array strides {x.strides} are not multiples of its "
                                     f"{item}-byte elements")
        return ArrayInfo(array_address(x), tuple(x.shape), tuple(s // item for s in x.strides),
                         item, d, "host")
    if is_torch_tensor(x):
        d = dtypes.of_torch(x.dtype) if dtype is None else dtype
        space = f"cuda:{x.device.index or 0}" if x.is_cuda else "host"
        return ArrayInfo(int(x.data_ptr()), tuple(x.shape), tuple(x.stride()),
                         int(x.element_size()), d, space)
    raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"expected a numpy array or a torch tensor, got {type(x).__name__}")


@dataclass
class Region:
    """A registered buffer: its name and its address range in this process."""

    name: str
    address: int
    nbytes: int
    space: str  # "host" or "cuda:N"
    owner: Any = field(default=None, repr=False)  # kept alive while registered

    def holds(self, begin: int, end: int, space: str) -> bool:
        return (space == self.space and self.address <= begin
                and end <= self.address + self.nbytes)


class RegionCache:
    """The regions of one session, looked up by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: List[Region] = []

    def add(self, region: Region) -> None:
        with self._lock:
            self._regions.append(region)

    def remove(self, name: str) -> Optional[Region]:
        with self._lock:
            for i, r in enumerate(self._regions):
                if r.name == name:
                    return self._regions.pop(i)
        return None

    def names(self) -> List[str]:
        with self._lock:
            return [r.name for r in self._regions]

    def get(self, name: str) -> Optional[Region]:
        with self._lock:
            return next((r for r in self._regions if r.name == name), None)

    def find(self, begin: int, end: int, space: str) -> Optional[Region]:
        # Newest first: memory freed and allocated again at the same address is
        # registered again, and the new registration is the one that holds it.
        with self._lock:
            for r in reversed(self._regions):
                if r.holds(begin, end, space):
                    return r
        return None

    def find_exact(self, address: int, nbytes: int, space: str) -> Optional[Region]:
        """The region registered for exactly this buffer, if any (newest first)."""
        with self._lock:
            for r in reversed(self._regions):
                if (r.address, r.nbytes, r.space) == (address, nbytes, space):
                    return r
        return None

    def tensor(self, x: Any, dtype: Optional[int] = None,
               shape: Optional[Sequence[int]] = None,
               strides: Optional[Sequence[int]] = None) -> pb.RegionTensor:
        """The RegionTensor of `x` (numpy array or torch tensor; a RegionTensor passes through).

        `dtype` overrides the element type (a ``specstate.v1.DType``); `shape`
        and `strides` (elements) override the array's own. NOT_FOUND when no
        registered buffer holds every byte of it.
        """
        if isinstance(x, pb.RegionTensor):
            return x
        info = describe(x, dtype)
        if shape is not None:
            info.shape = tuple(shape)
            if strides is None:
                raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                     "give strides together with shape")
        if strides is not None:
            info.strides = tuple(strides)
        if any(s < 0 for s in info.strides):
            raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"negative strides {info.strides}: the service reads "
                                 "forward strides only (copy the array first)")
        begin, end = info.extent()
        region = self.find(begin, max(end, begin + 1), info.space)
        if region is None:
            raise SpecStateError(
                grpc.StatusCode.NOT_FOUND,
                f"no registered buffer of this session holds the {info.space} "
                f"{'x'.join(map(str, info.shape)) or 'scalar'} {dtypes.name(info.dtype)} tensor at "
                f"0x{info.address:x}: allocate it in a SharedBuffer / CudaBuffer (or a registered "
                "torch tensor's storage) and register that first")
        return pb.RegionTensor(region=region.name, offset_bytes=info.address - region.address,
                               dtype=info.dtype, shape=list(info.shape),
                               strides=list(info.strides))

    def index(self, x: Any) -> Optional[pb.IndexTensor]:
        """An int32 IndexTensor: in a region when `x` lives in one, else inline.

        Lists, tuples, ranges and numpy arrays outside every region travel
        inline (their values now); arrays in a registered buffer travel as a
        reference (the service reads them when the call runs, which matters
        for ASYNC calls). None stays None.
        """
        if x is None or isinstance(x, pb.IndexTensor):
            return x
        if isinstance(x, pb.RegionTensor):
            return pb.IndexTensor(region=x)
        if isinstance(x, pb.Int32Values):
            return pb.IndexTensor(values=x)
        if isinstance(x, np.ndarray) or is_torch_tensor(x):
            info = describe(x, dtypes.INT32) if _is_int32(x) else None
            if info is not None:
                begin, end = info.extent()
                region = self.find(begin, max(end, begin + 1), info.space)
                if region is not None:
                    return pb.IndexTensor(region=self.tensor(x))
            if is_torch_tensor(x):
                if x.is_cuda:
                    raise SpecStateError(
                        grpc.StatusCode.NOT_FOUND,
                        "a CUDA index tensor must be int32 and live in a registered buffer "
                        "(or pass a list / CPU array to send it inline)")
                x = x.numpy()
        return pb.IndexTensor(values=inline_int32(x))

    def floats(self, x: Any) -> pb.FloatTensor:
        """A float32 FloatTensor: in a region when `x` is an fp32 array in one, else inline."""
        if isinstance(x, pb.FloatTensor):
            return x
        if isinstance(x, pb.RegionTensor):
            return pb.FloatTensor(region=x)
        if isinstance(x, np.ndarray) or is_torch_tensor(x):
            info = describe(x)
            if info.dtype == dtypes.FP32:
                begin, end = info.extent()
                if self.find(begin, max(end, begin + 1), info.space) is not None:
                    return pb.FloatTensor(region=self.tensor(x))
            if is_torch_tensor(x):
                x = x.detach().float().cpu().numpy()
        values = np.asarray(x, dtype=np.float32).reshape(-1)
        return pb.FloatTensor(values=pb.FloatValues(values=values.tolist()))


def _is_int32(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.dtype == np.int32
    return str(x.dtype) == "torch.int32"


def inline_int32(x: Any) -> pb.Int32Values:
    """Int32Values of a list, nested list (2-D) or array of integers."""
    a = np.asarray(x)
    if a.size and a.dtype.kind not in "iu":
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"index values must be integers, got {a.dtype}")
    if a.ndim > 2:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"index tensors have rank 1 or 2, got shape {a.shape}")
    if a.size and (a.min() < -(2 ** 31) or a.max() >= 2 ** 31):
        raise SpecStateError(grpc.StatusCode.OUT_OF_RANGE, "index values must fit in int32")
    return pb.Int32Values(values=a.astype(np.int64).reshape(-1).tolist(), shape=list(a.shape))
