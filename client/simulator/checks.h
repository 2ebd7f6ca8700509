// The simulator's checks of one service, bit for bit, each step: every
// Verify output against the stock kernel's; every committed recurrent state
// (and align-mode boundary state) against the stock path's state at its
// column, and every conv window the next step reads against the window the
// stock path reads; RecordStateBlocks' outputs against what the step's rows
// imply. Under tensor parallelism each check of an output or a state is
// followed by the TP=1 check's (Tp1Checks); in commit mode DEFERRED a
// pending row's committed state is checked where it is materialized
// (DeferredChecks); in commit mode FAST outputs and states are measured by
// its accuracy contract instead (FastChecks), conv windows still bit for
// bit. Every comparison is counted in the report, and the first
// mismatch described there.
//
//   Checks checks(memory, pools, stock, outputs, model, dims, report, /*tp1=*/nullptr,
//                 /*deferred=*/nullptr, /*fast=*/nullptr);
//   absl::Status st = checks.CompareOutputs(plan);          // after Verify
//   if (st.ok()) st = checks.CompareCommitted(plan);        // after Commit
#ifndef SPECSTATE_CLIENT_SIMULATOR_CHECKS_H_
#define SPECSTATE_CLIENT_SIMULATOR_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/deferred_checks.h"
#include "client/simulator/fast_checks.h"
#include "client/simulator/model.h"
#include "client/simulator/pools.h"
#include "client/simulator/ranks.h"
#include "client/simulator/report.h"
#include "client/simulator/simulation_report.h"
#include "client/simulator/stock_path.h"

namespace specstate {
namespace client {
namespace simulator_internal {

class Checks {
 public:
  // Everything given must outlive this; `outputs` are the service's Verify
  // outputs per layer; `tp1` is null with one rank, `deferred` but in
  // commit mode DEFERRED, `fast` but in commit mode FAST. A returned error is one of reading memory: a mismatch is
  // counted, not returned.
  Checks(SharedMemory& memory, const ServicePools& pools, const StockPath& stock,
         const LayerBuffers& outputs, const Model& model, const Dims& dims,
         SimulationReport& report, Tp1Checks* tp1, DeferredChecks* deferred, FastChecks* fast);

  // After Verify: every layer's output against the stock kernel's (then,
  // under tensor parallelism, against the TP=1 run's).
  absl::Status CompareOutputs(const StepPlan& p);
  // After RecordStateBlocks (align mode): its outputs, read from `recorded`
  // (state_idx then num_accepted, batch_max rows each, in shared memory). A
  // live row's state_idx is the column of its last accepted token and its
  // num_accepted 1; a null row keeps the poison.
  absl::Status CheckRecordedBlocks(const StepPlan& p, const int32_t* recorded);
  // After Commit, before the rows advance: each live row's committed states
  // (DEFERRED: a pending row's block still holds its checkpoint) and conv
  // windows.
  absl::Status CompareCommitted(const StepPlan& p);

 private:
  absl::Status CompareCommittedRow(const StepPlan& p, int slot);
  // The service's state in `block` against the stock path's at column `col`
  // (and the TP=1 run's).
  absl::Status CompareStates(int step, int layer, int slot, int32_t block, int col,
                             absl::string_view what);
  absl::Status CompareState(int step, int layer, int slot, int32_t block, int col,
                            absl::string_view what);
  // The service's conv window in `block` against `expected` [D][hl].
  absl::Status CompareWindow(int step, int layer, int slot, int32_t block,
                             const std::vector<char>& expected, absl::string_view what);

  SharedMemory& memory_;
  const ServicePools& pools_;
  const StockPath& stock_;
  const LayerBuffers& outputs_;
  const Model& model_;
  const Dims d_;
  SimulationReport& report_;
  Tally tally_;
  Tp1Checks* const tp1_;
  DeferredChecks* const deferred_;
  FastChecks* const fast_;
};

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_CHECKS_H_
