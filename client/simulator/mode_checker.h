// The simulator's checks of one service, behind one interface for the three
// commit modes (docs/semantics.md, "Commit modes"). ModeChecker holds what
// every mode checks alike, and is EAGER's checker as it stands: every Verify
// output against the stock kernel's, every committed recurrent state (and
// align-mode boundary state) against the stock path's state at its column,
// and every conv window the next step reads against the window the stock
// path reads, bit for bit; RecordStateBlocks' outputs against what the
// step's rows imply. Under tensor parallelism each check of an output or a
// state is followed by the TP=1 check's (Tp1Checks). Each mode's differences
// are overrides of the virtual members:
//   DeferredChecker (deferred_checker.h): a row's committed state is pending
//     on its checkpoint block and checked where it is materialized;
//   FastChecker (fast_checker.h): outputs and states by the accuracy contract
//     against a float64 reference, conv windows still bit for bit.
// Every comparison is counted in the report, and the first mismatch
// described there.
//
// The driver makes its checker once, by the service's commit mode
// (MakeModeChecker), and calls every hook in every mode (a mode without the
// phase does nothing); `phases()` says which of its own phases (Flush and
// ReadState between steps, a drill's pending blocks, the planted
// corruption's) the mode has.
//
//   std::unique_ptr<ModeChecker> checker =
//       MakeModeChecker(memory, pools, stock, outputs, model, dims, report, /*tp1=*/nullptr);
//   absl::Status st = checker->CompareOutputs(plan);  // after Verify
//   if (st.ok()) st = checker->BeforeCommit(plan);
//   if (st.ok()) st = checker->CompareCommitted(plan);  // after Commit
//   checker->Verdict();                               // at the end
#ifndef SPECSTATE_CLIENT_SIMULATOR_MODE_CHECKER_H_
#define SPECSTATE_CLIENT_SIMULATOR_MODE_CHECKER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/model.h"
#include "client/simulator/pools.h"
#include "client/simulator/ranks.h"
#include "client/simulator/report.h"
#include "client/simulator/simulation_report.h"
#include "client/simulator/stock_path.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// The driver's phases that differ by commit mode, fixed with the checker.
struct ModePhases {
  // DEFERRED, FAST: blocks hold pending tokens. A finished request's block
  // is flushed with `discard`; now and then between steps pending blocks are
  // flushed or read, and at the end every one is flushed.
  bool pending_blocks = false;
  // DEFERRED: a restart keeps the pending blocks (the service journals
  // them): a drill expects them (DeferredExpect) and re-prefills a lost one
  // with the state it must become.
  bool drill_keeps_pending = false;
  // FAST: the planted corruption flushes its block first (a checkpoint
  // behind a ring is decayed by the ring's gates, which can hide any flip in
  // it) and flips every element of it (one element's flip changes bf16
  // outputs by less than their rounding, which the contract tolerates).
  bool corrupt_whole_block = false;
};

class ModeChecker {
 public:
  virtual ~ModeChecker() = default;
  ModeChecker(const ModeChecker&) = delete;
  ModeChecker& operator=(const ModeChecker&) = delete;

  const ModePhases& phases() const { return phases_; }

  // ---- set-up, and each step beside the stock path (FAST: its float64
  // reference keeps copies) ----
  virtual void LoadParams(int layer, const GateParams& params) {}
  virtual void StartRequest(int layer, int slot, const PrefillLayer& prefill) {}
  virtual void RunReference(int layer, const LayerInputs& inputs,
                            const std::vector<Request>& requests, const std::vector<int32_t>& qsl,
                            int64_t num_tokens) {}

  // ---- each step; a returned error is one of reading memory: a mismatch is
  // counted, not returned ----
  // After Verify: every layer's output against the stock kernel's (then,
  // under tensor parallelism, against the TP=1 run's).
  virtual absl::Status CompareOutputs(const StepPlan& p);
  // After the outputs were compared, before Commit (DEFERRED: the pending
  // blocks the Verify calls materialized, and the checkpoints to keep).
  virtual absl::Status BeforeCommit(const StepPlan& p) { return absl::OkStatus(); }
  // After RecordStateBlocks (align mode): its outputs, read from `recorded`
  // (state_idx then num_accepted, batch_max rows each, in shared memory). A
  // live row's state_idx is the column of its last accepted token and its
  // num_accepted 1; a null row keeps the poison.
  absl::Status CheckRecordedBlocks(const StepPlan& p, const int32_t* recorded);
  // After Commit, before the rows advance: each live row's committed states
  // (unless StartsPending) and conv windows.
  absl::Status CompareCommitted(const StepPlan& p);

