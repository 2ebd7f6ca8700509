"""Tensor parallelism: connect_ranks and check_rank_layouts.

The check alone on layouts built here (every field, CUDA devices), then two
real CPU-backend services, each holding half of a 4-head model, and a third
whose layout is not a rank's part of that model.
"""
from __future__ import annotations

import os
import sys
import tempfile
import unittest

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import server_fixture  # noqa: E402
import specstate  # noqa: E402
from specstate import SpecStateError  # noqa: E402
from specstate.v1 import specstate_pb2 as pb  # noqa: E402

# A rank's part of a 4-head KDA model at TP=2.
HALF = dict(layers=2, heads=2, head_dim=64, conv_dim=32, conv_kernel=4, num_spec=3, blocks=16,
            max_rows=4)


def part(device: int = 0, **fields) -> pb.Layout:
    layout = pb.Layout(backend=pb.CPU, device=device, num_layers=4, num_heads=2, head_dim=64,
                       conv_dim=384, conv_kernel=4, num_spec=3, num_blocks=64, max_rows=16,
                       activation_dtype=pb.BF16, state_dtype=pb.FP32, cache_mode=pb.NONE,
                       lower_bound=-5.0)
    for name, value in fields.items():
        setattr(layout, name, value)
    return layout


class CheckRankLayoutsTest(unittest.TestCase):
    def refused(self, layouts, addresses=None) -> SpecStateError:
        with self.assertRaises(SpecStateError) as cm:
            specstate.check_rank_layouts(layouts, addresses)
        return cm.exception

    def test_equal_parts_pass(self) -> None:
        specstate.check_rank_layouts([part()])
        specstate.check_rank_layouts([part(), part(), part(mps_client=True)])
        specstate.check_rank_layouts([part(), part(num_value_heads=2)])  # 0 means as many as heads

    def test_no_layout_is_invalid(self) -> None:
        self.assertEqual(self.refused([]).code, grpc.StatusCode.INVALID_ARGUMENT)

    def test_every_field_that_differs_is_named(self) -> None:
        cases = [
            ("backend", pb.CUDA, "CUDA", "CPU"), ("layer_kind", pb.GDN, "GDN", "KDA"),
            ("kda_gate", pb.PLAIN_GATE, "PLAIN_GATE", "SAFE_GATE"), ("num_layers", 5, "5", "4"),
            ("num_heads", 3, "3", "2"), ("num_value_heads", 4, "4", "2"),
            ("head_dim", 128, "128", "64"), ("conv_dim", 768, "768", "384"),
            ("conv_kernel", 3, "3", "4"), ("num_spec", 2, "2", "3"),
            ("num_blocks", 65, "65", "64"), ("max_rows", 8, "8", "16"),
            ("activation_dtype", pb.FP16, "FP16", "BF16"), ("state_dtype", pb.BF16, "BF16", "FP32"),
            ("cache_mode", pb.ALIGN, "ALIGN", "NONE"), ("mamba_block_size", 8, "8", "0"),
            ("lower_bound", -4.0, "-4", "-5"),
        ]
        for field, value, got, want in cases:
            with self.subTest(field):
                e = self.refused([part(), part(), part(**{field: value})],
                                 ["unix:///a", "unix:///b", "unix:///c"])
                self.assertEqual(e.code, grpc.StatusCode.FAILED_PRECONDITION)
                self.assertIn(f"rank 2 (unix:///c): {field} is {got}, rank 0 (unix:///a)'s is "
                              f"{want}: ", e.message)

    def test_cuda_ranks_need_their_own_devices(self) -> None:
        a, b, c = part(0, backend=pb.CUDA), part(1, backend=pb.CUDA), part(0, backend=pb.CUDA)
        specstate.check_rank_layouts([a, b])
        e = self.refused([a, b, c], ["unix:///a", "unix:///b", "unix:///c"])
        self.assertEqual(e.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn("rank 2 (unix:///c) and rank 0 (unix:///a) are both on CUDA device 0",
                      e.message)
        self.assertIn("rank 1 and rank 0 are both on CUDA device 0", self.refused([a, a]).message)


class ConnectRanksTest(unittest.TestCase):
    def test_addresses_are_checked(self) -> None:
        with self.assertRaises(SpecStateError) as cm:
            specstate.connect_ranks([])
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        with self.assertRaises(SpecStateError) as cm:
            specstate.connect_ranks(["unix:///tmp/x.sock", "unix:///tmp/y.sock",
                                     "unix:///tmp/x.sock"])
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("rank 2's address is rank 0's (unix:///tmp/x.sock)", cm.exception.message)

    def test_a_service_that_does_not_answer_is_named_by_rank(self) -> None:
        d = tempfile.mkdtemp(prefix="ss", dir="/tmp")
        with server_fixture.Server(**HALF) as rank0:
            with self.assertRaises(SpecStateError) as cm:
                specstate.connect_ranks([rank0.address, f"unix://{d}/nobody.sock"],
                                        connect_timeout=0.5)
        os.rmdir(d)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("rank 1: cannot connect to specstated at unix://", cm.exception.message)

    def test_two_services_of_one_model(self) -> None:
        with server_fixture.Server(**HALF, device=0) as rank0, \
                server_fixture.Server(**HALF, device=1) as rank1:
            clients = specstate.connect_ranks([rank0.address, rank1.address], deadline=10.0)
            try:
                self.assertEqual([c.address for c in clients], [rank0.address, rank1.address])
                self.assertEqual([c.layout().num_heads for c in clients], [2, 2])
                self.assertEqual(clients[1].deadline, 10.0)
            finally:
                for c in clients:
                    c.close()

    def test_a_service_of_another_layout_is_refused(self) -> None:
        with server_fixture.Server(**HALF) as rank0, \
                server_fixture.Server(**{**HALF, "heads": 3}) as rank1:
            with self.assertRaises(SpecStateError) as cm:
                specstate.connect_ranks([rank0.address, rank1.address])
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn(f"rank 1 ({rank1.address}): num_heads is 3, rank 0 ({rank0.address})'s "
                      "is 2: under tensor parallelism", cm.exception.message)


if __name__ == "__main__":
    junit_runner.main()
