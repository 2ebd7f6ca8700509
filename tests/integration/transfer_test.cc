// Transfers between instances over a real socket (CPU backend), in every
// commit mode and over UCX's TCP and shared-memory transports: blocks saved
// on one specstated are fetched into another's host tier (FetchSaved: UCX
// one-sided reads), restored into its blocks bit for bit, and the source
// counts them sent; a key the source lacks, a source that is not there and
// a source of another layout are refused, and nothing stays held.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
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

// (commit mode, UCX_TLS)
class TransferTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    seed_ = std::random_device()();
    rng_.seed(seed_);
    // Both services (children of this process) use only these transports.
    setenv("UCX_TLS", std::get<1>(GetParam()).c_str(), 1);
  }
  void TearDown() override {
    if (HasFailure()) {
      std::fprintf(stderr, "seed %u\n", seed_);
      for (const auto& s : {source_.get(), destination_.get()}) {
        if (s != nullptr) std::fprintf(stderr, "server log:\n%s\n", s->Log().c_str());
      }
    }
  }

  std::unique_ptr<ServerProcess> Start(std::vector<std::string> more = {}) {
    const std::string mode = std::get<0>(GetParam());
    std::vector<std::string> flags = {"--backend=cpu", "--commit_mode=" + mode,
                                      "--host_tier_bytes=64MiB"};
    if (mode == "fast") flags.push_back("--fold_every=2");
    flags.insert(flags.end(), more.begin(), more.end());
    return ValueOrDie(ServerProcess::Start(flags));
  }

  // Every layer's recurrent and conv bytes of `block` in a pools snapshot.
  static std::string BlockState(const std::string& pools, const v1::ExportPoolsResponse& views,
                                int layers, int block) {
    std::string out;
    for (int l = 0; l < layers; ++l) {
      out += PoolBlock(pools, views, l, block, "recurrent");
      out += PoolBlock(pools, views, l, block, "conv");
    }
    return out;
  }

  uint32_t seed_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<ServerProcess> source_, destination_;
};

TEST_P(TransferTest, FetchedBlocksRestoreBitForBit) {
  source_ = Start();
  destination_ = Start();
  auto a = ValueOrDie(Client::Connect(source_->address()));
  auto b = ValueOrDie(Client::Connect(destination_->address()));
  Scheduler prefill(*a), decode(*b);
  const int layers = prefill.layout().num_layers();
  // The source's blocks 1..3 after a few steps (pending tokens, rings).
  for (uint64_t step = 1; step <= 3; ++step) {
    ASSERT_OK(prefill.VerifyAll(step));
    std::vector<int> accepted(Scheduler::kRows);
    for (int& x : accepted) x = 1 + static_cast<int>(rng_() % Scheduler::kTokensPerRow);
    ASSERT_OK(prefill.session().Commit(prefill.Commit(step, accepted)).status());
  }
  v1::SaveBlocksRequest save;
  for (const auto& [block, key] : {std::pair<int, const char*>{2, "req-7/2"}, {3, "req-7/3"}}) {
    v1::SaveEntry* e = save.add_entries();
    e->set_block(block);
    e->set_key(key);
  }
  ASSERT_OK(prefill.session().SaveBlocks(save).status());
  ASSERT_OK(prefill.session().Flush(v1::FlushRequest()).status());
  const std::string expected = prefill.Pools();
  const v1::ExportPoolsResponse source_views = ValueOrDie(a->ExportPools());

  const v1::FetchSavedResponse fetched =
      ValueOrDie(b->FetchSaved(source_->address(), {"req-7/2", "req-7/3"}));
  const uint64_t entry = uint64_t(layers) * (prefill.layout().state_block_bytes() +
                                             prefill.layout().conv_block_bytes());
  EXPECT_EQ(fetched.bytes(), 2 * entry);
  v1::RestoreBlocksRequest restore;
  for (const auto& [key, block] : {std::pair<const char*, int>{"req-7/2", 4}, {"req-7/3", 9}}) {
    v1::RestoreEntry* r = restore.add_entries();
    r->set_key(key);
    r->set_block(block);
  }
  ASSERT_OK(decode.session().RestoreBlocks(restore).status());
  const std::string got = decode.Pools();
  const v1::ExportPoolsResponse views = ValueOrDie(b->ExportPools());
  EXPECT_EQ(BlockState(got, views, layers, 4), BlockState(expected, source_views, layers, 2));
  EXPECT_EQ(BlockState(got, views, layers, 9), BlockState(expected, source_views, layers, 3));
  // Both sides know.
  EXPECT_EQ(ValueOrDie(a->GetStats()).host_tier().sent(), 2u);
  EXPECT_EQ(ValueOrDie(b->GetStats()).host_tier().fetched(), 2u);
  EXPECT_EQ(ValueOrDie(b->ListSaved()).keys_size(), 2);
  // The source holds nothing for the transfer any more: its keys can be
  // saved again and dropped.
  ASSERT_OK(prefill.session().SaveBlocks(save).status());
  EXPECT_EQ(ValueOrDie(a->DropSaved({"req-7/2", "req-7/3"})).dropped(), 2);
}

