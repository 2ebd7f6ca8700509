// The KDA recurrence of one token: the single definition of the per-token math
// that the stock kernel, verify and replay execute, on the CPU and on CUDA.
//
// The state of one head is S[V][K] (fp32 while computing). A "lane" owns a
// share of one state row: the row's columns are split in quads of 4
// consecutive columns and lane l of kLanes owns quads l, l + kLanes, ...
// (the CUDA kernel uses 8 lanes a row, 16 for K = 256, each lane owning that
// share of two rows: every input it loads from shared memory serves both;
// the CPU kernels use kLanes = 1, a whole row). For one token and one state
// row:
//
//   LoadSegment<kSeg, kLanes>(tok.decay, lane, decay);  // and k, q: this lane's columns
//   float kdot = lane_sum(DecayAndDotK<kSeg>(s, decay, k));
//   float u = DeltaCoefficient(v, kdot, tok.beta);
//   float o = lane_sum(UpdateAndDotQ<kSeg>(s, u, k, q));
//
// TokenStep() is exactly that, for one or several rows of a lane (their
// inputs loaded once). Bit identity between the stock kernel, verify
// and replay (docs/semantics.md) holds because all three run these functions with
// the same lane layout and reduction; never duplicate this arithmetic.
#ifndef SPECSTATE_KERNELS_KDA_MATH_H_
#define SPECSTATE_KERNELS_KDA_MATH_H_

#include <math.h>

#include "kernels/kda_args.h"
#include "kernels/numeric.h"

#if defined(__CUDACC__)
#define SPECSTATE_UNROLL _Pragma("unroll")
#else
#define SPECSTATE_UNROLL
#endif

namespace specstate {
namespace kda {

inline constexpr float kNormEpsilon = 1e-6f;

// a * b + c. One rounding on CUDA (explicit FMA: the kernels build with
// --fmad=false so that no other multiply-add is contracted behind our back),
// two on the host (built with -ffp-contract=off).
SPECSTATE_HD float MulAdd(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return a * b + c;
#endif
}

// The KDA "safe" gate for one column, as its log-decay gamma (<= 0):
// lower_bound / (1 + exp(-(a * (g + dt_bias)))), with a = exp(A_log[h]).
SPECSTATE_HD float GateLogDecay(float g, float dt_bias, float a, float lower_bound) {
  return lower_bound / (1.0f + expf(-(a * (g + dt_bias))));
}

// The same gate as the decay factor applied to the column: exp(gamma).
SPECSTATE_HD float GateDecay(float g, float dt_bias, float a, float lower_bound) {
  return expf(GateLogDecay(g, dt_bias, a, lower_bound));
}

SPECSTATE_HD float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// softplus(x) = log(1 + exp(x)), linear past 20 (torch's threshold).
SPECSTATE_HD float Softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// KDA's plain gate as the log-decay of one column: -a * softplus(g + dt_bias),
// with a = exp(A_log[h]).
SPECSTATE_HD float PlainGateLogDecay(float g, float dt_bias, float a) {
  return -(a * Softplus(g + dt_bias));
}

// The same gate as the decay factor of the column.
SPECSTATE_HD float PlainGateDecay(float g, float dt_bias, float a) {
  return expf(PlainGateLogDecay(g, dt_bias, a));
}

// Gated DeltaNet: the log-decay g of a value head, as the model computed it.
SPECSTATE_HD float ScalarGateDecay(float g) { return expf(g); }

// How a layer turns its gate input and beta into the per-token inputs; the
// one place the kinds differ (TokenStep is the same for all).
struct GateRule {
  kernels::LayerKind kind;
  kernels::KdaGate gate;
  float a;  // exp(A_log[h]) (KDA)
  float lower_bound;

  // The decay factor of column j for gate input `g` (KDA: g[t, h, j]; GDN:
  // g[t, hv], the same for every column).
  SPECSTATE_HD float Decay(float g, float dt_bias_j) const {
    if (kind == kernels::LayerKind::kGdn) return ScalarGateDecay(g);
    if (gate == kernels::KdaGate::kPlain) return PlainGateDecay(g, dt_bias_j, a);
    return GateDecay(g, dt_bias_j, a, lower_bound);
  }
  // The log-decay gamma of the same column: Decay() is exp(LogDecay()), the
  // same expressions (FAST mode sums gammas instead of multiplying decays).
  SPECSTATE_HD float LogDecay(float g, float dt_bias_j) const {
    if (kind == kernels::LayerKind::kGdn) return g;
    if (gate == kernels::KdaGate::kPlain) return PlainGateLogDecay(g, dt_bias_j, a);
    return GateLogDecay(g, dt_bias_j, a, lower_bound);
  }
  // KDA's beta is a logit (sigmoid here); GDN's is the strength itself.
  SPECSTATE_HD float Beta(float beta) const {
    return kind == kernels::LayerKind::kGdn ? beta : Sigmoid(beta);
  }
};

// K^-0.5, rounded once to fp32 (as the reference passes K ** -0.5).
SPECSTATE_HD float QueryScale(int head_dim) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(head_dim)));
}

// sqrt(sum(x*x) + eps): the L2 norm the kernel divides q and k by.
SPECSTATE_HD float L2Norm(float sum_of_squares) { return sqrtf(sum_of_squares + kNormEpsilon); }

// q / ||q|| * K^-0.5 (scale) and k / ||k|| (scale 1 is exact).
SPECSTATE_HD float Normalize(float x, float norm, float scale) { return x / norm * scale; }

