// The FAST kernels on the CPU: the math of kernels/fast/fast_math.h (itself
// on kernels/kda_math.h's per-token definitions), one value head at a time,
// in fp32. The reference a CUDA implementation is tested against; also what
// measures, through FastNumerics, what bf16 operands would cost.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/device_status.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/cpu/fast_cpu.h"
#include "kernels/fast/fast_math.h"
#include "kernels/checks/commit_plan.h"
#include "kernels/checks/cpu_checker.h"
#include "kernels/checks/rows.h"
#include "kernels/fast/checks.h"
#include "kernels/internal/dispatch.h"
#include "kernels/kda_math.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

using ::specstate::fast::Decayed;
using ::specstate::fast::Dot;
using ::specstate::fast::FoldRow;
using ::specstate::fast::kMaxWindow;
using ::specstate::fast::NormalizeHead;
using ::specstate::fast::RingExponents;
using ::specstate::fast::SolveWindowRow;
using ::specstate::fast::WindowExponents;
using internal::CpuChecker;
using internal::DispatchKda;
using internal::IsBlock;
using Operands = FastNumerics::Operands;

float Bf16(float x) { return ToFloat(FromFloat<BFloat16>(x)); }

// x rounded to tf32 (fp32 with a 10-bit mantissa), to nearest even.
float Tf32(float x) {
  uint32_t u = FloatBits(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return x;
  u += 0xfffu + ((u >> 13) & 1u);
  return BitsToFloat(u & 0xffffe000u);
}

float RoundOperand(float x, Operands mode) {
  switch (mode) {
    case Operands::kFp32:
      return x;
    case Operands::kTf32:
    case Operands::kTf32Split:
      return Tf32(x);
    default:
      return Bf16(x);
  }
}

bool SplitsFirst(Operands m) {
  return m == Operands::kBf16SplitA || m == Operands::kBf16Split || m == Operands::kTf32Split;
}
bool SplitsSecond(Operands m) { return m == Operands::kBf16Split || m == Operands::kTf32Split; }

// `x` as the first (or second) operand of a product of the given precision:
// its high part, and its low part (zero unless split).
void SplitOperand(const float* x, int n, Operands mode, bool first, float* hi, float* lo) {
  const bool split = first ? SplitsFirst(mode) : SplitsSecond(mode);
  for (int j = 0; j < n; ++j) {
    const float value = x[j];  // x may be hi
    hi[j] = RoundOperand(value, mode);
    lo[j] = split ? RoundOperand(value - hi[j], mode) : 0.0f;
  }
}

// sum_j x[j] y[j] with the operands split as SplitOperand() left them: the
// high parts' product, then the low parts' corrections.
float SplitDot(const float* x_hi, const float* x_lo, const float* y_hi, const float* y_lo, int n,
               Operands mode) {
  float sum = Dot(x_hi, y_hi, n);
  const bool a = SplitsFirst(mode), b = SplitsSecond(mode);
  if (a && b) return sum + (Dot(x_lo, y_hi, n) + Dot(x_hi, y_lo, n));
  if (a) return sum + Dot(x_lo, y_hi, n);
  return sum;
}

void RoundInPlace(float* x, size_t n, bool bf16) {
  if (!bf16) return;
  for (size_t i = 0; i < n; ++i) x[i] = Bf16(x[i]);
}

// The layer's view of one block's ring.
template <typename Act>
struct RingView {
  const KdaShape* shape;
  const FastRings* rings;
  int32_t block;

  int64_t Token(int i) const { return int64_t{block} * rings->capacity + i; }
  Act* K(int i, int h) const {
    return static_cast<Act*>(rings->k) + Token(i) * RingKWidth(*shape) +
           int64_t{h} * shape->head_dim;
  }
  float* U(int i, int hv) const {
    return rings->u + Token(i) * RingUWidth(*shape) + int64_t{hv} * shape->head_dim;
  }
  // Value head hv's log-decay (KDA: its key head's K columns; GDN: one value).
  float* LogDecay(int i, int hv) const {
    const bool gdn = shape->kind == LayerKind::kGdn;
    return rings->log_decay + Token(i) * RingLogDecayWidth(*shape) +
           (gdn ? int64_t{hv} : int64_t{KeyHeadOf(*shape, hv)} * shape->head_dim);
  }
  FastCursor& Cursor() const { return rings->cursors[block]; }
};

kda::GateRule RuleOf(const KdaShape& shape, const LayerParams& params, int hv) {
  const bool kda_kind = shape.kind == LayerKind::kKda;
  return kda::GateRule{shape.kind, shape.gate,
                       kda_kind ? expf(params.a_log[KeyHeadOf(shape, hv)]) : 0.0f,
                       shape.lower_bound};
}

// The ring side of one value head: n ring tokens, decayed to the n-th.
//   kr [n][K]: kr_i = k_i * exp(H_i);  total [K]: Gc;  u [n][V].
template <typename Act, int K>
struct RingSide {
  std::vector<float> kr, total, u, suffix, prefix;

  void Load(const RingView<Act>& ring, int hv, int n, const FastNumerics& num) {
    const KdaShape& s = *ring.shape;
    const bool gdn = s.kind == LayerKind::kGdn;
    const int h = KeyHeadOf(s, hv);
    kr.resize(size_t(n) * K);
    u.resize(size_t(n) * K);
    suffix.resize(size_t(n));
    prefix.resize(size_t(n));
    total.assign(K, 0.0f);
    for (int i = 0; i < n; ++i) {
      float* k = &kr[size_t(i) * K];
      NormalizeHead(ring.K(i, h), K, 1.0f, k);
      RoundInPlace(k, K, num.ring_k_normalized_bf16);
      std::memcpy(&u[size_t(i) * K], ring.U(i, hv), sizeof(float) * K);
      RoundInPlace(&u[size_t(i) * K], K, num.ring_u_bf16);
    }
    // Per column (one column for GDN, the same for all): H_i and Gc.
    for (int j = 0; j < (gdn ? 1 : K); ++j) {
      const auto gamma = [&](int i) { return ring.LogDecay(i, hv)[j]; };
      float gc;
      if (num.ring_cumulative_log_decay) {
        // Emulated: G_i from the checkpoint, summed forward in fp32 as a
        // stored cumulative ring would hold them; exponents are differences.
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) prefix[i] = acc += gamma(i);
        gc = acc;
        for (int i = 0; i < n; ++i) suffix[i] = gc - prefix[i];
      } else {
        gc = RingExponents(n, gamma, suffix.data());
      }
      for (int jj = gdn ? 0 : j; jj < (gdn ? K : j + 1); ++jj) {
        total[jj] = gc;
        for (int i = 0; i < n; ++i) {
          kr[size_t(i) * K + jj] = Decayed(kr[size_t(i) * K + jj], suffix[i]);
        }
      }
    }
  }
};

