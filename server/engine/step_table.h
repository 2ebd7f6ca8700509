// The step protocol's bookkeeping: which steps exist, which device slot each
// one uses, what each Verify, Commit and RecordStateBlocks did to it, which
// step last wrote each layer's records, and the sessions' pending errors and
// doorbell waits. Pure host state, no device calls: the engine calls it
// under its own lock (it is not thread-safe itself), and step_table_test
// runs it against host memory.
//
// A step is the driving session's: (session, id). Its first Verify prepares
// it (FindOrPrepare) and starts it once every check passed (Start), so a
// rejected call starts nothing. Steps are kept for kHistory steps; only the
// newest one may be verified or committed.
//
//   std::unique_ptr<Step> fresh;
//   absl::StatusOr<Step*> step = table.FindOrPrepare(session, id, num_rows, &fresh);
//   ...every check of the call...
//   if (fresh != nullptr) step = table.Start(std::move(fresh));
#ifndef SPECSTATE_SERVER_ENGINE_STEP_TABLE_H_
#define SPECSTATE_SERVER_ENGINE_STEP_TABLE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/device_status.h"
#include "kernels/kda_args.h"
#include "server/device/device.h"

namespace specstate {
namespace server {

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

class StepTable {
 public:
  static constexpr int kSlots = 8;
  static constexpr int kHistory = 64;

  // `slots`: kSlots slots with their memory, num_layers + 2 statuses each
  // (one per layer's Verify, Commit's, RecordStateBlocks').
  StepTable(int num_layers, std::vector<StepSlot> slots);

  StepSlot& slot(int index) { return slots_[index]; }

  // Newest first (nearly every call is of the current step); null if the
  // step is unknown or was forgotten.
  Step* Find(const std::string& session, uint64_t id);

  // The current step `id` of `session`, checked open for Verify (the newest,
  // not failed, not committed, `num_rows` as its first Verify's), or, when
  // it is new, a Step in `fresh` with a free slot that is not started yet.
  // UNAVAILABLE when every slot still has work in flight.
  absl::StatusOr<Step*> FindOrPrepare(const std::string& session, uint64_t id, int num_rows,
                                      std::unique_ptr<Step>* fresh);
  // Kept pools (server/kept/): step `id` was the last one committed before
  // this instance started (Recover's last_committed_step). A Verify or
  // Commit of that id, in any session of this instance, is refused as a
  // re-run of a committed step is within one instance (FAILED_PRECONDITION,
  // "step N is already committed: start a new step id"), before anything
  // starts.
  void SetCommittedBeforeRestart(uint64_t id) { committed_before_restart_ = id; }
  // Starts a prepared step: takes its slot, zeroes the slot's host statuses.
  Step* Start(std::unique_ptr<Step> fresh);

  // A Verify of `layer` in `step` is about to run: marks it verified and the
  // layer's records as the step's.
  void MarkVerified(Step& step, int layer);
  // The step `id`, ready to commit: known, not failed, every layer verified
  // in it, and no later Verify overwrote a layer's records.
  absl::StatusOr<Step*> FindCommittable(const std::string& session, uint64_t id);
  // The step `id`, committed (started) and not failed.
  absl::StatusOr<Step*> FindRecordable(const std::string& session, uint64_t id);

  // Marks the step failed (if known); returns whether it was not before. An
  // `async` failure is also kept for the session's next call
  // (TakeSessionError), once per session.
  bool MarkFailed(uint64_t id, const std::string& session, const absl::Status& status,
                  bool async);
  // Keeps an asynchronous failure outside a step (Flush) for the session's
  // next call, unless one is kept already.
  void KeepSessionError(const std::string& session, const absl::Status& status);
  // The session's first asynchronous error, once (then cleared).
  absl::Status TakeSessionError(const std::string& session);

  // Sessions: only an open one may wait on its doorbells; its end raises
  // the cancellation of every wait it started.
  void OpenSession(const std::string& session);
  // The cancellation to raise (null if the session never waited).
  std::shared_ptr<WaitCancellation> EndSession(const std::string& session);
  // FAILED_PRECONDITION once the session has ended.
  absl::StatusOr<std::shared_ptr<WaitCancellation>> WaitCancellationOf(
      const std::string& session);

 private:
  // Which step last wrote a layer's records (a later Verify overwrites them).
  struct RecordsOwner {
    std::string session;
    uint64_t step = 0;
    bool valid = false;
  };

  const int num_layers_;
  std::vector<StepSlot> slots_;
  int next_slot_ = 0;
  uint32_t next_generation_ = 0;
  std::deque<std::unique_ptr<Step>> steps_;  // oldest first; the last is the current one
  std::vector<RecordsOwner> records_;        // per layer
  std::set<std::string> open_sessions_;
  std::map<std::string, absl::Status> session_errors_;
  std::map<std::string, std::shared_ptr<WaitCancellation>> session_waits_;
  std::optional<uint64_t> committed_before_restart_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_STEP_TABLE_H_
