"""The pure logic of the torch / CUDA helpers and of the region cache, with
fake handles and fake tensors: no torch, no GPU, no server."""
from __future__ import annotations

import os
import sys
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import specstate  # noqa: E402
from specstate import cuda, dtypes  # noqa: E402
from specstate.regions import Region, RegionCache  # noqa: E402
from specstate.v1 import specstate_pb2 as pb  # noqa: E402

IPC = bytes(range(64))  # a stand-in cudaIpcMemHandle_t


class HandleParsingTest(unittest.TestCase):
    def test_default_allocator_handle(self) -> None:
        self.assertEqual(cuda.parse_torch_ipc_handle(b"\x02c" + IPC), IPC)

    def test_raw_64_byte_handle_of_older_torch(self) -> None:
        self.assertEqual(cuda.parse_torch_ipc_handle(IPC), IPC)

    def test_expandable_segment_handle_is_refused_clearly(self) -> None:
        for handle in (b"\x02e" + bytes(28), b"\x02e" + bytes(64), bytes(30)):
            with self.assertRaises(specstate.ExpandableSegmentsError) as cm:
                cuda.parse_torch_ipc_handle(handle)
            e = cm.exception
            self.assertIsInstance(e, specstate.SpecStateError)
            self.assertEqual(e.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("expandable_segments", e.message)
            self.assertIn("CudaBuffer", e.message)

    def test_unknown_handles_are_invalid_argument(self) -> None:
        for handle in (b"", b"\x02", b"\x02c" + bytes(10), b"\x02x" + IPC, bytes(65)):
            with self.assertRaises(specstate.SpecStateError) as cm:
                cuda.parse_torch_ipc_handle(handle)
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, handle)

    def test_region_from_share_cuda_tuple(self) -> None:
        shared = (1, b"\x02c" + IPC, 8192, 1536, b"ref", 0, b"event", True)
        r = cuda.region_from_share_cuda(shared, storage_address=0x7F0000001600)
        self.assertEqual(r, cuda.TorchRegion(IPC, 1, 1536, 8192, 0x7F0000001600))
        with self.assertRaises(specstate.ExpandableSegmentsError):
            cuda.region_from_share_cuda((0, b"\x02e" + bytes(28), 4096, 0), 0x1000)
        with self.assertRaises(specstate.SpecStateError):
            cuda.region_from_share_cuda((0, IPC), 0x1000)

    def test_expandable_segments_requested(self) -> None:
        yes = [{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
               {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"},
               {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}]
        no = [{}, {"PYTORCH_CUDA_ALLOC_CONF": ""},
              {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
              {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}]
        for env in yes:
            self.assertTrue(cuda.expandable_segments_requested(env), env)
        for env in no:
            self.assertFalse(cuda.expandable_segments_requested(env), env)

    def test_importing_the_cuda_module_does_not_import_torch(self) -> None:
        if "torch" in sys.modules:
            self.skipTest("torch was already imported by something else")
        import importlib  # noqa: PLC0415
        importlib.reload(cuda)
        self.assertNotIn("torch", sys.modules)


class _FakeDType:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


class _FakeDevice:
    index = 0


class FakeCudaTensor:
    """Quacks like a CUDA torch tensor for the region cache."""

    def __init__(self, address: int, shape, strides, dtype: str, itemsize: int) -> None:
        self._address, self.shape, self._strides = address, tuple(shape), tuple(strides)
        self.dtype, self._itemsize = _FakeDType(dtype), itemsize
        self.is_cuda, self.device = True, _FakeDevice()

    def data_ptr(self) -> int:
        return self._address

    def stride(self):
        return self._strides

    def element_size(self) -> int:
        return self._itemsize


FakeCudaTensor.__module__ = "torch"  # what is_torch_tensor looks at


class RegionCacheTest(unittest.TestCase):
    def setUp(self) -> None:
        self.cache = RegionCache()
        self.cache.add(Region("acts", 0x10000, 1 << 16, "cuda:0"))

    def test_cuda_tensor_resolves_with_offset_and_strides(self) -> None:
        # q as a column slice of a [T, 3*H*K + H] projection: token stride > a token.
        t = FakeCudaTensor(0x10000 + 512, (4, 2, 64), (3 * 128 + 2, 64, 1), "torch.bfloat16", 2)
        rt = self.cache.tensor(t)
        self.assertEqual(rt.region, "acts")
        self.assertEqual(rt.offset_bytes, 512)
        self.assertEqual(rt.dtype, pb.BF16)
        self.assertEqual(list(rt.shape), [4, 2, 64])
        self.assertEqual(list(rt.strides), [386, 64, 1])

    def test_tensor_running_past_the_region_is_not_found(self) -> None:
        t = FakeCudaTensor(0x10000 + (1 << 16) - 64, (64,), (1,), "torch.float32", 4)
        with self.assertRaises(specstate.SpecStateError) as cm:
            self.cache.tensor(t)
        self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_host_array_never_matches_a_cuda_region(self) -> None:
        with self.assertRaises(specstate.SpecStateError) as cm:
            self.cache.tensor(np.zeros(4, np.float32))
        self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_unsupported_torch_dtype(self) -> None:
        t = FakeCudaTensor(0x10000, (4,), (1,), "torch.float64", 8)
        with self.assertRaises(specstate.SpecStateError) as cm:
            self.cache.tensor(t)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_index_tensors(self) -> None:
        inline = self.cache.index([[1, 2], [3, 4]])
        self.assertEqual(list(inline.values.values), [1, 2, 3, 4])
        self.assertEqual(list(inline.values.shape), [2, 2])
        self.assertEqual(list(self.cache.index(np.arange(3)).values.values), [0, 1, 2])
        cuda_idx = FakeCudaTensor(0x10000 + 64, (3,), (1,), "torch.int32", 4)
        self.assertEqual(self.cache.index(cuda_idx).region.offset_bytes, 64)
        with self.assertRaises(specstate.SpecStateError) as cm:
            self.cache.index([2 ** 31])
        self.assertEqual(cm.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        with self.assertRaises(specstate.SpecStateError):
            self.cache.index([0.5])


class DTypeTest(unittest.TestCase):
    def test_bfloat16_round_trip_and_rounding(self) -> None:
        x = np.array([1.0, -2.5, 3.140625, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 0.0], np.float32)
        bits = specstate.to_bfloat16(x)
        # 1 + 2^-8 is a tie: rounds to even (1.0); 1 + 3*2^-8 rounds up to 1 + 2^-6.
        np.testing.assert_array_equal(specstate.from_bfloat16(bits),
                                      [1.0, -2.5, 3.140625, 1.0, 1.0 + 2 ** -6, 0.0])
        self.assertTrue(np.isnan(specstate.from_bfloat16(specstate.to_bfloat16([np.nan]))[0]))

    def test_dtype_mapping(self) -> None:
        self.assertEqual(dtypes.of_numpy(np.uint16), pb.BF16)
        self.assertEqual(dtypes.of_numpy(np.float32), pb.FP32)
        self.assertEqual(dtypes.of_torch("torch.bfloat16"), pb.BF16)
        self.assertEqual(dtypes.numpy_dtype(pb.BF16), np.uint16)
        with self.assertRaises(specstate.SpecStateError):
            dtypes.of_numpy(np.float64)
        with self.assertRaises(specstate.SpecStateError):
            dtypes.of_numpy(np.dtype(">f4"))


if __name__ == "__main__":
    junit_runner.main()
