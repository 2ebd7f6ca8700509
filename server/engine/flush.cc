// Engine::Flush: what the mode keeps unapplied for some blocks (or all)
// applied now (ModeEngine::Flush), through DriveUnstepped (unstepped.cc).
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
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
  UnsteppedCall call;
  call.session = session;
  call.verb = "Flush";
  call.ordering = *std::move(ordering);
  call.pins = lookup.TakePins();
  call.make = [this, blocks = std::make_shared<const IndexInput>(*std::move(blocks)),
               layer = req.has_layer() ? req.layer() : -1,
               discard = req.discard()](kernels::DeviceStatus* mirror) {
    return mode_->Flush(blocks, layer, discard, mirror);
  };
  call.respond = [reply](absl::Status status, bool enqueued) {
    v1::FlushResponse response;
    response.set_enqueued(enqueued);
    reply(status, status.ok() ? response : v1::FlushResponse());
  };
  DriveUnstepped(std::move(call));
}

}  // namespace server
}  // namespace specstate
