"""The integration kit (specstate.kit) and Session.submit_step against a real
specstated on the CPU backend, checked against the independent float64
reference (kda_reference.py); and examples/kda_decode.py end to end.

Skips (with a message) when torch is not installed; CI installs Debian's
python3-torch (tools/install_deps.sh), so there it runs.

Tolerances (per tensor, ||got - want|| / ||want||), as in e2e_test.py: the
service computes in fp32 from the very activation values the reference reads,
so fp32 outputs and states are held to 1e-5, bf16 outputs to 1e-2.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import unittest
from typing import Dict, List, Tuple

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import kda_reference as ref  # noqa: E402
import server_fixture  # noqa: E402
import specstate  # noqa: E402
from specstate.v1 import specstate_pb2 as pb  # noqa: E402

try:
    import torch
    from specstate import kit
except ImportError:  # CI has python3-torch; a bare machine may not
    torch = None
    kit = None

NEEDS_TORCH = unittest.skipIf(torch is None, "torch is not installed (apt-get install "
                              "python3-torch): the integration kit needs it")

# conv_dim = 3 * H * K: what examples/kda_decode.py's model convolves.
FLAGS = dict(layers=2, heads=2, head_dim=64, conv_dim=384, conv_kernel=4, num_spec=3,
             blocks=16, max_rows=4, activation_dtype="fp32", state_dtype="fp32")
TOL = 1e-5


def _example_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "examples", "kda_decode.py")


class Reference:
    """Random KDA gate parameters (loaded into a Runner) and the float64 state of
    every (layer, block) the test touches. Gated DeltaNet layouts (HV value
    heads, g and beta [T, HV] as the model computed them) have no parameters."""

    def __init__(self, lo: pb.Layout, seed: int) -> None:
        self.lo = lo
        self.gen = torch.Generator().manual_seed(seed)
        self.H, self.K, self.L = lo.num_heads, lo.head_dim, lo.num_layers
        self.HV = lo.num_value_heads or self.H
        self.gdn = lo.layer_kind == pb.GDN
        # The values the service reads: the inputs rounded to the activation dtype.
        self.act = kit.torch_dtype(lo.activation_dtype)
        self.a_log = [self.rand(self.H, lo=-2.0, hi=0.5) for _ in range(self.L)]
        self.dt_bias = [self.rand(self.H * self.K) for _ in range(self.L)]
        self.states: Dict[Tuple[int, int], np.ndarray] = {}

    def rand(self, *shape: int, lo: float = -1.0, hi: float = 1.0) -> "torch.Tensor":
        return torch.rand(*shape, generator=self.gen) * (hi - lo) + lo

    def load(self, runner: "kit.Runner") -> None:
        if self.gdn:  # GDN's g arrives as the model computed it: nothing to load
            return
        for layer in range(self.L):
            runner.load_layer_params(layer, self.a_log[layer], self.dt_bias[layer])

    def prefill(self, pools: "kit.StatePools", blocks: List[int]) -> None:
        """Fresh random states (never zeros) written into the pools, remembered here."""
        for layer in range(self.L):
            for b in blocks:
                s = self.rand(self.HV, self.K, self.K, lo=-0.5, hi=0.5)
                pools.recurrent(layer)[b].copy_(s)
                self.states[(layer, b)] = s.double().cpu().numpy()

    def inputs(self, shapes: Dict[str, tuple]) -> Dict[str, "torch.Tensor"]:
        """q, k, v in [-1, 1]; KDA's g in [-3, 1] and beta a logit in [-3, 3];
        GDN's g a log-decay in (-2, 0) and beta a write strength in (0, 1)."""
        ranges = {"q": (-1, 1), "k": (-1, 1), "v": (-1, 1)}
        ranges.update({"g": (-2, -0.05), "beta": (0.05, 0.95)} if self.gdn else
                      {"g": (-3, 1), "beta": (-3, 3)})
        return {n: self.rand(*shapes[n], lo=a, hi=b) for n, (a, b) in ranges.items()}

    def run(self, layer: int, block: int, x: Dict[str, "torch.Tensor"], a: int, e: int,
            n: int) -> np.ndarray:
        """Outputs of tokens [a, e) from the block's state; the state advances by
        the first n of them."""
        f = {name: t[a:e].to(self.act).double().cpu().numpy() for name, t in x.items()}
        state = self.states[(layer, block)]
        if self.gdn:
            out, _ = ref.gdn_tokens(state, f["q"], f["k"], f["v"], f["g"], f["beta"])
            _, self.states[(layer, block)] = ref.gdn_tokens(
                state, *(f[name][:n] for name in ("q", "k", "v", "g", "beta")))
            return out
        args = (self.a_log[layer].numpy(), self.dt_bias[layer].numpy(), self.lo.lower_bound)
        out, _ = ref.kda_tokens(state, f["q"], f["k"], f["v"], f["g"], f["beta"], *args)
        _, self.states[(layer, block)] = ref.kda_tokens(
            state, *(f[name][:n] for name in ("q", "k", "v", "g", "beta")), *args)
        return out


