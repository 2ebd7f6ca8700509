// The recurrence on the CPU, shared by the stock kernel, Verify (EAGER and
// DEFERRED) and every replay (EAGER's commit, DEFERRED's lists): the
// per-token math of kernels/kda_math.h with one lane per state row, so
// verify's outputs equal the stock kernel's and the replayed states equal
// the stock kernel's stored states bit for bit (the same code, compiled
// with the same flags: -ffp-contract=off keeps the instruction sequences).
//
//   RunStockLayer<Act, State, K>(work, num_rows, [&](int n, int64_t* bos, int* tokens,
//                                                    int32_t* source, const int32_t** idx) {...});
#ifndef SPECSTATE_KERNELS_COMMON_CPU_RECURRENCE_H_
#define SPECSTATE_KERNELS_COMMON_CPU_RECURRENCE_H_

#include <math.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/checks/rows.h"
#include "kernels/checks/verify_rows.h"
#include "kernels/kda_args.h"
#include "kernels/kda_math.h"
#include "kernels/numeric.h"

namespace specstate {
namespace kernels {
namespace common {

using internal::IsBlock;

// The prepared inputs (kda::TokenInputs) of `tokens` tokens of one head.
struct PreparedHead {
  std::vector<float> q, k, decay, v, beta;
};

// The gate rule of value head `hv` (its key head's parameters for KDA).
inline kda::GateRule RuleOf(const KdaShape& shape, const LayerParams& params, int hv) {
  const bool kda = shape.kind == LayerKind::kKda;
  const int h = KeyHeadOf(shape, hv);
  return kda::GateRule{shape.kind, shape.gate, kda ? expf(params.a_log[h]) : 0.0f,
                       shape.lower_bound};
}

// Value head hv's prepared inputs (q and k of its key head).
template <typename Act, int K>
void PrepareHead(const KdaShape& shape, const Activation& q, const Activation& k,
                 const Activation& v, const Activation& g, const Activation& beta,
                 const LayerParams& params, int hv, int64_t bos, int tokens, PreparedHead* out) {
  out->q.resize(size_t(tokens) * K);
  out->k.resize(size_t(tokens) * K);
  out->decay.resize(size_t(tokens) * K);
  out->v.resize(size_t(tokens) * K);
  out->beta.resize(tokens);
  const float scale = kda::QueryScale(K);
  const int h = KeyHeadOf(shape, hv);
  const bool gdn = shape.kind == LayerKind::kGdn;
  const kda::GateRule rule = RuleOf(shape, params, hv);
  const float* bias = gdn ? nullptr : params.dt_bias + int64_t{h} * K;
  for (int t = 0; t < tokens; ++t) {
    const int64_t tok = bos + t;
    const Act* qt = static_cast<const Act*>(q.data) + tok * q.token_stride + int64_t{h} * K;
    const Act* kt = static_cast<const Act*>(k.data) + tok * k.token_stride + int64_t{h} * K;
    const Act* vt = static_cast<const Act*>(v.data) + tok * v.token_stride + int64_t{hv} * K;
    const Act* gt = static_cast<const Act*>(g.data) + tok * g.token_stride +
                    (gdn ? int64_t{hv} : int64_t{h} * K);
    const Act* bt = static_cast<const Act*>(beta.data) + tok * beta.token_stride + hv;
    float* qo = &out->q[size_t(t) * K];
    float* ko = &out->k[size_t(t) * K];
    float q_sum = 0.0f, k_sum = 0.0f;
    for (int j = 0; j < K; ++j) {
      qo[j] = ToFloat(qt[j]);
      ko[j] = ToFloat(kt[j]);
      q_sum = kda::MulAdd(qo[j], qo[j], q_sum);
      k_sum = kda::MulAdd(ko[j], ko[j], k_sum);
    }
    const float q_norm = kda::L2Norm(q_sum);
    const float k_norm = kda::L2Norm(k_sum);
    for (int j = 0; j < K; ++j) {
      qo[j] = kda::Normalize(qo[j], q_norm, scale);
      ko[j] = kda::Normalize(ko[j], k_norm, 1.0f);
      out->decay[size_t(t) * K + j] = rule.Decay(ToFloat(gt[gdn ? 0 : j]), gdn ? 0.0f : bias[j]);
      out->v[size_t(t) * K + j] = ToFloat(vt[j]);
    }
    out->beta[t] = rule.Beta(ToFloat(bt[0]));
  }
}

// One head's state [V, K] in fp32 while it runs tokens: loaded once from a
// block, stored (rounded to the state dtype) wherever the tokens say.
template <int K>
class HeadRecurrence {
 public:
  static constexpr int V = K;

