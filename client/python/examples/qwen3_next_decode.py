#!/usr/bin/env python3
"""Qwen3-Next (transformers' own modules) decoding through SpecState, checked against generate.

A tiny random Qwen3-Next (``transformers.Qwen3NextForCausalLM``: Gated DeltaNet
linear-attention layers with their causal conv, gated full-attention layers,
sparse MoE and dense MLPs; fp32 weights, seeded) decodes 8 prompts with
speculative decoding while its GDN layers' conv windows and recurrent states
live in specstated's pools:

* prefill: the prompt runs through the model in transformers' own way; each
  GDN layer's final conv window and recurrent state are copied from
  transformers' cache into the request's SpecState block;
* decode: prompt-lookup (n-gram) drafts; one packed verify forward over every
  request's ``[last token + drafts]`` in which the full-attention layers use
  each request's transformers KV cache (cropped after acceptance) and every
  GDN layer runs its own module (projections, gating, gated norm, out
  projection) with its two kernels replaced: the causal conv update runs on
  the SpecState conv pool (docs/semantics.md's window contract) and the
  recurrence is SpecState's Verify; greedy acceptance, then Commit;
* check: transformers' own greedy ``generate`` on the same weights must give
  the same tokens (``--new_tokens`` per prompt); where a token differs, the
  two top logits are printed to show a near-tie; each request's final
  recurrent states must equal generate's (``--state_tol``);
* align pass (``--cache_mode=align``): prompts share a prefix; request 0's
  Commit writes the prefix's block-boundary state, and every later request
  starts from that block instead of prefilling the prefix (AlignPlan).

The SpecState side goes through ``specstate.kit`` (``Runner``: one SubmitStep
a step, doorbells; ``StatePools``); client/python/examples/scheduler_loop.py shows
the plain client's loop.

The code is in the package next to this script, qwen3_next/: model (transformers
glue), server (specstated's flags, layout check), runner (the kit's step I/O and
pools), verify_forward (the packed verify forward with the GDN module's two kernels
replaced), decode (drafts, requests, prefill, spec_decode), check (generate, the
comparison, the memory report). This file parses the flags and runs the passes.

    # the flags of a specstated that matches the model (needs no transformers):
    python3 client/python/examples/qwen3_next_decode.py --print_server_flags --cache_mode=none,align
    # start one per pass, decode, compare, stop it:
    PYTHONPATH=client/python python3 client/python/examples/qwen3_next_decode.py \\
        --start_server=bazel-bin/server/specstated --device=cuda \\
        --commit_mode=eager,deferred,fast --cache_mode=none,align --check
    # or against a running one (its commit and cache modes are read from GetLayout):
    python3 client/python/examples/qwen3_next_decode.py --server=unix:///tmp/s.sock --device=cuda

Needs torch, transformers (with Qwen3-Next), numpy and the specstate client
(client/python, stubs generated). ``--device=cuda`` needs a specstated on the
CUDA backend of the same GPU; ``--device=cpu`` one on the CPU backend.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, List, Optional, Tuple

# The kit's ASYNC steps park torch's stream on the service's doorbells: CUDA's lazy module
# loading could then synchronize the context on a kernel's first launch (client/python/README.md).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

try:
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    sys.exit("this example needs torch (pip install torch)")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # the qwen3_next package next to this script
if os.path.isdir(os.path.join(_HERE, "..", "specstate")):
    sys.path.append(os.path.abspath(os.path.join(_HERE, "..")))  # client/python, after PYTHONPATH

from qwen3_next.check import (  # noqa: E402
    compare, gib, memory_report, reference_generate, state_errors)
from qwen3_next.decode import Decoded, align_plan, make_align_prompts, make_prompts, spec_decode  # noqa: E402
from qwen3_next.model import ExampleError, Geometry, build_model, config_kwargs  # noqa: E402
from qwen3_next.runner import _kit_module  # noqa: E402
from qwen3_next.server import StartedServer, check_layout, server_flags  # noqa: E402


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", help="a running specstated (unix:///PATH or HOST:PORT)")
    where.add_argument("--start_server", metavar="PATH",
                       help="start this specstated binary on a temporary Unix socket (one per "
                       "--commit_mode) and stop it at the end")
    p.add_argument("--print_server_flags", action="store_true",
                   help="print the specstated command for this model and exit")
    p.add_argument("--commit_mode", default="",
                   help="eager, deferred or fast; with --start_server a comma-separated list runs "
                   "one pass each; with --server it must match the server's (GetLayout), empty: "
                   "whatever the server runs")
    p.add_argument("--cache_mode", default="none",
                   help="none, align or none,align (with --start_server: one pass each; align: "
                   "prompts sharing a prefix whose boundary state SpecState's Commit writes and "
                   "later requests reuse); with --server: the server's")
    p.add_argument("--mamba_block_size", type=int, default=16,
                   help="align pass: tokens per state block (>= num_spec + 1)")
    p.add_argument("--align_prefix_blocks", type=int, default=2,
                   help="align pass: the shared prefix, in blocks")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=48)
    p.add_argument("--new_tokens", type=int, default=512)
    p.add_argument("--num_spec", type=int, default=3, help="drafts per step (specstated --num_spec)")
    p.add_argument("--ngram_max", type=int, default=4)
    p.add_argument("--ngram_min", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="exit non-zero when a token differs from generate's where the two top "
                   "logits are not a near-tie")
    p.add_argument("--tie_tol", type=float, default=1e-3,
                   help="a difference is a near-tie when both sides' top-two logit gaps are within this")
    p.add_argument("--state_tol", type=float, default=1e-4,
                   help="--check also fails when a final recurrent state differs from generate's "
                   "by more than this (relative to its largest element)")
    p.add_argument("--attn_implementation", default="eager", choices=["eager", "sdpa"])
    g = p.add_argument_group("the tiny model")
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--full_attention_interval", type=int, default=4)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--intermediate", type=int, default=512)
    g.add_argument("--vocab", type=int, default=384)
    g.add_argument("--attn_heads", type=int, default=4)
    g.add_argument("--attn_kv_heads", type=int, default=2)
    g.add_argument("--attn_head_dim", type=int, default=64)
    g.add_argument("--gdn_key_heads", type=int, default=2)
    g.add_argument("--gdn_value_heads", type=int, default=4)
    g.add_argument("--gdn_head_dim", type=int, default=64, help="64, 128 or 256 (specstated's head dims)")
    g.add_argument("--conv_kernel", type=int, default=4)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--experts_per_tok", type=int, default=2)
    g.add_argument("--moe_intermediate", type=int, default=128)
    g.add_argument("--mlp_only_layers", type=lambda s: [int(x) for x in s.split(",") if x], default=[0, 5],
                   help="layers with the dense MLP (the others: sparse MoE)")
    g.add_argument("--max_positions", type=int, default=4096)
    g.add_argument("--init_std", type=float, default=0.02)
    g.add_argument("--embed_scale", type=float, default=6.0,
                   help="multiply the random token embeddings by this (see build_model)")
    g.add_argument("--router_scale", type=float, default=10.0,
                   help="multiply the MoE routers' random weights by this (see build_model)")
    g.add_argument("--decay_range", type=lambda s: tuple(float(x) for x in s.split(",")) if s else None,
                   default=(0.02, 0.5), metavar="LO,HI",
                   help="redraw each GDN head's A = exp(A_log) from U(LO, HI) (empty: keep "
                   "transformers' U(0, 16), whose heads forget their state within a token or two)")
    args = p.parse_args(argv)
    if args.num_spec < 0 or args.prompts < 1 or args.new_tokens < 2:
        p.error("--num_spec >= 0, --prompts >= 1, --new_tokens >= 2")
    if args.mamba_block_size < args.num_spec + 1 or args.align_prefix_blocks < 1:
        p.error("--mamba_block_size >= num_spec + 1, --align_prefix_blocks >= 1")
    for c in args.cache_mode.split(","):
        if c.strip() and c.strip() not in ("none", "align"):
            p.error(f"--cache_mode {c!r}: none or align")
    return args



def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    modes = [m.strip().lower() for m in args.commit_mode.split(",") if m.strip()]
    for m in modes:
        if m not in ("eager", "deferred", "fast"):
            raise ExampleError(f"--commit_mode {m!r}: eager, deferred or fast")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExampleError("--device=cuda but torch sees no GPU")
    # fp32 throughout: no TF32 in matmuls or in cuDNN's conv (both paths would round alike,
    # but the near-ties this example explains would come from TF32, not from SpecState).
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)

    if args.print_server_flags:
        geo = Geometry.of(argparse.Namespace(**config_kwargs(args)))  # the config's fields
        backend = "cuda" if device.type == "cuda" else "cpu"
        for c in [c.strip() for c in args.cache_mode.split(",") if c.strip()] or ["none"]:
            align = None
            if c == "align":
                align = align_plan(args, args.mamba_block_size,
                                   make_align_prompts(args, args.mamba_block_size))
            for m in modes or ["eager"]:
                print("bazel-bin/server/specstated " + " ".join(server_flags(geo, args, m, backend, align))
                      + " --listen=unix:///tmp/specstate-qwen3-next.sock")
        return 0
    if not args.server and not args.start_server:
        raise ExampleError("give --server=ADDRESS (a running specstated) or --start_server=PATH "
                           "(or --print_server_flags)")
    if args.server and len(modes) > 1:
        raise ExampleError("--server runs one commit mode (the server's): give at most one")

    import specstate  # noqa: PLC0415
    from specstate import pb  # noqa: PLC0415

    model = build_model(args, device)
    geo = Geometry.of(model.config)
    import transformers  # noqa: PLC0415
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {device}; "
          f"{type(model).__name__}: {args.layers} layers ({len(geo.gdn_layers)} Gated DeltaNet "
          f"{geo.gdn_layers}, {len(geo.attn_layers)} full attention {geo.attn_layers}), "
          f"GDN H={geo.heads} HV={geo.value_heads} K=V={geo.head_dim} conv {geo.conv_dim}x"
          f"{geo.conv_kernel}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M fp32 "
          f"parameters, seed {args.seed}")
    _kit_module()  # needs specstate.kit: its Runner and StatePools
    print("specstate I/O: specstate.kit")
    total = args.prompts * args.new_tokens
    references: Dict[int, Tuple[List[List[int]], Decoded]] = {}  # by block size (0: none mode)

    def reference(block_size: int) -> Tuple[List[List[int]], Decoded]:
        """transformers' greedy generate on the pass's prompts (once per prompt set)."""
        if block_size not in references:
            ps = make_align_prompts(args, block_size) if block_size else make_prompts(args)
            what = (f"prompts sharing a {args.align_prefix_blocks * block_size}-token prefix"
                    if block_size else "prompts")
            print(f"reference: transformers' greedy generate, {args.prompts} {what} x "
                  f"{args.new_tokens} new tokens, one request at a time ...", flush=True)
            r = reference_generate(model, ps, args.new_tokens, device)
            print(f"  generate: {total / r.seconds:.1f} tokens/s ({r.seconds:.2f} s)")
            references[block_size] = (ps, r)
        return references[block_size]

    failed = False
    cache_modes = [c.strip().lower() for c in args.cache_mode.split(",") if c.strip()] or ["none"]
    if args.start_server:
        passes = [(m, c) for c in cache_modes for m in (modes or ["eager"])]
    else:
        passes = [(modes[0] if modes else "", "")]  # the server's cache mode
    for mode, cache_mode in passes:
        with contextlib.ExitStack() as stack:
            align = None
            backend = "cuda" if device.type == "cuda" else "cpu"
            if args.start_server:
                if cache_mode == "align":
                    align = align_plan(args, args.mamba_block_size,
                                       make_align_prompts(args, args.mamba_block_size))
                flags = server_flags(geo, args, mode, backend, align)
                srv = stack.enter_context(StartedServer(args.start_server, flags))
                address = srv.address
                print(f"\nstarted: {' '.join(srv.cmd)}")
            else:
                address = args.server
            client = specstate.Client(address)
            stack.callback(client.close)
            lo = client.layout()
            if align is None and pb.CacheMode.Name(lo.cache_mode) == "ALIGN":
                align = align_plan(args, lo.mamba_block_size,
                                   make_align_prompts(args, lo.mamba_block_size))
            served = check_layout(lo, geo, args, device, align)
            if mode and served != mode.upper():
                raise ExampleError(f"--commit_mode={mode} but the server at {address} runs {served}")
            if args.num_spec > lo.num_spec:
                raise ExampleError(f"--num_spec={args.num_spec} drafts, the server's num_spec is "
                                   f"{lo.num_spec}")
            pass_prompts, pass_ref = reference(align.block_size if align else 0)
            print(f"\n== commit mode {served}, cache mode {pb.CacheMode.Name(lo.cache_mode)} "
                  f"({address}; num_spec {args.num_spec}"
                  + (f"; blocks of {align.block_size} tokens, a shared prefix of "
                     f"{align.prefix_len}" if align else "") + ") ==")
            got = spec_decode(model, geo, client, pass_prompts, args.new_tokens, args, device,
                              args.num_spec, f"qwen3_next_decode {served.lower()}", align)
            v = compare(pass_ref, got, args.tie_tol)
            rate = v.matched / v.total
            print(f"  SpecState spec decode: {total / got.seconds:.1f} tokens/s ({got.seconds:.2f} s, "
                  f"{got.steps} steps, {total / max(got.steps, 1):.2f} tokens a step across "
                  f"{args.prompts} requests); generate: {total / pass_ref.seconds:.1f} tokens/s")
            if align is not None:
                print(f"  prefix reuse: request 0's Commit wrote the state after the shared "
                      f"{align.prefix_len}-token prefix into its block-table column "
                      f"{align.prefix_len // align.block_size - 1}; {got.reused} requests started "
                      "from it (flushed, copied into their own next block) and ran only their "
                      "own tokens: none of them prefilled the prefix")
            if align is None:
                print(f"  first decode step of every request against transformers' own decode "
                      f"step from the same cache: max |logit diff| {got.probe_diff:.2e}")
            print(f"  acceptance: {got.accepted} of {got.drafted} drafts "
                  f"({100.0 * got.accepted / max(got.drafted, 1):.1f}%)")
            print(f"  agreement with generate: {v.matched} of {v.total} tokens ({100 * rate:.2f}%) "
                  f"equal before any difference; {args.prompts - v.near_ties - v.failures} of "
                  f"{args.prompts} requests identical over all {args.new_tokens} tokens, "
                  f"{v.near_ties} diverged at a near-tie, {v.failures} elsewhere")
            for line in v.lines:
                print(line)
            hv = lo.num_value_heads or lo.num_heads
            one = lo.num_layers * args.prompts * hv * lo.head_dim * lo.head_dim * 4
            print(f"  recurrent states of these {args.prompts} requests: stock spec path "
                  f"{gib((1 + lo.num_spec) * one)} ((1 + num_spec) per request per GDN layer), "
                  f"SpecState {gib(one)} (one) + {gib(lo.record_bytes)} of record scratch "
                  f"(Layout.record_bytes, for max_rows {lo.max_rows})")
            err = state_errors(pass_ref, got)
            if err is not None:
                bad = err > args.state_tol
                print(f"  final recurrent states against generate's (requests with every token "
                      f"equal): max |diff| / max |state| = {err:.2e}"
                      + (f": ABOVE --state_tol {args.state_tol:g}" if bad else ""))
                failed = failed or bad
            if v.failures:
                failed = True
    print("\nrecurrent-state memory (fp32):")
    for line in memory_report(geo, args.prompts, args.num_spec):
        print(line)
    if failed and args.check:
        print("FAIL: a token differs from generate's where the top two logits are not a near-tie, "
              "or a final state differs beyond --state_tol")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ExampleError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
