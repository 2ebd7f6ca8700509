// The FAST kernels on the CPU: agreement with the float64 reference over
// short loops of every supported shape (single steps and folds), the ring and
// cursor semantics (candidates, rejected drafts, the fold's schedule,
// Materialize), align mode's boundary states, a full ring at the lowest
// gate, and the misuse the checks refuse with nothing written. Every test
// draws fresh random inputs; its seed is printed (SPECSTATE_TEST_SEED=<seed>
// replays it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/fast/fast_args.h"
#include "kernels/fast/fast_kernels.h"
#include "kernels/fast/testing/fast_loop.h"
#include "kernels/kda_args.h"
#include "kernels/numeric.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace testing {
namespace {

namespace ref = ::specstate::reference;

uint64_t TestSeed() {
  const char* env = std::getenv("SPECSTATE_TEST_SEED");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

ref::Dtype RefDtype(DType d) {
  return d == DType::kBFloat16  ? ref::Dtype::kBFloat16
         : d == DType::kFloat16 ? ref::Dtype::kFloat16
                                : ref::Dtype::kFloat32;
}

// docs/semantics.md's budget for fp32 arithmetic against float64, plus one
// rounding to the stored dtype.
double Tolerance(DType stored) { return 1e-5 + ref::UnitRoundoff(RefDtype(stored)); }

KdaShape Shape(LayerKind kind, KdaGate gate, int heads, int value_heads, int head_dim, DType act,
               DType state) {
  KdaShape s;
  s.num_heads = heads;
  s.num_value_heads = value_heads;
  s.head_dim = head_dim;
  s.act_dtype = act;
  s.state_dtype = state;
  s.kind = kind;
  s.gate = gate;
  s.lower_bound = -5.0f;
  return s;
}

// ---------------------------------------------------------------------------
// Short loops against the reference, every shape.

struct ShortLoop {
  KdaShape shape;
  int q;
  int fold_every;
};

TEST(FastKernelsTest, AgreesWithTheReferenceOverShortLoops) {
  using L = LayerKind;
  using G = KdaGate;
  using D = DType;
  const ShortLoop loops[] = {
      // F = 1: a fold at every commit; F = 2: every other step or so.
      {Shape(L::kKda, G::kSafe, 2, 0, 64, D::kBFloat16, D::kFloat32), 4, 1},
      {Shape(L::kKda, G::kSafe, 3, 0, 64, D::kBFloat16, D::kBFloat16), 4, 2},
      {Shape(L::kKda, G::kSafe, 2, 0, 64, D::kFloat16, D::kFloat32), 3, 3},
      {Shape(L::kKda, G::kSafe, 2, 0, 64, D::kFloat32, D::kFloat32), 8, 2},
      {Shape(L::kKda, G::kSafe, 2, 0, 128, D::kBFloat16, D::kFloat32), 8, 2},
      {Shape(L::kKda, G::kSafe, 1, 0, 256, D::kFloat32, D::kBFloat16), 2, 2},
      {Shape(L::kKda, G::kPlain, 2, 0, 64, D::kBFloat16, D::kFloat32), 4, 2},
      {Shape(L::kKda, G::kSafe, 2, 0, 64, D::kBFloat16, D::kFloat32), 1, 4},  // Q = 1
      {Shape(L::kGdn, G::kSafe, 2, 4, 64, D::kBFloat16, D::kFloat32), 4, 2},
      {Shape(L::kGdn, G::kSafe, 1, 3, 64, D::kFloat32, D::kBFloat16), 4, 1},
      {Shape(L::kGdn, G::kSafe, 2, 2, 128, D::kFloat16, D::kFloat32), 8, 2},
      {Shape(L::kGdn, G::kSafe, 1, 1, 256, D::kBFloat16, D::kFloat32), 4, 2},
  };
  for (const ShortLoop& loop : loops) {
    LoopConfig c;
    c.shape = loop.shape;
    c.q = loop.q;
    c.fold_every = loop.fold_every;
    c.rows = 2;
    // Enough steps that some row's ring fills whatever the accepted counts
    // (uniform in [0, T]): with F * Q = 8 and 6 steps it did not under some
    // seeds (seed 9999364944551049753: no fold). Now at most ~1e-8 of seeds
    // fold nowhere: Q = 1 accepts a token with probability 1/2 a step.
    c.steps = loop.q == 1 ? 24 : loop.shape.head_dim == 256 ? 12 : 14;
    c.seed = TestSeed();
    SCOPED_TRACE(absl::StrCat(Describe(c), " (replay with SPECSTATE_TEST_SEED=", c.seed, ")"));
    std::printf("%s\n", Describe(c).c_str());
    absl::StatusOr<LoopResult> r = RunLoop(c);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->finite);
    EXPECT_GT(r->folds, 0);
    const bool fp32_state = loop.shape.state_dtype == DType::kFloat32;
    for (size_t i = 0; i < r->steps.size(); ++i) {
      const Errors& f = r->steps[i].fast;
      const Errors& x = r->steps[i].exact;
      // fp32 state: the single-step budget at every step (fp32 arithmetic,
      // one rounding of the output). bf16 state: the checkpoint is rounded
      // at every fold (the exact path at every commit): within twice the
      // exact path's error plus that budget.
      const double out_bound = fp32_state ? Tolerance(loop.shape.act_dtype)
                                          : Tolerance(loop.shape.act_dtype) + 2 * x.out_norm;
      EXPECT_LT(f.out_norm, out_bound) << "step " << i;
      EXPECT_LT(f.out_elem, fp32_state ? Tolerance(loop.shape.act_dtype)
                                       : Tolerance(loop.shape.act_dtype) + 2 * x.out_elem)
          << "step " << i;
      EXPECT_LT(f.state_norm, fp32_state ? Tolerance(DType::kFloat32)
                                         : Tolerance(DType::kFloat32) + 2 * x.state_norm)
          << "step " << i;
      EXPECT_LT(f.state_elem, fp32_state ? Tolerance(DType::kFloat32)
                                         : Tolerance(DType::kFloat32) + 2 * x.state_elem)
          << "step " << i;
    }
  }
}

// A full ring at the lowest gate: every token's gamma at the lower bound
// (-5; exp(-5 R) underflows fp32 from R = 18 on), R = 16 * 8 = 128. Nothing
// overflows or turns NaN, and the errors stay the exact path's.
TEST(FastKernelsTest, AFullRingAtTheLowestGateStaysFiniteAndAccurate) {
  for (const KdaShape& shape :
       {Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, 64, DType::kFloat32, DType::kFloat32),
        Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, 64, DType::kFloat32, DType::kBFloat16),
        Shape(LayerKind::kKda, KdaGate::kPlain, 2, 0, 64, DType::kFloat32, DType::kFloat32),
        Shape(LayerKind::kGdn, KdaGate::kSafe, 2, 2, 64, DType::kFloat32, DType::kFloat32)}) {
    LoopConfig c;
    c.shape = shape;
    c.q = 8;
    c.fold_every = 16;
    c.rows = 2;
    c.steps = 70;
    c.gates = GateInputs::kLowest;
    c.seed = TestSeed();
    SCOPED_TRACE(absl::StrCat(Describe(c), " (replay with SPECSTATE_TEST_SEED=", c.seed, ")"));
    absl::StatusOr<LoopResult> r = RunLoop(c);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->finite);
    int fullest = 0;
    Errors worst_fast, worst_exact;
    for (const StepResult& s : r->steps) {
      fullest = std::max(fullest, s.ring_tokens);
      worst_fast.out_elem = std::max(worst_fast.out_elem, s.fast.out_elem);
      worst_fast.state_elem = std::max(worst_fast.state_elem, s.fast.state_elem);
      worst_exact.out_elem = std::max(worst_exact.out_elem, s.exact.out_elem);
      worst_exact.state_elem = std::max(worst_exact.state_elem, s.exact.state_elem);
    }
    EXPECT_GT(fullest, 128 - 2 * 8) << "the ring never came close to full";
    EXPECT_GT(r->folds, 0);
    EXPECT_LE(worst_fast.out_elem, 2 * std::max(worst_exact.out_elem, 1e-7));
    EXPECT_LE(worst_fast.state_elem, 2 * std::max(worst_exact.state_elem, 1e-7));
    std::printf("%s: ring up to %d tokens, out elem %.2e (exact %.2e), state elem %.2e (exact "
                "%.2e)\n",
                Describe(c).c_str(), fullest, worst_fast.out_elem, worst_exact.out_elem,
                worst_fast.state_elem, worst_exact.state_elem);
  }
}

