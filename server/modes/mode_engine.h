// The engine side of a commit mode: the device memory it keeps beside the
// pools (records, DEFERRED's pending table and replay lists, FAST's rings),
// what it adds to each verb's kernel arguments, and what a Flush, a
// ReadState (into a copy: a read changes nothing) or the end of a driving
// session runs. The engine holds one and
// makes no mode decision of its own; ModeEngine::Create is the one place
// that picks an implementation (eager.cc, deferred.cc, fast.cc).
#ifndef SPECSTATE_SERVER_MODES_MODE_ENGINE_H_
#define SPECSTATE_SERVER_MODES_MODE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kda_args.h"
#include "kernels/kda_kernels.h"
#include "server/config/config.h"
#include "server/device/device.h"
#include "server/kept/pool_header.h"
#include "server/engine/request_tensors.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

// What a mode allocates from and reads; outlives the ModeEngine.
struct ModeEnvironment {
  const v1::Layout* layout = nullptr;
  const LayoutSizes* sizes = nullptr;
  kernels::KdaShape shape;
  Device* device = nullptr;
  // Kept pools: what the kept allocation holds for the mode, as an earlier
  // instance left it (DEFERRED's pending table and records; FAST's rings,
  // cursors and fold journal; both empty: fresh memory).
  KeptModeParts kept;
};

// The layer table every layer-spanning kernel reads (set up by the engine).
struct LayerTables {
  const kernels::CommitLayer* host = nullptr;
  kernels::CommitLayer* device = nullptr;
};

using Launch = std::function<absl::Status(kernels::Stream, Scratch&)>;

class ModeEngine {
 public:
  // The layout's mode's engine side (nothing allocated yet). INTERNAL when
  // `env.kept` does not fit the layout (Recovery checks that first).
  static absl::StatusOr<std::unique_ptr<ModeEngine>> Create(const ModeEnvironment& env);
  virtual ~ModeEngine() = default;

  // Bytes of ComputeServiceBytes().engine that the kept allocation already
  // holds (not allocated again).
  virtual uint64_t BytesAlreadyKept() const { return 0; }
  // Layer `layer`'s token scratch, into its layer-table entry (records,
  // records_alt, fast).
  virtual absl::Status AllocateLayer(int layer, kernels::CommitLayer& entry) = 0;
  // The rest, once the layer table is on the device.
  virtual absl::Status AllocateShared(const LayerTables& tables) = 0;
  // Kept pools: every Commit journals to `journal` (set by the engine).
  virtual void SetCommitJournal(const kernels::CommitJournal& journal) {}

  // Recover's pending_blocks (blocks holding pending tokens in some layer):
  // the readbacks that copy what the mode keeps pending into `host`
  // (PendingCountBytes() long), and the count read from it once they are
  // done. DEFERRED: its pending table; FAST: its cursors (ring tokens);
  // EAGER keeps nothing pending: nothing, 0.
  virtual uint64_t PendingCountBytes() const { return 0; }
  virtual std::vector<Readback> PendingCountReadbacks(void* host) const { return {}; }
  virtual int32_t CountPendingBlocks(const void* host) const { return 0; }

  // What the mode adds to a Verify of `layer` and to a Commit.
  virtual void AddToVerify(int layer, kernels::VerifyArgs& args) const = 0;
  virtual void AddToCommit(kernels::CommitArgs& args) const = 0;

  // Applies (or, with `discard`, forgets) what the mode keeps unapplied for
  // `blocks` (null: every block that has some) in `layer` (-1: every layer),
  // its status mirrored to `mirror` (may be null): DEFERRED replays pending
  // tokens, FAST folds rings; EAGER has nothing to apply.
  virtual Launch Materialize(std::shared_ptr<const IndexInput> blocks, int layer, bool discard,
                             kernels::DeviceStatus* mirror) const = 0;

