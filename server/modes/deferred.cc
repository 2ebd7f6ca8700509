// DEFERRED's engine side: two records buffers a layer (a step's records live
// until its blocks' next Verify), the pending table (kept across a restart
// with the pools), each layer's replay plan, and the replay lists of Commit
// and Flush. A Commit plans; a block's next Verify (or a Flush, the end of
// the driving session) replays its pending tokens; a ReadState replays them
// into a copy.
#include <vector>

#include "server/modes/mode_engine.h"
#include "server/base/test_crash.h"

namespace specstate {
namespace server {
namespace {

class DeferredEngine final : public ModeEngine {
 public:
  explicit DeferredEngine(const ModeEnvironment& env) : ModeEngine(env) {}

  uint64_t BytesAlreadyKept() const override {
    return kept() ? uint64_t(sizes().record_bytes) : 0;
  }

  absl::Status AllocateLayer(int l, kernels::CommitLayer& entry) override {
    absl::StatusOr<kernels::Records> records =
        AllocateRecords(kept() ? env_.kept.deferred.records[2 * l] : nullptr);
    if (!records.ok()) return records.status();
    entry.records = *records;
    records = AllocateRecords(kept() ? env_.kept.deferred.records[2 * l + 1] : nullptr);
    if (!records.ok()) return records.status();
    entry.records_alt = *records;
    return absl::OkStatus();
  }

  // The pending table (zeroed: nothing pending; kept: as the last instance
  // left it, with its journal), each layer's replay plan, the replay lists
  // of Commit and Flush, a Flush's checked blocks and status.
  absl::Status AllocateShared(const LayerTables& tables) override {
    tables_ = tables;
    const int L = layout().num_layers();
    const int rows = layout().max_rows();
    const int64_t blocks = layout().num_blocks();
    absl::Status st;
    if (kept()) {
      pending_ = env_.kept.deferred.pending;
    } else {
      pending_.num_layers = L;
      pending_.num_blocks = blocks;
      pending_.capacity = rows;
      st = AllocateDevice(kernels::PendingEntriesBytes(L, blocks), &pending_.entries);
      if (st.ok()) st = AllocateDevice(kernels::PendingHeaderBytes(rows), &pending_.header);
    }
    if (st.ok()) st = AllocateDevice(uint64_t(L) * rows * 4, &replay_plans_);
    workspace_bytes_ = kernels::VerifyWorkspaceBytes(blocks);
    if (st.ok()) st = AllocateDevice(workspace_bytes_, reinterpret_cast<char**>(&workspace_));
    commit_jobs_.capacity = static_cast<int>(kernels::CommitJobsCapacity(rows, L));
    flush_jobs_.capacity = static_cast<int>(kernels::FlushJobsCapacity(rows, L));
    if (st.ok()) st = AllocateDevice(commit_jobs_.capacity * sizeof(kernels::ReplayJob), &commit_jobs_.jobs);
    if (st.ok()) st = AllocateDevice(sizeof(int32_t), &commit_jobs_.count);
    if (st.ok()) st = AllocateDevice(flush_jobs_.capacity * sizeof(kernels::ReplayJob), &flush_jobs_.jobs);
    if (st.ok()) st = AllocateDevice(sizeof(int32_t), &flush_jobs_.count);
    if (st.ok()) st = AllocateDevice(uint64_t(blocks) * 4, &checked_blocks_);
    if (st.ok()) st = AllocateDevice(sizeof(kernels::DeviceStatus), &flush_status_);
    if (st.ok()) st = AllocateCopy(tables);
    // The layer table of a replay into the copy: each layer's records and
    // parameters, the copy as its state pool.
    copy_layers_.assign(tables.host, tables.host + L);
    for (kernels::CommitLayer& entry : copy_layers_) entry.state = copy();
    const uint64_t table_bytes = uint64_t(L) * sizeof(kernels::CommitLayer);
    if (st.ok()) st = AllocateDevice(table_bytes, &device_copy_layers_);
    if (st.ok()) st = device().CopyToDevice(device_copy_layers_, copy_layers_.data(), table_bytes);
    return st;
  }

