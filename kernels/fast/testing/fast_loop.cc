#include "kernels/fast/testing/fast_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/device_status.h"
#include "kernels/dtype.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "kernels/numeric.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

// Element i of a buffer of `dtype`, written rounded / read as a double.
void StoreAs(DType dtype, float x, void* base, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[i] = x;
      return;
    case DType::kBFloat16:
      static_cast<BFloat16*>(base)[i] = FromFloat<BFloat16>(x);
      return;
    case DType::kFloat16:
      static_cast<Float16*>(base)[i] = FromFloat<Float16>(x);
      return;
    default:
      std::abort();
  }
}

double LoadAs(DType dtype, const void* base, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kBFloat16:
      return ToFloat(static_cast<const BFloat16*>(base)[i]);
    case DType::kFloat16:
      return ToFloat(static_cast<const Float16*>(base)[i]);
    default:
      std::abort();
  }
}

// A buffer of `count` elements of `dtype` (zeroed).
struct Buffer {
  DType dtype = DType::kFloat32;
  std::vector<uint8_t> bytes;

  Buffer() = default;
  Buffer(DType d, size_t count) : dtype(d), bytes(count * DTypeSize(d), 0) {}
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  size_t size() const { return bytes.size() / DTypeSize(dtype); }
  void Set(size_t i, float x) { StoreAs(dtype, x, bytes.data(), i); }
  double Get(size_t i) const { return LoadAs(dtype, bytes.data(), i); }
};

class Loop {
 public:
  explicit Loop(const LoopConfig& c) : c_(c), rng_(c.seed) {}

  absl::StatusOr<LoopResult> Run() {
    Init();
    LoopResult result;
    for (int step = 0; step < c_.steps; ++step) {
      absl::Status st = Step(step, &result);
      if (!st.ok()) {
        return absl::Status(st.code(), absl::StrCat("step ", step, ": ", st.message()));
      }
    }
    return result;
  }

 private:
  float Normal(float stddev) { return std::normal_distribution<float>(0.0f, stddev)(rng_); }
  float Uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  void Init() {
    s_ = c_.shape;
    H_ = s_.num_heads;
    HV_ = ValueHeads(s_);
    K_ = s_.head_dim;
    N_ = c_.rows;
    Q_ = c_.q;
    R_ = FastRingCapacity(c_.fold_every, c_.q);
    num_blocks_ = N_ + 1;
    block_elems_ = int64_t{HV_} * K_ * K_;
    rshape_.heads = H_;
    rshape_.head_dim = K_;
    rshape_.lower_bound = s_.lower_bound;
    rshape_.kind = s_.kind == LayerKind::kGdn ? ref::Kind::kGdn : ref::Kind::kKda;
    rshape_.value_heads = HV_;
    rshape_.plain_gate = s_.gate == KdaGate::kPlain;
    // Checkpoints: the same rounded values in every pool.
    exact_pool_ = Buffer(s_.state_dtype, num_blocks_ * block_elems_);
    for (int64_t i = block_elems_; i < num_blocks_ * block_elems_; ++i) {
      exact_pool_.Set(i, Normal(0.1f));
    }
    fast_pool_ = exact_pool_;
    for (int r = 0; r < N_; ++r) {
      ref::State& st = ref_pool_[Block(r)];
      st.resize(block_elems_);
      for (int64_t i = 0; i < block_elems_; ++i) st[i] = exact_pool_.Get(Block(r) * block_elems_ + i);
    }
    a_log_.resize(H_);
    dt_bias_.resize(size_t(H_) * K_);
    for (float& x : a_log_) x = Normal(0.5f);
    for (float& x : dt_bias_) x = Normal(0.5f);
    rparams_.a_log.assign(a_log_.begin(), a_log_.end());
    rparams_.dt_bias.assign(dt_bias_.begin(), dt_bias_.end());
    params_ = LayerParams{a_log_.data(), dt_bias_.data()};
    // The exact path's memory.
    const DType act = s_.act_dtype;
    rec_kv_ = Buffer(act, size_t(N_) * Q_ * RecordTokenWidth(s_));
    rec_g_ = Buffer(act, size_t(N_) * Q_ * GateWidth(s_));
    rec_beta_ = Buffer(act, size_t(N_) * Q_ * HV_);
    conv_ = Buffer(act, size_t(num_blocks_) * (Q_ + 1));
    exact_out_ = Buffer(act, size_t(N_) * Q_ * ValueWidth(s_));
    commit_workspace_.assign(CommitWorkspaceBytes(N_, Q_, num_blocks_), 0);
    snapshot_qsl_.assign(N_ + 1, 0);
    snapshot_idx_.assign(N_, 0);
    // FAST's.
    fast_out_ = Buffer(act, size_t(N_) * Q_ * ValueWidth(s_));
    ring_k_ = Buffer(act, size_t(num_blocks_) * R_ * RingKWidth(s_));
    ring_u_.assign(size_t(num_blocks_) * R_ * RingUWidth(s_), 0.0f);
    ring_g_.assign(size_t(num_blocks_) * R_ * RingLogDecayWidth(s_), 0.0f);
    cursors_.assign(num_blocks_, FastCursor{0, 0});
    rings_ = FastRings{ring_k_.data(), ring_u_.data(), ring_g_.data(), cursors_.data(),
                       num_blocks_, R_};
    materialized_ = Buffer(s_.state_dtype, size_t(N_) * block_elems_);
  }

