// specstated restarts without losing a committed state (issue 24), on the
// CPU backend, with real processes: a specstate-keeper holding the pools and
// a specstated killed by SIGKILL.
//
// - The drill: 200 decode steps of the simulator (its own stock path checks
//   every output, committed state and conv window bit for bit) while
//   specstated is killed about every 7 steps, in turn between calls, inside a
//   Verify and at every phase of a Commit, and started again. After each
//   restart the simulator checks what was kept: a finished Commit kept, an
//   interrupted Commit's blocks (and only those) reported lost, every other
//   pool byte unchanged, the step in flight refused naming it; it re-prefills
//   the lost blocks and re-runs the step. Align mode too, shorter.
// - A step in flight: UNAVAILABLE, then FAILED_PRECONDITION naming it.
// - A layout change across a restart is refused with the changed field, and
//   discarded when told (--discard_kept_pools).
// - A second specstated on a live one's keeper is refused at start, naming
//   its pid; the next one after the first's death takes the pools over.
// - The keeper's death with specstated alive: NOT_SERVING with the reason,
//   SERVING again once a keeper is back (and holds the pools).
// - systemd's file-descriptor store (a fake notification socket): FDSTORE=1
//   with the descriptors, READY=1; the next instance gets them back as
//   LISTEN_FDS and keeps every byte.
// - The same drill in commit modes DEFERRED (pending tokens kept) and FAST
//   (rings kept; states by FAST's contract).
// - specstatectl verify-pools and simulate --restart_every, as a user runs them.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/lib/client.h"
#include "client/simulator/restart_drill.h"
#include "client/simulator/simulator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "keeper/fd_passing.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_scheduler.h"

