// Recovery on the CPU device with a real specstate-keeper: fresh pools are
// handed to the keeper and taken back by the next "instance" (a new Device
// and Recovery in this process) with every byte; an interrupted commit's
// blocks come back lost; another layout is refused naming the change, and
// discarded when told; the keeper's death is a health problem until a new
// keeper is up and holds the pools again.
#include "server/kept/recovery.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "keeper/keeper_client.h"
#include "server/config/config.h"
#include "server/device/device.h"
#include "server/kept/pool_header.h"

namespace specstate {
namespace server {
namespace {

using ::testing::HasSubstr;

std::string KeeperBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return srcdir != nullptr ? absl::StrCat(srcdir, "/specstate/keeper/specstate-keeper")
                           : "keeper/specstate-keeper";
}

class Keeper {
 public:
  explicit Keeper(std::string path) : path_(std::move(path)) { Start(); }
  ~Keeper() { Kill(SIGTERM); }
  void Start() {
    pid_ = fork();
    if (pid_ == 0) {
      execl(KeeperBinary().c_str(), "specstate-keeper", ("--socket=" + path_).c_str(), nullptr);
      _exit(127);
    }
    for (int i = 0; i < 300 && !keeper::KeeperClient::Connect(path_).ok(); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  void Kill(int signal) {
    if (pid_ <= 0) return;
    kill(pid_, signal);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  std::string path_;
  pid_t pid_ = -1;
};

class RecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/srXXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    options_.keeper = dir_ + "/keeper.sock";
    options_.keeper_wait = absl::Seconds(5);
    layout_ = DefaultServiceConfig().layout();
    layout_.set_num_layers(2);
    pool_bytes_ = ComputeLayoutSizes(layout_).pool_bytes;
  }
  void TearDown() override {
    unlink(options_.keeper.c_str());
    rmdir(dir_.c_str());
  }

  // One "instance": a device and its recovery.
  struct Instance {
    std::unique_ptr<Device> device;
    std::unique_ptr<Recovery> recovery;
    char* pools = nullptr;
  };
  absl::StatusOr<Instance> StartInstance(const v1::Layout& layout) {
    Instance i;
    absl::StatusOr<std::unique_ptr<Device>> d = CreateCpuDevice();
    if (!d.ok()) return d.status();
    i.device = *std::move(d);
    absl::StatusOr<std::unique_ptr<Recovery>> r =
        Recovery::Start(layout, *i.device, options_, absl::Now());
    if (!r.ok()) return r.status();
    i.recovery = *std::move(r);
    absl::StatusOr<void*> pools =
        i.device->AllocateExported(ComputeLayoutSizes(layout).pool_bytes);
    if (!pools.ok()) return pools.status();
    i.pools = static_cast<char*>(*pools);
    return i;
  }

  std::string dir_;
  RecoveryOptions options_;
  v1::Layout layout_;
  uint64_t pool_bytes_ = 0;
};

TEST_F(RecoveryTest, FreshPoolsGoToTheKeeperAndComeBackWithEveryByte) {
  Keeper keeper(options_.keeper);
  {
    absl::StatusOr<Instance> first = StartInstance(layout_);
    ASSERT_TRUE(first.ok()) << first.status();
    const v1::RecoverResponse r = first->recovery->Report();
    EXPECT_FALSE(r.kept());
    EXPECT_EQ(r.holder(), "keeper " + options_.keeper);
    EXPECT_EQ(r.pool_bytes(), pool_bytes_);
    EXPECT_GT(r.kept_bytes(), pool_bytes_);
    for (uint64_t i = 0; i < pool_bytes_; ++i) {
      ASSERT_EQ(first->pools[i], 0) << "fresh pools are zero at " << i;
      first->pools[i] = static_cast<char>(i * 7 + 3);
    }
    // A commit that started (blocks 4 and 6) and never finished, as the
    // kernels leave it when the process dies mid-commit.
    kernels::CommitJournal j = first->recovery->journal();
    j.entries[0] = 4;
    j.entries[1] = 0;
    j.entries[2] = 6;
    j.entries[3] = 0;
    j.record->num_rows = 2;
    j.record->step = 12;
    j.record->last_committed_step = 11;
    j.record->commits = 11;
    j.record->state = kernels::kJournalStarted;
    EXPECT_EQ(first->recovery->HealthProblem(), "");
  }  // the instance dies; only the keeper holds the pools
  absl::StatusOr<Instance> second = StartInstance(layout_);
  ASSERT_TRUE(second.ok()) << second.status();
  const v1::RecoverResponse r = second->recovery->Report();
  EXPECT_TRUE(r.kept());
  EXPECT_TRUE(r.interrupted());
  EXPECT_EQ(r.interrupted_step(), 12u);
  EXPECT_EQ(r.last_committed_step(), 11u);
  EXPECT_EQ(r.commits(), 11u);
  EXPECT_THAT(r.lost_blocks(), ::testing::ElementsAre(4, 6));
  EXPECT_EQ(r.restarts(), 1u);
  EXPECT_GT(r.previous_started_unix_s(), 0);
  for (uint64_t i = 0; i < pool_bytes_; ++i) {
    ASSERT_EQ(second->pools[i], static_cast<char>(i * 7 + 3)) << "byte " << i;
  }
  EXPECT_EQ(second->recovery->journal().record->state, kernels::kJournalIdle);
  // verify-pools: through the device's queue.
  v1::RecoverRequest verify;
  verify.set_verify(true);
  absl::Notification done;
  v1::RecoverResponse verified;
  second->recovery->Recover(verify, layout_, [&](absl::Status s, v1::RecoverResponse out) {
    EXPECT_TRUE(s.ok()) << s;
    verified = out;
    done.Notify();
  });
  done.WaitForNotification();
  EXPECT_TRUE(verified.verified());
  EXPECT_THAT(verified.inconsistent_blocks(), ::testing::ElementsAre(4, 6));
  EXPECT_TRUE(verified.kept());
}

TEST_F(RecoveryTest, AnotherLayoutIsRefusedUnlessDiscarding) {
  Keeper keeper(options_.keeper);
  {
    absl::StatusOr<Instance> first = StartInstance(layout_);
    ASSERT_TRUE(first.ok()) << first.status();
    first->pools[100] = 42;
  }
  v1::Layout bigger = layout_;
  bigger.set_num_blocks(layout_.num_blocks() * 2);
  absl::StatusOr<Instance> refused = StartInstance(bigger);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("num_blocks 64 -> 128"));
  // Refusing kept them: the old layout still finds them.
  {
    absl::StatusOr<Instance> same = StartInstance(layout_);
    ASSERT_TRUE(same.ok()) << same.status();
    EXPECT_TRUE(same->recovery->Report().kept());
    EXPECT_EQ(same->pools[100], 42);
  }
  options_.discard_kept_pools = true;
  {
    absl::StatusOr<Instance> fresh = StartInstance(bigger);
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    EXPECT_FALSE(fresh->recovery->Report().kept());
    EXPECT_EQ(fresh->pools[100], 0);
  }
  // The keeper now holds the new layout's pools.
  options_.discard_kept_pools = false;
  absl::StatusOr<Instance> again = StartInstance(bigger);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->recovery->Report().kept());
}

TEST_F(RecoveryTest, WithoutAKeeperItDoesNotStart) {
  options_.keeper_wait = absl::Milliseconds(300);
  absl::StatusOr<Instance> none = StartInstance(layout_);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("start specstate-keeper"));
}

