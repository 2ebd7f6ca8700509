"""Element types of the wire contract and their numpy / torch counterparts.

numpy has no bfloat16: this package represents a bf16 buffer as a ``uint16``
array holding the raw bf16 bits (the top half of a float32). A uint16 array
handed to the client is therefore sent as BF16; use :func:`to_bfloat16` and
:func:`from_bfloat16` to convert. (An ``ml_dtypes.bfloat16`` array is also
accepted as BF16.) torch tensors keep their own dtypes (``torch.bfloat16``).
"""
from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from specstate.errors import SpecStateError
from specstate.v1 import specstate_pb2 as pb

FP32: int = pb.FP32
FP16: int = pb.FP16
BF16: int = pb.BF16
INT32: int = pb.INT32

_ITEMSIZE = {FP32: 4, FP16: 2, BF16: 2, INT32: 4}
_NUMPY_OF = {FP32: np.dtype(np.float32), FP16: np.dtype(np.float16),
             BF16: np.dtype(np.uint16), INT32: np.dtype(np.int32)}
_OF_NUMPY = {np.dtype(np.float32): FP32, np.dtype(np.float16): FP16,
             np.dtype(np.uint16): BF16, np.dtype(np.int32): INT32}
_OF_TORCH_NAME = {"torch.float32": FP32, "torch.float16": FP16,
                  "torch.bfloat16": BF16, "torch.int32": INT32}


def name(dtype: int) -> str:
    """"FP32", "BF16", ... for a ``specstate.v1.DType`` value."""
    return pb.DType.Name(dtype)


def itemsize(dtype: int) -> int:
    """Bytes per element of a ``specstate.v1.DType``."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"dtype {dtype} is not FP32, FP16, BF16 or INT32") from None


def numpy_dtype(dtype: int) -> np.dtype:
    """The numpy dtype that holds a ``specstate.v1.DType`` (BF16 -> uint16 bits)."""
    try:
        return _NUMPY_OF[dtype]
    except KeyError:
        raise SpecStateError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"dtype {dtype} is not FP32, FP16, BF16 or INT32") from None


def of_numpy(dtype: Any) -> int:
    """The ``specstate.v1.DType`` of a numpy dtype (uint16 and ml_dtypes' bfloat16 -> BF16)."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return BF16
    found = _OF_NUMPY.get(dt) if dt.isnative else None
    if found is None:
        raise SpecStateError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"numpy dtype {dt} has no SpecState dtype: use float32, float16, int32, or uint16 "
            "for bf16 bits")
    return found


def of_torch(dtype: Any) -> int:
    """The ``specstate.v1.DType`` of a torch dtype (without importing torch)."""
    found = _OF_TORCH_NAME.get(str(dtype))
    if found is None:
        raise SpecStateError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"torch dtype {dtype} has no SpecState dtype: use float32, float16, bfloat16 or int32")
    return found


def to_bfloat16(x: Any) -> np.ndarray:
    """float values -> bf16 bits as uint16, rounding to nearest even (NaN stays NaN)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def from_bfloat16(bits: Any) -> np.ndarray:
    """bf16 bits (uint16) -> float32 values."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def to_numpy_values(x: Any, dtype: int) -> np.ndarray:
    """float values -> an array of `dtype`'s numpy representation (bf16 as uint16 bits)."""
    if dtype == BF16:
        return to_bfloat16(x)
    return np.asarray(x, dtype=numpy_dtype(dtype))


def as_float32(a: np.ndarray, dtype: int) -> np.ndarray:
    """An array of `dtype`'s numpy representation -> float32 values (bf16 bits decoded)."""
    if dtype == BF16:
        return from_bfloat16(a)
    return np.asarray(a, dtype=np.float32)
