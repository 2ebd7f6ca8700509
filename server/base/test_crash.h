// Tests only: kills specstated with SIGKILL at a chosen point, so the restart
// drills (tests/integration/restart_test.cc) crash it inside a call, as a
// crash or an OOM kill would, at a point they name:
//
//   specstated --test_crash_at=commit:layer:3   # the 3rd time a commit finishes replaying a layer
//
// Points: "verify" (a Verify's work starts on the device's queue),
// "commit:enqueued" (a Commit's kernels are enqueued: on CUDA they then run
// while the process dies; on the CPU the commit is complete and unanswered),
// and on the CPU backend the commit's phases (kernels::CommitJournal's test
// hook): "commit:started" (the journal says started, nothing written yet),
// "commit:conv" (conv windows compacted), "commit:layer" (a layer's states
// replayed), "commit:replayed" (every state written, not yet marked
// committed); DEFERRED adds "commit:deferred" (the pending table updated,
// the replays not run), "verify:replayed" (a Verify stored the first head
// of a row's materialized checkpoint) and "flush:taken" (a Flush took its
// blocks' entries, replayed none); FAST adds "commit:layer" (a Commit's
// rows of one layer advanced and folded) and "flush:taken" (a Flush folded
// its blocks' first layer); "restore:layer" (a RestoreBlocks wrote a
// layer of a block; CPU backend). Unset, every point costs one relaxed
// atomic load.
#ifndef SPECSTATE_SERVER_BASE_TEST_CRASH_H_
#define SPECSTATE_SERVER_BASE_TEST_CRASH_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace specstate {
namespace server {

// "POINT:N" (the N-th time POINT is reached, N >= 1) or "" (never).
// INVALID_ARGUMENT naming the spec otherwise.
absl::Status SetTestCrash(const std::string& spec);

// Dies by SIGKILL if this is the chosen point's chosen time.
void TestCrashPoint(absl::string_view point);

// kernels::CommitJournal::test_hook: TestCrashPoint("commit:" + phase).
void CommitTestHook(const char* phase);

// kernels::PendingBlocks::test_hook and kernels::FoldJournal::test_hook:
// TestCrashPoint(point) ("verify:replayed", "flush:taken"; CPU backend,
// DEFERRED or FAST with kept pools).
void PendingTestHook(const char* point);

// Whether a crash point is set (the journal's hook is installed only then).
bool TestCrashSet();

}  // namespace server
}  // namespace specstate

#endif  // SPECSTATE_SERVER_BASE_TEST_CRASH_H_
