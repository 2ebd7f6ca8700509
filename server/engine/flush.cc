// Engine::Flush: what the mode keeps unapplied for some blocks (or all)
// applied now (ModeEngine::Flush), ordered with the caller's work like a
// driving call; its errors are the call's, or the session's next call's when
// it was ASYNC.
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/device_status.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {

void Engine::Flush(const std::string& session, const v1::FlushRequest& req,
                   Reply<v1::FlushResponse> reply) {
  const int L = layout_.num_layers();
  if (req.has_layer() && (req.layer() < 0 || req.layer() >= L)) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", req.layer(),
                                             " is out of range: the layout has ", L, " layers")),
          {});
    return;
  }
  RegionLookup lookup(regions_, session);
  absl::StatusOr<IndexInput> blocks =
      ResolveIndex(lookup, req.blocks(), "blocks", IndexSpec{});
  if (blocks.ok() && blocks->rows > layout_.num_blocks()) {
    blocks = absl::OutOfRangeError(absl::StrCat("blocks has ", blocks->rows,
                                                " entries: at most the pool's ",
                                                layout_.num_blocks(), " blocks"));
  }
  absl::StatusOr<Ordering> ordering = blocks.ok() ? ResolveOrdering(session, req) : blocks.status();
  if (!ordering.ok()) {
    reply(ordering.status(), {});
    return;
  }
  // A host mirror of this call's status, reused across calls.
  kernels::DeviceStatus* mirror = nullptr;
  {
    absl::MutexLock lock(&mu_);
    drivers_.insert(session);
    if (!flush_mirrors_.empty()) {
      mirror = flush_mirrors_.back();
      flush_mirrors_.pop_back();
    }
  }
  if (mirror == nullptr) {
    absl::StatusOr<void*> p = device_->AllocateHost(mode_->FlushMirrorBytes());
    if (!p.ok()) {
      reply(p.status(), {});
      return;
    }
    mirror = static_cast<kernels::DeviceStatus*>(*p);
  }
  std::memset(mirror, 0, sizeof(*mirror));
  const bool async = ordering->async;
  Work work;
  work.waits = std::move(ordering->waits);
  work.signals = std::move(ordering->signals);
  ModeEngine::FlushWork flush =
      mode_->Flush(std::make_shared<const IndexInput>(*std::move(blocks)),
                   req.has_layer() ? req.layer() : -1, req.discard(), mirror);
  work.launch = std::move(flush.launch);
  work.readbacks = std::move(flush.readbacks);
  std::vector<RegionPin> pins = lookup.TakePins();
  pins.insert(pins.end(), ordering->pins.begin(), ordering->pins.end());
  work.done = [this, pins = UniquePins(std::move(pins)), reply, mirror, async, session,
               check = std::move(flush.check)](absl::Status launched) {
    absl::Status result = launched;
    if (absl::Status lost = regions_.DropTruncated(*pins); !lost.ok()) result = lost;
    pins->clear();  // the regions may go now
    if (result.ok() && check) check();
    const bool check_failed = result.ok() && mirror->failed != 0;
    if (check_failed) result = kernels::DeviceStatusToStatus(*mirror, "Flush");
    {
      absl::MutexLock lock(&mu_);
      if (check_failed) ++counters_.device_check_failures;
      flush_mirrors_.push_back(mirror);
      if (async && !result.ok()) {
        steps_->KeepSessionError(session, absl::Status(result.code(),
                                                       absl::StrCat("an earlier asynchronous "
                                                                    "Flush failed: ",
                                                                    result.message())));
      }
    }
    if (!async) reply(result, {});
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    {
      absl::MutexLock lock(&mu_);
      flush_mirrors_.push_back(mirror);
    }
    reply(st, {});
    return;
  }
  if (async) {
    v1::FlushResponse response;
    response.set_enqueued(true);
    reply(absl::OkStatus(), response);
  }
}

}  // namespace server
}  // namespace specstate