TEST_F(RecoveryTest, TheKeepersDeathIsAHealthProblemUntilItIsBack) {
  auto keeper = std::make_unique<Keeper>(options_.keeper);
  absl::StatusOr<Instance> instance = StartInstance(layout_);
  ASSERT_TRUE(instance.ok()) << instance.status();
  instance->pools[7] = 9;
  keeper->Kill(SIGKILL);
  std::string problem;
  for (int i = 0; i < 100 && problem.empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    problem = instance->recovery->HealthProblem();
  }
  EXPECT_THAT(problem, HasSubstr("keeper on " + options_.keeper + " is gone"));
  EXPECT_THAT(problem, HasSubstr("would not survive a restart"));
  keeper = std::make_unique<Keeper>(options_.keeper);
  for (int i = 0; i < 100 && !problem.empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    problem = instance->recovery->HealthProblem();
  }
  EXPECT_EQ(problem, "");
  // The new keeper holds them: a next instance takes them back.
  instance->recovery.reset();
  instance->device.reset();
  absl::StatusOr<Instance> next = StartInstance(layout_);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->recovery->Report().kept());
  EXPECT_EQ(next->pools[7], 9);
}

// An entry as the kernels pack it (kernels/internal/checks.h, PackPending).
int32_t Pending(int32_t record_row, int32_t buffer, int32_t tokens) {
  return ((record_row + 1) << 6) | (buffer << 5) | tokens;
}

