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
a step, doorbells; ``StatePools``), or the plain client with ``--no_kit``.

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
import copy
import dataclasses
import inspect
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

# The kit's ASYNC steps park torch's stream on the service's doorbells: CUDA's lazy module
# loading could then synchronize the context on a kernel's first launch (client/python/README.md).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - depends on the machine
    sys.exit("this example needs torch (pip install torch)")

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.isdir(os.path.join(_HERE, "..", "specstate")):
    sys.path.append(os.path.abspath(os.path.join(_HERE, "..")))  # client/python, after PYTHONPATH


class ExampleError(RuntimeError):
    """Something this example relies on is not as it expects (named in the message)."""


# ---------------------------------------------------------------------------
# The model: a tiny Qwen3-Next built from transformers' own classes.

def _transformers():
    try:
        import transformers  # noqa: PLC0415
    except ImportError as e:
        raise ExampleError(f"this example needs transformers with Qwen3-Next: {e}") from None
    for name in ("Qwen3NextConfig", "Qwen3NextForCausalLM"):
        if not hasattr(transformers, name):
            raise ExampleError(f"transformers {transformers.__version__} has no {name} "
                               "(Qwen3-Next arrived in transformers 4.57)")
    return transformers


def layer_types_of(args: argparse.Namespace) -> List[str]:
    """Qwen3-Next's pattern: every `full_attention_interval`-th layer is full attention."""
    return ["full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention"
            for i in range(args.layers)]


def config_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The tiny model's Qwen3NextConfig fields (only fields every version has)."""
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        layer_types=layer_types_of(args),
        num_attention_heads=args.attn_heads,
        num_key_value_heads=args.attn_kv_heads,
        head_dim=args.attn_head_dim,
        linear_conv_kernel_dim=args.conv_kernel,
        linear_key_head_dim=args.gdn_head_dim,
        linear_value_head_dim=args.gdn_head_dim,  # SpecState has V = K
        linear_num_key_heads=args.gdn_key_heads,
        linear_num_value_heads=args.gdn_value_heads,
        num_experts=args.experts,
        num_experts_per_tok=args.experts_per_tok,
        moe_intermediate_size=args.moe_intermediate,
        shared_expert_intermediate_size=args.moe_intermediate,
        decoder_sparse_step=1,
        mlp_only_layers=list(args.mlp_only_layers),  # these get the dense MLP
        norm_topk_prob=True,
        max_position_embeddings=args.max_positions,
        initializer_range=args.init_std,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_cache=True,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,  # never stop early: every request decodes --new_tokens
    )


@dataclasses.dataclass
class Geometry:
    """What specstated's layout must say, from the model's config."""

    gdn_layers: List[int]     # decoder-layer index of SpecState layer i
    attn_layers: List[int]
    heads: int                # linear_num_key_heads (H)
    value_heads: int          # linear_num_value_heads (HV)
    head_dim: int             # linear_key_head_dim == linear_value_head_dim (K = V)
    conv_dim: int             # 2 * H * K + HV * V: the GDN conv's channels
    conv_kernel: int

    @staticmethod
    def of(config: Any) -> "Geometry":
        types = list(config.layer_types)
        gdn = [i for i, t in enumerate(types) if t == "linear_attention"]
        attn = [i for i, t in enumerate(types) if t == "full_attention"]
        others = sorted(set(types) - {"linear_attention", "full_attention"})
        if others:
            raise ExampleError(f"config.layer_types has {others}: this example knows "
                               "linear_attention and full_attention")
        if config.linear_key_head_dim != config.linear_value_head_dim:
            raise ExampleError(
                f"linear_key_head_dim {config.linear_key_head_dim} != linear_value_head_dim "
                f"{config.linear_value_head_dim}: SpecState's state blocks are [HV, V, K] with V = K")
        h, hv, k = config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim
        if hv % h:
            raise ExampleError(f"linear_num_value_heads {hv} is not a multiple of "
                               f"linear_num_key_heads {h}")
        return Geometry(gdn, attn, h, hv, k, 2 * h * k + hv * k, config.linear_conv_kernel_dim)


