// Tensor parallelism in the simulator: TP ranks, one service each, every
// service holding one rank's part of the model (H/TP heads, HV/TP value
// heads, D/TP conv channels). Every rank's driver (a worker thread) draws the
// whole model's values from the same seed, so all ranks run the same steps;
// here is what concerns the group: the options and layouts a group takes,
// the ranks' progress and reports merged into one, and the TP=1 check, which
// compares each rank's committed states and Verify outputs, head by head,
// with the stock kernel's run over every head of the model (StockPath's
// TP=1 run).
//
//   absl::Status st = CheckRankOptions(tp, options);
//   absl::StatusOr<RankGroup> group = ReadRankLayouts(ranks);
//   ...  // one driver per rank, each with Tp1Checks
//   absl::StatusOr<SimulationReport> merged = MergeRankReports(reports, latencies, *group);
#ifndef SPECSTATE_CLIENT_SIMULATOR_RANKS_H_
#define SPECSTATE_CLIENT_SIMULATOR_RANKS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/lib/client.h"
#include "client/simulator/model.h"
#include "client/simulator/pools.h"
#include "client/simulator/report.h"
#include "client/simulator/simulator.h"
#include "client/simulator/stock_path.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// ---- the group ----

// INVALID_ARGUMENT when `options` cannot run on `ranks` services (more than
// one): the crash tests and restart drills take one service, and
// corrupt_rank must be a rank.
absl::Status CheckRankOptions(int ranks, const SimulationOptions& options);

// The ranks' layouts and addresses, checked to be the equal parts of one
// model (CheckRankLayouts: FAILED_PRECONDITION).
struct RankGroup {
  std::vector<v1::Layout> layouts;
  std::vector<std::string> addresses;
};
absl::StatusOr<RankGroup> ReadRankLayouts(const std::vector<Client*>& ranks);

// `status` of rank `rank`, its message prefixed with "rank r (ADDRESS): ".
absl::Status RankError(int rank, const std::string& address, const absl::Status& status);

// The ranks' progress, passed on once every rank has done a step, with the
// ranks' sums.
class MergedProgress {
 public:
  MergedProgress(int ranks, std::function<void(const SimulationProgress&)> progress);
  // What rank `rank` reports its progress to (null without a progress callback).
  std::function<void(const SimulationProgress&)> ForRank(int rank);

 private:
  absl::Mutex mu_;
  std::vector<SimulationProgress> latest_ ABSL_GUARDED_BY(mu_);
  int reported_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(const SimulationProgress&)> progress_;
};

// One report of the ranks' reports: the steps every rank ran (the same; an
// INTERNAL error when they differ), the ranks' sums of comparisons,
// mismatches and state bytes saved, the first rank's first mismatch, what
// each rank holds, and every rank's latencies. A rank's error is returned as
// RankError.
absl::StatusOr<SimulationReport> MergeRankReports(
    const std::vector<absl::StatusOr<SimulationReport>>& reports,
    const std::vector<const Latencies*>& latencies, const RankGroup& group);

// ---- the TP=1 check ----

// Compares this rank's service with the TP=1 run, on this rank's value heads
// (counted in the report as comparisons and as TP=1 comparisons).
class Tp1Checks {
 public:
  // Everything given must outlive this; `outputs` are the service's Verify
  // outputs per layer.
  Tp1Checks(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
            const LayerBuffers& outputs, const Dims& dims, SimulationReport& report);

  // The service's state of `layer` in `block` against the TP=1 run's state
  // of request slot `slot` at stock column `col`.
  absl::Status CompareState(int step, int layer, int slot, int32_t block, int col,
                            absl::string_view what);
  // Every layer's Verify output of step p against the TP=1 run's.
  absl::Status CompareOutputs(const StepPlan& p);

 private:
  SharedMemory& memory_;
  const ServicePools& pools_;
  const StockPath& stock_;
  const LayerBuffers& outputs_;
  const Dims d_;
  Tally tally_;
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_RANKS_H_