// A head's state [V, K] in fp32, loaded from or stored to a block.
template <typename State, int K>
void LoadHead(const StatePool& pool, int32_t block, int hv, float* s) {
  const State* src = static_cast<const State*>(pool.data) + int64_t{block} * pool.block_stride +
                     int64_t{hv} * K * K;
  for (int i = 0; i < K * K; ++i) s[i] = ToFloat(src[i]);
}

template <typename State, int K>
void StoreHead(const float* s, State* dst) {
  for (int i = 0; i < K * K; ++i) dst[i] = FromFloat<State>(s[i]);
}

template <typename State, int K>
State* HeadOf(const StatePool& pool, int32_t block, int hv) {
  return static_cast<State*>(pool.data) + int64_t{block} * pool.block_stride + int64_t{hv} * K * K;
}

// The fold of one value head: the checkpoint s0 [V, K] advanced by the ring
// side's n tokens, into `out` [V, K] (fp32).
template <typename Act, int K>
void FoldHead(const float* s0, const RingSide<Act, K>& ring, int n, const FastNumerics& num,
              float* out) {
  // A tensor-core fold is the matmul U^T Kr with the operands as `fold` says.
  const size_t count = size_t(n) * K;
  std::vector<float> u_hi(count), u_lo(count), kr_hi(count), kr_lo(count);
  SplitOperand(ring.u.data(), static_cast<int>(count), num.fold, true, u_hi.data(), u_lo.data());
  SplitOperand(ring.kr.data(), static_cast<int>(count), num.fold, false, kr_hi.data(),
               kr_lo.data());
  const bool corrections = SplitsFirst(num.fold) || SplitsSecond(num.fold);
  std::vector<float> correction(K);
  for (int v = 0; v < K; ++v) {
    FoldRow(
        s0 + size_t(v) * K, ring.total.data(), K, n, [&](int i) { return u_hi[size_t(i) * K + v]; },
        [&](int i) { return &kr_hi[size_t(i) * K]; }, out + size_t(v) * K);
    if (!corrections) continue;
    std::fill(correction.begin(), correction.end(), 0.0f);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < K; ++j) {
        correction[j] = kda::MulAdd(u_lo[size_t(i) * K + v], kr_hi[size_t(i) * K + j],
                                    kda::MulAdd(u_hi[size_t(i) * K + v], kr_lo[size_t(i) * K + j],
                                                correction[j]));
      }
    }
    for (int j = 0; j < K; ++j) out[size_t(v) * K + j] += correction[j];
  }
}

