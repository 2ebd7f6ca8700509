// Pools that outlive specstated. At start, before the Engine allocates
// anything, Recovery takes back the pools an earlier instance left with a
// holder (a specstate-keeper process, or systemd's file-descriptor store),
// checks their bookkeeping (server/kept/pool_header.h) against the layout and
// attaches them to the Device, so the Engine's AllocateExported returns them
// as they are; or, when nothing is held, allocates fresh kept pools and hands
// them to the holders. Then it keeps the commit journal's address for the
// Engine, answers Recover (what was kept, what was lost, verify-pools), and
// watches the keeper: its death makes health NOT_SERVING (the pools would
// not survive a restart then) until it is back and holds them again.
//
//   RecoveryOptions options;
//   options.keeper = "/run/specstate/keeper.sock";
//   auto recovery = Recovery::Start(config.layout(), *device, options, start).value();
//   KeptModeParts kept = recovery->kept_parts();
//   auto engine = Engine::Create(config, std::move(device), &kept).value();
//   engine->SetCommitJournal(recovery->journal());
#ifndef SPECSTATE_SERVER_KEPT_RECOVERY_H_
#define SPECSTATE_SERVER_KEPT_RECOVERY_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "keeper/keeper_client.h"
#include "kernels/kda_args.h"
#include "server/device/device.h"
#include "server/device/host_buffer_pool.h"
#include "server/kept/fd_server.h"
#include "server/kept/pool_header.h"
#include "specstate/v1/specstate.pb.h"

namespace specstate {
namespace server {

namespace v1 = ::specstate::v1;

struct RecoveryOptions {
  // A specstate-keeper's socket ("": none). At start specstated waits up to
  // `keeper_wait` for it to answer.
  std::string keeper;
  absl::Duration keeper_wait = absl::Seconds(10);
  // systemd's file-descriptor store ($NOTIFY_SOCKET): the pools come back as
  // $LISTEN_FDS named specstate-pools.BYTES and specstate-header.BYTES, and
  // are stored with FDSTORE=1.
  bool fd_store = false;
  // Kept pools that cannot be used (another layout, a damaged header) are
  // dropped and fresh ones made, instead of refusing to start.
  bool discard_kept_pools = false;
  // CUDA kept pools: where clients fetch the allocation's descriptor
  // (ExportPoolsResponse.pools_fd_socket).
  std::string pools_fd_socket;
};

// MarkReprefilled's blocks against pools of `num_blocks` blocks, with or
// without kept bookkeeping: the distinct blocks, sorted.
// \returns INVALID_ARGUMENT when `blocks` is empty or has more than
//   num_blocks entries; OUT_OF_RANGE naming the first entry outside
//   [1, num_blocks) (block 0 is the null block: never written, never lost).
absl::StatusOr<std::vector<int32_t>> CheckReprefilledBlocks(
    const v1::MarkReprefilledRequest& request, int64_t num_blocks);

class Recovery {
 public:
  // \returns UNAVAILABLE when the keeper does not answer within
  //   keeper_wait; FAILED_PRECONDITION naming the holder's pid when another
  //   live process holds the keeper's pools (one service per kept
  //   allocation: the keeper hands them to the next one once that process's
  //   connection closes, as it does when it dies); FAILED_PRECONDITION /
  //   DATA_LOSS (CheckHeader) when the kept
  //   pools cannot be used and discard_kept_pools is off; the device's
  //   errors.
  static absl::StatusOr<std::unique_ptr<Recovery>> Start(const v1::Layout& layout, Device& device,
                                                         const RecoveryOptions& options,
                                                         absl::Time process_start);
  ~Recovery();

  // The commit journal in the kept bookkeeping (CommitArgs.journal, step unset).
  kernels::CommitJournal journal() const { return journal_; }

  // What the kept bookkeeping allocation holds for the mode, for
  // Engine::Create: DEFERRED's pending table (with its journal) and both
  // records buffers of every layer; FAST's rings and cursors of every layer
  // and its fold journal; empty for EAGER.
  KeptModeParts kept_parts() const;

  // What was kept at start (RecoverResponse without the verify fields).
  v1::RecoverResponse Report() const;

  // Recover: the report, with the last committed step, the commits and the
  // lost blocks read now from the bookkeeping (ordered after the work
  // enqueued before); with `verify`, the bookkeeping checked against
  // `layout` too.
  void Recover(const v1::RecoverRequest& request, const v1::Layout& layout,
               std::function<void(absl::Status, v1::RecoverResponse)> reply);

  // MarkReprefilled: `request.blocks` were written again by the scheduler;
  // their block records' lost flag is cleared in stream order (after the
  // work enqueued before), so neither Recover nor a later instance reports
  // them lost. Replies with the blocks still lost. Checks first
  // (CheckReprefilledBlocks); a refused call changes nothing.
  void MarkReprefilled(const v1::MarkReprefilledRequest& request,
                       std::function<void(absl::Status, v1::MarkReprefilledResponse)> reply);

  // Why health must say NOT_SERVING ("" when nothing is wrong): the keeper
  // is gone, so a restart would lose the pools.
  std::string HealthProblem() const;

  // ExportPools' pools_fd_socket and pools_fd_bytes, when clients fetch the
  // pools' descriptor there.
  void AddExport(v1::ExportPoolsResponse* out) const;

 private:
  Recovery(Device& device, const RecoveryOptions& options)
      : device_(device), options_(options) {}

  // The held descriptors: names ("specstate-pools.BYTES", ...) and fds.
  struct Kept {
    std::vector<std::string> names;
    std::vector<int> fds;
  };
  absl::StatusOr<Kept> TakeHeld();
  absl::Status Attach(Kept kept, const v1::Layout& layout);
  absl::Status Fresh(const v1::Layout& layout);
  void DropHeld(Kept* kept);
  absl::Status HandToHolders();
  std::string Meta() const;
  void Watch();

  Device& device_;
  const RecoveryOptions options_;
  uint64_t pool_bytes_ = 0;
  uint64_t header_bytes_ = 0;       // the whole allocation (DEFERRED: with the records)
  uint64_t bookkeeping_bytes_ = 0;  // what the host reads: everything but the records
  KeptDeferred deferred_;
  KeptFast fast_;
  int64_t num_blocks_ = 0;
  Device::KeptMemory pools_;
  Device::KeptMemory header_;
  kernels::CommitJournal journal_;
  v1::RecoverResponse report_;
  std::unique_ptr<FdServer> fd_server_;

  mutable absl::Mutex mu_;
  // Host memory Recover and MarkReprefilled read the bookkeeping into.
  std::unique_ptr<HostBufferPool> buffers_;
  std::unique_ptr<keeper::KeeperClient> keeper_ ABSL_GUARDED_BY(mu_);
  std::string problem_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread watcher_;
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_KEPT_RECOVERY_H_
