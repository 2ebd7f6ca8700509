// ReadState's summaries against a float64 computation over fresh random
// values, in every float dtype.
#include "server/engine/tensor_summary.h"

#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "kernels/numeric.h"
#include "server/base/fnv1a.h"

namespace specstate {
namespace server {
namespace {

template <typename T>
void CheckSummary(DType dtype, std::mt19937_64& rng) {
  const int count = std::uniform_int_distribution<int>(1, 300)(rng);
  std::normal_distribution<float> normal(0.5f, 2.0f);
  std::vector<T> values(count);
  double mn = 1e300, mx = -1e300, sum = 0, sq = 0;
  for (T& v : values) {
    if constexpr (std::is_same_v<T, float>) {
      v = normal(rng);
    } else {
      v = FromFloat<T>(normal(rng));
    }
    const double x = ToFloat(v);
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    sum += x;
    sq += x * x;
  }
  v1::TensorSummary out;
  SummarizeTensor(values.data(), count * sizeof(T), dtype, /*keep_values=*/true, {count}, &out);
  EXPECT_EQ(out.min(), mn);
  EXPECT_EQ(out.max(), mx);
  EXPECT_DOUBLE_EQ(out.mean(), sum / count);
  EXPECT_DOUBLE_EQ(out.l2_norm(), std::sqrt(sq));
  EXPECT_EQ(out.checksum(), Fnv1a(absl::string_view(reinterpret_cast<const char*>(values.data()),
                                                    count * sizeof(T))));
  ASSERT_EQ(out.values_size(), count);
  ASSERT_EQ(out.shape_size(), 1);
  EXPECT_EQ(out.shape(0), count);
  for (int i = 0; i < count; ++i) EXPECT_EQ(out.values(i), ToFloat(values[i]));

  v1::TensorSummary without_values;
  SummarizeTensor(values.data(), count * sizeof(T), dtype, false, {count}, &without_values);
  EXPECT_EQ(without_values.values_size(), 0);
  EXPECT_EQ(without_values.checksum(), out.checksum());
}

TEST(TensorSummaryTest, MatchesAFloat64Computation) {
  std::mt19937_64 rng(::testing::UnitTest::GetInstance()->random_seed());
  CheckSummary<float>(DType::kFloat32, rng);
  CheckSummary<BFloat16>(DType::kBFloat16, rng);
  CheckSummary<Float16>(DType::kFloat16, rng);
}

}  // namespace
}  // namespace server
}  // namespace specstate
