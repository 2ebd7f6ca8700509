// FAST's engine side: no records (a step's window goes into the block's
// ring), each layer's rings (k, u, log-decay, cursors), and the Verify owner
// table. A Commit moves cursors and folds the rings that are due; a Flush
// and the end of the driving session fold (or empty) rings; a ReadState
// folds a block's ring into a copy.
#include "server/modes/mode_engine.h"

namespace specstate {
namespace server {
namespace {

class FastEngine final : public ModeEngine {
 public:
  explicit FastEngine(const ModeEnvironment& env) : ModeEngine(env) {}

  absl::Status AllocateLayer(int, kernels::CommitLayer& entry) override {
    // Records of no buffers, whose rows and window still bound a step.
    entry.records.rows = layout().max_rows();
    entry.records.q = sizes().spec_query_len;
    entry.records_alt = entry.records;
    // The rings, zeroed (every ring empty).
    kernels::FastRings& rings = entry.fast;
    absl::Status st = AllocateDevice(sizes().fast_ring_k_bytes, &rings.k);
    if (st.ok()) st = AllocateDevice(sizes().fast_ring_u_bytes, &rings.u);
    if (st.ok()) st = AllocateDevice(sizes().fast_ring_log_decay_bytes, &rings.log_decay);
    if (st.ok()) st = AllocateDevice(sizes().fast_cursor_bytes, &rings.cursors);
    rings.num_blocks = layout().num_blocks();
    rings.capacity = sizes().fast_ring_capacity;
    return st;
  }

  // The Verify owner table, a Flush's checked blocks and status.
  absl::Status AllocateShared(const LayerTables& tables) override {
    tables_ = tables;
    workspace_bytes_ = kernels::VerifyWorkspaceBytes(layout().num_blocks());
    absl::Status st = AllocateDevice(workspace_bytes_, reinterpret_cast<char**>(&workspace_));
    if (st.ok()) st = AllocateDevice(uint64_t(layout().num_blocks()) * 4, &checked_blocks_);
    if (st.ok()) st = AllocateDevice(sizeof(kernels::DeviceStatus), &flush_status_);
    if (st.ok()) st = AllocateCopy(tables);
    return st;
  }

  void AddToVerify(int layer, kernels::VerifyArgs& args) const override {
    args.mode = kernels::CommitMode::kFast;
    args.fast = tables_.host[layer].fast;
    args.workspace = workspace_;
    args.workspace_bytes = workspace_bytes_;
  }

  void AddToCommit(kernels::CommitArgs& args) const override {
    args.mode = kernels::CommitMode::kFast;  // the rings are in the layer table
  }

  Launch Materialize(std::shared_ptr<const IndexInput> blocks, int layer, bool discard,
                     kernels::DeviceStatus* mirror) const override {
    kernels::FlushArgs args = FlushArgsFor(tables_, layer, discard, flush_status_, mirror);
    args.mode = kernels::CommitMode::kFast;
    return FlushLaunchOf(args, std::move(blocks), checked_blocks_);
  }

  // The block's ring folded into the copy (Materialize's `out`), the ring,
  // its cursor and the pool left as they are.
  Launch MaterializeCopy(int layer, int32_t block, kernels::DeviceStatus* mirror) const override {
    kernels::FlushArgs args = FlushArgsFor(tables_, layer, false, flush_status_, mirror);
    args.mode = kernels::CommitMode::kFast;
    return CopyLaunchOf(args, block, checked_blocks_);
  }

 private:
  LayerTables tables_;
  void* workspace_ = nullptr;  // the Verify owner table
  size_t workspace_bytes_ = 0;
  int32_t* checked_blocks_ = nullptr;              // [num_blocks]: a Flush's list, checked
  kernels::DeviceStatus* flush_status_ = nullptr;  // every Flush's (stream-ordered)
};

}  // namespace

std::unique_ptr<ModeEngine> NewFastEngine(const ModeEnvironment& env) {
  return std::make_unique<FastEngine>(env);
}

}  // namespace server
}  // namespace specstate
