// FAST's engine side: no records (a step's window goes into the block's
// ring), each layer's rings (k, u, log-decay, cursors; with kept pools in
// the kept allocation, with the fold journal), and the Verify owner table.
// A Commit moves cursors and folds the rings that are due; a Flush and the
// end of the driving session fold (or empty) rings; a ReadState folds a
// block's ring into a copy.
#include <vector>

#include "server/base/test_crash.h"
#include "server/modes/mode_engine.h"

namespace specstate {
namespace server {
namespace {

class FastEngine final : public ModeEngine {
 public:
  explicit FastEngine(const ModeEnvironment& env) : ModeEngine(env) {}

  // The rings are kept: the engine allocates none of the token scratch.
  uint64_t BytesAlreadyKept() const override {
    return kept() ? uint64_t(sizes().record_bytes) : 0;
  }

  absl::Status AllocateLayer(int l, kernels::CommitLayer& entry) override {
    // Records of no buffers, whose rows and window still bound a step.
    entry.records.rows = layout().max_rows();
    entry.records.q = sizes().spec_query_len;
    entry.records_alt = entry.records;
    kernels::FastRings& rings = entry.fast;
    if (kept()) {  // as the last instance left them (AttachHeader checked the cursors)
      rings = env_.kept.fast.rings[l];
      return absl::OkStatus();
    }
    // The rings, zeroed (every ring empty).
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
    if (kept()) fold_journal_ = env_.kept.fast.journal;
    workspace_bytes_ = kernels::VerifyWorkspaceBytes(layout().num_blocks());
    absl::Status st = AllocateDevice(workspace_bytes_, reinterpret_cast<char**>(&workspace_));
    if (st.ok()) st = AllocateDevice(uint64_t(layout().num_blocks()) * 4, &checked_blocks_);
    if (st.ok()) st = AllocateDevice(sizeof(kernels::DeviceStatus), &flush_status_);
    if (st.ok()) st = AllocateCopy(tables);
    return st;
  }

  // A journal with a test hook installs the fold journal's too.
  void SetCommitJournal(const kernels::CommitJournal& journal) override {
    if (journal.test_hook != nullptr && kept()) fold_journal_.test_hook = &PendingTestHook;
  }

  // Recover's pending_blocks: every layer's cursors.
  uint64_t PendingCountBytes() const override {
    return uint64_t(layout().num_layers()) * sizes().fast_cursor_bytes;
  }
  std::vector<Readback> PendingCountReadbacks(void* host) const override {
    std::vector<Readback> out;
    for (int l = 0; l < layout().num_layers(); ++l) {
      out.push_back(Readback{tables_.host[l].fast.cursors,
                             static_cast<char*>(host) + uint64_t(l) * sizes().fast_cursor_bytes,
                             uint64_t(sizes().fast_cursor_bytes)});
    }
    return out;
  }
  // A block is pending when its ring holds accepted tokens in some layer.
  int32_t CountPendingBlocks(const void* host) const override {
    int32_t count = 0;
    for (int64_t b = 1; b < layout().num_blocks(); ++b) {
      for (int l = 0; l < layout().num_layers(); ++l) {
        const auto* cursors = reinterpret_cast<const kernels::FastCursor*>(
            static_cast<const char*>(host) + uint64_t(l) * sizes().fast_cursor_bytes);
        if (cursors[b].tokens != 0) {
          ++count;
          break;
        }
      }
    }
    return count;
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
    if (kept()) args.fold_journal = fold_journal_;
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
  bool kept() const { return !env_.kept.fast.rings.empty(); }

  LayerTables tables_;
  kernels::FoldJournal fold_journal_;  // kept pools: a Flush's in place
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
