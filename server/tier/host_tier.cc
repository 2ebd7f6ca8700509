#include "server/tier/host_tier.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace specstate {
namespace server {

absl::StatusOr<std::unique_ptr<HostTier>> HostTier::Create(uint64_t budget_bytes,
                                                           uint64_t entry_bytes,
                                                           const Allocate& allocate) {
  if (entry_bytes == 0 || budget_bytes / entry_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_tier_bytes ", budget_bytes, " holds no block: one block of every layer takes ",
        entry_bytes, " bytes"));
  }
  const uint64_t slots = budget_bytes / entry_bytes;
  if (slots > (uint64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("host_tier_bytes ", budget_bytes, " makes ",
                                                   slots, " slots: at most 2^30"));
  }
  absl::StatusOr<void*> arena = allocate(slots * entry_bytes);
  if (!arena.ok()) {
    return absl::Status(arena.status().code(),
                        absl::StrCat("the host tier's ", slots * entry_bytes,
                                     " bytes: ", arena.status().message()));
  }
  return std::unique_ptr<HostTier>(
      new HostTier(static_cast<char*>(*arena), static_cast<int>(slots), entry_bytes));
}

HostTier::HostTier(char* arena, int slots, uint64_t entry_bytes)
    : arena_(arena), entry_bytes_(entry_bytes), slots_(slots) {
  counters_.capacity = slots;
  counters_.entry_bytes = entry_bytes;
}

absl::Status HostTier::ValidateKeys(const std::vector<std::string>& keys, const char* field,
                                    const char* member) {
  absl::flat_hash_set<absl::string_view> seen;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].empty() || keys[i].size() > kMaxKeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]", member, " has ",
                                                     keys[i].size(), " bytes: 1 to ", kMaxKeyBytes));
    }
    if (!seen.insert(keys[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]", member, " \"", keys[i], "\" is listed twice"));
    }
  }
  return absl::OkStatus();
}

int HostTier::TakeFreeSlot() {
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    if (Free(i)) return i;
  }
  return -1;
}

void HostTier::Touch(Entry& e, const std::string& key) {
  lru_.erase(e.lru);
  lru_.push_front(key);
  e.lru = lru_.begin();
  e.used_at = absl::Now();
}

void HostTier::Forget(const std::string& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return;
  slots_[it->second.slot].keyed = false;
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

absl::StatusOr<HostTier::Ticket> HostTier::BeginSave(const std::vector<std::string>& keys,
                                                     std::vector<std::string>* evicted) {
  absl::MutexLock lock(&mu_);
  const int wanted = static_cast<int>(keys.size());
  int free = 0;
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) free += Free(i) ? 1 : 0;
  // Least recently used first; not this call's keys (a failed save must
  // leave them as they were), not a slot a restore in flight reads.
  absl::flat_hash_set<absl::string_view> own(keys.begin(), keys.end());
  std::vector<std::string> victims;
  for (auto it = lru_.rbegin(); free + static_cast<int>(victims.size()) < wanted && it != lru_.rend();
       ++it) {
    const Entry& e = entries_.at(*it);
    if (own.contains(*it) || slots_[e.slot].readers > 0 || slots_[e.slot].writing) continue;
    victims.push_back(*it);
  }
  if (free + static_cast<int>(victims.size()) < wanted) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the host tier has room for ", free + victims.size(), " of the ", wanted,
        " blocks to save: ", slots_.size(), " slots, the rest held by this call's keys or by "
        "copies in flight"));
  }
  for (const std::string& key : victims) {
    Forget(key);
    ++counters_.evictions;
    if (evicted != nullptr) evicted->push_back(key);
  }
  Ticket ticket;
  ticket.id = next_ticket_++;
  for (int i = 0; i < wanted; ++i) {
    const int slot = TakeFreeSlot();
    slots_[slot].writing = true;
    ticket.slots.push_back(slot);
    ++saving_[keys[i]];
  }
  return ticket;
}

void HostTier::EndSave(const Ticket& ticket, const std::vector<std::string>& keys, bool copied,
                       bool fetched) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < keys.size() && i < ticket.slots.size(); ++i) {
    const int slot = ticket.slots[i];
    slots_[slot].writing = false;
    if (--saving_[keys[i]] == 0) saving_.erase(keys[i]);
    if (!copied) continue;
    Forget(keys[i]);  // the slot it named is free once no restore reads it
    lru_.push_front(keys[i]);
    Entry& e = entries_[keys[i]];
    e = Entry{slot, now, now, 0, lru_.begin()};
    slots_[slot].keyed = true;
    ++(fetched ? counters_.fetched : counters_.saves);
  }
  if (!copied) counters_.failed_saves += keys.size();
}

absl::StatusOr<HostTier::Ticket> HostTier::BeginRestore(const std::vector<std::string>& keys,
                                                        bool send) {
  absl::MutexLock lock(&mu_);
  // How the caller's request names key i: RestoreBlocks' entries[i].key,
  // ExportSaved's keys[i].
  const auto named = [send](size_t i) {
    return send ? absl::StrCat("keys[", i, "]") : absl::StrCat("entries[", i, "].key");
  };
  for (size_t i = 0; i < keys.size(); ++i) {
    if (saving_.contains(keys[i])) {
      return absl::FailedPreconditionError(absl::StrCat(
          named(i), " \"", keys[i],
          "\" has a save in flight (ASYNC): read it once that call's work is done"));
    }
    if (!entries_.contains(keys[i])) {
      return absl::NotFoundError(
          absl::StrCat(named(i), " \"", keys[i], "\" is not saved in the host tier"));
    }
  }
  Ticket ticket;
  ticket.id = next_ticket_++;
  for (const std::string& key : keys) {
    Entry& e = entries_.at(key);
    ++slots_[e.slot].readers;
    Touch(e, key);
    if (!send) ++e.restores;
    ticket.slots.push_back(e.slot);
  }
  return ticket;
}

void HostTier::EndRestore(const Ticket& ticket, bool copied, bool send) {
  absl::MutexLock lock(&mu_);
  for (int slot : ticket.slots) --slots_[slot].readers;
  if (copied) (send ? counters_.sent : counters_.restores) += ticket.slots.size();
}

int64_t HostTier::Drop(const std::vector<std::string>& keys) {
  absl::MutexLock lock(&mu_);
  int64_t dropped = 0;
  for (const std::string& key : keys) {
    if (!entries_.contains(key)) continue;
    Forget(key);
    ++dropped;
  }
  counters_.drops += dropped;
  return dropped;
}

std::vector<HostTier::KeyInfo> HostTier::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<KeyInfo> out;
  out.reserve(lru_.size());
  for (const std::string& key : lru_) {
    const Entry& e = entries_.at(key);
    out.push_back(KeyInfo{key, e.saved_at, e.used_at, e.restores});
  }
  return out;
}

HostTier::Counters HostTier::counters() const {
  absl::MutexLock lock(&mu_);
  Counters c = counters_;
  c.keys = static_cast<int64_t>(entries_.size());
  return c;
}

}  // namespace server
}  // namespace specstate