// ---------------------------------------------------------------------------
// Direct calls on host memory: one layer, a block per row.

class World {
 public:
  World(const KdaShape& shape, int rows, int q, int fold_every, uint64_t seed)
      : s_(shape), q_len_(q), rng_(seed) {
    num_blocks_ = rows + 3;
    block_elems_ = ValueWidth(s_) * s_.head_dim;
    capacity_ = FastRingCapacity(fold_every, q);
    pool_.resize(num_blocks_ * block_elems_ * DTypeSize(s_.state_dtype));
    for (int64_t i = block_elems_; i < num_blocks_ * block_elems_; ++i) {
      StoreState(i, Normal(0.1f));
    }
    ring_k_.resize(FastRingKBytes(s_, num_blocks_, capacity_));
    ring_u_.assign(FastRingUBytes(s_, num_blocks_, capacity_) / 4, 0.0f);
    ring_g_.assign(FastRingLogDecayBytes(s_, num_blocks_, capacity_) / 4, 0.0f);
    cursors_.assign(num_blocks_, FastCursor{0, 0});
    a_log_.resize(s_.num_heads);
    dt_bias_.resize(KeyWidth(s_));
    for (float& x : a_log_) x = Normal(0.5f);
    for (float& x : dt_bias_) x = Normal(0.5f);
  }

