"""Speculative decoding through SpecState: prompt-lookup drafts, the prompts, the align
pass's plan, the requests, prefill in transformers, and the decode loop."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from .model import ExampleError, Geometry, cache_crop, cache_gdn_states, cache_length, sync
from .runner import KitRunner, Pools, _kit_module
from .verify_forward import Row, VerifyForward


def ngram_propose(seq: Sequence[int], k: int, max_n: int, min_n: int) -> List[int]:
    """Prompt lookup: for n = max_n .. min_n, the last n tokens' latest earlier occurrence
    in `seq` (prompt and output so far); the up to k tokens that followed it."""
    if k <= 0:
        return []
    s = np.asarray(seq, dtype=np.int64)
    L = len(s)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = s[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(s[:L - 1], n)  # starts 0 .. L-1-n
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        hits = hits[hits + n < L]  # something follows the match
        if len(hits):
            start = int(hits[-1]) + n
            return s[start:start + k].tolist()
    return []


def make_prompts(args: argparse.Namespace) -> List[List[int]]:
    """Seeded prompts with repeated phrases (what prompt lookup feeds on)."""
    rng = np.random.default_rng(args.seed + 1)
    prompts = []
    for _ in range(args.prompts):
        phrases = [rng.integers(1, args.vocab, rng.integers(3, 7)).tolist() for _ in range(3)]
        p: List[int] = []
        while len(p) < args.prompt_len:
            p += phrases[int(rng.integers(0, 3))] if rng.random() < 0.7 else \
                rng.integers(1, args.vocab, 2).tolist()
        prompts.append(p[:args.prompt_len])
    return prompts


def align_plan(args: argparse.Namespace, block_size: int, prompts: List[List[int]]) -> AlignPlan:
    prefix = args.align_prefix_blocks * block_size
    return AlignPlan(block_size=block_size, prefix_len=prefix,
                     first_prefill=max(1, prefix - args.num_spec - 2),
                     width=-(-(max(len(p) for p in prompts) + args.new_tokens) // block_size) + 1)


def make_align_prompts(args: argparse.Namespace, block_size: int) -> List[List[int]]:
    """Prompts that share their first align_prefix_blocks * block_size tokens, with tails of
    half a block to two blocks."""
    rng = np.random.default_rng(args.seed + 3)
    prefix_len = args.align_prefix_blocks * block_size
    base = make_prompts(argparse.Namespace(**{**vars(args), "prompts": 1,
                                              "prompt_len": prefix_len + 2 * block_size}))[0]
    prefix = base[:prefix_len]
    prompts = []
    for _ in range(args.prompts):
        tail = int(rng.integers(max(1, block_size // 2), 2 * block_size + 1))
        start = int(rng.integers(0, len(base) - 1))
        body = (base[start:] + rng.integers(1, args.vocab, tail).tolist())[:tail]
        prompts.append(prefix + body)
    return prompts


@dataclasses.dataclass
class Decoded:
    tokens: List[List[int]]
    logits: List[torch.Tensor]          # per request [new_tokens, vocab] (cpu), the row each token came from
    seconds: float
    states: List[Optional[List[torch.Tensor]]] = dataclasses.field(default_factory=list)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    reused: int = 0         # align pass: requests that started from the shared prefix's block
    probe_diff: float = 0.0  # max |logit diff| of the first verify step against transformers' decode



@dataclasses.dataclass
class AlignPlan:
    """The align-mode pass (``specstated --cache_mode=align``): every prompt starts with one
    shared prefix of ``prefix_len`` tokens (a whole number of ``block_size`` blocks).
    Request 0 prefills ``first_prefill`` tokens (fewer than the prefix) in transformers and
    the rest of its prompt through SpecState steps, whose Commit writes the prefix's
    boundary state into block-table column ``prefix_len / block_size - 1``. Each later
    request arrives after that, one a step: its attention KV for the prefix is request 0's
    (copied, cropped), its GDN state and conv window are that boundary block's (flushed,
    then copied into its own next block: the copy before writing, as vLLM's align mode
    does), and the rest of its prompt runs through SpecState steps too."""

    block_size: int
    prefix_len: int
    first_prefill: int
    width: int  # block-table columns per request


@dataclasses.dataclass(eq=False)  # requests compare by identity
class Request:
    prompt: List[int]
    pending: List[int]                      # prompt tokens still to run through SpecState
    table: List[int]                        # its state blocks (none mode: one)
    ckpt: int = 0                           # the block its state is in (the Verify's index)
    computed: int = 0                       # tokens in that state (align: num_computed_tokens)
    cache: Any = None                       # transformers' cache: the full-attention KV
    out: List[int] = dataclasses.field(default_factory=list)
    logits: List[torch.Tensor] = dataclasses.field(default_factory=list)
    arrived: bool = False
    done: bool = False
    probe: Optional[torch.Tensor] = None    # transformers' own logits for its first decode step


def _prefill_in_transformers(model: Any, geo: Geometry, pools: Pools, req: Request,
                             tokens: List[int], block: int, device: torch.device) -> torch.Tensor:
    """transformers' own forward over `tokens`; each GDN layer's final conv window and state
    into `block`. Returns the last token's logits."""
    hl = geo.conv_kernel - 1
    out = model(input_ids=torch.tensor([tokens], device=device), use_cache=True)
    cache = out.past_key_values
    for i, d in enumerate(geo.gdn_layers):
        conv, rec = cache_gdn_states(cache, d)  # [D, kernel] (the last inputs), [HV, K, V]
        if conv.shape[-1] < hl:
            raise ExampleError(f"transformers' conv state has {conv.shape[-1]} columns, the conv "
                               f"needs {hl}")
        if conv.shape[0] != geo.conv_dim or tuple(rec.shape) != (geo.value_heads, geo.head_dim, geo.head_dim):
            raise ExampleError(f"layer {d}'s GDN cache: conv state {tuple(conv.shape)}, recurrent "
                               f"state {tuple(rec.shape)} per request; expected [{geo.conv_dim}, W] "
                               f"and [{geo.value_heads}, {geo.head_dim}, {geo.head_dim}]")
        pool_conv = pools.conv(i)
        pool_conv[block].zero_()
        pool_conv[block, :, :hl] = conv[:, -hl:].to(pool_conv.dtype)  # columns [0, hl): h_1..h_hl
        pools.recurrent(i)[block] = rec.transpose(-1, -2).to(torch.float32)  # [HV, V, K]: S[v, k]
    if cache_length(cache) != len(tokens):
        raise ExampleError(f"after a prefill of {len(tokens)} tokens the cache holds "
                           f"{cache_length(cache)}")
    req.cache = cache
    return out.logits[0, -1].float()


