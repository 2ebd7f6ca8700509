// The simulator's report as it is gathered: per-RPC latencies, and the tally
// of comparisons (how many, how many differ, the first difference) kept in
// the SimulationReport (simulation_report.h). FormatReport (declared there,
// defined in report.cc)
// prints the report and its verdict.
//
//   Latencies latencies;
//   absl::Status st = latencies.Time("Commit", [&] { return session->Commit(c).status(); });
//   Tally tally(report);
//   tally.Count();
//   if (differ) tally.Mismatch("step 3, layer 0: ...");
#ifndef SPECSTATE_CLIENT_SIMULATOR_REPORT_H_
#define SPECSTATE_CLIENT_SIMULATOR_REPORT_H_

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "client/simulator/simulation_report.h"

namespace specstate {
namespace client {
namespace simulator_internal {

using Clock = std::chrono::steady_clock;

// Per-RPC latencies, for the report.
class Latencies {
 public:
  void Add(const std::string& rpc, Clock::duration d);
  // Every sample of `other` too (tensor parallelism: every rank's calls).
  void Add(const Latencies& other);
  // `call()`, timed as one sample of `rpc`; returns what it returns.
  template <typename Call>
  auto Time(const std::string& rpc, Call&& call) {
    const Clock::time_point t0 = Clock::now();
    auto result = call();
    Add(rpc, Clock::now() - t0);
    return result;
  }
  std::map<std::string, LatencySummary> Summaries() const;

 private:
  std::map<std::string, std::vector<double>> samples_;
};

// Counts comparisons into a report and keeps its first mismatch. `tp1`: a
// comparison with the TP=1 run (tensor parallelism), counted in both totals.
class Tally {
 public:
  explicit Tally(SimulationReport& report) : report_(report) {}
  void Count(bool tp1 = false);
  // A mismatch of the comparison just counted, described by `what`.
  void Mismatch(const std::string& what, bool tp1 = false);

 private:
  SimulationReport& report_;
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_REPORT_H_