  float Normal(float stddev) { return std::normal_distribution<float>(0.0f, stddev)(rng_); }

  void StoreState(int64_t i, float x) {
    ref::StoreElement(RefDtype(s_.state_dtype), x, &pool_[i * DTypeSize(s_.state_dtype)]);
  }
  double LoadState(const std::vector<uint8_t>& pool, int64_t i) const {
    return ref::LoadElement(RefDtype(s_.state_dtype), &pool[i * DTypeSize(s_.state_dtype)]);
  }
  std::vector<double> BlockValues(const std::vector<uint8_t>& pool, int32_t block) const {
    std::vector<double> out(block_elems_);
    for (int64_t i = 0; i < block_elems_; ++i) out[i] = LoadState(pool, block * block_elems_ + i);
    return out;
  }

  FastRings Rings() {
    return FastRings{ring_k_.data(), ring_u_.data(), ring_g_.data(), cursors_.data(), num_blocks_,
                     capacity_};
  }
  StatePool Pool() { return StatePool{pool_.data(), num_blocks_, block_elems_}; }
  FastLayer Layer() {
    return FastLayer{Pool(), Rings(), LayerParams{a_log_.data(), dt_bias_.data()}};
  }

  // A window of `tokens` tokens: random activations (and the reference's copy).
  void Draw(int tokens) {
    const size_t es = DTypeSize(s_.act_dtype);
    const ref::Dtype d = RefDtype(s_.act_dtype);
    const auto fill = [&](std::vector<uint8_t>* bytes, std::vector<double>* values, size_t n,
                          auto draw) {
      bytes->resize(n * es);
      values->resize(n);
      for (size_t i = 0; i < n; ++i) {
        ref::StoreElement(d, draw(), &(*bytes)[i * es]);
        (*values)[i] = ref::LoadElement(d, &(*bytes)[i * es]);
      }
    };
    const bool gdn = s_.kind == LayerKind::kGdn;
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    fill(&q_, &tokens_.q, tokens * KeyWidth(s_), [&] { return Normal(1.0f); });
    fill(&k_, &tokens_.k, tokens * KeyWidth(s_), [&] { return Normal(1.0f); });
    fill(&v_, &tokens_.v, tokens * ValueWidth(s_), [&] { return Normal(1.0f); });
    fill(&g_, &tokens_.g, tokens * GateWidth(s_),
         [&] { return gdn ? -unit(rng_) : Normal(1.0f); });
    fill(&beta_, &tokens_.beta, tokens * ValueHeads(s_),
         [&] { return gdn ? unit(rng_) : Normal(1.0f); });
    tokens_.count = tokens;
    out_.assign(tokens * ValueWidth(s_) * es, 0xff);
  }