// ---------------------------------------------------------------------------
// Verify.

template <typename Act, typename State, int K>
class VerifyWork {
 public:
  VerifyWork(const FastVerifyArgs& a, const FastNumerics& num) : a_(a), num_(num) {}

  // Row n: tokens [bos, bos + T) from block `block`.
  void Row(int64_t bos, int T, int32_t block) {
    const KdaShape& s = a_.shape;
    const RingView<Act> ring{&s, &a_.rings, block};
    const int c = ring.Cursor().tokens;
    const int HV = ValueHeads(s), H = s.num_heads;
    if (T == 0) {
      ring.Cursor().candidates = 0;
      return;
    }
    for (int hv = 0; hv < HV; ++hv) Head(ring, c, bos, T, hv);
    // The candidates' raw k (per key head) and, for KDA, their gammas (per
    // key head too): copied once per key head.
    const bool gdn = s.kind == LayerKind::kGdn;
    for (int t = 0; t < T; ++t) {
      for (int h = 0; h < H; ++h) {
        std::memcpy(ring.K(c + t, h),
                    static_cast<const Act*>(a_.k.data) + (bos + t) * a_.k.token_stride +
                        int64_t{h} * K,
                    sizeof(Act) * K);
      }
      if (!gdn) {
        for (int hv = 0; hv < HV; hv += HV / H) {
          std::memcpy(ring.LogDecay(c + t, hv), &gamma_by_key_head_[(size_t(t) * H + KeyHeadOf(s, hv)) * K],
                      sizeof(float) * K);
        }
      }
    }
    ring.Cursor().candidates = T;
  }

