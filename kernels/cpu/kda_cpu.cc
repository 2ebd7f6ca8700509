// The CPU backend: the same functions as the CUDA backend, on host memory,
// computed on the calling thread. It runs the per-token math of
// kernels/kda_math.h with one lane per state row, and the per-row checks and
// plan of kernels/internal/checks.h, so it accepts, rejects and plans exactly
// as the CUDA backend does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "kernels/fast/cpu/fast_cpu.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/from_interface.h"
#include "kernels/internal/checks.h"
#include "kernels/internal/journal.h"
#include "kernels/internal/dispatch.h"
#include "kernels/kda_kernels.h"
#include "kernels/kda_math.h"

namespace specstate {
namespace kernels {
namespace {

using internal::DispatchAct;
using internal::DispatchKda;
using internal::IsBlock;
using internal::RowFault;

// The status mirror's contract (kda_args.h): written only when a check failed.
void PublishStatus(const DeviceStatus& status, DeviceStatus* mirror) {
  if (mirror != nullptr && status.failed != 0) *mirror = status;
}

// ---------------------------------------------------------------------------
// Checks.

// Runs `check(n)` for every row and writes the fault of the lowest failing
// row to `status`. Returns whether every row passed.
template <typename Check>
bool CheckRows(int num_rows, DeviceStatus* status, Check check) {
  for (int n = 0; n < num_rows; ++n) {
    const RowFault f = check(n);
    if (f.problem != 0) {
      *status = internal::StatusFromFault(f, n, -1);
      return false;
    }
  }
  return true;
}

// The cross-row pass (see checks.h): no block written by two rows, none
// written by one row and read by another. `owner` is all zero on entry and
// on return.
template <typename Writes, typename Reads>
bool CheckCrossRow(int num_rows, int32_t* owner, DeviceStatus* status, Writes writes,
                   Reads reads) {
  for (int n = 0; n < num_rows; ++n) {
    writes(n, [&](int32_t block, CheckedField, int32_t, int32_t) {
      owner[block] = std::max(owner[block], internal::OwnerTag(n));
    });
  }
  bool ok = true;
  for (int n = 0; n < num_rows && ok; ++n) {
    writes(n, [&](int32_t block, CheckedField field, int32_t index, int32_t col) {
      const int other = internal::OwnerRow(owner[block]);
      if (ok && other != n) {
        *status = internal::StatusFromFault(
            internal::MakeFault(field, CheckProblem::kDuplicateWrite, index, col, block, 0), n,
            other);
        ok = false;
      }
    });
    reads(n, [&](int32_t block, CheckedField field, int32_t index, int32_t col) {
      if (ok && owner[block] != 0 && internal::OwnerRow(owner[block]) != n) {
        *status = internal::StatusFromFault(
            internal::MakeFault(field, CheckProblem::kWriteOfRead, index, col, block, 0), n,
            internal::OwnerRow(owner[block]));
        ok = false;
      }
    });
  }
  for (int n = 0; n < num_rows; ++n) {
    writes(n, [&](int32_t block, CheckedField, int32_t, int32_t) { owner[block] = 0; });
  }
  return ok;
}

// FAST: no two rows use one block (`block_of(n)`; null blocks skipped): the
// lowest row using a block owns it, and the first other row using it is the
// fault. `owner` is all zero on entry and on return.
template <typename BlockOf>
bool CheckOneRowABlock(int num_rows, int32_t* owner, DeviceStatus* status, BlockOf block_of) {
  for (int n = 0; n < num_rows; ++n) {
    const int32_t b = block_of(n);
    if (IsBlock(b)) owner[b] = std::max(owner[b], internal::OwnerTag(n));
  }
  bool ok = true;
  for (int n = 0; n < num_rows && ok; ++n) {
    const int32_t b = block_of(n);
    if (!IsBlock(b) || internal::OwnerRow(owner[b]) == n) continue;
    *status = internal::StatusFromFault(internal::FastSharedFault(b, n), n,
                                        internal::OwnerRow(owner[b]));
    ok = false;
  }
  for (int n = 0; n < num_rows; ++n) {
    const int32_t b = block_of(n);
    if (IsBlock(b)) owner[b] = 0;
  }
  return ok;
}

// False (with the status written) when a prerequisite failed.
bool PrerequisitesPassed(const Prerequisites& p, DeviceStatus* status) {
  const RowFault f = internal::CheckPrerequisites(p);
  if (f.problem == 0) return true;
  *status = internal::StatusFromFault(f, -1, -1);
  return false;
}

// False (with the status written) when loading the inputs faulted.
bool InputsIntact(const uint32_t* input_fault, DeviceStatus* status) {
  const RowFault f = internal::CheckInputFault(input_fault);
  if (f.problem == 0) return true;
  *status = internal::StatusFromFault(f, -1, -1);
  return false;
}

// ---------------------------------------------------------------------------
// The recurrence of one (row, head).

// The prepared inputs (kda::TokenInputs) of `tokens` tokens of one head.
struct PreparedHead {
  std::vector<float> q, k, decay, v, beta;
};

// The gate rule of value head `hv` (its key head's parameters for KDA).
kda::GateRule RuleOf(const KdaShape& shape, const LayerParams& params, int hv) {
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
      out->decay[size_t(t) * K + j] =
          rule.Decay(ToFloat(gt[gdn ? 0 : j]), gdn ? 0.0f : bias[j]);
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
        const float o = kda::TokenStep<K, 1>(&s_[size_t(v) * K], 0, tok,
                                             prep.v[size_t(t) * K + v], row_sum, want_output);
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

// ---------------------------------------------------------------------------
// Stock kernel.

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
          [&](int t, int v, float o) {
            out[((bos + t) * H + h) * K + v] = FromFloat<Act>(o);
          },
          [&](int t) -> State* {
            return IsBlock(idx[t]) ? HeadOf<State>(w.state, idx[t], h, K * K) : nullptr;
          });
    }
  }
}