  FastVerifyArgs VerifyArgs(const std::vector<int32_t>& qsl, const std::vector<int32_t>& blocks) {
    FastVerifyArgs a;
    a.shape = s_;
    a.q = Activation{q_.data(), KeyWidth(s_)};
    a.k = Activation{k_.data(), KeyWidth(s_)};
    a.v = Activation{v_.data(), ValueWidth(s_)};
    a.g = Activation{g_.data(), GateWidth(s_)};
    a.beta = Activation{beta_.data(), ValueHeads(s_)};
    a.num_tokens = qsl.back();
    a.out = out_.data();
    a.state = Pool();
    a.rings = Rings();
    a.params = LayerParams{a_log_.data(), dt_bias_.data()};
    a.spec_query_len = q_len_;
    a.num_rows = static_cast<int>(blocks.size());
    a.query_start_loc = qsl.data();
    a.state_indices = blocks.data();
    return a;
  }

  // `layer` must outlive the call.
  FastCommitArgs CommitArgs(const FastLayer* layer, const std::vector<int32_t>& qsl,
                            const std::vector<int32_t>& blocks,
                            const std::vector<int32_t>& accepted) {
    FastCommitArgs a;
    a.shape = s_;
    a.spec_query_len = q_len_;
    a.num_layers = 1;
    a.layers = layer;
    a.num_rows = static_cast<int>(blocks.size());
    a.query_start_loc = qsl.data();
    a.state_indices = IndexMatrix{blocks.data(), 1, 1};
    a.batch = static_cast<int>(accepted.size());
    a.num_accepted = accepted.data();
    return a;
  }

  // Block b's current state (Materialize into `out`), as values.
  std::vector<double> Current(int32_t block) {
    std::vector<uint8_t> out(block_elems_ * DTypeSize(s_.state_dtype));
    const FastLayer layer = Layer();
    FastMaterializeArgs m;
    m.shape = s_;
    m.num_layers = 1;
    m.layers = &layer;
    m.blocks = &block;
    m.num_blocks_given = 1;
    m.layer = 0;
    m.out = out.data();
    const absl::Status st = FastMaterializeCpu(m);
    EXPECT_TRUE(st.ok()) << st;
    return BlockValues(out, 0);
  }

  // Everything the kernels may write.
  std::vector<std::vector<uint8_t>> Everything() const {
    const auto bytes = [](const auto& v) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(v.data());
      return std::vector<uint8_t>(p, p + v.size() * sizeof(v[0]));
    };
    return {pool_, ring_k_, bytes(ring_u_), bytes(ring_g_), bytes(cursors_), out_};
  }

  ref::Shape RefShape() const {
    ref::Shape r;
    r.heads = s_.num_heads;
    r.head_dim = s_.head_dim;
    r.lower_bound = s_.lower_bound;
    r.kind = s_.kind == LayerKind::kGdn ? ref::Kind::kGdn : ref::Kind::kKda;
    r.value_heads = ValueHeads(s_);
    r.plain_gate = s_.gate == KdaGate::kPlain;
    return r;
  }
  ref::LayerParams RefParams() const {
    return ref::LayerParams{std::vector<double>(a_log_.begin(), a_log_.end()),
                            std::vector<double>(dt_bias_.begin(), dt_bias_.end())};
  }

  // The reference's state after running tokens [begin, begin + n) of the
  // current window from `initial`.
  ref::State RefAdvance(const ref::State& initial, int begin, int n) const {
    if (n == 0) return initial;
    ref::StatePool pool{{1, initial}};
    ref::Tokens t;
    const size_t kw = KeyWidth(s_), vw = ValueWidth(s_), gw = GateWidth(s_), hv = ValueHeads(s_);
    t.count = n;
    t.q.assign(tokens_.q.begin() + begin * kw, tokens_.q.begin() + (begin + n) * kw);
    t.k.assign(tokens_.k.begin() + begin * kw, tokens_.k.begin() + (begin + n) * kw);
    t.v.assign(tokens_.v.begin() + begin * vw, tokens_.v.begin() + (begin + n) * vw);
    t.g.assign(tokens_.g.begin() + begin * gw, tokens_.g.begin() + (begin + n) * gw);
    t.beta.assign(tokens_.beta.begin() + begin * hv, tokens_.beta.begin() + (begin + n) * hv);
    ref::StockCall call{{0, n}, {std::vector<int32_t>(n, 1)}, {}};
    ref::Stock(RefShape(), RefParams(), t, call, &pool);
    return pool.at(1);
  }

  std::vector<double> Outputs(int begin, int n) const {
    std::vector<double> o(n * ValueWidth(s_));
    const ref::Dtype d = RefDtype(s_.act_dtype);
    const size_t es = DTypeSize(s_.act_dtype);
    for (size_t i = 0; i < o.size(); ++i) {
      o[i] = ref::LoadElement(d, &out_[(begin * ValueWidth(s_) + i) * es]);
    }
    return o;
  }
  const ref::Tokens& tokens() const { return tokens_; }
  FastCursor& cursor(int32_t block) { return cursors_[block]; }
  const std::vector<uint8_t>& pool() const { return pool_; }
  const std::vector<uint8_t>& ring_k() const { return ring_k_; }
  const std::vector<uint8_t>& k_bytes() const { return k_; }
  int capacity() const { return capacity_; }
  int64_t num_blocks() const { return num_blocks_; }

 private:
  KdaShape s_;
  int q_len_;
  std::mt19937_64 rng_;
  int64_t num_blocks_ = 0, block_elems_ = 0;
  int capacity_ = 0;
  std::vector<uint8_t> pool_, ring_k_;
  std::vector<float> ring_u_, ring_g_;
  std::vector<FastCursor> cursors_;
  std::vector<float> a_log_, dt_bias_;
  std::vector<uint8_t> q_, k_, v_, g_, beta_, out_;
  ref::Tokens tokens_;
};

