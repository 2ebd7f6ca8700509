// The FAST mode's math (docs/semantics.md, "Fast mode (FAST)"): outputs of a
// window from a checkpoint S0, a ring of c accepted tokens and the window's T
// tokens in the chunked (UT/WY) form, and the fold of a ring into its
// checkpoint. Host and device (SPECSTATE_HD), like kernels/kda_math.h, whose
// per-token definitions it uses (gate log-decay, beta, q/k normalization,
// the delta coefficient): the CPU backend and a CUDA one call these.
//
// For one value head, with gamma_i the log-decay of token i (per column j
// for KDA, the same for every column for GDN), ring tokens 0..c-1 and window
// tokens t = 0..T-1:
//
//   H_i     = sum_{i < r < c} gamma_r          ring token i -> the cursor
//   Gc      = sum_{0 <= r < c} gamma_r         checkpoint -> the cursor
//   W_t     = sum_{0 <= r <= t} gamma_{c + r}  the cursor -> window token t
//   E_{t,s} = sum_{s < r <= t} gamma_{c + r}   window token s -> window token t
//
// Every exponent is such a sum of gammas (<= 0) over a range of tokens,
// accumulated from the near end: no exp(-G) is ever formed and no
// difference of two long cumulative sums either (over a full ring at the
// lowest gate G reaches -5 R; fp32 cancellation in G_t - G_i would cost
// |G| * 2^-24 of every coefficient). Each exponential is at most 1; one
// that underflows is a contribution below fp32's range, correctly 0.
//
// The operands then are
//
//   kr_i = k_i * exp(H_i)                 ring keys, decayed to the cursor
//   kw_t = k_t * exp(W_t), qw_t = q_t * exp(W_t)
//   kc_t = k_t * exp(Gc + W_t), qc_t = q_t * exp(Gc + W_t)
//
// and for each state row v (one row of S0 [V, K]; u_i[v] the ring's u):
//
//   kdot_t = S0[v] . kc_t + sum_i (kw_t . kr_i) u_i[v]
//                          + sum_{s<t} (k_t . (k_s * exp(E_{t,s}))) u_s[v]
//   u_t[v] = (v_t[v] - kdot_t) * beta_t                 (forward substitution:
//                                                        U = (I + A)^-1 R)
//   o_t[v] = S0[v] . qc_t + sum_i (qw_t . kr_i) u_i[v]
//                          + sum_{s<=t} (q_t . (k_s * exp(E_{t,s}))) u_s[v]
//
// The fold of n ring tokens: S[v] = S0[v] * exp(Gc) + sum_i u_i[v] kr_i
// (H_i and Gc taken at n).
#ifndef SPECSTATE_KERNELS_FAST_FAST_MATH_H_
#define SPECSTATE_KERNELS_FAST_FAST_MATH_H_

#include <math.h>

#include "kernels/kda_math.h"
#include "kernels/numeric.h"

namespace specstate {
namespace fast {

// The most tokens a FAST Verify window may have (kda_args.h's bound, which
// the kernel interface checks).
inline constexpr int kMaxWindow = ::specstate::kernels::kMaxFastQueryLen;

// sum_j x[j] * y[j] over n floats, four partial sums (as kda_math's dots).
SPECSTATE_HD float Dot(const float* x, const float* y, int n) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    SPECSTATE_UNROLL
    for (int c = 0; c < 4; ++c) acc[c] = kda::MulAdd(x[j + c], y[j + c], acc[c]);
  }
  for (; j < n; ++j) acc[0] = kda::MulAdd(x[j], y[j], acc[0]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// q or k of one head, normalized as the kernels normalize it:
// x / sqrt(sum(x*x) + eps) * scale (scale = kda::QueryScale(K) for q, 1 for k).
template <typename Raw>
SPECSTATE_HD void NormalizeHead(const Raw* raw, int n, float scale, float* out) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) {
    out[j] = ToFloat(raw[j]);
    sum = kda::MulAdd(out[j], out[j], sum);
  }
  const float norm = kda::L2Norm(sum);
  for (int j = 0; j < n; ++j) out[j] = kda::Normalize(out[j], norm, scale);
}

// x * exp(exponent), exponent a sum of log-decays (<= 0): at most |x|.
SPECSTATE_HD float Decayed(float x, float exponent) { return x * expf(exponent); }

