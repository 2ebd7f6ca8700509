// The simulator's transfer phase (SimulationOptions::transfer_every) against
// two real specstated processes (CPU backend), in every commit mode and over
// UCX's TCP and shared-memory transports: every few steps a live request's
// block is saved on the simulated service, fetched by the peer (FetchSaved),
// restored into a block of the peer's and saved there, fetched back after
// the block was overwritten, and restored; the decode goes on from it with
// every state still checked (FAST: by its contract). A bit flipped in the
// peer's block between its restore and its save fails the verdict, on the
// peer and once the block is back; bad options and services are refused
// naming the field; specstatectl simulate --transfer_every runs it too.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "client/simulator/simulator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using testing::ExpectError;
using testing::ServerProcess;
using testing::ValueOrDie;

// Two services of one layout (the simulated one and its peer), each with a
// host tier, and the simulations run on them.
class TwoServices {
 protected:
  // Both services' logs, after the seed, when the test failed.
  void PrintOnFailure(bool failed) const {
    if (!failed) return;
    std::fprintf(stderr, "seed %llu\n", static_cast<unsigned long long>(seed_));
    for (const auto& s : {service_.get(), peer_.get()}) {
      if (s != nullptr) std::fprintf(stderr, "server log:\n%s\n", s->Log().c_str());
    }
  }

  // Starts both with `flags` (and a host tier of 64 MiB) and connects.
  void StartBoth(const std::vector<std::string>& flags) {
    std::vector<std::string> all = {"--backend=cpu", "--host_tier_bytes=64MiB"};
    all.insert(all.end(), flags.begin(), flags.end());
    service_ = ValueOrDie(ServerProcess::Start(all));
    peer_ = ValueOrDie(ServerProcess::Start(all));
    client_ = ValueOrDie(Client::Connect(service_->address()));
  }

  client::SimulationOptions Options(int steps, int every) const {
    client::SimulationOptions o;
    o.steps = steps;
    o.requests = 4;
    o.seed = seed_;
    o.transfer_every = every;
    o.transfer_peer = peer_->address();
    return o;
  }

  uint64_t seed_ = std::random_device()();
  std::unique_ptr<ServerProcess> service_, peer_;
  std::unique_ptr<Client> client_;
};

// (commit mode, UCX_TLS)
class TransferSimulationTest
    : public ::testing::TestWithParam<std::tuple<std::string, std::string>>,
      public TwoServices {
 protected:
  void SetUp() override {
    // Both services (children of this process) use only these transports.
    setenv("UCX_TLS", std::get<1>(GetParam()).c_str(), 1);
  }
  void TearDown() override { PrintOnFailure(HasFailure()); }

  const std::string& mode() const { return std::get<0>(GetParam()); }
  void Start(std::vector<std::string> flags) {
    flags.push_back("--commit_mode=" + mode());
    if (mode() == "fast") flags.push_back("--fold_every=2");
    StartBoth(flags);
  }
  client::SimulationOptions ModeOptions(int steps, int every) const {
    client::SimulationOptions o = Options(steps, every);
    o.commit_mode = mode();
    return o;
  }
};

