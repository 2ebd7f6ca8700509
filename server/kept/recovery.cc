#include "server/kept/recovery.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "keeper/fd_passing.h"
#include "server/config/config.h"
#include "server/base/log.h"
#include "server/modes/rules.h"
#include "server/kept/pool_header.h"
#include "server/kept/sd_notify.h"

namespace specstate {
namespace server {
namespace {

constexpr char kPoolsName[] = "specstate-pools";
constexpr char kHeaderName[] = "specstate-header";
constexpr char kMetaPrefix[] = "specstate-kept/1 ";

// "specstate-pools.1234" -> ("specstate-pools", 1234).
bool ParseName(const std::string& name, std::string* base, uint64_t* bytes) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return false;
  *base = name.substr(0, dot);
  return absl::SimpleAtoi(name.substr(dot + 1), bytes);
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> CheckReprefilledBlocks(
    const v1::MarkReprefilledRequest& request, int64_t num_blocks) {
  if (request.blocks().empty()) {
    return absl::InvalidArgumentError(
        "blocks is empty: name the blocks the scheduler re-prefilled (Recover's lost_blocks)");
  }
  if (request.blocks_size() > num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("blocks has ", request.blocks_size(),
                                                   " entries: at most num_blocks = ", num_blocks));
  }
  std::vector<int32_t> out;
  for (int i = 0; i < request.blocks_size(); ++i) {
    const int32_t b = request.blocks(i);
    if (b < 1 || b >= num_blocks) {
      return absl::OutOfRangeError(absl::StrCat("blocks[", i, "] = ", b,
                                                " is out of range [1, num_blocks = ", num_blocks,
                                                ") (block 0 is the null block)"));
    }
    out.push_back(b);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

absl::StatusOr<std::unique_ptr<Recovery>> Recovery::Start(const v1::Layout& layout,
                                                          Device& device,
                                                          const RecoveryOptions& options,
                                                          absl::Time process_start) {
  if (absl::Status keeps = CommitModeOf(layout).CheckKeepsPools(); !keeps.ok()) return keeps;
  std::unique_ptr<Recovery> r(new Recovery(device, options));
  const LayoutSizes sizes = ComputeLayoutSizes(layout);
  r->pool_bytes_ = static_cast<uint64_t>(sizes.pool_bytes);
  r->num_blocks_ = layout.num_blocks();
  // DEFERRED: its pending table and both records buffers are kept in the
  // bookkeeping allocation (never exported: no client maps the records).
  // FAST: its rings, cursors and fold journal, likewise.
  r->deferred_ = KeptDeferredFor(layout, static_cast<uint64_t>(sizes.records_per_layer_bytes));
  r->fast_ = KeptFastFor(layout);
  const HeaderLayout at = HeaderLayoutFor(layout.num_blocks(), r->deferred_, r->fast_);
  r->header_bytes_ = at.bytes;
  r->bookkeeping_bytes_ = at.bookkeeping_bytes;
  r->buffers_ = std::make_unique<HostBufferPool>(device, at.bookkeeping_bytes);
  if (!options.keeper.empty()) {
    const absl::Time deadline = absl::Now() + options.keeper_wait;
    absl::StatusOr<std::unique_ptr<keeper::KeeperClient>> k =
        keeper::KeeperClient::Connect(options.keeper);
    while (!k.ok() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(100));
      k = keeper::KeeperClient::Connect(options.keeper);
    }
    if (!k.ok()) {
      return absl::UnavailableError(absl::StrCat(k.status().message(), " within ",
                                                 absl::FormatDuration(options.keeper_wait),
                                                 ": start specstate-keeper --socket=",
                                                 options.keeper, " first"));
    }
    absl::MutexLock lock(&r->mu_);
    r->keeper_ = *std::move(k);
  }
  absl::StatusOr<Kept> held = r->TakeHeld();
  if (!held.ok()) return held.status();
  absl::Status st;
  if (!held->fds.empty()) {
    Kept copy = *held;
    st = r->Attach(*std::move(held), layout);
    if (!st.ok()) {
      if (!options.discard_kept_pools) return st;
      LogError(absl::StrCat("discarding the kept pools (--discard_kept_pools): ", st.message()));
      r->DropHeld(&copy);
      st = r->Fresh(layout);
    }
  } else {
    st = r->Fresh(layout);
  }
  if (!st.ok()) return st;
  st = r->HandToHolders();
  if (!st.ok()) return st;
  r->report_.set_pool_bytes(r->pool_bytes_);
  r->report_.set_kept_bytes(r->pool_bytes_ + r->header_bytes_);
  r->report_.set_attach_ms(absl::ToDoubleMilliseconds(absl::Now() - process_start));
  if (device.ExportFd() >= 0 && !options.pools_fd_socket.empty()) {
    absl::StatusOr<std::unique_ptr<FdServer>> served = FdServer::Start(
        options.pools_fd_socket, device.ExportFd(), absl::StrCat("pools ", device.ExportFdBytes()));
    if (!served.ok()) {
      return absl::Status(served.status().code(),
                          absl::StrCat("serving the pools' descriptor on ", options.pools_fd_socket,
                                       ": ", served.status().message()));
    }
    r->fd_server_ = *std::move(served);
  }
  if (!options.keeper.empty()) r->watcher_ = std::thread([p = r.get()] { p->Watch(); });
  return r;
}

Recovery::~Recovery() {
  stop_.Notify();
  if (watcher_.joinable()) watcher_.join();
}

absl::StatusOr<Recovery::Kept> Recovery::TakeHeld() {
  Kept kept;
  {
    absl::MutexLock lock(&mu_);
    if (keeper_ != nullptr) {
      absl::StatusOr<keeper::Held> held = keeper_->Get();
      if (!held.ok()) return held.status();
      if (!held->fds.empty()) {
        if (!absl::StartsWith(held->meta, kMetaPrefix)) {
          keeper::CloseAll(&held->fds);
          return absl::DataLossError(absl::StrCat(
              "the keeper on ", options_.keeper, " holds descriptors that are not specstated's (",
              held->meta.substr(0, 64), ")"));
        }
        kept.names = absl::StrSplit(held->meta.substr(sizeof(kMetaPrefix) - 1), ' ',
                                    absl::SkipEmpty());
        kept.fds = std::move(held->fds);
        LogInfo(absl::StrCat("the keeper on ", options_.keeper, " holds ", held->meta));
        return kept;
      }
    }
  }
  if (options_.fd_store) {
    for (const auto& [name, fd] : SdListenFds()) {
      std::string base;
      uint64_t bytes = 0;
      if (ParseName(name, &base, &bytes) && (base == kPoolsName || base == kHeaderName)) {
        kept.names.push_back(name);
        kept.fds.push_back(fd);
      } else {
        LogError(absl::StrCat("systemd passed a descriptor named \"", name, "\": not ours, closed"));
        close(fd);
      }
    }
    if (!kept.fds.empty()) {
      LogInfo(absl::StrCat("systemd's file-descriptor store holds ", absl::StrJoin(kept.names, " ")));
    }
  }
  return kept;
}

absl::Status Recovery::Attach(Kept kept, const v1::Layout& layout) {
  int pools_fd = -1, header_fd = -1;
  uint64_t pools_bytes = 0, header_bytes = 0;
  for (size_t i = 0; i < kept.fds.size(); ++i) {
    std::string base;
    uint64_t bytes = 0;
    if (i < kept.names.size() && ParseName(kept.names[i], &base, &bytes)) {
      if (base == kPoolsName && pools_fd < 0) {
        pools_fd = kept.fds[i];
        pools_bytes = bytes;
        continue;
      }
      if (base == kHeaderName && header_fd < 0) {
        header_fd = kept.fds[i];
        header_bytes = bytes;
        continue;
      }
    }
    close(kept.fds[i]);
  }
  if (pools_fd < 0 || header_fd < 0) {
    if (pools_fd >= 0) close(pools_fd);
    if (header_fd >= 0) close(header_fd);
    return absl::DataLossError(absl::StrCat(
        "the kept descriptors (", absl::StrJoin(kept.names, " "),
        ") are not the pools and their header: specstated kept both"));
  }
  absl::StatusOr<Device::KeptMemory> header =
      device_.AttachKept(header_fd, std::max<uint64_t>(header_bytes, sizeof(KeptHeader)), false);
  if (!header.ok()) {
    close(pools_fd);
    return absl::Status(header.status().code(),
                        absl::StrCat("the kept pools' header: ", header.status().message()));
  }
  // The header's own fields say how much bookkeeping precedes its records
  // (DEFERRED): read that much, not the records.
  std::vector<char> bytes(std::min<uint64_t>(header->bytes, sizeof(KeptHeader)));
  absl::Status st = device_.CopyFromDevice(bytes.data(), header->data, bytes.size());
  const HeaderLayout at = HeaderLayoutOf(bytes);
  if (st.ok()) {
    bytes.resize(std::min<uint64_t>(header->bytes, at.bookkeeping_bytes));
    st = device_.CopyFromDevice(bytes.data(), header->data, bytes.size());
  }
  const v1::Backend backend =
      device_.kind() == kernels::Backend::kCuda ? v1::CUDA : v1::CPU;
  if (st.ok()) {
    st = CheckHeader(bytes, layout, backend, device_.ordinal(), pool_bytes_, deferred_, fast_);
  }
  if (st.ok() && header->bytes < header_bytes_) {
    st = absl::DataLossError(absl::StrCat("the kept pools' header allocation has ", header->bytes,
                                          " bytes, its layout needs ", header_bytes_));
  }
  if (!st.ok()) {
    close(pools_fd);
    return st;
  }
  absl::StatusOr<Device::KeptMemory> pools = device_.AttachKept(pools_fd, pool_bytes_, true);
  if (!pools.ok()) {
    return absl::Status(pools.status().code(),
                        absl::StrCat("the kept pools: ", pools.status().message()));
  }
  report_ = AttachHeader(&bytes, absl::Now(), getpid());
  st = device_.CopyToDevice(header->data, bytes.data(), bytes.size());
  if (!st.ok()) return st;
  pools_ = *pools;
  header_ = *header;
  journal_ = JournalAt(header_.data, num_blocks_);
  LogInfo(absl::StrCat(
      "took over the kept pools (", pool_bytes_, " bytes; restart ", report_.restarts(),
      "): last committed step ", report_.last_committed_step(), " (", report_.commits(),
      " commits)",
      report_.interrupted()
          ? absl::StrCat("; the commit of step ", report_.interrupted_step(), " was interrupted")
          : std::string(),
      report_.lost_blocks_size() > 0
          ? absl::StrCat("; ", report_.lost_blocks_size(), " blocks lost: ",
                         absl::StrJoin(report_.lost_blocks(), ","))
          : std::string(),
      report_.interrupted_call().empty()
          ? std::string()
          : absl::StrCat("; a ", report_.interrupted_call(), " was interrupted"),
      deferred_.present != 0 || fast_.present != 0
          ? absl::StrCat("; ", report_.pending_blocks(), " blocks pending")
          : std::string()));
  return absl::OkStatus();
}

absl::Status Recovery::Fresh(const v1::Layout& layout) {
  absl::StatusOr<Device::KeptMemory> pools = device_.AllocateKept(pool_bytes_, true);
  if (!pools.ok()) return pools.status();
  absl::StatusOr<Device::KeptMemory> header = device_.AllocateKept(header_bytes_, false);
  if (!header.ok()) return header.status();
  const v1::Backend backend =
      device_.kind() == kernels::Backend::kCuda ? v1::CUDA : v1::CPU;
  const std::vector<char> bytes =
      FreshHeader(layout, backend, device_.ordinal(), pool_bytes_, absl::Now(), deferred_, fast_);
  absl::Status st = device_.CopyToDevice(header->data, bytes.data(), bytes.size());
  if (!st.ok()) return st;
  pools_ = *pools;
  header_ = *header;
  journal_ = JournalAt(header_.data, num_blocks_);
  report_ = v1::RecoverResponse();
  report_.set_kept(false);
  report_.set_started_unix_s(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  report_.set_layout_fingerprint(absl::StrFormat("%016x", LayoutFingerprint(layout)));
  LogInfo(absl::StrCat("fresh kept pools: ", pool_bytes_, " bytes"));
  return absl::OkStatus();
}

void Recovery::DropHeld(Kept* kept) {
  {
    absl::MutexLock lock(&mu_);
    if (keeper_ != nullptr) {
      absl::Status st = keeper_->Drop();
      if (!st.ok()) LogError(absl::StrCat("dropping the kept pools: ", st.message()));
    }
  }
  if (options_.fd_store) {
    for (const std::string& name : kept->names) {
      SdNotify(absl::StrCat("FDSTOREREMOVE=1\nFDNAME=", name)).IgnoreError();
    }
  }
}

std::string Recovery::Meta() const {
  return absl::StrCat(kMetaPrefix, kPoolsName, ".", pool_bytes_, " ", kHeaderName, ".",
                      header_bytes_);
}

absl::Status Recovery::HandToHolders() {
  std::vector<std::string> holders;
  {
    absl::MutexLock lock(&mu_);
    if (keeper_ != nullptr) {
      absl::Status st = keeper_->Put(Meta(), {pools_.fd, header_.fd});
      if (!st.ok()) return st;
      holders.push_back(absl::StrCat("keeper ", options_.keeper));
    }
  }
  if (options_.fd_store) {
    absl::Status st = SdNotify(
        absl::StrCat("FDSTORE=1\nFDNAME=", kPoolsName, ".", pool_bytes_, "\nFDPOLL=0"), {pools_.fd});
    if (st.ok()) {
      st = SdNotify(absl::StrCat("FDSTORE=1\nFDNAME=", kHeaderName, ".", header_bytes_,
                                 "\nFDPOLL=0"),
                    {header_.fd});
    }
    if (!st.ok()) return st;
    holders.push_back("systemd");
  }
  report_.set_holder(absl::StrJoin(holders, ", "));
  return absl::OkStatus();
}

void Recovery::Watch() {
  const std::string path = options_.keeper;
  while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
    absl::MutexLock lock(&mu_);
    if (keeper_ != nullptr && keeper_->HungUp()) {
      keeper_.reset();
      problem_ = absl::StrCat("the keeper on ", path,
                              " is gone (its connection hung up): the pools would not survive a "
                              "restart of specstated now; restart specstate-keeper --socket=",
                              path, " (specstated hands it the pools again)");
      LogError(absl::StrCat("health: ", problem_));
    }
    if (keeper_ == nullptr) {
      absl::StatusOr<std::unique_ptr<keeper::KeeperClient>> k =
          keeper::KeeperClient::Connect(path);
      if (!k.ok()) continue;
      absl::StatusOr<keeper::Held> held = (*k)->Get();
      if (held.ok()) keeper::CloseAll(&held->fds);  // it cannot hold ours: it is new
      absl::Status put = held.ok() ? (*k)->Put(Meta(), {pools_.fd, header_.fd}) : held.status();
      if (!put.ok()) {
        LogError(absl::StrCat("the keeper on ", path, " is back but took nothing: ", put.message()));
        continue;
      }
      keeper_ = *std::move(k);
      problem_.clear();
      LogInfo(absl::StrCat("the keeper on ", path, " is back and holds the pools again"));
    }
  }
}

KeptModeParts Recovery::kept_parts() const {
  KeptModeParts parts;
  parts.deferred = DeferredPartsAt(header_.data, num_blocks_, deferred_);
  parts.fast = FastPartsAt(header_.data, num_blocks_, fast_);
  return parts;
}

std::string Recovery::HealthProblem() const {
  absl::MutexLock lock(&mu_);
  return problem_;
}

v1::RecoverResponse Recovery::Report() const { return report_; }

void Recovery::AddExport(v1::ExportPoolsResponse* out) const {
  if (fd_server_ == nullptr) return;
  out->set_pools_fd_socket(fd_server_->path());
  out->set_pools_fd_bytes(device_.ExportFdBytes());
}

void Recovery::Recover(const v1::RecoverRequest& request, const v1::Layout& layout,
                       std::function<void(absl::Status, v1::RecoverResponse)> reply) {
  // The bookkeeping as the work enqueued before this call leaves it: the
  // last committed step and the lost blocks now (the journal's and the
  // block records'), with `verify` everything checked.
  absl::StatusOr<char*> taken = buffers_->Take();
  if (!taken.ok()) {
    reply(taken.status(), {});
    return;
  }
  char* const buffer = *taken;
  Work work;
  work.launch = [](kernels::Stream, Scratch&) { return absl::OkStatus(); };
  work.readbacks.push_back(Readback{header_.data, buffer, bookkeeping_bytes_});
  const bool verify = request.verify();
  work.done = [this, buffer, layout, verify, reply](absl::Status launched) {
    v1::RecoverResponse out = Report();
    if (launched.ok()) {
      const std::vector<char> bytes(buffer, buffer + bookkeeping_bytes_);
      ReadLiveHeader(bytes, &out);
      if (verify) VerifyHeader(bytes, layout, &out);
    }
    buffers_->GiveBack(buffer);
    reply(launched, std::move(out));
  };
  absl::Status st = device_.Submit(std::move(work));
  if (!st.ok()) {
    buffers_->GiveBack(buffer);
    reply(st, {});
  }
}

void Recovery::MarkReprefilled(
    const v1::MarkReprefilledRequest& request,
    std::function<void(absl::Status, v1::MarkReprefilledResponse)> reply) {
  absl::StatusOr<std::vector<int32_t>> blocks = CheckReprefilledBlocks(request, num_blocks_);
  if (!blocks.ok()) {
    reply(blocks.status(), {});
    return;
  }
  absl::StatusOr<char*> taken = buffers_->Take();
  if (!taken.ok()) {
    reply(taken.status(), {});
    return;
  }
  char* const buffer = *taken;
  const auto give_back = [this, buffer] { buffers_->GiveBack(buffer); };
  // The lost flags are cleared on the device's queue: the block records are
  // written in stream order (a Commit clears the flag of every block it
  // writes; a RestoreBlocks sets its blocks' flags before its writes and
  // clears them after).
  Work work;
  kernels::BlockRecord* records = journal_.blocks;
  work.launch = [this, records, list = *blocks](kernels::Stream stream, Scratch&) {
    for (int32_t b : list) {
      absl::Status st = device_.ZeroOnStream(&records[b].lost, sizeof(records[b].lost), stream);
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  };
  work.readbacks.push_back(Readback{header_.data, buffer, bookkeeping_bytes_});
  work.done = [this, buffer, give_back, list = *blocks, reply](absl::Status launched) {
    v1::RecoverResponse now;
    if (launched.ok()) {
      ReadLiveHeader(std::vector<char>(buffer, buffer + bookkeeping_bytes_), &now);
      LogInfo(absl::StrCat("blocks ", absl::StrJoin(list, ","),
                           " were re-prefilled: no longer lost (",
                           now.lost_blocks_size(), " blocks still lost)"));
    }
    give_back();
    v1::MarkReprefilledResponse out;
    *out.mutable_lost_blocks() = now.lost_blocks();
    reply(launched, std::move(out));
  };
  absl::Status st = device_.Submit(std::move(work));
  if (!st.ok()) {
    give_back();
    reply(st, {});
  }
}

}  // namespace server
}  // namespace specstate
