// Commit mode DEFERRED over a real socket (CPU backend): two specstated, one
// EAGER and one DEFERRED, get the same calls; the DEFERRED one's outputs are
// the EAGER one's bit for bit, and so is every pool byte once it is
// materialized: by the block's next Verify, by Flush, or when the driving
// session ends (ReadState shows its current state from a copy, changing no
// pool byte). Until then a pending block holds its checkpoint.
// Misuse the service can detect is refused, with the field and the rows.
#include <algorithm>
#include <cstring>
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
using testing::Scheduler;
using testing::ServerProcess;
using testing::ValueOrDie;

// The EAGER and the DEFERRED service side by side (mode_fixture.h);
// deferred_, deferred_client_ and deferred_server_ name the DEFERRED one.
class DeferredCommitTest : public testing::ModePairTest {
 protected:
  void SetUp() override {
    StartPair({"--commit_mode=eager"}, {"--commit_mode=deferred"}, "DEFERRED");
    deferred_server_ = mode_server_.get();
    deferred_client_ = mode_client_.get();
    deferred_ = mode_.get();
  }

  // A step on both services: every layer verified, outputs compared, then
  // committed with `accepted`.
  void Step(uint64_t step, std::vector<int> accepted) {
    for (int l = 0; l < eager_->layout().num_layers(); ++l) {
      ASSERT_NO_FATAL_FAILURE(VerifyLayerOnBoth(step, l));
      ASSERT_EQ(eager_->Outputs(), deferred_->Outputs())
          << "step " << step << ", layer " << l << ": DEFERRED's outputs differ from EAGER's";
    }
    ASSERT_TRUE(CommitOnBoth(step, accepted));
  }

  // Whether every block of every layer but `pending` holds the same bytes,
  // and the pending ones their state before the step (`before`).
  void ExpectPoolsAfterStep(const std::string& before, const std::vector<int>& pending) {
    const std::string eager = eager_->Pools(), deferred = deferred_->Pools();
    for (int l = 0; l < eager_->layout().num_layers(); ++l) {
      for (int b = 1; b < eager_->layout().num_blocks(); ++b) {
        const bool is_pending = std::find(pending.begin(), pending.end(), b) != pending.end();
        EXPECT_EQ(Block(deferred, l, b), Block(is_pending ? before : eager, l, b))
            << "layer " << l << ", block " << b << (is_pending ? " (pending)" : "");
      }
    }
  }

  ServerProcess* deferred_server_ = nullptr;
  Client* deferred_client_ = nullptr;
  Scheduler* deferred_ = nullptr;
};

TEST_F(DeferredCommitTest, TheLayoutSaysSo) {
  const v1::Layout eager = eager_->layout(), deferred = deferred_->layout();
  EXPECT_EQ(eager.commit_mode(), v1::EAGER);
  EXPECT_EQ(deferred.commit_mode(), v1::DEFERRED);
  EXPECT_EQ(deferred.record_bytes(), 2 * eager.record_bytes()) << "records are double-buffered";
  EXPECT_THAT(CtlLayout(), ::testing::HasSubstr("commit mode      DEFERRED"));
}

TEST_F(DeferredCommitTest, PendingBlocksHoldTheirCheckpointUntilMaterialized) {
  const std::string before = deferred_->Pools();
  ASSERT_EQ(before, eager_->Pools());
  Step(1, {1, 2, 0});  // rows 0 and 1 (blocks 1 and 2) commit, row 2 commits nothing
  ExpectPoolsAfterStep(before, {1, 2});
  // The next step's Verify calls materialize them, and outputs still agree.
  Step(2, {2, 2, 2});
  const std::string after_two = deferred_->Pools();
  // ReadState shows a pending block's current state (here block 3, layer
  // 1), replayed into a copy: the pool keeps every byte.
  const v1::ReadStateResponse eager_read = ValueOrDie(eager_client_->ReadState(1, 3, false));
  const v1::ReadStateResponse deferred_read = ValueOrDie(deferred_client_->ReadState(1, 3, false));
  EXPECT_EQ(deferred_read.recurrent().checksum(), eager_read.recurrent().checksum());
  EXPECT_EQ(deferred_->Pools(), after_two) << "ReadState changed a pool byte";
  // Flush of blocks 1 and 2 (3 is still pending).
  v1::FlushRequest flush;
  for (int b : {1, 2, 2, 0}) flush.mutable_blocks()->mutable_values()->add_values(b);
  ASSERT_TRUE(deferred_->session().Flush(flush).ok());
  for (int l = 0; l < 4; ++l) {
    for (int b : {1, 2}) {
      EXPECT_EQ(Block(deferred_->Pools(), l, b), Block(eager_->Pools(), l, b))
          << "layer " << l << ", block " << b << " after its Flush";
    }
  }
  // Flush of everything: every byte equal.
  ASSERT_TRUE(deferred_->session().Flush(v1::FlushRequest()).ok());
  EXPECT_EQ(deferred_->Pools(), eager_->Pools());
}

