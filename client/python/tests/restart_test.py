"""The Python client across restarts of specstated (CPU backend, pools kept by
a specstate-keeper): a scheduler loop checked against the float64 reference
goes on after specstated is SIGKILLed and started again (session.resume()
reconnects, re-opens the session, re-registers the buffers, reloads the layer
parameters); a step in flight when it died is refused afterwards
(FAILED_PRECONDITION naming it) and re-runs under a new id; an interrupted
Commit's blocks come back in lost_blocks, until the scheduler says it
re-prefilled them (session.mark_reprefilled)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import unittest

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e_test  # noqa: E402
import junit_runner  # noqa: E402
import server_fixture  # noqa: E402
import specstate  # noqa: E402


class RestartTest(unittest.TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="pk", dir="/tmp")
        self.keeper = server_fixture.Keeper(self.dir)
        self.server = server_fixture.Server(keeper=self.keeper.socket, **e2e_test.SMALL)
        self.server.start()

    def tearDown(self) -> None:
        self.server.stop()
        self.keeper.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_the_loop_goes_on_after_a_restart(self) -> None:
        with self.server.client() as client, client.session("restart", drive=True) as session:
            h = e2e_test.Harness(self, client, session, requests=3, seed=7)
            for s in range(3):
                h.step(s)
            old_id = session.id
            self.server.kill(hard=True)  # SIGKILL: a crash
            with self.assertRaises(specstate.SpecStateError) as e:
                h.step(3)  # while it is down
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
            self.server.start()
            kept = session.resume()
            self.assertTrue(kept.kept)
            self.assertEqual(kept.holder, "keeper " + self.keeper.socket)
            self.assertEqual(kept.restarts, 1)
            self.assertEqual(kept.last_committed_step, 3)  # the Harness's steps 0..2 are ids 1..3
            self.assertEqual(list(kept.lost_blocks), [])
            self.assertNotEqual(session.id, old_id)
            # Step id 4 was in flight (its first Verify failed): refused, naming it.
            self.assertEqual(session.lost_steps, [4])
            with self.assertRaises(specstate.SpecStateError) as e:
                session.commit(4, [1, 1, 1])
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("step 4 was in flight when specstated restarted", e.exception.message)
            # The states kept by the keeper go on matching the reference.
            for s in range(3, 6):
                h.step(s)
            self.assertEqual(client.recover(verify=True).problems, [])
            h.close()

    def test_an_interrupted_commit_reports_its_blocks_lost(self) -> None:
        with self.server.client() as client, client.session("restart", drive=True) as session:
            h = e2e_test.Harness(self, client, session, requests=3, seed=8)
            h.step(0)
            self.server.kill(hard=True)
            self.server.flags.update(test_crash_at="commit:layer:1")
            self.server.start()
            session.resume()
            with self.assertRaises(specstate.SpecStateError) as e:
                h.step(1)  # dies after the first layer's replay of this Commit
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
            del self.server.flags["test_crash_at"]
            self.server.start()
            kept = session.resume()
            self.assertTrue(kept.interrupted)
            self.assertEqual(kept.interrupted_step, 2)
            self.assertEqual(sorted(kept.lost_blocks), sorted(h.checkpoint(i) for i in range(3)))
            with self.assertRaises(specstate.SpecStateError) as e:
                session.commit(2, [1, 1, 1])
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("step 2's Commit was interrupted", e.exception.message)
            verified = client.recover(verify=True)
            self.assertEqual(sorted(verified.inconsistent_blocks), sorted(kept.lost_blocks))
            # The scheduler re-prefills them and says so (a bad block first:
            # refused, nothing changed): no longer lost, after a restart too.
            with self.assertRaises(specstate.SpecStateError) as e:
                session.mark_reprefilled([kept.lost_blocks[0], 10**6])
            self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertIn("blocks[1] = 1000000 is out of range [1, num_blocks", e.exception.message)
            self.assertEqual(sorted(client.recover().lost_blocks), sorted(kept.lost_blocks))
            self.assertEqual(list(session.mark_reprefilled(kept.lost_blocks).lost_blocks), [])
            self.server.kill(hard=True)
            self.server.start()
            again = session.resume()
            self.assertEqual(list(again.lost_blocks), [])
            self.assertEqual(client.recover(verify=True).problems, [])
            h.close()


if __name__ == "__main__":
    junit_runner.main()
