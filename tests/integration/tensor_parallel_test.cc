// Tensor parallelism on the CPU backend: one real specstated per rank, each
// holding its equal part of one model (here a 4-head model at TP=2: heads
// 0-1 and 2-3), driven by the simulator's TP mode (`specstatectl simulate
// --servers=...` and RunSimulation(ranks)). Every rank is checked bit for bit
// against its own stock path and, head by head, against the TP=1 run over
// all heads; and the ranks' pools against those of one TP=1 service that ran
// the same simulation.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/lib/client.h"
#include "client/lib/shared_memory.h"
#include "client/simulator/simulator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace {

using client::Client;
using client::SimulationOptions;
using client::SimulationReport;
using testing::ServerProcess;
using testing::ValueOrDie;
using ::testing::HasSubstr;
using ::testing::StartsWith;

class TensorParallelTest : public ::testing::Test {
 protected:
  // `ranks` services, each started with `flags` (a rank's part of the model)
  // and its own --device (ignored by the CPU backend; as under systemd).
  void StartRanks(int ranks, const std::vector<std::string>& flags) {
    for (int r = 0; r < ranks; ++r) {
      std::vector<std::string> f = {"--backend=cpu", absl::StrCat("--device=", r)};
      f.insert(f.end(), flags.begin(), flags.end());
      servers_.push_back(ValueOrDie(ServerProcess::Start(f)));
      addresses_.push_back(servers_.back()->address());
    }
    clients_ = ValueOrDie(client::ConnectRanks(addresses_));
  }
  std::vector<Client*> Ranks() const {
    std::vector<Client*> out;
    for (const auto& c : clients_) out.push_back(c.get());
    return out;
  }
  testing::ProcessResult Ctl(std::vector<std::string> args) const {
    std::vector<std::string> argv = {testing::RunfilePath("client/cli/specstatectl"),
                                     absl::StrCat("--servers=", absl::StrJoin(addresses_, ","))};
    argv.insert(argv.end(), args.begin(), args.end());
    return ValueOrDie(testing::RunProcess(argv));
  }
  void TearDown() override {
    if (!HasFailure()) return;
    for (size_t r = 0; r < servers_.size(); ++r) {
      std::fprintf(stderr, "rank %zu's server log:\n%s", r, servers_[r]->Log().c_str());
    }
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<Client>> clients_;
};

// A rank's part of a 4-head KDA model at TP=2.
const std::vector<std::string> kHalfOfFourHeads = {"--heads=2", "--conv_dim=384"};

TEST_F(TensorParallelTest, SpecstatectlSimulatesTwoRanksToAPass) {
  StartRanks(2, kHalfOfFourHeads);
  const testing::ProcessResult r = Ctl({"simulate", "--steps=8", "--requests=3"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tensor parallelism: TP=2, one service per rank"));
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("rank 1 at ", addresses_[1],
                                               " (CPU): heads 2-3 of 4, value heads 2-3 of 4, "
                                               "conv channels 384-767 of 768")));
  EXPECT_THAT(r.output, HasSubstr("verdict: PASS: "));
  EXPECT_THAT(r.output, HasSubstr("of the 2 ranks bit-identical to the stock path, and every "
                                  "head's committed state and output to the TP=1 run's ("));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("TP=1 run's (0 of the comparisons)")));
}

