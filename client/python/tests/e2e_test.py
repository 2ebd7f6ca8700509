"""End to end: a numpy scheduler loop against a real specstated (CPU backend),
checked against the independent float64 reference in kda_reference.py. The
same loop runs KDA (the safe and the plain gate) and Gated DeltaNet layouts:
the Harness reads the shapes from GetLayout.

Tolerances (per tensor, ||got - want|| / ||want||):
- The service computes in fp32 from the very activation values the reference
  reads (bit copies), so the only differences are fp32 rounding in the
  recurrence (relative ~1e-7 per operation, a few hundred operations per
  element over these steps) and the rounding of the stored outputs.
- fp32 state: 1e-5 (about 100x the expected fp32 error).
- Outputs stored as fp32: 1e-5. Stored as bf16: every element is rounded to
  8 significant bits (relative error <= 2^-9 ~ 2e-3 per element), so 1e-2.
- Conv windows are bit copies: compared exactly.
"""
from __future__ import annotations

import os
import sys
import unittest
from typing import Dict, List, Optional

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import junit_runner  # noqa: E402
import kda_reference as ref  # noqa: E402
import server_fixture  # noqa: E402
import specstate  # noqa: E402
from specstate.v1 import specstate_pb2 as pb  # noqa: E402

STATE_TOL = 1e-5
OUT_TOL = {pb.FP32: 1e-5, pb.BF16: 1e-2, pb.FP16: 2e-3}

SMALL = dict(layers=2, heads=2, head_dim=64, conv_dim=32, conv_kernel=4, num_spec=3,
             blocks=24, max_rows=6)
# Gated DeltaNet: two value heads per key head, so a wrong key-head mapping shows.
GDN = dict(kind="gdn", heads=2, value_heads=4)


def act_values(x: np.ndarray, dtype: int) -> np.ndarray:
    """float values -> the activation dtype's numpy form (bf16 bits as uint16)."""
    if dtype == pb.BF16:
        return specstate.to_bfloat16(x)
    return x.astype(np.float16 if dtype == pb.FP16 else np.float32)


def act_float(a: np.ndarray, dtype: int) -> np.ndarray:
    """The activation dtype's numpy form -> float64 (decoded independently of the package)."""
    if dtype == pb.BF16:
        return ref.bf16_bits_to_float(a)
    return np.asarray(a, dtype=np.float64)


def poison(a: np.ndarray) -> None:
    a.view(np.uint8)[...] = 0xFF


