// The KDA recurrence of one token: the single definition of the per-token math
// that the stock kernel, verify and replay execute, on the CPU and on CUDA.
//
// The state of one head is S[V][K] (fp32 while computing). A "lane" owns a
// share of one state row: the row's columns are split in quads of 4
// consecutive columns and lane l of kLanes owns quads l, l + kLanes, ...
// (the CUDA kernels use kLanes = 4 so that the lanes of a warp read shared
// memory without bank conflicts; the CPU kernels use kLanes = 1, a whole row).
// For one token and one state row:
//
//   float kdot = lane_sum(DecayAndDotK<kSeg, kLanes>(s, lane, tok.decay, tok.k));
//   float u = DeltaCoefficient(v, kdot, tok.beta);
//   float o = lane_sum(UpdateAndDotQ<kSeg, kLanes>(s, lane, u, tok.k, tok.q));
//
// TokenStep() is exactly that. Bit identity between the stock kernel, verify
// and replay (SEMANTICS.md) holds because all three run these functions with
// the same lane layout and reduction; never duplicate this arithmetic.
#ifndef SPECSTATE_KERNELS_KDA_MATH_H_
#define SPECSTATE_KERNELS_KDA_MATH_H_

#include <math.h>

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

// The KDA "safe" gate for one column, as the decay factor applied to it:
// exp(lower_bound / (1 + exp(-(a * (g + dt_bias))))), with a = exp(A_log[h]).
SPECSTATE_HD float GateDecay(float g, float dt_bias, float a, float lower_bound) {
  const float gamma = lower_bound / (1.0f + expf(-(a * (g + dt_bias))));
  return expf(gamma);
}

SPECSTATE_HD float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

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

// S[v, :] *= decay over this lane's columns; returns this lane's share of
// sum_j S[v, j] * k[j] (after the decay).
template <int kSeg, int kLanes>
SPECSTATE_HD float DecayAndDotK(float* s, int lane, const float* decay, const float* k) {
  static_assert(kSeg % 4 == 0, "a lane owns whole quads");
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  SPECSTATE_UNROLL
  for (int i = 0; i < kSeg / 4; ++i) {
    const int col = QuadColumn<kLanes>(lane, i);
    const Quad d = LoadQuad(decay + col);
    const Quad kq = LoadQuad(k + col);
    SPECSTATE_UNROLL
    for (int c = 0; c < 4; ++c) {
      s[4 * i + c] = s[4 * i + c] * d.x[c];
      acc[c] = MulAdd(s[4 * i + c], kq.x[c], acc[c]);
    }
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// S[v, :] += u * k over this lane's columns; returns this lane's share of
// sum_j S[v, j] * q[j] (after the update), or 0 when no output is wanted.
template <int kSeg, int kLanes>
SPECSTATE_HD float UpdateAndDotQ(float* s, int lane, float u, const float* k, const float* q,
                                 bool want_output) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  SPECSTATE_UNROLL
  for (int i = 0; i < kSeg / 4; ++i) {
    const int col = QuadColumn<kLanes>(lane, i);
    const Quad kq = LoadQuad(k + col);
    SPECSTATE_UNROLL
    for (int c = 0; c < 4; ++c) s[4 * i + c] = MulAdd(u, kq.x[c], s[4 * i + c]);
    if (want_output) {
      const Quad qq = LoadQuad(q + col);
      SPECSTATE_UNROLL
      for (int c = 0; c < 4; ++c) acc[c] = MulAdd(s[4 * i + c], qq.x[c], acc[c]);
    }
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// One token for this lane's share `s` (kSeg floats) of state row v.
// `lane_sum` adds a value over the kLanes lanes of the row, in a fixed order,
// and returns the total to every lane. Returns the row's output o_v (every
// lane gets it), or 0 when `want_output` is false (replay discards outputs:
// the state it computes is the same either way).
template <int kSeg, int kLanes, typename LaneSum>
SPECSTATE_HD float TokenStep(float* s, int lane, const TokenInputs& tok, float v, LaneSum lane_sum,
                             bool want_output) {
  const float kdot = lane_sum(DecayAndDotK<kSeg, kLanes>(s, lane, tok.decay, tok.k));
  const float u = DeltaCoefficient(v, kdot, tok.beta);
  const float partial = UpdateAndDotQ<kSeg, kLanes>(s, lane, u, tok.k, tok.q, want_output);
  return want_output ? lane_sum(partial) : 0.0f;
}

}  // namespace kda
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_KDA_MATH_H_