// The ring takes accepted candidates and nothing else; it folds exactly when
// the next window might not fit; Materialize into `out` changes nothing and
// in place leaves the same bytes in the pool.
TEST(FastKernelsTest, TheRingTakesAcceptedTokensAndFoldsOnSchedule) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed));
  const KdaShape shape =
      Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, 64, DType::kBFloat16, DType::kFloat32);
  const int q = 4;
  World w(shape, 1, q, /*fold_every=*/3, seed);  // R = 12
  const int32_t block = 1;
  ref::State want = w.BlockValues(w.pool(), block);
  const FastLayer layer = w.Layer();
  int tokens = 0;
  // (window, accepted): rejected drafts, partial windows, a fold.
  const std::pair<int, int> steps[] = {{4, 2}, {4, 0}, {3, 3}, {4, 4}, {2, 1}, {4, 4}, {1, 1}};
  for (const auto& [window, accepted] : steps) {
    SCOPED_TRACE(absl::StrCat("window ", window, ", accepted ", accepted));
    w.Draw(window);
    const std::vector<int32_t> qsl = {0, window}, blocks = {block};
    const std::vector<uint8_t> pool_before = w.pool();
    ASSERT_TRUE(FastVerifyCpu(w.VerifyArgs(qsl, blocks)).ok());
    EXPECT_EQ(w.pool(), pool_before) << "Verify wrote a state";
    EXPECT_EQ(w.cursor(block).tokens, tokens);
    EXPECT_EQ(w.cursor(block).candidates, window);
    // The candidates' k: the raw bits, per key head.
    const size_t row_bytes = KeyWidth(shape) * DTypeSize(shape.act_dtype);
    for (int t = 0; t < window; ++t) {
      EXPECT_EQ(std::memcmp(&w.ring_k()[(block * w.capacity() + tokens + t) * row_bytes],
                            &w.k_bytes()[t * row_bytes], row_bytes),
                0)
          << "candidate " << t;
    }
    // Outputs against the reference from the current state.
    const ref::StatePool ref_pool{{1, want}};
    ref::Records records = ref::MakeRecords(w.RefShape(), 1, q);
    const std::vector<double> want_out =
        ref::Verify(w.RefShape(), w.RefParams(), w.tokens(), {{0, window}, {1}}, ref_pool,
                    &records)
            .out;
    const std::vector<double> got_out = w.Outputs(0, window);
    EXPECT_LT(NormError(got_out, want_out), Tolerance(shape.act_dtype));
    EXPECT_LT(ElementwiseError(got_out, want_out), Tolerance(shape.act_dtype));
    const std::vector<int32_t> acc = {accepted};
    ASSERT_TRUE(FastCommitCpu(w.CommitArgs(&layer, qsl, blocks, acc)).ok());
    want = w.RefAdvance(want, 0, accepted);
    const bool fold = tokens + accepted + q > w.capacity();
    tokens = fold ? 0 : tokens + accepted;
    EXPECT_EQ(w.cursor(block).tokens, tokens);
    EXPECT_EQ(w.cursor(block).candidates, 0);
    if (!fold) {
      EXPECT_EQ(w.pool(), pool_before) << "a commit without a fold wrote the checkpoint";
    } else {
      EXPECT_NE(w.pool(), pool_before) << "the fold wrote nothing";
      EXPECT_LT(NormError(w.BlockValues(w.pool(), block), want), Tolerance(DType::kFloat32));
    }
    const std::vector<double> current = w.Current(block);
    EXPECT_LT(NormError(current, want), Tolerance(DType::kFloat32));
    EXPECT_LT(ElementwiseError(current, want), Tolerance(DType::kFloat32));
  }
  // Materialize in place: the pool then holds what Materialize into `out`
  // wrote, bit for bit, and the ring is empty.
  ASSERT_GT(w.cursor(block).tokens, 0);
  const std::vector<double> current = w.Current(block);
  FastMaterializeArgs m;
  m.shape = shape;
  m.num_layers = 1;
  m.layers = &layer;
  const int32_t blocks[] = {block, 0, block};  // null skipped, repeated folded once
  m.blocks = blocks;
  m.num_blocks_given = 3;
  ASSERT_TRUE(FastMaterializeCpu(m).ok());
  EXPECT_EQ(w.BlockValues(w.pool(), block), current);
  EXPECT_EQ(w.cursor(block).tokens, 0);
}

