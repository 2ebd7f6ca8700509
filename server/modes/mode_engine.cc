#include "server/modes/mode_engine.h"

#include "server/modes/rules.h"

namespace specstate {
namespace server {

absl::StatusOr<std::unique_ptr<ModeEngine>> ModeEngine::Create(const ModeEnvironment& env) {
  if ((env.kept.deferred.pending.entries != nullptr &&
       !CommitModeOf(*env.layout).RecordsInKeptAllocation()) ||
      (!env.kept.fast.rings.empty() &&
       (!CommitModeOf(*env.layout).KeepsRings() ||
        static_cast<int>(env.kept.fast.rings.size()) != env.layout->num_layers()))) {
    return absl::InternalError(
        "kept parts were given for a layout of another commit mode or shape (Recovery checks "
        "that first)");
  }
  switch (CommitModeOf(*env.layout).id()) {
    case v1::DEFERRED:
      return NewDeferredEngine(env);
    case v1::FAST:
      return NewFastEngine(env);
    default:
      return NewEagerEngine(env);
  }
}

absl::StatusOr<kernels::Records> ModeEngine::AllocateRecords(char* at) {
  const kernels::KdaShape& shape = env_.shape;
  const int Q = sizes().spec_query_len;
  const int64_t act_size = DTypeSize(shape.act_dtype);
  const int64_t tokens = int64_t{layout().max_rows()} * Q;
  kernels::Records records;
  absl::StatusOr<void*> rec = at != nullptr
                                  ? absl::StatusOr<void*>(at)
                                  : device().AllocateDevice(sizes().records_per_layer_bytes);
  if (!rec.ok()) return rec.status();
  char* r = static_cast<char*>(*rec);
  const auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  records.kv = r;
  records.g = r + align(tokens * kernels::RecordTokenWidth(shape) * act_size);
  records.beta =
      static_cast<char*>(records.g) + align(tokens * kernels::GateWidth(shape) * act_size);
  records.rows = layout().max_rows();
  records.q = Q;
  return records;
}

kernels::FlushArgs ModeEngine::FlushArgsFor(const LayerTables& tables, int layer, bool discard,
                                            kernels::DeviceStatus* status,
                                            kernels::DeviceStatus* mirror) const {
  kernels::FlushArgs args;
  args.shape = env_.shape;
  args.spec_query_len = sizes().spec_query_len;
  args.num_layers = layout().num_layers();
  args.layers = tables.host;
  args.device_layers = tables.device;
  args.layer = layer;
  args.discard = discard;
  args.prerequisites.input_fault = device().input_fault_word();
  args.status = status;
  args.status_mirror = mirror;
  return args;
}

Launch ModeEngine::FlushLaunchOf(kernels::FlushArgs args, std::shared_ptr<const IndexInput> blocks,
                                 int32_t* checked_blocks) const {
  return [this, args, blocks = std::move(blocks), checked_blocks](
             kernels::Stream stream, Scratch& scratch) mutable -> absl::Status {
    if (blocks != nullptr && blocks->present && blocks->rows > 0) {
      absl::StatusOr<const int32_t*> data = blocks->Pointer(scratch);
      if (!data.ok()) return data.status();
      args.blocks = *data;
      args.num_blocks_given = static_cast<int>(blocks->rows);
      args.checked_blocks = checked_blocks;
    }
    return device().kernels().Flush(args, stream);
  };
}

const void* ModeEngine::CopyBlock() const {
  return static_cast<const char*>(copy_.data) + sizes().state_block_bytes;
}

absl::Status ModeEngine::AllocateCopy(const LayerTables& tables) {
  copy_tables_ = tables;
  copy_.num_blocks = 2;
  copy_.block_stride = tables.host[0].state.block_stride;
  return AllocateDevice(uint64_t(ReadCopyBytes(env_.shape)), &copy_.data);
}

Launch ModeEngine::CopyLaunchOf(kernels::FlushArgs args, int32_t block,
                                int32_t* checked_blocks) const {
  args.copy = copy_;
  auto list = std::make_shared<IndexInput>();
  list->present = true;
  list->values = {block};
  list->rows = 1;
  return FlushLaunchOf(args, std::move(list), checked_blocks);
}

}  // namespace server
}  // namespace specstate
