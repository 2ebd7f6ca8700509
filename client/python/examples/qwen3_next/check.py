"""The check: transformers' own greedy generate on the same weights, the comparison of
tokens (near-ties explained) and of final recurrent states, and the memory report."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Optional

import torch

from .decode import Decoded
from .model import ExampleError, Geometry, _transformers, cache_gdn_states, sync


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
