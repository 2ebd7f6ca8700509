// The service's core, independent of gRPC: it owns the pools, the records,
// the layer parameters and the step protocol, translates requests into
// kernel calls on its Device, and orders them with the caller's work.
//
// Every driving call answers through `reply`, exactly once: at once in
// ASYNC mode (after enqueueing) and for errors found on the host; after the
// device finished the work in SYNC mode.
//
//   auto engine = Engine::Create(config, std::move(device)).value();
//   engine->Verify(session_id, request, [](absl::Status s, v1::VerifyResponse r) { ... });
#ifndef SPECSTATE_SERVER_ENGINE_ENGINE_H_
#define SPECSTATE_SERVER_ENGINE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/kda_args.h"
#include "specstate/v1/specstate.pb.h"
#include "server/config/config.h"
#include "server/device/device.h"
#include "server/device/host_buffer_pool.h"
#include "server/modes/mode_engine.h"
#include "server/kept/pool_header.h"
#include "server/engine/phase_profile.h"
#include "server/engine/regions.h"
#include "server/engine/request_tensors.h"
#include "server/engine/step_table.h"
#include "server/tier/host_tier.h"
#include "server/transfer/ucx_transport.h"

namespace specstate {
namespace server {

template <typename Response>
using Reply = std::function<void(absl::Status, Response)>;

// Counters of the step protocol (a consistent copy).
struct EngineCounters {
  uint64_t steps_verified = 0;
  uint64_t steps_committed = 0;
  uint64_t steps_failed = 0;
  uint64_t rows_verified = 0;
  uint64_t rows_committed = 0;
  uint64_t tokens_verified = 0;
  uint64_t tokens_committed = 0;
  uint64_t state_bytes_saved = 0;
  // Calls answered with the error of a device-side check of their inputs
  // (kernels::DeviceStatus): Verify, Commit, RecordStateBlocks and
  // LoadLayerParams.
  uint64_t device_check_failures = 0;
};

class Engine {
 public:
  // Validates the layout, checks that it fits in the device's free memory
  // (RESOURCE_EXHAUSTED naming the bytes otherwise) and allocates everything.
  // `kept` (kept pools, Recovery::kept_parts()): DEFERRED's pending table
  // and records buffers, FAST's rings, cursors and fold journal live there,
  // as an earlier instance left them, instead of in fresh memory.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const v1::ServiceConfig& config,
                                                        std::unique_ptr<Device> device,
                                                        const KeptModeParts* kept = nullptr);
  ~Engine();

  // The layout, with the backend and derived sizes filled in.
  const v1::Layout& layout() const { return layout_; }
  Device& device() { return *device_; }
  RegionRegistry& regions() { return regions_; }

  v1::ExportPoolsResponse ExportPools() const;

  void ReadState(const v1::ReadStateRequest& request, Reply<v1::ReadStateResponse> reply);
  // commit_mode DEFERRED: how many blocks have tokens pending in some layer,
  // read from the pending table after the work enqueued before
  // (RecoverResponse.pending_blocks where no kept bookkeeping answers it);
  // 0 for the other modes.
  void CountPendingBlocks(Reply<int32_t> reply);

  absl::Status RegisterRegion(const v1::RegisterRegionRequest& request);

