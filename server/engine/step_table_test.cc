// The step protocol's bookkeeping against host memory: a step starts only
// when told, only the newest is open, Commit needs every layer verified and
// its records intact, failures and asynchronous errors are kept once, slots
// are reused only when their work is done, and a session's end refuses its
// waits. Step ids and row counts are drawn from the test's random seed.
#include "server/engine/step_table.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& substring) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(substring));
}

class StepTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_.seed(::testing::UnitTest::GetInstance()->random_seed());
    layers_ = std::uniform_int_distribution<int>(2, 6)(rng_);
    statuses_.resize(StepTable::kSlots * (layers_ + 2));
    std::vector<StepSlot> slots(StepTable::kSlots);
    for (int i = 0; i < StepTable::kSlots; ++i) {
      // The CPU backend's way: the host reads the device statuses directly.
      slots[i].status_device = slots[i].status_host = &statuses_[i * (layers_ + 2)];
    }
    table_ = std::make_unique<StepTable>(layers_, std::move(slots));
    first_id_ = std::uniform_int_distribution<uint64_t>(1, 1u << 30)(rng_);
  }

  // Starts step `id` of `session` with `rows` rows, as its first Verify does.
  Step* StartStep(const std::string& session, uint64_t id, int rows) {
    std::unique_ptr<Step> fresh;
    absl::StatusOr<Step*> step = table_->FindOrPrepare(session, id, rows, &fresh);
    EXPECT_TRUE(step.ok()) << step.status();
    EXPECT_NE(fresh, nullptr);
    return table_->Start(std::move(fresh));
  }

  void VerifyAll(Step& step) {
    for (int l = 0; l < layers_; ++l) table_->MarkVerified(step, l);
  }

  std::mt19937_64 rng_;
  int layers_ = 0;
  std::vector<kernels::DeviceStatus> statuses_;
  std::unique_ptr<StepTable> table_;
  uint64_t first_id_ = 0;
};

TEST_F(StepTableTest, APreparedStepIsNotStartedUntilStart) {
  std::unique_ptr<Step> fresh;
  absl::StatusOr<Step*> prepared = table_->FindOrPrepare("s1", first_id_, 3, &fresh);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  ASSERT_NE(fresh, nullptr);
  EXPECT_NE(fresh->generation, 0u);  // 0 means "no cancellation word"
  fresh.reset();                     // the call failed a later check
  EXPECT_EQ(table_->Find("s1", first_id_), nullptr);
  ExpectError(table_->FindCommittable("s1", first_id_).status(),
              absl::StatusCode::kFailedPrecondition, "was not verified");

  statuses_[0].failed = 1;  // a stale status of the slot's previous step
  Step* step = StartStep("s1", first_id_, 3);
  EXPECT_EQ(table_->Find("s1", first_id_), step);
  EXPECT_EQ(statuses_[0].failed, 0u);  // Start cleared the slot's statuses
  // Its later Verify calls find it, with the same row count only.
  std::unique_ptr<Step> none;
  absl::StatusOr<Step*> again = table_->FindOrPrepare("s1", first_id_, 3, &none);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, step);
  EXPECT_EQ(none, nullptr);
  ExpectError(table_->FindOrPrepare("s1", first_id_, 4, &none).status(),
              absl::StatusCode::kInvalidArgument, "num_rows = 4 differs from the 3 rows");
  // Steps are the session's: another driver's step of the same id is new.
  EXPECT_EQ(table_->Find("s2", first_id_), nullptr);
}

TEST_F(StepTableTest, OnlyTheNewestStepIsOpen) {
  Step* older = StartStep("s1", first_id_, 2);
  Step* newer = StartStep("s1", first_id_ + 1, 2);
  EXPECT_NE(older->slot, newer->slot);
  EXPECT_NE(older->generation, newer->generation);
  std::unique_ptr<Step> fresh;
  ExpectError(table_->FindOrPrepare("s1", first_id_, 2, &fresh).status(),
              absl::StatusCode::kFailedPrecondition,
              absl::StrCat("step ", first_id_, " has ended: step ", first_id_ + 1));
}

