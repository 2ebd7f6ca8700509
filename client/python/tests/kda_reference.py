"""An independent float64 reference of the KDA recurrence and the commit rules,
written plainly from SEMANTICS.md (shared/reference/SEMANTICS.md). It uses no
code of the package or the service.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float64 values."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(
        np.float64)


def kda_tokens(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
               beta: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
               lower_bound: float) -> Tuple[np.ndarray, np.ndarray]:
    """Runs tokens through the per-token step of SEMANTICS.md.

    state [H, V, K]; q, k, v, g [T, H, K]; beta [T, H]; a_log [H]; dt_bias [H*K].
    Returns (outputs [T, H, V], state after the last token), float64.
    """
    S = np.array(state, dtype=np.float64)
    T, H, K = q.shape
    out = np.zeros((T, H, K), dtype=np.float64)
    for t in range(T):
        for h in range(H):
            qt = np.asarray(q[t, h], dtype=np.float64)
            kt = np.asarray(k[t, h], dtype=np.float64)
            qt = qt / np.sqrt(np.sum(qt * qt) + 1e-6)
            kt = kt / np.sqrt(np.sum(kt * kt) + 1e-6)
            qt = qt * K ** -0.5
            a = np.exp(float(a_log[h]))
            gate_in = a * (np.asarray(g[t, h], dtype=np.float64) + dt_bias[h * K:(h + 1) * K])
            gamma = lower_bound / (1.0 + np.exp(-gate_in))
            S[h] = S[h] * np.exp(gamma)[None, :]
            sig_beta = 1.0 / (1.0 + np.exp(-float(beta[t, h])))
            u = (np.asarray(v[t, h], dtype=np.float64) - S[h] @ kt) * sig_beta
            S[h] = S[h] + np.outer(u, kt)
            out[t, h] = S[h] @ qt
    return out, S


def conv_update(block: np.ndarray, x: np.ndarray, history_len: int) -> np.ndarray:
    """The scheduler's conv update of SEMANTICS.md on a conv block [D, W] (raw values):
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
