// The host tier's verbs: SaveBlocks and RestoreBlocks copy whole blocks
// (every layer's recurrent and conv block) between the pools and the slots
// of server/tier's HostTier, through DriveUnstepped (ordered with the
// caller's work like a Flush); ListSaved and DropSaved only read or change
// the bookkeeping.
//
// A saved entry is the block's layers in order, each its recurrent block
// (LayoutSizes::state_block_bytes) then its conv block (conv_block_bytes).
//
// With kept pools a restore marks its blocks lost in the kept block records
// before its first write and clears them after its last, on the device's
// queue: a restore a restart cuts short reports its blocks lost
// (Recover.lost_blocks), as an interrupted Commit does.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/base/test_crash.h"
#include "server/engine/engine.h"

namespace specstate {
namespace server {
namespace {

// The lost flag a restore sets while it writes (any nonzero value).
const uint32_t kRestoreInFlight = 1;

// The checks every call with entries makes: their count, each block's range.
absl::Status CheckTierEntries(int entries, int capacity, const std::vector<int32_t>& blocks,
                              int64_t num_blocks) {
  if (entries < 1 || entries > capacity) {
    return absl::InvalidArgumentError(absl::StrCat("entries has ", entries,
                                                   " entries: 1 to the host tier's capacity, ",
                                                   capacity));
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] < 1 || blocks[i] >= num_blocks) {
      return absl::OutOfRangeError(absl::StrCat("entries[", i, "].block ", blocks[i],
                                                " is out of range: 1 to ", num_blocks - 1,
                                                " (0 is the null block)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Engine::NoHostTier() {
  return absl::FailedPreconditionError(
      "this service has no host tier: start specstated with --host_tier_bytes "
      "(ServiceConfig.host_tier_bytes)");
}

std::optional<HostTier::Counters> Engine::HostTierCounters() const {
  if (host_tier_ == nullptr) return std::nullopt;
  return host_tier_->counters();
}

void Engine::SaveBlocks(const std::string& session, const v1::SaveBlocksRequest& req,
                        Reply<v1::SaveBlocksResponse> reply) {
  if (host_tier_ == nullptr) return reply(NoHostTier(), {});
  std::vector<std::string> keys;
  std::vector<int32_t> blocks;
  for (const v1::SaveEntry& e : req.entries()) {
    keys.push_back(e.key());
    blocks.push_back(e.block());
  }
  absl::Status st =
      CheckTierEntries(req.entries_size(), host_tier_->capacity(), blocks, layout_.num_blocks());
  if (st.ok()) st = HostTier::ValidateKeys(keys, "entries");
  absl::StatusOr<Ordering> ordering = st.ok() ? ResolveOrdering(session, req) : st;
  if (!ordering.ok()) return reply(ordering.status(), {});
  std::vector<std::string> evicted;
  absl::StatusOr<HostTier::Ticket> ticket = host_tier_->BeginSave(keys, &evicted);
  if (!ticket.ok()) return reply(ticket.status(), {});

  UnsteppedCall call;
  call.session = session;
  call.verb = "SaveBlocks";
  call.ordering = *std::move(ordering);
  call.make = [this, blocks, slots = ticket->slots](kernels::DeviceStatus* mirror) {
    ModeEngine::FlushWork work;
    // Each block's current state, layer by layer, materialized into the
    // mode's copy (DEFERRED's pending tokens replayed there, FAST's ring
    // folded there: what a Flush would leave, the pool unchanged), then
    // copied out; the conv window straight from the pool.
    work.launch = [this, blocks, slots, mirror](kernels::Stream stream,
                                               Scratch& scratch) -> absl::Status {
      for (size_t i = 0; i < blocks.size(); ++i) {
        char* dst = host_tier_->SlotData(slots[i]);
        for (int l = 0; l < layout_.num_layers(); ++l) {
          absl::Status st = mode_->MaterializeCopy(l, blocks[i], mirror)(stream, scratch);
          if (st.ok()) {
            st = device_->CopyOnStream(dst, mode_->CopyBlock(), sizes_.state_block_bytes, stream);
          }
          dst += sizes_.state_block_bytes;
          const char* conv =
              static_cast<const char*>(layers_[l].conv.data) + blocks[i] * sizes_.conv_block_bytes;
          if (st.ok()) st = device_->CopyOnStream(dst, conv, sizes_.conv_block_bytes, stream);
          dst += sizes_.conv_block_bytes;
          if (!st.ok()) return st;
        }
      }
      return absl::OkStatus();
    };
    return work;
  };
  call.finished = [this, ticket = *ticket, keys](absl::Status status) {
    host_tier_->EndSave(ticket, keys, status.ok());
  };
  const uint64_t bytes = keys.size() * host_tier_->entry_bytes();
  call.respond = [reply, evicted, bytes](absl::Status status, bool enqueued) {
    v1::SaveBlocksResponse response;
    if (status.ok()) {
      response.set_enqueued(enqueued);
      for (const std::string& key : evicted) response.add_evicted(key);
      response.set_bytes(bytes);
    }
    reply(status, std::move(response));
  };
  DriveUnstepped(std::move(call));
}

void Engine::RestoreBlocks(const std::string& session, const v1::RestoreBlocksRequest& req,
                           Reply<v1::RestoreBlocksResponse> reply) {
  if (host_tier_ == nullptr) return reply(NoHostTier(), {});
  std::vector<std::string> keys;
  std::vector<int32_t> blocks;
  for (const v1::RestoreEntry& e : req.entries()) {
    keys.push_back(e.key());
    blocks.push_back(e.block());
  }
  absl::Status st =
      CheckTierEntries(req.entries_size(), host_tier_->capacity(), blocks, layout_.num_blocks());
  if (st.ok()) st = HostTier::ValidateKeys(keys, "entries");
  if (st.ok()) {
    absl::flat_hash_set<int32_t> seen;
    for (size_t i = 0; i < blocks.size() && st.ok(); ++i) {
      if (!seen.insert(blocks[i]).second) {
        st = absl::InvalidArgumentError(absl::StrCat(
            "entries[", i, "].block ", blocks[i], " is listed twice: one key a block"));
      }
    }
  }
  absl::StatusOr<Ordering> ordering = st.ok() ? ResolveOrdering(session, req) : st;
  if (!ordering.ok()) return reply(ordering.status(), {});
  absl::StatusOr<HostTier::Ticket> ticket = host_tier_->BeginRestore(keys);
  if (!ticket.ok()) return reply(ticket.status(), {});

  auto index = std::make_shared<IndexInput>();
  index->present = true;
  index->values = blocks;
  index->rows = static_cast<int64_t>(blocks.size());

  UnsteppedCall call;
  call.session = session;
  call.verb = "RestoreBlocks";
  call.ordering = *std::move(ordering);
  call.make = [this, index, blocks, slots = ticket->slots](kernels::DeviceStatus* mirror) {
    ModeEngine::FlushWork work;
    // What the mode keeps unapplied for the blocks is forgotten: the saved
    // state replaces all of it.
    Launch forget = mode_->Materialize(index, -1, true, mirror);
    work.launch = [this, forget, blocks, slots](kernels::Stream stream,
                                               Scratch& scratch) -> absl::Status {
      kernels::BlockRecord* records = journal_.blocks;  // null: no kept pools
      for (size_t i = 0; records != nullptr && i < blocks.size(); ++i) {
        absl::Status st = device_->CopyOnStream(&records[blocks[i]].lost, &kRestoreInFlight,
                                                sizeof(kRestoreInFlight), stream);
        if (!st.ok()) return st;
      }
      if (absl::Status st = forget(stream, scratch); !st.ok()) return st;
      for (size_t i = 0; i < blocks.size(); ++i) {
        const char* src = host_tier_->SlotData(slots[i]);
        for (const LayerState& layer : layers_) {
          char* state = static_cast<char*>(layer.state.data) + blocks[i] * sizes_.state_block_bytes;
          char* conv = static_cast<char*>(layer.conv.data) + blocks[i] * sizes_.conv_block_bytes;
          absl::Status st = device_->CopyOnStream(state, src, sizes_.state_block_bytes, stream);
          src += sizes_.state_block_bytes;
          if (st.ok()) st = device_->CopyOnStream(conv, src, sizes_.conv_block_bytes, stream);
          src += sizes_.conv_block_bytes;
          if (!st.ok()) return st;
          TestCrashPoint("restore:layer");
        }
      }
      for (size_t i = 0; records != nullptr && i < blocks.size(); ++i) {
        absl::Status st = device_->ZeroOnStream(&records[blocks[i]].lost,
                                                sizeof(records[blocks[i]].lost), stream);
        if (!st.ok()) return st;
      }
      return absl::OkStatus();
    };
    return work;
  };
  call.finished = [this, ticket = *ticket](absl::Status status) {
    host_tier_->EndRestore(ticket, status.ok());
  };
  const uint64_t bytes = keys.size() * host_tier_->entry_bytes();
  call.respond = [reply, bytes](absl::Status status, bool enqueued) {
    v1::RestoreBlocksResponse response;
    if (status.ok()) {
      response.set_enqueued(enqueued);
      response.set_bytes(bytes);
    }
    reply(status, std::move(response));
  };
  DriveUnstepped(std::move(call));
}

v1::ListSavedResponse Engine::ListSaved() const {
  v1::ListSavedResponse out;
  if (host_tier_ == nullptr) return out;
  out.set_entry_bytes(host_tier_->entry_bytes());
  out.set_capacity(host_tier_->capacity());
  for (const HostTier::KeyInfo& k : host_tier_->List()) {
    v1::SavedKey* key = out.add_keys();
    key->set_key(k.key);
    key->set_saved_at(absl::ToDoubleSeconds(k.saved_at - absl::UnixEpoch()));
    key->set_used_at(absl::ToDoubleSeconds(k.used_at - absl::UnixEpoch()));
    key->set_restores(k.restores);
  }
  return out;
}

absl::StatusOr<v1::DropSavedResponse> Engine::DropSaved(const v1::DropSavedRequest& req) {
  if (host_tier_ == nullptr) return NoHostTier();
  v1::DropSavedResponse out;
  out.set_dropped(host_tier_->Drop(std::vector<std::string>(req.keys().begin(), req.keys().end())));
  return out;
}

}  // namespace server
}  // namespace specstate
