#!/usr/bin/python3
"""Speculative decoding of a small KDA model in torch, its state in SpecState.

    bazel-bin/server/specstated --listen=unix:///tmp/x.sock --layers=2 --heads=2 \\
        --head_dim=64 --conv_dim=384 --num_spec=3 --activation_dtype=fp32 --state_dtype=fp32 &
    PYTHONPATH=client/python /usr/bin/python3 client/python/examples/kda_decode.py \\
        --server=unix:///tmp/x.sock --check

The model (tiny random weights, fp32, seeded): an embedding; per layer a KDA
linear-attention block as Kimi Linear builds it (q/k/v projections, a short
causal depthwise conv over q|k|v with SiLU, so conv_dim = 3 * H * K; the KDA
gate g from a low-rank projection and beta a logit; the recurrence; an
output gate with a per-head RMSNorm; the output projection) and a SwiGLU MLP;
a final norm and the LM head. Shapes come from GetLayout (layers, H, K,
conv_kernel, num_spec); the service's activation dtype must be fp32.

The speculative path (the engine through specstate.kit): each request has
its own state block; its recurrent state and conv window live only in
SpecState's pools (the kit's StatePools: the conv update runs in place on
them). A prompt enters through the same path, Q tokens a step, all accepted.
Then every step each request verifies [last token, drafts...] where the
drafts are prompt lookup's (the continuation of the latest earlier match of
the context's last n-gram, n = 3..1), greedy verification accepts the drafts
that equal the model's argmax, and Commit keeps the accepted tokens' state.
A finished request frees its block (runner.free: Flush discard under
DEFERRED / FAST) and the next request starts in it.

The reference: the same model decoding greedily one token at a time, every
request in one batch, with its own float32 recurrence written from
docs/semantics.md's per-token math (no speculation, no SpecState).

--check exits 1 when a token differs and the reference's two candidates are
not a near-tie (logit gap above --tie_tol), or when the logits a token came
from differ from the reference's by more than --logit_tol (1e-3; fp32
rounding gives ~1e-5, a stale or wrong state far more); 0 otherwise. --json
writes the tokens and the numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

# Before torch touches CUDA: on the CUDA backend this process's stream waits on
# the service's doorbells, and lazy module loading could then deadlock
# (client/python/README.md, "lazy module loading").
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

import specstate  # noqa: E402
from specstate import kit  # noqa: E402
from specstate.v1 import specstate_pb2 as pb  # noqa: E402

GIB = float(1 << 30)


# ---------------------------------------------------------------------------
# The model: every part but the recurrence, shared by both paths.

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class TinyKda:
    """Random fp32 weights for `layers` KDA blocks of H heads of dim K."""

    def __init__(self, lo: pb.Layout, vocab: int, hidden: int, seed: int,
                 device: torch.device) -> None:
        self.L, self.H, self.K = lo.num_layers, lo.num_heads, lo.head_dim
        self.kernel, self.hl = lo.conv_kernel, lo.conv_kernel - 1
        self.lower_bound = lo.lower_bound
        self.plain_gate = lo.kda_gate == pb.PLAIN_GATE
        self.vocab, self.hidden = vocab, hidden
        HK, d, rank = self.H * self.K, hidden, 16
        gen = torch.Generator().manual_seed(seed)

        def w(*shape: int, scale: Optional[float] = None) -> torch.Tensor:
            s = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            return (torch.randn(*shape, generator=gen) * s).to(device)

        self.embed = w(vocab, d, scale=1.0)
        self.layers = []
        for _ in range(self.L):
            self.layers.append({
                "norm": 1.0 + 0.1 * w(d, scale=1.0), "wq": w(d, HK), "wk": w(d, HK),
                "wv": w(d, HK),
                "conv": w(3 * HK, self.kernel, scale=0.5),   # depthwise, tap kernel-1 = newest
                "f_a": w(d, rank), "f_b": w(rank, HK), "wb": w(d, self.H),
                # Gates that keep a memory (decays mostly 0.6 to 0.99 a token), so
                # that a wrong state shows in tokens generated long after it.
                "a_log": (torch.rand(self.H, generator=gen) * 1.5 - 1.0).to(device),
                "dt_bias": (torch.rand(HK, generator=gen) * 4.0 - 6.0).to(device),
                "g_a": w(d, rank), "g_b": w(rank, HK), "o_norm": 1.0 + 0.1 * w(self.K, scale=1.0),
                "wo": w(HK, d),
                "mlp_norm": 1.0 + 0.1 * w(d, scale=1.0), "w1": w(d, 2 * d), "w3": w(d, 2 * d),
                "w2": w(2 * d, d)})
        self.final_norm = 1.0 + 0.1 * w(d, scale=1.0)
        # Partly tied to the embedding: a slight bias to repeat, so greedy decoding
        # falls into loops that prompt lookup predicts (pure noise would accept little).
        self.lm_head = w(d, vocab) + 0.03 * self.embed.t()

    def projections(self, layer: int, h: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Conv input x [T, 3HK] (q|k|v before the conv), g [T, H, K], beta [T, H] and
        the output gate [T, H, K] of normed hidden states h [T, d]."""
        p, T = self.layers[layer], h.shape[0]
        x = torch.cat([h @ p["wq"], h @ p["wk"], h @ p["wv"]], dim=-1)
        g = ((h @ p["f_a"]) @ p["f_b"]).view(T, self.H, self.K)
        beta = h @ p["wb"]
        gate = torch.sigmoid((h @ p["g_a"]) @ p["g_b"]).view(T, self.H, self.K)
        return x, g, beta, gate

    def conv(self, layer: int, history: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """SiLU of the causal depthwise conv of each row's x [N, T, D] after its
        `history` [N, D, hl] (the hl inputs before x_0, oldest first) -> [N, T, D]."""
        seq = torch.cat([history, x.transpose(1, 2)], dim=2)          # [N, D, hl + T]
        windows = seq.unfold(2, self.kernel, 1)                        # [N, D, T, kernel]
        y = (windows * self.layers[layer]["conv"][None, :, None, :]).sum(-1)
        return torch.nn.functional.silu(y.transpose(1, 2))

    def split_qkv(self, y: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        T, HK = y.shape[0], self.H * self.K
        return tuple(y[:, i * HK:(i + 1) * HK].reshape(T, self.H, self.K) for i in range(3))

    def finish_layer(self, layer: int, x: torch.Tensor, o: torch.Tensor,
                     gate: torch.Tensor) -> torch.Tensor:
        """The block's output gate, norm, out projection and MLP on the residual x."""
        p, T = self.layers[layer], x.shape[0]
        o = rms_norm(o, p["o_norm"]) * gate
        x = x + o.reshape(T, self.H * self.K) @ p["wo"]
        h = rms_norm(x, p["mlp_norm"])
        return x + (torch.nn.functional.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.final_norm) @ self.lm_head


# ---------------------------------------------------------------------------
# The reference recurrence (docs/semantics.md, "The per-token step"), float32.

def reference_token(model: TinyKda, layer: int, S: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token of every request: S [R, H, V, K] updated in place; q, k, v, g
    [R, H, K]; beta [R, H]. Returns o [R, H, V]."""
    p, K = model.layers[layer], model.K
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a = torch.exp(p["a_log"])[None, :, None]
    x = g + p["dt_bias"].view(model.H, K)[None]
    if model.plain_gate:
        softplus = torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))
        decay = torch.exp(-a * softplus)
    else:
        decay = torch.exp(model.lower_bound * torch.sigmoid(a * x))
    S.mul_(decay[:, :, None, :])                                     # per column j
    u = (v - torch.einsum("rhvk,rhk->rhv", S, k)) * torch.sigmoid(beta)[..., None]
    S.add_(u[..., :, None] * k[..., None, :])
    return torch.einsum("rhvk,rhk->rhv", S, q)


def reference_decode(model: TinyKda, prompts: List[List[int]], tokens: int,
                     device: torch.device) -> Tuple[List[List[int]], List[torch.Tensor], float]:
    """Greedy decoding, one token at a time, all requests in one batch (equal
    prompt lengths). Returns the tokens, each request's logits [tokens, vocab]
    and the seconds the generation took (prompt included)."""
    R, L, H, K, D = len(prompts), model.L, model.H, model.K, 3 * model.H * model.K
    S = [torch.zeros(R, H, K, K, device=device) for _ in range(L)]
    hist = [torch.zeros(R, D, model.hl, device=device) for _ in range(L)]
    seq = torch.tensor(prompts, device=device)
    out = [[] for _ in range(R)]
    logits_out: List[List[torch.Tensor]] = [[] for _ in range(R)]
    _sync(device)
    start = time.perf_counter()

    def forward(tok: torch.Tensor) -> torch.Tensor:
        x = model.embed[tok]                                           # [R, d]
        for l in range(L):
            p = model.layers[l]
            h = rms_norm(x, p["norm"])
            xin, g, beta, gate = model.projections(l, h)
            y = model.conv(l, hist[l], xin[:, None, :])[:, 0]
            hist[l] = torch.cat([hist[l][:, :, 1:], xin[:, :, None]], dim=2)
            q, k, v = model.split_qkv(y)
            o = reference_token(model, l, S[l], q, k, v, g, beta)
            x = model.finish_layer(l, x, o, gate)
        return model.logits(x)

    logits = None
    for t in range(seq.shape[1]):
        logits = forward(seq[:, t])
    for _ in range(tokens):
        nxt = logits.argmax(-1)
        for r in range(R):
            out[r].append(int(nxt[r]))
            logits_out[r].append(logits[r].detach().clone())
        logits = forward(nxt)
    _sync(device)
    return out, [torch.stack(x) for x in logits_out], time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# The speculative path through SpecState.

def prompt_lookup(context: List[int], k: int, max_ngram: int = 3) -> List[int]:
    """Up to k drafts: what followed an earlier occurrence of the context's last
    n-gram (n = max_ngram down to 1): the latest occurrence followed by k
    tokens, else the one followed by the most; none when nothing matches."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), 0, -1):
        tail, best = context[n_ctx - n:], []
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + k]
                if len(follow) == k:
                    return follow
                if len(follow) > len(best):
                    best = follow
        if best:
            return best
    return []


class Request:
    def __init__(self, index: int, prompt: List[int]) -> None:
        self.index = index
        self.prompt = prompt
        self.fed = 0                 # prompt tokens in the state
        self.out: List[int] = []     # generated tokens
        self.logits: List[torch.Tensor] = []  # the logits each generated token came from
        self.block = 0


def speculative_decode(model: TinyKda, runner: kit.Runner, pools: kit.StatePools,
                       prompts: List[List[int]], tokens: int,
                       slots: int) -> Tuple[List[Request], Dict[str, float]]:
    """Continuous batching over `slots` state blocks (1..slots); see the module docstring."""
    lo, device = runner.layout, runner.device
    Q, L, hl = lo.num_spec + 1, lo.num_layers, model.hl
    for layer in range(L):
        p = model.layers[layer]
        runner.load_layer_params(layer, p["a_log"], p["dt_bias"])
    waiting = [Request(i, p) for i, p in enumerate(prompts)]
    free_blocks = list(range(slots, 0, -1))
    active: List[Request] = []
    done: List[Request] = []
    stats = {"steps": 0, "drafted": 0, "accepted_drafts": 0, "decode_rows": 0}
    _sync(device)
    start = time.perf_counter()
    while waiting or active:
        while waiting and free_blocks:                      # admit: a fresh state block
            req = waiting.pop(0)
            req.block = free_blocks.pop()
            for layer in range(L):
                pools.recurrent(layer)[req.block].zero_()
                pools.conv(layer)[req.block].zero_()
            active.append(req)
        # Each row's window: a prompt chunk, or [last token, drafts...].
        windows, drafts = [], []
        for req in active:
            if req.fed < len(req.prompt):
                windows.append(req.prompt[req.fed:req.fed + Q])
                drafts.append(None)
            else:
                d = prompt_lookup(req.prompt + req.out, min(Q - 1, tokens - len(req.out)))
                windows.append([req.out[-1]] + d)
                drafts.append(d)
        lens = [len(w) for w in windows]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        blocks = [req.block for req in active]
        T, N, width = qsl[-1], len(active), max(lens)
        step = runner.begin_step(qsl, blocks, num_tokens=T)
        tok = torch.tensor([t for w in windows for t in w], device=device)
        # Token t of the step is row row_of[t], position col_of[t] of its window.
        row_of = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)], device=device)
        col_of = torch.tensor([j for n in lens for j in range(n)], device=device)
        block_of = torch.tensor(blocks, device=device)
        x = model.embed[tok]
        for layer in range(L):
            p = model.layers[layer]
            h = rms_norm(x, p["norm"])
            xin, g, beta, gate = model.projections(layer, h)
            # The causal-conv update of every row at once, in the pool
            # (docs/semantics.md): [h_1..h_hl] -> [h_2..h_hl, x_0..x_{T-1}] from
            # column 0. Columns past a row's tokens get the padding's zeros,
            # which no Commit reads (it keeps the window ending at an accepted token).
            conv = pools.conv(layer)                          # [blocks, D, W]
            history = conv[block_of, :, :hl]                  # [N, D, hl] (a copy)
            padded = xin.new_zeros(N, width, xin.shape[1])
            padded[row_of, col_of] = xin
            y = model.conv(layer, history, padded)[row_of, col_of]
            conv[block_of, :, :hl - 1 + width] = torch.cat(
                [history[:, :, 1:], padded.transpose(1, 2)], dim=2)
            q, k, v = model.split_qkv(y)
            o = step.verify(layer, q, k, v, g, beta)
            x = model.finish_layer(layer, x, o, gate)
        logits = model.logits(x)
        argmax = logits.argmax(-1).tolist()
        accepted = []
        for i, req in enumerate(active):
            a = qsl[i]
            if drafts[i] is None:                            # prefill chunk: all of it
                req.fed += lens[i]
                accepted.append(lens[i])
                if req.fed == len(req.prompt):
                    req.out.append(argmax[a + lens[i] - 1])
                    req.logits.append(logits[a + lens[i] - 1])
                continue
            d, m = drafts[i], 0
            while m < len(d) and argmax[a + m] == d[m]:
                m += 1
            stats["drafted"] += len(d)
            stats["accepted_drafts"] += m
            stats["decode_rows"] += 1
            for j in range(m + 1):                           # the matches and the bonus token
                req.out.append(argmax[a + j])
                req.logits.append(logits[a + j])
            accepted.append(1 + m)
        step.commit(accepted)
        stats["steps"] += 1
        for req in list(active):
            if len(req.out) >= tokens:
                req.out, req.logits = req.out[:tokens], req.logits[:tokens]
                runner.free([req.block])                     # DEFERRED / FAST: Flush discard
                free_blocks.append(req.block)
                active.remove(req)
                done.append(req)
    _sync(device)
    stats["seconds"] = time.perf_counter() - start
    return sorted(done, key=lambda r: r.index), stats


