#include "server/engine/tensor_summary.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/string_view.h"
#include "kernels/numeric.h"
#include "server/base/fnv1a.h"

namespace specstate {
namespace server {
namespace {

template <typename T>
void Summarize(const T* values, int64_t count, bool keep, const std::vector<int64_t>& shape,
               v1::TensorSummary* out) {
  double mn = std::numeric_limits<double>::infinity();
  double mx = -mn, sum = 0, sq = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double x = ToFloat(values[i]);
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    sum += x;
    sq += x * x;
    if (keep) out->add_values(static_cast<float>(x));
  }
  for (int64_t d : shape) out->add_shape(d);
  out->set_min(count ? mn : 0);
  out->set_max(count ? mx : 0);
  out->set_mean(count ? sum / count : 0);
  out->set_l2_norm(std::sqrt(sq));
  out->set_checksum(
      Fnv1a(absl::string_view(reinterpret_cast<const char*>(values), count * sizeof(T))));
}

}  // namespace

void SummarizeTensor(const void* data, int64_t bytes, DType dtype, bool keep_values,
                     const std::vector<int64_t>& shape, v1::TensorSummary* out) {
  switch (dtype) {
    case DType::kFloat32:
      Summarize(static_cast<const float*>(data), bytes / 4, keep_values, shape, out);
      break;
    case DType::kFloat16:
      Summarize(static_cast<const Float16*>(data), bytes / 2, keep_values, shape, out);
      break;
    case DType::kBFloat16:
      Summarize(static_cast<const BFloat16*>(data), bytes / 2, keep_values, shape, out);
      break;
    case DType::kInt32:
      break;
  }
}

}  // namespace server
}  // namespace specstate
