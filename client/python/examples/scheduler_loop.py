#!/usr/bin/python3
"""A small decode loop driving specstated from Python (CPU backend, numpy).

    bazel-bin/server/specstated --listen=unix:///tmp/x.sock &
    client/python/generate_stubs.sh            # once, outside Bazel
    PYTHONPATH=client/python /usr/bin/python3 client/python/examples/scheduler_loop.py \\
        --server=unix:///tmp/x.sock

Per step, for every request row: the scheduler's causal-conv1d update runs in
place on the row's block of the exported conv pool (docs/semantics.md's contract:
columns [h_1..h_hl] become [h_2..h_hl, x_0..x_{T-1}]), its output gives q, k, v;
Verify runs every layer; the "sampler" accepts a prefix of each row's tokens;
Commit folds the accepted tokens into every layer's state. The shapes come
from GetLayout: KDA layers (gate parameters loaded once, g [T, H, K]) or
Gated DeltaNet ones (--kind=gdn: HV value heads, g and beta [T, HV] computed
by the "model" each step, no parameters to load).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import specstate
from specstate.v1 import specstate_pb2 as pb


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="unix:///tmp/specstate.sock")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    client = specstate.Client(args.server)
    lo = client.layout()
    if lo.backend != pb.CPU:
        print("this example uses numpy on the CPU backend; the service runs CUDA", file=sys.stderr)
        return 2
    L, H, K, D = lo.num_layers, lo.num_heads, lo.head_dim, lo.conv_dim
    gdn = lo.layer_kind == pb.GDN
    HV = lo.num_value_heads or H  # value heads: v, beta, o, the state (and GDN's g)
    Q, hl = lo.num_spec + 1, lo.conv_kernel - 1
    R = min(args.requests, lo.max_rows, lo.num_blocks - 1)
    HK, HVK, act = H * K, HV * K, lo.activation_dtype
    g_shape = (HV,) if gdn else (H, K)  # per token
    act_np = specstate.dtypes.numpy_dtype(act)  # bf16 -> uint16 bits
    print(f"specstated at {args.server}: {L} {pb.LayerKind.Name(lo.layer_kind)} layers, H={H}, "
          f"HV={HV}, K={K}, D={D}, Q={Q}, "
          f"{specstate.dtypes.name(act)} activations, {specstate.dtypes.name(lo.state_dtype)} "
          f"state, cache mode {pb.CacheMode.Name(lo.cache_mode)}")
    if lo.cache_mode != pb.NONE:
        print("this example runs none mode (one block per request)", file=sys.stderr)
        return 2

    pools = client.map_pools()  # numpy views of the service's pools
    with client.session("scheduler_loop example", drive=True) as session:
        print(f"session {session.id}: driving={session.driving}, lease {session.lease_ms} ms")
        # KDA's gate parameters live in the service; GDN's gating runs in the model.
        a_log = [rng.uniform(-2, 0.5, HV if gdn else H).astype(np.float32) for _ in range(L)]
        dt_bias = [rng.uniform(-1, 1, HV if gdn else HK).astype(np.float32) for _ in range(L)]
        if not gdn:
            for layer in range(L):
                session.load_layer_params(layer, a_log[layer], dt_bias[layer])
        conv_weight = [rng.uniform(-0.5, 0.5, (D, lo.conv_kernel)) for _ in range(L)]

        # The scheduler's shared buffers: activations per layer, registered once.
        tmax = R * Q
        per_layer = tmax * (2 * HK + 2 * HVK + int(np.prod(g_shape)) + HV) * act_np.itemsize
        per_layer += 6 * 256
        buf = specstate.SharedBuffer(L * per_layer)
        session.register(buf, "activations")
        def per_layer_arrays(shape: tuple) -> list:
            return [buf.empty(shape, act_np) for _ in range(L)]

        q, k = (per_layer_arrays((tmax, H, K)) for _ in range(2))
        v, o = (per_layer_arrays((tmax, HV, K)) for _ in range(2))
        g, beta = per_layer_arrays((tmax,) + g_shape), per_layer_arrays((tmax, HV))

        # "Prefill": each request's block holds a state and a conv history.
        blocks = list(range(1, R + 1))
        for layer in range(L):
            for b in blocks:
                pools.recurrent(layer)[b] = specstate.dtypes.to_numpy_values(
                    rng.uniform(-0.1, 0.1, (HV, K, K)), lo.state_dtype)
                pools.conv(layer)[b] = 0
                pools.conv(layer)[b][:, :hl] = specstate.dtypes.to_numpy_values(
                    rng.uniform(-1, 1, (D, hl)), act)

        for _ in range(args.steps):
            tokens = rng.integers(1, Q + 1, R)
            qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
            T = int(qsl[-1])
            step = session.next_step()
            started = time.perf_counter()
            for layer in range(L):
                x_all = rng.uniform(-1, 1, (T, D))  # the in-projection of the hidden states
                y_all = np.zeros((T, D))
                for n, b in enumerate(blocks):
                    a, e = int(qsl[n]), int(qsl[n + 1])
                    conv = pools.conv(layer)[b]  # [D, W], in place
                    hist = specstate.dtypes.as_float32(np.array(conv[:, :hl]), act)
                    window = np.concatenate([hist, x_all[a:e].T], axis=1)  # [D, hl + T_n]
                    for t in range(e - a):
                        y_all[a + t] = silu((window[:, t:t + hl + 1] * conv_weight[layer]).sum(1))
                    # The contract: [h_2..h_hl, x_0..x_{T-1}] from column 0.
                    conv[:, :hl - 1 + e - a] = specstate.dtypes.to_numpy_values(
                        window[:, 1:], act)
                # q, k, v from the conv output (the first 2*H*K + HV*V channels, cycled if
                # D is smaller).
                width = 2 * HK + HVK
                qkv = np.resize(y_all, (T, width)) if D < width else y_all[:, :width]
                for dst, a, e, heads in ((q, 0, HK, H), (k, HK, 2 * HK, H), (v, 2 * HK, width, HV)):
                    dst[layer][:T] = specstate.dtypes.to_numpy_values(
                        qkv[:, a:e].reshape(T, heads, K), act)
                if gdn:  # the model's gating (vLLM's fused_gdn_gating): log-decay, strength
                    a_in = rng.uniform(-3, 3, (T, HV)) + dt_bias[layer]
                    softplus = np.where(a_in > 20, a_in, np.log1p(np.exp(np.minimum(a_in, 20))))
                    gate = -np.exp(a_log[layer]) * softplus
                    strength = 1.0 / (1.0 + np.exp(-rng.uniform(-3, 3, (T, HV))))
                else:  # the gate's input and beta's logit: the service applies both
                    gate, strength = rng.uniform(-3, 1, (T, H, K)), rng.uniform(-3, 3, (T, H))
                g[layer][:T] = specstate.dtypes.to_numpy_values(gate, act)
                beta[layer][:T] = specstate.dtypes.to_numpy_values(strength, act)
                session.verify(step, layer, q=q[layer][:T], k=k[layer][:T], v=v[layer][:T],
                               g=g[layer][:T], beta=beta[layer][:T], o=o[layer][:T],
                               query_start_loc=qsl.tolist(), state_indices=blocks)
            verified = time.perf_counter()
            out = specstate.dtypes.as_float32(o[L - 1][:T], act)
            accepted = [int(rng.integers(1, t + 1)) for t in tokens]  # the sampler
            result = session.commit(step, accepted)
            committed = time.perf_counter()
            norms = [client.read_state(0, b).recurrent.l2_norm for b in blocks]
            print(f"step {step}: {R} rows, tokens {tokens.tolist()}, accepted {accepted}; "
                  f"verify x{L} {1e3 * (verified - started):.1f} ms (last layer |o| = "
                  f"{np.linalg.norm(out):.3f}), commit of {result.num_layers} layers "
                  f"{1e3 * (committed - verified):.1f} ms; layer-0 state norms "
                  f"{', '.join(f'{x:.3f}' for x in norms)}")
        stats = client.stats()
        print(f"service: {stats.steps_committed} steps committed, {stats.tokens_verified} tokens "
              f"verified, {stats.steps_failed} failed")
    pools.close()
    buf.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