  template <typename State>
  void Load(const State* block) {
    for (size_t i = 0; i < s_.size(); ++i) s_[i] = ToFloat(block[i]);
  }

  template <typename State>
  void Store(State* block) const {
    for (size_t i = 0; i < s_.size(); ++i) block[i] = FromFloat<State>(s_[i]);
  }

  // The state as a later call that loads it from the pool will see it:
  // rounded to the state dtype and back (exact for fp32).
  template <typename State>
  void RoundTo() {
    for (float& x : s_) x = ToFloat(FromFloat<State>(x));
  }

  // Tokens [0, tokens) of `prep`. `output(t, v, o)` receives o_v of token t
  // (when want_output); after token t the state goes to destination(t) when
  // that is not null.
  template <typename State, typename Output, typename Destination>
  void Run(const PreparedHead& prep, int tokens, bool want_output, Output output,
           Destination destination) {
    const auto row_sum = [](float x) { return x; };  // one lane per row
    for (int t = 0; t < tokens; ++t) {
      const kda::TokenInputs tok{&prep.q[size_t(t) * K], &prep.k[size_t(t) * K],
                                 &prep.decay[size_t(t) * K], prep.beta[t]};
      for (int v = 0; v < V; ++v) {
        const float o = kda::TokenStep<K, 1>(&s_[size_t(v) * K], 0, tok, prep.v[size_t(t) * K + v],
                                             row_sum, want_output);
        if (want_output) output(t, v, o);
      }
      if (State* dst = destination(t)) Store(dst);
    }
  }