// Recover without kept pools counts the blocks with tokens pending too: the
// rows' checkpoint blocks that a Commit left pending, until a Flush
// materializes them; EAGER has none.
TEST_F(DeferredCommitTest, RecoverCountsPendingBlocksWithoutAKeeper) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int> accepted;
  for (int i = 0; i < Scheduler::kRows; ++i) accepted.push_back(rng() % 3);
  accepted[rng() % Scheduler::kRows] = 1 + rng() % 2;
  const int pending = static_cast<int>(
      std::count_if(accepted.begin(), accepted.end(), [](int a) { return a > 0; }));
  v1::RecoverResponse r = ValueOrDie(deferred_client_->Recover());
  EXPECT_FALSE(r.kept());
  EXPECT_EQ(r.pending_blocks(), 0);
  Step(1, accepted);
  r = ValueOrDie(deferred_client_->Recover());
  EXPECT_FALSE(r.kept());
  EXPECT_EQ(r.pending_blocks(), pending) << "accepted " << accepted[0] << "," << accepted[1]
                                         << "," << accepted[2];
  EXPECT_EQ(ValueOrDie(eager_client_->Recover()).pending_blocks(), 0);
  ASSERT_TRUE(deferred_->session().Flush(v1::FlushRequest()).ok());
  EXPECT_EQ(ValueOrDie(deferred_client_->Recover()).pending_blocks(), 0);
}