  // A journal with a test hook installs the pending table's too.
  void SetCommitJournal(const kernels::CommitJournal& journal) override {
    if (journal.test_hook != nullptr && pending_.journal != nullptr) {
      pending_.test_hook = &PendingTestHook;
    }
  }

  uint64_t PendingCountBytes() const override {
    return uint64_t(pending_.num_layers) * pending_.num_blocks * sizeof(int32_t);
  }
  std::vector<Readback> PendingCountReadbacks(void* host) const override {
    return {Readback{pending_.entries, host, PendingCountBytes()}};
  }
  // A block is pending when some layer's entry for it is not 0 (block 0,
  // the null block, never is).
  int32_t CountPendingBlocks(const void* host) const override {
    const auto* entries = static_cast<const int32_t*>(host);
    int32_t count = 0;
    for (int64_t b = 1; b < pending_.num_blocks; ++b) {
      for (int l = 0; l < pending_.num_layers; ++l) {
        if (entries[int64_t{l} * pending_.num_blocks + b] != 0) {
          ++count;
          break;
        }
      }
    }
    return count;
  }

  void AddToVerify(int layer, kernels::VerifyArgs& args) const override {
    args.mode = kernels::CommitMode::kDeferred;
    args.pending = pending_;
    args.layer = layer;
    args.records_alt = tables_.host[layer].records_alt;
    args.replay_plan = replay_plans_ + int64_t{layer} * layout().max_rows();
    args.workspace = workspace_;
    args.workspace_bytes = workspace_bytes_;
  }

  void AddToCommit(kernels::CommitArgs& args) const override {
    args.mode = kernels::CommitMode::kDeferred;
    args.pending = pending_;
    args.jobs = commit_jobs_;
  }

  Launch Materialize(std::shared_ptr<const IndexInput> blocks, int layer, bool discard,
                     kernels::DeviceStatus* mirror) const override {
    kernels::FlushArgs args = FlushArgsFor(tables_, layer, discard, flush_status_, mirror);
    args.mode = kernels::CommitMode::kDeferred;
    args.pending = pending_;
    args.jobs = flush_jobs_;
    return FlushLaunchOf(args, std::move(blocks), checked_blocks_);
  }

  // The block's pool bytes and its pending tokens replayed into the copy;
  // the pending table, its journal and the pool left as they are.
  Launch MaterializeCopy(int layer, int32_t block, kernels::DeviceStatus* mirror) const override {
    kernels::FlushArgs args = FlushArgsFor(tables_, layer, false, flush_status_, mirror);
    args.mode = kernels::CommitMode::kDeferred;
    args.pending = pending_;
    args.jobs = flush_jobs_;
    args.copy_layer = &copy_layers_[layer];
    args.device_copy_layer = device_copy_layers_ + layer;
    return CopyLaunchOf(args, block, checked_blocks_);
  }

 private:
  bool kept() const { return env_.kept.deferred.pending.entries != nullptr; }

  LayerTables tables_;
  kernels::PendingBlocks pending_;
  int32_t* replay_plans_ = nullptr;  // [layers, max_rows]
  void* workspace_ = nullptr;        // the Verify owner table
  size_t workspace_bytes_ = 0;
  kernels::ReplayJobs commit_jobs_, flush_jobs_;
  int32_t* checked_blocks_ = nullptr;        // [num_blocks]: a Flush's list, checked
  kernels::DeviceStatus* flush_status_ = nullptr;  // every Flush's (stream-ordered)
  // [layers]: each layer's entry with the read's copy as its state pool.
  std::vector<kernels::CommitLayer> copy_layers_;
  kernels::CommitLayer* device_copy_layers_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModeEngine>> NewDeferredEngine(const ModeEnvironment& env) {
  const DeferredParts& kept = env.kept.deferred;
  const v1::Layout& l = *env.layout;
  if (kept.pending.entries != nullptr &&
      (static_cast<int>(kept.records.size()) != 2 * l.num_layers() ||
       kept.pending.num_layers != l.num_layers() || kept.pending.num_blocks != l.num_blocks() ||
       kept.pending.capacity != l.max_rows())) {
    return absl::InternalError(
        "the kept DEFERRED parts were not made for this layout (Recovery checks that first)");
  }
  return std::unique_ptr<ModeEngine>(new DeferredEngine(env));
}

}  // namespace server
}  // namespace specstate
