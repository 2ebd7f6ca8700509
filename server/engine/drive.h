// The step protocol's templates (engine-private: included by the verbs'
// files only). A verb states what it does in a StepCall; Drive() runs the
// protocol around it, in one place, for Verify, Commit and RecordStateBlocks.
#ifndef SPECSTATE_SERVER_ENGINE_DRIVE_H_
#define SPECSTATE_SERVER_ENGINE_DRIVE_H_

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/device_status.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

template <typename Response>
void Engine::AnswerRetry(Step::Once& once, uint64_t fingerprint, bool async,
                         const std::string& first_call, Response cached,
                         absl::ReleasableMutexLock& lock, const Reply<Response>& reply) {
  if (once.fingerprint != fingerprint) {
    lock.Release();
    reply(absl::FailedPreconditionError(absl::StrCat(first_call, " with different arguments")), {});
    return;
  }
  cached.set_replayed_from_cache(true);
  cached.set_enqueued(async);
  if (once.finished || async) {
    const absl::Status s = once.finished ? once.status : absl::OkStatus();
    lock.Release();
    reply(s, cached);
    return;
  }
  once.waiters.push_back([reply, cached](absl::Status s) { reply(s, cached); });
}

// Whether a call's response can say it was answered from the cache (the
// calls that apply at most once per step).
template <typename Response, typename = void>
constexpr bool kAnswersRetries = false;
template <typename Response>
constexpr bool kAnswersRetries<
    Response, std::void_t<decltype(std::declval<Response&>().set_replayed_from_cache(true))>> =
    true;

// What a verb states; Drive() does the rest. `find_step`, `prepare` and
// `respond` run inside Drive, under the lock (they may capture the verb's
// locals by reference); `succeeded` runs later, when the work is done, also
// under the lock (it must capture by value).
template <typename Response>
struct Engine::StepCall {
  StepCall(const std::string& session, uint64_t step_id, Ordering ordering,
           std::vector<RegionPin> pins)
      : session(session), step_id(step_id), ordering(std::move(ordering)), pins(std::move(pins)) {}

  const std::string session;
  const uint64_t step_id;
  Ordering ordering;
  std::vector<RegionPin> pins;  // of the request's regions (the ordering's are added)
  // The slot's status the call's kernels write: a layer's (its Verify),
  // num_layers (Commit) or num_layers + 1 (RecordStateBlocks).
  int status_index = 0;
  int verifies_layer = -1;  // Verify: the layer it marks verified in the step
  // Commit / RecordStateBlocks apply at most once per step: a retry with
  // the same fingerprint is answered from the first call.
  Step::Once Step::*once = nullptr;
  uint64_t fingerprint = 0;
  std::string retry_first_call;  // "step 7 was already committed"

  // The call's step, checked for this verb. A Verify of a new step prepares
  // it in `fresh` (started only once every check passed).
  std::function<absl::StatusOr<Step*>(std::unique_ptr<Step>* fresh)> find_step;
  // The kernel arguments, checked on the host, as the work's launch and
  // readbacks. Changes nothing. `first`: the call starts the step.
  std::function<absl::StatusOr<Work>(const Step& step, const StepSlot& slot, bool first)> prepare;
  // What the response says of the step (also when answered from the cache).
  std::function<Response(const Step& step)> respond = [](const Step&) { return Response(); };
  // The work succeeded: counters. `first` and `num_rows` as of the call.
  std::function<void(const StepSlot& slot, bool first, int num_rows)> succeeded;
};