 private:
  void Head(const RingView<Act>& ring, int c, int64_t bos, int T, int hv) {
    const KdaShape& s = a_.shape;
    const bool gdn = s.kind == LayerKind::kGdn;
    const int h = KeyHeadOf(s, hv);
    const int HV = ValueHeads(s);
    const kda::GateRule rule = RuleOf(s, a_.params, hv);
    const float scale = kda::QueryScale(K);
    // The window: normalized q, k; gammas per column; v; beta.
    float qn[kMaxWindow][K], kn[kMaxWindow][K], gam[kMaxWindow][K], vw[kMaxWindow][K];
    float beta[kMaxWindow];
    gamma_by_key_head_.resize(size_t(kMaxWindow) * s.num_heads * K);
    for (int t = 0; t < T; ++t) {
      const int64_t tok = bos + t;
      NormalizeHead(static_cast<const Act*>(a_.q.data) + tok * a_.q.token_stride + int64_t{h} * K,
                    K, scale, qn[t]);
      NormalizeHead(static_cast<const Act*>(a_.k.data) + tok * a_.k.token_stride + int64_t{h} * K,
                    K, 1.0f, kn[t]);
      const Act* g = static_cast<const Act*>(a_.g.data) + tok * a_.g.token_stride +
                     (gdn ? int64_t{hv} : int64_t{h} * K);
      for (int j = 0; j < K; ++j) {
        gam[t][j] = gdn ? rule.LogDecay(ToFloat(g[0]), 0.0f)
                        : rule.LogDecay(ToFloat(g[j]), a_.params.dt_bias[int64_t{h} * K + j]);
      }
      const Act* v = static_cast<const Act*>(a_.v.data) + tok * a_.v.token_stride + int64_t{hv} * K;
      for (int j = 0; j < K; ++j) vw[t][j] = ToFloat(v[j]);
      beta[t] = rule.Beta(ToFloat(
          static_cast<const Act*>(a_.beta.data)[tok * a_.beta.token_stride + hv]));
      if (gdn) {
        ring_gamma_gdn_[t] = gam[t][0];
      } else {
        std::memcpy(&gamma_by_key_head_[(size_t(t) * s.num_heads + h) * K], gam[t],
                    sizeof(float) * K);
      }
    }
    // The ring side, decayed to the cursor.
    ring_.Load(ring, hv, c, num_);
    // Window exponents per column: W_t, E_{t,s}.
    float w[kMaxWindow][K];
    std::vector<float>& pair = pair_;  // [T][kMaxWindow][K]
    pair.assign(size_t(kMaxWindow) * kMaxWindow * K, 0.0f);
    {
      float g_col[kMaxWindow], w_col[kMaxWindow], pair_col[kMaxWindow * kMaxWindow];
      for (int j = 0; j < K; ++j) {
        for (int t = 0; t < T; ++t) g_col[t] = gam[t][j];
        WindowExponents(T, g_col, w_col, pair_col);
        for (int t = 0; t < T; ++t) {
          w[t][j] = w_col[t];
          for (int x = 0; x < t; ++x) {
            pair[(size_t(t) * kMaxWindow + x) * K + j] = pair_col[t * kMaxWindow + x];
          }
        }
      }
    }
    // Operands: kw, qw (ring products), kc, qc (checkpoint), window pairs.
    kw_.resize(size_t(T) * K);
    qw_.resize(size_t(T) * K);
    float kc[kMaxWindow][K], qc[kMaxWindow][K];
    for (int t = 0; t < T; ++t) {
      for (int j = 0; j < K; ++j) {
        kw_[size_t(t) * K + j] = Decayed(kn[t][j], w[t][j]);
        qw_[size_t(t) * K + j] = Decayed(qn[t][j], w[t][j]);
        kc[t][j] = Decayed(kn[t][j], ring_.total[j] + w[t][j]);
        qc[t][j] = Decayed(qn[t][j], ring_.total[j] + w[t][j]);
      }
    }
    float a[kMaxWindow * kMaxWindow] = {}, b[kMaxWindow * kMaxWindow] = {};
    {
      float ks[K];
      for (int t = 0; t < T; ++t) {
        for (int x = 0; x < t; ++x) {
          for (int j = 0; j < K; ++j) {
            ks[j] = Decayed(kn[x][j], pair[(size_t(t) * kMaxWindow + x) * K + j]);
          }
          a[t * kMaxWindow + x] = Dot(kn[t], ks, K);
          b[t * kMaxWindow + x] = Dot(qn[t], ks, K);
        }
        b[t * kMaxWindow + t] = Dot(qn[t], kn[t], K);
      }
    }
    // The ring's coefficients: A_r[t][i] = kw_t . kr_i, B_r[t][i] = qw_t . kr_i,
    // with the operands as `ring_keys` says.
    {
      const Operands m = num_.ring_keys;
      std::vector<float>& kr = ring_.kr;
      kr_lo_.resize(kr.size());
      kw_lo_.resize(kw_.size());
      qw_lo_.resize(qw_.size());
      SplitOperand(kw_.data(), static_cast<int>(kw_.size()), m, true, kw_.data(), kw_lo_.data());
      SplitOperand(qw_.data(), static_cast<int>(qw_.size()), m, true, qw_.data(), qw_lo_.data());
      SplitOperand(kr.data(), static_cast<int>(kr.size()), m, false, kr.data(), kr_lo_.data());
      ar_.resize(size_t(T) * c);
      br_.resize(size_t(T) * c);
      for (int t = 0; t < T; ++t) {
        for (int i = 0; i < c; ++i) {
          const size_t x = size_t(t) * K, y = size_t(i) * K;
          ar_[size_t(t) * c + i] = SplitDot(&kw_[x], &kw_lo_[x], &kr[y], &kr_lo_[y], K, m);
          br_[size_t(t) * c + i] = SplitDot(&qw_[x], &qw_lo_[x], &kr[y], &kr_lo_[y], K, m);
        }
      }
    }
    // ... and the values' operands as `ring_values` says.
    const Operands mv = num_.ring_values;
    const bool value_corrections = SplitsFirst(mv) || SplitsSecond(mv);
    ar_lo_.resize(ar_.size());
    br_lo_.resize(br_.size());
    u_lo_.resize(ring_.u.size());
    SplitOperand(ar_.data(), static_cast<int>(ar_.size()), mv, true, ar_.data(), ar_lo_.data());
    SplitOperand(br_.data(), static_cast<int>(br_.size()), mv, true, br_.data(), br_lo_.data());
    SplitOperand(ring_.u.data(), static_cast<int>(ring_.u.size()), mv, false, ring_.u.data(),
                 u_lo_.data());
    // The checkpoint's operands, split as the numerics say.
    s0_.resize(size_t(K) * K);
    s0_lo_.resize(size_t(K) * K);
    LoadHead<State, K>(a_.state, ring.block, hv, s0_.data());
    SplitOperand(s0_.data(), K * K, num_.checkpoint, true, s0_.data(), s0_lo_.data());
    float kc_hi[kMaxWindow][K], kc_lo[kMaxWindow][K], qc_hi[kMaxWindow][K], qc_lo[kMaxWindow][K];
    for (int t = 0; t < T; ++t) {
      SplitOperand(kc[t], K, num_.checkpoint, false, kc_hi[t], kc_lo[t]);
      SplitOperand(qc[t], K, num_.checkpoint, false, qc_hi[t], qc_lo[t]);
    }
    // Each state row: the checkpoint's and the ring's parts, then the window.
    Act* out = static_cast<Act*>(a_.out);
    float sk[kMaxWindow], sq[kMaxWindow], rk[kMaxWindow], rq[kMaxWindow], v_row[kMaxWindow];
    float u_row[kMaxWindow], o_row[kMaxWindow];
    std::vector<float> u_new(static_cast<size_t>(T) * K);
    for (int v = 0; v < K; ++v) {
      const float* s_hi = &s0_[size_t(v) * K];
      const float* s_lo = &s0_lo_[size_t(v) * K];
      for (int t = 0; t < T; ++t) {
        sk[t] = SplitDot(s_hi, s_lo, kc_hi[t], kc_lo[t], K, num_.checkpoint);
        sq[t] = SplitDot(s_hi, s_lo, qc_hi[t], qc_lo[t], K, num_.checkpoint);
        float rk_acc = 0.0f, rq_acc = 0.0f;
        for (int i = 0; i < c; ++i) {
          const float ui = ring_.u[size_t(i) * K + v];
          rk_acc = kda::MulAdd(ar_[size_t(t) * c + i], ui, rk_acc);
          rq_acc = kda::MulAdd(br_[size_t(t) * c + i], ui, rq_acc);
        }
        if (value_corrections) {
          float rk_lo = 0.0f, rq_lo = 0.0f;
          for (int i = 0; i < c; ++i) {
            const float ui = ring_.u[size_t(i) * K + v], ui_lo = u_lo_[size_t(i) * K + v];
            const size_t x = size_t(t) * c + i;
            rk_lo = kda::MulAdd(ar_lo_[x], ui, kda::MulAdd(ar_[x], ui_lo, rk_lo));
            rq_lo = kda::MulAdd(br_lo_[x], ui, kda::MulAdd(br_[x], ui_lo, rq_lo));
          }
          rk_acc += rk_lo;
          rq_acc += rq_lo;
        }
        rk[t] = rk_acc;
        rq[t] = rq_acc;
        v_row[t] = vw[t][v];
      }
      SolveWindowRow(T, sk, sq, rk, rq, a, b, v_row, beta, u_row, o_row);
      for (int t = 0; t < T; ++t) {
        out[((bos + t) * HV + hv) * K + v] = FromFloat<Act>(o_row[t]);
        u_new[size_t(t) * K + v] = u_row[t];
      }
    }
    for (int t = 0; t < T; ++t) {
      std::memcpy(ring.U(c + t, hv), &u_new[size_t(t) * K], sizeof(float) * K);
      if (gdn) *ring.LogDecay(c + t, hv) = ring_gamma_gdn_[t];
    }
  }

