"""The CUDA backend from torch, against a real specstated on a GPU.

Skips unless torch sees a CUDA device (Bazel target //client/python:gpu_test,
tagged "gpu"). Needs a CUDA build of specstated ($SPECSTATED or runfiles).
Checks: a torch tensor registered through _share_cuda_() (66-byte handle),
the pools opened by cudaIpcOpenMemHandle, a decode step against the float64
reference (tolerances as in e2e_test.py), a CudaBuffer with doorbells written
and waited on by the streams (cuStreamWriteValue32 / cuStreamWaitValue32), an
interprocess event, and the clear refusal of expandable segments.
"""
from __future__ import annotations

import os
import subprocess
import sys
import unittest

# Before torch touches CUDA: this process's streams wait on doorbells (see
# the README's caveat on lazy module loading).
os.environ["CUDA_MODULE_LOADING"] = "EAGER"

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import kda_reference as ref  # noqa: E402
import server_fixture  # noqa: E402
import specstate  # noqa: E402

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # the CPU machines: no torch
    torch = None
    HAVE_CUDA = False

FLAGS = dict(backend="cuda", layers=2, heads=2, head_dim=64, conv_dim=32, conv_kernel=4,
             num_spec=3, blocks=16, max_rows=4, activation_dtype="bf16", state_dtype="fp32",
             cache_mode="none")