// ---------------------------------------------------------------------------
// Commit pieces.

// docs/semantics.md, Commit step 2, for one row of one layer.
template <typename Act>
void CompactConvRow(const ConvPool& c, int history_len, const CommitPlanRow& p, bool align,
                    std::vector<Act>* scratch) {
  if (!internal::CommitsAnything(p)) return;
  Act* base = static_cast<Act*>(c.data);
  const Act* src = base + int64_t{p.source} * c.block_stride;
  const bool boundary = align && IsBlock(p.boundary_block);
  // Read the row's windows before writing: final or boundary may be the source.
  scratch->resize(size_t(c.dim) * history_len * 2);
  Act* final_window = scratch->data();
  Act* boundary_window = final_window + size_t(c.dim) * history_len;
  for (int d = 0; d < c.dim; ++d) {
    for (int x = 0; x < history_len; ++x) {
      final_window[size_t(d) * history_len + x] =
          src[d * c.dim_stride + int64_t(p.commit_len - 1 + x) * c.token_stride];
      if (boundary) {
        boundary_window[size_t(d) * history_len + x] =
            src[d * c.dim_stride + int64_t(p.boundary_len - 1 + x) * c.token_stride];
      }
    }
  }
  Act* dst = base + int64_t{p.final_block} * c.block_stride;
  Act* bdst = base + int64_t{p.boundary_block} * c.block_stride;
  for (int d = 0; d < c.dim; ++d) {
    for (int x = 0; x < history_len; ++x) {
      if (boundary) {
        bdst[d * c.dim_stride + x * c.token_stride] = boundary_window[size_t(d) * history_len + x];
      }
      dst[d * c.dim_stride + x * c.token_stride] = final_window[size_t(d) * history_len + x];
    }
  }
}

// Records buffer `buffer` (0: records, 1: records_alt; DEFERRED alternates).
const Records& RecordsOf(const CommitLayer& layer, int buffer) {
  return buffer == 0 ? layer.records : layer.records_alt;
}