TEST_F(StepTableTest, CommitNeedsEveryLayerVerifiedAndItsRecords) {
  Step* step = StartStep("s1", first_id_, 4);
  const int skipped = std::uniform_int_distribution<int>(0, layers_ - 1)(rng_);
  for (int l = 0; l < layers_; ++l) {
    if (l != skipped) table_->MarkVerified(*step, l);
  }
  ExpectError(table_->FindCommittable("s1", first_id_).status(),
              absl::StatusCode::kFailedPrecondition,
              absl::StrCat("layers ", skipped, " were not verified in it"));
  table_->MarkVerified(*step, skipped);
  absl::StatusOr<Step*> committable = table_->FindCommittable("s1", first_id_);
  ASSERT_TRUE(committable.ok()) << committable.status();
  EXPECT_EQ(*committable, step);

  // A later step's Verify overwrites a layer's records: the older step can
  // no longer be committed.
  Step* later = StartStep("s1", first_id_ + 1, 4);
  table_->MarkVerified(*later, skipped);
  ExpectError(table_->FindCommittable("s1", first_id_).status(),
              absl::StatusCode::kFailedPrecondition,
              absl::StrCat("a later Verify overwrote the records of layers ", skipped));
}

TEST_F(StepTableTest, RecordStateBlocksNeedsACommit) {
  Step* step = StartStep("s1", first_id_, 1);
  VerifyAll(*step);
  ExpectError(table_->FindRecordable("s1", first_id_).status(),
              absl::StatusCode::kFailedPrecondition, "Commit before RecordStateBlocks");
  step->commit.started = true;
  EXPECT_TRUE(table_->FindRecordable("s1", first_id_).ok());
  std::unique_ptr<Step> fresh;
  ExpectError(table_->FindOrPrepare("s1", first_id_, 1, &fresh).status(),
              absl::StatusCode::kFailedPrecondition, "is already committed");
}

// The step committed before a restart (kept pools): its re-run is refused in
// any session with the in-instance refusal, and starts nothing; other ids go
// on.
TEST_F(StepTableTest, TheStepCommittedBeforeARestartIsRefusedAsWithinOneInstance) {
  Step* step = StartStep("s1", first_id_, 1);
  VerifyAll(*step);
  step->commit.started = true;
  std::unique_ptr<Step> fresh;
  const absl::Status within = table_->FindOrPrepare("s1", first_id_, 1, &fresh).status();
  ExpectError(within, absl::StatusCode::kFailedPrecondition,
              absl::StrCat("step ", first_id_, " is already committed"));
  // A new instance's table: only the kept last committed step is known.
  std::vector<StepSlot> slots(StepTable::kSlots);
  for (int i = 0; i < StepTable::kSlots; ++i) {
    slots[i].status_device = slots[i].status_host = &statuses_[i * (layers_ + 2)];
  }
  StepTable after(layers_, std::move(slots));
  after.SetCommittedBeforeRestart(first_id_);
  for (const std::string session : {"s1", "s2"}) {
    const absl::Status verify = after.FindOrPrepare(session, first_id_, 1, &fresh).status();
    EXPECT_EQ(verify.code(), within.code()) << verify;
    EXPECT_EQ(std::string(verify.message()), std::string(within.message()));
    EXPECT_EQ(fresh, nullptr) << "nothing prepared";
    const absl::Status commit = after.FindCommittable(session, first_id_).status();
    EXPECT_EQ(std::string(commit.message()), std::string(within.message())) << commit;
  }
  EXPECT_TRUE(after.FindOrPrepare("s2", first_id_ + 1, 1, &fresh).ok());
  EXPECT_NE(fresh, nullptr);
}