// The decode loop (none and align mode; align with the host-tier phase
// too) with a block moved to the peer and back every 3 steps: every state
// and output as the stock path's (FAST: within its contract), every moved
// block checked on the peer and when back.
TEST_P(TransferSimulationTest, TheSimulatorMovesBlocksToAPeerAndBackMidRun) {
  for (const std::string cache_mode : {"none", "align"}) {
    SCOPED_TRACE(cache_mode);
    std::vector<std::string> flags = {"--cache_mode=" + cache_mode, "--blocks=200"};
    if (cache_mode == "align") flags.push_back("--mamba_block_size=8");
    Start(flags);
    client::SimulationOptions o = ModeOptions(30, 3);
    if (cache_mode == "align") o.host_tier_every = 4;
    const absl::StatusOr<client::SimulationReport> r = client::RunSimulation(*client_, o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->passed()) << client::FormatReport(*r);
    EXPECT_GE(r->transfer_round_trips, 8u) << client::FormatReport(*r);
    if (cache_mode == "align") {
      EXPECT_GE(r->host_tier_round_trips, 5u);
    }
    EXPECT_THAT(client::FormatReport(*r),
                ::testing::HasSubstr(absl::StrCat("transfers: ", r->transfer_round_trips,
                                                  " blocks moved to the peer service and back")));
    // The bytes really moved both ways, and no key is left on either side.
    auto peer = ValueOrDie(Client::Connect(peer_->address()));
    const v1::Stats ours = ValueOrDie(client_->GetStats()), theirs = ValueOrDie(peer->GetStats());
    EXPECT_EQ(ours.host_tier().sent(), r->transfer_round_trips);
    EXPECT_EQ(ours.host_tier().fetched(), r->transfer_round_trips);
    EXPECT_EQ(theirs.host_tier().sent(), r->transfer_round_trips);
    EXPECT_EQ(theirs.host_tier().fetched(), r->transfer_round_trips);
    EXPECT_EQ(ValueOrDie(peer->ListSaved()).keys_size(), 0);
    int ours_left = 0;
    const v1::ListSavedResponse saved = ValueOrDie(client_->ListSaved());
    for (const auto& k : saved.keys()) {
      if (absl::StartsWith(k.key(), "sim-transfer-")) ++ours_left;
    }
    EXPECT_EQ(ours_left, 0);
    peer.reset();
    client_.reset();
    service_.reset();
    peer_.reset();
  }
}

// A bit flipped in the peer's block between its restore and its save (at
// the last step's transfer, so nothing after it can be what fails): the
// peer's bytes differ from the ones saved, and so does the block once back
// (FAST: its whole state flipped, out of the contract).
TEST_P(TransferSimulationTest, ABlockCorruptedOnThePeerFailsTheVerdict) {
  Start({"--blocks=200"});
  client::SimulationOptions o = ModeOptions(6, 3);
  o.corrupt_transfer_at_step = 5;
  const absl::StatusOr<client::SimulationReport> r = client::RunSimulation(*client_, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->passed()) << client::FormatReport(*r);
  EXPECT_EQ(r->transfer_round_trips, 2u) << client::FormatReport(*r);
  EXPECT_GE(r->mismatches, 2u) << client::FormatReport(*r);
  EXPECT_THAT(r->first_mismatch,
              ::testing::HasSubstr(absl::StrCat("step 5, layer 0, the transfer peer's (",
                                                peer_->address(), ") block")));
  EXPECT_THAT(r->first_mismatch, ::testing::HasSubstr("differs from the one saved"));
  EXPECT_THAT(client::FormatReport(*r), ::testing::HasSubstr("verdict: FAIL"));
}

INSTANTIATE_TEST_SUITE_P(
    ModesAndTransports, TransferSimulationTest,
    ::testing::Values(std::make_tuple("eager", "tcp"), std::make_tuple("deferred", "tcp"),
                      std::make_tuple("fast", "tcp"), std::make_tuple("deferred", "posix,self")),
    [](const ::testing::TestParamInfo<std::tuple<std::string, std::string>>& p) {
      std::string tls = std::get<1>(p.param) == "tcp" ? "tcp" : "shm";
      return std::get<0>(p.param) + "_" + tls;
    });

class TransferOptionsTest : public ::testing::Test, public TwoServices {
 protected:
  void SetUp() override { setenv("UCX_TLS", "tcp", 1); }
  void TearDown() override { PrintOnFailure(HasFailure()); }
};

