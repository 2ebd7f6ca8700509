"""An independent float64 reference of the KDA and Gated DeltaNet recurrences
and the commit rules, written plainly from docs/semantics.md. It uses no code of the package or the service.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float64 values."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(
        np.float64)


def delta_step(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay,
               strength: float) -> np.ndarray:
    """One token of one value head, the step both kinds share (docs/semantics.md).

    S [V, K] float64, updated in place; q, k [K] raw (normalized here); v [V];
    `decay` [K] (KDA, per column) or a scalar (GDN, the whole row); `strength`
    the write strength (sigmoid(beta) for KDA, beta as given for GDN).
    Returns o [V].
    """
    K = q.shape[0]
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    q = q / np.sqrt(np.sum(q * q) + 1e-6) * K ** -0.5
    k = k / np.sqrt(np.sum(k * k) + 1e-6)
    S *= np.broadcast_to(np.asarray(decay, dtype=np.float64), (K,))[None, :]
    u = (np.asarray(v, dtype=np.float64) - S @ k) * strength
    S += np.outer(u, k)
    return S @ q


def kda_tokens(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
               beta: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
               lower_bound: float, plain_gate: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Runs KDA tokens through the per-token step of docs/semantics.md.

    state [H, V, K]; q, k, v, g [T, H, K]; beta [T, H]; a_log [H]; dt_bias [H*K].
    The safe gate: decay = exp(lower_bound * sigmoid(exp(a_log) (g + dt_bias)));
    `plain_gate` (vLLM's): decay = exp(-exp(a_log) softplus(g + dt_bias)),
    softplus linear past 20.
    Returns (outputs [T, H, V], state after the last token), float64.
    """
    S = np.array(state, dtype=np.float64)
    T, H, K = q.shape
    out = np.zeros((T, H, K), dtype=np.float64)
    for t in range(T):
        for h in range(H):
            a = np.exp(float(a_log[h]))
            x = np.asarray(g[t, h], dtype=np.float64) + dt_bias[h * K:(h + 1) * K]
            if plain_gate:
                softplus = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
                decay = np.exp(-a * softplus)
            else:
                decay = np.exp(lower_bound / (1.0 + np.exp(-(a * x))))
            sig_beta = 1.0 / (1.0 + np.exp(-float(beta[t, h])))
            out[t, h] = delta_step(S[h], q[t, h], k[t, h], v[t, h], decay, sig_beta)
    return out, S


def gdn_tokens(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
               beta: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Runs Gated DeltaNet tokens (Qwen3-Next) through the per-token step.

    state [HV, V, K]; q, k [T, H, K]; v [T, HV, V]; g, beta [T, HV] as the
    model computed them (log-decay and write strength). Value head hv reads
    key head hv // (HV // H) and decays its whole state by exp(g[hv]).
    Returns (outputs [T, HV, V], state after the last token), float64.
    """
    S = np.array(state, dtype=np.float64)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    assert HV % H == 0 and S.shape == (HV, V, K), (S.shape, q.shape, v.shape)
    assert g.shape == (T, HV) and beta.shape == (T, HV), (g.shape, beta.shape)
    out = np.zeros((T, HV, V), dtype=np.float64)
    for t in range(T):
        for hv in range(HV):
            h = hv // (HV // H)
            out[t, hv] = delta_step(S[hv], q[t, h], k[t, h], v[t, hv], np.exp(float(g[t, hv])),
                                    float(beta[t, hv]))
    return out, S


def conv_update(block: np.ndarray, x: np.ndarray, history_len: int) -> np.ndarray:
    """The scheduler's conv update of docs/semantics.md on a conv block [D, W] (raw values):
    columns [h_1..h_hl] become [h_2..h_hl, x_0..x_{T-1}] from column 0. x is [T, D]."""
    T = x.shape[0]
    out = block.copy()
    out[:, :history_len - 1] = block[:, 1:history_len]
    out[:, history_len - 1:history_len - 1 + T] = x.T
    return out


def window_after(updated: np.ndarray, tokens: int, history_len: int) -> np.ndarray:
    """The history_len columns ending at token x_{tokens-1} of an updated block [D, W]."""
    return updated[:, tokens - 1:tokens - 1 + history_len].copy()


def align_plan(nc: int, acc: int, T: int, Q: int, bs: int, table: List[int],
               source: int) -> Tuple[int, int, Optional[int], int]:
    """Commit's plan of one row in align mode: (commit_len, final, boundary, boundary_len)."""
    width = len(table)
    commit_len = min(max(acc, 0), T, Q)
    fnc = nc + commit_len
    final = table[min(max(fnc - 1, 0) // bs, width - 1)]
    next_boundary = (nc // bs + 1) * bs
    boundary_len = next_boundary - nc
    boundary = table[next_boundary // bs - 1] if fnc >= next_boundary else None
    if not (source > 0 and commit_len > 0):
        return 0, 0, None, 0
    return commit_len, final, boundary, boundary_len


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| (per tensor)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))
