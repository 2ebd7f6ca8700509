// The host tier over a real socket (CPU backend), in every commit mode:
// SaveBlocks copies a block's state (every layer, recurrent and conv, as
// the commits so far left it: DEFERRED's pending tokens and FAST's ring
// applied) into host memory; RestoreBlocks writes it back bit for bit, into
// the same block or another, and a decode goes on from it; least recently
// used keys are evicted; bad calls are refused with the field and the
// bound, and change nothing.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "client/simulator/simulator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/mode_fixture.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using testing::ExpectError;
using testing::PoolBlock;
using testing::Scheduler;
using testing::ServerProcess;
using testing::ValueOrDie;

v1::SaveBlocksRequest Save(const std::vector<std::pair<int, std::string>>& entries) {
  v1::SaveBlocksRequest r;
  for (const auto& [block, key] : entries) {
    v1::SaveEntry* e = r.add_entries();
    e->set_block(block);
    e->set_key(key);
  }
  return r;
}

v1::RestoreBlocksRequest Restore(const std::vector<std::pair<std::string, int>>& entries) {
  v1::RestoreBlocksRequest r;
  for (const auto& [key, block] : entries) {
    v1::RestoreEntry* e = r.add_entries();
    e->set_key(key);
    e->set_block(block);
  }
  return r;
}

class HostTierTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    seed_ = std::random_device()();
    rng_.seed(seed_);
  }
  void TearDown() override {
    if (HasFailure() && server_ != nullptr) {
      std::fprintf(stderr, "seed %u; server log:\n%s\n", seed_, server_->Log().c_str());
    }
  }

  // A service in the mode under test with `tier` (a --host_tier_bytes
  // value; "" none), its client and a driving scheduler.
  void Start(const std::string& tier) {
    std::vector<std::string> flags = {"--backend=cpu", "--commit_mode=" + GetParam()};
    if (GetParam() == "fast") flags.push_back("--fold_every=2");
    if (!tier.empty()) flags.push_back("--host_tier_bytes=" + tier);
    s_.reset();
    client_.reset();
    server_ = ValueOrDie(ServerProcess::Start(flags));
    client_ = ValueOrDie(Client::Connect(server_->address()));
    s_ = std::make_unique<Scheduler>(*client_);
    views_ = ValueOrDie(client_->ExportPools());
  }

  // Steps from `first` on: every layer verified, accepted counts drawn.
  void Decode(uint64_t first, int steps) {
    for (uint64_t step = first; step < first + steps; ++step) {
      ASSERT_OK(s_->VerifyAll(step));
      std::vector<int> accepted(Scheduler::kRows);
      for (int& a : accepted) a = 1 + static_cast<int>(rng_() % Scheduler::kTokensPerRow);
      ASSERT_OK(s_->session().Commit(s_->Commit(step, accepted)).status());
    }
  }

  // Every layer's recurrent and conv bytes of `block` in a pools snapshot.
  std::string BlockState(const std::string& pools, int block) {
    std::string out;
    for (int l = 0; l < s_->layout().num_layers(); ++l) {
      out += PoolBlock(pools, views_, l, block, "recurrent");
      out += PoolBlock(pools, views_, l, block, "conv");
    }
    return out;
  }

  // Blocks 1..3 with everything the mode keeps unapplied applied.
  std::string Materialized() {
    v1::FlushRequest flush;
    EXPECT_TRUE(s_->session().Flush(flush).ok());
    return s_->Pools();
  }

  uint64_t EntryBytes() const {
    const v1::Layout& l = s_->layout();
    return uint64_t(l.num_layers()) * (l.state_block_bytes() + l.conv_block_bytes());
  }

  uint32_t seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Scheduler> s_;
  v1::ExportPoolsResponse views_;
};