  int32_t Block(int r) const { return r + 1; }

  // The step's activations (act dtype) and the reference's copy.
  void DrawInputs(int tokens) {
    const DType act = s_.act_dtype;
    const bool gdn = s_.kind == LayerKind::kGdn;
    const bool lowest = c_.gates == GateInputs::kLowest;
    q_ = Buffer(act, size_t(tokens) * KeyWidth(s_));
    k_ = Buffer(act, size_t(tokens) * KeyWidth(s_));
    v_ = Buffer(act, size_t(tokens) * ValueWidth(s_));
    g_ = Buffer(act, size_t(tokens) * GateWidth(s_));
    beta_ = Buffer(act, size_t(tokens) * HV_);
    for (size_t i = 0; i < q_.size(); ++i) q_.Set(i, Normal(1.0f));
    for (size_t i = 0; i < k_.size(); ++i) k_.Set(i, Normal(1.0f));
    for (size_t i = 0; i < v_.size(); ++i) v_.Set(i, Normal(1.0f));
    for (size_t i = 0; i < g_.size(); ++i) {
      // Lowest: KDA's gate input far past its saturation (gamma at the
      // lower bound for the safe gate, a large decay for the plain one).
      g_.Set(i, lowest ? (gdn ? s_.lower_bound : 40.0f)
                       : (gdn ? -Uniform(0.0f, 1.0f) : Normal(1.0f)));
    }
    for (size_t i = 0; i < beta_.size(); ++i) beta_.Set(i, gdn ? Uniform(0.0f, 1.0f) : Normal(1.0f));
    rtokens_.count = tokens;
    const auto copy = [](const Buffer& b, std::vector<double>* out) {
      out->resize(b.size());
      for (size_t i = 0; i < b.size(); ++i) (*out)[i] = b.Get(i);
    };
    copy(q_, &rtokens_.q);
    copy(k_, &rtokens_.k);
    copy(v_, &rtokens_.v);
    copy(g_, &rtokens_.g);
    copy(beta_, &rtokens_.beta);
  }