# ---------------------------------------------------------------------------

def make_prompts(count: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    """Prompts that repeat: a random phrase of 4 to 8 tokens, repeated (with a
    token changed here and there) to `length` tokens."""
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = []
    for _ in range(count):
        n = int(torch.randint(4, 9, (1,), generator=gen))
        phrase = torch.randint(0, vocab, (n,), generator=gen).tolist()
        p = (phrase * (length // n + 1))[:length]
        for _ in range(length // 12):
            p[int(torch.randint(0, length, (1,), generator=gen))] = int(
                torch.randint(0, vocab, (1,), generator=gen))
        prompts.append(p)
    return prompts


def memory_report(lo: pb.Layout, requests: int) -> List[str]:
    kimi = pb.Layout(num_layers=20, num_heads=32, head_dim=128, num_spec=lo.num_spec,
                     state_dtype=pb.FP32)
    lines = []
    for label, layout, n in (("this layout", lo, requests), ("Kimi-Linear-48B-A3B (20 KDA "
                             "layers, H=32, K=V=128, fp32 state)", kimi, 256)):
        m = kit.state_memory_bytes(layout, n)
        lines.append(f"recurrent state, {label}, {n} requests, num_spec {layout.num_spec}: "
                     f"stock spec path {m['stock'] / GIB:.4f} GiB ((1 + num_spec) states a "
                     f"request a layer), SpecState {m['specstate'] / GIB:.4f} GiB (one)"
                     + (f" + {m['specstate_records'] / GIB:.4f} GiB records"
                        if layout is lo else ""))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="unix:///tmp/specstate.sock")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--prompt_len", type=int, default=24)
    parser.add_argument("--slots", type=int, default=0,
                        help="requests decoded at once, each in its own state block (0: as many "
                        "as the layout's max_rows and blocks allow); the others wait for a "
                        "finished request's block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ordering", choices=("async", "sync"), default="async")
    parser.add_argument("--tie_tol", type=float, default=1e-3,
                        help="logit gap under which a differing token is a near-tie")
    parser.add_argument("--logit_tol", type=float, default=1e-3,
                        help="--check: the largest |logit difference| allowed where the tokens "
                        "agree (fp32 rounding gives ~1e-5; a wrong state far more)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 on a differing token that is not a near-tie, or on logits "
                        "off by more than --logit_tol where the tokens agree")
    parser.add_argument("--json", help="write the tokens and the numbers here")
    args = parser.parse_args(argv)

    client = specstate.Client(args.server)
    lo = client.layout()
    H, K = lo.num_heads, lo.head_dim
    if lo.layer_kind != pb.KDA:
        print("kda_decode: the service runs Gated DeltaNet layers; start it with --kind=kda",
              file=sys.stderr)
        return 2
    if lo.conv_dim != 3 * H * K:
        print(f"kda_decode: conv_dim is {lo.conv_dim}; this model convolves q|k|v: start "
              f"specstated with --conv_dim={3 * H * K} (3 * heads * head_dim)", file=sys.stderr)
        return 2
    if lo.activation_dtype != pb.FP32:
        print("kda_decode: the model is fp32: start specstated with --activation_dtype=fp32",
              file=sys.stderr)
        return 2
    slots = min(args.requests, lo.max_rows, lo.num_blocks - 1)
    if args.slots > 0:
        slots = min(slots, args.slots)
    pools = kit.StatePools(client)
    device = pools.device
    print(f"specstated at {args.server}: {pb.Backend.Name(lo.backend)} backend, "
          f"{lo.num_layers} KDA layers, H={H}, K={K}, conv {lo.conv_dim}x{lo.conv_kernel}, "
          f"num_spec {lo.num_spec}, commit mode {pb.CommitMode.Name(lo.commit_mode)}, "
          f"state {specstate.dtypes.name(lo.state_dtype)}; torch {torch.__version__} on {device}")
    model = TinyKda(lo, args.vocab, args.hidden, args.seed, device)
    prompts = make_prompts(args.requests, args.prompt_len, args.vocab, args.seed)

    Q = lo.num_spec + 1
    with torch.no_grad(), kit.Runner(client, "kda-decode", max_tokens=slots * Q, max_rows=slots,
                                     ordering=args.ordering) as runner:
        done, stats = speculative_decode(model, runner, pools, prompts, args.tokens, slots)
        ref_tokens, ref_logits, ref_seconds = reference_decode(model, prompts, args.tokens,
                                                               device)
    pools.close()
    client.close()

    # Compare: the first differing token of each request, and whether it is a near-tie.
    failures, ties, compared, max_logit_diff = 0, 0, 0, 0.0
    for req in done:
        want = ref_tokens[req.index]
        for t, (got, exp) in enumerate(zip(req.out, want)):
            rl = ref_logits[req.index][t]
            if got == exp:
                compared += 1
                diff = float((req.logits[t].to(rl.device) - rl).abs().max())
                max_logit_diff = max(max_logit_diff, diff)
                continue
            gap = float(rl[exp] - rl[got])
            tie = gap <= args.tie_tol * max(1.0, float(rl[exp].abs()))
            print(f"request {req.index}, token {t}: speculative {got}, reference {exp}: "
                  f"reference logits {float(rl[exp]):.6f} vs {float(rl[got]):.6f} (gap "
                  f"{gap:.2e}): {'a near-tie' if tie else 'NOT a near-tie'}; the rest of "
                  "this request is not compared")
            ties += tie
            failures += not tie
            break
    total = args.requests * args.tokens
    drafted = max(stats["drafted"], 1)
    print(f"speculative (SpecState, {args.ordering}): {total} tokens in {stats['seconds']:.3f} s "
          f"= {total / stats['seconds']:.1f} tokens/s, {stats['steps']} steps; acceptance "
          f"{stats['accepted_drafts']}/{stats['drafted']} drafts = "
          f"{stats['accepted_drafts'] / drafted:.3f}, "
          f"{(stats['accepted_drafts'] + stats['decode_rows']) / max(stats['decode_rows'], 1):.2f}"
          " tokens per decode row")
    print(f"reference (one token at a time): {total} tokens in {ref_seconds:.3f} s = "
          f"{total / ref_seconds:.1f} tokens/s")
    for line in memory_report(lo, slots):
        print(line)
    print(f"tokens equal: {compared} of {total} compared, max |logit difference| "
          f"{max_logit_diff:.2e}; near-ties {ties}, mismatches {failures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": [r.out for r in done], "reference": ref_tokens,
                       "mismatches": failures, "near_ties": ties, "compared": compared,
                       "max_logit_diff": max_logit_diff, "steps": stats["steps"],
                       "drafted": stats["drafted"], "accepted_drafts": stats["accepted_drafts"],
                       "commit_mode": pb.CommitMode.Name(lo.commit_mode),
                       "backend": pb.Backend.Name(lo.backend)}, f)
    if args.check and failures:
        print(f"FAIL: {failures} requests differ from the reference beyond a near-tie")
        return 1
    if args.check and max_logit_diff > args.logit_tol:
        print(f"FAIL: logits off by {max_logit_diff:.2e} where the tokens agree (--logit_tol "
              f"{args.logit_tol:g})")
        return 1
    print("PASS" if args.check else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
