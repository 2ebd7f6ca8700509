#include "client/simulator/ranks.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/simulator/host_bytes.h"

namespace specstate {
namespace client {
namespace simulator_internal {

absl::Status CheckRankOptions(int ranks, const SimulationOptions& options) {
  if (options.steps < 1) return absl::InvalidArgumentError("steps must be >= 1");
  if (options.crash_after_verify_step >= 0 || options.abandon_commit_at_step >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the crash tests (crash_after_verify_step, abandon_commit_at_step) drive one service, "
        "not ", ranks, " ranks"));
  }
  if (options.drill != nullptr) {
    return absl::InvalidArgumentError("a restart drill drives one service, not ranks");
  }
  if (options.transfer_every != 0 || !options.transfer_peer.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transfer_every (transfer_peer) moves blocks between one service and its peer, not ",
        ranks, " ranks"));
  }
  if (options.corrupt_rank < 0 || options.corrupt_rank >= ranks) {
    return absl::InvalidArgumentError(absl::StrCat("corrupt_rank = ", options.corrupt_rank,
                                                   " is not a rank: there are ", ranks));
  }
  return absl::OkStatus();
}

absl::Status RankError(int rank, const std::string& address, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat("rank ", rank, " (", address, "): ", status.message()));
}

absl::StatusOr<RankGroup> ReadRankLayouts(const std::vector<Client*>& ranks) {
  RankGroup group;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    absl::StatusOr<v1::Layout> layout = ranks[r]->GetLayout();
    if (!layout.ok()) return RankError(r, ranks[r]->address(), layout.status());
    group.layouts.push_back(*std::move(layout));
    group.addresses.push_back(ranks[r]->address());
  }
  absl::Status st = CheckRankLayouts(group.layouts, group.addresses);
  if (!st.ok()) return st;
  return group;
}

MergedProgress::MergedProgress(int ranks, std::function<void(const SimulationProgress&)> progress)
    : latest_(ranks), progress_(std::move(progress)) {}

std::function<void(const SimulationProgress&)> MergedProgress::ForRank(int rank) {
  if (!progress_) return nullptr;
  return [this, rank](const SimulationProgress& p) {
    absl::MutexLock lock(&mu_);
    latest_[rank] = p;
    SimulationProgress all = p;
    all.comparisons = all.mismatches = 0;
    for (const SimulationProgress& q : latest_) {
      all.step = std::min(all.step, q.step);
      all.comparisons += q.comparisons;
      all.mismatches += q.mismatches;
    }
    if (all.step <= reported_) return;
    reported_ = all.step;
    progress_(all);
  };
}

namespace {

// What rank r of `layout`'s model holds, for the report.
std::string RankPart(int r, int ranks, const v1::Layout& layout, const std::string& address) {
  const int h = layout.num_heads();
  const int hv = layout.num_value_heads() > 0 ? layout.num_value_heads() : h;
  const int d = layout.conv_dim();
  const std::string where = layout.backend() == v1::CUDA
                                ? absl::StrCat("CUDA device ", layout.device())
                                : std::string("CPU");
  return absl::StrFormat(
      "rank %d at %s (%s): heads %d-%d of %d, value heads %d-%d of %d, conv channels %d-%d of %d",
      r, address, where, r * h,
      (r + 1) * h - 1, ranks * h, r * hv, (r + 1) * hv - 1, ranks * hv, r * d, (r + 1) * d - 1,
      ranks * d);
}

// Whether two ranks ran the same steps (their rows, tokens and requests).
bool SameSteps(const SimulationReport& a, const SimulationReport& b) {
  return a.rows == b.rows && a.null_rows == b.null_rows &&
         a.tokens_verified == b.tokens_verified && a.tokens_accepted == b.tokens_accepted &&
         a.requests_started == b.requests_started && a.requests_finished == b.requests_finished &&
         a.boundary_states == b.boundary_states;
}

}  // namespace

