"""Runs examples/scheduler_loop.py against a real specstated, as a user would."""
from __future__ import annotations

import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import server_fixture  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "scheduler_loop.py")


class ExampleTest(unittest.TestCase):
    def run_example(self, **flags) -> str:
        with server_fixture.Server(layers=2, heads=2, head_dim=64, conv_dim=384,
                                   **flags) as server:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            run = subprocess.run([sys.executable, EXAMPLE, f"--server={server.address}",
                                  "--steps=3", "--requests=3"],
                                 capture_output=True, text=True, timeout=120, env=env)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("step 3: 3 rows", run.stdout)
            self.assertIn("service: 3 steps committed", run.stdout)
            self.assertIn("0 failed", run.stdout)
            return run.stdout

    def test_scheduler_loop_example_runs(self) -> None:
        self.assertIn("2 KDA layers, H=2, HV=2", self.run_example())

    def test_scheduler_loop_example_runs_gated_deltanet(self) -> None:
        self.assertIn("2 GDN layers, H=2, HV=4", self.run_example(kind="gdn", value_heads=4))


if __name__ == "__main__":
    junit_runner.main()