 private:
  std::vector<float> s_ = std::vector<float>(size_t(V) * K);
};

// Runs `tokens` tokens of one head from `initial` ([V, K] of the state dtype).
template <typename State, int K, typename Output, typename Destination>
void RunHead(const PreparedHead& prep, const State* initial, int tokens, bool want_output,
             Output output, Destination destination) {
  HeadRecurrence<K> head;
  head.Load(initial);
  head.template Run<State>(prep, tokens, want_output, output, destination);
}

template <typename State>
State* HeadOf(const StatePool& pool, int32_t block, int h, int head_elems) {
  return static_cast<State*>(pool.data) + int64_t{block} * pool.block_stride +
         int64_t{h} * head_elems;
}

// The stock kernel's work for one layer: rows [0, num_rows) as `row_of`
// describes them. Shared by Stock and the commit's replay, which is this
// kernel over the records.
struct StockLayerWork {
  KdaShape shape;
  Activation q, k, v, g, beta;
  void* out;  // null: outputs are discarded (replay)
  StatePool state;
  LayerParams params;
};

template <typename Act, typename State, int K, typename RowOf>
void RunStockLayer(const StockLayerWork& w, int num_rows, RowOf row_of) {
  const int H = ValueHeads(w.shape);
  PreparedHead prep;
  for (int n = 0; n < num_rows; ++n) {
    int64_t bos = 0;
    int tokens = 0;
    int32_t source = 0;
    const int32_t* idx = nullptr;
    row_of(n, &bos, &tokens, &source, &idx);
    if (tokens == 0 || !IsBlock(source)) continue;
    for (int h = 0; h < H; ++h) {
      PrepareHead<Act, K>(w.shape, w.q, w.k, w.v, w.g, w.beta, w.params, h, bos, tokens, &prep);
      Act* out = static_cast<Act*>(w.out);
      RunHead<State, K>(
          prep, HeadOf<State>(w.state, source, h, K * K), tokens, out != nullptr,
          [&](int t, int v, float o) { out[((bos + t) * H + h) * K + v] = FromFloat<Act>(o); },
          [&](int t) -> State* {
            return IsBlock(idx[t]) ? HeadOf<State>(w.state, idx[t], h, K * K) : nullptr;
          });
    }
  }
}

// ---------------------------------------------------------------------------
// The records as the replay reads them.

// Records buffer `buffer` (0: records, 1: records_alt; DEFERRED alternates).
inline const Records& RecordsOf(const CommitLayer& layer, int buffer) {
  return buffer == 0 ? layer.records : layer.records_alt;
}

// The stock kernel reads the records as its q/k/v/g/beta (q = k = recorded k).
inline StockLayerWork ReplayWork(const KdaShape& shape, const CommitLayer& layer,
                                 const Records& records) {
  const size_t es = DTypeSize(shape.act_dtype);
  const int64_t width = RecordTokenWidth(shape);
  StockLayerWork w;
  w.shape = shape;
  w.k = Activation{records.kv, width};
  w.q = w.k;
  w.v = Activation{static_cast<const char*>(records.kv) + KeyWidth(shape) * es, width};
  w.g = Activation{records.g, GateWidth(shape)};
  w.beta = Activation{records.beta, ValueHeads(shape)};
  w.out = nullptr;
  w.state = layer.state;
  w.params = layer.params;
  return w;
}

// ---------------------------------------------------------------------------
// Verify.

// Copies row n's raw k (per key head), v and beta (per value head) and g
// (KDA: per key head, [K]; GDN: per value head, a scalar), bit for bit, to
// record tokens [n * Q, n * Q + tokens).
template <typename Act, int K>
void RecordWindow(const VerifyArgs& a, const Records& records, int n, int64_t bos, int tokens) {
  const KdaShape& s = a.shape;
  const int H = s.num_heads;
  const int HV = ValueHeads(s);
  const int64_t width = RecordTokenWidth(s);
  const int64_t gate_width = GateWidth(s);
  const size_t head_bytes = size_t(K) * sizeof(Act);
  Act* kv = static_cast<Act*>(records.kv);
  Act* g = static_cast<Act*>(records.g);
  Act* beta = static_cast<Act*>(records.beta);
  const Act* gin = static_cast<const Act*>(a.g.data);
  for (int t = 0; t < tokens; ++t) {
    const int64_t tok = bos + t;
    const int64_t rec = int64_t{n} * a.records.q + t;
    for (int h = 0; h < H; ++h) {
      std::memcpy(kv + rec * width + int64_t{h} * K,
                  static_cast<const Act*>(a.k.data) + tok * a.k.token_stride + int64_t{h} * K,
                  head_bytes);
    }
    for (int hv = 0; hv < HV; ++hv) {
      std::memcpy(kv + rec * width + KeyWidth(s) + int64_t{hv} * K,
                  static_cast<const Act*>(a.v.data) + tok * a.v.token_stride + int64_t{hv} * K,
                  head_bytes);
      beta[rec * HV + hv] = static_cast<const Act*>(a.beta.data)[tok * a.beta.token_stride + hv];
    }
    std::memcpy(g + rec * gate_width, gin + tok * a.g.token_stride,
                size_t(gate_width) * sizeof(Act));
  }
}

// Verify's work after its checks (EAGER, and DEFERRED with its pending
// tokens first): per row and value head, the checkpoint loaded into fp32,
// before(n, h, head, checkpoint) (DEFERRED: the pending tokens replayed, the
// checkpoint stored and read back), then the window's outputs (no state is
// stored); then the window's raw inputs to `records`. A row with no block,
// or with no tokens and extra(n) == 0 (DEFERRED: none pending), is skipped.
template <typename Act, typename State, int K, typename Extra, typename Before>
void VerifyRows(const VerifyArgs& a, const std::vector<internal::VerifyRow>& rows,
                const Records& records, Extra extra, Before before) {
  const int32_t* const qsl = internal::VerifiedQueryStartLoc(a);
  const int H = ValueHeads(a.shape);
  PreparedHead prep;
  Act* out = static_cast<Act*>(a.out);
  for (int n = 0; n < a.num_rows; ++n) {
    const int tokens = rows[n].tokens;
    if ((tokens == 0 && extra(n) == 0) || !IsBlock(rows[n].source)) continue;
    const int64_t bos = qsl[n];
    for (int h = 0; h < H; ++h) {
      State* const checkpoint = HeadOf<State>(a.state, rows[n].source, h, K * K);
      HeadRecurrence<K> head;
      head.Load(checkpoint);
      before(n, h, head, checkpoint);
      PrepareHead<Act, K>(a.shape, a.q, a.k, a.v, a.g, a.beta, a.params, h, bos, tokens, &prep);
      head.template Run<State>(
          prep, tokens, true,
          [&](int t, int v, float o) { out[((bos + t) * H + h) * K + v] = FromFloat<Act>(o); },
          [](int) -> State* { return nullptr; });  // the window's states are not stored
    }
    RecordWindow<Act, K>(a, records, n, bos, tokens);
  }
}

}  // namespace common
}  // namespace kernels
}  // namespace specstate

#endif  // SPECSTATE_KERNELS_COMMON_CPU_RECURRENCE_H_
