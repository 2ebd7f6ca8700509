"""The CUDA backend from torch, against a real specstated on a GPU.

Skips unless torch sees a CUDA device (Bazel target //client/python:gpu_test,
tagged "gpu"). Needs a CUDA build of specstated ($SPECSTATED or runfiles).
Checks: a torch tensor registered through _share_cuda_() (66-byte handle),
the pools opened by cudaIpcOpenMemHandle, a decode step against the float64
reference (tolerances as in e2e_test.py), a CudaBuffer with doorbells written
and waited on by the streams (cuStreamWriteValue32 / cuStreamWaitValue32), an
interprocess event, and the clear refusal of expandable segments. The decode
steps run on a KDA layout (GpuTest) and on a Gated DeltaNet one
(GatedDeltaNetGpuTest: 2 key heads, 4 value heads, pools [B, HV, V, K]).
"""
from __future__ import annotations

import os
import subprocess
import sys
import unittest

# Before torch touches CUDA: this process's streams wait on doorbells (see
# the README's caveat on lazy module loading).
os.environ["CUDA_MODULE_LOADING"] = "EAGER"

import grpc
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
# Gated DeltaNet: two value heads per key head, so a wrong key-head mapping shows.
GDN_FLAGS = dict(FLAGS, kind="gdn", heads=2, value_heads=4)


