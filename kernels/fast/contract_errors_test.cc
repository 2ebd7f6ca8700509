#include "kernels/fast/contract_errors.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace specstate {
namespace kernels {
namespace fast {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::vector<double> Random(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = normal(rng);
  return v;
}

TEST(ContractErrorsTest, MatchTheirDefinitions) {
  std::mt19937_64 rng(0xe77);
  const std::vector<double> want = Random(257, rng);
  std::vector<double> got = want;
  double worst = 0.0, scale = 0.0, diff2 = 0.0, norm2 = 0.0;
  std::normal_distribution<double> noise(0.0, 1e-6);
  for (size_t i = 0; i < got.size(); ++i) {
    got[i] += noise(rng);
    worst = std::max(worst, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
    diff2 += (got[i] - want[i]) * (got[i] - want[i]);
    norm2 += want[i] * want[i];
  }
  EXPECT_DOUBLE_EQ(ElementwiseError(got, want), worst / scale);
  EXPECT_DOUBLE_EQ(NormError(got, want), std::sqrt(diff2 / norm2));
  EXPECT_EQ(ElementwiseError(want, want), 0.0);
  EXPECT_EQ(NormError(want, want), 0.0);
}

TEST(ContractErrorsTest, ANaNAnywhereIsNeverForgotten) {
  std::mt19937_64 rng(0xa11);
  const std::vector<double> want = Random(64, rng);
  for (size_t at : {size_t{0}, size_t{31}, size_t{63}}) {
    std::vector<double> got = Random(64, rng);
    got[at] = kNaN;
    // Elements after the NaN are finite and differ: they must not replace it.
    EXPECT_TRUE(std::isnan(ElementwiseError(got, want))) << "NaN at " << at;
    EXPECT_TRUE(std::isnan(NormError(got, want))) << "NaN at " << at;
  }
  EXPECT_TRUE(std::isnan(MaxError(kNaN, 1.0)));
  EXPECT_TRUE(std::isnan(MaxError(1.0, kNaN)));
  EXPECT_EQ(MaxError(2.0, 1.0), 2.0);
  // A running maximum that once saw a NaN fails any bound check.
  double running = 0.0;
  for (double e : {1e-7, kNaN, 3e-7, 2e-7}) running = MaxError(running, e);
  EXPECT_FALSE(running <= 1.0);
}

TEST(ContractErrorsTest, AllZeroReferenceGivesTheAbsoluteError) {
  const std::vector<double> want(8, 0.0);
  std::vector<double> got(8, 0.0);
  got[3] = -0.25;
  EXPECT_EQ(ElementwiseError(got, want), 0.25);
  EXPECT_EQ(NormError(got, want), 0.25);
}

}  // namespace
}  // namespace fast
}  // namespace kernels
}  // namespace specstate