def shapes_of(step: "kit.Step") -> Dict[str, tuple]:
    r, T = step.runner, step.num_tokens
    return {"q": (T, r.H, r.K), "k": (T, r.H, r.K), "v": (T, r.HV, r.K),
            "g": (T, r.HV) if r.gdn else (T, r.H, r.K), "beta": (T, r.HV)}


class _ServerTest(unittest.TestCase):
    FLAGS: dict = FLAGS
    OUT_TOL = TOL  # outputs stored in the activation dtype: bf16 rounds them

    @classmethod
    def setUpClass(cls) -> None:
        if torch is None:
            raise unittest.SkipTest("torch is not installed (apt-get install python3-torch)")
        cls.server = server_fixture.Server(**cls.FLAGS).start()
        cls.client = cls.server.client()
        cls.lo = cls.client.layout()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.server.stop()

    def decode_steps(self, runner: "kit.Runner", pools: "kit.StatePools", reference: Reference,
                     blocks: List[int], steps: int, in_place: bool = False,
                     check_states: bool = True) -> None:
        """`steps` steps of rows on `blocks` (random window lengths and accepted
        counts), outputs and (EAGER) committed states against the reference."""
        Q = runner.Q
        rng = np.random.default_rng(int(reference.rand(1, lo=0, hi=1e6)))
        for s in range(steps):
            lens = [int(rng.integers(1, Q + 1)) for _ in blocks]
            accepted = [int(rng.integers(1, n + 1)) for n in lens]
            qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            step = runner.begin_step(torch.from_numpy(qsl), blocks)
            self.assertEqual((step.num_rows, step.num_tokens), (len(blocks), int(qsl[-1])))
            for layer in range(runner.num_layers):
                x = reference.inputs(shapes_of(step))
                if in_place:  # the model writes into the bound buffers: nothing is copied
                    views = step.inputs(layer)
                    for name in x:
                        views[name].copy_(x[name])
                    views["o"].fill_(float("nan"))
                    o = step.verify(layer, *(views[n] for n in ("q", "k", "v", "g", "beta")))
                else:
                    o = step.verify(layer, **x)
                self.assertEqual(tuple(o.shape), (step.num_tokens, runner.HV, runner.K))
                for i, b in enumerate(blocks):
                    a, e = int(qsl[i]), int(qsl[i + 1])
                    want = reference.run(layer, b, x, a, e, accepted[i])
                    err = ref.rel_err(o[a:e].double().cpu().numpy(), want)
                    self.assertLess(err, self.OUT_TOL, f"step {s}, layer {layer}, row {i}")
            r = step.commit(torch.tensor(accepted, dtype=torch.int64))
            self.assertEqual(r.num_layers if not r.enqueued else runner.num_layers,
                             runner.num_layers)
            if check_states:
                for layer in range(runner.num_layers):
                    for b in blocks:
                        err = ref.rel_err(pools.recurrent(layer)[b].double().cpu().numpy(),
                                          reference.states[(layer, b)])
                        self.assertLess(err, TOL, f"step {s}: layer {layer}, block {b}")