// One Commit for every layer of a group: each layer's ring advances and
// folds on its own data; a layer whose Verify did not run refuses the Commit
// of every layer.
TEST(FastKernelsTest, ACommitCoversEveryLayer) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed));
  const KdaShape shape =
      Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, 64, DType::kBFloat16, DType::kFloat32);
  const int q = 4;
  World w0(shape, 2, q, /*fold_every=*/2, seed), w1(shape, 2, q, 2, seed + 1);
  const FastLayer layers[] = {w0.Layer(), w1.Layer()};
  const std::vector<int32_t> blocks = {2, 1};
  ref::State want0[] = {w0.BlockValues(w0.pool(), 2), w0.BlockValues(w0.pool(), 1)};
  ref::State want1[] = {w1.BlockValues(w1.pool(), 2), w1.BlockValues(w1.pool(), 1)};
  for (int step = 0; step < 5; ++step) {
    const std::vector<int32_t> qsl = {0, q, q + 3}, accepted = {1 + step % q, step % 4};
    w0.Draw(q + 3);
    w1.Draw(q + 3);
    ASSERT_TRUE(FastVerifyCpu(w0.VerifyArgs(qsl, blocks)).ok());
    if (step == 4) {
      // Layer 1 not verified: its candidates are those of the last step's,
      // already consumed.
      FastCommitArgs a = w0.CommitArgs(layers, qsl, blocks, accepted);
      a.num_layers = 2;
      const auto before0 = w0.Everything(), before1 = w1.Everything();
      const absl::Status st = FastCommitCpu(a);
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
      EXPECT_NE(st.message().find("layer 1: row 0 commits"), std::string::npos) << st;
      EXPECT_EQ(w0.Everything(), before0);
      EXPECT_EQ(w1.Everything(), before1);
      break;
    }
    ASSERT_TRUE(FastVerifyCpu(w1.VerifyArgs(qsl, blocks)).ok());
    FastCommitArgs a = w0.CommitArgs(layers, qsl, blocks, accepted);
    a.num_layers = 2;
    ASSERT_TRUE(FastCommitCpu(a).ok());
    for (int r = 0; r < 2; ++r) {
      want0[r] = w0.RefAdvance(want0[r], qsl[r], std::min(accepted[r], qsl[r + 1] - qsl[r]));
      want1[r] = w1.RefAdvance(want1[r], qsl[r], std::min(accepted[r], qsl[r + 1] - qsl[r]));
      EXPECT_LT(NormError(w0.Current(blocks[r]), want0[r]), Tolerance(DType::kFloat32))
          << "step " << step << ", layer 0, row " << r;
      EXPECT_LT(NormError(w1.Current(blocks[r]), want1[r]), Tolerance(DType::kFloat32))
          << "step " << step << ", layer 1, row " << r;
    }
  }
  EXPECT_EQ(w0.cursor(2).tokens, w1.cursor(2).tokens);
}