TEST_F(RecoveryTest, DeferredKeepsItsPendingTableAndRecordsAcrossInstances) {
  Keeper keeper(options_.keeper);
  v1::Layout deferred = layout_;
  deferred.set_commit_mode(v1::DEFERRED);
  absl::StatusOr<Instance> first = StartInstance(deferred);
  ASSERT_TRUE(first.ok()) << first.status();
  DeferredParts parts = first->recovery->kept_parts().deferred;
  ASSERT_NE(parts.pending.entries, nullptr);
  ASSERT_NE(parts.pending.journal, nullptr);
  ASSERT_EQ(parts.records.size(), 2u * deferred.num_layers());
  const int64_t B = deferred.num_blocks();
  // As a commit leaves them: records buffer 1, blocks 5 and 7 pending.
  parts.pending.header[0] = 1;
  parts.pending.header[1] = 2;
  parts.pending.header[2] = 5;
  parts.pending.header[3] = 7;
  parts.pending.entries[5] = Pending(0, 1, 3);          // layer 0
  parts.pending.entries[B + 5] = Pending(0, 1, 3);      // layer 1
  parts.pending.entries[B + 7] = Pending(1, 1, 2);      // layer 1 only (layer 0 taken)
  parts.records[3][100] = 42;                           // layer 1, buffer 1
  first->pools[7] = 9;
  const uint64_t kept_bytes = first->recovery->Report().kept_bytes();
  EXPECT_GT(kept_bytes, pool_bytes_ + 2 * deferred.num_layers() *
                                          ComputeLayoutSizes(deferred).records_per_layer_bytes);
  first->recovery.reset();
  first->device.reset();

  // A restart between calls: everything as it was.
  absl::StatusOr<Instance> second = StartInstance(deferred);
  ASSERT_TRUE(second.ok()) << second.status();
  v1::RecoverResponse report = second->recovery->Report();
  EXPECT_TRUE(report.kept());
  EXPECT_THAT(report.lost_blocks(), ::testing::IsEmpty());
  EXPECT_EQ(report.interrupted_call(), "");
  EXPECT_EQ(report.pending_blocks(), 2);
  parts = second->recovery->kept_parts().deferred;
  EXPECT_EQ(parts.pending.header[0], 1);
  EXPECT_EQ(parts.pending.header[1], 2);
  EXPECT_EQ(parts.pending.entries[B + 7], Pending(1, 1, 2));
  EXPECT_EQ(parts.records[3][100], 42);
  EXPECT_EQ(second->pools[7], 9);

  // A Verify of layer 0 killed while it materialized block 5: block 5 is
  // lost, its entries are gone in every layer, block 7 stays pending.
  parts.pending.journal_blocks[0] = 5;
  parts.pending.journal->kind = kernels::kPendingVerify;
  parts.pending.journal->layer = 0;
  parts.pending.journal->count = 1;
  parts.pending.journal->state = kernels::kJournalStarted;
  parts.pending.entries[5] = 0;  // taken
  second->recovery.reset();
  second->device.reset();
  absl::StatusOr<Instance> third = StartInstance(deferred);
  ASSERT_TRUE(third.ok()) << third.status();
  report = third->recovery->Report();
  EXPECT_THAT(report.lost_blocks(), ::testing::ElementsAre(5));
  EXPECT_EQ(report.interrupted_call(), "Verify of layer 0");
  EXPECT_EQ(report.pending_blocks(), 1);
  parts = third->recovery->kept_parts().deferred;
  EXPECT_EQ(parts.pending.journal->state, kernels::kJournalIdle);
  EXPECT_EQ(parts.pending.entries[B + 5], 0);
  EXPECT_EQ(parts.pending.entries[B + 7], Pending(1, 1, 2));
  EXPECT_EQ(parts.pending.header[1], 1);
  EXPECT_EQ(parts.pending.header[2], 7);
  EXPECT_EQ(parts.records[3][100], 42);
}

