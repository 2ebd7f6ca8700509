"""The integration kit (specstate.kit) on the CUDA backend: torch CUDA tensors,
doorbells on the caller's stream (cuStreamWriteValue32 / cuStreamWaitValue32),
a decode step captured in a CUDA graph and replayed, kit_test's Gated
DeltaNet bf16, align-mode, DEFERRED and FAST tests on CUDA, and
examples/kda_decode.py end to end.

Skips unless torch sees a CUDA device (Bazel target
//client/python:kit_gpu_test, tagged "gpu"; tools/gpu/run_suite.sh runs it
from a bundle). Needs a CUDA build of specstated ($SPECSTATED or runfiles).
The checks and tolerances are kit_test.py's (the float64 reference, 1e-5 for
fp32 outputs and states).
"""
from __future__ import annotations

import os
import sys
import unittest

# Before torch touches CUDA: this process's streams wait on doorbells (see
# client/python/README.md's caveat on lazy module loading).
os.environ["CUDA_MODULE_LOADING"] = "EAGER"

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import kda_reference as ref  # noqa: E402
import kit_test  # noqa: E402
import specstate  # noqa: E402

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
    from specstate import kit
except ImportError:  # the CPU machines
    torch = None
    HAVE_CUDA = False

FLAGS = dict(kit_test.FLAGS, backend="cuda")
TOL = kit_test.TOL


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class RunnerCudaTest(kit_test._ServerTest):
    FLAGS = FLAGS

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        assert cls.lo.backend == specstate.pb.CUDA, "specstated is not serving the CUDA backend"

    def test_pools_are_cuda_tensors(self) -> None:
        with kit.StatePools(self.client) as pools:
            self.assertTrue(pools.recurrent(0).is_cuda)
            self.assertEqual(tuple(pools.conv(1).shape),
                             (self.lo.num_blocks, self.lo.conv_dim,
                              self.lo.conv_kernel - 1 + self.lo.num_spec))

    def test_async_and_sync_steps(self) -> None:
        for ordering in ("async", "sync"):
            reference = kit_test.Reference(self.lo, seed=int.from_bytes(os.urandom(4), "little"))
            with kit.Runner(self.client, f"kit-cuda-{ordering}", max_tokens=16,
                            ordering=ordering) as runner, kit.StatePools(self.client) as pools:
                self.assertTrue(runner.inputs(0)["q"].is_cuda)
                reference.load(runner)
                reference.prefill(pools, [1, 4, 9])
                torch.cuda.synchronize()
                self.decode_steps(runner, pools, reference, [1, 4, 9], steps=3)
                self.decode_steps(runner, pools, reference, [4, 9], steps=2, in_place=True)

    def test_a_step_captured_in_a_cuda_graph(self) -> None:
        """The stream work of a whole decode step (input copies, every layer's
        doorbells, the accepted counts, the Commit's doorbells) captured once and
        replayed every step; the host sends one SubmitStep (all Verify calls and
        the Commit) per step before each replay."""
        lo = self.lo
        reference = kit_test.Reference(lo, seed=int.from_bytes(os.urandom(4), "little"))
        blocks, Q = [2, 7], lo.num_spec + 1
        N, T = len(blocks), len(blocks) * Q
        with kit.Runner(self.client, "kit-graph", max_tokens=T, max_rows=N) as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            reference.prefill(pools, blocks)
            shapes = {"q": (T, lo.num_heads, lo.head_dim), "k": (T, lo.num_heads, lo.head_dim),
                      "v": (T, lo.num_heads, lo.head_dim), "g": (T, lo.num_heads, lo.head_dim),
                      "beta": (T, lo.num_heads)}
            static = [{n: torch.zeros(s, device="cuda") for n, s in shapes.items()}
                      for _ in range(lo.num_layers)]
            outs = [torch.zeros(T, lo.num_heads, lo.head_dim, device="cuda")
                    for _ in range(lo.num_layers)]
            accepted = torch.zeros(N, dtype=torch.int32, device="cuda")
            qsl = [i * Q for i in range(N + 1)]
            runner.query_start_loc[:N + 1].copy_(torch.tensor(qsl, dtype=torch.int32))
            runner.state_indices[:N].copy_(torch.tensor(blocks, dtype=torch.int32))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            step = runner.capture_step(T, N)
            with torch.cuda.graph(graph):
                for layer in range(lo.num_layers):
                    o = step.verify(layer, **static[layer])
                    outs[layer].copy_(o)
                step.commit(accepted)
            rng = np.random.default_rng(5)
            for s in range(4):
                x = [reference.inputs(shapes) for _ in range(lo.num_layers)]
                acc = [int(rng.integers(1, Q + 1)) for _ in blocks]
                for layer in range(lo.num_layers):
                    for n in shapes:
                        static[layer][n].copy_(x[layer][n])
                accepted.copy_(torch.tensor(acc, dtype=torch.int32))
                torch.cuda.synchronize()
                r = runner.replay_step(T, N, commit_batch=N)
                self.assertTrue(r.commit.enqueued)
                graph.replay()
                torch.cuda.synchronize()
                for layer in range(lo.num_layers):
                    for i, b in enumerate(blocks):
                        want = reference.run(layer, b, x[layer], qsl[i], qsl[i + 1], acc[i])
                        err = ref.rel_err(outs[layer][qsl[i]:qsl[i + 1]].double().cpu().numpy(),
                                          want)
                        self.assertLess(err, TOL, f"replay {s}, layer {layer}, row {i}")
                        err = ref.rel_err(pools.recurrent(layer)[b].double().cpu().numpy(),
                                          reference.states[(layer, b)])
                        self.assertLess(err, TOL, f"replay {s}: layer {layer}, block {b}")
            self.assertEqual(self.client.stats().steps_failed, 0)


# kit_test's layouts and commit modes on the CUDA backend.

@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class GatedDeltaNetBf16CudaTest(kit_test.RunnerGatedDeltaNetBf16Test):
    FLAGS = dict(kit_test.RunnerGatedDeltaNetBf16Test.FLAGS, backend="cuda")


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class AlignModeCudaTest(kit_test.RunnerAlignModeTest):
    FLAGS = dict(kit_test.RunnerAlignModeTest.FLAGS, backend="cuda")


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class DeferredCudaTest(kit_test.RunnerDeferredTest):
    FLAGS = dict(kit_test.RunnerDeferredTest.FLAGS, backend="cuda")


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class FastCudaTest(kit_test.RunnerFastTest):
    FLAGS = dict(kit_test.RunnerFastTest.FLAGS, backend="cuda")


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class KeptPoolsResumeCudaTest(kit_test.KeptPoolsResumeTest):
    FLAGS = FLAGS


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class KdaDecodeCudaTest(kit_test.KdaDecodeExampleTest):
    """examples/kda_decode.py against a CUDA specstated, torch CUDA tensors."""

    def run_example(self, **flags) -> dict:
        return super().run_example(backend="cuda", **flags)


if __name__ == "__main__":
    junit_runner.main()
