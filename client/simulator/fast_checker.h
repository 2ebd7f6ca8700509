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
// windows stay bit for bit (ModeChecker's): FAST changes only the recurrent
// state.
//
// A request's checkpoint block may hold tokens in its ring for many steps;
// the simulator does not model when the service folds, so such a block is
// checked only where it is materialized, each time against the request's
// current stock and reference states. A finished request's block is flushed
// with `discard` before its blocks are reused, as a scheduler must.
//
//   auto fast = MakeModeChecker(...);                    // for a FAST service
//   fast->LoadParams(layer, params); fast->StartRequest(layer, slot, prefill);
//   fast->RunReference(layer, inputs, requests, qsl, T);  // each step, beside the stock path
//   st = fast->CompareOutputs(plan);                     // after Verify
//   st = fast->CompareCommitted(plan);                   // StartsPending, CompareStates
//   fast->Verdict();                                     // at the end
#ifndef SPECSTATE_CLIENT_SIMULATOR_FAST_CHECKER_H_
#define SPECSTATE_CLIENT_SIMULATOR_FAST_CHECKER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/simulator/mode_checker.h"
#include "tests/reference/kda_reference.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// The contract's factor, and the error below which a ratio means nothing.
inline constexpr double kFastContractFactor = 2.0;
inline constexpr double kFastContractFloor = 1e-7;

class FastChecker final : public ModeChecker {
 public:
  // ModeChecker's arguments (MakeModeChecker's); `tp1` must be null (FAST
  // runs on one service).
  FastChecker(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
              const LayerBuffers& outputs, const Model& model, const Dims& dims,
              SimulationReport& report, Tp1Checks* tp1);

  // The reference's copy of layer `layer`'s gate parameters (KDA).
  void LoadParams(int layer, const GateParams& params) override;
  // A new request's state of `layer`, in its reference column 0.
  void StartRequest(int layer, int slot, const PrefillLayer& prefill) override;
  // The reference's step of `layer` on the service's inputs: the stock spec
  // path in float64, on the same columns as the stock path (before Advance).
  void RunReference(int layer, const LayerInputs& inputs, const std::vector<Request>& requests,
                    const std::vector<int32_t>& qsl, int64_t num_tokens) override;

  // After Verify: every layer's outputs (the service's and the stock
  // path's) against the reference's.
  absl::Status CompareOutputs(const StepPlan& p) override;

  // After a Flush of `blocks` (empty: every block): each flushed pending
  // block, every layer, against its request's current states.
  absl::Status CheckFlushed(const std::vector<int32_t>& blocks, int step,
                            absl::string_view how) override;
  // After ReadState of `slot`'s pending block in `layer`: its checksum
  // against its values, and those against the current states (the block
  // stays pending: a read folds into a copy).
  absl::Status CheckRead(int step, int slot, int layer, const v1::ReadStateResponse& read) override;

  std::vector<int32_t> PendingBlocks() const override { return pending_; }
  int32_t PendingBlock(int slot) const override { return pending_[slot]; }
  void Discarded(int slot) override;

  // Restart drills: each pending block with its request's current state (the
  // stock path's), which a re-prefill writes when a restart lost the block;
  // the block then holds that state with an empty ring: no longer pending.
  std::vector<Expected> Expectations() const override;
  void Forget(int slot) override { pending_[slot] = 0; }

  // At the end: the contract over the whole run (a mismatch if broken).
  void Verdict() override;

 protected:
  // After Commit: whether row `slot`'s checkpoint block keeps its ring (it
  // stays in the block, no boundary state); then its state is checked where
  // it is materialized.
  bool StartsPending(const StepPlan& p, int slot, const CommittedBlocks& c) override;
  // Then per layer: its committed state kept (for Expectations).
  absl::Status CheckPending(const StepPlan& p, int slot, int layer) override;
  // A real state the service stored: `layer`'s state in `block` against the
  // stock and reference states at column `col` of `slot`.
  absl::Status CompareStates(int step, int layer, int slot, int32_t block, int col,
                             absl::string_view what) override;

 private:
  // CompareStates of `service`, the service's state of `block` in `layer`
  // however it was read (the pool, or ReadState's values).
  absl::Status MeasureState(int step, int layer, int slot, int32_t block, int col,
                            const std::vector<char>& service, absl::string_view what);
  // One comparison of `got` (the service's) and `exact` (the stock path's)
  // with `want`, into the run's maxima; `what` names it for the worst case.
  void Measure(const std::vector<double>& got, const std::vector<double>& exact,
               const std::vector<double>& want, bool state, const std::string& what);

  reference::Shape shape_;
  std::vector<reference::LayerParams> params_;  // per layer
  std::vector<reference::StatePool> pools64_;   // per layer: block 1 + slot * Q + col
  std::vector<std::vector<double>> out64_;      // per layer: the step's outputs
  std::vector<std::vector<bool>> written64_;    // per layer: tokens with outputs
  std::vector<int32_t> pending_;                // per slot
  std::vector<std::vector<std::vector<char>>> current_;  // per slot, layer: its pending state
  // Where the largest FAST/exact ratio of each quantity was seen.
  std::string worst_[4];
  double worst_ratio_[4] = {0, 0, 0, 0};
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_FAST_CHECKER_H_