@NEEDS_TORCH
class SubmitStepTest(_ServerTest):
    """Session.submit_step: a step's Verify calls and its Commit in one round trip."""

    def test_one_round_trip_per_step(self) -> None:
        lo = self.lo
        H, K, L = lo.num_heads, lo.head_dim, lo.num_layers
        reference = Reference(lo, seed=int.from_bytes(os.urandom(4), "little"))
        pools = self.client.map_pools()
        with self.client.session("submit-step", drive=True) as session, \
                specstate.SharedBuffer(1 << 20) as buf:
            session.register(buf, "acts")
            for layer in range(L):
                session.load_layer_params(layer, reference.a_log[layer].numpy(),
                                          reference.dt_bias[layer].numpy())
            kpools = kit.StatePools(self.client)
            blocks, qsl, accepted = [2, 5], [0, 4, 7], [3, 2]
            T = qsl[-1]
            reference.prefill(kpools, blocks)
            acts = []
            for layer in range(L):
                a = {n: buf.empty((T, H, K), np.float32) for n in ("q", "k", "v", "g", "o")}
                a["beta"] = buf.empty((T, H), np.float32)
                x = reference.inputs({"q": (T, H, K), "k": (T, H, K), "v": (T, H, K),
                                      "g": (T, H, K), "beta": (T, H)})
                for n, t in x.items():
                    a[n][...] = t.numpy()
                a["o"][...] = np.nan
                acts.append((a, x))
            step = session.next_step()
            # Dicts of verify()'s arguments, built in order (later layers use the
            # step's indices).
            verifies = [dict(layer=0, query_start_loc=qsl, state_indices=blocks,
                             **acts[0][0])]
            verifies += [dict(layer=layer, **acts[layer][0]) for layer in range(1, L)]
            r = session.submit_step(step, verifies, commit=dict(num_accepted=accepted))
            self.assertEqual(len(r.verifies), L)
            self.assertEqual((r.commit.num_rows, r.commit.num_layers), (2, L))
            for layer, (a, x) in enumerate(acts):
                for i, b in enumerate(blocks):
                    want = reference.run(layer, b, x, qsl[i], qsl[i + 1], accepted[i])
                    self.assertLess(ref.rel_err(a["o"][qsl[i]:qsl[i + 1]], want), TOL)
                    self.assertLess(ref.rel_err(pools.recurrent(layer)[b],
                                                reference.states[(layer, b)]), TOL)
            # The first failing call stops the rest and names itself; nothing is committed.
            before = pools.snapshot()
            step = session.next_step()
            bad = [session.verify_request(step, 0, query_start_loc=qsl, state_indices=blocks,
                                          **acts[0][0]),
                   session.verify_request(step, L, **acts[0][0])]
            with self.assertRaises(kit.InvalidInput) as cm:
                session.submit_step(step, bad, commit=dict(num_accepted=accepted))
            self.assertEqual(cm.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertIn("verifies[1]", cm.exception.message)
            self.assertTrue(before == pools.snapshot(), "a refused SubmitStep wrote")
            # Client-side: a request of another step, a non-list.
            with self.assertRaises(kit.InvalidInput) as cm:
                session.submit_step(step + 1, bad[:1])
            self.assertIn("verifies[0]: step", cm.exception.message)
            with self.assertRaises(specstate.SpecStateError):
                session.submit_step(step, bad[0])
            kpools.close()
        pools.close()


@NEEDS_TORCH
class RunnerEagerTest(_ServerTest):
    """The Runner over a few steps against the float64 reference, both orderings;
    the pools as torch tensors; the typed errors."""

    def test_pools_are_torch_views_of_the_service(self) -> None:
        lo = self.lo
        with kit.StatePools(self.client) as pools:
            self.assertEqual(tuple(pools.recurrent(1).shape), (lo.num_blocks, 2, 64, 64))
            self.assertEqual(tuple(pools.conv(0).shape),
                             (lo.num_blocks, lo.conv_dim, lo.conv_kernel - 1 + lo.num_spec))
            self.assertEqual(pools.recurrent(0).dtype, torch.float32)
            s = torch.rand(2, 64, 64) - 0.5
            pools.recurrent(1)[3].copy_(s)
            read = self.client.read_state(1, 3, values=True)
            np.testing.assert_array_equal(np.array(read.recurrent.values, np.float32),
                                          s.numpy().reshape(-1))
            with self.assertRaises(kit.InvalidInput) as cm:
                pools.conv(lo.num_layers)
            self.assertIn(f"the service holds {lo.num_layers} layers", cm.exception.message)

    def test_async_steps(self) -> None:
        reference = Reference(self.lo, seed=int.from_bytes(os.urandom(4), "little"))
        with kit.Runner(self.client, "kit-async", max_tokens=16, max_rows=4) as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            reference.prefill(pools, [1, 4, 9])
            self.decode_steps(runner, pools, reference, [1, 4, 9], steps=4)
            self.decode_steps(runner, pools, reference, [4, 9], steps=2, in_place=True)
            rpcs = {r.method: r.calls for r in self.client.stats().rpcs}
            self.assertGreaterEqual(rpcs.get("SubmitStep", 0), 6)

    def test_sync_steps(self) -> None:
        reference = Reference(self.lo, seed=int.from_bytes(os.urandom(4), "little"))
        with kit.Runner(self.client, "kit-sync", max_tokens=16, ordering="sync") as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            reference.prefill(pools, [3, 7])
            self.decode_steps(runner, pools, reference, [3, 7], steps=3)
            # EAGER: free has nothing to do and makes no call.
            flushes = {r.method: r.calls for r in self.client.stats().rpcs}.get("Flush", 0)
            runner.free([3, 7])
            self.assertEqual({r.method: r.calls for r in self.client.stats().rpcs}
                             .get("Flush", 0), flushes)

    def test_bad_input_is_refused_with_the_field_and_the_bound(self) -> None:
        lo = self.lo
        with self.assertRaises(kit.InvalidInput) as cm:
            kit.Runner(self.client, max_tokens=8, max_rows=lo.max_rows + 1)
        self.assertEqual(cm.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        self.assertIn(f"[1, {lo.max_rows}]", cm.exception.message)
        reference = Reference(lo, seed=int.from_bytes(os.urandom(4), "little"))
        with kit.Runner(self.client, "kit-errors", max_tokens=8, max_rows=2) as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            reference.prefill(pools, [2, 6])
            with self.assertRaises(kit.InvalidInput) as cm:
                runner.begin_step([0, 1, 2, 3], [1, 2, 3])
            self.assertIn("3 rows is out of range: must be in [1, 2]", cm.exception.message)
            with self.assertRaises(kit.InvalidInput) as cm:
                runner.begin_step([0, 5, 9], [1, 2])
            self.assertIn("num_tokens = 9", cm.exception.message)
            with self.assertRaises(kit.InvalidInput) as cm:
                runner.begin_step([0, 1], [1, 2])
            self.assertIn("query_start_loc: shape [2], expected [3]", cm.exception.message)
            step = runner.begin_step([0, 2, 3], [2, 6])
            x = reference.inputs(shapes_of(step))
            with self.assertRaises(kit.InvalidInput) as cm:
                step.verify(0, **dict(x, beta=x["beta"][:, :1]))
            self.assertIn("beta: shape [3, 1], expected [3, 2]", cm.exception.message)
            with self.assertRaises(kit.FailedPrecondition) as cm:
                step.verify(1, **x)
            self.assertIn("layer 0 comes next", cm.exception.message)
            with self.assertRaises(kit.FailedPrecondition) as cm:
                step.commit([1, 1])
            self.assertIn("layers 0 to 1 were not verified", cm.exception.message)
            with self.assertRaises(kit.FailedPrecondition):
                runner.begin_step([0, 1], [2])  # step still open
            with self.assertRaises(kit.FailedPrecondition) as cm:
                runner.capture_step(2, 1)
            self.assertIn("CUDA graphs need the CUDA backend", cm.exception.message)
            step.abandon()  # the queued Verify calls run on what the buffers hold
            self.decode_steps(runner, pools, reference, [2, 6], steps=1)
            with self.assertRaises(kit.InvalidInput) as cm:
                runner.begin_step([0, 1, 2], [2, 6], num_tokens=3)
            self.assertIn("num_tokens = 3 but query_start_loc[2] = 2", cm.exception.message)
            # A block past the pools: found when the service runs the call, and
            # returned by the step's next call (its Commit); nothing is committed.
            before = [pools.recurrent(layer).clone() for layer in range(lo.num_layers)]
            step = runner.begin_step([0, 1, 2], [2, lo.num_blocks])
            for layer in range(lo.num_layers):
                step.verify(layer, **reference.inputs(shapes_of(step)))
            with self.assertRaises(kit.InvalidInput) as cm:
                step.commit([1, 1])
            self.assertEqual(cm.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertIn(f"state_indices[1] = {lo.num_blocks} is out of range",
                          cm.exception.message)
            for layer in range(lo.num_layers):
                self.assertTrue(torch.equal(pools.recurrent(layer), before[layer]))
            # The Runner goes on.
            self.decode_steps(runner, pools, reference, [6, 2], steps=1)
            # Closing with a step open (its Verify calls queued on doorbells)
            # abandons it first, so the session ends at once.
            step = runner.begin_step([0, 1], [2])
            step.verify(0, **reference.inputs(shapes_of(step)))
            start = time.monotonic()
            runner.close()  # (without the abandon: about 10 s, the service's own release)
            self.assertLess(time.monotonic() - start, 5.0)

    def test_server_down_is_unavailable(self) -> None:
        server = server_fixture.Server(**self.FLAGS).start()
        try:
            with server.client() as client:
                runner = kit.Runner(client, "kit-down", max_tokens=8, max_rows=2)
                try:
                    server.kill()
                    with self.assertRaises(kit.Unavailable) as cm:
                        runner.begin_step([0, 1], [1])
                    self.assertIsInstance(cm.exception, specstate.SpecStateError)
                    self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
                finally:
                    runner.close()
        finally:
            server.stop()


@NEEDS_TORCH
class RunnerGatedDeltaNetBf16Test(_ServerTest):
    """Gated DeltaNet (2 key heads, 4 value heads: g and beta [T, HV], no gate
    parameters) with bf16 activations: the kit's bf16 buffers are torch.bfloat16
    views of shared memory; outputs (stored bf16) to 1e-2, fp32 states to 1e-5."""

    FLAGS = dict(FLAGS, kind="gdn", heads=2, value_heads=4, activation_dtype="bf16")
    OUT_TOL = 1e-2

    def test_steps(self) -> None:
        reference = Reference(self.lo, seed=int.from_bytes(os.urandom(4), "little"))
        for ordering in ("async", "sync"):
            with kit.Runner(self.client, f"kit-gdn-{ordering}", max_tokens=16,
                            ordering=ordering) as runner, kit.StatePools(self.client) as pools:
                self.assertEqual(runner.inputs(0)["g"].shape, (16, 4))
                self.assertEqual(runner.inputs(0)["q"].dtype, torch.bfloat16)
                self.assertEqual(pools.conv(0).dtype, torch.bfloat16)
                self.assertEqual(tuple(pools.recurrent(0).shape), (self.lo.num_blocks, 4, 64, 64))
                with self.assertRaises(kit.FailedPrecondition) as cm:
                    runner.load_layer_params(0, torch.zeros(2), torch.zeros(128))
                self.assertIn("no gate parameters", cm.exception.message)
                reference.prefill(pools, [2, 5])
                self.decode_steps(runner, pools, reference, [2, 5], steps=3)


@NEEDS_TORCH
class RunnerAlignModeTest(_ServerTest):
    """Align mode (prefix caching, blocks of 4 tokens): Commit from the engine's
    block table and computed-token counts writes the final state (and the
    boundary state a row crosses) into the table's blocks; record_state_blocks
    gives each request's state block column."""

    FLAGS = dict(FLAGS, cache_mode="align", mamba_block_size=4)

    def test_commit_and_record_state_blocks(self) -> None:
        lo = self.lo
        bs, Q, width = lo.mamba_block_size, lo.num_spec + 1, 4
        reference = Reference(lo, seed=int.from_bytes(os.urandom(4), "little"))
        with kit.Runner(self.client, "kit-align", max_tokens=8, max_rows=2,
                        block_table_width=width) as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            nc = [3, 6]                                   # tokens each request has computed
            tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0]], dtype=torch.int32)
            checkpoints = [int(tables[i, (nc[i] - 1) // bs]) for i in range(2)]
            reference.prefill(pools, checkpoints)
            lens, accepted = [Q, Q], [3, 4]               # row 0 crosses a boundary at token 1
            qsl = [0, lens[0], lens[0] + lens[1]]
            step = runner.begin_step(qsl, checkpoints)
            xs = []
            for layer in range(runner.num_layers):
                x = reference.inputs(shapes_of(step))
                xs.append(x)
                o = step.verify(layer, **x)
                for i, b in enumerate(checkpoints):
                    f = {n: t[qsl[i]:qsl[i + 1]].double().cpu().numpy() for n, t in x.items()}
                    want, _ = ref.kda_tokens(reference.states[(layer, b)], *(
                        f[n] for n in ("q", "k", "v", "g", "beta")), reference.a_log[layer].numpy(),
                        reference.dt_bias[layer].numpy(), lo.lower_bound)
                    got = o[qsl[i]:qsl[i + 1]].double().cpu().numpy()
                    self.assertLess(ref.rel_err(got, want), TOL)
            step.commit(accepted, block_table=tables, num_computed_tokens=torch.tensor(nc))
            boundaries = 0
            for i in range(2):
                commit_len, final, boundary, boundary_len = ref.align_plan(
                    nc[i], accepted[i], lens[i], Q, bs, tables[i].tolist(), checkpoints[i])
                for layer in range(runner.num_layers):
                    f = {n: t[qsl[i]:qsl[i + 1]].double().cpu().numpy()
                         for n, t in xs[layer].items()}

                    def state_after(n: int) -> np.ndarray:
                        _, st = ref.kda_tokens(
                            reference.states[(layer, checkpoints[i])],
                            *(f[k][:n] for k in ("q", "k", "v", "g", "beta")),
                            reference.a_log[layer].numpy(), reference.dt_bias[layer].numpy(),
                            lo.lower_bound)
                        return st

                    got = pools.recurrent(layer)[final].double().cpu().numpy()
                    self.assertLess(ref.rel_err(got, state_after(commit_len)), TOL)
                    if boundary is not None and boundary > 0 and boundary_len < commit_len:
                        boundaries += 1
                        self.assertLess(ref.rel_err(
                            pools.recurrent(layer)[boundary].double().cpu().numpy(),
                            state_after(boundary_len)), TOL)
            self.assertGreater(boundaries, 0, "no row crossed a block boundary")
            state_idx, acc = runner.record_state_blocks(
                step, idx_mapping=[0, 1], num_sampled=accepted,
                num_computed_tokens=nc, block_table_width=width)
            self.assertEqual(state_idx.tolist(), [min((nc[i] + accepted[i] - 1) // bs, width - 1)
                                                  for i in range(2)])
            self.assertEqual(acc.tolist(), [1, 1])


@NEEDS_TORCH
class RunnerDeferredTest(_ServerTest):
    """DEFERRED: a Commit leaves the tokens pending (the pool holds the
    checkpoint) until the block's next Verify or a Flush; free discards them."""

    FLAGS = dict(FLAGS, commit_mode="deferred")

    def test_flush_and_free(self) -> None:
        reference = Reference(self.lo, seed=int.from_bytes(os.urandom(4), "little"))
        with kit.Runner(self.client, "kit-deferred", max_tokens=16) as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            blocks = [3, 8]
            reference.prefill(pools, blocks)
            checkpoint = {k: v.copy() for k, v in reference.states.items()}
            self.decode_steps(runner, pools, reference, blocks, steps=1, check_states=False)
            for layer in range(runner.num_layers):  # pending: the checkpoint, unchanged
                for b in blocks:
                    np.testing.assert_array_equal(pools.recurrent(layer)[b].double().cpu().numpy(),
                                                  checkpoint[(layer, b)])
            # The next step's Verify replays them (its outputs are checked).
            self.decode_steps(runner, pools, reference, blocks, steps=2, check_states=False)
            runner.flush([blocks[0]])
            for layer in range(runner.num_layers):
                got = pools.recurrent(layer)[blocks[0]].double().cpu().numpy()
                self.assertLess(ref.rel_err(got, reference.states[(layer, blocks[0])]), TOL)
            # free: the pending tokens are forgotten, the checkpoint stays.
            held = [pools.recurrent(layer)[blocks[1]].clone() for layer in range(runner.num_layers)]
            runner.free([blocks[1]])
            runner.flush()
            for layer in range(runner.num_layers):
                self.assertTrue(torch.equal(pools.recurrent(layer)[blocks[1]], held[layer]))
            with self.assertRaises(kit.InvalidInput) as cm:
                runner.flush([1, self.lo.num_blocks])
            self.assertEqual(cm.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertIn("blocks[1]", cm.exception.message)


@NEEDS_TORCH
class RunnerFastTest(_ServerTest):
    """FAST (rings of 2 * Q tokens): states materialize at a fold or a Flush;
    free empties the ring, so a new request in the block starts clean."""

    FLAGS = dict(FLAGS, commit_mode="fast", fold_every=2)

    def test_flush_and_free(self) -> None:
        reference = Reference(self.lo, seed=int.from_bytes(os.urandom(4), "little"))
        with kit.Runner(self.client, "kit-fast", max_tokens=16) as runner, \
                kit.StatePools(self.client) as pools:
            reference.load(runner)
            blocks = [2, 11]
            reference.prefill(pools, blocks)
            self.decode_steps(runner, pools, reference, blocks, steps=3, check_states=False)
            runner.flush(blocks)
            for layer in range(runner.num_layers):
                for b in blocks:
                    self.assertLess(ref.rel_err(pools.recurrent(layer)[b].double().cpu().numpy(),
                                                reference.states[(layer, b)]), TOL)
            # A request ends with tokens in its ring; free (discard) empties it, and
            # the next request's fresh state in the block is all Verify sees.
            self.decode_steps(runner, pools, reference, blocks, steps=1, check_states=False)
            runner.free(blocks)
            reference.prefill(pools, blocks)
            self.decode_steps(runner, pools, reference, blocks, steps=2, check_states=False)


@NEEDS_TORCH
class KeptPoolsResumeTest(unittest.TestCase):
    """specstated SIGKILLed in the middle of a step and restarted with its pools
    kept: the step raises Unavailable, runner.resume() re-opens, re-registers,
    reloads and re-binds (and, on CUDA, releases the stream waits the dead
    service left parked), the old step id is refused (LostSteps), and the
    states go on matching the reference."""

    FLAGS: dict = FLAGS

    def test_resume(self) -> None:
        directory = tempfile.mkdtemp(prefix="kk", dir="/tmp")
        keeper = server_fixture.Keeper(directory)
        server = server_fixture.Server(keeper=keeper.socket, **self.FLAGS).start()
        try:
            with server.client() as client:
                reference = Reference(client.layout(), seed=int.from_bytes(os.urandom(4),
                                                                           "little"))
                runner = kit.Runner(client, "kit-resume", max_tokens=8, max_rows=2)
                pools = kit.StatePools(client)
                try:
                    reference.load(runner)
                    reference.prefill(pools, [1, 5])
                    helper = RunnerEagerTest("test_async_steps")
                    helper.decode_steps(runner, pools, reference, [1, 5], steps=2)
                    pools.close()
                    step = runner.begin_step([0, 1, 2], [1, 5])
                    # Every layer's inputs on the runner's device before the kill:
                    # on CUDA the first Verify's wait parks the caller's stream
                    # until resume() releases it, and a copy from host memory
                    # would block the host behind it (kit/runner.py, resume).
                    inputs = [{n: t.to(runner.device) for n, t in
                               reference.inputs(shapes_of(step)).items()}
                              for _ in range(runner.num_layers)]
                    server.kill(hard=True)
                    with self.assertRaises(kit.Unavailable):
                        # CPU: the host's wait for layer 0 sees the session end;
                        # CUDA: the waits are on the stream, the Commit's RPC fails.
                        for layer in range(runner.num_layers):
                            step.verify(layer, **inputs[layer])
                        step.commit([1, 1])
                    server.start()
                    self.assertEqual(runner.resume(), [])
                    self.assertEqual(runner.last_recover.last_committed_step, step.id - 1)
                    with self.assertRaises(kit.FailedPrecondition):
                        step.verify(0, **reference.inputs(shapes_of(step)))
                    self.assertEqual(runner.session.lost_steps, [step.id])
                    with self.assertRaises(kit.LostSteps) as cm:
                        runner.session.commit(step.id, [1, 1])
                    self.assertIn("was in flight when specstated restarted", cm.exception.message)
                    pools = kit.StatePools(client)
                    helper.decode_steps(runner, pools, reference, [5, 1], steps=2)
                finally:
                    runner.close()
                    pools.close()
        finally:
            server.stop()
            keeper.stop()
            shutil.rmtree(directory, ignore_errors=True)


@NEEDS_TORCH
class KdaDecodeExampleTest(unittest.TestCase):
    """examples/kda_decode.py end to end (5 requests on 2 blocks, so blocks are
    freed and reused): EAGER and DEFERRED give the same tokens, each equal to
    the reference's, logits within 1e-3; FAST within its contract (the same
    check: the tokens, near-ties allowed, and the logits)."""

    def run_example(self, **flags) -> dict:
        spec = importlib.util.spec_from_file_location("kda_decode", _example_path())
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        server = server_fixture.Server(**dict(FLAGS, **flags)).start()
        out = os.path.join(server.dir, "out.json")
        try:
            rc = example.main([f"--server={server.address}", "--requests=5", "--slots=2",
                               "--tokens=64", "--seed=11", "--check", f"--json={out}"])
            self.assertEqual(rc, 0)
            with open(out) as f:
                return json.load(f)
        finally:
            server.stop()

    def test_eager_deferred_fast(self) -> None:
        eager = self.run_example()
        deferred = self.run_example(commit_mode="deferred")
        fast = self.run_example(commit_mode="fast", fold_every=2)
        for result in (eager, deferred, fast):
            self.assertEqual(result["mismatches"], 0, result)
            self.assertGreater(result["accepted_drafts"], 0, "no draft was ever accepted")
            self.assertLess(result["max_logit_diff"], 1e-3)
        self.assertEqual(eager["compared"], 5 * 64)
        # DEFERRED's states and outputs are EAGER's bit for bit: so are the tokens.
        self.assertEqual(eager["tokens"], deferred["tokens"])
        self.assertEqual(eager["max_logit_diff"], deferred["max_logit_diff"])


if __name__ == "__main__":
    junit_runner.main()