// KDA (both gates) and Gated DeltaNet, none and align mode, SYNC and ASYNC,
// SubmitStep and bound inputs, TP=2 and TP=4.
TEST_F(TensorParallelTest, EveryKindAndModePasses) {
  struct Case {
    std::string name;
    int ranks;
    std::vector<std::string> flags;
    bool async, batch, bound_inputs;
  };
  const std::vector<Case> cases = {
      {"kda sync", 2, kHalfOfFourHeads, false, false, false},
      {"kda plain gate, async, SubmitStep", 2,
       {"--heads=2", "--conv_dim=64", "--kda_gate=plain"}, true, true, false},
      {"gdn (2 value heads per key head)", 2,
       {"--kind=gdn", "--heads=1", "--value_heads=2", "--conv_dim=64"}, false, false, false},
      {"gdn align mode, async, bound inputs", 2,
       {"--kind=gdn", "--heads=1", "--value_heads=2", "--conv_dim=64", "--cache_mode=align",
        "--mamba_block_size=8", "--blocks=160"},
       true, false, true},
      {"kda align mode, fp32 activations", 2,
       {"--heads=2", "--conv_dim=64", "--cache_mode=align", "--mamba_block_size=8",
        "--blocks=160", "--activation_dtype=fp32"},
       false, false, false},
      {"kda TP=4", 4, {"--heads=1", "--conv_dim=64", "--layers=2"}, false, false, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    clients_.clear();
    servers_.clear();
    addresses_.clear();
    StartRanks(c.ranks, c.flags);
    SimulationOptions o;
    o.steps = 8;
    o.requests = 3;
    o.async = c.async;
    o.batch = c.batch;
    o.bound_inputs = c.bound_inputs;
    const SimulationReport r = ValueOrDie(client::RunSimulation(Ranks(), o));
    EXPECT_TRUE(r.passed()) << client::FormatReport(r);
    EXPECT_EQ(r.tensor_parallel, c.ranks);
    EXPECT_EQ(r.ranks.size(), static_cast<size_t>(c.ranks));
    EXPECT_GT(r.tp1_comparisons, 0u);
    EXPECT_EQ(r.tp1_mismatches, 0u);
    if (absl::StrContains(c.name, "align")) {
      EXPECT_GT(r.boundary_states, 0u);
    }
  }
}

// Every block of every layer of `tp1`'s pools, cut into the ranks' value
// heads (recurrent) and channels (conv), against the ranks' pools.
void ExpectPoolsAreTheRanks(Client& tp1, const std::vector<Client*>& ranks) {
  auto memory = ValueOrDie(client::SharedMemory::Create(v1::CPU));
  auto whole = ValueOrDie(memory->MapPools(ValueOrDie(tp1.ExportPools())));
  std::vector<std::unique_ptr<client::MappedPools>> parts;
  for (Client* r : ranks) parts.push_back(ValueOrDie(memory->MapPools(ValueOrDie(r->ExportPools()))));
  const int tp = static_cast<int>(ranks.size());
  int64_t blocks_compared = 0;
  for (const v1::PoolView& w : whole->description().pools()) {
    // [B, HV, V, K] or [B, D, W]: a block's rows (value heads or channels)
    // are split across the ranks; each row is dense.
    const int64_t elem = w.dtype() == v1::FP32 ? 4 : 2;
    const int64_t rows = w.shape(1) / tp;
    const int64_t row_elements = w.strides(1);
    for (int r = 0; r < tp; ++r) {
      const v1::PoolView* p = nullptr;
      for (const v1::PoolView& q : parts[r]->description().pools()) {
        if (q.layer() == w.layer() && q.kind() == w.kind()) p = &q;
      }
      ASSERT_NE(p, nullptr);
      ASSERT_EQ(p->shape(0), w.shape(0));
      ASSERT_EQ(p->shape(1), rows) << w.kind();
      ASSERT_EQ(p->strides(1), row_elements) << w.kind();
      for (int64_t b = 0; b < w.shape(0); ++b) {
        const char* want = whole->base() + w.offset_bytes() +
                           (b * w.strides(0) + r * rows * row_elements) * elem;
        const char* got = parts[r]->base() + p->offset_bytes() + b * p->strides(0) * elem;
        ASSERT_EQ(std::memcmp(got, want, rows * row_elements * elem), 0)
            << "rank " << r << ", layer " << w.layer() << ", " << w.kind() << " block " << b;
        ++blocks_compared;
      }
    }
  }
  EXPECT_GT(blocks_compared, 0);
}

// The ranks' services end up holding, byte for byte, what one TP=1 service
// holds after the same simulation (same seed: the same draws): each rank's
// pools are its value heads and channels of the TP=1 service's. A check of
// the services themselves, beside the simulator's TP=1 stock run.
TEST_F(TensorParallelTest, TheRanksPoolsAreATp1ServicesPoolsCutByHeads) {
  struct Case {
    std::string name;
    std::vector<std::string> rank_flags, tp1_flags;
    bool async;
  };
  const std::vector<std::string> align = {"--cache_mode=align", "--mamba_block_size=8",
                                          "--blocks=160"};
  std::vector<std::string> kda_rank = {"--heads=2", "--conv_dim=64"};
  std::vector<std::string> kda_tp1 = {"--heads=4", "--conv_dim=128"};
  kda_rank.insert(kda_rank.end(), align.begin(), align.end());
  kda_tp1.insert(kda_tp1.end(), align.begin(), align.end());
  const std::vector<Case> cases = {
      {"kda align mode, async", kda_rank, kda_tp1, true},
      {"gdn", {"--kind=gdn", "--heads=1", "--value_heads=2", "--conv_dim=64"},
       {"--kind=gdn", "--heads=2", "--value_heads=4", "--conv_dim=128"}, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    clients_.clear();
    servers_.clear();
    addresses_.clear();
    StartRanks(2, c.rank_flags);
    std::vector<std::string> tp1_flags = {"--backend=cpu"};
    tp1_flags.insert(tp1_flags.end(), c.tp1_flags.begin(), c.tp1_flags.end());
    auto tp1_server = ValueOrDie(ServerProcess::Start(tp1_flags));
    auto tp1 = ValueOrDie(Client::Connect(tp1_server->address()));
    SimulationOptions o;
    o.steps = 10;
    o.requests = 3;
    o.seed = 11;
    o.async = c.async;
    const SimulationReport tp = ValueOrDie(client::RunSimulation(Ranks(), o));
    ASSERT_TRUE(tp.passed()) << client::FormatReport(tp);
    const SimulationReport one = ValueOrDie(client::RunSimulation(*tp1, o));
    ASSERT_TRUE(one.passed()) << client::FormatReport(one);
    // The same steps (the TP run's counts are each rank's).
    EXPECT_EQ(one.tokens_verified, tp.tokens_verified);
    EXPECT_EQ(one.tokens_accepted, tp.tokens_accepted);
    EXPECT_EQ(one.requests_started, tp.requests_started);
    ExpectPoolsAreTheRanks(*tp1, Ranks());
  }
}

TEST_F(TensorParallelTest, MismatchedLayoutsAreRefusedNamingTheRankAndTheField) {
  StartRanks(1, kHalfOfFourHeads);
  std::vector<std::string> other = {"--backend=cpu", "--heads=3", "--conv_dim=384"};
  servers_.push_back(ValueOrDie(ServerProcess::Start(other)));
  addresses_.push_back(servers_.back()->address());
  const std::string expected =
      absl::StrCat("rank 1 (", addresses_[1], "): num_heads is 3, rank 0 (", addresses_[0],
                   ")'s is 2: under tensor parallelism every rank's service holds an equal part "
                   "of one model");
  const testing::ProcessResult r = Ctl({"simulate", "--steps=2"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("FAILED_PRECONDITION: ", expected)));
  testing::ExpectError(client::ConnectRanks(addresses_).status(),
                       absl::StatusCode::kFailedPrecondition, expected);
  // RunSimulation checks the layouts itself too.
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<Client*> ranks;
  for (const std::string& a : addresses_) {
    clients.push_back(ValueOrDie(Client::Connect(a)));
    ranks.push_back(clients.back().get());
  }
  testing::ExpectError(client::RunSimulation(ranks, SimulationOptions()).status(),
                       absl::StatusCode::kFailedPrecondition, expected);

  // Another field: num_spec.
  servers_.pop_back();
  addresses_.pop_back();
  servers_.push_back(
      ValueOrDie(ServerProcess::Start({"--backend=cpu", "--heads=2", "--conv_dim=384",
                                       "--num_spec=2"})));
  addresses_.push_back(servers_.back()->address());
  const testing::ProcessResult spec = Ctl({"simulate", "--steps=2"});
  EXPECT_EQ(spec.exit_code, 1) << spec.output;
  EXPECT_THAT(spec.output, HasSubstr("rank 1 (" + addresses_[1] + "): num_spec is 2, rank 0 ("));
}

TEST_F(TensorParallelTest, APlantedCorruptionInOneRankFailsTheVerdict) {
  StartRanks(2, kHalfOfFourHeads);
  const testing::ProcessResult r =
      Ctl({"simulate", "--steps=6", "--requests=3", "--corrupt_after_step=2", "--corrupt_rank=1"});
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_THAT(r.output, HasSubstr("verdict: FAIL: "));
  EXPECT_THAT(r.output, HasSubstr("; first: rank 1: step 3, "));
  // Both checks see it: the rank's own stock path and the TP=1 run.
  SimulationOptions o;
  o.steps = 6;
  o.requests = 3;
  o.corrupt_after_step = 2;
  o.corrupt_rank = 1;
  const SimulationReport report = ValueOrDie(client::RunSimulation(Ranks(), o));
  EXPECT_FALSE(report.passed());
  EXPECT_THAT(report.first_mismatch, StartsWith("rank 1: step 3, "));
  EXPECT_GT(report.tp1_mismatches, 0u);
  EXPECT_GT(report.mismatches, report.tp1_mismatches);
  EXPECT_THAT(client::FormatReport(report), HasSubstr("against the TP=1 run); first: rank 1:"));
}

TEST_F(TensorParallelTest, ARanksErrorNamesTheRank) {
  StartRanks(2, kHalfOfFourHeads);
  // Rank 1's driving seat is taken.
  auto driver = ValueOrDie(clients_[1]->OpenSession("another scheduler", /*drive=*/true));
  testing::ExpectError(client::RunSimulation(Ranks(), SimulationOptions()).status(),
                       absl::StatusCode::kFailedPrecondition,
                       absl::StrCat("rank 1 (", addresses_[1], "): "));
  ASSERT_OK(driver->Close());
  SimulationOptions crash;
  crash.crash_after_verify_step = 1;
  testing::ExpectError(client::RunSimulation(Ranks(), crash).status(),
                       absl::StatusCode::kInvalidArgument, "drive one service, not 2 ranks");
  SimulationOptions bad_rank;
  bad_rank.corrupt_after_step = 1;
  bad_rank.corrupt_rank = 2;
  testing::ExpectError(client::RunSimulation(Ranks(), bad_rank).status(),
                       absl::StatusCode::kInvalidArgument, "corrupt_rank = 2 is not a rank");
  // --servers is simulate's.
  const testing::ProcessResult layout = Ctl({"layout"});
  EXPECT_EQ(layout.exit_code, 2) << layout.output;
  EXPECT_THAT(layout.output, HasSubstr("--servers is for simulate"));
}

}  // namespace
}  // namespace specstate
