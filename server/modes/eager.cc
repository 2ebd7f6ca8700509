// EAGER's engine side: one records buffer a layer; a Commit applies its
// tokens at once, so a Flush, a ReadState and the end of a session have
// nothing to apply (a read's copy is the pool's block). A Flush's block list is still checked, in stream order,
// as the other modes' kernels check theirs.
#include <cstring>
#include <vector>

#include "kernels/internal/checks.h"
#include "server/modes/mode_engine.h"

namespace specstate {
namespace server {
namespace {

// The copy of a Flush's block list, after its status mirror.
int32_t* ListCopyOf(kernels::DeviceStatus* mirror) {
  return reinterpret_cast<int32_t*>(mirror + 1);
}

// The check that the DEFERRED and FAST kernels run on a Flush's block list
// (kernels/internal/checks.h, CheckListedBlock: <= 0 is skipped, every other
// block below the pool's), on the list's copy after `mirror`; the lowest
// failing element's fault goes to `mirror`, as theirs goes to theirs.
void CheckListCopy(kernels::DeviceStatus* mirror, int64_t rows, int64_t num_blocks) {
  const int32_t* list = ListCopyOf(mirror);
  std::vector<int32_t> checked(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const kernels::internal::RowFault f = kernels::internal::CheckListedBlock(
        list, checked.data(), static_cast<int>(i), num_blocks);
    if (f.problem != 0) {
      *mirror = kernels::internal::StatusFromFault(f, static_cast<int32_t>(i), -1);
      return;
    }
  }
}

class EagerEngine final : public ModeEngine {
 public:
  explicit EagerEngine(const ModeEnvironment& env) : ModeEngine(env) {}

  absl::Status AllocateLayer(int, kernels::CommitLayer& entry) override {
    absl::StatusOr<kernels::Records> records = AllocateRecords();
    if (!records.ok()) return records.status();
    entry.records = *records;
    entry.records_alt = *records;  // one buffer: the second is the first
    return absl::OkStatus();
  }

  absl::Status AllocateShared(const LayerTables& tables) override {
    // Where a Flush's block list is copied to be checked; a read's copy.
    absl::Status st = AllocateDevice(uint64_t(layout().num_blocks()) * 4, &checked_blocks_);
    return st.ok() ? AllocateCopy(tables) : st;
  }

  void AddToVerify(int, kernels::VerifyArgs&) const override {}
  void AddToCommit(kernels::CommitArgs&) const override {}

  Launch Materialize(std::shared_ptr<const IndexInput>, int, bool,
                     kernels::DeviceStatus*) const override {
    return [](kernels::Stream, Scratch&) { return absl::OkStatus(); };
  }

  // Nothing unapplied: the pool's block is its current state, copied on the
  // stream. (The null block, and a block past the pool, which ReadState
  // refuses first, leave the copy as it was, as the other modes' checks do.)
  Launch MaterializeCopy(int layer, int32_t block, kernels::DeviceStatus*) const override {
    const kernels::StatePool pool = copy_tables().host[layer].state;
    return [this, pool, block](kernels::Stream stream, Scratch&) -> absl::Status {
      if (block <= 0 || block >= pool.num_blocks) return absl::OkStatus();
      const uint64_t bytes = uint64_t(sizes().state_block_bytes);
      return device().CopyOnStream(const_cast<void*>(CopyBlock()),
                                   static_cast<const char*>(pool.data) + block * bytes, bytes,
                                   stream);
    };
  }

  uint64_t FlushMirrorBytes() const override {
    static_assert(sizeof(kernels::DeviceStatus) % alignof(int32_t) == 0, "the list follows it");
    return sizeof(kernels::DeviceStatus) + uint64_t(layout().num_blocks()) * 4;
  }

  // Nothing pending; the block list is copied on the stream (a list in a
  // region may be written by the caller's stream before a wait), read back
  // and checked once the device got there. A list that fails is the call's
  // error (OUT_OF_RANGE naming the element and the bound); one that passes,
  // as under the other modes, changes nothing.
  FlushWork Flush(std::shared_ptr<const IndexInput> list, int, bool,
                  kernels::DeviceStatus* mirror) const override {
    if (list == nullptr || !list->present || list->rows == 0) {
      return FlushWork{Materialize(nullptr, -1, false, mirror), {}, nullptr};
    }
    const uint64_t bytes = uint64_t(list->rows) * sizeof(int32_t);
    FlushWork work;
    work.launch = [this, list, bytes](kernels::Stream stream, Scratch& scratch) -> absl::Status {
      absl::StatusOr<const int32_t*> data = list->Pointer(scratch);
      if (!data.ok()) return data.status();
      return device().CopyOnStream(checked_blocks_, *data, bytes, stream);
    };
    work.readbacks.push_back(Readback{checked_blocks_, ListCopyOf(mirror), bytes});
    work.check = [mirror, rows = list->rows, blocks = layout().num_blocks()] {
      CheckListCopy(mirror, rows, blocks);
    };
    return work;
  }

 private:
  int32_t* checked_blocks_ = nullptr;
};

}  // namespace

std::unique_ptr<ModeEngine> NewEagerEngine(const ModeEnvironment& env) {
  return std::make_unique<EagerEngine>(env);
}

}  // namespace server
}  // namespace specstate