  const FastVerifyArgs& a_;
  const FastNumerics& num_;
  RingSide<Act, K> ring_;
  std::vector<float> pair_, kw_, qw_, ar_, br_, s0_, s0_lo_, gamma_by_key_head_;
  std::vector<float> kw_lo_, qw_lo_, kr_lo_, ar_lo_, br_lo_, u_lo_;
  float ring_gamma_gdn_[kMaxWindow];
};

// ---------------------------------------------------------------------------
// Folds (Commit, Materialize).

// The state of `block` after its first n ring tokens, per value head, in
// fp32: out [HV, V, K].
template <typename Act, typename State, int K>
void FoldBlock(const KdaShape& s, const FastLayer& layer, int32_t block, int n,
               const FastNumerics& num, std::vector<float>* out) {
  const RingView<Act> ring{&s, &layer.rings, block};
  const int HV = ValueHeads(s);
  out->resize(size_t(HV) * K * K);
  std::vector<float> s0(static_cast<size_t>(K) * K);
  RingSide<Act, K> side;
  for (int hv = 0; hv < HV; ++hv) {
    LoadHead<State, K>(layer.state, block, hv, s0.data());
    if (n == 0) {
      std::memcpy(out->data() + size_t(hv) * K * K, s0.data(), sizeof(float) * K * K);
      continue;
    }
    side.Load(ring, hv, n, num);
    FoldHead<Act, K>(s0.data(), side, n, num, out->data() + size_t(hv) * K * K);
  }
}