def _make_runner(client: Any, label: str, args: argparse.Namespace, rows: int, Q: int,
                 device: torch.device, block_table_width: int) -> Any:
    return KitRunner(_kit_module(), client, label, max_tokens=rows * Q, max_rows=rows,
                     device=device, block_table_width=block_table_width)


def spec_decode(model: Any, geo: Geometry, client: Any, prompts: List[List[int]], n: int,
                args: argparse.Namespace, device: torch.device, num_spec: int, label: str,
                align: Optional[AlignPlan] = None) -> Decoded:
    Q = num_spec + 1
    R = len(prompts)
    runner = _make_runner(client, label, args, R, Q, device, align.width if align else 0)
    pools = Pools(runner)
    fwd = VerifyForward(model, geo, pools)
    stats = Decoded([], [], 0.0)
    if align is None:  # block 0 is the null block
        reqs = [Request(p, [], [r + 1]) for r, p in enumerate(prompts)]
    else:
        reqs = [Request(p, [], list(range(1 + r * align.width, 1 + (r + 1) * align.width)))
                for r, p in enumerate(prompts)]
        m = align.prefix_len // align.block_size  # prefix blocks
        shared = reqs[0].table[m - 1]  # where request 0's Commit writes the prefix's boundary state
        for r in range(1, R):
            reqs[r].table[:m] = reqs[0].table[:m]
    final_states: List[Optional[List[torch.Tensor]]] = [None] * R
    try:
        sync(device)
        t0 = time.perf_counter()
        probe_seconds = 0.0
        # Prefill in transformers: every prompt (none mode), request 0's first tokens (align).
        for r, req in enumerate(reqs):
            if align is not None and r > 0:
                continue
            k = len(req.prompt) if align is None else align.first_prefill
            col = 0 if align is None else (k - 1) // align.block_size
            first = _prefill_in_transformers(model, geo, pools, req, req.prompt[:k], req.table[col],
                                             device)
            req.ckpt, req.computed, req.pending, req.arrived = req.table[col], k, req.prompt[k:], True
            if not req.pending:
                req.out.append(int(first.argmax()))
                req.logits.append(first.cpu())
                # transformers' own decode of that token, on a copy of its cache: the first
                # verify's logits for it must agree (a wrong state or conv layout shows here).
                p0 = time.perf_counter()
                probe = model(input_ids=torch.tensor([[req.out[0]]], device=device),
                              past_key_values=copy.deepcopy(req.cache), use_cache=True)
                req.probe = probe.logits[0, -1].float().cpu()
                probe_seconds += time.perf_counter() - p0  # not the decode's time
        sync(device)
        with fwd.installed_on_model():
            while not all(req.done for req in reqs):
                if align is not None:
                    _arrive(reqs, align, runner, pools, geo, shared, device, stats)
                active = [req for req in reqs if req.arrived and not req.done]
                rows, tokens, positions, drafts = [], [], [], []
                for req in active:
                    if req.pending:  # the rest of its prompt, Q tokens a step, all kept
                        window, d = req.pending[:Q], []
                    else:
                        k = min(num_spec, n - len(req.out) - 1)
                        d = ngram_propose(req.prompt + req.out, k, args.ngram_max, args.ngram_min)
                        window = [req.out[-1]] + d
                    past = cache_length(req.cache)
                    rows.append(Row(len(tokens), len(tokens) + len(window), req.ckpt, past, req.cache))
                    tokens += window
                    positions += list(range(past, past + len(window)))
                    drafts.append(d)
                step = runner.begin_step([row.start for row in rows] + [rows[-1].end],
                                         [row.block for row in rows])
                logits = fwd.logits(torch.tensor(tokens, device=device),
                                    torch.tensor(positions, device=device), rows, step)
                best = logits.argmax(-1).tolist()
                num_accepted, computed_before = [], [req.computed for req in active]
                for row, req, d in zip(rows, active, drafts):
                    if req.pending:
                        kept = row.end - row.start
                        req.pending = req.pending[kept:]
                        if not req.pending:  # the prompt's last token: its first new token
                            req.out.append(best[row.end - 1])
                            req.logits.append(logits[row.end - 1].cpu())
                    else:
                        if req.probe is not None:
                            _check_probe(req, logits[row.start].cpu(), args.tie_tol, stats)
                        a = 0
                        while a < len(d) and d[a] == best[row.start + a]:
                            a += 1
                        req.out += d[:a] + [best[row.start + a]]  # accepted drafts and the bonus
                        req.logits += [logits[row.start + j].cpu() for j in range(a + 1)]
                        kept = 1 + a  # the window's first token and a drafts
                        cache_crop(req.cache, row.past + kept)
                        stats.drafted += len(d)
                        stats.accepted += a
                    num_accepted.append(kept)
                    req.computed += kept
                if align is None:
                    step.commit(num_accepted)
                else:
                    table = torch.tensor([req.table for req in active], dtype=torch.int32)
                    step.commit(num_accepted, block_table=table,
                                num_computed_tokens=torch.tensor(computed_before, dtype=torch.int32))
                    cols = runner.record_state_blocks(step, idx_mapping=list(range(len(active))),
                                                      num_sampled=num_accepted,
                                                      num_computed_tokens=computed_before,
                                                      block_table_width=align.width)
                    for req, col in zip(active, cols):
                        want = min((req.computed - 1) // align.block_size, align.width - 1)
                        if col != want:
                            raise ExampleError(f"RecordStateBlocks put a request's state in column "
                                               f"{col}, its {req.computed} tokens say {want}")
                        req.ckpt = req.table[col]
                stats.steps += 1
                for r, req in enumerate(reqs):
                    if req in active and len(req.out) >= n:
                        req.done = True
                        runner.flush([req.ckpt])  # DEFERRED / FAST: make its state current
                        sync(device)
                        final_states[r] = [pools.recurrent(i)[req.ckpt].float().cpu().clone()
                                           for i in range(len(geo.gdn_layers))]
                        if align is None:
                            runner.free(req.table)
                        elif r > 0:  # its own blocks; request 0's (the prefix's) go last
                            runner.free([b for b in req.table if b not in reqs[0].table])
                        req.cache = None
            if align is not None:  # request 0's blocks, the shared prefix among them, last
                runner.free(reqs[0].table)
        sync(device)
        stats.seconds = time.perf_counter() - t0 - probe_seconds
    finally:
        pools.close()
        runner.close()
    stats.tokens = [req.out[:n] for req in reqs]
    stats.logits = [torch.stack(req.logits[:n]) for req in reqs]
    stats.states = final_states
    return stats


def _check_probe(req: Request, got: torch.Tensor, tol: float, stats: Decoded) -> None:
    """The first verify's logits for a request's first new token against transformers' own
    decode step from the same cache: what the prefill put into the SpecState block (the state
    transposed to [HV, V, K], the conv window's last inputs) must be what transformers uses."""
    diff = float((got - req.probe).abs().max())
    stats.probe_diff = max(stats.probe_diff, diff)
    req.probe = None
    if diff > tol:
        raise ExampleError(
            f"the first verify step's logits differ from transformers' own decode of the same "
            f"token by {diff:.3e} (> {tol:g}): the GDN state or conv window copied from "
            "transformers' cache is not laid out as assumed (recurrent state [B, HV, K, V] "
            "transposed to SpecState's [HV, V, K]; conv state's last kernel-1 columns = the last "
            "inputs), or the replaced kernels' arguments differ (see VerifyForward)")


def _arrive(reqs: List[Request], align: AlignPlan, runner: Any, pools: Pools, geo: Geometry,
            shared: int, device: torch.device, stats: Decoded) -> None:
    """Align pass: the next waiting request arrives once request 0's Commit has written the
    prefix's boundary state; it starts from that state (copied into its own block)."""
    first = reqs[0]
    if first.computed < align.prefix_len:
        return
    waiting = [req for req in reqs if not req.arrived]
    if not waiting:
        return
    req = waiting[0]
    m = align.prefix_len // align.block_size
    runner.flush([shared])  # DEFERRED / FAST: the boundary block's bytes current before the copy
    sync(device)
    own = req.table[m]
    for i in range(len(geo.gdn_layers)):
        pools.recurrent(i)[own] = pools.recurrent(i)[shared]
        pools.conv(i)[own] = pools.conv(i)[shared]
    cache = copy.deepcopy(first.cache)  # the prefix's attention KV (a prefix-cache hit)
    cache_crop(cache, align.prefix_len)
    req.cache, req.ckpt, req.computed = cache, own, align.prefix_len
    req.pending = req.prompt[align.prefix_len:]
    req.arrived = True
    stats.reused += 1