// u = (v - S k) * sigmoid(beta).
SPECSTATE_HD float DeltaCoefficient(float v, float kdot, float beta_sigmoid) {
  return (v - kdot) * beta_sigmoid;
}

// The prepared inputs of one token of one head, each K floats (fp32):
// normalized and scaled q, normalized k, the gate's decay factors, sigmoid(beta).
struct TokenInputs {
  const float* q;
  const float* k;
  const float* decay;
  float beta;
};

// Four consecutive floats; loaded as one 16-byte access on CUDA.
struct Quad {
  float x[4];
};

SPECSTATE_HD Quad LoadQuad(const float* p) {
#if defined(__CUDA_ARCH__)
  const float4 f = *reinterpret_cast<const float4*>(p);
  return Quad{{f.x, f.y, f.z, f.w}};
#else
  return Quad{{p[0], p[1], p[2], p[3]}};
#endif
}

// First column of quad `i` of `lane`'s share of a row.
template <int kLanes>
SPECSTATE_HD int QuadColumn(int lane, int i) {
  return 4 * (lane + kLanes * i);
}

// This lane's share of a row of one of the token's inputs, in registers:
// its quads, in order (seg[4 * i + c] is column QuadColumn(lane, i) + c).
template <int kSeg, int kLanes>
SPECSTATE_HD void LoadSegment(const float* row, int lane, float* seg) {
  static_assert(kSeg % 4 == 0, "a lane owns whole quads");
  SPECSTATE_UNROLL
  for (int i = 0; i < kSeg / 4; ++i) {
    const Quad q = LoadQuad(row + QuadColumn<kLanes>(lane, i));
    SPECSTATE_UNROLL
    for (int c = 0; c < 4; ++c) seg[4 * i + c] = q.x[c];
  }
}

// S[v, :] *= decay over this lane's columns; returns this lane's share of
// sum_j S[v, j] * k[j] (after the decay). `decay` and `k` are the lane's
// segments (LoadSegment).
template <int kSeg>
SPECSTATE_HD float DecayAndDotK(float* s, const float* decay, const float* k) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  SPECSTATE_UNROLL
  for (int i = 0; i < kSeg / 4; ++i) {
    SPECSTATE_UNROLL
    for (int c = 0; c < 4; ++c) {
      s[4 * i + c] = s[4 * i + c] * decay[4 * i + c];
      acc[c] = MulAdd(s[4 * i + c], k[4 * i + c], acc[c]);
    }
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// S[v, :] += u * k over this lane's columns; returns this lane's share of
// sum_j S[v, j] * q[j] (after the update), or 0 when no output is wanted.
template <int kSeg>
SPECSTATE_HD float UpdateAndDotQ(float* s, float u, const float* k, const float* q,
                                 bool want_output) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  SPECSTATE_UNROLL
  for (int i = 0; i < kSeg / 4; ++i) {
    SPECSTATE_UNROLL
    for (int c = 0; c < 4; ++c) s[4 * i + c] = MulAdd(u, k[4 * i + c], s[4 * i + c]);
    if (want_output) {
      SPECSTATE_UNROLL
      for (int c = 0; c < 4; ++c) acc[c] = MulAdd(s[4 * i + c], q[4 * i + c], acc[c]);
    }
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// One token for kRowsPer state rows of this lane: `s` holds kRowsPer
// segments of kSeg floats (row r at s + r * kSeg), `v` their values of v.
// The token's inputs are loaded once for all the rows. `lane_sum` adds a
// value over the kLanes lanes of a row, in a fixed order, and returns the
// total to every lane. Writes each row's output o_v to `out[r]` (every lane
// gets it; 0 when `want_output` is false: replay discards outputs, and the
// state it computes is the same either way).
template <int kSeg, int kLanes, int kRowsPer, typename LaneSum>
SPECSTATE_HD void TokenStep(float* s, int lane, const TokenInputs& tok, const float* v,
                            LaneSum lane_sum, bool want_output, float* out) {
  float decay[kSeg], k[kSeg], q[kSeg];
  LoadSegment<kSeg, kLanes>(tok.decay, lane, decay);
  LoadSegment<kSeg, kLanes>(tok.k, lane, k);
  if (want_output) LoadSegment<kSeg, kLanes>(tok.q, lane, q);
  float partial[kRowsPer];
  SPECSTATE_UNROLL
  for (int r = 0; r < kRowsPer; ++r) partial[r] = DecayAndDotK<kSeg>(s + r * kSeg, decay, k);
  SPECSTATE_UNROLL
  for (int r = 0; r < kRowsPer; ++r) {
    const float u = DeltaCoefficient(v[r], lane_sum(partial[r]), tok.beta);
    partial[r] = UpdateAndDotQ<kSeg>(s + r * kSeg, u, k, q, want_output);
  }
  SPECSTATE_UNROLL
  for (int r = 0; r < kRowsPer; ++r) out[r] = want_output ? lane_sum(partial[r]) : 0.0f;
}

// One token for one state row (kRowsPer = 1).
template <int kSeg, int kLanes, typename LaneSum>
SPECSTATE_HD float TokenStep(float* s, int lane, const TokenInputs& tok, float v, LaneSum lane_sum,
                             bool want_output) {
  float o = 0.0f;
  TokenStep<kSeg, kLanes, 1>(s, lane, tok, &v, lane_sum, want_output, &o);
  return o;
}

}  // namespace kda
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_KDA_MATH_H_