  absl::Status Step(int step, LoopResult* result) {
    // Rows: mostly full windows, some partial; accepted in [0, T].
    std::vector<int32_t> qsl(1, 0), idx, accepted, commit_len;
    for (int r = 0; r < N_; ++r) {
      const int T = Int(0, 3) > 0 ? Q_ : Int(1, Q_);
      qsl.push_back(qsl.back() + T);
      idx.push_back(Block(r));
      const int acc = Int(0, 9) == 0 ? 0 : Int(1, T);
      accepted.push_back(acc);
      commit_len.push_back(std::min(acc, T));
      result->committed_tokens += commit_len.back();
      result->rejected_tokens += T - commit_len.back();
    }
    const int tokens = qsl.back();
    DrawInputs(tokens);

    // The reference: outputs from each row's state, then the accepted tokens.
    ref::Records records = ref::MakeRecords(rshape_, N_, Q_);
    const ref::VerifyResult want =
        ref::Verify(rshape_, rparams_, rtokens_, ref::VerifyCall{qsl, idx}, ref_pool_, &records);
    {
      ref::Tokens kept;
      ref::StockCall call;
      call.query_start_loc.assign(1, 0);
      const size_t kw = KeyWidth(s_), vw = ValueWidth(s_), gw = GateWidth(s_);
      for (int r = 0; r < N_; ++r) {
        for (int t = 0; t < commit_len[r]; ++t) {
          const size_t tok = qsl[r] + t;
          kept.q.insert(kept.q.end(), rtokens_.q.begin() + tok * kw, rtokens_.q.begin() + (tok + 1) * kw);
          kept.k.insert(kept.k.end(), rtokens_.k.begin() + tok * kw, rtokens_.k.begin() + (tok + 1) * kw);
          kept.v.insert(kept.v.end(), rtokens_.v.begin() + tok * vw, rtokens_.v.begin() + (tok + 1) * vw);
          kept.g.insert(kept.g.end(), rtokens_.g.begin() + tok * gw, rtokens_.g.begin() + (tok + 1) * gw);
          kept.beta.insert(kept.beta.end(), rtokens_.beta.begin() + tok * HV_,
                           rtokens_.beta.begin() + (tok + 1) * HV_);
        }
        kept.count += commit_len[r];
        call.query_start_loc.push_back(static_cast<int32_t>(kept.count));
        call.ssm_state_indices.push_back(std::vector<int32_t>(Q_, Block(r)));
      }
      ref::Stock(rshape_, rparams_, kept, call, &ref_pool_);
    }

    // The exact path: the CPU kernels' Verify and EAGER Commit.
    if (c_.run_exact) {
      absl::Status st = ExactStep(qsl, idx, accepted, tokens);
      if (!st.ok()) return st;
    }

    // FAST.
    std::vector<int32_t> before(N_);
    for (int r = 0; r < N_; ++r) before[r] = cursors_[Block(r)].tokens;
    {
      FastVerifyArgs a;
      a.shape = s_;
      a.q = Activation{q_.data(), KeyWidth(s_)};
      a.k = Activation{k_.data(), KeyWidth(s_)};
      a.v = Activation{v_.data(), ValueWidth(s_)};
      a.g = Activation{g_.data(), GateWidth(s_)};
      a.beta = Activation{beta_.data(), HV_};
      a.num_tokens = tokens;
      a.out = fast_out_.data();
      a.state = StatePool{fast_pool_.data(), num_blocks_, block_elems_};
      a.rings = rings_;
      a.params = params_;
      a.spec_query_len = Q_;
      a.num_rows = N_;
      a.query_start_loc = qsl.data();
      a.state_indices = idx.data();
      absl::Status st = FastVerifyCpu(a, c_.numerics);
      if (!st.ok()) return st;
    }
    {
      const FastLayer layer{StatePool{fast_pool_.data(), num_blocks_, block_elems_}, rings_,
                            params_};
      FastCommitArgs a;
      a.shape = s_;
      a.spec_query_len = Q_;
      a.num_layers = 1;
      a.layers = &layer;
      a.num_rows = N_;
      a.query_start_loc = qsl.data();
      a.state_indices = IndexMatrix{idx.data(), 1, 1};
      a.batch = N_;
      a.num_accepted = accepted.data();
      absl::Status st = FastCommitCpu(a, c_.numerics);
      if (!st.ok()) return st;
    }
    for (int r = 0; r < N_; ++r) {
      if (cursors_[Block(r)].tokens < before[r] + commit_len[r]) ++result->folds;
    }

    StepResult sr;
    sr.folds = result->folds;
    sr.ring_tokens = cursors_[Block(0)].tokens;
    // Outputs: every row's tokens.
    std::vector<double> want_out(want.out.begin(), want.out.begin() + size_t(tokens) * ValueWidth(s_));
    std::vector<double> got(want_out.size());
    for (size_t i = 0; i < got.size(); ++i) got[i] = fast_out_.Get(i);
    for (double x : got) result->finite = result->finite && std::isfinite(x);
    sr.fast.out_elem = ElementwiseError(got, want_out);
    sr.fast.out_norm = NormError(got, want_out);
    if (c_.run_exact) {
      for (size_t i = 0; i < got.size(); ++i) got[i] = exact_out_.Get(i);
      sr.exact.out_elem = ElementwiseError(got, want_out);
      sr.exact.out_norm = NormError(got, want_out);
    }
    // States: every row's block after the Commit (FAST's materialized).
    const bool folded = result->steps.empty() || sr.folds != result->steps.back().folds;
    if (c_.check_states_every_step || folded || step == c_.steps - 1) {
      sr.states = true;
      std::vector<int32_t> blocks;
      std::vector<double> want_state;
      for (int r = 0; r < N_; ++r) {
        blocks.push_back(Block(r));
        const ref::State& st = ref_pool_.at(Block(r));
        want_state.insert(want_state.end(), st.begin(), st.end());
      }
      const FastLayer layer{StatePool{fast_pool_.data(), num_blocks_, block_elems_}, rings_,
                            params_};
      FastMaterializeArgs m;
      m.shape = s_;
      m.num_layers = 1;
      m.layers = &layer;
      m.blocks = blocks.data();
      m.num_blocks_given = N_;
      m.layer = 0;
      m.out = materialized_.data();
      absl::Status st = FastMaterializeCpu(m, c_.numerics);
      if (!st.ok()) return st;
      std::vector<double> got_state(want_state.size());
      for (size_t i = 0; i < got_state.size(); ++i) got_state[i] = materialized_.Get(i);
      for (double x : got_state) result->finite = result->finite && std::isfinite(x);
      sr.fast.state_elem = ElementwiseError(got_state, want_state);
      sr.fast.state_norm = NormError(got_state, want_state);
      if (c_.run_exact) {
        for (int r = 0; r < N_; ++r) {
          for (int64_t i = 0; i < block_elems_; ++i) {
            got_state[r * block_elems_ + i] = exact_pool_.Get(Block(r) * block_elems_ + i);
          }
        }
        sr.exact.state_elem = ElementwiseError(got_state, want_state);
        sr.exact.state_norm = NormError(got_state, want_state);
      }
    }
    result->steps.push_back(sr);
    return absl::OkStatus();
  }

