// The simulator's checks of commit mode FAST (docs/semantics.md, "Fast mode
// (FAST)"), by its accuracy contract rather than bit for bit: beside its
// stock path (the exact path, the stock kernel's arithmetic) the simulator
// runs a float64 reference of the same model (//tests/reference, the stock
// spec path in double precision), and measures both against it: every
// layer's Verify outputs each step, and every state FAST materializes (an
// align-mode state a Commit stores in a new block, a Flush of some blocks or
// of all, a ReadState, the final Flush). The contract holds when, over the
// whole run, FAST's largest error is within 2x the exact path's, element-wise
// (max|got - want| / max|want|) and norm-wise (||got - want|| / ||want||),
// errors below 1e-7 (single fp32 roundings) counting as 1e-7. The conv
// windows stay bit for bit (Checks): FAST changes only the recurrent state.
//
// A request's checkpoint block may hold tokens in its ring for many steps;
// the simulator does not model when the service folds, so such a block is
// checked only where it is materialized, each time against the request's
// current stock and reference states. A finished request's block is flushed
// with `discard` before its blocks are reused, as a scheduler must.
//
//   FastChecks fast(memory, pools, stock, model, dims, report);
//   fast.LoadParams(layer, params); fast.StartRequest(layer, slot, prefill);
//   fast.RunReference(layer, inputs, requests, qsl, T);  // each step, beside the stock path
//   st = fast.CompareOutputs(plan, outputs);             // after Verify
//   ... Checks::CompareCommittedRow: StaysPending, CompareState
//   fast.Verdict();                                      // at the end
#ifndef SPECSTATE_CLIENT_SIMULATOR_FAST_CHECKS_H_
#define SPECSTATE_CLIENT_SIMULATOR_FAST_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/model.h"
#include "client/simulator/pools.h"
#include "client/simulator/report.h"
#include "client/simulator/simulation_report.h"
#include "client/simulator/stock_path.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// The contract's factor, and the error below which a ratio means nothing.
inline constexpr double kFastContractFactor = 2.0;
inline constexpr double kFastContractFloor = 1e-7;

class FastChecks {
 public:
  // Everything given must outlive this. A returned error is one of reading
  // memory: an error beyond the contract is counted in the report.
  FastChecks(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
             const Model& model, const Dims& dims, SimulationReport& report);

  // The reference's copy of layer `layer`'s gate parameters (KDA).
  void LoadParams(int layer, const GateParams& params);
  // A new request's state of `layer`, in its reference column 0.
  void StartRequest(int layer, int slot, const PrefillLayer& prefill);
  // The reference's step of `layer` on the service's inputs: the stock spec
  // path in float64, on the same columns as the stock path (before Advance).
  void RunReference(int layer, const LayerInputs& inputs, const std::vector<Request>& requests,
                    const std::vector<int32_t>& qsl, int64_t num_tokens);

  // After Verify: every layer's outputs (the service's and the stock
  // path's) against the reference's.
  absl::Status CompareOutputs(const StepPlan& p, const LayerBuffers& outputs);

  // After Commit, row `slot` of step p, whose Commit leaves its states in
  // `c`: whether its checkpoint block keeps its ring (it stays in the block,
  // no boundary state); then its state is checked where it is materialized.
  bool StaysPending(const StepPlan& p, int slot, const CommittedBlocks& c);
  // A real state the service stored: `layer`'s state in `block` against the
  // stock and reference states at column `col` of `slot`.
  absl::Status CompareState(int step, int layer, int slot, int32_t block, int col,
                            absl::string_view what);

  // After a Flush of `blocks` (empty: every block): each flushed pending
  // block, every layer, against its request's current states.
  absl::Status CheckFlushed(const std::vector<int32_t>& blocks, int step, absl::string_view how);
  // After ReadState of `slot`'s pending block in `layer`: its checksum
  // against the pool's bytes, and those against the current states.
  absl::Status CheckRead(int step, int slot, int layer, const v1::ReadStateResponse& read);

  // Per request slot, its pending block (0: none).
  std::vector<int32_t> PendingBlocks() const { return pending_; }
  int32_t PendingBlock(int slot) const { return pending_[slot]; }
  // A finished request's pending block was flushed with `discard`.
  void Discarded(int slot);

  // At the end: the contract over the whole run (a mismatch if broken).
  void Verdict();

 private:
  // One comparison of `got` (the service's) and `exact` (the stock path's)
  // with `want`, into the run's maxima; `what` names it for the worst case.
  void Measure(const std::vector<double>& got, const std::vector<double>& exact,
               const std::vector<double>& want, bool state, const std::string& what);

  SharedMemory& memory_;
  const ServicePools& pools_;
  const StockPath& stock_;
  const Model& model_;
  const Dims d_;
  SimulationReport& report_;
  Tally tally_;
  reference::Shape shape_;
  std::vector<reference::LayerParams> params_;  // per layer
  std::vector<reference::StatePool> pools64_;   // per layer: block 1 + slot * Q + col
  std::vector<std::vector<double>> out64_;      // per layer: the step's outputs
  std::vector<std::vector<bool>> written64_;    // per layer: tokens with outputs
  std::vector<int32_t> pending_;                // per slot
  // Where the largest FAST/exact ratio of each quantity was seen.
  std::string worst_[4];
  double worst_ratio_[4] = {0, 0, 0, 0};
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_FAST_CHECKS_H_