def _accepted_config_kwargs(cls: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The kwargs this version's Qwen3NextConfig knows (its dataclass fields in transformers
    >= 5; 4.x takes everything); the MoE/dense choice per layer as mlp_layer_types where a
    version names it so. Fields it lacks are left at its defaults, and said so."""
    if not dataclasses.is_dataclass(cls):
        return kwargs  # 4.x: explicit parameters and **kwargs for PretrainedConfig's own
    known = {f.name for f in dataclasses.fields(cls)}
    out = {k: v for k, v in kwargs.items() if k in known}
    if "mlp_only_layers" not in known and "mlp_layer_types" in known:
        out["mlp_layer_types"] = ["dense" if i in kwargs["mlp_only_layers"] else "sparse"
                                  for i in range(kwargs["num_hidden_layers"])]
    dropped = sorted(set(kwargs) - known - {"mlp_only_layers"} if "mlp_layer_types" in out
                     else set(kwargs) - known)
    if dropped:
        print(f"note: this transformers' {cls.__name__} has no {', '.join(dropped)}: left at "
              "its defaults")
    return out


def build_model(args: argparse.Namespace, device: torch.device) -> Any:
    tf = _transformers()
    torch.manual_seed(args.seed)
    config = tf.Qwen3NextConfig(**_accepted_config_kwargs(tf.Qwen3NextConfig, config_kwargs(args)))
    # The verify forward passes its own additive masks (one per request, see
    # _attention_forward): eager and sdpa take them; flash attention would not.
    if args.attn_implementation not in ("eager", "sdpa"):
        raise ExampleError("--attn_implementation must be eager or sdpa")
    config._attn_implementation = args.attn_implementation
    model = tf.Qwen3NextForCausalLM(config)
    model.to(device=device, dtype=torch.float32).eval()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != args.attn_implementation:
        raise ExampleError(f"asked for attn_implementation {args.attn_implementation!r}, "
                           f"the model runs {impl!r}")
    if args.embed_scale != 1.0:
        # Scales the token embeddings: the residual stream then leans on the current token,
        # and greedy decoding falls into the cycles prompt lookup predicts (a random model's
        # context alone gives a few percent acceptance), while the layers still decide some.
        model.model.embed_tokens.weight.data.mul_(args.embed_scale)
    if args.router_scale != 1.0:
        # Sharper MoE routing: with transformers' 0.02 router weights the 2nd and 3rd experts'
        # probabilities can lie within the fp32 noise between two forwards of one token (a
        # batch of one in generate, a packed window here), and a flipped expert moves that
        # token's hidden state far past a near-tie. Scaled weights keep the choice robust.
        for layer in model.model.layers:
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "weight"):
                gate.weight.data.mul_(args.router_scale)
    if args.decay_range:
        # transformers draws A = exp(A_log) from U(0, 16): with dt_bias = 1 most heads then keep
        # exp(-A softplus(a + 1)) ~ e^-10 of their state per token and forget it at once, which
        # would hide a wrong state. A from U(lo, hi) keeps a memory of tens to hundreds of tokens.
        lo, hi = args.decay_range
        gen = torch.Generator().manual_seed(args.seed + 2)
        for d in Geometry.of(model.config).gdn_layers:
            m = model.model.layers[d].linear_attn
            a = torch.empty(m.A_log.shape, dtype=torch.float32).uniform_(lo, hi, generator=gen)
            m.A_log.data.copy_(a.log().to(m.A_log.device))
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise ExampleError(f"transformers' initialization left non-finite values in {name}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def decoder_layers(model: Any) -> Sequence[Any]:
    inner = getattr(model, "model", None)
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, attr):
            raise ExampleError(f"Qwen3NextForCausalLM.model has no {attr!r}: the verify forward "
                               "drives model.model's embed_tokens, layers, rotary_emb and norm")
    if not hasattr(model, "lm_head"):
        raise ExampleError("Qwen3NextForCausalLM has no lm_head")
    return inner.layers


# ---------------------------------------------------------------------------
# transformers' cache: the GDN states after prefill, and the attention KV.

def cache_gdn_states(cache: Any, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(conv window [D, W_tf], recurrent state [HV, K, V]) of batch row 0 of decoder layer
    `layer_idx`: transformers >= 5 keeps them on cache.layers[i] (LinearAttentionLayer),
    4.57's Qwen3NextDynamicCache in cache.conv_states[i] / cache.recurrent_states[i]."""
    layers = getattr(cache, "layers", None)
    conv = rec = None
    if layers is not None and layer_idx < len(layers) and hasattr(layers[layer_idx], "recurrent_states"):
        conv, rec = layers[layer_idx].conv_states, layers[layer_idx].recurrent_states
    elif hasattr(cache, "recurrent_states") and hasattr(cache, "conv_states"):
        conv, rec = cache.conv_states[layer_idx], cache.recurrent_states[layer_idx]
    else:
        raise ExampleError(f"{type(cache).__name__} keeps layer {layer_idx}'s GDN states neither "
                           "in .layers[i].conv_states/.recurrent_states nor in "
                           ".conv_states[i]/.recurrent_states[i]")
    if not torch.is_tensor(conv) or not torch.is_tensor(rec):
        raise ExampleError(f"layer {layer_idx}'s GDN cache holds no tensors after prefill "
                           f"(conv {type(conv).__name__}, recurrent {type(rec).__name__})")
    return conv[0], rec[0]


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def cache_crop(cache: Any, length: int) -> None:
    """Drops the attention KV of rejected drafts (the GDN entries are not used while decoding)."""
    done = False
    crop = getattr(cache, "crop", None)
    if crop is not None:
        try:
            crop(length)
            done = True
        except (NotImplementedError, AttributeError):
            done = False
    if not done:
        for attr in ("key_cache", "value_cache"):
            tensors = getattr(cache, attr, None)
            if tensors is None:
                raise ExampleError(f"{type(cache).__name__} has neither crop() nor key_cache/value_cache")
            for i, t in enumerate(tensors):
                if torch.is_tensor(t) and t.dim() == 4 and t.shape[-2] > length:
                    tensors[i] = t[..., :length, :]
    if cache_length(cache) != length:
        raise ExampleError(f"{type(cache).__name__}.crop({length}) left {cache_length(cache)} tokens")


# ---------------------------------------------------------------------------
# specstated: the flags that match the model, and starting one.

def server_flags(geo: Geometry, args: argparse.Namespace, commit_mode: str, backend: str,
                 align: Optional[AlignPlan] = None) -> List[str]:
    flags = [
        "--kind=gdn",
        f"--layers={len(geo.gdn_layers)}",
        f"--heads={geo.heads}",
        f"--value_heads={geo.value_heads}",
        f"--head_dim={geo.head_dim}",
        f"--conv_dim={geo.conv_dim}",
        f"--conv_kernel={geo.conv_kernel}",
        f"--num_spec={args.num_spec}",
        "--activation_dtype=fp32",
        "--state_dtype=fp32",
        f"--max_rows={args.prompts}",
        f"--blocks={max(64, 1 + args.prompts * (align.width if align else 1))}",
        f"--commit_mode={commit_mode}",
        f"--backend={backend}",
    ]
    if align is not None:
        flags += ["--cache_mode=align", f"--mamba_block_size={align.block_size}"]
    return flags


class StartedServer:
    """A specstated of our own on a temporary Unix socket, stopped (SIGTERM) on exit."""

    def __init__(self, binary: str, flags: List[str], timeout: float = 60.0) -> None:
        import specstate  # noqa: PLC0415
        self.dir = tempfile.mkdtemp(prefix="qwen3-next-specstate-")
        self.address = f"unix://{self.dir}/specstate.sock"
        self.log_path = os.path.join(self.dir, "specstated.log")
        self.cmd = [binary] + flags + [f"--listen={self.address}"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise ExampleError(f"specstated exited with {self.proc.returncode}: "
                                   f"{' '.join(self.cmd)}\n{self.log()}")
            if os.path.exists(f"{self.dir}/specstate.sock"):
                try:
                    c = specstate.Client(self.address, connect_timeout=1.0)
                    serving = c.health() == "SERVING"
                    c.close()
                    if serving:
                        break
                except specstate.SpecStateError:
                    pass
            if time.time() > deadline:
                self.close()
                raise ExampleError(f"specstated did not serve within {timeout:g} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-4000:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "StartedServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_layout(lo: Any, geo: Geometry, args: argparse.Namespace, device: torch.device,
                 align: Optional[AlignPlan]) -> str:
    """Refuses a service whose layout does not hold this model's GDN layers; returns its
    commit mode's name."""
    from specstate import pb  # noqa: PLC0415
    hv = lo.num_value_heads or lo.num_heads
    want = [
        ("layer_kind", pb.LayerKind.Name(lo.layer_kind), "GDN", "--kind=gdn"),
        ("num_layers", lo.num_layers, len(geo.gdn_layers), f"--layers={len(geo.gdn_layers)}"),
        ("num_heads", lo.num_heads, geo.heads, f"--heads={geo.heads}"),
        ("num_value_heads", hv, geo.value_heads, f"--value_heads={geo.value_heads}"),
        ("head_dim", lo.head_dim, geo.head_dim, f"--head_dim={geo.head_dim}"),
        ("conv_dim", lo.conv_dim, geo.conv_dim, f"--conv_dim={geo.conv_dim}"),
        ("conv_kernel", lo.conv_kernel, geo.conv_kernel, f"--conv_kernel={geo.conv_kernel}"),
        ("activation_dtype", pb.DType.Name(lo.activation_dtype), "FP32", "--activation_dtype=fp32"),
        ("backend", pb.Backend.Name(lo.backend), "CUDA" if device.type == "cuda" else "CPU",
         f"--backend={'cuda' if device.type == 'cuda' else 'cpu'} (or --device to match)"),
    ]
    bad = [f"{field} is {got}, the model needs {need} ({flag})"
           for field, got, need, flag in want if got != need]
    if lo.max_rows < args.prompts:
        bad.append(f"max_rows is {lo.max_rows}, {args.prompts} requests decode together "
                   f"(--max_rows={args.prompts})")
    need = 1 + args.prompts * (align.width if align else 1)
    if lo.num_blocks < need:
        bad.append(f"num_blocks is {lo.num_blocks}: {args.prompts} requests need {need} with the "
                   f"null block (--blocks={need})")
    if align is None and pb.CacheMode.Name(lo.cache_mode) != "NONE":
        bad.append("cache_mode is ALIGN where this pass decodes one block per request (none mode)")
    if align is not None:
        if pb.CacheMode.Name(lo.cache_mode) != "ALIGN":
            bad.append("cache_mode is NONE where the align pass needs --cache_mode=align")
        elif lo.mamba_block_size != align.block_size:
            bad.append(f"mamba_block_size is {lo.mamba_block_size}, the pass plans "
                       f"{align.block_size} (--mamba_block_size={align.block_size})")
    if bad:
        raise ExampleError("specstated's layout does not match the model:\n  " + "\n  ".join(bad))
    if pb.DType.Name(lo.state_dtype) != "FP32":
        print(f"note: the service keeps {pb.DType.Name(lo.state_dtype)} states: "
              "expect more near-ties against generate's fp32 ones")
    return pb.CommitMode.Name(lo.commit_mode)


# ---------------------------------------------------------------------------
# SpecState's step I/O: specstate.kit when it is there, else the plain client.

class _PlainStep:
    def __init__(self, runner: "PlainRunner", query_start_loc: List[int], state_indices: List[int]):
        self.runner = runner
        self.id = runner.session.next_step()
        self.qsl = [int(x) for x in query_start_loc]
        self.state_indices = [int(x) for x in state_indices]
        self.first = True

    def verify(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        r, T = self.runner, q.shape[0]
        if T > r.max_tokens:
            raise ExampleError(f"{T} tokens in a step, the buffers hold {r.max_tokens}")
        for dst, src in ((r.q, q), (r.k, k), (r.v, v), (r.g, g), (r.beta, beta)):
            dst[:T].copy_(src)
        if r.device.type == "cuda":
            torch.cuda.synchronize(r.device)  # SYNC ordering: inputs complete when we call
        kwargs = {}
        if self.first:
            kwargs = dict(query_start_loc=self.qsl, state_indices=self.state_indices)
            self.first = False
        r.session.verify(self.id, layer, q=r.q[:T], k=r.k[:T], v=r.v[:T], g=r.g[:T],
                         beta=r.beta[:T], o=r.o[:T], num_rows=len(self.state_indices), **kwargs)
        return r.o[:T]

    def commit(self, num_accepted: Sequence[int], block_table: Optional[torch.Tensor] = None,
               num_computed_tokens: Optional[torch.Tensor] = None) -> Any:
        kwargs = {}
        if block_table is not None:  # align mode: inline int32 values
            kwargs = dict(block_table=block_table.tolist(),
                          num_computed_tokens=num_computed_tokens.tolist())
        return self.runner.session.commit(self.id, [int(x) for x in num_accepted], **kwargs)


class PlainRunner:
    """The same calls as KitRunner on the plain client (``--no_kit``): a driving session and
    fp32 activation buffers registered once (shared memory on the CPU backend, cudaMalloc'd
    device memory on CUDA), reused by every layer's SYNC Verify."""

    def __init__(self, client: Any, name: str, *, max_tokens: int, max_rows: int,
                 device: torch.device) -> None:
        import specstate  # noqa: PLC0415
        lo = client.layout()
        H, HV, K = lo.num_heads, lo.num_value_heads or lo.num_heads, lo.head_dim
        self.device, self.max_tokens, self.max_rows = device, max_tokens, max_rows
        shapes = [("q", (max_tokens, H, K)), ("k", (max_tokens, H, K)),
                  ("v", (max_tokens, HV, K)), ("o", (max_tokens, HV, K)),
                  ("g", (max_tokens, HV)), ("beta", (max_tokens, HV))]
        ints = [("state_idx_out", (max_rows,)), ("num_accepted_out", (max_rows,))]  # RecordStateBlocks
        nbytes = sum(4 * int(np.prod(s)) + 256 for _, s in shapes + ints)
        if device.type == "cuda":
            from specstate.cuda import CudaBuffer  # noqa: PLC0415
            self.buffer = CudaBuffer(nbytes, device.index or 0)
            for n, s in shapes:
                setattr(self, n, self.buffer.empty(s, torch.float32))
            for n, s in ints:
                setattr(self, n, self.buffer.empty(s, torch.int32))
        else:
            self.buffer = specstate.SharedBuffer(nbytes)
            for n, s in shapes:
                setattr(self, n, torch.from_numpy(self.buffer.empty(s, np.float32)))
            for n, s in ints:
                setattr(self, n, self.buffer.empty(s, np.int32))
        self.session = client.session(name, drive=True)
        self.session.register(self.buffer, "qwen3-next-acts")

    def begin_step(self, query_start_loc: Sequence[int], state_indices: Sequence[int]) -> _PlainStep:
        return _PlainStep(self, list(query_start_loc), list(state_indices))

    def flush(self, blocks: Sequence[int], discard: bool = False) -> None:
        self.session.flush([int(b) for b in blocks], discard=discard)

    def record_state_blocks(self, step: _PlainStep, *, idx_mapping: Sequence[int],
                            num_sampled: Sequence[int], num_computed_tokens: Sequence[int],
                            block_table_width: int) -> List[int]:
        n = len(idx_mapping)
        self.session.record_state_blocks(
            step.id, idx_mapping=list(idx_mapping), num_sampled=list(num_sampled),
            num_computed_tokens=list(num_computed_tokens), block_table_width=block_table_width,
            state_idx=self.state_idx_out[:n], num_accepted=self.num_accepted_out[:n])
        return [int(x) for x in self.state_idx_out[:n].tolist()]

    def free(self, blocks: Sequence[int]) -> None:
        # DEFERRED / FAST: a freed block's pending tokens (or ring) must not reach the
        # next request that gets it. EAGER: nothing is pending, Flush succeeds.
        self.flush(blocks, discard=True)

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            self.buffer.close()


class KitRunner:
    """specstate.kit's Runner (ASYNC: one SubmitStep a step, doorbells) behind the calls
    spec_decode makes: begin_step (whose Step has verify and commit), flush, free,
    record_state_blocks, close."""

    def __init__(self, kit: Any, client: Any, name: str, *, max_tokens: int, max_rows: int,
                 device: torch.device, block_table_width: int = 0) -> None:
        self.runner = kit.Runner(client, name, max_tokens=max_tokens, max_rows=max_rows,
                                 device=device, block_table_width=block_table_width)

    def begin_step(self, query_start_loc: Sequence[int], state_indices: Sequence[int]) -> Any:
        return self.runner.begin_step(list(query_start_loc), list(state_indices))

    def flush(self, blocks: Sequence[int], discard: bool = False) -> None:
        self.runner.flush(list(blocks), discard=discard)

    def free(self, blocks: Sequence[int]) -> None:
        self.runner.free(list(blocks))

    def record_state_blocks(self, step: Any, *, idx_mapping: Sequence[int], num_sampled: Sequence[int],
                            num_computed_tokens: Sequence[int], block_table_width: int) -> List[int]:
        state_idx, _ = self.runner.record_state_blocks(
            step, idx_mapping=list(idx_mapping), num_sampled=list(num_sampled),
            num_computed_tokens=list(num_computed_tokens), block_table_width=block_table_width)
        return [int(x) for x in state_idx.tolist()]

    def close(self) -> None:
        self.runner.close()


def _kit_module() -> Optional[Any]:
    try:
        from specstate import kit  # noqa: PLC0415
    except ImportError:
        return None
    needed = ("Runner", "StatePools")
    if not all(hasattr(kit, n) for n in needed):
        return None
    return kit


class Pools:
    """The service's recurrent and conv pools as torch tensors ([blocks, HV, V, K], [blocks, D, W]):
    the kit Runner's StatePools, or the plain client's mapping (numpy views on the CPU backend)."""

    def __init__(self, client: Any, runner: Any) -> None:
        self._kit = runner.runner.pools if isinstance(runner, KitRunner) else None
        self._mapped = None if self._kit is not None else client.map_pools()
        self._cache: Dict[Tuple[str, int], torch.Tensor] = {}

    def _get(self, kind: str, layer: int) -> torch.Tensor:
        key = (kind, layer)
        if key not in self._cache:
            src = self._kit if self._kit is not None else self._mapped
            t = getattr(src, kind)(layer)
            if isinstance(t, np.ndarray):
                t = torch.from_numpy(t)
            if t.dtype != torch.float32:
                raise ExampleError(f"the {kind} pool of layer {layer} is {t.dtype}, this example "
                                   "writes fp32 (--activation_dtype=fp32 --state_dtype=fp32)")
            self._cache[key] = t
        return self._cache[key]

    def recurrent(self, layer: int) -> torch.Tensor:
        return self._get("recurrent", layer)

    def conv(self, layer: int) -> torch.Tensor:
        return self._get("conv", layer)

    def close(self) -> None:
        self._cache.clear()
        if self._mapped is not None:  # the kit's pools close with its Runner
            self._mapped.close()


# ---------------------------------------------------------------------------
# The verify forward: transformers' modules, two kernels of each GDN layer replaced.

@dataclasses.dataclass
class Row:
    """One request's part of a packed verify forward."""

    start: int      # its tokens are [start, end) of the packed batch
    end: int
    block: int      # its SpecState state block
    past: int       # tokens in its attention KV cache before this step
    cache: Any      # its transformers cache (the full-attention layers' KV)


class _Handle:
    """Stands in for a cache tensor the GDN module reads and hands to a replaced kernel."""

    def __init__(self, what: str, layer: int) -> None:
        self.what, self.layer = what, layer

    def __repr__(self) -> str:
        return f"<SpecState {self.what} of GDN layer {self.layer}>"


class _AnyIndex:
    def __init__(self, make: Callable[[int], Any]) -> None:
        self._make = make

    def __getitem__(self, i: int) -> Any:
        return self._make(i)

    def __setitem__(self, i: int, value: Any) -> None:
        pass  # the module stores its new recurrent state: SpecState holds it

    def __len__(self) -> int:
        return 1 << 30


class _LinearLayerView:
    def __init__(self, conv: _Handle, rec: _Handle) -> None:
        self.conv_states, self.recurrent_states = conv, rec
        self.has_previous_state = True


class _DecodeCacheView:
    """What a Qwen3NextGatedDeltaNet reads of its cache_params while it decodes: a previous
    state exists (so it takes its decode path: causal_conv1d_update and
    recurrent_gated_delta_rule), the states are SpecState's (the replaced kernels
    use the pools), and the new state it stores is dropped. transformers >= 5:
    has_previous_state(layer_idx), layers[i].conv_states, update_recurrent_state();
    4.57: has_previous_state (truthy), conv_states[i], recurrent_states[i] = ..."""

    def __init__(self, spec_layer: int) -> None:
        conv, rec = _Handle("conv window", spec_layer), _Handle("recurrent state", spec_layer)
        self.conv_states = _AnyIndex(lambda i: conv)
        self.recurrent_states = _AnyIndex(lambda i: rec)
        self.layers = _AnyIndex(lambda i: _LinearLayerView(conv, rec))

    def has_previous_state(self, layer_idx: Optional[int] = None) -> bool:  # a method: truthy too
        return True

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, **kwargs: Any) -> Any:
        return recurrent_states

    def update_conv_state(self, conv_states: Any, layer_idx: int, **kwargs: Any) -> Any:
        raise ExampleError("the GDN module took its prefill path inside a verify forward")


class VerifyForward:
    """Runs one packed verify step: every request's window through the model.

    Full-attention layers: transformers' module per request, with its cache and an
    explicit causal mask over [past + window]. GDN layers: transformers' module on the
    packed tokens, seen as a batch of T one-token sequences so that it takes its
    decode path, with `causal_conv1d_update` replaced by the window update on the
    SpecState conv pool and `recurrent_gated_delta_rule` by SpecState's Verify.
    """

    def __init__(self, model: Any, geo: Geometry, pools: Pools) -> None:
        self.model, self.geo, self.pools = model, geo, pools
        self.layers = decoder_layers(model)
        self.spec_layer_of = {d: i for i, d in enumerate(geo.gdn_layers)}
        self.rows: List[Row] = []
        self.step: Any = None
        self._layer, self._seen = -1, set()
        self.hl = geo.conv_kernel - 1
        self.installed = False
        self._saved: List[Tuple[Any, str, Any]] = []
        for d in geo.gdn_layers:
            layer = self.layers[d]
            m = getattr(layer, "linear_attn", None)
            if m is None:
                raise ExampleError(f"decoder layer {d} (linear_attention) has no linear_attn module")
            for attr in ("causal_conv1d_update", "recurrent_gated_delta_rule", "conv1d"):
                if not hasattr(m, attr):
                    raise ExampleError(
                        f"{type(m).__name__} has no attribute {attr!r}: this example replaces the "
                        "module's causal_conv1d_update and recurrent_gated_delta_rule (instance "
                        "attributes in transformers 4.57-5.x) with SpecState's")
        for d in geo.attn_layers:
            if getattr(self.layers[d], "self_attn", None) is None:
                raise ExampleError(f"decoder layer {d} (full_attention) has no self_attn module")

    # -- installing and removing the replacements --------------------------------

    @contextlib.contextmanager
    def installed_on_model(self) -> Iterator[None]:
        for d in self.geo.gdn_layers:
            m = self.layers[d].linear_attn
            spec_layer = self.spec_layer_of[d]
            self._swap(m, "forward", self._gdn_forward(m, m.forward, spec_layer))
            self._swap(m, "causal_conv1d_update", self._conv_update)
            self._swap(m, "recurrent_gated_delta_rule", self._recurrence)
        for d in self.geo.attn_layers:
            a = self.layers[d].self_attn
            self._swap(a, "forward", self._attention_forward(a.forward))
        self.installed = True
        try:
            yield
        finally:
            for obj, name, had in reversed(self._saved):
                if had is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, had)
            self._saved.clear()
            self.installed = False

    def _swap(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    # -- GDN ---------------------------------------------------------------------

    def _gdn_forward(self, module: Any, original: Callable, spec_layer: int) -> Callable:
        params = inspect.signature(original).parameters
        owner = self
        cache_name = next((n for n in ("cache_params", "past_key_values", "past_key_value")
                           if n in params), None)
        if cache_name is None:
            raise ExampleError(f"{type(module).__name__}.forward{inspect.signature(original)} takes "
                               "no cache_params / past_key_values: this example hands the GDN "
                               "module a cache view that makes it take its decode path")

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
                raise ExampleError(f"packed hidden states are [1, T, hidden], got "
                                   f"{tuple(hidden_states.shape)}")
            owner._layer = spec_layer
            owner._seen = set()
            call: Dict[str, Any] = {cache_name: _DecodeCacheView(spec_layer)}
            if "attention_mask" in params:
                call["attention_mask"] = None
            if "cache_position" in params:  # 4.57 also needs it for its decode path
                call["cache_position"] = torch.zeros(1, dtype=torch.long, device=hidden_states.device)
            # T one-token sequences: the module's decode path, every projection per token.
            out = original(hidden_states.transpose(0, 1), **call)
            if owner._seen != {"conv", "recurrence"}:
                missing = {"conv", "recurrence"} - owner._seen
                raise ExampleError(
                    f"{type(module).__name__}.forward did not call its "
                    f"{' and '.join(sorted(missing))} kernel through the module attribute "
                    "(causal_conv1d_update / recurrent_gated_delta_rule) with a cache that has a "
                    "previous state: transformers' GDN decode path differs from what this "
                    "example replaces")
            return out.transpose(0, 1)

        return forward

    def _conv_update(self, x: torch.Tensor, conv_state: Any, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                     *args: Any, **kwargs: Any) -> torch.Tensor:
        """The causal conv of every row's window, on its block of the SpecState conv pool.

        docs/semantics.md's contract: the block's columns [0, hl) hold the last hl inputs
        h_1..h_hl (hl = kernel - 1); the update writes [h_2..h_hl, x_0..x_{T-1}] from
        column 0, and Commit moves the window ending at the last accepted token back to
        columns [0, hl). transformers' update is the same convolution over [state, x]."""
        self._seen.add("conv")
        if args or any(v is not None for v in kwargs.values()):
            raise ExampleError(f"causal_conv1d_update called with arguments this example does not "
                               f"know: {len(args)} positional, {sorted(kwargs)}")
        if activation not in (None, "silu", "swish"):
            raise ExampleError(f"the GDN conv's activation is {activation!r}; expected silu")
        T, D = x.shape[0], x.shape[1]
        if x.dim() != 3 or x.shape[2] != 1 or D != self.geo.conv_dim or T != self.rows[-1].end:
            raise ExampleError(f"causal_conv1d_update input {tuple(x.shape)}, expected "
                               f"[{self.rows[-1].end}, {self.geo.conv_dim}, 1]")
        if weight.dim() == 3:
            weight = weight.squeeze(1)
        if tuple(weight.shape) != (D, self.geo.conv_kernel):
            raise ExampleError(f"conv weight {tuple(weight.shape)}, expected "
                               f"[{D}, {self.geo.conv_kernel}]")
        pool = self.pools.conv(self._layer)  # [blocks, D, W], in place
        hl = self.hl
        xs = x[:, :, 0]
        out = torch.empty_like(xs)
        for row in self.rows:
            n = row.end - row.start
            window = torch.cat([pool[row.block, :, :hl].to(x.dtype), xs[row.start:row.end].t()], dim=1)
            y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=D)[0]  # [D, n]
            out[row.start:row.end] = (F.silu(y) if activation is not None else y).t()
            pool[row.block, :, :hl - 1 + n] = window[:, 1:]
        return out.unsqueeze(-1)

    def _recurrence(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    g: Optional[torch.Tensor] = None, beta: Optional[torch.Tensor] = None,
                    initial_state: Any = None, output_final_state: bool = False,
                    use_qk_l2norm_in_kernel: bool = False, scale: Optional[float] = None,
                    **kwargs: Any) -> Tuple[torch.Tensor, None]:
        """SpecState's Verify in place of the module's recurrent kernel.

        The module hands over q, k after the conv (q, k repeated to the value heads when HV
        > H), v, g = -exp(A_log) softplus(a + dt_bias) (the log-decay) and beta = sigmoid(b),
        asking the kernel to l2-normalize q and k (eps 1e-6) and scale q by K^-0.5: exactly
        what SpecState's GDN step does (docs/semantics.md), so everything goes as is."""
        self._seen.add("recurrence")
        extra = {k: v for k, v in kwargs.items() if v is not None}
        if extra:
            raise ExampleError(f"recurrent_gated_delta_rule called with {sorted(extra)}: unknown here")
        if not use_qk_l2norm_in_kernel:
            raise ExampleError("the GDN module asked its recurrent kernel not to l2-normalize q and "
                               "k; SpecState always does (docs/semantics.md): they would be "
                               "normalized twice")
        K = self.geo.head_dim
        if scale is not None and not math.isclose(scale, K ** -0.5, rel_tol=1e-6):
            raise ExampleError(f"the GDN module scales q by {scale}; SpecState by K^-0.5 = {K ** -0.5}")
        if g is None or beta is None:
            raise ExampleError("recurrent_gated_delta_rule called without g or beta")
        H, HV = self.geo.heads, self.geo.value_heads
        T = query.shape[0]
        if query.dim() != 4 or query.shape[1] != 1 or value.shape[2] != HV:
            raise ExampleError(f"q {tuple(query.shape)}, v {tuple(value.shape)}: expected "
                               f"[T, 1, H or HV, {K}] and [T, 1, {HV}, {K}]")
        q, k = query[:, 0], key[:, 0]
        if q.shape[1] == HV and HV != H:  # repeat_interleave'd: value head hv reads key head hv // r
            r = HV // H
            q, k = q[:, ::r], k[:, ::r]
        if q.shape[1] != H:
            raise ExampleError(f"q has {q.shape[1]} heads; expected {H} or {HV}")
        o = self.step.verify(self._layer, q.float(), k.float(), value[:, 0].float(),
                             g.reshape(T, HV).float(), beta.reshape(T, HV).float())
        return o.reshape(T, 1, HV, K).to(value.dtype).clone(), None

    # -- full attention ------------------------------------------------------------

    def _attention_forward(self, original: Callable) -> Callable:
        owner = self
        params = inspect.signature(original).parameters
        # transformers >= 4.56 names the cache past_key_values (past_key_value before).
        cache_kw = "past_key_value" if ("past_key_value" in params and
                                        "past_key_values" not in params) else "past_key_values"

        def forward(*args: Any, **kwargs: Any) -> Tuple[torch.Tensor, None]:
            hidden = kwargs.pop("hidden_states", None)
            if hidden is None:
                hidden, args = args[0], args[1:]
            pe = kwargs.pop("position_embeddings", None)
            if pe is None:
                pe, args = args[0], args[1:]
            if args:
                raise ExampleError(f"the decoder layer passed {len(args)} more positional "
                                   "arguments to self_attn than this example knows")
            kwargs.pop("attention_mask", None)
            kwargs.pop("past_key_values", None)
            kwargs.pop("past_key_value", None)
            kwargs.pop("position_ids", None)
            had_cache_position = kwargs.pop("cache_position", None) is not None
            cos, sin = pe
            outs = []
            for row in owner.rows:
                n = row.end - row.start
                mask = None
                if n > 1:  # causal over [past + window]; eager adds it, sdpa takes it as is
                    allowed = (torch.arange(row.past + n, device=hidden.device)[None, :]
                               <= row.past + torch.arange(n, device=hidden.device)[:, None])
                    mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
                    mask.masked_fill_(~allowed, torch.finfo(hidden.dtype).min)
                    mask = mask[None, None]
                extra = dict(kwargs)
                if had_cache_position:
                    extra["cache_position"] = torch.arange(row.past, row.past + n, device=hidden.device)
                out = original(hidden_states=hidden[:, row.start:row.end],
                               position_embeddings=(cos[:, row.start:row.end], sin[:, row.start:row.end]),
                               attention_mask=mask, **{cache_kw: row.cache}, **extra)
                outs.append(out[0] if isinstance(out, tuple) else out)
            return torch.cat(outs, dim=1), None

        return forward

    # -- one step ------------------------------------------------------------------

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, rows: List[Row], step: Any) -> torch.Tensor:
        """logits [T, vocab] of the packed tokens [T] at positions [T]."""
        if not self.installed:
            raise ExampleError("VerifyForward.logits outside installed_on_model()")
        self.rows, self.step = rows, step
        inner = self.model.model
        hidden = inner.embed_tokens(tokens[None])
        pos = positions[None]
        pe = inner.rotary_emb(hidden, pos)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings=pe, attention_mask=None, position_ids=pos,
                           past_key_values=None)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        hidden = inner.norm(hidden)
        return self.model.lm_head(hidden)[0].float()


_MISSING = object()


# ---------------------------------------------------------------------------
# Drafts, prompts, the reference.

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


def reference_generate(model: Any, prompts: List[List[int]], n: int, device: torch.device) -> Decoded:
    """transformers' own greedy generate, one request at a time."""
    tf = _transformers()
    gc = tf.GenerationConfig(max_new_tokens=n, do_sample=False, num_beams=1,
                             output_logits=True, return_dict_in_generate=True, use_cache=True,
                             eos_token_id=None, pad_token_id=0)
    tokens, logits, states = [], [], []
    sync(device)
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        seq = out.sequences[0, len(p):].tolist()
        if len(seq) != n:
            raise ExampleError(f"generate returned {len(seq)} new tokens, asked for {n}")
        tokens.append(seq)
        if getattr(out, "logits", None) is None:
            raise ExampleError("generate(output_logits=True) returned no logits")
        logits.append(torch.stack([x[0] for x in out.logits]).float().cpu())
        cache = getattr(out, "past_key_values", None)
        states.append(_final_states(model, cache))
    sync(device)
    return Decoded(tokens, logits, time.perf_counter() - t0, states)


def _final_states(model: Any, cache: Any) -> Optional[List[torch.Tensor]]:
    """generate's final GDN recurrent states, [HV, V, K] per GDN layer (None if not exposed)."""
    if cache is None:
        return None
    geo = Geometry.of(model.config)
    try:
        return [cache_gdn_states(cache, d)[1].transpose(-1, -2).float().cpu() for d in geo.gdn_layers]
    except ExampleError:
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# Speculative decoding through SpecState.

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
    kit = _kit_module() if args.use_kit else None
    if kit is not None:
        return KitRunner(kit, client, label, max_tokens=rows * Q, max_rows=rows, device=device,
                         block_table_width=block_table_width)
    return PlainRunner(client, label, max_tokens=rows * Q, max_rows=rows, device=device)


