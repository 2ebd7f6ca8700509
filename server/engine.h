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
#ifndef SPECSTATE_SERVER_ENGINE_H_
#define SPECSTATE_SERVER_ENGINE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/kda_args.h"
#include "specstate/v1/specstate.pb.h"
#include "server/config.h"
#include "server/device.h"
#include "server/regions.h"

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
};

class Engine {
 public:
  // Validates the layout, checks that it fits in the device's free memory
  // (RESOURCE_EXHAUSTED naming the bytes otherwise) and allocates everything.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const v1::ServiceConfig& config,
                                                        std::unique_ptr<Device> device);
  ~Engine();

  // The layout, with the backend and derived sizes filled in.
  const v1::Layout& layout() const { return layout_; }
  Device& device() { return *device_; }
  RegionRegistry& regions() { return regions_; }

  v1::ExportPoolsResponse ExportPools() const;

  void ReadState(const v1::ReadStateRequest& request, Reply<v1::ReadStateResponse> reply);

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
  // Verify of each of `request.verifies`, in order, then Commit; stops at the
  // first error. `request` must live until `reply` is called (the RPC's does).
  // At most MaxSubmitStepVerifies() Verify calls (INVALID_ARGUMENT beyond).
  void SubmitStep(const std::string& session, const v1::SubmitStepRequest& request,
                  Reply<v1::SubmitStepResponse> reply);

  // A session opened: it may register regions and wait on doorbells.
  void OpenSession(const std::string& session);
  // The session ended: its regions go (once their work is done), waits on
  // its doorbells are released, its pending errors are dropped; it may
  // register and wait no more.
  void EndSession(const std::string& session);

  EngineCounters counters() const;

  // Why the service should report NOT_SERVING now ("" when healthy): a
  // sticky device error, or the device's queue stuck on one piece of work
  // for longer than ServiceConfig.stuck_stream_ms.
  std::string HealthProblem() const;

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
    kernels::Records records;
    std::string records_session;  // the session and step whose Verify last wrote the records
    uint64_t records_step = 0;
    bool records_valid = false;
  };

  // Device memory of one step in flight (a ring of these).
  struct StepSlot {
    kernels::DeviceStatus* status_device = nullptr;  // [layers + 2]
    // Where the service reads them: pinned host memory the check kernels
    // write (the status mirror); status_device itself on the CPU backend.
    kernels::DeviceStatus* status_host = nullptr;
    kernels::DeviceStatus* StatusMirror(int index) const {
      return status_host == status_device ? nullptr : status_host + index;
    }
    // The cancellation word of the steps in this slot (kernels::Prerequisites).
    uint32_t* cancelled = nullptr;
    int32_t* query_start_loc = nullptr;  // [max_rows + 1], the step's snapshot
    int32_t* state_indices = nullptr;    // [max_rows]
    int32_t* qsl_host = nullptr;         // readback of the snapshot
    kernels::CommitPlanRow* plan_host = nullptr;  // readback of the commit plan
    int in_flight = 0;                   // submitted work not yet done
  };

  // What the service knows of one step.
  struct Step {
    std::string session;  // the driving session whose step it is
    uint64_t id = 0;
    int slot = 0;
    uint32_t generation = 0;  // unique, nonzero: its value of the slot's cancellation word
    int num_rows = 0;
    std::vector<bool> verified;
    int verified_count = 0;
    bool failed = false;
    absl::Status failure;
    // Commit / RecordStateBlocks: at most once, answered from here on retry.
    struct Once {
      bool started = false;
      bool finished = false;
      uint64_t fingerprint = 0;
      absl::Status status;
      std::vector<std::function<void(absl::Status)>> waiters;
    };
    Once commit;
    Once record;
  };

  Engine(const v1::ServiceConfig& config, std::unique_ptr<Device> device);
  absl::Status Allocate();

  // A call's prerequisites: the first `count` statuses of its step's slot and
  // the step's cancellation. Its waits, with the cancellation word they set
  // when they are cancelled.
  kernels::Prerequisites StepPrerequisites(const StepSlot& slot, const Step& step,
                                           int count) const;
  static std::vector<WaitOp> StepWaits(const StepSlot& slot, const Step& step,
                                       std::vector<WaitOp> waits);

  // The current step `id` of `session`, or, when it is new, a Step in
  // `fresh` (with a free slot) that is not started yet: nothing changes
  // until StartStep(), so a call that fails its checks starts no step.
  // Steps are the driving session's: a new driver starts its own numbering.
  absl::StatusOr<Step*> FindOrPrepareStep(const std::string& session, uint64_t id, int num_rows,
                                          std::unique_ptr<Step>* fresh)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Step* StartStep(std::unique_ptr<Step> fresh) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Step* FindStep(const std::string& session, uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first asynchronous error of the session, once (then cleared).
  absl::Status TakeSessionError(const std::string& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MarkFailed(uint64_t step, const std::string& session, absl::Status status, bool async)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Submits `work` of a step in `slot`, counted in the slot's in-flight work
  // (its `done` must uncount it); uncounted again if the submit fails.
  absl::Status SubmitInSlot(StepSlot& slot, Work work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DATA_LOSS naming the first of `pins` whose owner truncated it while the
  // call ran (server/truncation_guard.h); each such region is unregistered.
  absl::Status LostRegions(const std::vector<RegionPin>& pins) ABSL_LOCKS_EXCLUDED(mu_);

  // A retry of a call that applies at most once per step (same step, same
  // arguments): answered from the first call's result, at once or when it
  // finishes. Other arguments are FAILED_PRECONDITION ("<first_call> with
  // different arguments").
  template <typename Response>
  void AnswerRetry(Step::Once& once, uint64_t fingerprint, bool async,
                   const std::string& first_call, Response cached,
                   absl::ReleasableMutexLock& lock, const Reply<Response>& reply)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A Verify's tensors, from its request or from its layer's binding.
  struct VerifyInputs;
  struct BoundInputs;
  absl::StatusOr<VerifyInputs> RequestInputs(const std::string& session,
                                             const v1::VerifyRequest& request, int num_rows);
  absl::StatusOr<VerifyInputs> BoundInputsOf(const std::string& session,
                                             const v1::VerifyRequest& request, int num_rows);

  struct Ordering {
    std::vector<WaitOp> waits;
    std::vector<SignalOp> signals;
    std::vector<std::pair<std::string, ByteSpan>> doorbells;  // by field
    std::vector<RegionPin> pins;
    bool async = false;
  };
  absl::StatusOr<Ordering> ResolveOrdering(const std::string& session, v1::Ordering ordering,
                                           const v1::Signal& wait, const v1::Signal& signal,
                                           bool has_wait, bool has_signal);

  const v1::ServiceConfig config_;
  v1::Layout layout_;
  LayoutSizes sizes_;
  kernels::KdaShape shape_;
  std::unique_ptr<Device> device_;
  RegionRegistry regions_;

  char* pools_ = nullptr;
  std::vector<LayerState> layers_;
  kernels::CommitLayer* device_layer_table_ = nullptr;
  std::vector<kernels::CommitLayer> host_layer_table_;
  void* commit_workspace_ = nullptr;
  size_t commit_workspace_bytes_ = 0;
  void* record_workspace_ = nullptr;
  size_t record_workspace_bytes_ = 0;
  float* params_staging_ = nullptr;                  // LoadLayerParams: [H + H * K]
  kernels::DeviceStatus* params_status_ = nullptr;  // LoadLayerParams' device status

  static constexpr int kStepSlots = 8;
  static constexpr int kStepHistory = 64;

  mutable absl::Mutex mu_;
  std::vector<StepSlot> slots_ ABSL_GUARDED_BY(mu_);
  int next_slot_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t next_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Recent steps, oldest first; the last is the current one.
  std::deque<std::unique_ptr<Step>> steps_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> open_sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Status> session_errors_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<WaitCancellation>> session_waits_ ABSL_GUARDED_BY(mu_);
  EngineCounters counters_ ABSL_GUARDED_BY(mu_);
  std::vector<char*> read_buffers_ ABSL_GUARDED_BY(mu_);  // ReadState's host buffers
  std::vector<kernels::DeviceStatus*> param_mirrors_ ABSL_GUARDED_BY(mu_);  // LoadLayerParams'

  // Per layer, its binding (BindVerifyInputs), or null. Its own lock: a
  // Verify reads it before it takes mu_.
  mutable absl::Mutex bound_mu_;
  std::vector<std::shared_ptr<const BoundInputs>> bound_ ABSL_GUARDED_BY(bound_mu_);
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_H_