def f64(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


class _DecodeStepTests:
    """The decode-step tests on the layout of FLAGS, as a mixin of a TestCase.

    The layout decides the shapes: q, k [T, H, K]; v, o [T, HV, V]; g KDA
    [T, H, K] (gate parameters loaded in setUp), GDN [T, HV]; beta [T, HV].
    """

    FLAGS: dict = FLAGS

    @classmethod
    def setUpClass(cls) -> None:
        cls.server = server_fixture.Server(**cls.FLAGS).start()
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
        self.gdn = lo.layer_kind == specstate.pb.GDN
        self.HV = lo.num_value_heads or self.H
        self.session = self.client.session(self._testMethodName, drive=True)
        gen = torch.Generator().manual_seed(0)
        self.a_log, self.dt_bias = [None] * self.L, [None] * self.L
        if not self.gdn:  # GDN's g arrives as the model computed it: nothing to load
            self.a_log = [torch.rand(self.H, generator=gen) * 2.5 - 2 for _ in range(self.L)]
            self.dt_bias = [torch.rand(self.H * self.K, generator=gen) * 2 - 1
                            for _ in range(self.L)]
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

    def shapes(self, T: int) -> dict:
        """Each Verify tensor's shape for T tokens."""
        H, HV, K = self.H, self.HV, self.K
        return {"q": (T, H, K), "k": (T, H, K), "v": (T, HV, K), "o": (T, HV, K),
                "g": (T, HV) if self.gdn else (T, H, K), "beta": (T, HV)}

    def fill(self, a: dict, T: int) -> None:
        """Fresh random inputs (never zeros) into a layer's tensors `a` (any device):
        q, k, v in [-1, 1]; KDA's g in [-3, 1] and beta a logit in [-3, 3]; GDN's
        g a log-decay in (-2, 0) and beta a write strength in (0, 1)."""
        shapes = self.shapes(T)
        ranges = {"q": (-1, 1), "k": (-1, 1), "v": (-1, 1)}
        ranges.update({"g": (-2, -0.05), "beta": (0.05, 0.95)} if self.gdn else
                      {"g": (-3, 1), "beta": (-3, 3)})
        for n, (lo, hi) in ranges.items():
            x = self.rand(*shapes[n], lo=lo, hi=hi)
            a[n].copy_(x.to(device=a[n].device, dtype=torch.bfloat16))

    def reference(self, layer: int, state, q, k, v, g, beta):
        """(outputs [T, HV, V], state after the tokens) by the float64 reference."""
        if self.gdn:
            return ref.gdn_tokens(state, q, k, v, g, beta)
        return ref.kda_tokens(state, q, k, v, g, beta, self.a_log[layer].numpy(),
                              self.dt_bias[layer].numpy(), self.lo.lower_bound,
                              plain_gate=self.lo.kda_gate == specstate.pb.PLAIN_GATE)

    def prefill(self, blocks):
        states = {}
        for layer in range(self.L):
            for b in blocks:
                s = self.rand(self.HV, self.K, self.K, lo=-0.5, hi=0.5)
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
                a, e, n = qsl[i], qsl[i + 1], qsl[i] + accepted[i]
                want, _ = self.reference(layer, states[(layer, b)], q[a:e], k[a:e], v[a:e],
                                         g[a:e], beta[a:e])
                self.assertLess(ref.rel_err(o[a:e], want), 1e-2, f"layer {layer} row {i}")
                _, st = self.reference(layer, states[(layer, b)], q[a:n], k[a:n], v[a:n],
                                       g[a:n], beta[a:n])
                states[(layer, b)] = st

    def check_states(self, blocks, states) -> None:
        torch.cuda.synchronize()
        for layer in range(self.L):
            for b in blocks:
                err = ref.rel_err(f64(self.pools.recurrent(layer)[b]), states[(layer, b)])
                self.assertLess(err, 1e-5, f"layer {layer} block {b}")

    def test_torch_tensors_registered_by_share_cuda(self) -> None:
        T, HVK = 2 * self.Q, self.HV * self.K
        shapes = self.shapes(T)
        # One torch allocation holding every activation (default caching allocator):
        # per layer six slots of T * HV * K elements, each tensor at the start of its own.
        arena = torch.zeros(self.L * 6 * T * HVK, dtype=torch.bfloat16, device="cuda")
        name = self.session.register(arena)
        self.assertEqual(self.session.register(arena[100:]), name)  # same storage, same region
        slots = arena.view(self.L, 6, T * HVK)

        def slot(l: int, i: int, n: str):
            return slots[l, i][:int(np.prod(shapes[n]))].view(shapes[n])

        acts = [{"q": slot(l, 0, "q"), "k": slot(l, 1, "k"), "v": slot(l, 2, "v"),
                 "g": slot(l, 3, "g"), "o": slot(l, 5, "o"),
                 "beta": slots[l, 4].view(T, HVK)[:, :self.HV]}
                for l in range(self.L)]
        self.assertFalse(acts[0]["beta"].is_contiguous())  # [T, HV] with a token stride of HV*K
        blocks = [3, 7]
        states = self.prefill(blocks)
        qsl, accepted = [0, self.Q, 2 * self.Q], [2, self.Q]
        step = self.session.next_step()
        for layer in range(self.L):
            a = acts[layer]
            self.fill(a, T)
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
        T = self.Q
        buf = cuda.CudaBuffer(1 << 20)
        self.session.register(buf, "acts")
        acts = [{n: buf.empty(shape, torch.bfloat16) for n, shape in self.shapes(T).items()}
                for _ in range(self.L)]
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
            self.fill(a, T)
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


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class GpuTest(_DecodeStepTests, unittest.TestCase):
    """KDA (the safe gate), and what does not depend on the layout."""

    FLAGS = FLAGS

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


@unittest.skipUnless(HAVE_CUDA, "needs torch with a CUDA device")
class GatedDeltaNetGpuTest(_DecodeStepTests, unittest.TestCase):
    """Gated DeltaNet: the same decode steps on torch tensors, its CUDA pools."""

    FLAGS = GDN_FLAGS

    def test_layout_and_pool_shapes(self) -> None:
        lo = self.lo
        self.assertEqual(lo.layer_kind, specstate.pb.GDN)
        self.assertEqual((lo.num_heads, lo.num_value_heads), (2, 4))
        for layer in range(lo.num_layers):
            self.assertEqual(tuple(self.pools.recurrent(layer).shape),
                             (lo.num_blocks, self.HV, self.K, self.K))
        with self.assertRaises(specstate.SpecStateError) as cm:
            self.session.load_layer_params(0, self.rand(self.H).numpy(),
                                           self.rand(self.H * self.K).numpy())
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION,
                         cm.exception.message)
        self.assertIn("no gate parameters", cm.exception.message)


if __name__ == "__main__":
    junit_runner.main()