TEST_P(HostTierTest, RestoreWritesBackWhatWasSavedBitForBit) {
  Start("64MiB");
  // Blocks 1..3 after a few steps: DEFERRED's last commit pending, FAST's
  // ring holding tokens.
  ASSERT_NO_FATAL_FAILURE(Decode(1, 3));
  const std::string before_save = s_->Pools();
  v1::SaveBlocksResponse saved = ValueOrDie(s_->session().SaveBlocks(Save({{2, "k2"}, {3, "k3"}})));
  EXPECT_EQ(saved.bytes(), 2 * EntryBytes());
  EXPECT_TRUE(saved.evicted().empty());
  // A save is a read: not a pool byte changed (the pending tokens and rings
  // are applied in a copy).
  EXPECT_EQ(s_->Pools(), before_save);
  const std::string expected = Materialized();

  // More steps change blocks 1..3; then k2 back into block 2 and into block
  // 5, k3 into block 3.
  ASSERT_NO_FATAL_FAILURE(Decode(4, 2));
  ASSERT_NE(BlockState(Materialized(), 2), BlockState(expected, 2));
  v1::RestoreBlocksResponse restored =
      ValueOrDie(s_->session().RestoreBlocks(Restore({{"k2", 2}, {"k3", 3}})));
  EXPECT_EQ(restored.bytes(), 2 * EntryBytes());
  ASSERT_OK(s_->session().RestoreBlocks(Restore({{"k2", 5}})).status());
  std::string now = s_->Pools();
  EXPECT_EQ(BlockState(now, 2), BlockState(expected, 2));
  EXPECT_EQ(BlockState(now, 3), BlockState(expected, 3));
  EXPECT_EQ(BlockState(now, 5), BlockState(expected, 2));
  // Nothing of the steps after the save is left to apply to them.
  now = Materialized();
  EXPECT_EQ(BlockState(now, 2), BlockState(expected, 2));
  EXPECT_EQ(BlockState(now, 5), BlockState(expected, 2));
  // The decode goes on from the restored blocks.
  ASSERT_NO_FATAL_FAILURE(Decode(6, 2));

  const v1::ListSavedResponse list = ValueOrDie(client_->ListSaved());
  ASSERT_EQ(list.keys_size(), 2);
  EXPECT_EQ(list.keys(0).key(), "k2");  // restored last
  EXPECT_EQ(list.keys(0).restores(), 2u);
  EXPECT_EQ(list.keys(1).key(), "k3");
  EXPECT_EQ(list.entry_bytes(), EntryBytes());
  EXPECT_EQ(list.capacity(), int64_t((64 << 20) / EntryBytes()));
  const v1::Stats stats = ValueOrDie(client_->GetStats());
  EXPECT_EQ(stats.host_tier().keys(), 2);
  EXPECT_EQ(stats.host_tier().saves(), 2u);
  EXPECT_EQ(stats.host_tier().restores(), 3u);
}

TEST_P(HostTierTest, AsyncSaveAndRestoreAreOrderedWithTheSession) {
  Start("64MiB");
  ASSERT_NO_FATAL_FAILURE(Decode(1, 2));
  v1::SaveBlocksRequest save = Save({{1, "a"}});
  save.set_ordering(v1::ASYNC);
  EXPECT_TRUE(ValueOrDie(s_->session().SaveBlocks(save)).enqueued());
  const std::string expected = Materialized();  // ordered after the save
  ASSERT_NO_FATAL_FAILURE(Decode(3, 1));
  v1::RestoreBlocksRequest restore = Restore({{"a", 1}});
  restore.set_ordering(v1::ASYNC);
  EXPECT_TRUE(ValueOrDie(s_->session().RestoreBlocks(restore)).enqueued());
  ASSERT_TRUE(s_->session().Flush(v1::FlushRequest()).ok());  // SYNC: after the restore
  EXPECT_EQ(BlockState(s_->Pools(), 1), BlockState(expected, 1));
}