  // ---- pending blocks (phases().pending_blocks) ----
  // Per request slot, its pending block (0: none); empty without any.
  virtual std::vector<int32_t> PendingBlocks() const { return {}; }
  virtual int32_t PendingBlock(int slot) const { return 0; }
  // After a Flush of `blocks` (empty: of every block): each flushed pending
  // block, materialized by `how`.
  virtual absl::Status CheckFlushed(const std::vector<int32_t>& blocks, int step,
                                    absl::string_view how) {
    return absl::OkStatus();
  }
  // After ReadState of `slot`'s pending block in `layer`.
  virtual absl::Status CheckRead(int step, int slot, int layer, const v1::ReadStateResponse& read) {
    return absl::OkStatus();
  }
  // A finished request's pending block was flushed with `discard`.
  virtual void Discarded(int slot) {}

  // ---- restart drills (phases().drill_keeps_pending) ----
  // Per request slot with a pending block, that block and the state each
  // layer must become (what a scheduler re-prefills when the service reports
  // the block lost, since its pending tokens are then gone).
  struct Expected {
    int slot;
    int32_t block;
    std::vector<std::vector<char>> state;
  };
  virtual std::vector<Expected> Expectations() const { return {}; }
  // The service forgot `slot`'s pending tokens (its block was lost and
  // re-prefilled with the materialized state).
  virtual void Forget(int slot) {}

  // ---- the end: FAST's contract over the whole run (a mismatch if broken) ----
  virtual void Verdict() {}

 protected:
  // Everything given must outlive this; `outputs` are the service's Verify
  // outputs per layer; `tp1` is null with one rank.
  ModeChecker(const ModePhases& phases, SharedMemory& memory, const ServicePools& pools,
              const StockPath& stock, const LayerBuffers& outputs, const Model& model,
              const Dims& dims, SimulationReport& report, Tp1Checks* tp1);

  // After Commit, row `slot` of step p, whose Commit leaves its states in
  // `c`: whether its state is left pending on its block (not checked now:
  // CheckPending instead); if so its pending block starts here.
  virtual bool StartsPending(const StepPlan& p, int slot, const CommittedBlocks& c) {
    return false;
  }
  // Then per layer, what a pending row's block holds.
  virtual absl::Status CheckPending(const StepPlan& p, int slot, int layer) {
    return absl::OkStatus();
  }
  // The service's state in `block` against the stock path's at column `col`
  // (and the TP=1 run's), bit for bit.
  virtual absl::Status CompareStates(int step, int layer, int slot, int32_t block, int col,
                                     absl::string_view what);

  SharedMemory& memory_;
  const ServicePools& pools_;
  const StockPath& stock_;
  const LayerBuffers& outputs_;
  const Model& model_;
  const Dims d_;
  SimulationReport& report_;
  Tally tally_;
  Tp1Checks* const tp1_;

 private:
  absl::Status CompareCommittedRow(const StepPlan& p, int slot);
  // This service's state, bit for bit against the stock path's.
  absl::Status CompareState(int step, int layer, int slot, int32_t block, int col,
                            absl::string_view what);
  // The service's conv window in `block` against `expected` [D][hl].
  absl::Status CompareWindow(int step, int layer, int slot, int32_t block,
                             const std::vector<char>& expected, absl::string_view what);

  const ModePhases phases_;
};

// The checker of the service's commit mode (dims.deferred, dims.fast, else
// EAGER), with ModeChecker's arguments. It marks the report with its mode
// (SimulationReport::deferred, ::fast).
std::unique_ptr<ModeChecker> MakeModeChecker(SharedMemory& memory, const ServicePools& pools,
                                             const StockPath& stock, const LayerBuffers& outputs,
                                             const Model& model, const Dims& dims,
                                             SimulationReport& report, Tp1Checks* tp1);

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_MODE_CHECKER_H_
