// The step protocol's non-template parts: starting and failing steps,
// submitting into a step's slot, a call's prerequisites and waits, and
// resolving a call's ordering (its doorbells and events).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

void Engine::MarkFailed(uint64_t step_id, const std::string& session, absl::Status status,
                        bool async) {
  if (steps_->MarkFailed(step_id, session, status, async)) ++counters_.steps_failed;
}

Step* Engine::StartStep(std::unique_ptr<Step> fresh) {
  ++counters_.steps_verified;
  counters_.rows_verified += fresh->num_rows;
  // The latest step's rows: what the stock path would hold beyond them now.
  counters_.state_bytes_saved = uint64_t(fresh->num_rows) * (sizes_.spec_query_len - 1) *
                                sizes_.state_block_bytes * layout_.num_layers();
  return steps_->Start(std::move(fresh));
}

absl::Status Engine::SubmitInSlot(StepSlot& slot, Work work) {
  ++slot.in_flight;
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) --slot.in_flight;
  return st;
}

kernels::Prerequisites Engine::StepPrerequisites(const StepSlot& slot, const Step& step,
                                                int count) const {
  return kernels::Prerequisites{slot.status_device, count, slot.cancelled, step.generation,
                                device_->input_fault_word()};
}

std::vector<WaitOp> Engine::StepWaits(const StepSlot& slot, const Step& step,
                                      std::vector<WaitOp> waits) {
  for (WaitOp& w : waits) {
    w.cancel_word = slot.cancelled;
    w.cancel_value = step.generation;
  }
  return waits;
}

absl::StatusOr<SyncPoint> Engine::ResolveSyncPoint(const std::string& session,
                                                   const v1::Signal& sync,
                                                   absl::string_view field, Ordering& out) {
  SyncPoint op;
  if (sync.has_doorbell()) {
    const std::string name = absl::StrCat(field, ".doorbell");
    absl::StatusOr<Counter> counter = regions_.ResolveCounter(session, sync.doorbell(), name);
    if (!counter.ok()) return counter.status();
    op.kind = SyncPoint::Kind::kDoorbell;
    op.counter = counter->word;
    op.value = sync.doorbell().value();
    out.doorbells.emplace_back(name, counter->span);
    out.pins.push_back(counter->pin);
  } else if (sync.has_event()) {
    absl::StatusOr<void*> event = device_->OpenIpcEvent(sync.event().handle());
    if (!event.ok()) return Prefixed(absl::StrCat(field, ".event: "), event.status());
    op.kind = SyncPoint::Kind::kEvent;
    op.event = *event;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(field, ": set doorbell or event"));
  }
  return op;
}

absl::StatusOr<Engine::Ordering> Engine::ResolveOrdering(const std::string& session,
                                                         v1::Ordering ordering,
                                                         const v1::Signal& wait,
                                                         const v1::Signal& signal, bool has_wait,
                                                         bool has_signal) {
  Ordering out;
  out.async = ordering == v1::ASYNC;
  if (!out.async && (has_wait || has_signal)) {
    return absl::InvalidArgumentError("wait and signal need ordering ASYNC");
  }
  // One doorbell (a counter in a region of the session) or one event each.
  if (has_wait) {
    absl::StatusOr<SyncPoint> op = ResolveSyncPoint(session, wait, "wait", out);
    if (!op.ok()) return op.status();
    {
      // Raised when the session ends, so that nothing waits for it forever.
      absl::MutexLock lock(&mu_);
      absl::StatusOr<std::shared_ptr<WaitCancellation>> c = steps_->WaitCancellationOf(session);
      if (!c.ok()) return c.status();
      op->cancellation = *std::move(c);
    }
    out.waits.push_back(*op);
  }
  if (has_signal) {
    absl::StatusOr<SyncPoint> op = ResolveSyncPoint(session, signal, "signal", out);
    if (!op.ok()) return op.status();
    out.signals.push_back(*op);
  }
  return out;
}

Work Engine::StatusReset(const Step& step, bool async) {
  Work reset;
  const int L = layout_.num_layers();
  const StepSlot& slot = steps_->slot(step.slot);
  reset.launch = [this, status = slot.status_device, L](kernels::Stream stream, Scratch&) {
    return device_->ZeroOnStream(status, (L + 2) * sizeof(kernels::DeviceStatus), stream);
  };
  reset.done = [this, step_id = step.id, session = step.session, async,
                slot_index = step.slot](absl::Status launched) {
    absl::MutexLock lock(&mu_);
    --steps_->slot(slot_index).in_flight;
    if (!launched.ok()) MarkFailed(step_id, session, launched, async);
  };
  return reset;
}

}  // namespace server
}  // namespace specstate