def spec_decode(model: Any, geo: Geometry, client: Any, prompts: List[List[int]], n: int,
                args: argparse.Namespace, device: torch.device, num_spec: int, label: str,
                align: Optional[AlignPlan] = None) -> Decoded:
    Q = num_spec + 1
    R = len(prompts)
    runner = _make_runner(client, label, args, R, Q, device, align.width if align else 0)
    pools = Pools(client, runner)
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


# ---------------------------------------------------------------------------
# Comparison and the report.

@dataclasses.dataclass
class Verdict:
    matched: int = 0        # tokens equal before the first difference, summed
    total: int = 0
    near_ties: int = 0      # requests that diverged at a near-tie
    failures: int = 0       # requests that diverged where the top two logits were not close
    lines: List[str] = dataclasses.field(default_factory=list)


def compare(ref: Decoded, got: Decoded, tol: float) -> Verdict:
    v = Verdict()
    for r, (want, have) in enumerate(zip(ref.tokens, got.tokens)):
        v.total += len(want)
        j = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if j is None:
            v.matched += len(want)
            continue
        v.matched += j
        a, b = want[j], have[j]
        lr, ls = ref.logits[r][j], got.logits[r][j]
        gap_ref = float(lr[a] - lr[b])  # >= 0: generate chose a
        gap_spec = float(ls[b] - ls[a])  # >= 0: SpecState's forward chose b
        tie = abs(gap_ref) <= tol and abs(gap_spec) <= tol
        v.near_ties += tie
        v.failures += not tie
        v.lines.append(
            f"  request {r}: first difference at new token {j}: generate {a}, SpecState {b}; "
            f"generate's logits {a}: {float(lr[a]):.7f}, {b}: {float(lr[b]):.7f} (gap {gap_ref:.2e}); "
            f"SpecState's {b}: {float(ls[b]):.7f}, {a}: {float(ls[a]):.7f} (gap {gap_spec:.2e}) -> "
            + ("a near-tie (|gap| <= %.0e): compared up to here" % tol if tie else
               "NOT a near-tie: a real difference"))
    return v