template <typename State, int K>
void StoreBlock(const KdaShape& s, const StatePool& pool, int32_t block,
                const std::vector<float>& state) {
  for (int hv = 0; hv < ValueHeads(s); ++hv) {
    StoreHead<State, K>(state.data() + size_t(hv) * K * K, HeadOf<State, K>(pool, block, hv));
  }
}

// Moves the ring slots [from, from + n) of `block` to [0, n) (k, u, gamma).
template <typename Act>
void MoveSlotsToFront(const KdaShape& s, const FastRings& rings, int32_t block, int from, int n) {
  if (from == 0 || n == 0) return;
  const int64_t base = int64_t{block} * rings.capacity;
  Act* k = static_cast<Act*>(rings.k);
  std::memmove(k + base * RingKWidth(s), k + (base + from) * RingKWidth(s),
               sizeof(Act) * n * RingKWidth(s));
  std::memmove(rings.u + base * RingUWidth(s), rings.u + (base + from) * RingUWidth(s),
               sizeof(float) * n * RingUWidth(s));
  std::memmove(rings.log_decay + base * RingLogDecayWidth(s),
               rings.log_decay + (base + from) * RingLogDecayWidth(s),
               sizeof(float) * n * RingLogDecayWidth(s));
}

// A fault of the checks, as the kernel interface reports it (DeviceStatus).
absl::Status Refused(const internal::RowFault& f, int row, int other_row, const char* op) {
  return DeviceStatusToStatus(internal::StatusFromFault(f, row, other_row), op);
}

}  // namespace

// ---------------------------------------------------------------------------
// The work, after the checks (fast_cpu.h).

void RunFastVerifyCpu(const FastVerifyArgs& a, const FastNumerics& num) {
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    constexpr int K = decltype(head_dim)::value;
    VerifyWork<Act, State, K> work(a, num);
    for (int n = 0; n < a.num_rows; ++n) {
      const int32_t b = a.state_indices[n];
      if (!IsBlock(b)) continue;
      const int T = a.query_start_loc[n + 1] - a.query_start_loc[n];
      work.Row(a.query_start_loc[n], T, b);
    }
  });
}

