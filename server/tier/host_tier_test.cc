#include "server/tier/host_tier.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace specstate {
namespace server {
namespace {

constexpr uint64_t kEntry = 64;

class HostTierTest : public ::testing::Test {
 protected:
  // A tier of `slots` slots (and half a slot more budget: it is not used).
  std::unique_ptr<HostTier> Make(int slots) {
    arena_.assign(slots * kEntry, 0);
    auto tier = HostTier::Create(slots * kEntry + kEntry / 2, kEntry,
                                 [this](uint64_t bytes) -> absl::StatusOr<void*> {
                                   EXPECT_LE(bytes, arena_.size());
                                   return arena_.data();
                                 });
    EXPECT_TRUE(tier.ok()) << tier.status();
    return std::move(*tier);
  }
  // Saves `key` fully; its slot.
  int Save(HostTier& tier, const std::string& key, std::vector<std::string>* evicted = nullptr) {
    absl::StatusOr<HostTier::Ticket> t = tier.BeginSave({key}, evicted);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return -1;
    tier.EndSave(*t, {key}, true);
    return t->slots[0];
  }
  std::vector<std::string> Keys(const HostTier& tier) {
    std::vector<std::string> out;
    for (const auto& k : tier.List()) out.push_back(k.key);
    return out;
  }
  std::vector<char> arena_;
};

TEST_F(HostTierTest, BudgetBelowOneBlockIsRefused) {
  absl::StatusOr<std::unique_ptr<HostTier>> tier = HostTier::Create(
      kEntry - 1, kEntry, [](uint64_t) -> absl::StatusOr<void*> { return nullptr; });
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tier.status().message().find("holds no block"), std::string::npos);
}

TEST_F(HostTierTest, SlotsAreDistinctAndInTheArena) {
  auto tier = Make(3);
  EXPECT_EQ(tier->capacity(), 3);
  const int a = Save(*tier, "a"), b = Save(*tier, "b"), c = Save(*tier, "c");
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  EXPECT_NE(a, c);
  for (int s : {a, b, c}) {
    EXPECT_GE(tier->SlotData(s), arena_.data());
    EXPECT_LE(tier->SlotData(s) + kEntry, arena_.data() + arena_.size());
  }
  EXPECT_EQ(Keys(*tier), (std::vector<std::string>{"c", "b", "a"}));
}

TEST_F(HostTierTest, EvictsTheLeastRecentlyUsed) {
  auto tier = Make(3);
  Save(*tier, "a");
  Save(*tier, "b");
  Save(*tier, "c");
  // A restore makes "a" the most recent: "b" goes first.
  absl::StatusOr<HostTier::Ticket> r = tier->BeginRestore({"a"});
  ASSERT_TRUE(r.ok()) << r.status();
  tier->EndRestore(*r, true);
  std::vector<std::string> evicted;
  Save(*tier, "d", &evicted);
  EXPECT_EQ(evicted, (std::vector<std::string>{"b"}));
  EXPECT_EQ(Keys(*tier), (std::vector<std::string>{"d", "a", "c"}));
  const HostTier::Counters c = tier->counters();
  EXPECT_EQ(c.keys, 3);
  EXPECT_EQ(c.saves, 4u);
  EXPECT_EQ(c.restores, 1u);
  EXPECT_EQ(c.evictions, 1u);
}

TEST_F(HostTierTest, ASlotARestoreReadsIsNeitherEvictedNorReused) {
  auto tier = Make(2);
  const int a = Save(*tier, "a");
  Save(*tier, "b");
  absl::StatusOr<HostTier::Ticket> r = tier->BeginRestore({"a"});
  ASSERT_TRUE(r.ok());
  // "a" is the most recent now; "b" is evicted, not "a".
  std::vector<std::string> evicted;
  const int c = Save(*tier, "c", &evicted);
  EXPECT_EQ(evicted, (std::vector<std::string>{"b"}));
  EXPECT_NE(c, a);
  // Dropped while read: its slot stays out of use until the restore ends.
  EXPECT_EQ(tier->Drop({"a", "nothing"}), 1);
  absl::StatusOr<HostTier::Ticket> full = tier->BeginSave({"d"}, nullptr);
  ASSERT_TRUE(full.ok());  // evicts "c"
  absl::StatusOr<HostTier::Ticket> none = tier->BeginSave({"e"}, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  tier->EndRestore(*r, true);
  absl::StatusOr<HostTier::Ticket> now = tier->BeginSave({"e"}, nullptr);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->slots[0], a);
  tier->EndSave(*full, {"d"}, true);
  tier->EndSave(*now, {"e"}, true);
  EXPECT_EQ(Keys(*tier), (std::vector<std::string>{"e", "d"}));
}

TEST_F(HostTierTest, AFailedSaveLeavesTheKeyAsItWas) {
  auto tier = Make(3);
  const int first = Save(*tier, "a");
  absl::StatusOr<HostTier::Ticket> t = tier->BeginSave({"a"}, nullptr);
  ASSERT_TRUE(t.ok());
  EXPECT_NE(t->slots[0], first);  // out of place
  // A restore of a key whose save is in flight is refused.
  EXPECT_EQ(tier->BeginRestore({"a"}).status().code(), absl::StatusCode::kFailedPrecondition);
  tier->EndSave(*t, {"a"}, false);
  absl::StatusOr<HostTier::Ticket> r = tier->BeginRestore({"a"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->slots[0], first);
  tier->EndRestore(*r, true);
  EXPECT_EQ(tier->counters().failed_saves, 1u);
  // A successful one switches the key and frees the old slot.
  const int second = Save(*tier, "a");
  EXPECT_NE(second, first);
  EXPECT_EQ(tier->counters().keys, 1);
  Save(*tier, "b");
  Save(*tier, "c");  // uses `first` again: no eviction needed
  EXPECT_EQ(tier->counters().evictions, 0u);
}

TEST_F(HostTierTest, MoreBlocksThanTheTierHoldsChangeNothing) {
  auto tier = Make(2);
  Save(*tier, "a");
  std::vector<std::string> evicted;
  absl::StatusOr<HostTier::Ticket> t = tier->BeginSave({"x", "y", "z"}, &evicted);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(Keys(*tier), (std::vector<std::string>{"a"}));
}

TEST_F(HostTierTest, UnknownKeysAreNotFoundAndHoldNothing) {
  auto tier = Make(2);
  Save(*tier, "a");
  absl::StatusOr<HostTier::Ticket> r = tier->BeginRestore({"a", "b"});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("entries[1].key \"b\""), std::string::npos) << r.status();
  // "a" was not held: both slots can be written.
  absl::StatusOr<HostTier::Ticket> t = tier->BeginSave({"c", "d"}, nullptr);
  EXPECT_TRUE(t.ok()) << t.status();
}

TEST_F(HostTierTest, KeysAreValidated) {
  EXPECT_TRUE(HostTier::ValidateKeys({"a", "b"}, "entries").ok());
  EXPECT_EQ(HostTier::ValidateKeys({""}, "entries").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostTier::ValidateKeys({std::string(HostTier::kMaxKeyBytes + 1, 'k')}, "entries")
                .code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status twice = HostTier::ValidateKeys({"a", "b", "a"}, "entries");
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("entries[2].key \"a\" is listed twice"), std::string::npos);
}

}  // namespace
}  // namespace server
}  // namespace specstate
