// The simulator's checks of commit mode DEFERRED (docs/semantics.md, "Commit
// modes"): ModeChecker's, bit for bit, but a deferred row's committed state
// is pending. After Commit its tokens are pending on its block, which must
// still hold the checkpoint bit for bit; the state the block must become
// (the stock path's, and under tensor parallelism the TP=1 run's) is kept
// here per request slot and checked where the service materializes it: by
// the next step's Verify (before its Commit), by a Flush of some blocks or
// of all, or by ReadState (its checksum and the block's bytes). The driver
// makes those calls, and flushes a finished request's pending block with
// `discard` before its blocks are reused, as a scheduler must.
//
//   auto deferred = MakeModeChecker(...);        // for a DEFERRED service
//   st = deferred->BeforeCommit(plan);           // after Verify: materialized by it; checkpoints
//   st = deferred->CompareCommitted(plan);       // StartsPending, CheckPending per layer
//   st = deferred->CheckFlushed(blocks, step, "a Flush");
#ifndef SPECSTATE_CLIENT_SIMULATOR_DEFERRED_CHECKER_H_
#define SPECSTATE_CLIENT_SIMULATOR_DEFERRED_CHECKER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/simulator/mode_checker.h"

namespace specstate {
namespace client {
namespace simulator_internal {

class DeferredChecker final : public ModeChecker {
 public:
  // ModeChecker's arguments (MakeModeChecker's).
  DeferredChecker(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
                  const LayerBuffers& outputs, const Model& model, const Dims& dims,
                  SimulationReport& report, Tp1Checks* tp1);

  // After a step's Verify calls: every live row's pending block (its
  // checkpoint) is materialized; then the live rows' checkpoints, which a
  // deferred row's block must still hold after Commit.
  absl::Status BeforeCommit(const StepPlan& p) override;

  // After a Flush of `blocks` (empty: of every block): each flushed pending
  // block, materialized by `how`.
  absl::Status CheckFlushed(const std::vector<int32_t>& blocks, int step,
                            absl::string_view how) override;
  // After ReadState of `slot`'s pending block in `layer`: its checksum and
  // its values against the stock state (the block stays pending: a read
  // materializes into a copy).
  absl::Status CheckRead(int step, int slot, int layer, const v1::ReadStateResponse& read) override;

  std::vector<int32_t> PendingBlocks() const override;
  int32_t PendingBlock(int slot) const override { return pending_[slot].block; }
  void Discarded(int slot) override;

  std::vector<Expected> Expectations() const override;
  void Forget(int slot) override { pending_[slot] = Pending(); }

 protected:
  // After Commit: whether row `slot`'s tokens are pending (on its checkpoint
  // block, with no boundary state written); if so its pending block starts
  // here.
  bool StartsPending(const StepPlan& p, int slot, const CommittedBlocks& c) override;
  // Then per layer: the block still holds the checkpoint, and the stock
  // state it must become is kept.
  absl::Status CheckPending(const StepPlan& p, int slot, int layer) override;

 private:
  // Per request slot: its block whose tokens are pending, and per layer the
  // stock state (this rank's part; under TP also the TP=1 run's) it must
  // hold once materialized.
  struct Pending {
    int32_t block = 0;  // 0: nothing pending
    int step = 0;
    std::vector<std::vector<char>> state, tp1_state;
  };

  // After a step's Verify calls: every live row's pending block.
  absl::Status CheckMaterializedByVerify(const StepPlan& p);
  // Before Commit: the live rows' checkpoints.
  absl::Status SnapshotCheckpoints(const StepPlan& p);
  // A pending block, once materialized: every layer checked against
  // the stock state kept for it (and the TP=1 run's); then nothing pending.
  absl::Status CheckMaterialized(int step, int slot, absl::string_view how);
  // The service's block `block` of `layer` against `expected`, bit for bit
  // (`tp1`: counted as a comparison with the TP=1 run too).
  absl::Status CompareBytes(int step, int layer, int slot, int32_t block,
                            const std::vector<char>& expected, absl::string_view what,
                            absl::string_view against, bool tp1 = false);

  std::vector<Pending> pending_;
  std::vector<std::vector<std::vector<char>>> checkpoints_;  // [slot][layer], before Commit
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_DEFERRED_CHECKER_H_