void RunFastCommitCpu(const FastCommitArgs& a, const CommitPlanRow* plan,
                      const FastNumerics& num) {
  const int Q = a.spec_query_len;
  const auto in_ring = [](const CommitPlanRow& p) {
    return p.final_block == p.source && !IsBlock(p.boundary_block);
  };
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    constexpr int K = decltype(head_dim)::value;
    std::vector<float> boundary_state, final_state;
    for (int l = 0; l < a.num_layers; ++l) {
      const FastLayer& layer = a.layers[l];
      for (int i = 0; i < a.num_rows; ++i) {
        const CommitPlanRow& p = plan[i];
        if (!IsBlock(p.source)) continue;
        FastCursor& cursor = layer.rings.cursors[p.source];
        if (!internal::CommitsAnything(p)) {
          cursor.candidates = 0;
          continue;
        }
        if (in_ring(p)) {
          cursor.tokens += p.commit_len;
          cursor.candidates = 0;
          if (cursor.tokens + Q > layer.rings.capacity) {
            FoldBlock<Act, State, K>(a.shape, layer, p.source, cursor.tokens, num, &final_state);
            StoreBlock<State, K>(a.shape, layer.state, p.source, final_state);
            cursor.tokens = 0;
          }
          continue;
        }
        // Align mode, leaving the block or crossing a boundary: real states.
        const bool boundary = IsBlock(p.boundary_block) && p.boundary_len < p.commit_len;
        if (boundary) {
          FoldBlock<Act, State, K>(a.shape, layer, p.source, cursor.tokens + p.boundary_len, num,
                                   &boundary_state);
        }
        FoldBlock<Act, State, K>(a.shape, layer, p.source, cursor.tokens + p.commit_len, num,
                                 &final_state);
        cursor.candidates = 0;
        if (boundary) {
          StoreBlock<State, K>(a.shape, layer.state, p.boundary_block, boundary_state);
          layer.rings.cursors[p.boundary_block] = FastCursor{0, 0};
        }
        StoreBlock<State, K>(a.shape, layer.state, p.final_block, final_state);
        layer.rings.cursors[p.final_block] = FastCursor{0, 0};
      }
      if (a.test_hook != nullptr) a.test_hook("layer");
    }
  });
}

void RunFastMaterializeCpu(const FastMaterializeArgs& a, const FastNumerics& num) {
  DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    constexpr int K = decltype(head_dim)::value;
    std::vector<float> folded;
    bool hooked = false;
    const int64_t block_elems = int64_t{ValueHeads(a.shape)} * K * K;
    for (int l = 0; l < a.num_layers; ++l) {
      if (a.layer >= 0 && l != a.layer) continue;
      const FastLayer& layer = a.layers[l];
      const int64_t count = a.every_block ? layer.state.num_blocks : a.num_blocks_given;
      for (int64_t i = 0; i < count; ++i) {
        const int32_t b = a.every_block ? static_cast<int32_t>(i) : a.blocks[i];
        if (!IsBlock(b)) continue;
        FastCursor& cursor = layer.rings.cursors[b];
        if (a.out != nullptr) {
          FoldBlock<Act, State, K>(a.shape, layer, b, cursor.tokens, num, &folded);
          State* dst = static_cast<State*>(a.out) + i * block_elems;
          for (int64_t e = 0; e < block_elems; ++e) dst[e] = FromFloat<State>(folded[e]);
          continue;
        }
        if (a.discard) {
          cursor = FastCursor{0, 0};
          continue;
        }
        if (cursor.tokens == 0) continue;  // (a block listed twice: folded once)
        FoldBlock<Act, State, K>(a.shape, layer, b, cursor.tokens, num, &folded);
        StoreBlock<State, K>(a.shape, layer.state, b, folded);
        // The last Verify's candidates stay: their u holds against the state
        // they follow, which the fold changes only by its rounding.
        MoveSlotsToFront<Act>(a.shape, layer.rings, b, cursor.tokens, cursor.candidates);
        cursor.tokens = 0;
      }
      if (a.test_hook != nullptr && a.out == nullptr && !a.discard && !hooked) {
        hooked = true;
        a.test_hook("flush:taken");
      }
    }
  });
}