  // Driving calls; `session` has been checked to be the driver.
  void LoadLayerParams(const std::string& session, const v1::LoadLayerParamsRequest& request,
                       Reply<v1::LoadLayerParamsResponse> reply);
  void Verify(const std::string& session, const v1::VerifyRequest& request,
              Reply<v1::VerifyResponse> reply);
  // Checks and keeps a layer's Verify tensors for bound Verify calls of the
  // session (replacing the layer's binding).
  void BindVerifyInputs(const std::string& session, const v1::BindVerifyInputsRequest& request,
                        Reply<v1::BindVerifyInputsResponse> reply);
  void Commit(const std::string& session, const v1::CommitRequest& request,
              Reply<v1::CommitResponse> reply);
  void RecordStateBlocks(const std::string& session, const v1::RecordStateBlocksRequest& request,
                         Reply<v1::RecordStateBlocksResponse> reply);
  // DEFERRED: materializes (or forgets) pending tokens of blocks; FAST: folds
  // (or empties) their rings; under EAGER only orders its wait and signal.
  void Flush(const std::string& session, const v1::FlushRequest& request,
             Reply<v1::FlushResponse> reply);
  // The host tier (host_tier.cc): FAILED_PRECONDITION when the service has
  // none (ServiceConfig.host_tier_bytes 0).
  void SaveBlocks(const std::string& session, const v1::SaveBlocksRequest& request,
                  Reply<v1::SaveBlocksResponse> reply);
  void RestoreBlocks(const std::string& session, const v1::RestoreBlocksRequest& request,
                     Reply<v1::RestoreBlocksResponse> reply);
  // Any client's.
  v1::ListSavedResponse ListSaved() const;
  absl::StatusOr<v1::DropSavedResponse> DropSaved(const v1::DropSavedRequest& request);
  // Transfers between instances (transfer.cc), any client's: FetchSaved
  // (destination side; answers from a thread of its own once the blocks
  // are here), ExportSaved and ReleaseSaved (source side).
  void FetchSaved(const v1::FetchSavedRequest& request, Reply<v1::FetchSavedResponse> reply);
  absl::StatusOr<v1::ExportSavedResponse> ExportSaved(const v1::ExportSavedRequest& request);
  absl::Status ReleaseSaved(const v1::ReleaseSavedRequest& request);
  // Unset when the service has no host tier.
  std::optional<HostTier::Counters> HostTierCounters() const;
  // Verify of each of `request.verifies`, in order, then Commit; stops at the
  // first error. `request` must live until `reply` is called (the RPC's does).
  // At most MaxSubmitStepVerifies() Verify calls (INVALID_ARGUMENT beyond).
  void SubmitStep(const std::string& session, const v1::SubmitStepRequest& request,
                  Reply<v1::SubmitStepResponse> reply);

  // A session opened: it may register regions and wait on doorbells.
  void OpenSession(const std::string& session);
  // The session ended: its regions go (once their work is done), waits on
  // its doorbells are released, its pending errors are dropped; it may
  // register and wait no more. DEFERRED and FAST: when it drove steps, every
  // pending block (every non-empty ring) is materialized (the pools are then
  // current for whoever comes next).
  void EndSession(const std::string& session);

  EngineCounters counters() const;

  // Why the service should report NOT_SERVING now ("" when healthy): a
  // sticky device error, or the device's queue stuck on one piece of work
  // for longer than ServiceConfig.stuck_stream_ms.
  std::string HealthProblem() const;
  // What should be fixed though the service serves (Stats.warnings): on
  // CUDA, not running as an MPS client.
  std::vector<std::string> Warnings() const;

  // Pools that outlive the service (server/kept/recovery.h): every Commit keeps
  // its crash bookkeeping in `journal` (the step id set per call). Call
  // before serving.
  // DEFERRED: its pending journal is in the kept parts given to Create; a
  // journal with a test hook installs the pending table's too.
  void SetCommitJournal(const kernels::CommitJournal& journal);
  // Kept pools: `step` was the last step committed before this instance
  // started (Recover's last_committed_step, when a commit was). Its re-run
  // is refused in every session, as within one instance
  // (StepTable::SetCommittedBeforeRestart). Call before serving.
  void SetCommittedBeforeRestart(uint64_t step);

  // The most Verify calls one SubmitStep may carry: 4 per layer (a step
  // verifies each layer once; the rest is room for retries).
  int64_t MaxSubmitStepVerifies() const { return 4 * int64_t{layout_.num_layers()}; }

 private:
  struct LayerState {
    kernels::StatePool state;
    kernels::ConvPool conv;
    float* a_log = nullptr;    // device [H]
    float* dt_bias = nullptr;  // device [H * K]
    bool params_loaded = false;
    // Its records and rings: host_layer_table_'s entry (ModeEngine::AllocateLayer).
  };

  struct Ordering {
    std::vector<WaitOp> waits;
    std::vector<SignalOp> signals;
    std::vector<std::pair<std::string, ByteSpan>> doorbells;  // by field
    std::vector<RegionPin> pins;
    bool async = false;
  };

