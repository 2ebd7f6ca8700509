// Engine::ReadState: a summary (and optionally the values) of one block's
// recurrent and conv state in one layer, for debugging. A read changes no
// pool byte: the mode materializes the block into a copy
// (ModeEngine::MaterializeCopy) and the summary is of the copy. And
// Engine::CountPendingBlocks, DEFERRED's pending blocks for Recover.
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/device_status.h"
#include "server/engine/engine.h"
#include "server/engine/tensor_summary.h"

namespace specstate {
namespace server {

void Engine::ReadState(const v1::ReadStateRequest& request, Reply<v1::ReadStateResponse> reply) {
  if (request.layer() < 0 || request.layer() >= layout_.num_layers()) {
    reply(absl::OutOfRangeError(absl::StrCat("layer ", request.layer(),
                                             " is out of range: the layout has ",
                                             layout_.num_layers(), " layers")),
          {});
    return;
  }
  if (request.block() < 0 || request.block() >= layout_.num_blocks()) {
    reply(absl::OutOfRangeError(absl::StrCat("block ", request.block(),
                                             " is out of range: the pools have ",
                                             layout_.num_blocks(), " blocks")),
          {});
    return;
  }
  const LayerState& layer = layers_[request.layer()];
  // Host memory the device copies into (pinned on CUDA, so the copies stay
  // asynchronous), reused across calls: the status of the mode's checks,
  // then the recurrent and the conv state.
  const uint64_t status_bytes = sizeof(kernels::DeviceStatus);
  absl::StatusOr<char*> taken = read_buffers_->Take();
  if (!taken.ok()) {
    reply(taken.status(), {});
    return;
  }
  char* const buffer = *taken;
  auto* mirror = reinterpret_cast<kernels::DeviceStatus*>(buffer);
  std::memset(mirror, 0, sizeof(*mirror));
  char* const state = buffer + status_bytes;
  const int64_t state_bytes = sizes_.state_block_bytes;
  const int64_t conv_bytes = sizes_.conv_block_bytes;
  const int32_t block = request.block();
  Work work;
  // A read changes nothing (docs/semantics.md, "Reads"): what the mode keeps
  // unapplied for the block in this layer is applied to a copy (DEFERRED
  // replays its pending tokens there, FAST folds its ring there), and the
  // summary is of the copy: the block's current state, bit for bit what a
  // Flush would leave in the pool, which keeps its bytes. The null block 0
  // has nothing unapplied: it is read from the pool.
  const void* recurrent =
      static_cast<const char*>(layer.state.data) + int64_t{block} * state_bytes;
  if (block > 0) {
    work.launch = mode_->MaterializeCopy(request.layer(), block, mirror);
    recurrent = mode_->CopyBlock();
  } else {
    work.launch = [](kernels::Stream, Scratch&) { return absl::OkStatus(); };
  }
  work.readbacks.push_back(Readback{recurrent, state, uint64_t(state_bytes)});
  work.readbacks.push_back(Readback{
      static_cast<const char*>(layer.conv.data) + int64_t{block} * conv_bytes,
      state + state_bytes, uint64_t(conv_bytes)});
  const v1::Layout layout = layout_;
  const bool values = request.values();
  work.done = [this, buffer, mirror, state, state_bytes, conv_bytes, layout, values,
               reply](absl::Status launched) {
    v1::ReadStateResponse out;
    absl::Status result = launched;
    if (result.ok() && mirror->failed != 0) {
      result = kernels::DeviceStatusToStatus(*mirror, "ReadState");
    }
    if (result.ok()) {
      const int64_t k = layout.head_dim();
      SummarizeTensor(state, state_bytes, FromProto(layout.state_dtype()).value(), values,
                      {ValueHeadsOf(layout), k, k}, out.mutable_recurrent());
      SummarizeTensor(state + state_bytes, conv_bytes,
                      FromProto(layout.activation_dtype()).value(), values,
                      {layout.conv_dim(), layout.conv_width()}, out.mutable_conv());
    }
    read_buffers_->GiveBack(buffer);
    reply(result, std::move(out));
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    read_buffers_->GiveBack(buffer);
    reply(st, {});
  }
}

void Engine::CountPendingBlocks(Reply<int32_t> reply) {
  // What the mode keeps pending, read back after the work enqueued before
  // (ModeEngine::PendingCountReadbacks; nothing for the modes without).
  absl::StatusOr<char*> taken = pending_buffers_->Take();
  if (!taken.ok()) {
    reply(taken.status(), 0);
    return;
  }
  char* const buffer = *taken;
  const auto give_back = [this, buffer] { pending_buffers_->GiveBack(buffer); };
  Work work;
  work.launch = [](kernels::Stream, Scratch&) { return absl::OkStatus(); };
  work.readbacks = mode_->PendingCountReadbacks(buffer);
  work.done = [this, buffer, give_back, reply](absl::Status launched) {
    const int32_t count = launched.ok() ? mode_->CountPendingBlocks(buffer) : 0;
    give_back();
    reply(launched, count);
  };
  absl::Status st = device_->Submit(std::move(work));
  if (!st.ok()) {
    give_back();
    reply(st, 0);
  }
}

}  // namespace server
}  // namespace specstate
