// The simulator's checks of commit mode DEFERRED (docs/semantics.md, "Commit
// modes"). After Commit a deferred row's tokens are pending on its block,
// which must still hold the checkpoint bit for bit; the state the block must
// become (the stock path's, and under tensor parallelism the TP=1 run's) is
// kept here per request slot and checked where the service materializes it:
// by the next step's Verify (before its Commit), by a Flush of some blocks or
// of all, or by ReadState (its checksum and the block's bytes). The driver
// makes those calls, and flushes a finished request's pending block with
// `discard` before its blocks are reused, as a scheduler must.
//
//   DeferredChecks deferred(memory, pools, stock, model, dims, report);
//   st = deferred.CheckMaterializedByVerify(plan);  // after the Verify calls
//   st = deferred.SnapshotCheckpoints(plan);        // before Commit
//   ... Checks::CompareCommitted: StartPending, CheckPending per layer
#ifndef SPECSTATE_CLIENT_SIMULATOR_DEFERRED_CHECKS_H_
#define SPECSTATE_CLIENT_SIMULATOR_DEFERRED_CHECKS_H_

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

namespace specstate {
namespace client {
namespace simulator_internal {

class DeferredChecks {
 public:
  // Everything given must outlive this. A returned error is one of reading
  // memory: a mismatch is counted in the report, not returned.
  DeferredChecks(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
                 const Model& model, const Dims& dims, SimulationReport& report);

  // After a step's Verify calls: every live row's pending block (its
  // checkpoint) is materialized.
  absl::Status CheckMaterializedByVerify(const StepPlan& p);
  // Before Commit: the live rows' checkpoints, which a deferred row's block
  // must still hold after it.
  absl::Status SnapshotCheckpoints(const StepPlan& p);

  // After Commit, row `slot` of step p, whose Commit leaves its states in
  // `c`: whether its tokens are pending (on its checkpoint block, with no
  // boundary state written); if so its pending block starts here.
  bool StartPending(const StepPlan& p, int slot, const CommittedBlocks& c);
  // Then per layer: the block still holds the checkpoint, and the stock
  // state it must become is kept.
  absl::Status CheckPending(const StepPlan& p, int slot, int layer);

  // After a Flush of `blocks` (empty: of every block): each flushed pending
  // block, materialized by `how`.
  absl::Status CheckFlushed(const std::vector<int32_t>& blocks, int step, absl::string_view how);
  // After ReadState of `slot`'s pending block in `layer`: its checksum and
  // the block's bytes in that layer.
  absl::Status CheckRead(int step, int slot, int layer, const v1::ReadStateResponse& read);

  // Per request slot, its pending block (0: none).
  std::vector<int32_t> PendingBlocks() const;
  int32_t PendingBlock(int slot) const { return pending_[slot].block; }
  // A finished request's pending block was flushed with `discard`.
  void Discarded(int slot);

  // Restart drills: per request slot with a pending block, that block and
  // the state each layer must become (what a scheduler re-prefills when the
  // service reports the block lost, since its pending tokens are then gone).
  struct Expected {
    int slot;
    int32_t block;
    std::vector<std::vector<char>> state;
  };
  std::vector<Expected> Expectations() const;
  // The service forgot `slot`'s pending tokens (its block was lost and
  // re-prefilled with the materialized state).
  void Forget(int slot) { pending_[slot] = Pending(); }

 private:
  // Per request slot: its block whose tokens are pending, and per layer the
  // stock state (this rank's part; under TP also the TP=1 run's) it must
  // hold once materialized; whether each layer already is (ReadState).
  struct Pending {
    int32_t block = 0;  // 0: nothing pending
    int step = 0;
    std::vector<std::vector<char>> state, tp1_state;
    std::vector<bool> materialized;
  };

  // A pending block, once materialized: every layer not yet checked against
  // the stock state kept for it (and the TP=1 run's); then nothing pending.
  absl::Status CheckMaterialized(int step, int slot, absl::string_view how);
  // The service's block `block` of `layer` against `expected`, bit for bit
  // (`tp1`: counted as a comparison with the TP=1 run too).
  absl::Status CompareBytes(int step, int layer, int slot, int32_t block,
                            const std::vector<char>& expected, absl::string_view what,
                            absl::string_view against, bool tp1 = false);

  SharedMemory& memory_;
  const ServicePools& pools_;
  const StockPath& stock_;
  const Model& model_;
  const Dims d_;
  SimulationReport& report_;
  Tally tally_;
  std::vector<Pending> pending_;
  std::vector<std::vector<std::vector<char>>> checkpoints_;  // [slot][layer], before Commit
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_DEFERRED_CHECKS_H_