def state_errors(ref: Decoded, got: Decoded) -> Optional[float]:
    """max |SpecState - generate| / max |generate| over the final recurrent states of the
    requests whose tokens all agree (both fed the same prompt + new_tokens - 1 tokens)."""
    worst = None
    for r, (want, have) in enumerate(zip(ref.tokens, got.tokens)):
        if want != have or not ref.states or ref.states[r] is None or got.states[r] is None:
            continue
        for a, b in zip(ref.states[r], got.states[r]):
            e = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
            worst = e if worst is None else max(worst, e)
    return worst


def gib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.4f} GiB"


def memory_report(geo: Geometry, requests: int, num_spec: int) -> List[str]:
    lines = []
    for name, layers, hv, k, reqs in (
            ("this example", len(geo.gdn_layers), geo.value_heads, geo.head_dim, requests),
            ("Qwen3-Next-80B-A3B (36 GDN layers, 32 value heads, 128 x 128 fp32), 1 request",
             36, 32, 128, 1),
            ("Qwen3-Next-80B-A3B, 256 requests", 36, 32, 128, 256)):
        one = layers * hv * k * k * 4 * reqs
        lines.append(f"  {name}: stock spec path (1 + num_spec = {1 + num_spec} states per request "
                     f"per GDN layer) {gib(one * (1 + num_spec))}, SpecState (one) {gib(one)}")
    return lines


# ---------------------------------------------------------------------------

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
    p.add_argument("--no_kit", dest="use_kit", action="store_false",
                   help="use the plain client even where specstate.kit exists")
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
    print("specstate I/O: " + ("specstate.kit" if args.use_kit and _kit_module() else "the plain client"))
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