// The ring's exponents of one column: suffix[i] = H_i = sum_{i < r < n}
// gamma[r] (gamma[r] at gamma_of(r)), accumulated from the newest token back,
// and the total Gc = sum_{r < n} gamma[r], returned.
template <typename GammaOf>
SPECSTATE_HD float RingExponents(int n, GammaOf gamma_of, float* suffix) {
  float acc = 0.0f;
  for (int i = n - 1; i >= 0; --i) {
    suffix[i] = acc;
    acc += gamma_of(i);
  }
  return acc;
}

// The window's exponents of one column, from its gammas g[0..T): w[t] = W_t
// and pair[t * kMaxWindow + s] = E_{t,s} for s < t, each summed from token
// s + 1 on (never W_t - W_s).
SPECSTATE_HD void WindowExponents(int T, const float* g, float* w, float* pair) {
  float acc = 0.0f;
  for (int t = 0; t < T; ++t) {
    acc += g[t];
    w[t] = acc;
  }
  for (int s = 0; s < T; ++s) {
    float e = 0.0f;
    for (int t = s + 1; t < T; ++t) {
      e += g[t];
      pair[t * kMaxWindow + s] = e;
    }
  }
}

// One state row v of a window (forward substitution, T <= kMaxWindow):
//   sk[t] = S0[v] . kc_t, sq[t] = S0[v] . qc_t (the checkpoint's part),
//   rk[t] = sum_i (kw_t . kr_i) u_i[v], rq[t] likewise with qw_t (the ring's),
//   a[t * kMaxWindow + s] = k_t . (k_s * exp(E_{t,s})) for s < t,
//   b[t * kMaxWindow + s] = q_t . (k_s * exp(E_{t,s})) for s <= t (E_{t,t} = 0),
//   v[t], beta[t] (sigmoid'ed for KDA: GateRule::Beta).
// Writes u[t] = the token's u_v (kda::DeltaCoefficient) and o[t] its output.
// kBound: the most tokens a window of this call may have (T <= kBound <=
// kMaxWindow), what the loops unroll to; a and b keep kMaxWindow's stride.
template <int kBound = kMaxWindow>
SPECSTATE_HD void SolveWindowRow(int T, const float* sk, const float* sq, const float* rk,
                                 const float* rq, const float* a, const float* b, const float* v,
                                 const float* beta, float* u, float* o) {
  static_assert(kBound >= 1 && kBound <= kMaxWindow, "a window bound of 1 .. kMaxWindow");
  // Unrolled to kBound with T as a predicate: on the GPU the arrays stay in
  // registers (indexed by constants); the order of the sums is the same.
  SPECSTATE_UNROLL
  for (int t = 0; t < kBound; ++t) {
    if (t >= T) break;
    float kdot = sk[t] + rk[t];
    SPECSTATE_UNROLL
    for (int s = 0; s < t; ++s) kdot = kda::MulAdd(a[t * kMaxWindow + s], u[s], kdot);
    u[t] = kda::DeltaCoefficient(v[t], kdot, beta[t]);
    float out = sq[t] + rq[t];
    SPECSTATE_UNROLL
    for (int s = 0; s <= t; ++s) out = kda::MulAdd(b[t * kMaxWindow + s], u[s], out);
    o[t] = out;
  }
}

// One state row of a fold of n ring tokens: out[j] = S0[v, j] * exp(Gc[j])
// plus the ring's terms u_i[v] * kr_i[j], oldest first. `u_of(i)` is u_i[v],
// `kr_of(i)` points at kr_i ([k] floats).
template <typename UOf, typename KrOf>
SPECSTATE_HD void FoldRow(const float* s0, const float* total_exponent, int k, int n, UOf u_of,
                          KrOf kr_of, float* out) {
  for (int j = 0; j < k; ++j) out[j] = Decayed(s0[j], total_exponent[j]);
  for (int i = 0; i < n; ++i) {
    const float ui = u_of(i);
    const float* kr = kr_of(i);
    for (int j = 0; j < k; ++j) out[j] = kda::MulAdd(ui, kr[j], out[j]);
  }
}

}  // namespace fast
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_FAST_FAST_MATH_H_