  // A driving call that belongs to no step (Flush, SaveBlocks,
  // RestoreBlocks), once its host checks passed: its work is what `make`
  // returns for a device-status mirror (the mode's checks write it), ordered
  // by `ordering`. `finished` runs when the device got there (also after a
  // failed submit), with the call's status; `respond` answers the RPC once:
  // a SYNC call with that status, an ASYNC one when enqueued (its failure
  // then becomes the session's next call's error). unstepped.cc.
  struct UnsteppedCall {
    std::string session;
    const char* verb = "";
    Ordering ordering;
    std::vector<RegionPin> pins;
    std::function<ModeEngine::FlushWork(kernels::DeviceStatus* mirror)> make;
    std::function<void(absl::Status)> finished;
    std::function<void(absl::Status, bool enqueued)> respond;
  };
  void DriveUnstepped(UnsteppedCall call);

  // One driving call of a step once its host checks passed: what its verb
  // states (drive.h); Drive() runs the step protocol around it.
  template <typename Response>
  struct StepCall;

  Engine(const v1::ServiceConfig& config, std::unique_ptr<Device> device);
  // `kept`: DEFERRED's parts in the kept allocation (may be null).
  absl::Status Allocate(const KeptModeParts* kept);
  absl::Status AllocateLayers();
  absl::StatusOr<std::vector<StepSlot>> AllocateSlots();