namespace specstate {
namespace testing {
namespace {

using client::OwnService;
using client::OwnServiceOptions;
using client::RestartDrill;
using ::testing::HasSubstr;

OwnServiceOptions Own(std::vector<std::string> flags = {}) {
  OwnServiceOptions o;
  o.specstated = RunfilePath("server/specstated");
  o.keeper = RunfilePath("keeper/specstate-keeper");
  o.flags = std::move(flags);
  return o;
}

std::unique_ptr<OwnService> StartOwn(std::vector<std::string> flags = {}) {
  absl::StatusOr<std::unique_ptr<OwnService>> s = OwnService::Start(Own(std::move(flags)));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// Runs the simulator under a drill and expects a PASS with every kind of kill.
void RunDrill(const std::vector<std::string>& flags, int steps, int every, uint64_t seed,
              int min_restarts) {
  std::unique_ptr<OwnService> service = StartOwn(flags);
  ASSERT_NE(service, nullptr);
  auto c = ValueOrDie(Client::Connect(service->address()));
  const v1::Layout layout = ValueOrDie(c->GetLayout());
  RestartDrill drill(service.get(), every, seed, layout);
  client::SimulationOptions options;
  options.steps = steps;
  options.requests = 4;
  options.seed = seed;
  options.drill = &drill;
  absl::StatusOr<client::SimulationReport> report = client::RunSimulation(*c, options);
  ASSERT_TRUE(report.ok()) << report.status() << "\n" << service->Log();
  EXPECT_TRUE(report->passed()) << client::FormatReport(*report);
  EXPECT_GE(report->restarts, min_restarts) << report->restart_summary;
  EXPECT_EQ(static_cast<int>(drill.kills().size()), drill.kinds())
      << "every kind of kill: " << report->restart_summary;
  EXPECT_GT(report->lost_blocks, 0u) << "interrupted commits lose their blocks";
  EXPECT_GT(report->steps_rerun, 0u);
  std::printf("%s", client::FormatReport(*report).c_str());
}

// A small layout: the drill compares every pool byte around every restart.
TEST(RestartTest, ADecodeLoopKeepsEveryCommittedStateAcrossKills) {
  RunDrill({"--layers=3", "--heads=2", "--conv_dim=128", "--blocks=32"}, 200, 7, 11, 25);
}

// commit_mode DEFERRED: pending tokens (the pending table and both records
// buffers) survive kills between calls, inside a Verify and its replay of
// pending blocks, at every phase of a Commit and inside a Flush (a
// ReadState, which replays into a copy, changes nothing a kill could lose);
// every state the service materializes is the stock path's.
TEST(RestartTest, DeferredCommitsKeepTheirPendingTokensAcrossKills) {
  RunDrill({"--commit_mode=deferred", "--layers=3", "--heads=2", "--conv_dim=128",
            "--blocks=32"},
           200, 5, 13, 30);
}

TEST(RestartTest, DeferredAlignModeKeepsItsStatesAcrossKills) {
  RunDrill({"--commit_mode=deferred", "--cache_mode=align", "--mamba_block_size=4",
            "--blocks=200", "--layers=2", "--heads=2", "--conv_dim=128"},
           40, 3, 29, 10);
}

// commit_mode FAST: the rings (accepted tokens not yet folded), cursors and
// fold journal survive kills between calls, inside a Verify, at every phase
// of a Commit (its folds layer by layer) and inside a Flush's fold; a block
// an interrupted call was folding is reported lost and re-prefilled, and
// every state the service materializes stays within FAST's contract.
TEST(RestartTest, FastCommitsKeepTheirRingsAcrossKills) {
  RunDrill({"--commit_mode=fast", "--fold_every=2", "--layers=3", "--heads=2", "--conv_dim=128",
            "--blocks=32"},
           160, 5, 17, 25);
}

TEST(RestartTest, FastAlignModeKeepsItsStatesAcrossKills) {
  RunDrill({"--commit_mode=fast", "--cache_mode=align", "--mamba_block_size=4", "--blocks=200",
            "--layers=2", "--heads=2", "--conv_dim=128"},
           40, 3, 31, 10);
}

TEST(RestartTest, AlignModeKeepsItsBoundaryStatesAcrossKills) {
  RunDrill({"--cache_mode=align", "--mamba_block_size=4", "--blocks=200", "--layers=2",
            "--heads=2", "--conv_dim=128"},
           40, 3, 23, 10);
}

// The C++ client's view: UNAVAILABLE while it is down, then after Resume the
// step in flight is FAILED_PRECONDITION naming it; a new step goes on from
// the kept states.
TEST(RestartTest, AStepInFlightIsRefusedNamingItAfterTheRestart) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  auto c = ValueOrDie(Client::Connect(service->address()));
  Scheduler s(*c);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const std::string committed = s.Pools();
  ASSERT_OK(s.VerifyAll(2));
  const std::string old_id = s.session().id();
  service->Kill();
  absl::Status down = s.session().Commit(s.Commit(2)).status();
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable) << down;
  ASSERT_OK(service->Launch());
  v1::RecoverResponse kept = ValueOrDie(s.session().Resume(absl::Seconds(20)));
  EXPECT_TRUE(kept.kept());
  EXPECT_EQ(kept.last_committed_step(), 1u);
  EXPECT_EQ(kept.commits(), 1u);
  EXPECT_FALSE(kept.interrupted());
  EXPECT_THAT(kept.lost_blocks(), ::testing::IsEmpty());
  EXPECT_EQ(kept.restarts(), 1u);
  EXPECT_EQ(kept.holder(), "keeper " + service->keeper_socket());
  EXPECT_GT(kept.pool_bytes(), 0u);
  EXPECT_NE(s.session().id(), old_id);
  EXPECT_EQ(s.Pools(), committed) << "the pools as the last commit left them";
  EXPECT_THAT(s.session().lost_steps(), ::testing::ElementsAre(2u));
  ExpectError(s.session().Commit(s.Commit(2)).status(), absl::StatusCode::kFailedPrecondition,
              "step 2 was in flight when specstated restarted (the last committed step is 1)");
  ExpectError(s.session().Verify(s.Verify(2, 0)).status(), absl::StatusCode::kFailedPrecondition,
              "step 2 was in flight");
  // A new step id goes on: the regions and the layer parameters are back.
  ASSERT_OK(s.VerifyAll(3));
  ASSERT_OK(s.session().Commit(s.Commit(3)).status());
  EXPECT_NE(s.Pools(), committed);
  EXPECT_EQ(ValueOrDie(c->Recover()).last_committed_step(), 3u);
}

// A RestoreBlocks (the host tier) dies after writing one layer of its
// block: after the restart that block, and only it, is reported lost; a
// restore that finishes clears it.
TEST(RestartTest, AnInterruptedRestoreReportsItsBlockLost) {
  std::unique_ptr<OwnService> service = StartOwn({"--host_tier_bytes=64MiB"});
  ASSERT_NE(service, nullptr);
  service->Kill();
  ASSERT_OK(service->Launch({"--test_crash_at=restore:layer:1"}));
  auto c = ValueOrDie(Client::Connect(service->address()));
  Scheduler s(*c);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  v1::SaveBlocksRequest save;
  v1::SaveEntry* e = save.add_entries();
  e->set_block(2);
  e->set_key("prefix");
  ASSERT_OK(s.session().SaveBlocks(save).status());
  v1::RestoreBlocksRequest restore;
  v1::RestoreEntry* r = restore.add_entries();
  r->set_key("prefix");
  r->set_block(5);
  EXPECT_EQ(s.session().RestoreBlocks(restore).status().code(), absl::StatusCode::kUnavailable);
  service->Kill();  // reaps it: it killed itself
  ASSERT_OK(service->Launch());
  v1::RecoverResponse kept = ValueOrDie(s.session().Resume(absl::Seconds(20)));
  EXPECT_THAT(kept.lost_blocks(), ::testing::ElementsAre(5));
  EXPECT_EQ(kept.last_committed_step(), 1u);
  // The saved copies died with the process; a new save and a restore that
  // finishes write the block whole and clear it.
  ASSERT_OK(s.session().SaveBlocks(save).status());
  ASSERT_OK(s.session().RestoreBlocks(restore).status());
  EXPECT_THAT(ValueOrDie(c->Recover()).lost_blocks(), ::testing::IsEmpty());
}

// The commit of step 2 dies after its first layer: its blocks are lost, and
// say so across a second restart too, until a commit writes them again.
TEST(RestartTest, AnInterruptedCommitReportsItsBlocksLostUntilRewritten) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  service->Kill();
  ASSERT_OK(service->Launch({"--test_crash_at=commit:layer:1"}));
  auto c = ValueOrDie(Client::Connect(service->address()));
  Scheduler s(*c);
  ASSERT_OK(s.VerifyAll(2));
  EXPECT_EQ(s.session().Commit(s.Commit(2)).status().code(), absl::StatusCode::kUnavailable);
  service->Kill();  // reaps it: it killed itself
  ASSERT_OK(service->Launch());
  v1::RecoverResponse kept = ValueOrDie(s.session().Resume(absl::Seconds(20)));
  EXPECT_TRUE(kept.interrupted());
  EXPECT_EQ(kept.interrupted_step(), 2u);
  EXPECT_THAT(kept.lost_blocks(), ::testing::ElementsAre(1, 2, 3));  // the rows' checkpoints
  ExpectError(s.session().Commit(s.Commit(2)).status(), absl::StatusCode::kFailedPrecondition,
              "step 2's Commit was interrupted when specstated restarted: 3 blocks are lost");
  // verify-pools lists them; exit status 4.
  absl::StatusOr<ProcessResult> verify = RunProcess(
      {RunfilePath("client/cli/specstatectl"), "--server=" + service->address(), "verify-pools"});
  ASSERT_TRUE(verify.ok());
  EXPECT_EQ(verify->exit_code, 4) << verify->output;
  EXPECT_THAT(verify->output, HasSubstr("INCONSISTENT"));
  EXPECT_THAT(verify->output, HasSubstr("3 blocks are marked lost"));
  EXPECT_THAT(verify->output, HasSubstr("blocks: 1,2,3"));
  // Another restart before any commit: still lost, no longer interrupted.
  service->Kill();
  ASSERT_OK(service->Launch());
  kept = ValueOrDie(ValueOrDie(Client::Connect(service->address()))->Recover());
  EXPECT_FALSE(kept.interrupted());
  EXPECT_THAT(kept.lost_blocks(), ::testing::ElementsAre(1, 2, 3));
  EXPECT_EQ(kept.restarts(), 3u);  // the crash-armed start was the first
  // A finished commit that writes them (after a re-prefill) clears them.
  ValueOrDie(s.session().Resume(absl::Seconds(20)));
  ASSERT_OK(s.VerifyAll(4));
  ASSERT_OK(s.session().Commit(s.Commit(4)).status());
  kept = ValueOrDie(c->Recover(/*verify=*/true));
  EXPECT_THAT(kept.problems(), ::testing::IsEmpty());
  service->Kill();
  ASSERT_OK(service->Launch());
  kept = ValueOrDie(ValueOrDie(Client::Connect(service->address()))->Recover());
  EXPECT_THAT(kept.lost_blocks(), ::testing::IsEmpty());
  EXPECT_EQ(kept.last_committed_step(), 4u);
  verify = RunProcess(
      {RunfilePath("client/cli/specstatectl"), "--server=" + service->address(), "verify-pools"});
  EXPECT_EQ(verify->exit_code, 0) << verify->output;
  EXPECT_THAT(verify->output, HasSubstr("verify       consistent"));
}

// Fresh random inputs for `s`'s steps: q, k, v, g and beta (small bf16
// values, never zero) of the layout's heads.
void RandomActivations(Scheduler& s, const v1::Layout& layout, std::mt19937_64& rng) {
  const size_t tokens = Scheduler::kRows * Scheduler::kTokensPerRow;
  const size_t per_head = layout.head_dim();
  for (int which : {0, 1, 2, 3, 5}) {
    const size_t count = tokens * layout.num_heads() * (which == 5 ? 1 : per_head);
    uint16_t* v = reinterpret_cast<uint16_t*>(s.Act(which));
    for (size_t i = 0; i < count; ++i) v[i] = static_cast<uint16_t>(0x3c00 + rng() % 256);
  }
}

// A step committed before a restart is refused after it, as within one
// instance: a full re-run (Verify of every layer, then Commit) of the step
// Recover reports as last_committed_step gets the in-instance refusal, code
// and message, and writes nothing; the next step goes on.
TEST(RestartTest, TheLastCommittedStepIsRefusedAfterARestartAsWithinOneInstance) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  auto c = ValueOrDie(Client::Connect(service->address()));
  const v1::Layout layout = ValueOrDie(c->GetLayout());
  Scheduler s(*c);
  std::mt19937_64 rng(std::random_device{}());
  RandomActivations(s, layout, rng);
  const uint64_t step = 1 + rng() % 1000;
  std::vector<int> accepted;
  for (int i = 0; i < Scheduler::kRows; ++i) accepted.push_back(1 + rng() % 2);
  const v1::CommitRequest commit = s.Commit(step, accepted);
  ASSERT_OK(s.VerifyAll(step));
  ASSERT_OK(s.session().Commit(commit).status());
  const absl::Status within = s.session().Verify(s.Verify(step, 0)).status();
  ExpectError(within, absl::StatusCode::kFailedPrecondition,
              absl::StrCat("step ", step, " is already committed"));
  const std::string committed = s.Pools();
  service->Kill();
  ASSERT_OK(service->Launch());
  const v1::RecoverResponse kept = ValueOrDie(s.session().Resume(absl::Seconds(20)));
  ASSERT_EQ(kept.last_committed_step(), step);
  // The full re-run: every layer's Verify, then the Commit.
  for (int l = 0; l < layout.num_layers(); ++l) {
    const absl::Status after = s.session().Verify(s.Verify(step, l)).status();
    EXPECT_EQ(after.code(), within.code()) << "layer " << l << ": " << after;
    EXPECT_EQ(std::string(after.message()), std::string(within.message())) << "layer " << l;
  }
  const absl::Status again = s.session().Commit(commit).status();
  ExpectError(again, absl::StatusCode::kFailedPrecondition,
              absl::StrCat("step ", step, " is already committed"));
  EXPECT_TRUE(s.Pools() == committed) << "the re-run wrote the pools";
  v1::RecoverResponse now = ValueOrDie(c->Recover(/*verify=*/true));
  EXPECT_EQ(now.commits(), 1u);
  EXPECT_EQ(now.last_committed_step(), step);
  EXPECT_THAT(now.problems(), ::testing::IsEmpty());
  // The next step id goes on from the kept states.
  ASSERT_OK(s.VerifyAll(step + 1));
  ASSERT_OK(s.session().Commit(s.Commit(step + 1, accepted)).status());
  EXPECT_FALSE(s.Pools() == committed);
  EXPECT_EQ(ValueOrDie(c->Recover()).last_committed_step(), step + 1);
}