class Harness:
    """A scheduler over R request slots: its buffers, the pools and the reference.

    The layout decides the shapes. KDA: H value heads, g [T, H, K], gate
    parameters loaded here. GDN: HV value heads, g and beta [T, HV], no gate
    parameters. Each token's q | k | v | beta are column slices of one
    projection row (q, k H*K each, v HV*V, beta HV), as a model's fused
    projection writes them, so beta's token stride is not its width.

    Each request slot i has a block table (none mode: one block, i + 1) and,
    per layer, its reference state (float64 [HV, V, K]) and conv window (raw values).
    """

    def __init__(self, test: unittest.TestCase, client: specstate.Client,
                 session: specstate.Session, requests: int, seed: int) -> None:
        self.t = test
        self.client = client
        self.session = session
        self.rng = np.random.default_rng(seed)
        self.lo = client.layout()
        lo = self.lo
        self.L, self.H, self.K = lo.num_layers, lo.num_heads, lo.head_dim
        self.Q, self.D, self.W = lo.num_spec + 1, lo.conv_dim, lo.conv_width
        self.hl = lo.conv_kernel - 1
        self.act = lo.activation_dtype
        self.align = lo.cache_mode == pb.ALIGN
        self.deferred = lo.commit_mode == pb.DEFERRED
        # FAST: each request's ring of accepted tokens, as the Commits left it
        # (a fold empties it when the next window might not fit).
        self.fast = lo.commit_mode == pb.FAST
        self.ring_capacity = lo.fold_every * (lo.num_spec + 1)
        self.ring_tokens: List[int] = []
        self.bs = lo.mamba_block_size
        self.R = requests
        self.gdn = lo.layer_kind == pb.GDN
        self.plain_gate = lo.kda_gate == pb.PLAIN_GATE
        self.HV = lo.num_value_heads or self.H
        self.HK, self.HVK = self.H * self.K, self.HV * self.K
        self.g_shape = (self.HV,) if self.gdn else (self.H, self.K)
        self.pools = client.map_pools()
        self.np_act = specstate.dtypes.numpy_dtype(self.act)
        tmax = self.R * self.Q
        self.proj_stride = 2 * self.HK + self.HVK + self.HV
        item = self.np_act.itemsize
        g_width = int(np.prod(self.g_shape))
        nbytes = self.L * tmax * (self.proj_stride + g_width + self.HVK) * item + (1 << 16)
        self.buf = specstate.SharedBuffer(nbytes)
        session.register(self.buf, "acts")
        self.proj = [self.buf.zeros((tmax, self.proj_stride), self.np_act) for _ in range(self.L)]
        self.g = [self.buf.zeros((tmax,) + self.g_shape, self.np_act) for _ in range(self.L)]
        self.o = [self.buf.zeros((tmax, self.HV, self.K), self.np_act) for _ in range(self.L)]
        self.meta = specstate.SharedBuffer(1 << 16)
        session.register(self.meta, "meta")
        self.a_log: List[Optional[np.ndarray]] = [None] * self.L
        self.dt_bias: List[Optional[np.ndarray]] = [None] * self.L
        if not self.gdn:  # GDN's g arrives as the model computed it: nothing to load
            self.a_log = [self.rng.uniform(-2.0, 0.5, self.H).astype(np.float32)
                          for _ in range(self.L)]
            self.dt_bias = [self.rng.uniform(-1.0, 1.0, self.HK).astype(np.float32)
                            for _ in range(self.L)]
            for layer in range(self.L):
                session.load_layer_params(layer, self.a_log[layer], self.dt_bias[layer])
        self.width = 3 + (2 * self.bs + 8 * self.Q) // self.bs if self.align else 1
        self.free = list(range(lo.num_blocks - 1, 0, -1))
        self.tables: List[List[int]] = []
        self.nc: List[int] = []
        self.states: List[List[np.ndarray]] = []  # [request][layer] float64 [H, V, K]
        self.windows: List[List[np.ndarray]] = []  # [request][layer] [D, hl] raw
        self.bound_qsl: Optional[np.ndarray] = None  # set by bind()
        self.bound_idx: Optional[np.ndarray] = None
        for i in range(self.R):
            self.start_request(i)

    # ---- activations and the reference ----

    def split(self, proj: np.ndarray) -> Dict[str, np.ndarray]:
        """q, k [T, H, K], v [T, HV, V] and beta [T, HV]: views of projection rows [T, stride]."""
        T, H, HV, K, HK, HVK = proj.shape[0], self.H, self.HV, self.K, self.HK, self.HVK
        return dict(q=proj[:, :HK].reshape(T, H, K), k=proj[:, HK:2 * HK].reshape(T, H, K),
                    v=proj[:, 2 * HK:2 * HK + HVK].reshape(T, HV, K), beta=proj[:, 2 * HK + HVK:])

    def inputs(self, layer: int, a: int, b: int) -> Dict[str, np.ndarray]:
        """Views of layer `layer`'s Verify inputs (q, k, v, beta, g) for tokens [a, b)."""
        x = self.split(self.proj[layer][a:b])
        x["g"] = self.g[layer][a:b]
        return x

    def fill_inputs(self, layer: int, T: int) -> None:
        """Fresh random inputs (never zeros) for the first T tokens of `layer`: q, k,
        v in [-1, 1]; KDA's beta a logit in [-3, 3] and g in [-3, 1]; GDN's beta a
        write strength in (0, 1) and g a log-decay in (-2, 0), as its gating gives them."""
        proj = self.rng.uniform(-1, 1, (T, self.proj_stride))
        beta = proj[:, 2 * self.HK + self.HVK:]
        if self.gdn:
            beta[...] = self.rng.uniform(0.05, 0.95, beta.shape)
            g = self.rng.uniform(-2.0, -0.05, (T,) + self.g_shape)
        else:
            beta[...] = self.rng.uniform(-3, 3, beta.shape)
            g = self.rng.uniform(-3, 1, (T,) + self.g_shape)
        self.proj[layer][:T] = act_values(proj, self.act)
        self.g[layer][:T] = act_values(g, self.act)

    def reference(self, layer: int, state: np.ndarray, x: Dict[str, np.ndarray]):
        """(outputs [T, HV, V], state after the tokens) of inputs `x` (as inputs()
        gives them, decoded here) from `state`, by the float64 reference."""
        f = {n: act_float(a, self.act) for n, a in x.items()}
        if self.gdn:
            return ref.gdn_tokens(state, f["q"], f["k"], f["v"], f["g"], f["beta"])
        return ref.kda_tokens(state, f["q"], f["k"], f["v"], f["g"], f["beta"], self.a_log[layer],
                              self.dt_bias[layer], self.lo.lower_bound,
                              plain_gate=self.plain_gate)

    # ---- bound inputs ----

    def bind(self) -> None:
        """Binds every layer's Verify tensors once, at capacity: the R * Q tokens of
        the activation buffers and the layout's max_rows rows of index buffers in
        "meta", of which a step uses the first T and R. Even layers are bound with
        the indices (state_indices [max_rows, 2], column 0 used), odd layers
        without (their bound Verify uses the step's copy)."""
        if self.bound_qsl is not None:
            return
        tmax, rows = self.R * self.Q, self.lo.max_rows
        self.t.assertLessEqual(self.R, rows)
        self.bound_qsl = self.meta.ndarray((rows + 1,), np.int32, 40960)
        self.bound_idx = self.meta.ndarray((rows, 2), np.int32, 45056)
        # Entries past a step's rows (and column 1) are never read: out of range if they were.
        self.bound_qsl[...] = -9
        self.bound_idx[...] = -9
        for layer in range(self.L):
            indices = layer % 2 == 0
            r = self.session.bind_verify_inputs(
                layer, **self.inputs(layer, 0, tmax), o=self.o[layer],
                query_start_loc=self.bound_qsl if indices else None,
                state_indices=self.bound_idx if indices else None)
            self.t.assertEqual(r.max_tokens, tmax)
            self.t.assertEqual(r.max_rows, rows if indices else -1)

    # ---- requests ----

    def checkpoint(self, i: int) -> int:
        return self.tables[i][(self.nc[i] - 1) // self.bs if self.align else 0]

    def start_request(self, i: int) -> None:
        nc = int(self.rng.integers(1, 2 * self.bs + 1)) if self.align else 1
        table = [0] * self.width
        table[(nc - 1) // self.bs if self.align else 0] = self.free.pop()
        if i < len(self.tables):
            self.tables[i], self.nc[i] = table, nc
            self.ring_tokens[i] = 0
        else:
            self.tables.append(table)
            self.nc.append(nc)
            self.ring_tokens.append(0)
            self.states.append([None] * self.L)
            self.windows.append([None] * self.L)
        block = self.checkpoint(i)
        for layer in range(self.L):
            s = self.rng.uniform(-0.5, 0.5, (self.HV, self.K, self.K)).astype(np.float32)
            self.pools.recurrent(layer)[block] = s
            self.states[i][layer] = s.astype(np.float64)
            hist = act_values(self.rng.uniform(-1, 1, (self.D, self.hl)), self.act)
            conv = self.pools.conv(layer)[block]
            conv[...] = 0
            conv[:, :self.hl] = hist
            self.windows[i][layer] = hist.copy()

    # ---- one step ----

    def step(self, s: int, null_rows: tuple = (), remap: bool = False,
             region_indices: bool = False, full: bool = False,
             bound: bool = False, flush: Optional[str] = None) -> Dict[str, object]:
        """One decode step; `full`: every row verifies Q tokens and accepts them all;
        `bound`: Verify through the layers' bindings (bind() on the first such step).
        Commit mode DEFERRED: the blocks a Commit leaves pending hold their
        checkpoint until `flush` ("all": Flush every block; "blocks": Flush the
        step's blocks) or the next step's Verify materializes them; without a
        flush their states are checked through the next step's outputs.
        Commit mode FAST: the same, for the blocks whose ring took the
        accepted tokens without folding (a fold, and a row that leaves its
        block or crosses a boundary in align mode, store real states); with
        `flush` "read", each such block's state is read through ReadState
        (which materializes it into a copy: the pool keeps the checkpoint and
        the block stays pending) instead of a Flush."""
        R, Q = self.R, self.Q
        tokens = [Q if full else int(self.rng.integers(1, Q + 1)) for _ in range(R)]
        accepted = [t if full else int(self.rng.integers(1, t + 1)) for t in tokens]
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
        T = int(qsl[-1])
        live = [i not in null_rows for i in range(R)]
        if self.align:  # blocks for the columns this step's tokens reach
            for i in range(R):
                last = (self.nc[i] + tokens[i] - 1) // self.bs
                for c in range((self.nc[i] - 1) // self.bs, min(last, self.width - 1) + 1):
                    if self.tables[i][c] == 0:
                        self.tables[i][c] = self.free.pop()
        checkpoint = [self.checkpoint(i) if live[i] else 0 for i in range(R)]

        # Activations (q | k | v | beta per token: column slices of one projection), g, o.
        for layer in range(self.L):
            self.fill_inputs(layer, T)
            poison(self.o[layer])

        # The conv update on the exported pool (docs/semantics.md, the contract):
        # [h_1..h_hl] -> [h_2..h_hl, x_0..x_{T-1}] from column 0.
        updated: List[List[Optional[np.ndarray]]] = [[None] * self.L for _ in range(R)]
        for i in range(R):
            if not live[i]:
                continue
            for layer in range(self.L):
                conv = self.pools.conv(layer)[checkpoint[i]]
                x = act_values(self.rng.uniform(-1, 1, (tokens[i], self.D)), self.act)
                new = ref.conv_update(np.array(conv), x, self.hl)
                conv[...] = new
                updated[i][layer] = new

        # Verify every layer.
        if region_indices:
            qsl_arg = self.meta.ndarray((R + 1,), np.int32, 0)
            qsl_arg[...] = qsl
            idx_arg = self.meta.ndarray((R,), np.int32, 4096)
            idx_arg[...] = checkpoint
        else:
            qsl_arg, idx_arg = qsl.tolist(), checkpoint
        if bound:
            self.bind()
            self.bound_qsl[:R + 1] = qsl
            self.bound_idx[:R, 0] = checkpoint
        step = self.session.next_step()
        for layer in range(self.L):
            # Bound steps: odd steps send the last layer's tensors in a plain
            # Verify (bindings and tensors mix within a step), and later layers
            # leave num_rows to the client's copy of the step's.
            if bound and not (s % 2 == 1 and layer == self.L - 1 > 0):
                self.session.verify_bound(step, layer, num_tokens=T,
                                          num_rows=R if layer == 0 or s % 2 == 0 else None)
                continue
            # Later layers may rely on the step's copy.
            give = not bound and (layer == 0 or s % 2 == 0)
            self.session.verify(
                step, layer, **self.inputs(layer, 0, T), o=self.o[layer][:T],
                query_start_loc=qsl_arg if give else None,
                state_indices=idx_arg if give else None,
                num_rows=None if give or bound else R)

        # Outputs against the reference; null rows keep the poison.
        out_errors = []
        for layer in range(self.L):
            # Tokens past T keep the poison (a binding's capacity is not written).
            self.t.assertTrue(np.all(self.o[layer][T:].view(np.uint8) == 0xFF),
                              f"step {s}, layer {layer}: outputs past token {T}")
            o = act_float(self.o[layer][:T], self.act)
            for i in range(R):
                a, b = int(qsl[i]), int(qsl[i + 1])
                if not live[i]:
                    self.t.assertTrue(np.all(self.o[layer][a:b].view(np.uint8) == 0xFF),
                                      f"step {s}: null row {i} got outputs")
                    continue
                want, _ = self.reference(layer, self.states[i][layer], self.inputs(layer, a, b))
                err = ref.rel_err(o[a:b], want)
                out_errors.append(err)
                self.t.assertLess(err, OUT_TOL[self.act],
                                  f"step {s}, layer {layer}, row {i}: outputs off by {err:.2e}")

        # Commit (odd steps: a prefill row in front, spec rows mapped by request_indices).
        shift = 1 if remap else 0
        batch = R + shift
        num_accepted = [0] * shift + accepted
        kwargs = {}
        if remap:
            kwargs["request_indices"] = list(range(1, R + 1))
        if self.align:
            table = self.meta.ndarray((batch, self.width), np.int32, 8192)
            table[...] = 0
            for i in range(R):
                table[i + shift] = self.tables[i] if live[i] else 0
            nc = self.meta.ndarray((batch,), np.int32, 16384)
            nc[...] = [0] * shift + [self.nc[i] if live[i] else 0 for i in range(R)]
            kwargs.update(block_table=table, num_computed_tokens=nc)
        before = self.pools.snapshot()
        checkpoints_before = [[np.array(self.pools.recurrent(layer)[checkpoint[i]])
                               for layer in range(self.L)] for i in range(R)]
        response = self.session.commit(step, num_accepted, **kwargs)
        self.t.assertEqual(response.num_rows, R)
        self.t.assertEqual(response.num_layers, self.L)
        self.t.assertFalse(response.replayed_from_cache)
        # A retry of the same Commit is answered from the first and writes nothing.
        after = self.pools.snapshot()
        again = self.session.commit(step, num_accepted, **kwargs)
        self.t.assertTrue(again.replayed_from_cache)
        self.t.assertTrue(after == self.pools.snapshot(), f"step {s}: a retried Commit wrote")
        # (DEFERRED and FAST may write no state at Commit: when every row
        # accepts one token, its conv windows stay where they are too.)
        if not self.deferred and not self.fast:
            self.t.assertTrue(before != after, f"step {s}: the Commit wrote nothing")

        if self.align:
            state_idx = self.meta.ndarray((R,), np.int32, 20480)
            acc_out = self.meta.ndarray((R,), np.int32, 24576)
            state_idx[...] = -7
            acc_out[...] = -7
            mapping = [-1] * shift + [i if live[i] else -1 for i in range(R)]
            self.session.record_state_blocks(
                step, idx_mapping=mapping, num_sampled=num_accepted,
                num_computed_tokens=kwargs["num_computed_tokens"],
                block_table_width=self.width, state_idx=state_idx, num_accepted=acc_out,
                request_indices=kwargs.get("request_indices"))
            for i in range(R):
                want_idx = (min((self.nc[i] + accepted[i] - 1) // self.bs, self.width - 1)
                            if live[i] else -7)
                self.t.assertEqual(int(state_idx[i]), want_idx, f"step {s}: state_idx[{i}]")
                self.t.assertEqual(int(acc_out[i]), 1 if live[i] else -7)

        # DEFERRED: a row whose state stays in its checkpoint block and crosses
        # no boundary is pending there; the block still holds the checkpoint.
        # FAST: a row that stays in its block appends to its ring, which
        # folds (a real state in the pool) when the next window might not fit.
        pending, folds = set(), 0
        for i in range(R):
            if not live[i] or not (self.deferred or self.fast):
                continue
            if self.align:
                _, final, boundary, _ = ref.align_plan(self.nc[i], accepted[i], tokens[i], Q,
                                                       self.bs, self.tables[i], checkpoint[i])
                if final != checkpoint[i] or (boundary is not None and boundary > 0):
                    self.ring_tokens[i] = 0  # real states; the final block's ring is empty
                    continue
            if self.fast:
                self.ring_tokens[i] += accepted[i]
                if self.ring_tokens[i] + Q > self.ring_capacity:
                    self.ring_tokens[i] = 0  # folded: a real state
                    folds += 1
                    continue
            pending.add(i)
            for layer in range(self.L):
                np.testing.assert_array_equal(
                    self.pools.recurrent(layer)[checkpoint[i]], checkpoints_before[i][layer],
                    f"step {s}: pending block {checkpoint[i]} changed before it was flushed")
        flushed = (set(range(R)) if flush == "all" else
                   set(pending) if flush in ("blocks",) else set())
        read_states = {}
        if flush == "all":
            self.session.flush()
            pending.clear()
        elif flush == "blocks":
            self.session.flush([checkpoint[i] for i in sorted(pending)] + [0])
            pending.clear()
        elif flush == "read":  # ReadState shows each layer's current state, from a copy
            for i in sorted(pending):
                for layer in range(self.L):
                    read = self.client.read_state(layer, checkpoint[i], values=True)
                    pool = self.pools.recurrent(layer)[checkpoint[i]]
                    read_states[(i, layer)] = np.array(
                        read.recurrent.values, dtype=np.float64).reshape(pool.shape)
                    np.testing.assert_array_equal(
                        pool, checkpoints_before[i][layer],
                        f"step {s}: ReadState changed pending block {checkpoint[i]} in the pool")
        for i in flushed:  # (FAST: their rings folded)
            self.ring_tokens[i] = 0

        # Committed states and conv windows against the reference.
        state_errors, boundaries = [], 0
        for i in range(R):
            if not live[i]:
                continue
            acc = accepted[i]
            a = int(qsl[i])
            if self.align:
                commit_len, final, boundary, boundary_len = ref.align_plan(
                    self.nc[i], acc, tokens[i], Q, self.bs, self.tables[i], checkpoint[i])
            else:
                commit_len, final, boundary, boundary_len = acc, checkpoint[i], None, 0
            for layer in range(self.L):
                def run(n: int) -> np.ndarray:
                    _, st = self.reference(layer, self.states[i][layer],
                                           self.inputs(layer, a, a + n))
                    return st

                want = run(commit_len)
                # (pending: checked through the next step's outputs, or
                # through what ReadState returned)
                if i not in pending or (i, layer) in read_states:
                    got = read_states.get((i, layer), self.pools.recurrent(layer)[final])
                    err = ref.rel_err(got, want)
                    state_errors.append(err)
                    self.t.assertLess(err, STATE_TOL, f"step {s}, layer {layer}, row {i}: "
                                      f"committed state in block {final} off by {err:.2e}")
                window = ref.window_after(updated[i][layer], commit_len, self.hl)
                np.testing.assert_array_equal(
                    self.pools.conv(layer)[final][:, :self.hl], window,
                    f"step {s}, layer {layer}, row {i}: conv window in block {final}")
                if boundary is not None and boundary > 0 and boundary_len < commit_len:
                    boundaries += layer == 0
                    err = ref.rel_err(self.pools.recurrent(layer)[boundary], run(boundary_len))
                    state_errors.append(err)
                    self.t.assertLess(err, STATE_TOL, f"step {s}: boundary state off by {err:.2e}")
                    np.testing.assert_array_equal(
                        self.pools.conv(layer)[boundary][:, :self.hl],
                        ref.window_after(updated[i][layer], boundary_len, self.hl))
                self.states[i][layer] = want
                self.windows[i][layer] = window
            self.nc[i] += commit_len
        return {"tokens": T, "accepted": sum(accepted[i] for i in range(R) if live[i]),
                "max_out_err": max(out_errors, default=0.0),
                "max_state_err": max(state_errors, default=0.0), "boundaries": boundaries,
                "folds": folds, "states_checked": len(state_errors)}

    def close(self) -> None:
        self.pools.close()


class _ServerTest(unittest.TestCase):
    FLAGS: dict = {}

    @classmethod
    def setUpClass(cls) -> None:
        cls.server = server_fixture.Server(**cls.FLAGS).start()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.stop()


class NoneModeBf16Test(_ServerTest):
    FLAGS = dict(SMALL, activation_dtype="bf16", state_dtype="fp32", cache_mode="none")

    def test_scheduler_loop(self) -> None:
        with self.server.client() as client, client.session("e2e-bf16", drive=True) as session:
            self.assertTrue(session.driving)
            h = Harness(self, client, session, requests=3, seed=1)
            report = []
            for s in range(5):
                report.append(h.step(s, null_rows=(1,) if s == 2 else (), remap=s % 2 == 1,
                                     region_indices=s % 2 == 0))
            h.close()
            stats = client.stats()
            self.assertEqual(stats.steps_committed, 5)
            self.assertEqual(stats.steps_failed, 0)
            print(f"bf16 none, {pb.LayerKind.Name(h.lo.layer_kind)}: {report}", file=sys.stderr)


class NoneModeFp32Test(_ServerTest):
    """fp32 activations: outputs and states checked to 1e-5."""

    FLAGS = dict(SMALL, activation_dtype="fp32", state_dtype="fp32", cache_mode="none")

    def test_scheduler_loop_tight(self) -> None:
        with self.server.client() as client, client.session("e2e-fp32", drive=True) as session:
            h = Harness(self, client, session, requests=4, seed=2)
            for s in range(4):
                r = h.step(s, remap=s == 1)
                self.assertLess(r["max_out_err"], 1e-5)
                self.assertLess(r["max_state_err"], 1e-5)
            h.close()

    def test_async_doorbells(self) -> None:
        """ASYNC: Verify is sent before its inputs exist, waiting on a doorbell the
        scheduler rings once they are written; the service signals the others."""
        with self.server.client() as client, client.session("e2e-async", drive=True) as session:
            h = Harness(self, client, session, requests=2, seed=3)
            bells = h.meta.ndarray((4,), np.uint32, 32768)
            bells[...] = 0
            R, Q = h.R, h.Q
            tokens = [Q, 2]
            qsl = [0, tokens[0], tokens[0] + tokens[1]]
            T = qsl[-1]
            step = session.next_step()
            for layer in range(h.L):
                r = session.verify(
                    step, layer, **h.inputs(layer, 0, T), o=h.o[layer][:T],
                    query_start_loc=qsl, state_indices=[h.checkpoint(0), h.checkpoint(1)],
                    wait=session.doorbell(bells[0:1], 1),
                    signal=session.doorbell(bells[1:2], 7) if layer == h.L - 1 else None)
                self.assertTrue(r.enqueued)
            # The inputs appear only now; then the doorbell rings.
            for layer in range(h.L):
                h.fill_inputs(layer, T)
            specstate.ring(bells[0:1], 1)
            specstate.wait_counter(bells[1:2], 7, timeout=30)
            for layer in range(h.L):
                for i in range(R):
                    a, b = qsl[i], qsl[i + 1]
                    want, _ = h.reference(layer, h.states[i][layer], h.inputs(layer, a, b))
                    self.assertLess(ref.rel_err(h.o[layer][a:b], want), 1e-5)
            r = session.commit(step, [2, 1], signal=session.doorbell(bells[2:3], 9))
            self.assertTrue(r.enqueued)
            specstate.wait_counter(bells[2:3], 9, timeout=30)
            for layer in range(h.L):
                _, want = h.reference(layer, h.states[0][layer], h.inputs(layer, 0, 2))
                self.assertLess(ref.rel_err(h.pools.recurrent(layer)[h.checkpoint(0)], want), 1e-5)
            h.close()

    def test_bound_inputs(self) -> None:
        """BindVerifyInputs once per layer at capacity, then Verify calls that carry
        only their counts: the same checks (and tolerances) as the plain loop."""
        with self.server.client() as client, client.session("e2e-bound", drive=True) as session:
            h = Harness(self, client, session, requests=4, seed=5)
            # No binding in this session yet.
            with self.assertRaises(specstate.SpecStateError) as cm:
                session.verify_bound(session.next_step(), 0, num_tokens=1, num_rows=1)
            self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION,
                             cm.exception.message)
            for s in range(6):
                # Step 3 sends tensors: the bindings outlive a plain step.
                r = h.step(s, bound=s != 3, remap=s == 1, null_rows=(2,) if s == 4 else (),
                           full=s == 5)
                self.assertLess(r["max_out_err"], 1e-5)
                self.assertLess(r["max_state_err"], 1e-5)
            # Past the binding's capacity.
            with self.assertRaises(specstate.SpecStateError) as cm:
                session.verify_bound(session.next_step(), 0, num_tokens=h.R * h.Q + 1,
                                     num_rows=h.R)
            self.assertEqual(cm.exception.code, grpc.StatusCode.OUT_OF_RANGE,
                             cm.exception.message)
            # Index values inline: refused before the call (they could not change).
            with self.assertRaises(specstate.SpecStateError) as cm:
                session.bind_verify_inputs(0, **h.inputs(0, 0, h.R * h.Q), o=h.o[0],
                                           query_start_loc=[0, 1], state_indices=[1])
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            # A binding does not keep its regions.
            session.unregister("meta")
            with self.assertRaises(specstate.SpecStateError) as cm:
                session.verify_bound(session.next_step(), 0, num_tokens=1, num_rows=1)
            self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION,
                             cm.exception.message)
            h.close()


class AlignModeTest(_ServerTest):
    FLAGS = dict(SMALL, blocks=40, activation_dtype="bf16", state_dtype="fp32",
                 cache_mode="align", mamba_block_size=4)

    def test_scheduler_loop_with_record_state_blocks(self) -> None:
        with self.server.client() as client, client.session("e2e-align", drive=True) as session:
            h = Harness(self, client, session, requests=3, seed=4)
            boundaries = 0
            for s in range(5):
                r = h.step(s, remap=s % 2 == 1, null_rows=(2,) if s == 3 else (),
                           full=s in (1, 4))
                boundaries += r["boundaries"]
            h.close()
            # mamba_block_size = Q: most steps cross a block boundary before their last token.
            self.assertGreater(boundaries, 0)


# The same loops on the other layer kinds. Each class starts its own server;
# the tests, seeds and tolerances are the KDA classes' (fp32 rounding is the
# same per operation, and GDN has fewer operations per element).


class PlainGateFp32Test(NoneModeFp32Test):
    """KDA with vLLM's plain gate, exp(-exp(A_log) softplus(g + dt_bias))."""

    FLAGS = dict(NoneModeFp32Test.FLAGS, kda_gate="plain")

    def test_layout_reports_the_plain_gate(self) -> None:
        with self.server.client() as client:
            lo = client.layout()
            self.assertEqual((lo.layer_kind, lo.kda_gate), (pb.KDA, pb.PLAIN_GATE))


class GatedDeltaNetFp32Test(NoneModeFp32Test):
    """Gated DeltaNet, 2 key heads and 4 value heads: the fp32 loop, async
    doorbells and bound inputs (inherited), and what the layout says."""

    FLAGS = dict(NoneModeFp32Test.FLAGS, **GDN)

    def test_layout_and_pool_shapes(self) -> None:
        with self.server.client() as client:
            lo = client.layout()
            self.assertEqual(lo.layer_kind, pb.GDN)
            self.assertEqual((lo.num_heads, lo.num_value_heads, lo.head_dim), (2, 4, 64))
            HV, K = lo.num_value_heads, lo.head_dim
            self.assertEqual(lo.state_block_bytes, HV * K * K * 4)  # fp32 [HV, V, K]
            pools = client.map_pools()
            try:
                for layer in range(lo.num_layers):
                    self.assertEqual(pools.recurrent(layer).shape, (lo.num_blocks, HV, K, K))
                    self.assertEqual(pools.conv(layer).shape,
                                     (lo.num_blocks, lo.conv_dim, lo.conv_width))
            finally:
                pools.close()

    def test_gate_parameters_are_refused(self) -> None:
        """GDN's g is the log-decay as the model computed it: no A_log or dt_bias."""
        rng = np.random.default_rng(6)
        with self.server.client() as client, client.session("e2e-gdn", drive=True) as session:
            lo = client.layout()
            with self.assertRaises(specstate.SpecStateError) as cm:
                session.load_layer_params(
                    0, rng.uniform(-2.0, 0.5, lo.num_heads).astype(np.float32),
                    rng.uniform(-1.0, 1.0, lo.num_heads * lo.head_dim).astype(np.float32))
            self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION,
                             cm.exception.message)
            self.assertIn("no gate parameters", cm.exception.message)


class GatedDeltaNetBf16Test(NoneModeBf16Test):
    FLAGS = dict(NoneModeBf16Test.FLAGS, **GDN)


class DeferredBf16Test(_ServerTest):
    """Commit mode DEFERRED: each Commit leaves the accepted tokens pending; the
    next step's Verify replays them (its outputs checked against the
    reference), or a Flush does (the states checked). (bf16 state: the kernel
    tests and the simulator, bit for bit against EAGER.)"""

    FLAGS = dict(SMALL, activation_dtype="bf16", state_dtype="fp32", cache_mode="none",
                 commit_mode="deferred")

    def test_scheduler_loop(self) -> None:
        with self.server.client() as client, client.session("e2e-deferred", drive=True) as session:
            h = Harness(self, client, session, requests=4, seed=5)
            self.assertTrue(h.deferred)
            flushes = (None, "blocks", None, None, "all", None)
            for s, flush in enumerate(flushes):
                h.step(s, remap=s % 2 == 1, null_rows=(2,) if s == 3 else (), flush=flush)
            h.close()
            self.assertEqual(client.stats().steps_failed, 0)


class DeferredAlignModeTest(_ServerTest):
    """DEFERRED in align mode: rows that cross a block boundary are replayed at
    Commit (their boundary state is real), the others are left pending."""

    FLAGS = dict(SMALL, activation_dtype="fp32", state_dtype="fp32", cache_mode="align",
                 mamba_block_size=4, commit_mode="deferred")

    def test_scheduler_loop(self) -> None:
        with self.server.client() as client, client.session("e2e-deferred-align",
                                                            drive=True) as session:
            h = Harness(self, client, session, requests=3, seed=6)
            boundaries = 0
            for s in range(6):
                r = h.step(s, flush="all" if s % 3 == 2 else None)
                boundaries += r["boundaries"]
                self.assertLess(r["max_out_err"], 1e-5)
            h.close()
            self.assertGreater(boundaries, 0, "no row crossed a block boundary")

    def test_flush_is_checked(self) -> None:
        with self.server.client() as client, client.session("e2e-flush", drive=True) as session:
            with self.assertRaises(specstate.SpecStateError) as e:
                session.flush([1, client.layout().num_blocks])
            self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
            self.assertIn("blocks[1]", e.exception.message)


class FastBf16Test(_ServerTest):
    """Commit mode FAST (fold_every 2: rings of 2 * Q tokens a block): a Commit
    appends the accepted tokens to the block's ring and writes no state until
    the ring folds; Verify's outputs come from the checkpoint and the ring.
    Against the float64 reference with this file's tolerances (FAST's
    contract, within 2x the exact path's error, sits well inside them: both
    paths are at a few fp32 ulps, docs/semantics.md): the outputs every step
    (through the rings), the states where they are materialized: at a fold,
    after a Flush of some blocks or of all, through ReadState. A block whose
    ring took tokens without folding holds its checkpoint."""

    FLAGS = dict(SMALL, activation_dtype="bf16", state_dtype="fp32", cache_mode="none",
                 commit_mode="fast", fold_every=2)

    def test_scheduler_loop(self) -> None:
        seed = int.from_bytes(os.urandom(4), "little")
        with self.server.client() as client, client.session("e2e-fast", drive=True) as session:
            lo = client.layout()
            self.assertEqual((lo.commit_mode, lo.fold_every), (pb.FAST, 2))
            h = Harness(self, client, session, requests=4, seed=seed)
            failed_before = client.stats().steps_failed  # (this server's other tests')
            flushes = (None, None, "blocks", None, "read", None, None, "all", None, None)
            folds = checked = 0
            for s, flush in enumerate(flushes):
                r = h.step(s, remap=s % 2 == 1, null_rows=(2,) if s == 3 else (), flush=flush)
                folds += r["folds"]
                checked += r["states_checked"]
            h.close()
            self.assertEqual(client.stats().steps_failed, failed_before)
            self.assertGreater(folds, 0, f"no ring folded at Commit (seed {seed})")
            self.assertGreater(checked, 0, f"no state was checked (seed {seed})")

    def test_rows_sharing_a_block_are_refused(self) -> None:
        with self.server.client() as client, client.session("e2e-fast-shared",
                                                            drive=True) as session:
            h = Harness(self, client, session, requests=2, seed=8)
            h.fill_inputs(0, 2)
            with self.assertRaises(specstate.SpecStateError) as cm:
                session.verify(session.next_step(), 0, **h.inputs(0, 0, 2), o=h.o[0][:2],
                               query_start_loc=[0, 1, 2],
                               state_indices=[h.checkpoint(0), h.checkpoint(0)])
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("rows 0 and 1 both verify from block", cm.exception.message)
            h.close()


class FastAlignModeTest(_ServerTest):
    """FAST in align mode: a row that leaves its block or crosses a block
    boundary stores real states at Commit (a block handed to the prefix cache
    is never a checkpoint with a ring), the others append to their ring."""

    FLAGS = dict(SMALL, blocks=40, activation_dtype="fp32", state_dtype="fp32",
                 cache_mode="align", mamba_block_size=4, commit_mode="fast", fold_every=3)

    def test_scheduler_loop(self) -> None:
        seed = int.from_bytes(os.urandom(4), "little")
        with self.server.client() as client, client.session("e2e-fast-align",
                                                            drive=True) as session:
            h = Harness(self, client, session, requests=3, seed=seed)
            boundaries = 0
            for s in range(8):
                r = h.step(s, remap=s % 2 == 1, full=s == 5,
                           flush="all" if s % 4 == 3 else "read" if s == 6 else None)
                boundaries += r["boundaries"]
                self.assertLess(r["max_out_err"], 1e-5, f"seed {seed}")
                self.assertLess(r["max_state_err"], 1e-5, f"seed {seed}")
            h.close()
            self.assertGreater(boundaries, 0, f"no row crossed a block boundary (seed {seed})")
            self.assertEqual(client.stats().steps_failed, 0)


class GatedDeltaNetAlignModeTest(AlignModeTest):
    """Align mode (boundary states, RecordStateBlocks) on Gated DeltaNet."""

    FLAGS = dict(AlignModeTest.FLAGS, **GDN)


if __name__ == "__main__":
    junit_runner.main()