  // The step protocol of every Verify, Commit and RecordStateBlocks, in one
  // place: under the lock, a retry of an at-most-once call is answered from
  // the first; the session's pending asynchronous error is reported; the
  // verb finds (or prepares) and checks its step, then builds and checks
  // its work, and only then does anything change (the step starts, the call
  // is marked in it, its work is submitted). The reply comes at once in
  // ASYNC mode (and for every error), when the work is done in SYNC mode.
  template <typename Response>
  void Drive(StepCall<Response>& call, const Reply<Response>& reply,
             PhaseProfile::Timer* timer = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // The `done` of a call's work: the device's verdict on the call (lost
  // regions, the call's status), the step failed or the verb's counters,
  // an at-most-once call finished (its waiting retries answered), and
  // `reply` (empty for an ASYNC call, answered when enqueued).
  template <typename Response>
  std::function<void(absl::Status)> Completion(StepCall<Response>& call, Reply<Response> reply,
                                               Response response,
                                               std::shared_ptr<std::vector<RegionPin>> pins,
                                               bool first, int num_rows, int slot_index);
  // The work that zeroes a fresh step's statuses (later calls of the step
  // read them as prerequisites), ahead of the wait for the caller's inputs
  // so that it runs while the caller's GPU work does.
  Work StatusReset(const Step& step, bool async) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A call's prerequisites: the first `count` statuses of its step's slot and
  // the step's cancellation. Its waits, with the cancellation word they set
  // when they are cancelled.
  kernels::Prerequisites StepPrerequisites(const StepSlot& slot, const Step& step,
                                           int count) const;
  static std::vector<WaitOp> StepWaits(const StepSlot& slot, const Step& step,
                                       std::vector<WaitOp> waits);

  Step* StartStep(std::unique_ptr<Step> fresh) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkFailed(uint64_t step, const std::string& session, absl::Status status, bool async)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Submits `work` of a step in `slot`, counted in the slot's in-flight work
  // (its `done` must uncount it); uncounted again if the submit fails.
  absl::Status SubmitInSlot(StepSlot& slot, Work work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A retry of a call that applies at most once per step (same step, same
  // arguments): answered from the first call's result, at once or when it
  // finishes. Other arguments are FAILED_PRECONDITION ("<first_call> with
  // different arguments").
  template <typename Response>
  void AnswerRetry(Step::Once& once, uint64_t fingerprint, bool async,
                   const std::string& first_call, Response cached,
                   absl::ReleasableMutexLock& lock, const Reply<Response>& reply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Each verb's kernel arguments for its step, checked on the host (inline
  // index tensors get their device address only when the work is enqueued).
  absl::StatusOr<kernels::VerifyArgs> VerifyArgsFor(const VerifyInputs& inputs, int layer,
                                                    const Step& step, const StepSlot& slot,
                                                    bool first) const;
  absl::StatusOr<kernels::CommitArgs> CommitArgsFor(const CommitIndices& indices,
                                                    const Step& step, const StepSlot& slot) const;
  absl::StatusOr<kernels::RecordStateBlocksArgs> RecordArgsFor(
      const RecordIndices& indices, const v1::RecordStateBlocksRequest& request,
      const Step& step, const StepSlot& slot) const;

  // A Verify's tensors, from its request or from its layer's binding.
  absl::StatusOr<VerifyInputs> VerifyInputsOf(const std::string& session,
                                              const v1::VerifyRequest& request);
  // The checked parameters of a LoadLayerParams (`lookup` holds their regions).
  absl::StatusOr<std::shared_ptr<std::pair<FloatSource, FloatSource>>> LayerParamsOf(
      RegionLookup& lookup, const v1::LoadLayerParamsRequest& request);

  // The waits and signals of a call: `request`'s ordering, wait and signal.
  template <typename Request>
  absl::StatusOr<Ordering> ResolveOrdering(const std::string& session, const Request& request) {
    return ResolveOrdering(session, request.ordering(), request.wait(), request.signal(),
                           request.has_wait(), request.has_signal());
  }
  absl::StatusOr<Ordering> ResolveOrdering(const std::string& session, v1::Ordering ordering,
                                           const v1::Signal& wait, const v1::Signal& signal,
                                           bool has_wait, bool has_signal);
  absl::StatusOr<SyncPoint> ResolveSyncPoint(const std::string& session, const v1::Signal& sync,
                                             absl::string_view field, Ordering& out);

  const v1::ServiceConfig config_;
  v1::Layout layout_;
  LayoutSizes sizes_;
  kernels::KdaShape shape_;
  std::unique_ptr<Device> device_;
  RegionRegistry regions_;

  char* pools_ = nullptr;
  kernels::CommitJournal journal_;  // record null: no journal
  std::vector<LayerState> layers_;
  kernels::CommitLayer* device_layer_table_ = nullptr;
  std::vector<kernels::CommitLayer> host_layer_table_;
  void* commit_workspace_ = nullptr;
  size_t commit_workspace_bytes_ = 0;
  void* record_workspace_ = nullptr;
  size_t record_workspace_bytes_ = 0;
  // What the commit mode keeps and adds to each verb (server/modes/).
  std::unique_ptr<ModeEngine> mode_;
  // Saved blocks in host memory (null: no host tier).
  std::unique_ptr<HostTier> host_tier_;
  // Transfers: the UCX transport over the host tier (made at the first
  // transfer), and the exports other instances are reading (released by
  // ReleaseSaved, or after kExportLease).
  struct Export {
    HostTier::Ticket ticket;
    absl::Time expires;
  };
  // FAILED_PRECONDITION: this service has no host tier.
  static absl::Status NoHostTier();
  absl::StatusOr<UcxTransport*> Transport() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transfer_mu_);
  void ExpireExports() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transfer_mu_);
  absl::StatusOr<v1::FetchSavedResponse> FetchSavedNow(const v1::FetchSavedRequest& request);
  absl::Mutex transfer_mu_;
  std::unique_ptr<UcxTransport> transport_ ABSL_GUARDED_BY(transfer_mu_);
  std::map<uint64_t, Export> exports_ ABSL_GUARDED_BY(transfer_mu_);
  uint64_t next_export_ ABSL_GUARDED_BY(transfer_mu_) = 1;
  float* params_staging_ = nullptr;                  // LoadLayerParams: [H + H * K]
  kernels::DeviceStatus* params_status_ = nullptr;  // LoadLayerParams' device status

  mutable absl::Mutex mu_;
  // The steps, their slots, the sessions' errors and waits (set by Allocate).
  std::unique_ptr<StepTable> steps_ ABSL_PT_GUARDED_BY(mu_);
  EngineCounters counters_ ABSL_GUARDED_BY(mu_);
  // Host buffers ReadState and CountPendingBlocks read back into.
  std::unique_ptr<HostBufferPool> read_buffers_;
  std::unique_ptr<HostBufferPool> pending_buffers_;
  std::vector<kernels::DeviceStatus*> param_mirrors_ ABSL_GUARDED_BY(mu_);  // LoadLayerParams'
  // Status mirrors of the unstepped calls (Flush, SaveBlocks, RestoreBlocks).
  std::vector<kernels::DeviceStatus*> flush_mirrors_ ABSL_GUARDED_BY(mu_);
  // The sessions that drove steps (DEFERRED and FAST flush when one ends).
  std::set<std::string> drivers_ ABSL_GUARDED_BY(mu_);

  // Per layer, its binding (BindVerifyInputs), or null. Its own lock: a
  // Verify reads it before it takes mu_.
  mutable absl::Mutex bound_mu_;
  std::vector<std::shared_ptr<const BoundInputs>> bound_ ABSL_GUARDED_BY(bound_mu_);
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_ENGINE_H_
