#include "server/api/stats.h"

#include <algorithm>

namespace specstate {
namespace server {

const std::array<double, LatencyHistogram::kBuckets - 1>& LatencyHistogram::Bounds() {
  static const std::array<double, kBuckets - 1> bounds = [] {
    std::array<double, kBuckets - 1> b{};
    const double steps[3] = {1, 2, 5};
    double scale = 1;
    for (int i = 0; i < kBuckets - 1; ++i) {
      b[i] = steps[i % 3] * scale;
      if (i % 3 == 2) scale *= 10;
    }
    return b;
  }();
  return bounds;
}

void LatencyHistogram::Add(double us) {
  const auto& bounds = Bounds();
  const int bucket = static_cast<int>(std::lower_bound(bounds.begin(), bounds.end(), us) -
                                      bounds.begin());
  ++counts_[bucket];
  ++count_;
  sum_us_ += us;
}

double LatencyHistogram::Quantile(double q) const {
  if (count_ == 0) return 0;
  const auto& bounds = Bounds();
  const double target = q * count_;
  double seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    if (counts_[i] == 0) continue;
    if (seen + counts_[i] >= target) {
      const double lo = i == 0 ? 0 : bounds[i - 1];
      const double hi = i < kBuckets - 1 ? bounds[i] : bounds[kBuckets - 2] * 2;
      return lo + (hi - lo) * (target - seen) / counts_[i];
    }
    seen += counts_[i];
  }
  return bounds[kBuckets - 2];
}

void LatencyHistogram::ToProto(v1::LatencyHistogram* out) const {
  for (double b : Bounds()) out->add_bounds_us(b);
  for (uint64_t c : counts_) out->add_counts(c);
  out->set_count(count_);
  out->set_sum_us(sum_us_);
  out->set_p50_us(Quantile(0.5));
  out->set_p99_us(Quantile(0.99));
}

void RpcStatsRegistry::Record(const std::string& method, absl::StatusCode code,
                              absl::Duration latency) {
  absl::MutexLock lock(&mu_);
  Entry& e = methods_[method];
  ++e.calls;
  if (code != absl::StatusCode::kOk) ++e.errors[absl::StatusCodeToString(code)];
  e.latency.Add(absl::ToDoubleMicroseconds(latency));
}

void RpcStatsRegistry::ToProto(v1::Stats* out) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [method, e] : methods_) {
    v1::RpcStats* r = out->add_rpcs();
    r->set_method(method);
    r->set_calls(e.calls);
    for (const auto& [code, n] : e.errors) (*r->mutable_errors())[code] = n;
    e.latency.ToProto(r->mutable_latency());
  }
}

}  // namespace server
}  // namespace specstate