TEST_F(TransferOptionsTest, BadOptionsAndServicesAreRefusedNamingTheField) {
  StartBoth({});
  const auto refused = [&](const client::SimulationOptions& o, absl::StatusCode code,
                           const std::string& message) {
    ExpectError(client::RunSimulation(*client_, o).status(), code, message);
  };
  client::SimulationOptions o = Options(3, 1);
  o.transfer_peer.clear();
  refused(o, absl::StatusCode::kInvalidArgument, "transfer_every = 1 needs transfer_peer");
  o = Options(3, 0);
  refused(o, absl::StatusCode::kInvalidArgument, "transfer_peer is " + peer_->address() +
                                                     " but transfer_every is 0");
  o = Options(3, -2);
  refused(o, absl::StatusCode::kInvalidArgument, "transfer_every = -2 must be >= 0");
  o = Options(3, 1);
  o.transfer_peer = service_->address();
  refused(o, absl::StatusCode::kInvalidArgument,
          "transfer_peer is the simulated service's own address");
  o = Options(3, 0);
  o.transfer_peer.clear();
  o.corrupt_transfer_at_step = 1;
  refused(o, absl::StatusCode::kInvalidArgument, "corrupt_transfer_at_step = 1");
  // Tensor parallelism.
  auto peer = ValueOrDie(Client::Connect(peer_->address()));
  ExpectError(client::RunSimulation({client_.get(), peer.get()}, Options(3, 1)).status(),
              absl::StatusCode::kInvalidArgument,
              "transfer_every (transfer_peer) moves blocks between one service and its peer, not "
              "2 ranks");
  // A peer of another layout, a peer or a service without a host tier.
  std::unique_ptr<ServerProcess> other =
      ValueOrDie(ServerProcess::Start({"--backend=cpu", "--host_tier_bytes=64MiB", "--layers=2"}));
  o = Options(3, 1);
  o.transfer_peer = other->address();
  refused(o, absl::StatusCode::kFailedPrecondition,
          "transfer_peer " + other->address() + ": its layout's num_layers is 2");
  std::unique_ptr<ServerProcess> no_tier = ValueOrDie(ServerProcess::Start({"--backend=cpu"}));
  o.transfer_peer = no_tier->address();
  refused(o, absl::StatusCode::kFailedPrecondition,
          "transfer_peer " + no_tier->address() + " has no host tier");
  auto untiered = ValueOrDie(Client::Connect(no_tier->address()));
  o = Options(3, 1);
  ExpectError(client::RunSimulation(*untiered, o).status(), absl::StatusCode::kFailedPrecondition,
              "the simulated service " + no_tier->address() + " has no host tier");
  // Nothing was left driving the peer: a simulation with it runs.
  const absl::StatusOr<client::SimulationReport> r = client::RunSimulation(*client_, Options(3, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->passed()) << client::FormatReport(*r);
  EXPECT_EQ(r->transfer_round_trips, 3u);
}

// What an operator runs: specstatectl simulate --transfer_every; its
// refusals of a peer without --transfer_every and of a restart drill (whose
// restarts would lose the host tier's copies).
TEST_F(TransferOptionsTest, SpecstatectlSimulateMovesBlocks) {
  StartBoth({});
  const std::string ctl = testing::RunfilePath("client/cli/specstatectl");
  const testing::ProcessResult run = ValueOrDie(testing::RunProcess(
      {ctl, "--server=" + service_->address(), "simulate", "--steps=9", "--requests=3",
       absl::StrCat("--seed=", seed_), "--transfer_every=3",
       "--transfer_peer=" + peer_->address()}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, ::testing::HasSubstr("transfers: 3 blocks moved to the peer service"));
  EXPECT_THAT(run.output, ::testing::HasSubstr("verdict: PASS"));
  const testing::ProcessResult refused = ValueOrDie(testing::RunProcess(
      {ctl, "--server=" + service_->address(), "simulate", "--steps=3",
       "--transfer_peer=" + peer_->address()}));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, ::testing::HasSubstr("INVALID_ARGUMENT: transfer_peer is "));
  const testing::ProcessResult drill = ValueOrDie(testing::RunProcess(
      {ctl, "simulate", "--restart_every=2", "--steps=3", "--transfer_every=1",
       "--transfer_peer=" + peer_->address(),
       "--specstated=" + testing::RunfilePath("server/specstated"),
       "--keeper_binary=" + testing::RunfilePath("keeper/specstate-keeper")}));
  EXPECT_EQ(drill.exit_code, 1) << drill.output;
  EXPECT_THAT(drill.output,
              ::testing::HasSubstr("INVALID_ARGUMENT: transfer_every with a restart drill"));
}

}  // namespace
}  // namespace specstate