// One service per kept allocation: a second specstated given the keeper of
// a live one is refused at start, naming the holder's pid, and exits
// non-zero; the first serves on and its pools are untouched. Once the first
// is dead (SIGKILL: no goodbye), the next one takes the pools over.
TEST(RestartTest, ASecondServiceOnALiveHoldersPoolsIsRefusedAtStart) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  auto c = ValueOrDie(Client::Connect(service->address()));
  Scheduler s(*c);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const std::string committed = s.Pools();
  // `timeout`: without the refusal the second one would serve for good.
  absl::StatusOr<ProcessResult> second = RunProcess(
      {"/usr/bin/timeout", "30", RunfilePath("server/specstated"),
       "--listen=unix://" + service->directory() + "/second.sock",
       "--keeper=" + service->keeper_socket()});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->exit_code, 0) << second->output;
  EXPECT_NE(second->exit_code, 124) << "it served on the live holder's pools:\n" << second->output;
  EXPECT_THAT(second->output, HasSubstr(absl::StrCat("held by pid ", service->pid())));
  EXPECT_THAT(second->output, HasSubstr("one service per kept allocation"));
  EXPECT_THAT(second->output, ::testing::Not(HasSubstr("took over the kept pools")));
  // The first serves on, its pools as it left them, and goes on committing.
  EXPECT_EQ(s.Pools(), committed);
  EXPECT_EQ(ValueOrDie(c->Health()), "SERVING");
  ASSERT_OK(s.VerifyAll(2));
  ASSERT_OK(s.session().Commit(s.Commit(2)).status());
  v1::RecoverResponse live = ValueOrDie(c->Recover(/*verify=*/true));
  EXPECT_EQ(live.last_committed_step(), 2u);
  EXPECT_EQ(live.restarts(), 0u);
  EXPECT_THAT(live.problems(), ::testing::IsEmpty());
  const std::string pools = s.Pools();
  // A dead holder holds nothing: the next specstated takes them over.
  service->Kill();
  ASSERT_OK(service->Launch());
  auto next = ValueOrDie(Client::Connect(service->address()));
  const v1::RecoverResponse kept = ValueOrDie(next->Recover());
  EXPECT_TRUE(kept.kept());
  EXPECT_EQ(kept.restarts(), 1u);
  EXPECT_EQ(kept.last_committed_step(), 2u);
  EXPECT_EQ(s.Pools(), pools);
}

