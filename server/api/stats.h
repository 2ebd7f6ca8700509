// Per-RPC call counts, errors by code and latency histograms.
//
//   RpcStatsRegistry stats;
//   auto start = absl::Now();
//   ...
//   stats.Record("Verify", status.code(), absl::Now() - start);
#ifndef SPECSTATE_SERVER_API_STATS_H_
#define SPECSTATE_SERVER_API_STATS_H_

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

// Buckets with upper bounds 1, 2, 5, 10, 20, 50, ... microseconds up to 10 s;
// the last bucket is open.
class LatencyHistogram {
 public:
  static constexpr int kBuckets = 23;
  void Add(double us);
  // Linear interpolation inside the bucket holding the quantile.
  double Quantile(double q) const;
  void ToProto(v1::LatencyHistogram* out) const;

 private:
  static const std::array<double, kBuckets - 1>& Bounds();
  std::array<uint64_t, kBuckets> counts_{};
  uint64_t count_ = 0;
  double sum_us_ = 0;
};

class RpcStatsRegistry {
 public:
  void Record(const std::string& method, absl::StatusCode code, absl::Duration latency);
  void ToProto(v1::Stats* out) const;

 private:
  struct Entry {
    uint64_t calls = 0;
    std::map<std::string, uint64_t> errors;
    LatencyHistogram latency;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> methods_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_API_STATS_H_
