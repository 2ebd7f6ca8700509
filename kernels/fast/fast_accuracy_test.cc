// The FAST mode's accuracy contract (issue 23): over 1,000 decode steps of
// random window lengths and accepted counts (0 included), the outputs' and
// the states' errors against the float64 reference stay within 2x the
// errors of the exact path (the CPU kernels' Verify + EAGER Commit) on the
// same inputs, element-wise and norm-wise, for F = 4, 8, 16, KDA's safe and
// plain gates and GDN, fp32 and bf16 state; and the state error grows over
// the folds no faster than the exact path's. Each case prints its seed and
// its numbers; SPECSTATE_TEST_SEED=<seed> replays one.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/fast/testing/fast_loop.h"
#include "kernels/kda_args.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace testing {
namespace {

// The contract's factor.
constexpr double kFactor = 2.0;
// Errors this small are fp32 roundings of single values: a ratio of two of
// them says nothing (both paths' errors sit there for fp32 state).
constexpr double kFloor = 1e-7;

uint64_t TestSeed() {
  const char* env = std::getenv("SPECSTATE_TEST_SEED");
  if (env != nullptr && *env != '\0') return std::strtoull(env, nullptr, 0);
  std::random_device device;
  return (uint64_t{device()} << 32) ^ device();
}

struct Case {
  const char* name;
  LayerKind kind;
  KdaGate gate;
  int value_heads;
  DType state;
  int fold_every;
  DType act = DType::kFloat32;
  int head_dim = 64;
  int q = 4;
  int steps = 1000;
  int heads = 2;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return absl::StrCat(c.name, "_", DTypeName(c.state), "_state_", DTypeName(c.act), "_act_F",
                      c.fold_every, "_K", c.head_dim, "_Q", c.q);
}

Errors Max(const LoopResult& r, bool fast, size_t begin, size_t end) {
  Errors m;
  for (size_t i = begin; i < end; ++i) {
    const Errors& e = fast ? r.steps[i].fast : r.steps[i].exact;
    m.out_elem = std::max(m.out_elem, e.out_elem);
    m.out_norm = std::max(m.out_norm, e.out_norm);
    if (r.steps[i].states) {
      m.state_elem = std::max(m.state_elem, e.state_elem);
      m.state_norm = std::max(m.state_norm, e.state_norm);
    }
  }
  return m;
}

class FastAccuracyTest : public ::testing::TestWithParam<Case> {};

TEST_P(FastAccuracyTest, WithinTwiceTheExactPathsErrors) {
  const Case& p = GetParam();
  LoopConfig c;
  c.shape.num_heads = p.heads;
  c.shape.head_dim = p.head_dim;
  c.shape.act_dtype = p.act;
  c.shape.state_dtype = p.state;
  c.shape.kind = p.kind;
  c.shape.gate = p.gate;
  c.shape.num_value_heads = p.value_heads;
  c.shape.lower_bound = -5.0f;
  c.q = p.q;
  c.fold_every = p.fold_every;
  c.rows = 3;
  c.steps = p.steps;
  c.seed = TestSeed();
  SCOPED_TRACE(absl::StrCat(Describe(c), " (replay with SPECSTATE_TEST_SEED=", c.seed, ")"));
  absl::StatusOr<LoopResult> run = RunLoop(c);
  ASSERT_TRUE(run.ok()) << run.status();
  const LoopResult& r = *run;
  EXPECT_TRUE(r.finite);
  const size_t n = r.steps.size();
  const Errors exact = Max(r, false, 0, n), fast = Max(r, true, 0, n);
  std::printf("%s\n  exact: out %.3e elem %.3e norm, state %.3e elem %.3e norm\n"
              "  FAST:  out %.3e elem %.3e norm, state %.3e elem %.3e norm\n"
              "  %d folds, %d tokens committed, %d rejected\n",
              Describe(c).c_str(), exact.out_elem, exact.out_norm, exact.state_elem,
              exact.state_norm, fast.out_elem, fast.out_norm, fast.state_elem, fast.state_norm,
              r.folds, r.committed_tokens, r.rejected_tokens);
  const auto bound = [](double exact_error) { return kFactor * std::max(exact_error, kFloor); };
  EXPECT_LE(fast.out_elem, bound(exact.out_elem)) << "outputs, element-wise";
  EXPECT_LE(fast.out_norm, bound(exact.out_norm)) << "outputs, norm-wise";
  EXPECT_LE(fast.state_elem, bound(exact.state_elem)) << "states, element-wise";
  EXPECT_LE(fast.state_norm, bound(exact.state_norm)) << "states, norm-wise";
  // Growth over the folds: each quarter of the run (a quarter of its folds)
  // stays within the factor of the exact path's error in the same quarter,
  // and FAST's last quarter over its first grows no faster than exact's.
  Errors first_fast, first_exact;
  for (int quarter = 0; quarter < 4; ++quarter) {
    const size_t b = n * quarter / 4, e = n * (quarter + 1) / 4;
    const Errors ex = Max(r, false, b, e), fa = Max(r, true, b, e);
    std::printf("  quarter %d (%d folds at its end): state elem exact %.3e FAST %.3e\n", quarter,
                r.steps[e - 1].folds, ex.state_elem, fa.state_elem);
    EXPECT_LE(fa.state_elem, bound(ex.state_elem)) << "quarter " << quarter;
    EXPECT_LE(fa.state_norm, bound(ex.state_norm)) << "quarter " << quarter;
    if (quarter == 0) {
      first_fast = fa;
      first_exact = ex;
    } else if (quarter == 3) {
      const double growth_fast = fa.state_elem / std::max(first_fast.state_elem, kFloor);
      const double growth_exact = ex.state_elem / std::max(first_exact.state_elem, kFloor);
      EXPECT_LE(growth_fast, kFactor * std::max(growth_exact, 1.0))
          << "the state error grows faster over the folds than the exact path's";
    }
  }
  // The loop exercised what it is about: folds, and rejected tokens.
  EXPECT_GT(r.folds, c.steps / (2 * c.fold_every));
  EXPECT_GT(r.rejected_tokens, c.steps / 4);
}

constexpr LayerKind kKda = LayerKind::kKda;
constexpr LayerKind kGdn = LayerKind::kGdn;
constexpr KdaGate kSafe = KdaGate::kSafe;
constexpr KdaGate kPlain = KdaGate::kPlain;
constexpr DType kF32 = DType::kFloat32;
constexpr DType kBf16 = DType::kBFloat16;

// GDN with grouped value heads: H = 1, HV = 2.
Case Gdn(DType state, int fold_every) {
  Case c{"Gdn", kGdn, kSafe, 2, state, fold_every};
  c.heads = 1;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Contract, FastAccuracyTest,
    ::testing::Values(
        // 1,000 steps, H = 2, K = 64, Q = 4 (GDN: H = 1, HV = 2), fp32 activations.
        Case{"KdaSafe", kKda, kSafe, 0, kF32, 4}, Case{"KdaSafe", kKda, kSafe, 0, kF32, 8},
        Case{"KdaSafe", kKda, kSafe, 0, kF32, 16}, Case{"KdaSafe", kKda, kSafe, 0, kBf16, 4},
        Case{"KdaSafe", kKda, kSafe, 0, kBf16, 8}, Case{"KdaSafe", kKda, kSafe, 0, kBf16, 16},
        Case{"KdaPlain", kKda, kPlain, 0, kF32, 4}, Case{"KdaPlain", kKda, kPlain, 0, kF32, 8},
        Case{"KdaPlain", kKda, kPlain, 0, kF32, 16}, Case{"KdaPlain", kKda, kPlain, 0, kBf16, 4},
        Case{"KdaPlain", kKda, kPlain, 0, kBf16, 8}, Case{"KdaPlain", kKda, kPlain, 0, kBf16, 16},
        Gdn(kF32, 4), Gdn(kF32, 8), Gdn(kF32, 16), Gdn(kBf16, 4), Gdn(kBf16, 8), Gdn(kBf16, 16),
        // bf16 activations (the ring's k in bf16: the raw bits); Q = 8.
        Case{"KdaSafe", kKda, kSafe, 0, kF32, 8, kBf16, 64, 8, 500},
        Case{"Gdn", kGdn, kSafe, 2, kBf16, 8, kBf16, 64, 8, 500},
        // Larger heads, fewer steps.
        Case{"KdaSafe", kKda, kSafe, 0, kF32, 8, kF32, 128, 8, 150, 1},
        Case{"Gdn", kGdn, kSafe, 2, kBf16, 4, kF32, 256, 8, 60, 1}),
    CaseName);

}  // namespace
}  // namespace testing
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