// ---------------------------------------------------------------------------
// The direct calls: their host checks, the device checks of checks.h (as
// the kernel interface runs them, with the same messages), then the work.

absl::Status FastVerifyCpu(const FastVerifyArgs& a, const FastNumerics& num) {
  constexpr const char* op = "FastVerify";
  absl::Status st = ValidateFastVerifyArgs(a);
  if (!st.ok()) return st;
  DeviceStatus status = internal::OkStatus();
  std::vector<int> tokens(a.num_rows);
  std::vector<int32_t> owner(a.state.num_blocks, 0);
  if (!CpuChecker::Rows(a.num_rows, &status, [&](int n) {
        internal::RowFault f = internal::CheckRowTokens(
            a.query_start_loc, n, a.num_rows, a.spec_query_len, a.num_tokens, &tokens[n]);
        if (f.problem != 0) return f;
        return internal::CheckBlock(CheckedField::kStateIndices, a.state_indices[n],
                                    a.state.num_blocks, n, -1);
      }) ||
      !CheckFastVerify<CpuChecker>(
          a.rings, a.num_rows, owner.data(), &status, [&](int n) { return a.state_indices[n]; },
          [&](int n) { return tokens[n]; })) {
    return DeviceStatusToStatus(status, op);
  }
  RunFastVerifyCpu(a, num);
  return absl::OkStatus();
}

absl::Status FastCommitCpu(const FastCommitArgs& a, const FastNumerics& num) {
  constexpr const char* op = "FastCommit";
  absl::Status st = ValidateFastCommitArgs(a);
  if (!st.ok()) return st;
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  // The plan and its checks exactly as every commit's (commit_plan.h), then
  // FAST's own (checks.h), as the kernel interface runs them.
  DeviceStatus status;
  CommitArgs plan_args = PlanArgsOf(a);
  plan_args.status = &status;
  std::vector<CommitPlanRow> plan(a.num_rows);
  std::vector<int32_t> owner(num_blocks, 0);
  const internal::CommitWorkspace ws{owner.data(), plan.data(), nullptr};
  if (!internal::CheckCommitPlan<CpuChecker>(plan_args, ws, num_blocks) ||
      !CheckFastCommit<CpuChecker>(plan_args, ws, a.num_layers,
                                   [&](int l) { return a.layers[l].rings; })) {
    return DeviceStatusToStatus(status, op);
  }
  RunFastCommitCpu(a, plan.data(), num);
  return absl::OkStatus();
}

absl::Status FastMaterializeCpu(const FastMaterializeArgs& a, const FastNumerics& num) {
  constexpr const char* op = "FastMaterialize";
  absl::Status st = ValidateFastMaterializeArgs(a);
  if (!st.ok()) return st;
  const int64_t num_blocks = a.layers[0].state.num_blocks;
  std::vector<int32_t> checked(a.every_block ? num_blocks : a.num_blocks_given);
  for (int64_t i = 0; i < static_cast<int64_t>(checked.size()); ++i) {
    if (a.every_block) {
      checked[i] = static_cast<int32_t>(i);
      continue;
    }
    const internal::RowFault f =
        internal::CheckListedBlock(a.blocks, checked.data(), i, num_blocks);
    if (f.problem != 0) return Refused(f, i, -1, op);
  }
  for (size_t i = 0; i < checked.size(); ++i) {
    if (!IsBlock(checked[i])) continue;
    for (int l = 0; l < a.num_layers; ++l) {
      if (a.layer >= 0 && l != a.layer) continue;
      const internal::RowFault f = CheckFastCursor(a.layers[l].rings, checked[i], l);
      if (f.problem != 0) return Refused(f, -1, -1, op);
    }
  }
  FastMaterializeArgs work = a;
  work.blocks = checked.data();
  RunFastMaterializeCpu(work, num);
  return absl::OkStatus();
}

}  // namespace fast
}  // namespace kernels
}  // namespace specstate