TEST_P(TransferTest, BadFetchesAreRefusedAndHoldNothing) {
  source_ = Start();
  destination_ = Start();
  auto a = ValueOrDie(Client::Connect(source_->address()));
  auto b = ValueOrDie(Client::Connect(destination_->address()));
  Scheduler prefill(*a);
  v1::SaveBlocksRequest save;
  v1::SaveEntry* e = save.add_entries();
  e->set_block(1);
  e->set_key("k");
  ASSERT_OK(prefill.session().SaveBlocks(save).status());
  ExpectError(b->FetchSaved(source_->address(), {"k", "missing"}).status(),
              absl::StatusCode::kNotFound, "keys[1] \"missing\" is not saved");
  ExpectError(b->FetchSaved("unix:///tmp/specstate-no-such-service.sock", {"k"}).status(),
              absl::StatusCode::kUnavailable, "the source unix:///tmp/specstate-no-such-service");
  ExpectError(b->FetchSaved(source_->address(), {}).status(), absl::StatusCode::kInvalidArgument,
              "keys has 0 entries");
  ExpectError(b->FetchSaved("", {"k"}).status(), absl::StatusCode::kInvalidArgument,
              "source is empty");
  // Another layout: refused, the source's export released.
  std::unique_ptr<ServerProcess> other = Start({"--layers=2"});
  auto c = ValueOrDie(Client::Connect(other->address()));
  ExpectError(c->FetchSaved(source_->address(), {"k"}).status(),
              absl::StatusCode::kFailedPrecondition, "transfers need the same layout");
  EXPECT_EQ(ValueOrDie(b->ListSaved()).keys_size(), 0);
  EXPECT_EQ(ValueOrDie(c->ListSaved()).keys_size(), 0);
  EXPECT_EQ(ValueOrDie(a->GetStats()).host_tier().sent(), 0u);
  // Nothing holds "k" on the source: it can be dropped and saved again.
  EXPECT_EQ(ValueOrDie(a->DropSaved({"k"})).dropped(), 1);
  ASSERT_OK(prefill.session().SaveBlocks(save).status());
}

INSTANTIATE_TEST_SUITE_P(
    ModesAndTransports, TransferTest,
    ::testing::Combine(::testing::Values("eager", "deferred", "fast"),
                       ::testing::Values("tcp", "posix,self")),
    [](const ::testing::TestParamInfo<std::tuple<std::string, std::string>>& p) {
      std::string tls = std::get<1>(p.param) == "tcp" ? "tcp" : "shm";
      return std::get<0>(p.param) + "_" + tls;
    });

}  // namespace
}  // namespace specstate
