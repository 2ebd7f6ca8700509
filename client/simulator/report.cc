#include "client/simulator/report.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace specstate {
namespace client {
namespace simulator_internal {

void Latencies::Add(const std::string& rpc, Clock::duration d) {
  samples_[rpc].push_back(std::chrono::duration<double, std::micro>(d).count());
}

void Latencies::Add(const Latencies& other) {
  for (const auto& [rpc, v] : other.samples_) {
    samples_[rpc].insert(samples_[rpc].end(), v.begin(), v.end());
  }
}

std::map<std::string, LatencySummary> Latencies::Summaries() const {
  std::map<std::string, LatencySummary> out;
  for (auto [rpc, v] : samples_) {
    std::sort(v.begin(), v.end());
    LatencySummary s;
    s.count = v.size();
    s.p50_us = v[v.size() / 2];
    s.p99_us = v[std::min(v.size() - 1, static_cast<size_t>(v.size() * 0.99))];
    double sum = 0;
    for (double x : v) sum += x;
    s.mean_us = sum / v.size();
    out[rpc] = s;
  }
  return out;
}

void Tally::Count(bool tp1) {
  ++report_.comparisons;
  if (tp1) ++report_.tp1_comparisons;
}

void Tally::Mismatch(const std::string& what, bool tp1) {
  if (tp1) ++report_.tp1_mismatches;
  ++report_.mismatches;
  if (report_.first_mismatch.empty()) report_.first_mismatch = what;
}

}  // namespace simulator_internal

namespace {

// The verdict line: PASS with what was compared, or FAIL with why.
std::string Verdict(const SimulationReport& r) {
  if (r.passed() && r.tensor_parallel > 1) {
    return absl::StrFormat(
        "verdict: PASS: %d comparisons, every output, state and conv window of the %d ranks "
        "bit-identical to the stock path, and every head's committed state and output to the "
        "TP=1 run's (%d of the comparisons)\n",
        r.comparisons, r.tensor_parallel, r.tp1_comparisons);
  }
  if (r.passed() && r.fast) {
    return absl::StrFormat(
        "verdict: PASS: %d comparisons, outputs and states within FAST's accuracy contract "
        "(errors against the float64 reference within 2x the stock path's), every conv window "
        "bit-identical to the stock path\n",
        r.comparisons);
  }
  if (r.passed()) {
    return absl::StrFormat(
        "verdict: PASS: %d comparisons, every output, state and conv window bit-identical to "
        "the stock path%s\n",
        r.comparisons,
        r.restarts > 0 ? absl::StrFormat(", across %d restarts of the service", r.restarts) : "");
  }
  if (r.comparisons == 0) return "verdict: FAIL: nothing was compared\n";
  if (r.mismatches == 0) {  // tensor parallelism, no TP=1 comparison
    return "verdict: FAIL: nothing was compared with the TP=1 run\n";
  }
  const std::string tp1 =
      r.tensor_parallel > 1
          ? absl::StrFormat(" (%d of %d against the TP=1 run)", r.tp1_mismatches,
                            r.tp1_comparisons)
          : "";
  return absl::StrFormat("verdict: FAIL: %d of %d comparisons differ%s; first: %s\n",
                         r.mismatches, r.comparisons, tp1, r.first_mismatch);
}

}  // namespace

std::string FormatReport(const SimulationReport& r) {
  std::string out = absl::StrFormat(
      "steps %d on the %s backend, %d layers: %d rows (%d null), %d tokens verified, %d accepted\n"
      "requests: %d started, %d finished; %d boundary states (align mode)\n"
      "memory saved against the stock path: %d bytes of recurrent state\n",
      r.steps, r.backend, r.layers, r.rows, r.null_rows, r.tokens_verified, r.tokens_accepted,
      r.requests_started, r.requests_finished, r.boundary_states, r.state_bytes_saved);
  if (r.host_tier_round_trips > 0) {
    out += absl::StrFormat(
        "host tier: %d blocks saved, overwritten and restored between steps, each checked as "
        "after a Flush\n",
        r.host_tier_round_trips);
  }
  if (r.transfer_round_trips > 0) {
    out += absl::StrFormat(
        "transfers: %d blocks moved to the peer service and back between steps (FetchSaved both "
        "ways, through a block of the peer's), checked on the peer and when back\n",
        r.transfer_round_trips);
  }
  if (r.deferred) {
    out += absl::StrFormat(
        "commit mode DEFERRED: %d blocks held their checkpoint after Commit; materialized by "
        "Verify %d, by Flush %d, by ReadState %d (layer, block); %d discarded at a request's end\n",
        r.pending_checked, r.materialized_by_verify, r.materialized_by_flush,
        r.materialized_by_read, r.discarded);
  }
  if (r.fast) {
    out += absl::StrFormat(
        "commit mode FAST, fold every %d steps: %d rows kept their ring after Commit; %d states "
        "measured (materialized by Flush %d, by ReadState %d; %d discarded at a request's end)\n"
        "  largest error against the float64 reference   FAST       exact (stock path)  ratio\n",
        r.fold_every, r.pending_checked, r.fast_states_checked, r.materialized_by_flush,
        r.materialized_by_read, r.discarded);
    const char* names[4] = {"outputs, element-wise", "outputs, norm-wise", "states, element-wise",
                            "states, norm-wise"};
    for (int q = 0; q < 4; ++q) {
      out += absl::StrFormat("    %-42s %9.3g  %9.3g  %9.2f\n", names[q], r.fast_error[q],
                             r.exact_error[q],
                             r.fast_error[q] / std::max(r.exact_error[q], 1e-7));
    }
  }
  if (r.tensor_parallel > 1) {
    out += absl::StrFormat("tensor parallelism: TP=%d, one service per rank\n", r.tensor_parallel);
    for (const std::string& rank : r.ranks) out += absl::StrCat("  ", rank, "\n");
  }
  if (!r.restart_summary.empty()) {
    out += absl::StrFormat(
        "restart drill: %s; %d steps re-run, %d blocks reported lost (and re-prefilled)\n",
        r.restart_summary, r.steps_rerun, r.lost_blocks);
  }
  out += "latency per RPC (us):           calls      p50      p99     mean\n";
  for (const auto& [rpc, s] : r.latency) {
    out += absl::StrFormat("  %-28s %7d %8.1f %8.1f %8.1f\n", rpc, s.count, s.p50_us, s.p99_us,
                           s.mean_us);
  }
  return out + Verdict(r);
}

}  // namespace client
}  // namespace specstate
