#include "server/engine/step_table.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace specstate {
namespace server {
namespace {

// A re-run of a committed step: the same refusal within one instance and
// after a restart.
absl::Status AlreadyCommitted(uint64_t id) {
  return absl::FailedPreconditionError(
      absl::StrCat("step ", id, " is already committed: start a new step id"));
}

}  // namespace

StepTable::StepTable(int num_layers, std::vector<StepSlot> slots)
    : num_layers_(num_layers), slots_(std::move(slots)), records_(num_layers) {}

Step* StepTable::Find(const std::string& session, uint64_t id) {
  // Each Step is a heap object of its own (a cache miss apiece on a cold
  // core): the newest is nearly always the one.
  for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
    if ((*it)->id == id && (*it)->session == session) return it->get();
  }
  return nullptr;
}

absl::StatusOr<Step*> StepTable::FindOrPrepare(const std::string& session, uint64_t id,
                                               int num_rows, std::unique_ptr<Step>* fresh) {
  Step* step = Find(session, id);
  if (step != nullptr) {
    if (step != steps_.back().get()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", id, " has ended: step ", steps_.back()->id, " started after it"));
    }
    if (step->failed) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", id, " failed: ", step->failure.message()));
    }
    if (step->commit.started) return AlreadyCommitted(id);
    if (num_rows != step->num_rows) {
      return absl::InvalidArgumentError(absl::StrCat("num_rows = ", num_rows, " differs from the ",
                                                     step->num_rows, " rows of step ", id,
                                                     "'s first Verify"));
    }
    return step;
  }
  if (committed_before_restart_ == id) return AlreadyCommitted(id);
  const int slot = next_slot_;
  if (slots_[slot].in_flight > 0) {
    return absl::UnavailableError(absl::StrCat(
        kSlots, " steps are still in flight on the device; retry once one has finished"));
  }
  *fresh = std::make_unique<Step>();
  Step& f = **fresh;
  f.session = session;
  f.id = id;
  f.slot = slot;
  f.num_rows = num_rows;
  f.verified.assign(num_layers_, false);
  f.generation = next_generation_ + 1 == 0 ? 1 : next_generation_ + 1;  // 0: no cancellation word
  return fresh->get();
}

Step* StepTable::Start(std::unique_ptr<Step> fresh) {
  next_slot_ = (next_slot_ + 1) % kSlots;
  next_generation_ = fresh->generation;
  std::memset(slots_[fresh->slot].status_host, 0,
              (num_layers_ + 2) * sizeof(kernels::DeviceStatus));
  steps_.push_back(std::move(fresh));
  while (steps_.size() > kHistory) steps_.pop_front();
  return steps_.back().get();
}

void StepTable::MarkVerified(Step& step, int layer) {
  step.verified[layer] = true;
  ++step.verified_count;
  records_[layer] = RecordsOwner{step.session, step.id, true};
}

absl::StatusOr<Step*> StepTable::FindCommittable(const std::string& session, uint64_t id) {
  Step* step = Find(session, id);
  if (step == nullptr && committed_before_restart_ == id) return AlreadyCommitted(id);
  if (step == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", id, " was not verified (or ended long ago): Verify every layer before Commit"));
  }
  if (step->failed) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id, " failed: ", step->failure.message()));
  }
  std::vector<int> unverified, overwritten;
  for (int l = 0; l < num_layers_; ++l) {
    const RecordsOwner& owner = records_[l];
    if (!step->verified[l]) {
      unverified.push_back(l);
    } else if (!owner.valid || owner.step != id || owner.session != session) {
      overwritten.push_back(l);
    }
  }
  if (!unverified.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id, " cannot be committed: layers ",
                     absl::StrJoin(unverified, ", "), " were not verified in it"));
  }
  if (!overwritten.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", id, " cannot be committed: a later Verify overwrote the records of layers ",
        absl::StrJoin(overwritten, ", ")));
  }
  return step;
}

absl::StatusOr<Step*> StepTable::FindRecordable(const std::string& session, uint64_t id) {
  Step* step = Find(session, id);
  if (step == nullptr || !step->commit.started) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id, " was not committed: Commit before RecordStateBlocks"));
  }
  if (step->failed) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", id, " failed: ", step->failure.message()));
  }
  return step;
}

bool StepTable::MarkFailed(uint64_t id, const std::string& session, const absl::Status& status,
                           bool async) {
  bool newly = false;
  Step* step = Find(session, id);
  if (step != nullptr && !step->failed) {
    step->failed = true;
    step->failure = status;
    newly = true;
  }
  if (async && session_errors_.count(session) == 0) {
    session_errors_[session] = absl::Status(
        status.code(), absl::StrCat("an earlier asynchronous call failed (its step ", id,
                                    " is marked failed; nothing of it was committed): ",
                                    status.message()));
  }
  return newly;
}

void StepTable::KeepSessionError(const std::string& session, const absl::Status& status) {
  if (session_errors_.count(session) == 0) session_errors_[session] = status;
}

absl::Status StepTable::TakeSessionError(const std::string& session) {
  auto it = session_errors_.find(session);
  if (it == session_errors_.end()) return absl::OkStatus();
  absl::Status s = it->second;
  session_errors_.erase(it);
  return s;
}

void StepTable::OpenSession(const std::string& session) { open_sessions_.insert(session); }

std::shared_ptr<WaitCancellation> StepTable::EndSession(const std::string& session) {
  open_sessions_.erase(session);
  session_errors_.erase(session);
  std::shared_ptr<WaitCancellation> cancellation;
  auto it = session_waits_.find(session);
  if (it != session_waits_.end()) {
    cancellation = std::move(it->second);
    session_waits_.erase(it);
  }
  return cancellation;
}

absl::StatusOr<std::shared_ptr<WaitCancellation>> StepTable::WaitCancellationOf(
    const std::string& session) {
  // Refused once the session has ended: its end raised the cancellations
  // before, so nothing would ever release this wait.
  if (open_sessions_.count(session) == 0) {
    return absl::FailedPreconditionError(
        "the session has ended: nothing may wait on its doorbells any more");
  }
  std::shared_ptr<WaitCancellation>& c = session_waits_[session];
  if (c == nullptr) c = std::make_shared<WaitCancellation>();
  return c;
}

}  // namespace server
}  // namespace specstate