// Align mode: a commit that crosses a block boundary stores the boundary
// state and the final state into their blocks (rings empty there); one that
// stays in the checkpoint's block appends to its ring.
TEST(FastKernelsTest, AlignModeStoresBoundaryAndFinalStates) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed));
  for (DType state : {DType::kFloat32, DType::kBFloat16}) {
    const KdaShape shape = Shape(LayerKind::kGdn, KdaGate::kSafe, 1, 2, 64, DType::kBFloat16, state);
    const int q = 4, bs = 5, width = 12;
    World w(shape, 1, q, /*fold_every=*/8, seed);  // a pool of blocks 0..3
    // The request's table cycles through blocks 1, 2, 3: a commit spans at
    // most two adjacent columns, always two different blocks.
    std::vector<int32_t> table(width);
    for (int c = 0; c < width; ++c) table[c] = 1 + c % 3;
    int computed = 3;  // the running state is in column (3 - 1) / 5 = 0
    ref::State want = w.BlockValues(w.pool(), table[0]);
    const FastLayer layer = w.Layer();
    int crossings = 0;
    for (int step = 0; step < 9; ++step) {
      const int window = q;
      const int accepted = 1 + step % q;
      const int32_t source = table[std::max(computed - 1, 0) / bs];
      w.Draw(window);
      const std::vector<int32_t> qsl = {0, window}, blocks = {source};
      ASSERT_TRUE(FastVerifyCpu(w.VerifyArgs(qsl, blocks)).ok());
      FastCommitArgs a = w.CommitArgs(&layer, qsl, blocks, {accepted});
      const std::vector<int32_t> acc = {accepted}, nc = {computed};
      a.num_accepted = acc.data();
      a.block_table = IndexMatrix{table.data(), width, width};
      a.num_computed_tokens = nc.data();
      a.mamba_block_size = bs;
      const absl::Status st = FastCommitCpu(a);
      ASSERT_TRUE(st.ok()) << st;
      const int next_boundary = (computed / bs + 1) * bs;
      const int boundary_len = next_boundary - computed;
      const int32_t final_block = table[(computed + accepted - 1) / bs];
      if (computed + accepted >= next_boundary) {
        ++crossings;
        const int32_t boundary_block = table[next_boundary / bs - 1];
        const ref::State at_boundary = w.RefAdvance(want, 0, boundary_len);
        EXPECT_LT(NormError(w.BlockValues(w.pool(), boundary_block), at_boundary),
                  Tolerance(state))
            << "step " << step << ": the boundary state";
        EXPECT_EQ(w.cursor(boundary_block).tokens, 0);
      }
      want = w.RefAdvance(want, 0, accepted);
      if (final_block != source || computed + accepted >= next_boundary) {
        EXPECT_LT(NormError(w.BlockValues(w.pool(), final_block), want), Tolerance(state))
            << "step " << step << ": the final state, stored";
        EXPECT_EQ(w.cursor(final_block).tokens, 0);
      } else {
        EXPECT_GT(w.cursor(final_block).tokens, 0) << "step " << step << ": not in the ring";
      }
      EXPECT_LT(NormError(w.Current(final_block), want), Tolerance(state) * 2) << "step " << step;
      computed += accepted;
    }
    EXPECT_GE(crossings, 3);
  }
}