template <typename Response>
void Engine::Drive(StepCall<Response>& call, const Reply<Response>& reply,
                   PhaseProfile::Timer* timer) {
  const bool async = call.ordering.async;
  absl::ReleasableMutexLock lock(&mu_);
  if constexpr (kAnswersRetries<Response>) {
    Step* earlier = call.once == nullptr ? nullptr : steps_->Find(call.session, call.step_id);
    if (earlier != nullptr && (earlier->*call.once).started) {
      AnswerRetry(earlier->*call.once, call.fingerprint, async, call.retry_first_call,
                  call.respond(*earlier), lock, reply);
      return;
    }
  }
  drivers_.insert(call.session);
  absl::Status pending = steps_->TakeSessionError(call.session);
  std::unique_ptr<Step> fresh;
  absl::StatusOr<Step*> found = pending.ok() ? call.find_step(&fresh) : pending;
  const bool first = fresh != nullptr;
  absl::StatusOr<Work> work =
      found.ok() ? call.prepare(**found, steps_->slot((*found)->slot), first) : found.status();
  if (!work.ok()) {
    lock.Release();
    reply(work.status(), {});
    return;
  }

  // Every check passed: from here on the call changes state.
  const int slot_index = (*found)->slot;
  StepSlot& slot = steps_->slot(slot_index);
  const int num_rows = (*found)->num_rows;
  Response response = call.respond(**found);
  response.set_enqueued(async);
  work->waits = StepWaits(slot, **found, std::move(call.ordering.waits));
  work->signals = std::move(call.ordering.signals);
  std::vector<RegionPin> all_pins = std::move(call.pins);
  all_pins.insert(all_pins.end(), call.ordering.pins.begin(), call.ordering.pins.end());
  work->done = Completion(call, async ? Reply<Response>() : reply, response,
                          UniquePins(std::move(all_pins)), first, num_rows, slot_index);
  Work reset = first ? StatusReset(**found, async) : Work();
  Step* step = first ? StartStep(std::move(fresh)) : *found;
  if (call.verifies_layer >= 0) steps_->MarkVerified(*step, call.verifies_layer);
  if (call.once != nullptr) {
    (step->*call.once).started = true;
    (step->*call.once).fingerprint = call.fingerprint;
  }
  if (timer != nullptr) timer->Mark();
  absl::Status st = first ? SubmitInSlot(slot, std::move(reset)) : absl::OkStatus();
  if (st.ok()) st = SubmitInSlot(slot, *std::move(work));
  if (!st.ok()) {
    // An at-most-once call may be retried; a Verify's step cannot go on.
    if (call.once != nullptr) {
      (step->*call.once).started = false;
    } else {
      MarkFailed(call.step_id, call.session, st, false);
    }
    lock.Release();
    reply(st, {});
    return;
  }
  lock.Release();
  if (timer != nullptr) timer->Mark();
  if (async) {
    reply(absl::OkStatus(), std::move(response));
    if (timer != nullptr) timer->Mark();
  }
}

template <typename Response>
std::function<void(absl::Status)> Engine::Completion(
    StepCall<Response>& call, Reply<Response> reply, Response response,
    std::shared_ptr<std::vector<RegionPin>> pins, bool first, int num_rows, int slot_index) {
  return [this, pins = std::move(pins), reply = std::move(reply),
          response = std::move(response), async = call.ordering.async, first, num_rows,
          slot_index, session = call.session, step_id = call.step_id,
          status_index = call.status_index, once = call.once,
          succeeded = std::move(call.succeeded)](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    std::vector<std::function<void(absl::Status)>> waiters;
    {
      absl::MutexLock lock(&mu_);
      StepSlot& s = steps_->slot(slot_index);
      --s.in_flight;
      const kernels::DeviceStatus& status = s.status_host[status_index];
      if (result.ok() && status.failed != 0) {  // the message only then
        ++counters_.device_check_failures;
        const int L = layout_.num_layers();
        result = kernels::DeviceStatusToStatus(
            status, status_index < L    ? absl::StrCat("Verify of layer ", status_index)
                    : status_index == L ? std::string("Commit")
                                        : std::string("RecordStateBlocks"));
      }
      if (!result.ok()) {
        MarkFailed(step_id, session, result, async);
      } else if (succeeded) {
        succeeded(s, first, num_rows);
      }
      if (once != nullptr) {
        if (Step* st = steps_->Find(session, step_id)) {
          (st->*once).finished = true;
          (st->*once).status = result;
          waiters.swap((st->*once).waiters);
        }
      }
    }
    pins->clear();  // the regions may go now
    if (reply) reply(result, response);
    for (auto& w : waiters) w(result);
  };
}

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_ENGINE_DRIVE_H_
