"""Error paths against a real specstated: every failure is a SpecStateError
with the right gRPC code and a message naming what was wrong."""
from __future__ import annotations

import os
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import server_fixture  # noqa: E402
import specstate  # noqa: E402
from specstate import SpecStateError  # noqa: E402
from specstate.v1 import specstate_pb2 as pb  # noqa: E402

FLAGS = dict(layers=2, heads=2, head_dim=64, conv_dim=32, conv_kernel=4, num_spec=3, blocks=16,
             max_rows=4, activation_dtype="bf16", cache_mode="none")


class ServerDownTest(unittest.TestCase):
    def test_dead_socket_is_unavailable(self) -> None:
        d = tempfile.mkdtemp(prefix="ss", dir="/tmp")
        address = f"unix://{d}/nobody.sock"
        started = time.monotonic()
        with self.assertRaises(SpecStateError) as cm:
            specstate.Client(address, connect_timeout=0.5)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn(address, cm.exception.message)
        self.assertIn("is it running", cm.exception.message)
        self.assertLess(time.monotonic() - started, 5)
        os.rmdir(d)

    def test_server_gone_mid_session(self) -> None:
        server = server_fixture.Server(**FLAGS).start()
        try:
            client = server.client()
            session = client.session("doomed", drive=True, lease_ms=300)
            self.assertEqual(client.layout().num_layers, 2)
            server.kill(hard=True)  # a crash
            with self.assertRaises(SpecStateError) as cm:
                client.layout()
            self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
            self.assertIn("GetLayout", cm.exception.message)
            deadline = time.monotonic() + 5
            while session.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertFalse(session.alive, "the renewal thread did not notice the server left")
            session.close()  # never raises
            client.close()
        finally:
            server.stop()


class ErrorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.server = server_fixture.Server(**FLAGS).start()
        cls.client = cls.server.client()
        cls.layout = cls.client.layout()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.server.stop()

    def setUp(self) -> None:
        self.session = self.client.session(f"errors-{self._testMethodName}", drive=True)
        lo = self.layout
        self.H, self.K = lo.num_heads, lo.head_dim
        for layer in range(lo.num_layers):
            self.session.load_layer_params(layer, np.full(self.H, -1.0, np.float32),
                                           np.zeros(self.H * self.K, np.float32))
        self.buf = specstate.SharedBuffer(1 << 20)
        self.session.register(self.buf, "acts")
        T = 4
        rng = np.random.default_rng(0)
        self.acts = {n: self.buf.empty((T, self.H, self.K), np.uint16) for n in "qkvgo"}
        for n in "qkvg":
            self.acts[n][...] = specstate.to_bfloat16(rng.uniform(-1, 1, (T, self.H, self.K)))
        self.acts["beta"] = self.buf.zeros((T, self.H), np.uint16)
        self.acts["o"].view(np.uint8)[...] = 0xFF
        self.pools = self.client.map_pools()

    def tearDown(self) -> None:
        self.session.close()
        self.pools.close()
        self.buf.close()

    def verify(self, step: int, **overrides) -> pb.VerifyResponse:
        args = dict(self.acts, query_start_loc=[0, 2, 4], state_indices=[1, 2])
        args.update(overrides)
        return self.session.verify(step, 0, **args)

    def assertCode(self, cm, code: grpc.StatusCode, *fragments: str) -> None:
        self.assertEqual(cm.exception.code, code, cm.exception.message)
        for f in fragments:
            self.assertIn(f, cm.exception.message)

    def test_unknown_region_is_not_found(self) -> None:
        bogus = pb.RegionTensor(region="no-such-region", dtype=pb.BF16, shape=[4, self.H, self.K])
        with self.assertRaises(SpecStateError) as cm:
            self.verify(self.session.next_step(), q=bogus)
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND, "q", "no-such-region")
        with self.assertRaises(SpecStateError) as cm:
            self.session.unregister("no-such-region")
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND, "no-such-region")

    def test_array_outside_every_region_is_not_found(self) -> None:
        stray = np.zeros((4, self.H, self.K), np.uint16)
        with self.assertRaises(SpecStateError) as cm:
            self.verify(self.session.next_step(), k=stray)
        self.assertCode(cm, grpc.StatusCode.NOT_FOUND, "no registered buffer")

    def test_wrong_dtype_is_invalid_argument(self) -> None:
        fp32 = self.buf.zeros((4, self.H, self.K), np.float32)
        with self.assertRaises(SpecStateError) as cm:
            self.verify(self.session.next_step(), v=fp32)
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT, "v: dtype FP32")
        fp64 = self.buf.zeros((4, self.H, self.K), np.float64)  # no wire dtype at all
        with self.assertRaises(SpecStateError) as cm:
            self.verify(self.session.next_step(), v=fp64)
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT, "float64")

    def test_wrong_shape_and_param_count_are_invalid_argument(self) -> None:
        with self.assertRaises(SpecStateError) as cm:
            self.verify(self.session.next_step(), beta=self.acts["beta"][:3])
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT, "beta")
        with self.assertRaises(SpecStateError) as cm:
            self.session.load_layer_params(0, [0.0] * (self.H + 1), [0.0] * (self.H * self.K))
        self.assertCode(cm, grpc.StatusCode.INVALID_ARGUMENT, "a_log")

    def test_region_name_taken_is_already_exists(self) -> None:
        other = specstate.SharedBuffer(4096)
        try:
            with self.assertRaises(SpecStateError) as cm:
                self.session.register(other, "acts")
            self.assertCode(cm, grpc.StatusCode.ALREADY_EXISTS, "acts")
        finally:
            other.close()

    def test_second_driver_is_refused_naming_the_holder(self) -> None:
        with self.assertRaises(SpecStateError) as cm:
            self.client.session("second-scheduler", drive=True)
        # Named by its label and client; its id is the driver's secret.
        label = self.session.id.split("-")[0]
        self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION,
                        f"errors-{self._testMethodName}", f"session {label} ")
        self.assertNotIn(self.session.id, cm.exception.message)
        self.assertGreaterEqual(len(self.session.id.split("-")[1]), 32)
        # A non-driving session may read but not drive.
        with self.client.session("observer") as observer:
            self.assertFalse(observer.driving)
            observer.register(self.buf, "acts")
            with self.assertRaises(SpecStateError) as cm:
                observer.verify(1, 0, **self.acts, query_start_loc=[0, 4], state_indices=[1])
            self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION, "does not drive")
        # Once the driver closes, another session may drive.
        self.session.close()
        with self.client.session("next-driver", drive=True) as second:
            self.assertTrue(second.driving)

    def test_state_index_past_the_pool_is_out_of_range_and_writes_nothing(self) -> None:
        before = self.pools.snapshot()
        o_before = self.acts["o"].copy()
        blocks = self.layout.num_blocks
        with self.assertRaises(SpecStateError) as cm:
            self.verify(self.session.next_step(), state_indices=[1, blocks])
        self.assertCode(cm, grpc.StatusCode.OUT_OF_RANGE, "state_indices", str(blocks))
        self.assertEqual(self.pools.snapshot(), before)
        np.testing.assert_array_equal(self.acts["o"], o_before)
        self.assertGreaterEqual(self.client.stats().steps_failed, 1)

    def test_commit_request_index_past_the_batch_is_out_of_range_and_writes_nothing(self) -> None:
        step = self.session.next_step()
        for layer in range(self.layout.num_layers):
            self.session.verify(step, layer, **self.acts, query_start_loc=[0, 2, 4],
                                state_indices=[1, 2])
        before = self.pools.snapshot()
        with self.assertRaises(SpecStateError) as cm:
            self.session.commit(step, [2, 2], request_indices=[0, 5])
        self.assertCode(cm, grpc.StatusCode.OUT_OF_RANGE, "request_indices")
        self.assertEqual(self.pools.snapshot(), before)
        # The session goes on with a new step.
        step = self.session.next_step()
        for layer in range(self.layout.num_layers):
            self.session.verify(step, layer, **self.acts, query_start_loc=[0, 2, 4],
                                state_indices=[1, 2])
        self.assertEqual(self.session.commit(step, [1, 2]).num_rows, 2)
        self.assertNotEqual(self.pools.snapshot(), before)

    def test_lapsed_lease_ends_the_session(self) -> None:
        self.session.close()
        hung = self.client.session("hung-scheduler", drive=True, lease_ms=300)
        hung.register(self.buf, "acts")
        hung._stop.set()  # the renewals stop, as in a process that hangs
        hung._renewer.join()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with self.client.session("successor", drive=True) as successor:
                    self.assertTrue(successor.driving)
                break
            except SpecStateError as e:
                self.assertEqual(e.code, grpc.StatusCode.FAILED_PRECONDITION)
                time.sleep(0.1)
        else:
            self.fail("the lapsed session still drives after 10 s")
        with self.assertRaises(SpecStateError) as cm:
            hung.verify(1, 0, **self.acts, query_start_loc=[0, 4], state_indices=[1])
        self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION, hung.id)
        hung.close()

    def test_verify_before_layer_params_is_failed_precondition(self) -> None:
        with server_fixture.Server(**FLAGS) as fresh, fresh.client() as client, \
                client.session("no-params", drive=True) as session:
            session.register(self.buf, "acts")
            with self.assertRaises(SpecStateError) as cm:
                session.verify(1, 1, **self.acts, query_start_loc=[0, 4], state_indices=[1])
            self.assertCode(cm, grpc.StatusCode.FAILED_PRECONDITION, "LoadLayerParams")


if __name__ == "__main__":
    junit_runner.main()