absl::StatusOr<SimulationReport> MergeRankReports(
    const std::vector<absl::StatusOr<SimulationReport>>& reports,
    const std::vector<const Latencies*>& latencies, const RankGroup& group) {
  const int tp = static_cast<int>(reports.size());
  for (int r = 0; r < tp; ++r) {
    if (!reports[r].ok()) return RankError(r, group.addresses[r], reports[r].status());
  }
  // One report: the steps every rank ran (the same), the ranks' sums.
  SimulationReport merged = *reports[0];
  merged.tensor_parallel = tp;
  merged.state_bytes_saved = merged.comparisons = merged.mismatches = 0;
  merged.tp1_comparisons = merged.tp1_mismatches = 0;
  merged.first_mismatch.clear();
  Latencies all;
  for (int r = 0; r < tp; ++r) {
    const SimulationReport& rr = *reports[r];
    if (!SameSteps(rr, *reports[0])) {
      return absl::InternalError(absl::StrCat(
          "rank ", r, " ran other steps than rank 0 (its rows, tokens or requests differ): the "
          "ranks' draws diverged, a bug of the simulator"));
    }
    merged.state_bytes_saved += rr.state_bytes_saved;
    merged.comparisons += rr.comparisons;
    merged.mismatches += rr.mismatches;
    merged.tp1_comparisons += rr.tp1_comparisons;
    merged.tp1_mismatches += rr.tp1_mismatches;
    if (merged.first_mismatch.empty() && !rr.first_mismatch.empty()) {
      merged.first_mismatch = absl::StrCat("rank ", r, ": ", rr.first_mismatch);
    }
    all.Add(*latencies[r]);
    merged.ranks.push_back(RankPart(r, tp, group.layouts[r], group.addresses[r]));
  }
  merged.latency = all.Summaries();
  return merged;
}

// ---- the TP=1 check ----

Tp1Checks::Tp1Checks(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
                     const LayerBuffers& outputs, const Dims& dims, SimulationReport& report)
    : memory_(memory), pools_(pools), stock_(stock), outputs_(outputs), d_(dims), tally_(report) {}

absl::Status Tp1Checks::CompareState(int step, int layer, int slot, int32_t block, int col,
                                     absl::string_view what) {
  std::vector<char> service, tp1(d_.state_block_bytes);
  absl::Status st = pools_.ReadState(layer, block, &service);
  if (st.ok()) {
    st = memory_.CopyOut(tp1.data(),
                         stock_.ModelBlock(layer, slot, col) + d_.rank * d_.state_block_bytes,
                         tp1.size());
  }
  if (!st.ok()) return st;
  tally_.Count(/*tp1=*/true);
  if (std::memcmp(service.data(), tp1.data(), service.size()) == 0) return absl::OkStatus();
  const int64_t i = FirstDifference(service.data(), tp1.data(), d_.ss);
  const int64_t head = i / (int64_t{d_.K} * d_.K);
  tally_.Mismatch(
      absl::StrFormat(
          "step %d, layer %d, row %d: the %s in block %d differs from the TP=1 run's state "
          "(all %d value heads, column %d) at value head %d of the model (this rank's head %d), "
          "row %d, col %d: %.9g vs %.9g",
          step, layer, slot, std::string(what), block, d_.FHV, col, d_.rank * d_.HV + head, head,
          (i / d_.K) % d_.K, i % d_.K, ElementAsFloat(service.data() + i * d_.ss, d_.state),
          ElementAsFloat(tp1.data() + i * d_.ss, d_.state)),
      /*tp1=*/true);
  return absl::OkStatus();
}

absl::Status Tp1Checks::CompareOutputs(const StepPlan& p) {
  const int64_t T = p.num_tokens;
  const int64_t as = d_.as, VW = d_.VW, K = d_.K;
  for (int l = 0; l < d_.L; ++l) {
    std::vector<char> service(T * VW * as), model(T * d_.FVW * as), tp1(T * VW * as);
    absl::Status st = memory_.CopyOut(service.data(), outputs_[l]->data(), service.size());
    if (st.ok()) st = memory_.CopyOut(model.data(), stock_.ModelOutput(l).data(), model.size());
    if (!st.ok()) return st;
    CopyColumns(model, d_.FVW, d_.rank * VW, &tp1, VW, 0, T, VW, as);
    tally_.Count(/*tp1=*/true);
    if (std::memcmp(service.data(), tp1.data(), service.size()) == 0) continue;
    const int64_t e = FirstDifference(service.data(), tp1.data(), as);
    tally_.Mismatch(
        absl::StrFormat(
            "step %d, layer %d: Verify's output differs from the TP=1 run's (all %d value heads) "
            "at token %d, value head %d of the model (this rank's head %d), column %d: %.9g vs "
            "%.9g",
            p.step, l, d_.FHV, e / VW, d_.rank * d_.HV + (e / K) % d_.HV, (e / K) % d_.HV,
            e % K, ElementAsFloat(service.data() + e * as, d_.act),
            ElementAsFloat(tp1.data() + e * as, d_.act)),
        /*tp1=*/true);
  }
  return absl::OkStatus();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate
