// The host tier's bookkeeping: saved copies of state blocks (every layer's
// recurrent and conv block) in one arena of host memory, under keys the
// scheduler chooses. The arena is cut into equal slots, one saved block
// each; when a save finds no free slot it evicts the least recently used
// key. The engine does the copies (server/engine/host_tier.cc); this class
// only says which slot each copy reads or writes, and keeps a slot that a
// copy in flight uses from being handed out again.
//
// A save writes fresh slots and switches its keys to them only once its
// copies are done (EndSave), so a failed save leaves every key as it was.
// Thread-safe.
#ifndef SPECSTATE_SERVER_TIER_HOST_TIER_H_
#define SPECSTATE_SERVER_TIER_HOST_TIER_H_

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace specstate {
namespace server {

class HostTier {
 public:
  // The longest key.
  static constexpr size_t kMaxKeyBytes = 256;

  // Host memory of `bytes` bytes (pinned on CUDA: the device copies to and
  // from it asynchronously).
  using Allocate = std::function<absl::StatusOr<void*>(uint64_t bytes)>;

  // A tier of budget_bytes / entry_bytes slots, its arena from `allocate`
  // now. INVALID_ARGUMENT when the budget holds no slot.
  static absl::StatusOr<std::unique_ptr<HostTier>> Create(uint64_t budget_bytes,
                                                          uint64_t entry_bytes,
                                                          const Allocate& allocate);

  struct Counters {
    int64_t keys = 0;
    int64_t capacity = 0;
    uint64_t entry_bytes = 0;
    uint64_t saves = 0;
    uint64_t restores = 0;
    uint64_t evictions = 0;
    uint64_t drops = 0;
    uint64_t failed_saves = 0;
    uint64_t sent = 0;     // blocks another instance read (transfers out)
    uint64_t fetched = 0;  // blocks read from another instance (transfers in)
  };
  struct KeyInfo {
    std::string key;
    absl::Time saved_at;
    absl::Time used_at;
    uint64_t restores = 0;
  };

  // A save or restore in flight: the slots its copies use, in the order of
  // its keys (where each slot's bytes are: SlotData()).
  struct Ticket {
    uint64_t id = 0;
    std::vector<int> slots;
  };

  // Fresh slots for `keys` (checked: ValidateKeys), evicting least recently
  // used keys that no copy in flight reads; their keys into `evicted`.
  // RESOURCE_EXHAUSTED (nothing changed) when there is not room for all.
  absl::StatusOr<Ticket> BeginSave(const std::vector<std::string>& keys,
                                   std::vector<std::string>* evicted);
  // The save's copies are done: on success its keys name its slots (the
  // slots they named before are free once no copy reads them); otherwise
  // its slots are free again and its keys unchanged. `fetched`: the copies
  // came from another instance (counted as fetched, not saved).
  void EndSave(const Ticket& ticket, const std::vector<std::string>& keys, bool copied,
               bool fetched = false);

  // The slots of saved `keys`, held until EndRestore; the keys count as
  // used. NOT_FOUND naming the first key not saved; FAILED_PRECONDITION
  // when a save of one is in flight. Nothing held then. `send`: another
  // instance reads them (counted as sent, not restored).
  absl::StatusOr<Ticket> BeginRestore(const std::vector<std::string>& keys, bool send = false);
  void EndRestore(const Ticket& ticket, bool copied, bool send = false);

  // Forgets `keys` (those not saved are skipped); how many were saved.
  int64_t Drop(const std::vector<std::string>& keys);

  // Most recently used first.
  std::vector<KeyInfo> List() const;
  Counters counters() const;

  uint64_t entry_bytes() const { return entry_bytes_; }
  int capacity() const { return static_cast<int>(slots_.size()); }
  // Where slot `slot`'s entry_bytes() bytes are.
  char* SlotData(int slot) const { return arena_ + uint64_t(slot) * entry_bytes_; }
  // The arena: every slot, capacity() x entry_bytes() bytes from SlotData(0).
  uint64_t arena_bytes() const { return uint64_t(capacity()) * entry_bytes_; }

  // 1 to kMaxKeyBytes bytes each, distinct: INVALID_ARGUMENT naming
  // `field`, the entry and `member` (entries[3].key; keys[3]) otherwise.
  static absl::Status ValidateKeys(const std::vector<std::string>& keys, const char* field,
                                   const char* member = ".key");

 private:
  HostTier(char* arena, int slots, uint64_t entry_bytes);

  struct Slot {
    int readers = 0;      // restores in flight
    bool writing = false; // a save in flight writes it
    bool keyed = false;   // a key names it
  };
  struct Entry {
    int slot = -1;
    absl::Time saved_at;
    absl::Time used_at;
    uint64_t restores = 0;
    std::list<std::string>::iterator lru;  // in lru_ (front: most recent)
  };

  // A slot no key names and no copy uses, or -1.
  int TakeFreeSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Touch(Entry& e, const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The key goes; its slot is free once no copy reads it.
  void Forget(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Free(int slot) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Slot& s = slots_[slot];
    return !s.keyed && !s.writing && s.readers == 0;
  }

  char* const arena_;
  const uint64_t entry_bytes_;
  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);
  // Keys with a save in flight, and how many.
  absl::flat_hash_map<std::string, int> saving_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_TIER_HOST_TIER_H_