// The scheduler says which lost blocks it re-prefilled (MarkReprefilled):
// Recover and every later restart no longer report them, the others stay
// lost. Bad input is refused naming the entry and the bound, by the driver
// only, and changes nothing.
TEST(RestartTest, ReprefilledBlocksAreNoLongerReportedLostAfterTheNextRestart) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  service->Kill();
  ASSERT_OK(service->Launch({"--test_crash_at=commit:layer:1"}));
  auto c = ValueOrDie(Client::Connect(service->address()));
  const int64_t num_blocks = ValueOrDie(c->GetLayout()).num_blocks();
  Scheduler s(*c);
  ASSERT_OK(s.VerifyAll(2));
  EXPECT_EQ(s.session().Commit(s.Commit(2)).status().code(), absl::StatusCode::kUnavailable);
  service->Kill();
  ASSERT_OK(service->Launch());
  v1::RecoverResponse kept = ValueOrDie(s.session().Resume(absl::Seconds(20)));
  ASSERT_THAT(kept.lost_blocks(), ::testing::ElementsAre(1, 2, 3));
  // A random part of them re-prefilled (the scheduler's own writes), one
  // listed twice.
  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> done, rest;
  const int mask = 1 + rng() % 7;
  for (int b = 1; b <= 3; ++b) ((mask >> (b - 1)) & 1 ? done : rest).push_back(b);
  std::vector<int32_t> told = done;
  told.push_back(done[rng() % done.size()]);
  std::shuffle(told.begin(), told.end(), rng);
  // Bad input first: refused, nothing changes.
  ExpectError(s.session().MarkReprefilled({}).status(), absl::StatusCode::kInvalidArgument,
              "blocks is empty");
  std::vector<int32_t> bad = told;
  const int32_t past = static_cast<int32_t>(num_blocks + rng() % 100);
  bad.push_back(past);
  ExpectError(s.session().MarkReprefilled(bad).status(), absl::StatusCode::kOutOfRange,
              absl::StrCat("blocks[", bad.size() - 1, "] = ", past,
                           " is out of range [1, num_blocks = ", num_blocks, ")"));
  ExpectError(s.session().MarkReprefilled({done[0], 0}).status(), absl::StatusCode::kOutOfRange,
              "blocks[1] = 0 is out of range");
  ExpectError(s.session().MarkReprefilled({-1 - static_cast<int32_t>(rng() % 1000)}).status(),
              absl::StatusCode::kOutOfRange, "blocks[0] = -");
  ExpectError(
      s.session().MarkReprefilled(std::vector<int32_t>(num_blocks + 1, done[0])).status(),
      absl::StatusCode::kInvalidArgument,
      absl::StrCat("blocks has ", num_blocks + 1, " entries: at most num_blocks = ", num_blocks));
  {
    Scheduler reader(*c, /*drive=*/false);
    absl::Status refused = reader.session().MarkReprefilled(done).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  }
  EXPECT_THAT(ValueOrDie(c->Recover()).lost_blocks(), ::testing::ElementsAre(1, 2, 3));
  // The re-prefilled ones are no longer lost, now and after the next restart.
  const v1::MarkReprefilledResponse marked = ValueOrDie(s.session().MarkReprefilled(told));
  EXPECT_THAT(marked.lost_blocks(), ::testing::ElementsAreArray(rest));
  EXPECT_THAT(ValueOrDie(c->Recover()).lost_blocks(), ::testing::ElementsAreArray(rest));
  service->Kill();
  ASSERT_OK(service->Launch());
  kept = ValueOrDie(ValueOrDie(Client::Connect(service->address()))->Recover(/*verify=*/true));
  EXPECT_THAT(kept.lost_blocks(), ::testing::ElementsAreArray(rest));
  EXPECT_FALSE(kept.interrupted());
  EXPECT_EQ(kept.problems().empty(), rest.empty()) << kept.DebugString();
  // The rest too: the bookkeeping is consistent again.
  ValueOrDie(s.session().Resume(absl::Seconds(20)));
  if (!rest.empty()) {
    EXPECT_THAT(ValueOrDie(s.session().MarkReprefilled(rest)).lost_blocks(), ::testing::IsEmpty());
  }
  kept = ValueOrDie(c->Recover(/*verify=*/true));
  EXPECT_THAT(kept.lost_blocks(), ::testing::IsEmpty());
  EXPECT_THAT(kept.problems(), ::testing::IsEmpty());
}

