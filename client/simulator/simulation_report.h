// What a simulation found: counts, comparisons and their verdict, latencies,
// and what each commit mode's checks measured. The driver (simulator.h) fills
// it; the checkers (mode_checker.h, deferred_checker.h, fast_checker.h) add
// to it through report.h's Tally without including the driver; specstatectl
// prints it with FormatReport (defined in report.cc).
#ifndef SPECSTATE_CLIENT_SIMULATOR_SIMULATION_REPORT_H_
#define SPECSTATE_CLIENT_SIMULATOR_SIMULATION_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace specstate {
namespace client {

struct LatencySummary {
  uint64_t count = 0;
  double p50_us = 0;
  double p99_us = 0;
  double mean_us = 0;
};

struct SimulationReport {
  std::string backend;
  int steps = 0;
  int layers = 0;
  uint64_t rows = 0;
  uint64_t null_rows = 0;
  uint64_t tokens_verified = 0;
  uint64_t tokens_accepted = 0;
  uint64_t requests_started = 0;
  uint64_t requests_finished = 0;
  uint64_t boundary_states = 0;
  // (Q - 1) state blocks per request and layer that the stock path holds
  // and RecoverSSM does not, at the largest number of live requests.
  uint64_t state_bytes_saved = 0;
  uint64_t comparisons = 0;
  uint64_t mismatches = 0;
  std::string first_mismatch;
  std::map<std::string, LatencySummary> latency;  // per RPC (under TP, every rank's calls)
  // Tensor parallelism: the number of ranks (1: one service), what each rank
  // holds, and how many of `comparisons` (of `mismatches`) compared a rank's
  // committed states and outputs with the TP=1 run's. Under TP the counts of rows, tokens and
  // requests are each rank's (all ranks run the same), and comparisons,
  // mismatches and state_bytes_saved the ranks' sums.
  int tensor_parallel = 1;
  std::vector<std::string> ranks;
  uint64_t tp1_comparisons = 0;
  uint64_t tp1_mismatches = 0;
  // Commit mode DEFERRED: the service's mode, and how the deferred rows'
  // states were materialized (each then compared with the stock path's).
  bool deferred = false;
  uint64_t pending_checked = 0;     // blocks that held their checkpoint after Commit
  uint64_t materialized_by_verify = 0;
  uint64_t materialized_by_flush = 0;
  uint64_t materialized_by_read = 0;  // (layer, block) pairs ReadState materialized
  uint64_t discarded = 0;             // finished requests' pending blocks flushed with discard
  // The host tier (SimulationOptions::host_tier_every): blocks saved,
  // overwritten and restored, each then checked as after a Flush.
  uint64_t host_tier_round_trips = 0;
  // Transfers (SimulationOptions::transfer_every): blocks moved to the peer
  // and back (saved, fetched, restored into the peer's pool and saved there,
  // checked there; fetched back and restored), each then checked as above.
  uint64_t transfer_round_trips = 0;
  // Commit mode FAST: the service's mode and fold_every; how many states
  // were measured; the largest errors over the run against the float64
  // reference, FAST's (the service's) and the exact path's (the stock
  // path's): [0] outputs element-wise, [1] outputs norm-wise, [2] states
  // element-wise, [3] states norm-wise. The contract: fast <= 2x
  // max(exact, 1e-7) in each. The DEFERRED counters above count FAST's
  // materializations too (pending_checked: rows whose block kept its ring).
  bool fast = false;
  int fold_every = 0;
  uint64_t fast_states_checked = 0;
  double fast_error[4] = {0, 0, 0, 0};
  double exact_error[4] = {0, 0, 0, 0};
  // Restart drills: restarts survived, steps re-run, blocks reported lost
  // (and re-prefilled), and the drill's summary.
  int restarts = 0;
  uint64_t steps_rerun = 0;
  uint64_t lost_blocks = 0;
  std::string restart_summary;
  bool passed() const {
    return mismatches == 0 && comparisons > 0 && (tensor_parallel == 1 || tp1_comparisons > 0);
  }
};

std::string FormatReport(const SimulationReport& report);

}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_SIMULATION_REPORT_H_