  absl::Status ExactStep(const std::vector<int32_t>& qsl, const std::vector<int32_t>& idx,
                         const std::vector<int32_t>& accepted, int tokens) {
    const KdaKernels& kernels = CpuKdaKernels();
    const Records records{rec_kv_.data(), rec_g_.data(), rec_beta_.data(), N_, Q_};
    const StatePool pool{exact_pool_.data(), num_blocks_, block_elems_};
    DeviceStatus status{};
    VerifyArgs v;
    v.shape = s_;
    v.q = Activation{q_.data(), KeyWidth(s_)};
    v.k = Activation{k_.data(), KeyWidth(s_)};
    v.v = Activation{v_.data(), ValueWidth(s_)};
    v.g = Activation{g_.data(), GateWidth(s_)};
    v.beta = Activation{beta_.data(), HV_};
    v.num_tokens = tokens;
    v.out = exact_out_.data();
    v.state = pool;
    v.params = params_;
    v.records = records;
    v.num_rows = N_;
    v.query_start_loc = qsl.data();
    v.state_indices = IndexMatrix{idx.data(), 1, 1};
    v.snapshot_query_start_loc = snapshot_qsl_.data();
    v.snapshot_state_indices = snapshot_idx_.data();
    v.status = &status;
    absl::Status st = kernels.Verify(v, nullptr);
    if (st.ok()) st = DeviceStatusToStatus(status, "Verify");
    if (!st.ok()) return st;
    const ConvPool conv{conv_.data(), num_blocks_, Q_ + 1, Q_ + 1, 1, 1, Q_ + 1};
    const CommitLayer layer{pool, conv, params_, records, records};
    CommitArgs c;
    c.shape = s_;
    c.spec_query_len = Q_;
    c.num_layers = 1;
    c.layers = &layer;
    c.device_layers = &layer;
    c.num_rows = N_;
    c.query_start_loc = snapshot_qsl_.data();
    c.state_indices = IndexMatrix{snapshot_idx_.data(), 1, 1};
    c.batch = N_;
    c.num_accepted = accepted.data();
    c.workspace = commit_workspace_.data();
    c.workspace_bytes = commit_workspace_.size();
    c.status = &status;
    st = kernels.Commit(c, nullptr);
    if (st.ok()) st = DeviceStatusToStatus(status, "Commit");
    return st;
  }

  const LoopConfig c_;
  std::mt19937_64 rng_;
  KdaShape s_;
  int H_ = 0, HV_ = 0, K_ = 0, N_ = 0, Q_ = 0, R_ = 0;
  int64_t num_blocks_ = 0, block_elems_ = 0;
  ref::Shape rshape_;
  ref::LayerParams rparams_;
  ref::StatePool ref_pool_;
  ref::Tokens rtokens_;
  std::vector<float> a_log_, dt_bias_;
  LayerParams params_;
  Buffer q_, k_, v_, g_, beta_;
  Buffer exact_pool_, rec_kv_, rec_g_, rec_beta_, conv_, exact_out_;
  std::vector<uint8_t> commit_workspace_;
  std::vector<int32_t> snapshot_qsl_, snapshot_idx_;
  Buffer fast_pool_, fast_out_, ring_k_, materialized_;
  std::vector<float> ring_u_, ring_g_;
  std::vector<FastCursor> cursors_;
  FastRings rings_;
};

}  // namespace

absl::StatusOr<LoopResult> RunLoop(const LoopConfig& config) { return Loop(config).Run(); }

std::string Describe(const LoopConfig& c) {
  const KdaShape& s = c.shape;
  std::string kind = s.kind == LayerKind::kGdn ? "GDN"
                     : s.gate == KdaGate::kPlain ? "KDA plain"
                                                 : "KDA safe";
  return absl::StrCat(kind, ", ", DTypeName(s.act_dtype), " act, ", DTypeName(s.state_dtype),
                      " state, F=", c.fold_every, ", Q=", c.q, ", H=", s.num_heads,
                      s.num_value_heads > 0 ? absl::StrCat(" HV=", s.num_value_heads) : "",
                      " K=", s.head_dim, ", ", c.rows, " rows, ", c.steps, " steps",
                      c.gates == GateInputs::kLowest ? ", lowest gate" : "",
                      ", seed ", c.seed);
}

}  // namespace testing
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