TEST(RestartTest, ALayoutChangeIsRefusedAcrossARestart) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  service->Kill();
  absl::Status refused = service->Launch({"--blocks=128", "--head_dim=128"});
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("they were made for another layout"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("head_dim 64 -> 128"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("num_blocks 64 -> 128"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("--discard_kept_pools"));
  // The old layout still takes them; the new one only when told to discard.
  ASSERT_OK(service->Launch());
  auto c = ValueOrDie(Client::Connect(service->address()));
  absl::StatusOr<v1::RecoverResponse> kept = c->Recover();
  ASSERT_TRUE(kept.ok()) << kept.status() << service->Log();
  EXPECT_TRUE(kept->kept());
  service->Kill();
  ASSERT_OK(service->Launch({"--blocks=128", "--discard_kept_pools"}));
  c = ValueOrDie(Client::Connect(service->address()));
  v1::RecoverResponse fresh = ValueOrDie(c->Recover());
  EXPECT_FALSE(fresh.kept());
  EXPECT_EQ(ValueOrDie(c->GetLayout()).num_blocks(), 128);
  EXPECT_THAT(service->Log(), HasSubstr("discarding the kept pools"));
}

TEST(RestartTest, TheKeepersDeathIsReportedInHealth) {
  std::unique_ptr<OwnService> service = StartOwn();
  ASSERT_NE(service, nullptr);
  auto c = ValueOrDie(Client::Connect(service->address()));
  EXPECT_EQ(ValueOrDie(c->Health()), "SERVING");
  service->KillKeeper();
  std::string health;
  for (int i = 0; i < 100 && health != "NOT_SERVING"; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    health = ValueOrDie(c->Health());
  }
  EXPECT_EQ(health, "NOT_SERVING");
  EXPECT_EQ(ValueOrDie(c->Health("specstate.v1.SpecState")), "NOT_SERVING");
  const v1::Stats stats = ValueOrDie(c->GetStats());
  EXPECT_THAT(stats.health(), HasSubstr("NOT_SERVING: the keeper on " + service->keeper_socket() +
                                        " is gone"));
  EXPECT_THAT(stats.health(), HasSubstr("would not survive a restart"));
  // A new keeper: specstated hands it the pools, and serves again.
  ASSERT_OK(service->LaunchKeeper());
  for (int i = 0; i < 100 && health != "SERVING"; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    health = ValueOrDie(c->Health());
  }
  EXPECT_EQ(health, "SERVING");
  Scheduler s(*c);
  ASSERT_OK(s.VerifyAll(1));
  ASSERT_OK(s.session().Commit(s.Commit(1)).status());
  const std::string pools = s.Pools();
  service->Kill();
  ASSERT_OK(service->Launch());
  EXPECT_TRUE(ValueOrDie(ValueOrDie(Client::Connect(service->address()))->Recover()).kept());
  EXPECT_EQ(s.Pools(), pools);
}

// ---------------------------------------------------------------------------
// systemd's file-descriptor store, with a fake service manager: a datagram
// socket that receives specstated's notifications (and their descriptors),
// and a child started with them as LISTEN_FDS.

struct Notification {
  std::string text;
  std::vector<int> fds;
};

class FakeSystemd {
 public:
  explicit FakeSystemd(const std::string& dir) : path_(dir + "/notify.sock") {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~FakeSystemd() {
    close(fd_);
    unlink(path_.c_str());
    for (auto& [name, fd] : store_) close(fd);
  }
  const std::string& path() const { return path_; }

  // Receives notifications until `text` arrives (or `timeout`), keeping the
  // FDSTORE ones' descriptors by FDNAME, as systemd does.
  bool WaitFor(const std::string& text, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      absl::StatusOr<keeper::FdMessage> m = keeper::ReceiveWithFds(fd_, absl::Milliseconds(100));
      if (!m.ok()) continue;
      texts_.push_back(m->data);
      if (absl::StrContains(m->data, "FDSTORE=1") && m->fds.size() == 1) {
        const size_t at = m->data.find("FDNAME=");
        const std::string name = m->data.substr(at + 7, m->data.find('\n', at) - at - 7);
        if (store_.count(name) != 0) close(store_[name]);
        store_[name] = m->fds[0];
      } else {
        keeper::CloseAll(&m->fds);
      }
      if (absl::StrContains(m->data, text)) return true;
    }
    return false;
  }
  const std::map<std::string, int>& store() const { return store_; }
  const std::vector<std::string>& texts() const { return texts_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, int> store_;
  std::vector<std::string> texts_;
};

// specstated under the fake manager: NOTIFY_SOCKET, and the stored
// descriptors at 3, 4, ... with LISTEN_FDS / LISTEN_PID / LISTEN_FDNAMES.
pid_t StartUnderSystemd(const FakeSystemd& systemd, const std::string& address,
                        const std::string& log) {
  std::vector<std::pair<std::string, int>> stored(systemd.store().begin(), systemd.store().end());
  const std::string specstated = RunfilePath("server/specstated");
  const pid_t pid = fork();
  if (pid == 0) {
    const int out = open(log.c_str(), O_CREAT | O_WRONLY | O_APPEND, 0600);
    dup2(out, 1);
    dup2(out, 2);
    // Move the descriptors out of the way, then to 3, 4, ...
    std::vector<int> high;
    for (auto& [name, fd] : stored) high.push_back(fcntl(fd, F_DUPFD, 100));
    std::string names;
    for (size_t i = 0; i < stored.size(); ++i) {
      dup2(high[i], 3 + static_cast<int>(i));
      names += (i ? ":" : "") + stored[i].first;
    }
    setenv("NOTIFY_SOCKET", systemd.path().c_str(), 1);
    if (!stored.empty()) {
      setenv("LISTEN_FDS", std::to_string(stored.size()).c_str(), 1);
      setenv("LISTEN_PID", std::to_string(getpid()).c_str(), 1);
      setenv("LISTEN_FDNAMES", names.c_str(), 1);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    execl(specstated.c_str(), "specstated", "--backend=cpu", ("--listen=" + address).c_str(),
          nullptr);
    _exit(127);
  }
  return pid;
}

TEST(RestartTest, SystemdsFileDescriptorStoreKeepsThePools) {
  char tmpl[] = "/tmp/sdXXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl, address = "unix://" + dir + "/s.sock", log = dir + "/log";
  FakeSystemd systemd(dir);
  pid_t pid = StartUnderSystemd(systemd, address, log);
  ASSERT_TRUE(systemd.WaitFor("READY=1", absl::Seconds(20)));
  EXPECT_EQ(systemd.store().size(), 2u);
  for (const auto& [name, fd] : systemd.store()) {
    EXPECT_TRUE(absl::StartsWith(name, "specstate-pools.") ||
                absl::StartsWith(name, "specstate-header."))
        << name;
  }
  bool fdpoll = false;
  for (const std::string& t : systemd.texts()) fdpoll |= absl::StrContains(t, "FDPOLL=0");
  EXPECT_TRUE(fdpoll) << "memfds are not pollable: FDPOLL=0";
  std::string pools;
  {
    auto c = ValueOrDie(Client::Connect(address));
    EXPECT_EQ(ValueOrDie(c->Recover()).holder(), "systemd");
    Scheduler s(*c);
    ASSERT_OK(s.VerifyAll(1));
    ASSERT_OK(s.session().Commit(s.Commit(1)).status());
    pools = s.Pools();
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  pid = StartUnderSystemd(systemd, address, log);
  ASSERT_TRUE(systemd.WaitFor("READY=1", absl::Seconds(20)));
  {
    auto c = ValueOrDie(Client::Connect(address));
    const v1::RecoverResponse kept = ValueOrDie(c->Recover());
    EXPECT_TRUE(kept.kept());
    EXPECT_EQ(kept.last_committed_step(), 1u);
    auto memory = ValueOrDie(client::SharedMemory::Create(v1::CPU));
    auto mapped = ValueOrDie(memory->MapPools(ValueOrDie(c->ExportPools())));
    EXPECT_EQ(std::string(mapped->base(), pools.size()), pools);
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(systemd.WaitFor("STOPPING=1", absl::Seconds(1)) ||
              std::find(systemd.texts().begin(), systemd.texts().end(), "STOPPING=1") !=
                  systemd.texts().end());
  unlink(log.c_str());
  unlink((dir + "/s.sock").c_str());
}

// The whole drill as one command, as a user runs it.
TEST(RestartTest, SpecstatectlSimulateRestartEvery) {
  absl::StatusOr<ProcessResult> r = RunProcess(
      {RunfilePath("client/cli/specstatectl"), "simulate", "--restart_every=5", "--steps=25",
       "--specstated=" + RunfilePath("server/specstated"),
       "--keeper_binary=" + RunfilePath("keeper/specstate-keeper")});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->exit_code, 0) << r->output;
  EXPECT_THAT(r->output, HasSubstr("restart drill: "));
  EXPECT_THAT(r->output, HasSubstr("verdict: PASS"));
  EXPECT_THAT(r->output, HasSubstr("restarts of the service"));
  // commit_mode DEFERRED: its own service serves it, with its own kill points.
  r = RunProcess({RunfilePath("client/cli/specstatectl"), "simulate", "--restart_every=3",
                  "--steps=40", "--commit_mode=deferred", "--service_flags=--layers=2 --blocks=64",
                  "--specstated=" + RunfilePath("server/specstated"),
                  "--keeper_binary=" + RunfilePath("keeper/specstate-keeper")});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->exit_code, 0) << r->output;
  EXPECT_THAT(r->output, HasSubstr("commit mode DEFERRED"));
  EXPECT_THAT(r->output, HasSubstr("inside Verify's replay"));
  EXPECT_THAT(r->output, HasSubstr("verdict: PASS"));
  // With --server it refuses: it only restarts a service of its own.
  r = RunProcess({RunfilePath("client/cli/specstatectl"), "--server=unix:///tmp/x.sock", "simulate",
                  "--restart_every=5"});
  EXPECT_EQ(r->exit_code, 2) << r->output;
  EXPECT_THAT(r->output, HasSubstr("leave out --server"));
}

}  // namespace
}  // namespace testing
}  // namespace specstate