def f64(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class GpuTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.server = server_fixture.Server(**FLAGS).start()
        cls.client = cls.server.client()
        cls.lo = cls.client.layout()
        assert cls.lo.backend == specstate.pb.CUDA, "specstated is not serving the CUDA backend"

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.server.stop()

    def setUp(self) -> None:
        lo = self.lo
        self.L, self.H, self.K, self.Q = lo.num_layers, lo.num_heads, lo.head_dim, lo.num_spec + 1
        self.hl, self.D = lo.conv_kernel - 1, lo.conv_dim
        self.session = self.client.session(self._testMethodName, drive=True)
        gen = torch.Generator().manual_seed(0)
        self.a_log = [torch.rand(self.H, generator=gen) * 2.5 - 2 for _ in range(self.L)]
        self.dt_bias = [torch.rand(self.H * self.K, generator=gen) * 2 - 1 for _ in range(self.L)]
        for layer in range(self.L):
            self.session.load_layer_params(layer, self.a_log[layer].numpy(),
                                           self.dt_bias[layer].numpy())
        self.pools = self.client.map_pools()
        self.gen = gen

    def tearDown(self) -> None:
        self.session.close()
        self.pools.close()

    def rand(self, *shape, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=self.gen) * (hi - lo) + lo)

    def prefill(self, blocks):
        states = {}
        for layer in range(self.L):
            for b in blocks:
                s = self.rand(self.H, self.K, self.K, lo=-0.5, hi=0.5)
                self.pools.recurrent(layer)[b].copy_(s.cuda())
                conv = self.pools.conv(layer)[b]
                conv.zero_()
                conv[:, :self.hl].copy_(self.rand(self.D, self.hl).to(torch.bfloat16).cuda())
                states[(layer, b)] = s.numpy().astype(np.float64)
        torch.cuda.synchronize()
        return states

    def check_step(self, acts, qsl, blocks, accepted, states) -> None:
        """Outputs of the step, then (after the caller's Commit) committed states."""
        for layer in range(self.L):
            q, k, v, g, beta, o = (f64(acts[layer][n]) for n in ("q", "k", "v", "g", "beta", "o"))
            for i, b in enumerate(blocks):
                a, e = qsl[i], qsl[i + 1]
                want, _ = ref.kda_tokens(states[(layer, b)], q[a:e], k[a:e], v[a:e], g[a:e],
                                         beta[a:e], self.a_log[layer].numpy(),
                                         self.dt_bias[layer].numpy(), self.lo.lower_bound)
                self.assertLess(ref.rel_err(o[a:e], want), 1e-2, f"layer {layer} row {i}")
                _, st = ref.kda_tokens(states[(layer, b)], q[a:a + accepted[i]],
                                       k[a:a + accepted[i]], v[a:a + accepted[i]],
                                       g[a:a + accepted[i]], beta[a:a + accepted[i]],
                                       self.a_log[layer].numpy(), self.dt_bias[layer].numpy(),
                                       self.lo.lower_bound)
                states[(layer, b)] = st

    def check_states(self, blocks, states) -> None:
        torch.cuda.synchronize()
        for layer in range(self.L):
            for b in blocks:
                err = ref.rel_err(f64(self.pools.recurrent(layer)[b]), states[(layer, b)])
                self.assertLess(err, 1e-5, f"layer {layer} block {b}")

    def test_torch_tensors_registered_by_share_cuda(self) -> None:
        T, H, K = 2 * self.Q, self.H, self.K
        # One torch allocation holding every activation (default caching allocator).
        arena = torch.zeros(self.L * 6 * T * H * K, dtype=torch.bfloat16, device="cuda")
        name = self.session.register(arena)
        self.assertEqual(self.session.register(arena[100:]), name)  # same storage, same region
        views = arena.view(self.L, 6, T, H, K)
        acts = [{"q": views[l, 0], "k": views[l, 1], "v": views[l, 2], "g": views[l, 3],
                 "o": views[l, 5], "beta": views[l, 4].reshape(T, H * K)[:, :H]}
                for l in range(self.L)]
        self.assertFalse(acts[0]["beta"].is_contiguous())  # [T, H] with a token stride of H*K
        blocks = [3, 7]
        states = self.prefill(blocks)
        qsl, accepted = [0, self.Q, 2 * self.Q], [2, self.Q]
        step = self.session.next_step()
        for layer in range(self.L):
            a = acts[layer]
            for n in "qkv":
                a[n].copy_(self.rand(T, H, K).to(torch.bfloat16))
            a["g"].copy_(self.rand(T, H, K, lo=-3, hi=1).to(torch.bfloat16))
            a["beta"].copy_(self.rand(T, H, lo=-3, hi=3).to(torch.bfloat16))
            a["o"].fill_(float("nan"))
            torch.cuda.synchronize()  # SYNC calls: the inputs are complete when we call
            self.session.verify(step, layer, query_start_loc=qsl, state_indices=blocks, **a)
        self.check_step(acts, qsl, blocks, accepted, states)
        self.session.commit(step, accepted)
        self.check_states(blocks, states)
        regions = self.session.list_regions().regions
        self.assertEqual([(r.name, r.kind) for r in regions], [(name, "cuda_ipc")])

    def test_cuda_buffer_with_stream_doorbells_and_events(self) -> None:
        from specstate import cuda  # noqa: PLC0415
        T, H, K = self.Q, self.H, self.K
        buf = cuda.CudaBuffer(1 << 20)
        self.session.register(buf, "acts")
        acts = [{n: buf.empty((T, H, K), torch.bfloat16) for n in ("q", "k", "v", "g", "o")}
                for _ in range(self.L)]
        for a in acts:
            a["beta"] = buf.empty((T, H), torch.bfloat16)
        bells = buf.empty((4,), torch.int32)
        blocks = [5]
        states = self.prefill(blocks)
        stream = torch.cuda.current_stream()

        # Verify is enqueued before its inputs exist; the scheduler's stream writes
        # them, then rings doorbell 0; the service signals doorbell 1 after the last layer.
        step = self.session.next_step()
        for layer in range(self.L):
            r = self.session.verify(
                step, layer, query_start_loc=[0, T], state_indices=blocks, **acts[layer],
                wait=self.session.doorbell(bells[0:1], 1),
                signal=self.session.doorbell(bells[1:2], 1) if layer == self.L - 1 else None)
            self.assertTrue(r.enqueued)
        torch.cuda._sleep(50_000_000)  # the inputs come late
        for a in acts:
            for n in "qkv":
                a[n].copy_(self.rand(T, H, K).to(torch.bfloat16).cuda())
            a["g"].copy_(self.rand(T, H, K, lo=-3, hi=1).to(torch.bfloat16).cuda())
            a["beta"].copy_(self.rand(T, H, lo=-3, hi=3).to(torch.bfloat16).cuda())
        cuda.stream_write_value32(bells[0:1], 1, stream)
        cuda.stream_wait_value32(bells[1:2], 1, stream)
        torch.cuda.synchronize()
        self.check_step(acts, [0, T], blocks, [3], states)

        # Commit waits on an interprocess event recorded on our stream and
        # records another when done.
        ready = torch.cuda.Event(interprocess=True)
        done = torch.cuda.Event(interprocess=True)
        ready.record(stream)
        r = self.session.commit(step, [3], wait=ready, signal=done)
        self.assertTrue(r.enqueued)
        done.synchronize()
        self.check_states(blocks, states)
        self.session.unregister("acts")
        buf.close()

    def test_expandable_segments_are_refused_clearly(self) -> None:
        code = ("import torch, specstate\n"
                "from specstate import cuda\n"
                "t = torch.empty(1 << 20, device='cuda')\n"
                "try:\n"
                "    cuda.torch_region(t)\n"
                "except specstate.ExpandableSegmentsError as e:\n"
                "    print('REFUSED', e.code.name, e.message)\n")
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                   PYTHONPATH=os.pathsep.join(sys.path))
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=env)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("REFUSED FAILED_PRECONDITION", run.stdout)
        self.assertIn("expandable_segments", run.stdout)


if __name__ == "__main__":
    junit_runner.main()
