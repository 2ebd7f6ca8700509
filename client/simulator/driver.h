// The driver of the simulation (simulator.h's RunSimulation): sets up one
// service (its layout, pools, session, shared buffers, the stock path's
// memory and the layer parameters) and runs the decode steps on it, as a
// scheduler does, calling on the model (model.h) for the draws, the stock
// path (stock_path.h) for the reference and the checker of the service's
// commit mode (mode_checker.h) after each phase. Private to the simulator;
// its phases, a file each:
//   simulator.cc             set-up, Run, RunSimulation (one service, or one
//                            driver per rank on worker threads: ranks.h)
//   step.cc                  one step: churn and prefill, the inputs, Verify,
//                            Commit, RecordStateBlocks, the crash and
//                            corruption tests, doorbells
//   pending_and_restarts.cc  Flush and ReadState of pending blocks between
//                            steps and at the end (DEFERRED, FAST), and a
//                            restart drill's resume
//   host_tier_phase.cc       a block saved to the host tier, evicted and
//                            restored, and the helpers of moved blocks
//   transfer_phase.cc        a block's round trip through a second service
#ifndef SPECSTATE_CLIENT_SIMULATOR_DRIVER_H_
#define SPECSTATE_CLIENT_SIMULATOR_DRIVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/lib/client.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/mode_checker.h"
#include "client/simulator/model.h"
#include "client/simulator/pools.h"
#include "client/simulator/ranks.h"
#include "client/simulator/report.h"
#include "client/simulator/restart_drill.h"
#include "client/simulator/simulator.h"
#include "client/simulator/stock_path.h"

namespace specstate {
namespace client {
namespace simulator_internal {

// SPECSTATE_TRACE=1: each phase of each step on stderr, so a stall shows
// where it is (used while bringing up a backend).
void TracePhase(int step, const char* phase);

// The transfer phase's options (transfer_every, transfer_peer,
// corrupt_transfer_at_step) for a simulation of the service at `address`:
// INVALID_ARGUMENT naming the field for a bad value or combination (a peer
// without transfer_every or the other way round, the service itself as its
// peer, a restart drill).
absl::Status CheckTransferOptions(const SimulationOptions& options, const std::string& address);

// The driver of one service: the whole model's, or under tensor parallelism
// rank `rank`'s part of it (of `ranks`).
class Driver {
 public:
  Driver(Client& client, const SimulationOptions& options, int rank = 0, int ranks = 1)
      : client_(client), options_(options), rank_(rank), tp_(ranks) {}

  const Latencies& latencies() const { return latencies_; }

  absl::StatusOr<SimulationReport> Run();

 private:
  // ---- set-up (simulator.cc) ----
  absl::Status Setup();
  absl::Status ReadLayout();
  absl::Status OpenMemoryAndPools();
  absl::Status AllocateSharedBuffers();
  absl::Status LoadLayerParams();
  absl::Status BindInputs();
  absl::Status CreateEvents();
  // Layer `l`'s q, k, v and beta (column slices of proj), g and o, for
  // `tokens` tokens, in a Verify or BindVerifyInputs request.
  template <typename Message>
  void SetLayerTensors(int l, int64_t tokens, Message* r);

  // ---- one step (step.cc) ----
  absl::Status Step(int s);
  absl::Status ServiceCalls(const StepPlan& p);
  absl::Status ChurnRequests(int s);
  absl::Status FinishRequest(int slot);
  absl::Status Prefill(int slot);
  absl::Status LayOutMetadata(StepPlan& p);
  void BuildVerifies(StepPlan& p);
  absl::Status SendVerifies(const StepPlan& p, const std::string& name);
  absl::Status WriteInputs(const StepPlan& p);
  absl::Status WriteLayerInputs(int l, const LayerInputs& in, const std::vector<char>& poison);
  absl::Status UpdateConvWindows(StepPlan& p);
  absl::Status RunVerifies(const StepPlan& p);
  v1::CommitRequest BuildCommit(const StepPlan& p);
  absl::Status CommitStep(const StepPlan& p);
  absl::Status RecordStateBlocks(const StepPlan& p);
  absl::Status CorruptARunningState(bool flip, int step);
  [[noreturn]] void Crash();

