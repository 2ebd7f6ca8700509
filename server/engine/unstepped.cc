// Engine::DriveUnstepped: the driving path of the calls that belong to no
// step (Flush, SaveBlocks, RestoreBlocks). Like Drive() (drive.h) it orders
// the call's work with the caller's by its waits and signals, pins the
// regions it reads and turns a device check's failure into the call's
// error; unlike a step call it has no slot or step statuses, so the mode's
// checks report into a host mirror of their own, and an ASYNC call's
// failure becomes the session's next call's error instead of a failed step.
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/device_status.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

void Engine::DriveUnstepped(UnsteppedCall call) {
  // A host mirror of this call's status, reused across calls.
  kernels::DeviceStatus* mirror = nullptr;
  {
    absl::MutexLock lock(&mu_);
    drivers_.insert(call.session);
    if (!flush_mirrors_.empty()) {
      mirror = flush_mirrors_.back();
      flush_mirrors_.pop_back();
    }
  }
  if (mirror == nullptr) {
    absl::StatusOr<void*> p = device_->AllocateHost(mode_->FlushMirrorBytes());
    if (!p.ok()) {
      if (call.finished) call.finished(p.status());
      call.respond(p.status(), false);
      return;
    }
    mirror = static_cast<kernels::DeviceStatus*>(*p);
  }
  std::memset(mirror, 0, sizeof(*mirror));
  const bool async = call.ordering.async;
  ModeEngine::FlushWork made = call.make(mirror);
  Work work;
  work.waits = std::move(call.ordering.waits);
  work.signals = std::move(call.ordering.signals);
  work.launch = std::move(made.launch);
  work.readbacks = std::move(made.readbacks);
  std::vector<RegionPin> pins = std::move(call.pins);
  pins.insert(pins.end(), call.ordering.pins.begin(), call.ordering.pins.end());
  auto respond = std::make_shared<std::function<void(absl::Status, bool)>>(std::move(call.respond));
  auto finished = std::make_shared<std::function<void(absl::Status)>>(std::move(call.finished));
  work.done = [this, pins = UniquePins(std::move(pins)), respond, finished, mirror, async,
               session = call.session, verb = std::string(call.verb),
               check = std::move(made.check)](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    pins->clear();  // the regions may go now
    if (result.ok() && check) check();
    const bool check_failed = result.ok() && mirror->failed != 0;
    if (check_failed) result = kernels::DeviceStatusToStatus(*mirror, verb);
    {
      absl::MutexLock lock(&mu_);
      if (check_failed) ++counters_.device_check_failures;
      flush_mirrors_.push_back(mirror);
      if (async && !result.ok()) {
        steps_->KeepSessionError(
            session, absl::Status(result.code(), absl::StrCat("an earlier asynchronous ", verb,
                                                              " failed: ", result.message())));
      }
    }
    if (*finished) (*finished)(result);
    if (!async) (*respond)(result, false);
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    {
      absl::MutexLock lock(&mu_);
      flush_mirrors_.push_back(mirror);
    }
    if (*finished) (*finished)(st);
    (*respond)(st, false);
    return;
  }
  if (async) (*respond)(absl::OkStatus(), true);
}

}  // namespace server
}  // namespace specstate