TEST_P(HostTierTest, LeastRecentlyUsedKeysAreEvicted) {
  Start("64MiB");
  const uint64_t entry = EntryBytes();
  Start(absl::StrCat(3 * entry + entry / 2));  // three keys
  ASSERT_NO_FATAL_FAILURE(Decode(1, 1));
  ASSERT_OK(s_->session().SaveBlocks(Save({{1, "a"}, {2, "b"}, {3, "c"}})).status());
  ASSERT_OK(s_->session().RestoreBlocks(Restore({{"a", 4}})).status());  // "a" used
  v1::SaveBlocksResponse r = ValueOrDie(s_->session().SaveBlocks(Save({{1, "d"}})));
  EXPECT_THAT(r.evicted(), ::testing::ElementsAre("b"));
  const v1::ListSavedResponse list = ValueOrDie(client_->ListSaved());
  std::vector<std::string> keys;
  for (const v1::SavedKey& k : list.keys()) keys.push_back(k.key());
  EXPECT_THAT(keys, ::testing::ElementsAre("d", "a", "c"));
  ExpectError(s_->session().RestoreBlocks(Restore({{"b", 1}})).status(),
              absl::StatusCode::kNotFound, "entries[0].key \"b\" is not saved");
  EXPECT_EQ(ValueOrDie(client_->DropSaved({"a", "x"})).dropped(), 1);
  EXPECT_EQ(ValueOrDie(client_->ListSaved()).keys_size(), 2);
  // More blocks than the tier holds: refused, nothing evicted.
  ExpectError(s_->session().SaveBlocks(Save({{1, "p"}, {2, "q"}, {3, "r"}, {4, "s"}})).status(),
              absl::StatusCode::kInvalidArgument, "1 to the host tier's capacity, 3");
  const v1::Stats stats = ValueOrDie(client_->GetStats());
  EXPECT_EQ(stats.host_tier().evictions(), 1u);
  EXPECT_EQ(stats.host_tier().drops(), 1u);
  EXPECT_EQ(stats.host_tier().capacity(), 3);
  // What an operator sees: specstatectl saved and stats.
  const auto ctl = [&](const std::string& command) {
    return ValueOrDie(testing::RunProcess({testing::RunfilePath("client/cli/specstatectl"),
                                           "--server=" + server_->address(), command}));
  };
  const testing::ProcessResult saved = ctl("saved");
  EXPECT_EQ(saved.exit_code, 0) << saved.output;
  EXPECT_THAT(saved.output, ::testing::HasSubstr("host tier: 2 of 3 blocks saved"));
  EXPECT_THAT(saved.output, ::testing::HasSubstr("\nd "));
  EXPECT_THAT(saved.output, ::testing::HasSubstr("\nc "));
  const testing::ProcessResult counters = ctl("stats");
  EXPECT_THAT(counters.output, ::testing::HasSubstr("host tier: 2 of 3 blocks saved; since start "
                                                    "4 saved, 1 restored, 1 evicted, 1 dropped"));
}