  // ---- pending blocks and restarts (pending_and_restarts.cc) ----
  // Pending blocks (ModePhases::pending_blocks: DEFERRED, FAST): flushed or
  // read between steps, and at the end.
  absl::Status FlushAndCheck(const std::vector<int32_t>& blocks, int step, absl::string_view how);
  absl::Status MaterializeSome(int step);
  absl::Status MaterializeSomeOnce(int step);
  absl::Status FinalFlush();
  // ---- blocks moved out of the pools and back (host_tier_phase.cc,
  // transfer_phase.cc) ----
  // A live request's checkpoint block, picked with `rng`, and its bytes in
  // every layer before it moves.
  struct MovingBlock {
    int32_t block = 0;     // 0: no live request has one
    bool pending = false;  // the mode holds it pending: checked as after a Flush
    std::vector<std::vector<char>> states, convs;  // per layer
  };
  absl::StatusOr<MovingBlock> PickMovingBlock(std::mt19937_64& rng);
  // Every layer's state and conv window of `block` in `pools` overwritten
  // with random bytes (an eviction: the block reused by someone else).
  absl::Status WriteNoise(ServicePools& pools, int32_t block, std::mt19937_64& rng);
  // `got` (per layer, of `block` in `whose` pools) against `want`, bit for
  // bit: each layer a comparison, each difference a mismatch naming `how`.
  void CompareBlockBytes(const std::vector<std::vector<char>>& got,
                         const std::vector<std::vector<char>>& want, bool states, int step,
                         int32_t block, absl::string_view whose, absl::string_view how);
  // After `moving` came back into its block by `how`: a pending block holds
  // its materialized state (checked as after a Flush), any other exactly
  // its bytes; conv windows always their bytes.
  absl::Status CheckMovedBack(const MovingBlock& moving, int step, absl::string_view how);
  // The host tier (SimulationOptions::host_tier_every): a live request's
  // block saved, overwritten, restored and checked.
  absl::Status EvictAndRestore(int step);
  // Transfers (SimulationOptions::transfer_every): the peer connected, its
  // layout and host tiers checked, a driving session opened on it and its
  // pools mapped (at set-up); then a block's round trip through the peer.
  absl::Status ConnectTransferPeer();
  absl::Status TransferRoundTrip(int step);
  // Restart drills: a step's service calls, or a call between steps, across
  // the service's restarts.
  absl::Status ServiceCallsAcrossRestarts(StepPlan& p);
  // Runs `call` (a Flush or ReadState between steps) across the drill's
  // restarts.
  absl::Status BetweenStepsAcrossRestarts(const std::function<absl::Status()>& call);
  // DEFERRED (ModePhases::drill_keeps_pending): what a death may have
  // touched (DeferredExpect) and the states pending blocks must become;
  // after the restart, lost blocks re-prefilled (a pending one with its
  // materialized state).
  struct DeferredSnapshot {
    DeferredExpect expect;
    std::vector<ModeChecker::Expected> expected;
  };
  DeferredSnapshot SnapshotPending(bool between_steps) const;
  absl::Status RePrefill(const std::vector<int32_t>& lost, const std::vector<char>& before,
                         const DeferredSnapshot* snapshot);
  std::vector<int32_t> last_listed_;  // what the last Commit left pending
  uint64_t last_step_id_ = 0;

  // ---- the metadata buffer and its doorbells (step.cc) ----
  int32_t* Meta(int offset) { return reinterpret_cast<int32_t*>(meta_->data()) + offset; }
  absl::Status WaitDoorbell(int index, uint32_t value);
  v1::Doorbell Door(int index, uint32_t value);

  Client& client_;
  const SimulationOptions options_;
  const int rank_;  // tensor parallelism: this service's rank, of tp_
  const int tp_;
  SimulationReport report_;
  Latencies latencies_;

  v1::Layout layout_;
  Dims d_;
  MetaOffsets at_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<SharedMemory> memory_;
  std::unique_ptr<ServicePools> pools_;
  std::unique_ptr<StockPath> stock_;
  std::unique_ptr<Session> session_;
  // The scheduler's shared buffers, registered with the session: per layer
  // proj = [q | k | v | beta] per token (so q, k, v and beta are column
  // slices with a token stride larger than a token), g and o; and one int32
  // buffer for the step's metadata and doorbells.
  LayerBuffers proj_, g_, o_;
  std::unique_ptr<SharedBuffer> meta_;
  std::unique_ptr<IpcEvent> inputs_ready_, work_done_;
  std::unique_ptr<Tp1Checks> tp1_;  // tensor parallelism only
  // The checks of the service's commit mode, and the phases it has: both
  // chosen once, at set-up.
  std::unique_ptr<ModeChecker> checker_;
  ModePhases phases_;
  // Transfers (transfer_every): the peer, a driving session on it and its
  // pools (mapped with memory_, so declared after it).
  std::unique_ptr<Client> peer_;
  std::unique_ptr<Session> peer_session_;
  std::unique_ptr<ServicePools> peer_pools_;
};

template <typename Message>
void Driver::SetLayerTensors(int l, int64_t tokens, Message* r) {
  const int64_t HK = d_.HK, as = d_.as;
  const char* proj = static_cast<const char*>(proj_[l]->data());
  const std::vector<int64_t> strides = {d_.proj_stride, d_.K, 1};
  *r->mutable_q() = session_->Tensor(proj, d_.act, {tokens, d_.H, d_.K}, strides).value();
  *r->mutable_k() = session_->Tensor(proj + HK * as, d_.act, {tokens, d_.H, d_.K}, strides).value();
  *r->mutable_v() =
      session_->Tensor(proj + 2 * HK * as, d_.act, {tokens, d_.HV, d_.K}, strides).value();
  *r->mutable_beta() = session_->Tensor(proj + (2 * HK + d_.VW) * as, d_.act, {tokens, d_.HV},
                                        {d_.proj_stride, 1})
                           .value();
  *r->mutable_g() = session_->Tensor(g_[l]->data(), d_.act, d_.GateShape(tokens)).value();
  *r->mutable_o() = session_->Tensor(o_[l]->data(), d_.act, {tokens, d_.HV, d_.K}).value();
}

}  // namespace simulator_internal
}  // namespace client
}  // namespace specstate

#endif  // SPECSTATE_CLIENT_SIMULATOR_DRIVER_H_