// The stock kernel reads the records as its q/k/v/g/beta (q = k = recorded k).
StockLayerWork ReplayWork(const KdaShape& shape, const CommitLayer& layer,
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

// Runs a replay list (ReplayJob: one layer's replay of one row), each as
// the stock kernel over the records, like the commit's replay.
void RunReplayJobs(const KdaShape& shape, const CommitLayer* layers, int q,
                   const std::vector<ReplayJob>& jobs) {
  DispatchKda(shape, [&](auto act, auto state, auto head_dim) {
    using Act = typename decltype(act)::type;
    using State = typename decltype(state)::type;
    for (const ReplayJob& job : jobs) {
      const CommitLayer& layer = layers[job.layer];
      RunStockLayer<Act, State, decltype(head_dim)::value>(
          ReplayWork(shape, layer, RecordsOf(layer, job.buffer)), 1,
          [&](int, int64_t* bos, int* tokens, int32_t* source, const int32_t** idx) {
            *bos = int64_t{job.record_row} * q;
            *source = job.indices[q];
            *idx = job.indices;
            *tokens = internal::ReplayTokens(job.indices, q);
          });
    }
  });
}

// The list also goes to the call's ReplayJobs, as the CUDA backend leaves it.
void PublishJobs(const std::vector<ReplayJob>& jobs, const ReplayJobs& out) {
  if (out.count == nullptr) return;
  *out.count = static_cast<int32_t>(jobs.size());
  if (!jobs.empty()) std::memcpy(out.jobs, jobs.data(), jobs.size() * sizeof(ReplayJob));
}

// DEFERRED Commit, after its checks: what the previous commit left pending
// that no Verify took is materialized (replay jobs), rows that are not
// deferred are replayed now (jobs), and the deferred rows' tokens become
// the pending entries, in the records buffer this step's Verify calls wrote.
std::vector<ReplayJob> DeferCommit(const CommitArgs& a, const CommitPlanRow* plan) {
  const PendingBlocks& p = a.pending;
  const int q = a.spec_query_len;
  const int32_t buffer = *internal::PendingBufferWord(p);  // the previous commit's records
  std::vector<ReplayJob> jobs;
  const int32_t* list = internal::PendingList(p);
  for (int j = 0; j < *internal::PendingListSize(p); ++j) {
    for (int l = 0; l < p.num_layers; ++l) {
      int32_t& entry = internal::PendingEntriesOf(p, l)[list[j]];
      if (entry == 0) continue;
      jobs.push_back(internal::PendingJob(l, list[j], internal::UnpackPending(entry), q));
      entry = 0;
    }
  }
  for (int i = 0; i < a.num_rows; ++i) {
    if (!internal::CommitsAnything(plan[i]) || internal::DefersCommit(plan[i])) continue;
    for (int l = 0; l < a.num_layers; ++l) {
      jobs.push_back(internal::CommitJob(l, plan[i], i, 1 - buffer, q));
    }
  }
  int32_t listed = 0;
  for (int i = 0; i < a.num_rows; ++i) {
    if (!internal::DefersCommit(plan[i])) continue;
    const int32_t entry = internal::PackPending(i, 1 - buffer, plan[i].commit_len);
    for (int l = 0; l < p.num_layers; ++l) {
      internal::PendingEntriesOf(p, l)[plan[i].source] = entry;
    }
    internal::PendingList(p)[listed++] = plan[i].source;
  }
  *internal::PendingListSize(p) = listed;
  *internal::PendingBufferWord(p) = 1 - buffer;
  PublishJobs(jobs, a.jobs);
  return jobs;
}

// ---------------------------------------------------------------------------

class CpuKernels final : public KdaKernels {
 public:
  Backend backend() const override { return Backend::kCpu; }

 protected:
  absl::Status LaunchStock(const StockArgs& a, Stream) const override {
    *a.status = internal::OkStatus();
    std::vector<internal::StockRow> rows(a.num_rows);
    if (!CheckRows(a.num_rows, a.status,
                   [&](int n) { return internal::CheckStockRow(a, n, &rows[n]); })) {
      return absl::OkStatus();
    }
    if (!CheckCrossRow(
            a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
            [&](int n, auto fn) { internal::ForEachStockWrite(a, rows[n], n, fn); },
            [&](int n, auto fn) { internal::ForEachStockRead(rows[n], n, fn); })) {
      return absl::OkStatus();
    }
    StockLayerWork w{a.shape, a.q, a.k, a.v, a.g, a.beta, a.out, a.state, a.params};
    DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
      using Act = typename decltype(act)::type;
      using State = typename decltype(state)::type;
      RunStockLayer<Act, State, decltype(head_dim)::value>(
          w, a.num_rows,
          [&](int n, int64_t* bos, int* tokens, int32_t* source, const int32_t** idx) {
            *bos = a.query_start_loc[n];
            *tokens = rows[n].tokens;
            *source = rows[n].source;
            *idx = a.ssm_state_indices.data + n * a.ssm_state_indices.row_stride;
          });
    });
    return absl::OkStatus();
  }

  absl::Status LaunchVerify(const VerifyArgs& a, Stream) const override {
    RunVerify(a);
    PublishStatus(*a.status, a.status_mirror);
    return absl::OkStatus();
  }

  void RunVerify(const VerifyArgs& a) const {
    *a.status = internal::OkStatus();
    if (!PrerequisitesPassed(a.prerequisites, a.status)) return;
    std::vector<RowFault> mismatch(a.num_rows);
    for (int n = 0; n < a.num_rows; ++n) {
      mismatch[n] = internal::SnapshotVerifyRow(a, n, internal::LoadVerifyRow(a, n));
    }
    if (!InputsIntact(a.prerequisites.input_fault, a.status)) return;
    std::vector<internal::VerifyRow> rows(a.num_rows);
    if (!CheckRows(a.num_rows, a.status, [&](int n) {
          return mismatch[n].problem != 0 ? mismatch[n] : internal::CheckVerifyRow(a, n, &rows[n]);
        })) {
      return;
    }
    if (a.fast.cursors != nullptr) {
      RunFastVerify(a, rows);
      return;
    }
    const bool deferred = a.pending.entries != nullptr;
    if (deferred && !TakePendingTokens(a, rows)) return;
    // DEFERRED: the pending tokens' records are in one buffer, this
    // window's go to the other.
    const int32_t pending_buffer = deferred ? *internal::PendingBufferWord(a.pending) : 1;
    const Records& records = pending_buffer == 1 ? a.records : a.records_alt;
    const Records& pending_records = pending_buffer == 1 ? a.records_alt : a.records;
    const int32_t* const qsl = internal::VerifiedQueryStartLoc(a);
    DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
      using Act = typename decltype(act)::type;
      using State = typename decltype(state)::type;
      constexpr int K = decltype(head_dim)::value;
      const int H = ValueHeads(a.shape);
      // DEFERRED: the pending tokens as the commit's replay reads them (EAGER
      // has no second buffer: nothing to read).
      const CommitLayer layer{a.state, {}, a.params, pending_records, {}};
      const StockLayerWork replay =
          deferred ? ReplayWork(a.shape, layer, pending_records) : StockLayerWork{};
      PreparedHead prep, pending_prep;
      Act* out = static_cast<Act*>(a.out);
      for (int n = 0; n < a.num_rows; ++n) {
        const int tokens = rows[n].tokens;
        const internal::PendingEntry pending =
            internal::UnpackPending(deferred ? a.replay_plan[n] : 0);
        if ((tokens == 0 && pending.tokens == 0) || !IsBlock(rows[n].source)) continue;
        const int64_t bos = qsl[n];
        for (int h = 0; h < H; ++h) {
          State* const checkpoint = HeadOf<State>(a.state, rows[n].source, h, K * K);
          HeadRecurrence<K> head;
          head.Load(checkpoint);
          if (pending.tokens > 0) {
            // The DEFERRED commit's replay, then the checkpoint stored once
            // (and read back as a later Verify would read it).
            PrepareHead<Act, K>(a.shape, replay.q, replay.k, replay.v, replay.g, replay.beta,
                                a.params, h, int64_t{pending.record_row} * a.records.q,
                                pending.tokens, &pending_prep);
            head.template Run<State>(pending_prep, pending.tokens, false, [](int, int, float) {},
                                     [](int) -> State* { return nullptr; });
            head.Store(checkpoint);
            head.template RoundTo<State>();
            if (h == 0 && a.pending.test_hook != nullptr) a.pending.test_hook("verify:replayed");
          }
          PrepareHead<Act, K>(a.shape, a.q, a.k, a.v, a.g, a.beta, a.params, h, bos, tokens,
                              &prep);
          head.template Run<State>(
              prep, tokens, true,
              [&](int t, int v, float o) {
                out[((bos + t) * H + h) * K + v] = FromFloat<Act>(o);
              },
              [](int) -> State* { return nullptr; });  // the window's states are not stored
        }
        RecordRow<Act, K>(a, records, n, bos, tokens);
      }
    });
    return;
  }

  // FAST Verify, after the checks every Verify runs: each row's block has a
  // cursor a Commit leaves and room in its ring for the window, and no two
  // rows verify from one block (their candidates would share its ring's
  // slots). Then kernels/fast's Verify on the checked snapshot.
  void RunFastVerify(const VerifyArgs& a, const std::vector<internal::VerifyRow>& rows) const {
    if (!CheckRows(a.num_rows, a.status, [&](int n) {
          return internal::CheckFastVerifyRow(a.fast, n, rows[n].source, rows[n].tokens);
        })) {
      return;
    }
    if (!CheckOneRowABlock(a.num_rows, static_cast<int32_t*>(a.workspace), a.status,
                           [&](int n) { return rows[n].source; })) {
      return;
    }
    fast::RunFastVerifyCpu(fast::FastVerifyArgsOf(a), fast::FastNumerics());
  }

  // DEFERRED Verify, after the other checks: no two rows may verify from a
  // block that has pending tokens in this layer (the first to run would
  // materialize it under the other). Then each row takes its block's entry
  // (replay_plan) and the table forgets it: the kernels replay it now.
  bool TakePendingTokens(const VerifyArgs& a, const std::vector<internal::VerifyRow>& rows) const {
    int32_t* const entries = internal::PendingEntriesOf(a.pending, a.layer);
    int32_t* const owner = static_cast<int32_t*>(a.workspace);
    for (int n = 0; n < a.num_rows; ++n) {
      if (IsBlock(rows[n].source)) {
        owner[rows[n].source] = std::max(owner[rows[n].source], internal::OwnerTag(n));
      }
    }
    bool ok = true;
    for (int n = 0; n < a.num_rows && ok; ++n) {
      const int32_t b = rows[n].source;
      if (!IsBlock(b) || entries[b] == 0 || internal::OwnerRow(owner[b]) == n) continue;
      *a.status = internal::StatusFromFault(internal::PendingSharedFault(b, n),  n,
                                            internal::OwnerRow(owner[b]));
      ok = false;
    }
    for (int n = 0; n < a.num_rows; ++n) {
      if (IsBlock(rows[n].source)) owner[rows[n].source] = 0;
    }
    if (!ok) return false;
    if (a.pending.journal != nullptr) {  // before the table or a checkpoint changes
      int listed = 0;
      for (int n = 0; n < a.num_rows; ++n) {
        const int32_t b = rows[n].source;
        if (IsBlock(b) && entries[b] != 0) internal::PendingJournalList(a.pending, listed++, b);
      }
      internal::PendingJournalMarkStarted(a.pending, kPendingVerify, listed, a.layer, 0);
    }
    for (int n = 0; n < a.num_rows; ++n) {
      const int32_t b = rows[n].source;
      a.replay_plan[n] = IsBlock(b) ? entries[b] : 0;
      if (IsBlock(b)) entries[b] = 0;
    }
    return true;
  }

  absl::Status LaunchCommit(const CommitArgs& a, Stream) const override {
    RunCommit(a);
    PublishStatus(*a.status, a.status_mirror);
    return absl::OkStatus();
  }

  void RunCommit(const CommitArgs& a) const {
    *a.status = internal::OkStatus();
    if (!PrerequisitesPassed(a.prerequisites, a.status)) return;
    const int64_t num_blocks = a.layers[0].state.num_blocks;
    const internal::CommitWorkspace ws =
        internal::CommitWorkspaceLayout(a.workspace, a.num_rows, num_blocks);
    std::vector<RowFault> faults(a.num_rows);
    for (int i = 0; i < a.num_rows; ++i) {
      faults[i] = internal::PlanCommitRow(a, num_blocks, i, &ws.plan[i]);
    }
    if (!InputsIntact(a.prerequisites.input_fault, a.status)) return;
    if (!CheckRows(a.num_rows, a.status, [&](int i) { return faults[i]; })) return;
    if (!CheckCrossRow(
            a.num_rows, ws.owner, a.status,
            [&](int i, auto fn) { internal::ForEachCommitWrite(a, ws.plan[i], i, fn); },
            [&](int i, auto fn) { internal::ForEachCommitRead(ws.plan[i], i, fn); })) {
      return;
    }
    const bool deferred = a.pending.entries != nullptr;
    if (deferred && !CheckRows(a.num_rows, a.status, [&](int i) {
          return internal::CheckDeferredCommitRow(a, ws.plan[i], i);
        })) {
      return;
    }
    // FAST: every layer's cursors and candidates, each written block's ring
    // empty, one row a checkpoint block.
    if (a.fast && !CheckRows(a.num_rows, a.status, [&](int i) {
          for (int l = 0; l < a.num_layers; ++l) {
            const RowFault f = internal::CheckFastCommitRow(a, a.layers[l].fast, l, ws.plan[i], i);
            if (f.problem != 0) return f;
          }
          return internal::NoFault();
        })) {
      return;
    }
    if (a.fast && !CheckOneRowABlock(a.num_rows, ws.owner, a.status,
                                     [&](int i) { return ws.plan[i].source; })) {
      return;
    }
    const int Q = a.spec_query_len;
    for (int i = 0; i < a.num_rows; ++i) {
      for (int col = 0; col <= Q; ++col) {
        ws.replay_indices[i * (Q + 1) + col] = internal::ReplayIndex(ws.plan[i], Q, col);
      }
    }
    const CommitJournal& journal = a.journal;
    if (journal.record != nullptr) {  // before the first write
      for (int i = 0; i < a.num_rows; ++i) internal::JournalListRow(a, ws.plan[i], i);
      if (deferred && a.pending.journal != nullptr) ListDeferredCommit(a, ws.plan);
      internal::JournalMarkStarted(journal, a.num_rows);
      if (journal.test_hook != nullptr) journal.test_hook("started");
    }
    const bool align = a.block_table.data != nullptr;
    const int history_len = a.layers[0].conv.width - Q + 1;
    DispatchAct(a.shape.act_dtype, [&](auto act) {
      using Act = typename decltype(act)::type;
      std::vector<Act> scratch;
      for (int l = 0; l < a.num_layers; ++l) {
        for (int i = 0; i < a.num_rows; ++i) {
          CompactConvRow<Act>(a.layers[l].conv, history_len, ws.plan[i], align, &scratch);
        }
      }
    });
    if (journal.test_hook != nullptr) journal.test_hook("conv");
    if (a.fast) {
      // kernels/fast's Commit along the checked plan: rings advance, folds.
      const std::vector<fast::FastLayer> layers = fast::FastLayersOf(a.layers, a.num_layers);
      fast::RunFastCommitCpu(fast::FastCommitArgsOf(a, layers.data()), ws.plan,
                             fast::FastNumerics());
      return;
    }
    if (deferred) {
      const std::vector<ReplayJob> jobs = DeferCommit(a, ws.plan);
      if (journal.test_hook != nullptr) journal.test_hook("deferred");
      RunReplayJobs(a.shape, a.layers, Q, jobs);
      return;
    }
    // Replay: the stock kernel over the records, Q tokens per row, reading
    // the source at column Q and storing only the planned columns. Tokens
    // after the last stored column cannot change a stored state, so they
    // are not run.
    DispatchKda(a.shape, [&](auto act, auto state, auto head_dim) {
      using Act = typename decltype(act)::type;
      using State = typename decltype(state)::type;
      for (int l = 0; l < a.num_layers; ++l) {
        RunStockLayer<Act, State, decltype(head_dim)::value>(
            ReplayWork(a.shape, a.layers[l], a.layers[l].records), a.num_rows,
            [&](int i, int64_t* bos, int* tokens, int32_t* source, const int32_t** idx) {
              const int32_t* row = ws.replay_indices + i * (Q + 1);
              *bos = int64_t{i} * Q;
              *source = row[Q];
              *idx = row;
              *tokens = internal::ReplayTokens(row, Q);
            });
        if (journal.test_hook != nullptr) journal.test_hook("layer");
      }
    });
    return;
  }

  // DEFERRED with kept pools, before the commit's first write: the pending
  // journal lists what the previous commit left pending (materialized now
  // or by this step's Verify calls) and every block a row writes (some
  // become pending), and is marked started.
  static void ListDeferredCommit(const CommitArgs& a, const CommitPlanRow* plan) {
    const PendingBlocks& p = a.pending;
    int listed = 0;
    const int32_t* list = internal::PendingList(p);
    for (int j = 0; j < *internal::PendingListSize(p); ++j) {
      internal::PendingJournalList(p, listed++, list[j]);
    }
    for (int i = 0; i < a.num_rows; ++i) {
      internal::ForEachCommitWrite(a, plan[i], i, [&](int32_t b, CheckedField, int32_t, int32_t) {
        internal::PendingJournalList(p, listed++, b);
      });
    }
    internal::PendingJournalMarkStarted(p, kPendingCommit, listed, -1, a.journal.step);
  }

  // After the commit's last write: the pending journal closed (DEFERRED),
  // its blocks' records, then "committed".
  absl::Status LaunchJournalFinish(const CommitArgs& a, Stream) const override {
    const CommitJournal& j = a.journal;
    if (!internal::JournalOpenFor(j)) return absl::OkStatus();  // its checks failed
    if (j.test_hook != nullptr) j.test_hook("replayed");
    if (a.pending.journal != nullptr) internal::PendingJournalMarkDone(a.pending);
    const uint64_t sequence = j.record->commits + 1;
    const int64_t num_blocks = a.layers[0].state.num_blocks;
    const int rows = internal::JournalRows(j);
    for (int e = 0; e < 2 * rows; ++e) {
      internal::JournalRecordEntry(j, num_blocks, e, j.step, sequence);
    }
    internal::JournalMarkCommitted(j, sequence);
    return absl::OkStatus();
  }

  absl::Status LaunchPendingFinish(const PendingBlocks& p, Stream) const override {
    internal::PendingJournalMarkDone(p);
    return absl::OkStatus();
  }

  absl::Status LaunchRecordStateBlocks(const RecordStateBlocksArgs& a, Stream) const override {
    RunRecordStateBlocks(a);
    PublishStatus(*a.status, a.status_mirror);
    return absl::OkStatus();
  }

  void RunRecordStateBlocks(const RecordStateBlocksArgs& a) const {
    *a.status = internal::OkStatus();
    if (!PrerequisitesPassed(a.prerequisites, a.status)) return;
    const internal::RecordWorkspace ws =
        internal::RecordWorkspaceLayout(a.workspace, a.workspace_bytes);
    internal::RecordRow* const rows = ws.rows;
    std::vector<RowFault> faults(a.num_rows);
    for (int i = 0; i < a.num_rows; ++i) faults[i] = internal::CheckRecordRow(a, i, &rows[i]);
    if (!InputsIntact(a.prerequisites.input_fault, a.status)) return;
    if (!CheckRows(a.num_rows, a.status, [&](int i) { return faults[i]; })) return;
    const auto no_reads = [](int, auto) {};
    if (!CheckCrossRow(
            a.num_rows, ws.owner, a.status,
            [&](int i, auto fn) { internal::ForEachRecordWrite(rows[i], fn); }, no_reads)) {
      return;
    }
    for (int i = 0; i < a.num_rows; ++i) {
      if (rows[i].request_row < 0) continue;
      a.state_idx[rows[i].request_row] = rows[i].state_column;
      a.num_accepted[rows[i].request_row] = 1;
    }
    return;
  }

  absl::Status LaunchFlush(const FlushArgs& a, Stream) const override {
    RunFlush(a);
    PublishStatus(*a.status, a.status_mirror);
    return absl::OkStatus();
  }

  void RunFlush(const FlushArgs& a) const {
    *a.status = internal::OkStatus();
    std::vector<RowFault> faults(a.num_blocks_given);
    for (int i = 0; i < a.num_blocks_given; ++i) {
      faults[i] = a.fast ? internal::CheckListedBlock(a.blocks, a.checked_blocks, i,
                                                      a.layers[0].state.num_blocks)
                         : internal::CheckFlushBlock(a, i);
    }
    if (!InputsIntact(a.prerequisites.input_fault, a.status)) return;
    if (!CheckRows(a.num_blocks_given, a.status, [&](int i) { return faults[i]; })) return;
    if (a.fast) {
      RunFastFlush(a);
      return;
    }
    const bool listed = a.blocks == nullptr;
    const int count = listed ? *internal::PendingListSize(a.pending) : a.num_blocks_given;
    const int32_t* blocks = listed ? internal::PendingList(a.pending) : a.checked_blocks;
    if (a.pending.journal != nullptr) {  // before the table or a state changes
      int journaled = 0;
      for (int i = 0; i < count; ++i) {
        if (!IsBlock(blocks[i])) continue;
        for (int l = 0; l < a.num_layers; ++l) {
          if ((a.layer < 0 || l == a.layer) &&
              internal::PendingEntriesOf(a.pending, l)[blocks[i]] != 0) {
            internal::PendingJournalList(a.pending, journaled++, blocks[i]);
            break;
          }
        }
      }
      internal::PendingJournalMarkStarted(
          a.pending, a.discard ? kPendingDiscard : kPendingFlush, journaled, a.layer, 0);
    }
    std::vector<ReplayJob> jobs;
    for (int i = 0; i < count; ++i) {
      if (!IsBlock(blocks[i])) continue;
      for (int l = 0; l < a.num_layers; ++l) {
        if (a.layer >= 0 && l != a.layer) continue;
        int32_t& entry = internal::PendingEntriesOf(a.pending, l)[blocks[i]];
        if (entry == 0) continue;
        if (!a.discard) {
          jobs.push_back(internal::PendingJob(l, blocks[i], internal::UnpackPending(entry),
                                              a.spec_query_len));
        }
        entry = 0;
      }
    }
    PublishJobs(jobs, a.jobs);
    if (a.pending.test_hook != nullptr && !a.discard) a.pending.test_hook("flush:taken");
    RunReplayJobs(a.shape, a.layers, a.spec_query_len, jobs);
  }

  // FAST Flush, after the block list's checks: every listed block's cursor
  // in every layer it covers (without a list: every block whose ring holds
  // tokens or candidates), then kernels/fast's Materialize in place.
  void RunFastFlush(const FlushArgs& a) const {
    const auto covers = [&](int l) { return a.layer < 0 || l == a.layer; };
    std::vector<int32_t> every;
    const int32_t* blocks = a.checked_blocks;
    int count = a.num_blocks_given;
    if (a.blocks == nullptr) {
      for (int32_t b = 1; b < a.layers[0].state.num_blocks; ++b) {
        for (int l = 0; l < a.num_layers; ++l) {
          const FastCursor c = a.layers[l].fast.cursors[b];
          if (covers(l) && (c.tokens != 0 || c.candidates != 0)) {
            every.push_back(b);
            break;
          }
        }
      }
      blocks = every.data();
      count = static_cast<int>(every.size());
    }
    for (int i = 0; i < count; ++i) {
      if (!IsBlock(blocks[i])) continue;
      for (int l = 0; l < a.num_layers; ++l) {
        if (!covers(l)) continue;
        const RowFault f = internal::CheckFastCursor(a.layers[l].fast, blocks[i], l);
        if (f.problem != 0) {
          *a.status = internal::StatusFromFault(f, -1, -1);
          return;
        }
      }
    }
    const std::vector<fast::FastLayer> layers = fast::FastLayersOf(a.layers, a.num_layers);
    fast::FastMaterializeArgs m;
    m.shape = a.shape;
    m.num_layers = a.num_layers;
    m.layers = layers.data();
    m.blocks = blocks;
    m.num_blocks_given = count;
    m.layer = a.layer;
    m.discard = a.discard;
    fast::RunFastMaterializeCpu(m, fast::FastNumerics());
  }

  absl::Status LaunchLoadParams(const LoadParamsArgs& a, Stream) const override {
    *a.status = internal::OkStatus();
    const int count = a.num_heads + a.num_heads * a.head_dim;
    for (int i = 0; i < count; ++i) {
      a.staging[i] = i < a.num_heads ? a.a_log[i] : a.dt_bias[i - a.num_heads];
    }
    if (InputsIntact(a.input_fault, a.status)) {
      for (int i = 0; i < count; ++i) {
        const RowFault f = internal::CheckParamValue(a.staging[i], i, a.num_heads);
        if (f.problem != 0) {
          *a.status = internal::StatusFromFault(f, -1, -1);
          break;
        }
      }
    }
    if (a.status->failed == 0) {
      std::memcpy(a.dst_a_log, a.staging, sizeof(float) * a.num_heads);
      std::memcpy(a.dst_dt_bias, a.staging + a.num_heads,
                  sizeof(float) * a.num_heads * a.head_dim);
    }
    PublishStatus(*a.status, a.status_mirror);
    return absl::OkStatus();
  }

 private:
  // Copies row n's raw k (per key head), v and beta (per value head) and g
  // (KDA: per key head, [K]; GDN: per value head, a scalar), bit for bit, to
  // record tokens [n * Q, n * Q + tokens).
  template <typename Act, int K>
  static void RecordRow(const VerifyArgs& a, const Records& records, int n, int64_t bos,
                        int tokens) {
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
};

}  // namespace

const KdaKernels& CpuKdaKernels() {
  static const CpuKernels* const kernels = new CpuKernels();
  return *kernels;
}

}  // namespace kernels
}  // namespace specstate