TEST_F(StepTableTest, FailuresAreKeptOnceAndAsyncErrorsReportedOnce) {
  Step* step = StartStep("s1", first_id_, 2);
  VerifyAll(*step);
  const absl::Status failure = absl::OutOfRangeError("state_indices[1] = 9000 is past the pool");
  EXPECT_TRUE(table_->MarkFailed(first_id_, "s1", failure, /*async=*/true));
  EXPECT_FALSE(table_->MarkFailed(first_id_, "s1", absl::InternalError("later"), true));
  ExpectError(table_->FindCommittable("s1", first_id_).status(),
              absl::StatusCode::kFailedPrecondition, "failed: state_indices[1] = 9000");
  std::unique_ptr<Step> fresh;
  ExpectError(table_->FindOrPrepare("s1", first_id_, 2, &fresh).status(),
              absl::StatusCode::kFailedPrecondition, "failed:");
  // The session hears of the first asynchronous failure once, with its code.
  ExpectError(table_->TakeSessionError("s1"), absl::StatusCode::kOutOfRange,
              "an earlier asynchronous call failed");
  EXPECT_TRUE(table_->TakeSessionError("s1").ok());
  EXPECT_TRUE(table_->TakeSessionError("s2").ok());
  // A synchronous failure was already answered: nothing is kept for later.
  Step* next = StartStep("s1", first_id_ + 1, 2);
  EXPECT_TRUE(table_->MarkFailed(next->id, "s1", failure, /*async=*/false));
  EXPECT_TRUE(table_->TakeSessionError("s1").ok());
}

TEST_F(StepTableTest, ASlotIsReusedOnlyWhenItsWorkIsDone) {
  std::vector<Step*> steps;
  for (int i = 0; i < StepTable::kSlots; ++i) {
    steps.push_back(StartStep("s1", first_id_ + i, 1));
    ++table_->slot(steps.back()->slot).in_flight;
  }
  std::unique_ptr<Step> fresh;
  ExpectError(table_->FindOrPrepare("s1", first_id_ + StepTable::kSlots, 1, &fresh).status(),
              absl::StatusCode::kUnavailable, "steps are still in flight");
  EXPECT_EQ(fresh, nullptr);
  --table_->slot(steps.front()->slot).in_flight;
  Step* reused = StartStep("s1", first_id_ + StepTable::kSlots, 1);
  EXPECT_EQ(reused->slot, steps.front()->slot);
  EXPECT_NE(reused->generation, steps.front()->generation);
}

TEST_F(StepTableTest, OldStepsAreForgotten) {
  for (int i = 0; i <= StepTable::kHistory; ++i) StartStep("s1", first_id_ + i, 1);
  EXPECT_EQ(table_->Find("s1", first_id_), nullptr);
  EXPECT_NE(table_->Find("s1", first_id_ + 1), nullptr);
}

TEST_F(StepTableTest, AnEndedSessionMayNotWait) {
  ExpectError(table_->WaitCancellationOf("s1").status(), absl::StatusCode::kFailedPrecondition,
              "the session has ended");
  table_->OpenSession("s1");
  absl::StatusOr<std::shared_ptr<WaitCancellation>> wait = table_->WaitCancellationOf("s1");
  ASSERT_TRUE(wait.ok());
  EXPECT_EQ(*table_->WaitCancellationOf("s1"), *wait);  // one per session
  StartStep("s1", first_id_, 1);
  table_->MarkFailed(first_id_, "s1", absl::InternalError("lost"), /*async=*/true);
  EXPECT_EQ(table_->EndSession("s1"), *wait);
  EXPECT_TRUE(table_->TakeSessionError("s1").ok());  // dropped with the session
  ExpectError(table_->WaitCancellationOf("s1").status(), absl::StatusCode::kFailedPrecondition,
              "nothing may wait on its doorbells");
  table_->OpenSession("s2");
  EXPECT_EQ(table_->EndSession("s2"), nullptr);  // it never waited
}

}  // namespace
}  // namespace server
}  // namespace specstate