TEST_F(RecoveryTest, TheCommitModeOfKeptPoolsCannotChange) {
  Keeper keeper(options_.keeper);
  {
    absl::StatusOr<Instance> eager = StartInstance(layout_);
    ASSERT_TRUE(eager.ok()) << eager.status();
  }
  v1::Layout deferred = layout_;
  deferred.set_commit_mode(v1::DEFERRED);
  absl::StatusOr<Instance> refused = StartInstance(deferred);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("commit_mode EAGER -> DEFERRED"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("max_rows (not kept) -> "));
}

// commit_mode FAST: the rings, cursors and fold journal are kept with the
// pools; an interrupted fold or commit loses exactly its blocks (their rings
// emptied), an interrupted discard is finished, a cursor no call leaves
// loses its block, and a Verify's candidates are forgotten.
TEST_F(RecoveryTest, FastKeepsItsRingsAcrossInstances) {
  Keeper keeper(options_.keeper);
  v1::Layout fast = layout_;
  fast.set_commit_mode(v1::FAST);
  absl::StatusOr<Instance> first = StartInstance(fast);
  ASSERT_TRUE(first.ok()) << first.status();
  FastParts parts = first->recovery->kept_parts().fast;
  ASSERT_EQ(parts.rings.size(), size_t(fast.num_layers()));
  ASSERT_NE(parts.journal.record, nullptr);
  const int R = parts.rings[0].capacity;
  const int Q = fast.num_spec() + 1;
  ASSERT_GE(R - Q, 3);
  // As Commits and a Verify leave them: block 5 with tokens in both layers
  // (and candidates in layer 0), block 7 in layer 1 only, block 11 too.
  parts.rings[0].cursors[5] = kernels::FastCursor{2, Q, 0};
  parts.rings[1].cursors[5] = kernels::FastCursor{2, 0, 0};
  parts.rings[1].cursors[7] = kernels::FastCursor{3, 0, 0};
  parts.rings[0].cursors[11] = kernels::FastCursor{1, 0, 0};
  parts.rings[1].u[100] = 1.5f;
  first->pools[7] = 9;
  first->recovery.reset();
  first->device.reset();

  // A restart between calls: the rings as they were, the candidates gone.
  absl::StatusOr<Instance> second = StartInstance(fast);
  ASSERT_TRUE(second.ok()) << second.status();
  v1::RecoverResponse report = second->recovery->Report();
  EXPECT_TRUE(report.kept());
  EXPECT_THAT(report.lost_blocks(), ::testing::IsEmpty());
  EXPECT_EQ(report.pending_blocks(), 3);
  parts = second->recovery->kept_parts().fast;
  EXPECT_EQ(parts.rings[0].cursors[5].tokens, 2);
  EXPECT_EQ(parts.rings[0].cursors[5].candidates, 0);
  EXPECT_EQ(parts.rings[1].cursors[7].tokens, 3);
  EXPECT_EQ(parts.rings[1].u[100], 1.5f);
  EXPECT_EQ(second->pools[7], 9);

  // A Flush killed mid-fold of block 5, a Commit killed writing block 11,
  // and block 9's cursor no call leaves: all three lost, their rings
  // emptied in every layer; block 7 stays.
  parts.journal.blocks[0] = 5;
  parts.journal.record->kind = kernels::kPendingFlush;
  parts.journal.record->layer = -1;
  parts.journal.record->count = 1;
  parts.journal.record->state = kernels::kJournalStarted;
  parts.rings[1].cursors[9] = kernels::FastCursor{R, 0, 0};
  kernels::CommitJournal commit = second->recovery->journal();
  commit.entries[0] = 11;
  commit.entries[1] = kernels::kNullBlock;
  commit.record->num_rows = 1;
  commit.record->step = 77;
  commit.record->state = kernels::kJournalStarted;
  second->recovery.reset();
  second->device.reset();
  absl::StatusOr<Instance> third = StartInstance(fast);
  ASSERT_TRUE(third.ok()) << third.status();
  report = third->recovery->Report();
  EXPECT_THAT(report.lost_blocks(), ::testing::ElementsAre(5, 9, 11));
  EXPECT_EQ(report.interrupted_call(), "Flush");
  EXPECT_TRUE(report.interrupted());
  EXPECT_EQ(report.interrupted_step(), 77u);
  EXPECT_EQ(report.pending_blocks(), 1);
  parts = third->recovery->kept_parts().fast;
  EXPECT_EQ(parts.journal.record->state, kernels::kJournalIdle);
  for (int l = 0; l < fast.num_layers(); ++l) {
    for (int32_t b : {5, 9, 11}) {
      EXPECT_EQ(parts.rings[l].cursors[b].tokens, 0) << "layer " << l << " block " << b;
    }
  }
  EXPECT_EQ(parts.rings[1].cursors[7].tokens, 3);

  // A discard of block 7 killed: finished (its rings empty), not lost.
  parts.journal.blocks[0] = 7;
  parts.journal.record->kind = kernels::kPendingDiscard;
  parts.journal.record->count = 1;
  parts.journal.record->state = kernels::kJournalStarted;
  third->recovery.reset();
  third->device.reset();
  absl::StatusOr<Instance> fourth = StartInstance(fast);
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  report = fourth->recovery->Report();
  EXPECT_THAT(report.lost_blocks(), ::testing::ElementsAre(5, 9, 11));
  EXPECT_EQ(report.interrupted_call(), "Flush (discard)");
  EXPECT_EQ(report.pending_blocks(), 0);
  EXPECT_EQ(fourth->recovery->kept_parts().fast.rings[1].cursors[7].tokens, 0);
  EXPECT_EQ(fourth->pools[7], 9);
}

// The rings' meaning depends on fold_every: a change is refused, named.
TEST_F(RecoveryTest, TheFoldEveryOfKeptRingsCannotChange) {
  Keeper keeper(options_.keeper);
  v1::Layout fast = layout_;
  fast.set_commit_mode(v1::FAST);
  fast.set_fold_every(4);
  {
    absl::StatusOr<Instance> first = StartInstance(fast);
    ASSERT_TRUE(first.ok()) << first.status();
  }
  fast.set_fold_every(2);
  absl::StatusOr<Instance> refused = StartInstance(fast);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("fold_every 4 -> 2"));
}

TEST_F(RecoveryTest, DescriptorsThatAreNotSpecstatedsAreRefused) {
  Keeper keeper(options_.keeper);
  auto client = keeper::KeeperClient::Connect(options_.keeper);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Put("something else", {0}).ok());
  absl::StatusOr<Instance> refused = StartInstance(layout_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("not specstated's"));
}

}  // namespace
}  // namespace server
}  // namespace specstate