// What the checks refuse, each with its field and bound, nothing written.
TEST(FastKernelsTest, MisuseIsRefusedWithNothingWritten) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(absl::StrCat("replay with SPECSTATE_TEST_SEED=", seed));
  const KdaShape shape =
      Shape(LayerKind::kKda, KdaGate::kSafe, 2, 0, 64, DType::kBFloat16, DType::kFloat32);
  const int q = 4;
  World w(shape, 2, q, /*fold_every=*/2, seed);  // R = 8
  const FastLayer layer = w.Layer();
  w.Draw(2 * q);
  const std::vector<int32_t> qsl = {0, q, 2 * q};
  const auto expect_refused = [&](const absl::Status& st, absl::StatusCode code,
                                  const std::string& text) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(text), std::string::npos) << st;
  };
  {
    // Two rows verifying from one block: their candidates would collide.
    const auto before = w.Everything();
    expect_refused(FastVerifyCpu(w.VerifyArgs(qsl, {1, 1})), absl::StatusCode::kInvalidArgument,
                   "rows 0 and 1 both verify from block 1");
    EXPECT_EQ(w.Everything(), before);
  }
  {
    // A block past the pool.
    const auto before = w.Everything();
    expect_refused(FastVerifyCpu(w.VerifyArgs(qsl, {1, static_cast<int32_t>(w.num_blocks())})),
                   absl::StatusCode::kOutOfRange, "state_indices[1]");
    EXPECT_EQ(w.Everything(), before);
  }
  {
    // A row longer than Q.
    const auto before = w.Everything();
    expect_refused(FastVerifyCpu(w.VerifyArgs({0, q + 1, 2 * q}, {1, 2})),
                   absl::StatusCode::kOutOfRange, "query_start_loc gives row 0 5 tokens");
    EXPECT_EQ(w.Everything(), before);
  }
  {
    // A window that does not fit in the ring (a cursor no Commit leaves).
    w.cursor(2) = FastCursor{w.capacity() - 2, 0};
    const auto before = w.Everything();
    expect_refused(FastVerifyCpu(w.VerifyArgs(qsl, {1, 2})), absl::StatusCode::kOutOfRange,
                   "no room for the window's 4");
    EXPECT_EQ(w.Everything(), before);
    w.cursor(2) = FastCursor{w.capacity() + 1, 0};
    expect_refused(FastVerifyCpu(w.VerifyArgs(qsl, {1, 2})),
                   absl::StatusCode::kFailedPrecondition, "rings.cursors[2]");
    w.cursor(2) = FastCursor{0, 0};
  }
  {
    // A Commit of more tokens than the last Verify left candidates.
    ASSERT_TRUE(FastVerifyCpu(w.VerifyArgs({0, q, q + 1}, {1, 2})).ok());
    ASSERT_TRUE(FastCommitCpu(w.CommitArgs(&layer, {0, q, q + 1}, {1, 2}, {q, 1})).ok());
    ASSERT_EQ(w.cursor(1).tokens, q);
    ASSERT_EQ(w.cursor(2).tokens, 1);
    // Now no candidates are left: a second Commit is refused.
    const auto after_first = w.Everything();
    expect_refused(FastCommitCpu(w.CommitArgs(&layer, {0, q, q + 1}, {1, 2}, {1, 1})),
                   absl::StatusCode::kFailedPrecondition, "left 0 candidates");
    EXPECT_EQ(w.Everything(), after_first);
  }
  {
    // Two rows committing from one block (both would write it).
    const auto before = w.Everything();
    expect_refused(FastCommitCpu(w.CommitArgs(&layer, {0, 1, 2}, {2, 2}, {1, 1})),
                   absl::StatusCode::kInvalidArgument, "rows 0 and 1 both write block 2");
    EXPECT_EQ(w.Everything(), before);
  }
  {
    // Host checks: Q past the window, a ring smaller than a window.
    FastVerifyArgs a = w.VerifyArgs(qsl, {1, 2});
    a.spec_query_len = 9;
    expect_refused(FastVerifyCpu(a), absl::StatusCode::kOutOfRange, "spec_query_len = 9");
    a = w.VerifyArgs(qsl, {1, 2});
    a.rings.capacity = q - 1;
    expect_refused(FastVerifyCpu(a), absl::StatusCode::kOutOfRange, "rings.capacity = 3");
    a = w.VerifyArgs(qsl, {1, 2});
    a.rings.num_blocks = 2;
    expect_refused(FastVerifyCpu(a), absl::StatusCode::kInvalidArgument, "rings.num_blocks = 2");
  }
  {
    // Materialize: a block past the pool, a layer past the group.
    const FastLayer l = w.Layer();
    FastMaterializeArgs m;
    m.shape = shape;
    m.num_layers = 1;
    m.layers = &l;
    const int32_t blocks[] = {1, static_cast<int32_t>(w.num_blocks())};
    m.blocks = blocks;
    m.num_blocks_given = 2;
    const auto before = w.Everything();
    expect_refused(FastMaterializeCpu(m), absl::StatusCode::kOutOfRange, "blocks[1]");
    EXPECT_EQ(w.Everything(), before);
    m.layer = 1;
    expect_refused(FastMaterializeCpu(m), absl::StatusCode::kOutOfRange, "layer = 1");
  }
}

}  // namespace
}  // namespace testing
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