  // Materializes into a copy: the current state of `block` in `layer`, the
  // bytes a Flush would leave in its pool block (the same replay or fold, bit
  // for bit), written to CopyBlock(), and nothing else changed: no pool byte,
  // nothing the mode keeps (DEFERRED's pending entries and journal, FAST's
  // rings and cursors). Its status mirrored to `mirror` (may be null). The
  // block is checked as a Flush's list (in [0, num_blocks); the null block 0
  // leaves the copy as it was). ReadState reads from the copy; a host tier
  // would save blocks through it. Stream-ordered: the copy is good until the
  // next work on the device.
  virtual Launch MaterializeCopy(int layer, int32_t block, kernels::DeviceStatus* mirror) const = 0;
  // Where MaterializeCopy writes: device memory, one block of the state pool
  // (LayoutSizes::state_block_bytes).
  const void* CopyBlock() const;

  // A Flush call: its launch, readbacks into `mirror`'s host memory, and a
  // check on the host once the device got there (may be empty). The host
  // memory of `mirror` is FlushMirrorBytes() long.
  struct FlushWork {
    Launch launch;
    std::vector<Readback> readbacks;
    std::function<void()> check;
  };
  virtual uint64_t FlushMirrorBytes() const { return sizeof(kernels::DeviceStatus); }
  virtual FlushWork Flush(std::shared_ptr<const IndexInput> blocks, int layer, bool discard,
                          kernels::DeviceStatus* mirror) const {
    return FlushWork{Materialize(std::move(blocks), layer, discard, mirror), {}, nullptr};
  }

 protected:
  explicit ModeEngine(const ModeEnvironment& env) : env_(env) {}
  const v1::Layout& layout() const { return *env_.layout; }
  const LayoutSizes& sizes() const { return *env_.sizes; }
  Device& device() const { return *env_.device; }
  // One layer's records: kv, g, beta, each 256-byte aligned; at `at` (kept
  // memory) or allocated.
  absl::StatusOr<kernels::Records> AllocateRecords(char* at = nullptr);
  // A flush kernel's arguments for `layer` (-1: every layer), the mode's
  // own fields (pending, rings) left to the caller.
  kernels::FlushArgs FlushArgsFor(const LayerTables& tables, int layer, bool discard,
                                  kernels::DeviceStatus* status,
                                  kernels::DeviceStatus* mirror) const;
  // Its launch over `blocks` (null or empty: every block with something
  // unapplied), the list checked into `checked_blocks` [num_blocks].
  Launch FlushLaunchOf(kernels::FlushArgs args, std::shared_ptr<const IndexInput> blocks,
                       int32_t* checked_blocks) const;
  // The copy MaterializeCopy writes (a state pool of two blocks: block 1 the
  // copy, block 0 unused as a pool's), allocated by each mode's
  // AllocateShared, and the layer table it copies from.
  absl::Status AllocateCopy(const LayerTables& tables);
  // A Flush into the copy of `block` in `layer` (DEFERRED, FAST): `args`
  // from FlushArgsFor with the mode's fields, the copy set here.
  Launch CopyLaunchOf(kernels::FlushArgs args, int32_t block, int32_t* checked_blocks) const;
  const kernels::StatePool& copy() const { return copy_; }
  const LayerTables& copy_tables() const { return copy_tables_; }
  // `bytes` of zeroed device memory.
  template <typename T>
  absl::Status AllocateDevice(uint64_t bytes, T** out) {
    absl::StatusOr<void*> p = env_.device->AllocateDevice(bytes);
    if (!p.ok()) return p.status();
    *out = static_cast<T*>(*p);
    return absl::OkStatus();
  }

  const ModeEnvironment env_;

 private:
  kernels::StatePool copy_;
  LayerTables copy_tables_;
};

// Each mode's engine side (eager.cc, deferred.cc, fast.cc).
std::unique_ptr<ModeEngine> NewEagerEngine(const ModeEnvironment& env);
absl::StatusOr<std::unique_ptr<ModeEngine>> NewDeferredEngine(const ModeEnvironment& env);
std::unique_ptr<ModeEngine> NewFastEngine(const ModeEnvironment& env);

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_MODES_MODE_ENGINE_H_
