"""The host tier from Python against a real specstated (CPU backend, every
commit mode): Session.save_blocks / restore_blocks, Client.list_saved /
drop_saved. A block's bytes, written by the test as a prefill would, come
back bit for bit in another block; errors are SpecStateErrors with the
service's code."""
from __future__ import annotations

import os
import sys
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import server_fixture  # noqa: E402
from specstate import SpecStateError  # noqa: E402

FLAGS = dict(layers=2, heads=2, head_dim=64, conv_dim=32, conv_kernel=4, num_spec=3, blocks=16,
             max_rows=4, activation_dtype="bf16", cache_mode="none", host_tier_bytes="4MiB")


class HostTierTest(unittest.TestCase):
    def run_mode(self, mode: str) -> None:
        flags = dict(FLAGS, commit_mode=mode)
        if mode == "fast":
            flags["fold_every"] = 2
        rng = np.random.default_rng()
        with server_fixture.Server(**flags) as server, server.client() as client:
            layout = client.layout()
            pools = client.map_pools()
            session = client.session(f"host-tier-{mode}", drive=True)

            def block_bytes(block: int) -> bytes:
                return b"".join(pools.view(layer, kind)[block].tobytes()
                                for layer in range(layout.num_layers)
                                for kind in ("recurrent", "conv"))

            def fill(block: int) -> None:  # as a prefill writes a block
                for layer in range(layout.num_layers):
                    for kind in ("recurrent", "conv"):
                        b = pools.view(layer, kind)[block].view(np.uint8)
                        b[...] = rng.integers(0, 256, b.shape, dtype=np.uint8)

            fill(3)
            saved = block_bytes(3)
            reply = session.save_blocks({"prefix-a": 3})
            entry = layout.num_layers * (layout.state_block_bytes + layout.conv_block_bytes)
            self.assertEqual(reply.bytes, entry)
            fill(3)
            self.assertNotEqual(block_bytes(3), saved)
            self.assertEqual(session.restore_blocks({"prefix-a": 5}).bytes, entry)
            self.assertEqual(block_bytes(5), saved)

            listed = client.list_saved()
            self.assertEqual([k.key for k in listed.keys], ["prefix-a"])
            self.assertEqual(listed.keys[0].restores, 1)
            self.assertEqual(listed.capacity, (4 << 20) // entry)
            with self.assertRaises(SpecStateError) as e:
                session.restore_blocks({"prefix-b": 6})
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            with self.assertRaises(SpecStateError) as e:
                session.save_blocks([(layout.num_blocks, "x")])
            self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertEqual(client.drop_saved(["prefix-a", "never"]), 1)
            self.assertEqual(len(client.list_saved().keys), 0)
            self.assertEqual(client.stats().host_tier.saves, 1)
            session.close()

    def test_eager(self) -> None:
        self.run_mode("eager")

    def test_deferred(self) -> None:
        self.run_mode("deferred")

    def test_fast(self) -> None:
        self.run_mode("fast")


if __name__ == "__main__":
    junit_runner.main()