TEST_P(HostTierTest, BadCallsChangeNothing) {
  Start("64MiB");
  ASSERT_NO_FATAL_FAILURE(Decode(1, 2));
  ASSERT_OK(s_->session().SaveBlocks(Save({{1, "a"}, {2, "b"}})).status());
  const std::string pools = s_->Pools();
  const int64_t num_blocks = s_->layout().num_blocks();
  const std::string bound = absl::StrCat("1 to ", num_blocks - 1, " (0 is the null block)");
  ExpectError(s_->session().SaveBlocks(Save({{2, "c"}, {0, "d"}})).status(),
              absl::StatusCode::kOutOfRange, "entries[1].block 0 is out of range: " + bound);
  ExpectError(s_->session().SaveBlocks(Save({{int(num_blocks), "c"}})).status(),
              absl::StatusCode::kOutOfRange,
              absl::StrCat("entries[0].block ", num_blocks, " is out of range"));
  ExpectError(s_->session().SaveBlocks(Save({{2, "c"}, {3, "c"}})).status(),
              absl::StatusCode::kInvalidArgument, "entries[1].key \"c\" is listed twice");
  ExpectError(s_->session().SaveBlocks(Save({{2, ""}})).status(),
              absl::StatusCode::kInvalidArgument, "entries[0].key has 0 bytes: 1 to 256");
  ExpectError(s_->session().SaveBlocks(Save({})).status(), absl::StatusCode::kInvalidArgument,
              "entries has 0 entries");
  ExpectError(s_->session().RestoreBlocks(Restore({{"a", 2}, {"nope", 3}})).status(),
              absl::StatusCode::kNotFound, "entries[1].key \"nope\" is not saved");
  ExpectError(s_->session().RestoreBlocks(Restore({{"a", 2}, {"a", 3}})).status(),
              absl::StatusCode::kInvalidArgument, "listed twice");
  ExpectError(s_->session().RestoreBlocks(Restore({{"a", 4}, {"b", 4}})).status(),
              absl::StatusCode::kInvalidArgument, "entries[1].block 4 is listed twice");
  ExpectError(s_->session().RestoreBlocks(Restore({{"a", -1}})).status(),
              absl::StatusCode::kOutOfRange, "entries[0].block -1 is out of range");
  // A client that does not drive cannot save or restore.
  std::unique_ptr<client::Session> other =
      ValueOrDie(client_->OpenSession("not the driver", /*drive=*/false));
  EXPECT_EQ(other->SaveBlocks(Save({{1, "z"}})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(other->RestoreBlocks(Restore({{"a", 1}})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Not a pool byte, not a key changed.
  EXPECT_EQ(s_->Pools(), pools);
  const v1::ListSavedResponse list = ValueOrDie(client_->ListSaved());
  ASSERT_EQ(list.keys_size(), 2);
  EXPECT_EQ(list.keys(0).restores() + list.keys(1).restores(), 0u);
  EXPECT_EQ(ValueOrDie(client_->GetStats()).host_tier().restores(), 0u);
}

TEST_P(HostTierTest, WithoutAHostTierTheCallsAreRefused) {
  Start("");
  ExpectError(s_->session().SaveBlocks(Save({{1, "a"}})).status(),
              absl::StatusCode::kFailedPrecondition, "no host tier: start specstated with "
                                                     "--host_tier_bytes");
  ExpectError(s_->session().RestoreBlocks(Restore({{"a", 1}})).status(),
              absl::StatusCode::kFailedPrecondition, "no host tier");
  ExpectError(client_->DropSaved({"a"}).status(), absl::StatusCode::kFailedPrecondition,
              "no host tier");
  const v1::ListSavedResponse list = ValueOrDie(client_->ListSaved());
  EXPECT_EQ(list.capacity(), 0);
  EXPECT_FALSE(ValueOrDie(client_->GetStats()).has_host_tier());
}

TEST_P(HostTierTest, ABudgetBelowOneBlockIsRefusedAtStart) {
  const testing::ProcessResult r = ValueOrDie(testing::RunProcess(
      {testing::RunfilePath("server/specstated"), "--backend=cpu", "--commit_mode=" + GetParam(),
       "--host_tier_bytes=1KiB", "--listen=unix:///tmp/specstate-host-tier-refused.sock"}));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::HasSubstr("host_tier_bytes 1024 holds no block: one block of "
                                             "every layer takes 299008 bytes"));
}

// The simulator's decode loop with a block saved, overwritten and restored
// every few steps (none and align mode): every state and output still as
// the stock path's (FAST: within its contract), and the restored blocks
// checked.
TEST_P(HostTierTest, TheSimulatorSavesOverwritesAndRestoresBlocksMidRun) {
  for (const std::string cache_mode : {"none", "align"}) {
    SCOPED_TRACE(cache_mode);
    std::vector<std::string> flags = {"--backend=cpu", "--commit_mode=" + GetParam(),
                                      "--host_tier_bytes=64MiB", "--cache_mode=" + cache_mode,
                                      "--blocks=200"};
    if (cache_mode == "align") flags.push_back("--mamba_block_size=8");
    if (GetParam() == "fast") flags.push_back("--fold_every=2");
    server_ = ValueOrDie(ServerProcess::Start(flags));
    client_ = ValueOrDie(Client::Connect(server_->address()));
    client::SimulationOptions o;
    o.steps = 40;
    o.requests = 4;
    o.seed = seed_;
    o.commit_mode = GetParam();
    o.host_tier_every = 3;
    const client::SimulationReport r = ValueOrDie(client::RunSimulation(*client_, o));
    EXPECT_TRUE(r.passed()) << client::FormatReport(r);
    EXPECT_GE(r.host_tier_round_trips, 10u) << client::FormatReport(r);
    client_.reset();
    server_.reset();
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, HostTierTest, ::testing::Values("eager", "deferred", "fast"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace specstate