TEST_F(DeferredCommitTest, ManyStepsAgreeAndTheEndOfTheDriverMaterializesEverything) {
  for (uint64_t step = 1; step <= 30; ++step) {
    Step(step, {static_cast<int>(step % 3), 2, static_cast<int>((step + 1) % 3)});
    if (HasFatalFailure()) return;
  }
  EXPECT_NE(deferred_->Pools(), eager_->Pools()) << "the last commit left blocks pending";
  // The driving session ends: its service flushes every pending block.
  ASSERT_TRUE(deferred_->session().Close().ok());
  ASSERT_TRUE(deferred_client_->GetStats().ok());  // ordered after the flush
  bool equal = false;
  for (int i = 0; i < 100 && !equal; ++i) {
    equal = deferred_->Pools() == eager_->Pools();
    if (!equal) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(equal) << "the pools are not current after the driving session ended";
}

TEST_F(DeferredCommitTest, DiscardForgetsThePendingTokens) {
  const std::string before = deferred_->Pools();
  Step(1, {2, 2, 2});
  v1::FlushRequest discard;
  discard.mutable_blocks()->mutable_values()->add_values(2);
  discard.set_discard(true);
  ASSERT_TRUE(deferred_->session().Flush(discard).ok());
  ASSERT_TRUE(deferred_->session().Flush(v1::FlushRequest()).ok());
  const std::string after = deferred_->Pools();
  for (int l = 0; l < 4; ++l) {
    EXPECT_EQ(Block(after, l, 2), Block(before, l, 2)) << "block 2 got its discarded tokens";
    EXPECT_EQ(Block(after, l, 1), Block(eager_->Pools(), l, 1));
  }
}

TEST_F(DeferredCommitTest, MisuseIsRefusedAndChangesNothing) {
  Step(1, {2, 2, 2});
  const std::string pools = deferred_->Pools();
  // Two rows verifying from one pending block.
  v1::VerifyRequest shared = deferred_->Verify(2, 0);
  shared.mutable_state_indices()->mutable_values()->set_values(1, 1);
  ExpectError(deferred_->session().Verify(shared).status(), absl::StatusCode::kFailedPrecondition,
              "rows 0 and 1 both verify from block 1, which has tokens pending");
  EXPECT_EQ(deferred_->Pools(), pools);
  // A block list past the pool; a layer past the layout.
  v1::FlushRequest past;
  past.mutable_blocks()->mutable_values()->add_values(1);
  past.mutable_blocks()->mutable_values()->add_values(deferred_->layout().num_blocks());
  ExpectError(deferred_->session().Flush(past).status(), absl::StatusCode::kOutOfRange,
              absl::StrCat("In Flush: blocks[1] = ", deferred_->layout().num_blocks()));
  v1::FlushRequest layer;
  layer.set_layer(4);
  ExpectError(deferred_->session().Flush(layer).status(), absl::StatusCode::kOutOfRange,
              "layer 4 is out of range");
  EXPECT_EQ(deferred_->Pools(), pools);
  // Flush writes the pools: only the driving session may.
  std::unique_ptr<client::Session> reader =
      ValueOrDie(deferred_client_->OpenSession("reader", /*drive=*/false));
  ExpectError(reader->Flush(v1::FlushRequest()).status(), absl::StatusCode::kFailedPrecondition,
              "drive");
  EXPECT_EQ(deferred_->Pools(), pools);
  // Under EAGER a Flush has nothing to do, and says so by succeeding.
  EXPECT_TRUE(eager_->session().Flush(v1::FlushRequest()).ok());
}

// The simulator against DEFERRED services: every output, and every state
// where it is materialized (Verify, Flush, ReadState), bit for bit against
// its stock path; the blocks a Commit leaves pending hold their checkpoint.
class DeferredSimulationTest : public testing::ModeSimulationTest {
 protected:
  DeferredSimulationTest() : ModeSimulationTest("deferred", {"--blocks=200"}) {}
};

void ExpectDeferredPass(const client::SimulationReport& r) {
  EXPECT_TRUE(r.passed()) << client::FormatReport(r);
  EXPECT_TRUE(r.deferred);
  EXPECT_GT(r.pending_checked, 0u) << client::FormatReport(r);
  EXPECT_GT(r.materialized_by_verify, 0u) << client::FormatReport(r);
  EXPECT_GT(r.materialized_by_flush, 0u) << client::FormatReport(r);
}

TEST_F(DeferredSimulationTest, NoneModeSyncAndAsync) {
  client::SimulationOptions o;
  o.steps = 40;
  o.requests = 5;
  ExpectDeferredPass(Simulate({}, o));
  server_.reset();
  o.async = true;
  o.bound_inputs = true;
  ExpectDeferredPass(Simulate({"--state_dtype=bf16"}, o));
}

TEST_F(DeferredSimulationTest, AlignModeAcrossBlockBoundaries) {
  client::SimulationOptions o;
  o.steps = 40;
  o.requests = 4;
  const client::SimulationReport r =
      Simulate({"--cache_mode=align", "--mamba_block_size=4", "--state_dtype=bf16"}, o);
  ExpectDeferredPass(r);
  EXPECT_GT(r.boundary_states, 0u) << "no row crossed a block boundary";
}

TEST_F(DeferredSimulationTest, GatedDeltaNet) {
  client::SimulationOptions o;
  o.steps = 30;
  o.requests = 4;
  ExpectDeferredPass(Simulate({"--kind=gdn", "--heads=2", "--value_heads=4"}, o));
}

TEST_F(DeferredSimulationTest, APlantedCorruptionOfAPendingBlockFailsTheVerdict) {
  client::SimulationOptions o;
  o.steps = 8;
  o.requests = 3;
  o.corrupt_after_step = 3;
  const client::SimulationReport r = Simulate({}, o);
  EXPECT_FALSE(r.passed()) << client::FormatReport(r);
  EXPECT_GT(r.mismatches, 0u);
}

TEST_F(DeferredSimulationTest, TheModeIsChecked) {
  ExpectTheModeIsChecked({"--commit_mode=eager"},
                         "the service runs commit mode EAGER, not deferred");
}

}  // namespace
}  // namespace specstate
